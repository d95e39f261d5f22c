"""Elementwise update rules, each written once.

A rule is what an optimizer does to one element: from the param, its gradient and its
moment-like states to new ones. Each rule here has

* a **schedule** (``scalars``): every step-dependent number (bias corrections, decay, step
  size, schedulers) formed on the host in double, once per param and step -- no device syncs;
* an **elementwise function** on tensors of the compute dtype (fp32, or fp64 for fp64 params),
  with no host syncs and no in-place writes, so that the reference calls it on whole tensors,
  the CPU path compiles it as it is (``kernels.cpu_elementwise``), and its Triton twin
  (``kernels.triton_rules``, one ``@triton.jit`` helper per rule) is held to it by the parity
  tests;
* its **description**: the names of its scalars and flags and its largest number of states,
  which every backend reads (a compiled twin runs a rule only where it declares the same,
  :mod:`leanopt.kernels.twins`);
* the **kinds of its states**: their keys, whether they are signed (a first moment: a signed
  code when stored quantized) and whether they only decay on a zero gradient (then a quantized
  copy is stored with the decay rounding of ``quant.formats``).

Storage is not the rule's business: the same rule runs on fp32 states, on block-quantized ones
(dequantized before, requantized after, by whichever backend runs it) and on FSDP2 shards.

**Safe mode** (the low-bit optimizers): a rule may add *floors* that keep a second moment at
least ``m^2 / K_t`` (:func:`adam_moment_bound`: the largest ratio exact moments can reach), and
the caller skips elements of :func:`skipped_elements` (param kept, states reset to 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

# Slack on the second-moment floor: fp32 rounding of an exact history may put m^2/K a few ulps
# above v (at step 1 the bound is an equality), and the floor must never touch such a state.
MOMENT_BOUND_SLACK = 1e-3


@dataclass(frozen=True)
class StateKind:
    """One state of a rule: its ``key`` in ``optimizer.state[p]``; ``signed``: takes both signs
    (a first moment; stored on a signed code); ``decays``: where the gradient is exactly 0 the
    state only decays (a momentum), and a quantized copy is stored with the decay rounding of
    :meth:`leanopt.quant.formats.BlockFormat.code_indices`, so that it decays as fp32's does in
    expectation instead of sticking on its code or dropping a whole code each step."""

    key: str
    signed: bool
    decays: bool = False


@dataclass(frozen=True)
class Rule:
    """An elementwise rule (see the module docstring), described once for every backend.

    ``scalars``: the names of the step's numbers, in the order every backend receives them;
    ``schedule(hp, step, safe)`` -> ``{name: float}`` forms them on the host (exactly those
    names). ``flags``: the names of the rule's static switches, each a boolean hyper-parameter
    (a new value compiles a new kernel). ``max_states``: the most states the rule keeps under
    any hyper-parameters; ``states(hp)`` the :class:`StateKind` of each under ``hp`` (0 to
    ``max_states`` of them). ``hyperparameters(group)``: the rule's hyper-parameters from a param
    group (always with ``maximize``). ``elementwise(p, g, states, c, flags, safe)`` ->
    ``(p, states)``: the update, with ``c`` and ``flags`` mappings by name and ``g`` already
    negated under ``maximize``.

    Nothing here names a backend: a fast backend runs a rule only where it has a *twin* of it
    that reads the same scalars, flags and number of states (:mod:`leanopt.kernels.twins`);
    :func:`leanopt.kernels.select` sends anything else to a backend that runs ``elementwise``
    itself."""

    name: str
    states: Callable[[Mapping[str, Any]], tuple[StateKind, ...]]
    hyperparameters: Callable[[Mapping[str, Any]], dict[str, Any]]
    scalars: tuple[str, ...]
    schedule: Callable[[Mapping[str, Any], int, bool], Mapping[str, float]]
    elementwise: Callable[..., tuple[Tensor, list[Tensor]]]
    flags: tuple[str, ...] = ()
    max_states: int = 3
    # The signatures (flags, safe mode, number of states, shape, compute dtype) whose results
    # :meth:`check` has held to the rule's declaration: each is checked once per process.
    _checked: set[tuple] = field(default_factory=set, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        for kind, names in (("scalars", self.scalars), ("flags", self.flags)):
            if len(set(names)) != len(names) or not all(isinstance(n, str) and n.isidentifier() for n in names):
                raise ValueError(f"Rule {self.name!r}: {kind} must be distinct identifiers, got {names!r}")
        if not isinstance(self.max_states, int) or self.max_states < 0:
            raise ValueError(f"Rule {self.name!r}: max_states must be an int >= 0, got {self.max_states!r}")

    def flag_values(self, hp: Mapping[str, Any]) -> tuple[bool, ...]:
        """The static switches under ``hp``, in :attr:`flags` order."""
        return tuple(bool(hp[name]) for name in self.flags)

    def scalar_values(self, hp: Mapping[str, Any], step: int, safe: bool) -> tuple[float, ...]:
        """The step's numbers in :attr:`scalars` order (what the compiled backends receive)."""
        try:
            named = self.schedule(hp, step, safe)
        except Exception as err:
            name_rule(err, self, "schedule")
            raise
        if len(named) != len(self.scalars):
            raise ValueError(f"Rule {self.name!r}: schedule gave {sorted(named)}, the rule declares {list(self.scalars)}")
        try:
            return tuple(map(named.__getitem__, self.scalars))  # per param and step: kept cheap
        except KeyError as err:
            raise ValueError(f"Rule {self.name!r}: schedule gave {sorted(named)}, the rule declares "
                             f"{list(self.scalars)} (no {err})") from None  # fmt: skip

    def apply(self, p, g, states, c: Sequence[Any], flags: Sequence[bool], safe: bool):
        """``elementwise`` with the scalars ``c`` (in :attr:`scalars` order: floats or 0-dim
        tensors) and ``flags`` (in :attr:`flags` order) passed by name. An error of
        ``elementwise`` propagates as itself, naming the rule."""
        if torch.compiler.is_compiling():  # traced: an error is the compile's, told apart by kernels.cpu.Graph
            return self.elementwise(p, g, list(states), dict(zip(self.scalars, c)), dict(zip(self.flags, flags)), safe)
        try:
            return self.elementwise(p, g, list(states), dict(zip(self.scalars, c)), dict(zip(self.flags, flags)), safe)
        except Exception as err:
            name_rule(err, self, "elementwise")
            raise

    def check(self, hp: Mapping[str, Any], safe: bool, p: Tensor, n_states: int, step: int) -> None:
        """Refuse, naming the rule, what no backend can run right: more states under ``hp``
        than :attr:`max_states`; ``n_states`` states given where :meth:`states` declares
        another number; an ``elementwise`` that returns another number of states, or a param
        or state not of the param's shape (a backend would drop the extra state, broadcast a
        wrong shape into the param, or hand a Triton twin the wrong number of states). Once
        per signature (flags, ``safe``, number of states, ``p``'s shape and dtype): the
        function runs on meta tensors, which hold no memory and compute nothing."""
        self.check_flags(self.flag_values(hp), hp, safe, p, n_states, step)

    def check_flags(self, flags: tuple, hp: Mapping[str, Any], safe: bool, p: Tensor, n_states: int, step: int) -> None:
        """:meth:`check` with the flags of ``hp`` given (a step checks every param with the
        flags it computed once)."""
        key = (flags, safe, n_states, tuple(p.shape), p.dtype)
        if key in self._checked:
            return
        declared = [kind.key for kind in self.states(hp)]
        if len(declared) > self.max_states:
            raise ValueError(f"Rule {self.name!r}: states() gives {len(declared)} states {declared}, more than its "
                             f"max_states={self.max_states}")  # fmt: skip
        if n_states != len(declared):
            raise ValueError(f"Rule {self.name!r}: {n_states} states given for the {len(declared)} it declares {declared}")
        ct = torch.float64 if p.dtype == torch.float64 else torch.float32
        shape = tuple(p.shape)

        def meta() -> Tensor:
            return torch.empty(shape, dtype=ct, device="meta")

        try:
            result = self.apply(meta(), meta(), [meta() for _ in declared], self.scalar_values(hp, step, safe), flags,
                                safe)  # fmt: skip
        except NotImplementedError:  # an op without a meta kernel: the rule runs unchecked
            self._checked.add(key)
            return
        if not (isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[1], (tuple, list))):
            raise TypeError(f"Rule {self.name!r}: elementwise must return (param, [states]), got {_kind(result)}")
        new_p, new = result
        if len(new) != len(declared):
            raise ValueError(f"Rule {self.name!r}: elementwise returned {len(new)} states for the {len(declared)} the "
                             f"rule declares {declared}")  # fmt: skip
        for what, t in [("param", new_p), *zip((f"state {k!r}" for k in declared), new)]:
            if not isinstance(t, Tensor) or tuple(t.shape) != shape:
                got = f"shape {tuple(t.shape)}" if isinstance(t, Tensor) else _kind(t)
                raise ValueError(f"Rule {self.name!r}: elementwise returned a {what} of {got} for a param of shape "
                                 f"{shape} (each must have the param's shape)")  # fmt: skip
        self._checked.add(key)

    def __repr__(self) -> str:
        return f"Rule({self.name!r})"


def name_rule(err: BaseException, rule: Rule, function: str) -> None:
    """Add to ``err`` (once) which rule's ``function`` raised it: the exception stays itself."""
    note = f"raised by the {function} function of Rule {rule.name!r}"
    if hasattr(err, "add_note"):
        if note not in getattr(err, "__notes__", ()):
            err.add_note(note)
    elif err.args and isinstance(err.args[0], str) and note not in err.args[0]:  # Python 3.10: no notes
        err.args = (f"{err.args[0]} ({note})", *err.args[1:])


def _kind(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def adam_moment_bound(beta1: float, beta2: float, step: int) -> float:
    """``K_t``: the largest ``m_t^2 / v_t`` that Adam's moment estimates can reach at ``step``.

    With ``m_t = (1-b1) sum b1^(t-k) g_k`` and ``v_t = (1-b2) sum b2^(t-k) g_k^2``, Cauchy-Schwarz
    gives ``m_t^2 <= K_t v_t`` with ``K_t = (1-b1)^2/(1-b2) * sum_{j<t} (b1^2/b2)^j`` -- and
    ``K_{t+1} = (b1^2/b2) K_t + (1-b1)^2/(1-b2)``, so one exact step from a state that satisfies
    the bound satisfies the next one. ``inf`` when there is no finite bound (``b2 = 0``, or
    ``b1^2 >= b2`` for long enough to overflow).
    """
    if beta2 == 0.0:
        return math.inf
    base = (1.0 - beta1) ** 2 / (1.0 - beta2)
    r = beta1 * beta1 / beta2
    if r == 1.0:
        return base * step
    try:
        return base * (1.0 - r**step) / (1.0 - r)
    except OverflowError:
        return math.inf


def floor_divisor(beta_m: float, beta2: float, step: int) -> float:
    """The divisor of the second-moment floor ``v >= m^2 / divisor`` (``inf``: no floor)."""
    return adam_moment_bound(beta_m, beta2, step) * (1 + MOMENT_BOUND_SLACK)


def skipped_elements(g: Tensor, new_states: Sequence[Tensor]) -> Tensor:
    """The elements a safe-mode step skips (a bool mask), for every rule and backend (the
    compiled CPU path traces this function; ``triton_rules.skipped_elements`` spells out the
    same test).

    ``g`` is the gradient in the compute dtype, ``new_states`` the updated states. An element is
    skipped where ``g * g`` computed in that dtype is not finite -- ``g`` NaN/Inf, or
    ``|g| >= sqrt(finfo.max)``: from ``2^64 ~ 1.845e19`` in fp32 (fp32, bf16 and fp16 params),
    ``~1.34e154`` in fp64 -- or where a new state is not finite. The square is tested on its
    own: Adam's ``(1 - b2) * g * g`` may be finite for larger ``|g|`` (up to ~5.8e20 with
    ``b2 = 0.999`` in fp32), depending only on the order of the multiplications.
    """
    ok = torch.isfinite(g * g)
    for s in new_states:
        ok = ok & torch.isfinite(s)
    return ~ok


def _betas(group: Mapping[str, Any]) -> tuple[float, ...]:
    return tuple(group["betas"])


def _lr(value: Any) -> float:
    return float(value.item()) if isinstance(value, Tensor) else float(value)


# ---- AdamW ----------------------------------------------------------------------------------
def _adamw_states(hp: Mapping[str, Any]) -> tuple[StateKind, ...]:
    kinds = (StateKind("exp_avg", True, decays=True), StateKind("exp_avg_sq", False))
    return kinds + ((StateKind("max_exp_avg_sq", False),) if hp.get("amsgrad") else ())


def _adamw_hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    beta1, beta2 = _betas(group)
    return dict(lr=_lr(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                amsgrad=bool(group.get("amsgrad", False)), maximize=bool(group["maximize"]))  # fmt: skip


def _adamw_schedule(hp: Mapping[str, Any], step: int, safe: bool) -> dict[str, float]:
    lr, b1, b2 = hp["lr"], hp["beta1"], hp["beta2"]
    return dict(decay=1 - lr * hp["weight_decay"], lerp_weight=1 - b1, beta2=b2, one_minus_beta2=1 - b2, eps=hp["eps"],
                step_size=lr / (1 - b1**step), bc2_sqrt=(1 - b2**step) ** 0.5,
                floor=floor_divisor(b1, b2, step) if safe else math.inf)  # fmt: skip


def lerp(start, end, weight):
    """``torch.lerp(start, end, weight)``, to the bit on every CPU path. torch's CPU kernel
    computes ``fma(coeff, end - start, base)`` (``coeff, base = weight, start`` for
    ``|weight| < 0.5``, else ``weight - 1, end``); Inductor lowers ``torch.lerp`` without the
    FMA, which rounds differently on ~11 % of elements (measured, 1M fp32 elements), so a
    compiled graph spells the FMA out (Inductor's ``fma``: ``std::fma`` / ``fmadd``), as the
    native kernel does."""
    if not torch.compiler.is_compiling():
        return torch.lerp(start, end, weight)
    from torch._inductor import inductor_prims

    if isinstance(weight, torch.Tensor):
        w = weight.to(start.dtype)
        small = w.abs() < 0.5
        return inductor_prims.fma(torch.where(small, w, w - 1), end - start, torch.where(small, start, end))
    small = abs(weight) < 0.5
    return inductor_prims.fma(weight if small else weight - 1, end - start, start if small else end)


def sqrt(x, correctly_rounded: bool = True):
    """``x.sqrt()``, correctly rounded on every CPU path (the default). torch's fp32 CPU
    ``sqrt`` (MKL's VML) is one ulp off the correctly rounded root on ~17 % of inputs
    (measured, 13M fp32 values against the hardware's); Inductor's and the native kernel's are
    correctly rounded, and so is the root taken in fp64 and rounded to fp32, which the eager
    paths take: the reference, the eager CPU path, the compiled graphs and the native kernel
    then agree to the bit, so a step may switch between them (the native kernel builds in the
    background). ``correctly_rounded=False``: torch's own ``sqrt`` (AdamW outside safe mode,
    to the bit torch.optim.AdamW's)."""
    if not correctly_rounded or torch.compiler.is_compiling() or x.dtype != torch.float32:
        return x.sqrt()
    return x.double().sqrt().float()


def adamw_elementwise(p, g, states, c, flags, safe: bool):
    """torch.optim.AdamW's update in its operation order (decoupled decay, ``m.lerp(g, 1-b1)``,
    ``v = b2 v + (1-b2) g g``, ``p - lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)``); flag
    ``amsgrad``. Safe mode floors ``v`` at ``m^2 / K_t``."""
    m, v = states[0], states[1]
    p = p * c["decay"]
    m = lerp(m, g, c["lerp_weight"])
    v = v * c["beta2"] + c["one_minus_beta2"] * g * g
    if safe:
        v = torch.maximum(v, m * m / c["floor"])
    out = [m, v]
    if flags["amsgrad"]:
        v = torch.maximum(states[2], v)
        out.append(v)
    p = p - c["step_size"] * (m / (sqrt(v, correctly_rounded=safe) / c["bc2_sqrt"] + c["eps"]))
    return p, out


ADAMW = Rule(
    "adamw", _adamw_states, _adamw_hyperparameters,
    scalars=("decay", "lerp_weight", "beta2", "one_minus_beta2", "eps", "step_size", "bc2_sqrt", "floor"),
    schedule=_adamw_schedule, elementwise=adamw_elementwise, flags=("amsgrad",), max_states=3,
)  # fmt: skip


# ---- Lion ------------------------------------------------------------------------------------
def _lion_hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    beta1, beta2 = _betas(group)
    return dict(lr=_lr(group["lr"]), beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                maximize=bool(group["maximize"]))  # fmt: skip


def _lion_schedule(hp: Mapping[str, Any], step: int, safe: bool) -> dict[str, float]:
    lr, b1, b2 = hp["lr"], hp["beta1"], hp["beta2"]
    return dict(decay=1 - lr * hp["weight_decay"], beta1=b1, one_minus_beta1=1 - b1, beta2=b2, one_minus_beta2=1 - b2, lr=lr)


def lion_elementwise(p, g, states, c, flags, safe: bool):
    """Lion (Chen et al. 2023): ``p <- p (1 - lr wd) - lr sign(b1 m + (1-b1) g)``, then
    ``m <- b2 m + (1-b2) g``."""
    m = states[0]
    p = p * c["decay"] - c["lr"] * torch.sign(m * c["beta1"] + c["one_minus_beta1"] * g)
    return p, [m * c["beta2"] + c["one_minus_beta2"] * g]


LION = Rule(
    "lion",
    # Nearest rounding, not the decay rounding: with a zero gradient Lion steps by sign(m),
    # which a decaying fp32 momentum keeps, and a momentum rounded down to 0 would stop the
    # param (rounding toward zero measured 3.5x the drift from fp32 on sparse gradients,
    # benchmarks/lowbit_vs_bnb.py).
    lambda hp: (StateKind("exp_avg", True),), _lion_hyperparameters,
    scalars=("decay", "beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "lr"),
    schedule=_lion_schedule, elementwise=lion_elementwise, max_states=1,
)


# ---- AdEMAMix --------------------------------------------------------------------------------
def ademamix_alpha_beta3(hp: Mapping[str, Any], step: int) -> tuple[float, float]:
    """``(alpha_t, beta3_t)``: the paper's warm-up schedulers (linear in alpha over ``t_alpha``
    steps; beta3 so that the slow EMA's half-life grows linearly over ``t_beta3`` steps, from
    beta1's), constant when ``t_alpha``/``t_beta3`` is None."""
    alpha, beta1, beta3 = hp["alpha"], hp["beta1"], hp["beta3"]
    if hp["t_alpha"]:
        alpha = min(step * alpha / hp["t_alpha"], alpha)
    if hp["t_beta3"]:
        ln1, ln3 = math.log(beta1), math.log(beta3)
        scale = step / hp["t_beta3"]
        beta3 = min(math.exp(ln1 * ln3 / ((1 - scale) * ln3 + scale * ln1)), beta3)
    return alpha, beta3


_SLOW_BOUNDS: dict[tuple, list[float]] = {}


def slow_moment_bound(hp: Mapping[str, Any], step: int) -> float:
    """``K_t`` of AdEMAMix's slow EMA against its second moment, with beta3 on its schedule:
    the recurrence of :func:`adam_moment_bound` with that step's beta3 (memoized per schedule)."""
    if not hp["t_beta3"]:
        return adam_moment_bound(hp["beta3"], hp["beta2"], step)
    key = (hp["beta1"], hp["beta2"], hp["beta3"], hp["t_beta3"])
    bounds = _SLOW_BOUNDS.setdefault(key, [0.0])
    b2 = hp["beta2"]
    while len(bounds) <= step:
        t = len(bounds)
        _, b3 = ademamix_alpha_beta3({**hp, "t_alpha": None}, t)
        bounds.append(min(math.inf, (b3 * b3 / b2) * bounds[-1] + (1 - b3) ** 2 / (1 - b2)) if b2 < 1 else math.inf)
    return bounds[step]


def _ademamix_hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    beta1, beta2, beta3 = _betas(group)
    return dict(lr=_lr(group["lr"]), beta1=beta1, beta2=beta2, beta3=beta3, alpha=group["alpha"], eps=group["eps"],
                weight_decay=group["weight_decay"], t_alpha=group["t_alpha"], t_beta3=group["t_beta3"],
                maximize=bool(group["maximize"]))  # fmt: skip


def _ademamix_schedule(hp: Mapping[str, Any], step: int, safe: bool) -> dict[str, float]:
    lr, b1, b2 = hp["lr"], hp["beta1"], hp["beta2"]
    alpha, b3 = ademamix_alpha_beta3(hp, step)
    return dict(decay=1 - lr * hp["weight_decay"], beta1=b1, one_minus_beta1=1 - b1, beta3=b3, one_minus_beta3=1 - b3,
                beta2=b2, one_minus_beta2=1 - b2, bc1=1 - b1**step, alpha=alpha, bc2_sqrt=(1 - b2**step) ** 0.5,
                eps=hp["eps"], lr=lr, floor_fast=floor_divisor(b1, b2, step) if safe else math.inf,
                floor_slow=slow_moment_bound(hp, step) * (1 + MOMENT_BOUND_SLACK) if safe else math.inf)  # fmt: skip


def ademamix_elementwise(p, g, states, c, flags, safe: bool):
    """AdEMAMix (Pagliardini et al. 2024): fast and slow EMAs of ``g`` and one of ``g^2``;
    ``p <- p (1 - lr wd) - lr (m1/bc1 + alpha m2) / (sqrt(nu)/sqrt(bc2) + eps)``. Safe mode
    floors ``nu`` at ``m1^2 / K_t`` and ``m2^2 / K3_t``."""
    m1, m2, nu = states[0], states[1], states[2]
    m1 = m1 * c["beta1"] + c["one_minus_beta1"] * g
    m2 = m2 * c["beta3"] + c["one_minus_beta3"] * g
    nu = nu * c["beta2"] + c["one_minus_beta2"] * g * g
    if safe:
        nu = torch.maximum(torch.maximum(nu, m1 * m1 / c["floor_fast"]), m2 * m2 / c["floor_slow"])
    p = p * c["decay"] - c["lr"] * ((m1 / c["bc1"] + c["alpha"] * m2) / (sqrt(nu) / c["bc2_sqrt"] + c["eps"]))
    return p, [m1, m2, nu]


ADEMAMIX = Rule(
    "ademamix",
    # The slow EMA (beta3 ~ 0.9999) rounds to nearest: it decays by 0.01 % a step, far below a
    # code's spacing, and nearest rounding keeps it where fp32 nearly does.
    lambda hp: (StateKind("exp_avg_fast", True, decays=True), StateKind("exp_avg_slow", True),
                StateKind("exp_avg_sq", False)),  # fmt: skip
    _ademamix_hyperparameters,
    scalars=("decay", "beta1", "one_minus_beta1", "beta3", "one_minus_beta3", "beta2", "one_minus_beta2", "bc1", "alpha",
             "bc2_sqrt", "eps", "lr", "floor_fast", "floor_slow"),
    schedule=_ademamix_schedule, elementwise=ademamix_elementwise, max_states=3,
)  # fmt: skip


# ---- SGD -------------------------------------------------------------------------------------
def _sgd_states(hp: Mapping[str, Any]) -> tuple[StateKind, ...]:
    # The momentum only decays where the gradient (and weight decay) is 0 and the step is
    # proportional to it: the decay rounding, as AdamW's first moment (a nearest-rounded
    # momentum would stick on its code and keep the weight moving without a gradient).
    return (StateKind("momentum_buffer", True, decays=True),) if hp["momentum"] != 0 else ()


def _sgd_hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    return dict(lr=_lr(group["lr"]), momentum=float(group["momentum"]), dampening=float(group["dampening"]),
                weight_decay=float(group["weight_decay"]), nesterov=bool(group["nesterov"]),
                maximize=bool(group["maximize"]))  # fmt: skip


def _sgd_schedule(hp: Mapping[str, Any], step: int, safe: bool) -> dict[str, float]:
    # torch.optim.SGD starts the buffer as a copy of the first update direction: from a zero
    # state, that is the step-1 buffer decay 0 and weight 1 (exact: 0*0 + 1*d = d).
    first = step <= 1
    return dict(weight_decay=hp["weight_decay"], momentum=hp["momentum"], buffer_decay=0.0 if first else hp["momentum"],
                buffer_weight=1.0 if first else 1 - hp["dampening"], lr=hp["lr"])  # fmt: skip


def sgd_elementwise(p, g, states, c, flags, safe: bool):
    """torch.optim.SGD's update in its operation order: ``d = g + wd p``; with a momentum
    ``buf = momentum buf + (1 - dampening) d`` (``buf = d`` at the first step) and
    ``d = d + momentum buf`` (flag ``nesterov``) or ``d = buf``; ``p - lr d``. Without a
    momentum (no state) ``p - lr d``."""
    d = g + c["weight_decay"] * p
    out = []
    if states:
        buf = states[0] * c["buffer_decay"] + c["buffer_weight"] * d
        out.append(buf)
        d = d + c["momentum"] * buf if flags["nesterov"] else buf
    return p - c["lr"] * d, out


SGD = Rule(
    "sgd", _sgd_states, _sgd_hyperparameters,
    scalars=("weight_decay", "momentum", "buffer_decay", "buffer_weight", "lr"),
    schedule=_sgd_schedule, elementwise=sgd_elementwise, flags=("nesterov",), max_states=1,
)  # fmt: skip

# ---- Muon's momentum ---------------------------------------------------------------------------
def _muon_hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    return dict(momentum=float(group["momentum"]), nesterov=bool(group["nesterov"]), maximize=False)


def _muon_schedule(hp: Mapping[str, Any], step: int, safe: bool) -> dict[str, float]:
    return dict(lerp_weight=1 - hp["momentum"], momentum=hp["momentum"])


def muon_momentum_elementwise(p, g, states, c, flags, safe: bool):
    """torch.optim.Muon's momentum in its operation order: ``buf.lerp_(g, 1 - momentum)``, then
    the update ``g.lerp(buf, momentum)`` (flag ``nesterov``) or ``buf``. The "param" this rule
    writes is that update (what Newton-Schulz orthogonalizes next), not a weight: its input
    ``p`` is not read."""
    buf = lerp(states[0], g, c["lerp_weight"])
    return (lerp(g, buf, c["momentum"]) if flags["nesterov"] else buf), [buf]


# Muon's first stage (leanopt.optim.muon): elementwise, so it runs on every backend and storage
# (bf16, block-quantized) the elementwise rules run on; the orthogonalization that follows is
# kernels.newton_schulz. Like SGD's, the buffer only decays where the gradient is 0.
MUON_MOMENTUM = Rule(
    "muon_momentum", lambda hp: (StateKind("momentum_buffer", True, decays=True),), _muon_hyperparameters,
    scalars=("lerp_weight", "momentum"), schedule=_muon_schedule, elementwise=muon_momentum_elementwise,
    flags=("nesterov",), max_states=1,
)  # fmt: skip

# The rules leanopt ships, in the order that numbers them for the compiled twins
# (:func:`rule_id`): one scheme for the Triton helpers and the C++ kernel.
RULES: dict[str, Rule] = {r.name: r for r in (ADAMW, LION, ADEMAMIX, SGD, MUON_MOMENTUM)}


def rule_id(rule: Rule) -> int | None:
    """The number the compiled twins know ``rule`` by: its place in :data:`RULES`; None for a
    rule defined elsewhere (even under a shipped rule's name), which has no twin."""
    return _IDS.get(rule.name) if RULES.get(rule.name) is rule else None


_IDS = {name: i for i, name in enumerate(RULES)}
