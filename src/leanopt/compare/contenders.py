"""The optimizers a comparison can run: leanopt's and the peers', by name, resolved lazily.

Every contender of one family gets the same hyper-parameters except the learning rate, which
is tuned per optimizer on a grid centred on its usual default (:meth:`Contender.lr_centre`):
the AdamW family torch's defaults (betas (0.9, 0.999), eps 1e-8) and the task's
``weight_decay``; the Adafactor family a fixed step size (``relative_step=False``,
``scale_parameter=False``, no ``beta1``) under the shared warm-up + cosine schedule, plus one
grid point with its own relative step (:data:`RELATIVE`: ``relative_step=True``,
``scale_parameter=True``, no external schedule). Any other optimizer (Lion, AdEMAMix, ...) runs
with only ``lr`` and ``weight_decay`` set, its grid centred on its class's default ``lr``.
leanopt's rows come from its registry (:data:`leanopt.optim.REGISTRY`), a row per registered
optimizer, its hyper-parameters chosen by the rule it declares (``cls.family``); the peers'
are listed by hand.

Training modes: a contender name may carry modes after the optimizer's, joined by ``+``
(``adamw+bf16-kahan``, ``adamw8bit+bf16-stochastic+release``; :data:`MODES`): the precision the
model trains in (``fp32``, ``bf16-mixed``, or pure bf16 without master weights with the
optimizer's ``rounding=`` set: ``bf16-nearest``, ``bf16-stochastic``, ``bf16-kahan``) and
``release`` (``leanopt.release_gradients`` after the optimizer is built). A name without a
precision mode trains in the run's ``--precision`` (:attr:`Plan.precision`, default fp32). The
workload applies a contender's :class:`Mode` (cast the model, autocast, release); nothing else in
the protocol, the verdict or the report depends on it.

Adding an optimizer: registering it (``leanopt.optim.registry.register``) makes it a contender,
in the default list and with every mode: an AdamW- or Adafactor-family one gets that family's
hyper-parameters, any other ``lr`` and ``weight_decay`` (its own defaults for the rest) and an lr
grid centred on its class's default ``lr``. Nothing here names leanopt's optimizers.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch

from leanopt.compare.protocol import MODES, unknown_mode, unknown_optimizer
from leanopt.memory import OPTIMIZER_NAMES, resolve_optimizer
from leanopt.optim.base import LeanOptimizer
from leanopt.optim.lowbit import LowBit
from leanopt.optim.muon_groups import muon_groups_with_decay
from leanopt.optim.registry import REGISTRY

# A grid point: a learning rate, or RELATIVE for Adafactor's own relative step size.
RELATIVE = "relative"
LR = float | str

# The lr each family is usually run with, relative to AdamW's 1e-3 (torch's default): a task
# states the AdamW-family centre and every family's grid is centred on it times this factor.
ADAMW_DEFAULT_LR = 1e-3

# Pure bf16 modes and the optimizer's rounding= each sets.
PURE_BF16 = {"bf16-nearest": "nearest", "bf16-stochastic": "stochastic", "bf16-kahan": "kahan"}


@dataclass(frozen=True)
class Mode:
    """How one contender trains: the precision, the optimizer's rounding, gradient release."""

    precision: str  # "fp32", "bf16-mixed", or "bf16" (pure bf16, no master weights)
    rounding: str | None = None  # for pure bf16: "nearest", "stochastic", "kahan"
    release: bool = False
    state_dtype: str | None = None  # "bfloat16": the optimizer's state_dtype= (None: its default, fp32)

    @property
    def label(self) -> str:
        text = f"bf16 ({self.rounding} rounding)" if self.precision == "bf16" else self.precision
        return text + (f" + {self.state_dtype} states" if self.state_dtype else "") + (" + gradient release" if self.release else "")

    def cast(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model in this mode's parameter dtype (bf16 for pure bf16; as built otherwise)."""
        return model.to(torch.bfloat16) if self.precision == "bf16" else model

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """Forward passes run under this (bf16 autocast for bf16-mixed, nothing otherwise)."""
        if self.precision == "bf16-mixed":
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        """Switch gradient release on after the optimizer is built; the handle (None: no release)."""
        if not self.release:
            return None
        from leanopt.optim.release import release_gradients

        return release_gradients(model, optimizer)


@dataclass(frozen=True)
class Contender:
    name: str
    # Which hyper-parameters it is given: "adamw", "adafactor", or "plain" (lr and weight decay).
    family: str
    origin: str  # "leanopt" or the peer's package
    # "module:attribute" for peers outside leanopt's registry; None: leanopt.memory.OPTIMIZER_NAMES.
    target: str | None = None
    # Why it is left out of a --quick run on the CPU unless named (None: it is not).
    slow_on_cpu: str | None = None
    # Its usual default lr (torch's AdamW 1e-3; HF's recommended fixed-lr Adafactor 1e-3;
    # torch.optim.Adafactor 1e-2, whose lr caps the relative step).
    default_lr: float = ADAMW_DEFAULT_LR
    # Seconds its warm-up spends compiling the update on the CPU (2 cores, measured here, between
    # a warm and a cold compile cache): the prior of the time-left estimate for a set-up not yet
    # seen (a compile takes 10-1000x any other optimizer's set-up).
    cpu_compile_s: float = 0.0
    # A training-mode contender (``adamw+bf16-kahan``): the optimizer's own name, and the modes.
    base: str | None = None
    precision: str | None = None  # "fp32", "bf16-mixed", "bf16"; None: the run's --precision
    rounding: str | None = None  # rounding= for pure bf16 (leanopt optimizers)
    release: bool = False
    state_dtype: str | None = None  # state_dtype= of a leanopt elementwise optimizer ("bfloat16"); None: fp32

    @property
    def optimizer(self) -> str:
        """The optimizer's name without modes (``adamw`` for ``adamw+bf16-kahan``)."""
        return self.base or self.name

    def mode(self, precision: str = "fp32") -> Mode:
        """This contender's training mode when the run's ``--precision`` is ``precision``."""
        return Mode(self.precision or precision, self.rounding, self.release, self.state_dtype)

    def lr_centre(self, task_lr: float) -> float:
        """The centre of this optimizer's lr grid when AdamW's is ``task_lr``."""
        return task_lr * self.default_lr / ADAMW_DEFAULT_LR

    def lr_grid(self, task_lr: float, multipliers: Iterable[float], *, relative: bool = True) -> list[LR]:
        """The lrs tried: the centre times each multiplier, then RELATIVE for the Adafactor family."""
        centre = self.lr_centre(task_lr)
        grid: list[LR] = [float(f"{centre * m:.6g}") for m in multipliers]
        if relative and self.family == "adafactor":
            grid.append(RELATIVE)
        return grid

    def scheduled(self, lr: LR) -> bool:
        """Whether the task's warm-up + cosine schedule drives this lr (not a relative step)."""
        return lr != RELATIVE

    def load(self) -> type:
        """The optimizer class (imports the peer). Raises ``ValueError`` when unavailable."""
        if self.target is None:
            return resolve_optimizer(self.optimizer)
        module, attr = self.target.split(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"{self.target.replace(':', '.')} is not available here ({err})") from None

    def unavailable(self) -> str | None:
        """Why this contender cannot run here, found without importing heavy peers; None if it may."""
        if self.origin == "leanopt":
            try:
                resolve_optimizer(self.optimizer)
            except ValueError as err:
                return str(err)
            return None
        module = (self.target or OPTIMIZER_NAMES.get(self.optimizer, "")).split(":")[0]
        top = module.split(".")[0]
        if top and importlib.util.find_spec(top) is None:
            return f"{top} is not installed"
        return None

    def kwargs(self, *, lr: LR, weight_decay: float, device: torch.device) -> dict[str, Any]:
        kwargs = self._kwargs(lr=lr, weight_decay=weight_decay, device=device)
        if self.rounding is not None and self.origin == "leanopt":
            kwargs["rounding"] = self.rounding
        if self.state_dtype is not None:
            kwargs["state_dtype"] = self.state_dtype  # the dtype's name, which leanopt takes (and JSON holds)
        return kwargs

    def _kwargs(self, *, lr: LR, weight_decay: float, device: torch.device) -> dict[str, Any]:
        if self.family == "adafactor" and lr == RELATIVE:
            return {
                "lr": None,
                "relative_step": True,
                "scale_parameter": True,
                "warmup_init": False,
                "weight_decay": weight_decay,
            }
        if lr == RELATIVE:
            raise ValueError(f"{self.name} has no relative step size")
        if self.family == "adafactor":
            return {
                "lr": lr,
                "relative_step": False,
                "scale_parameter": False,
                "warmup_init": False,
                "weight_decay": weight_decay,
            }
        if self.family == "plain":
            return {"lr": lr, "weight_decay": weight_decay}
        if self.family == "muon":
            # The update scaled to AdamW's RMS (Moonlight's rule, torch's "match_rms_adamw"): one
            # lr serves the matrices and the AdamW-family params beside them, so the grid is AdamW's.
            return {"lr": lr, "weight_decay": weight_decay, "adjust_lr_fn": "match_rms_adamw", "aux_betas": (0.9, 0.999),
                    "aux_eps": 1e-8}  # fmt: skip
        kwargs: dict[str, Any] = {"lr": lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": weight_decay}
        if self.optimizer == "torch-adamw" and device.type in _fused_devices():
            kwargs["fused"] = True
        return kwargs

    def build(self, params: Iterable[Any], *, lr: LR, weight_decay: float, device: torch.device,
              model: torch.nn.Module | None = None) -> torch.optim.Optimizer:  # fmt: skip
        """The optimizer over ``params`` (the decay and no-decay groups); one that splits a model by
        what its modules are (Muon: matrices, and embeddings, head, norms and biases apart) over
        ``model``'s groups instead, matrices decaying and vectors not, as Trainer's rule."""
        kwargs = self.kwargs(lr=lr, weight_decay=weight_decay, device=device)
        if self.family == "muon":
            if model is None:
                raise ValueError(f"{self.name} is built over a model's groups (leanopt.muon_groups): pass model=")
            aux = {"aux_betas": kwargs.pop("aux_betas"), "aux_eps": kwargs.pop("aux_eps")}  # the groups' options
            groups = muon_groups_with_decay(model, weight_decay, **aux)
            return self.load()(groups, **kwargs)
        return self.load()(params, **kwargs)


def _fused_devices() -> list[str]:
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return list(_get_fused_kernels_supported_devices())
    except ImportError:  # older torch: fused AdamW is CUDA-only
        return ["cuda"]


_TORCHAO_COMPILE = (
    "left out of --quick on the CPU: torchao compiles its step for every parameter shape with "
    "torch.compile, which took 20 s (warm compile cache) to 2 minutes (cold) here before the first step; "
    "name it in --optimizers to run it"
)

_QUICK_SIZE = (
    "left out of --quick on the CPU to keep it under 4 minutes (a third Adafactor; the full run has it); "
    "name it in --optimizers to run it"
)

# --quick on the CPU was timed (under 4 minutes) with leanopt's AdamW and Adafactor families;
# the other families' rows run in the full protocol, or in --quick when named.
QUICK_CPU_FAMILIES = ("adamw", "adafactor")

_QUICK_FAMILY = (
    "left out of --quick on the CPU to keep it under 4 minutes (--quick runs leanopt's AdamW and Adafactor "
    "families; the full run has it); name it in --optimizers to run it"
)


def _class_default_lr(cls: type) -> float:
    """The default ``lr`` of an optimizer class (AdamW's 1e-3 when it has none)."""
    try:
        default = inspect.signature(cls).parameters["lr"].default
    except (ValueError, KeyError, TypeError):
        return ADAMW_DEFAULT_LR
    ok = isinstance(default, (int, float)) and not isinstance(default, bool) and default > 0
    return float(default) if ok else ADAMW_DEFAULT_LR


def _leanopt_contender(name: str, cls: type[LeanOptimizer]) -> Contender:
    """The row of a registered leanopt optimizer, from the rule it declares (``cls.family``)."""
    family = cls.family if cls.family in ("adamw", "adafactor", "muon") else "plain"
    # Seconds to compile on the CPU (measured here, warm to cold cache): the quantized path
    # compiles dequantize -> rule -> requantize; a dense rule other than AdamW's (torch's fused
    # kernel) and Adafactor's compiles the rule.
    compile_s = 10.0 if issubclass(cls, LowBit) else 0.0 if family != "plain" else 5.0
    return Contender(
        name,
        family,
        "leanopt",
        slow_on_cpu=None if cls.family in QUICK_CPU_FAMILIES else _QUICK_FAMILY,
        # The families' grids are centred on the task's lr; any other on its class's default
        # (Lion's 1e-4: its sign update wants a 3-10x smaller lr than AdamW's).
        default_lr=ADAMW_DEFAULT_LR if family != "plain" else _class_default_lr(cls),
        cpu_compile_s=compile_s,
    )


CONTENDERS: dict[str, Contender] = {
    **{name: _leanopt_contender(name, cls) for name, cls in REGISTRY.items()},
    **{c.name: c for c in [
        Contender("torch-adamw", "adamw", "torch"),
        Contender("torch-adafactor", "plain", "torch", slow_on_cpu=_QUICK_SIZE, default_lr=1e-2),
        Contender("hf-adafactor", "adafactor", "transformers"),
        Contender("bnb-adamw8bit", "adamw", "bitsandbytes", "bitsandbytes.optim:AdamW8bit"),
        Contender("torchao-adamw8bit", "adamw", "torchao", "torchao.optim:AdamW8bit", _TORCHAO_COMPILE,
                  cpu_compile_s=60.0),
        Contender("torchao-adamw4bit", "adamw", "torchao", "torchao.optim:AdamW4bit", _TORCHAO_COMPILE,
                  cpu_compile_s=60.0),
    ]},
}


def contender(name: str) -> Contender:
    """A contender by name: an optimizer, optionally followed by training modes (:data:`MODES`).

    The optimizer is a name from :data:`CONTENDERS` or any other name in
    ``leanopt.memory.OPTIMIZER_NAMES``; ``+mode`` suffixes (any order) switch modes on, e.g.
    ``adamw8bit+bf16-kahan+release``. The returned contender's name is canonical: the optimizer,
    then its precision mode, then ``release``. Raises ``ValueError`` naming an unknown optimizer or
    mode, or a mode the optimizer cannot run.
    """
    key = name.strip().lower()
    optimizer, *modes = key.split("+")
    base = _optimizer(optimizer.strip())
    return _with_modes(base, [m.strip() for m in modes], name.strip()) if modes else base


def _optimizer(key: str) -> Contender:
    if key in CONTENDERS:
        return CONTENDERS[key]
    if key in OPTIMIZER_NAMES:
        module = OPTIMIZER_NAMES[key].split(":")[0]
        origin = "leanopt" if module == "leanopt" else module.split(".")[0]
        default_lr = _class_default_lr(resolve_optimizer(key)) if origin == "leanopt" else ADAMW_DEFAULT_LR
        return Contender(key, "plain", origin, default_lr=default_lr)
    raise ValueError(unknown_optimizer(key, set(CONTENDERS) | set(OPTIMIZER_NAMES)))


def _with_modes(base: Contender, modes: list[str], given: str) -> Contender:
    precision: str | None = None
    release = bf16_states = False
    for mode in modes:
        if mode not in MODES:
            raise ValueError(unknown_mode(mode, given, base.name))
        if mode == "bf16-states":
            if bf16_states:
                raise ValueError(f"{given!r}: 'bf16-states' is given twice")
            bf16_states = True
        elif mode == "release":
            if release:
                raise ValueError(f"{given!r}: 'release' is given twice")
            release = True
        elif precision is not None:
            raise ValueError(f"{given!r}: one precision mode at most, got {precision!r} and {mode!r}")
        else:
            precision = mode
    rounding = PURE_BF16.get(precision or "")
    if rounding not in (None, "nearest") and base.origin != "leanopt":
        raise ValueError(f"{given!r}: {precision} needs a leanopt optimizer (rounding= is leanopt's option); "
                         f"{base.name} is {base.origin}'s (its bf16 params round to nearest: "
                         f"{base.name}+bf16-nearest)")
    if release and base.origin != "leanopt":
        raise ValueError(f"{given!r}: release needs a leanopt optimizer (release_gradients steps one param at "
                         f"a time); {base.name} is {base.origin}'s")
    if bf16_states:
        _check_bf16_states(base, given)
    canonical = "+".join([base.name] + ([precision] if precision else []) + (["bf16-states"] if bf16_states else [])
                         + (["release"] if release else []))
    return replace(base, name=canonical, base=base.name, precision="bf16" if rounding else precision,
                   rounding=rounding, release=release, state_dtype="bfloat16" if bf16_states else None)


def _check_bf16_states(base: Contender, given: str) -> None:
    """``ValueError`` unless ``base`` is a leanopt optimizer with dense moments that ``state_dtype=`` stores."""
    from leanopt.optim.elementwise import ElementwiseOptimizer

    cls = resolve_optimizer(base.name) if base.origin == "leanopt" else None
    if cls is None or not issubclass(cls, ElementwiseOptimizer):
        whose = f"{base.origin}'s" if cls is None else "not an elementwise optimizer (its states are factored)"
        raise ValueError(f"{given!r}: bf16-states needs a leanopt elementwise optimizer (state_dtype= is its "
                         f"option: adamw, lion, ademamix, sgd, ...); {base.name} is {whose}")
    if issubclass(cls, LowBit):
        raise ValueError(f"{given!r}: bf16-states stores dense moments in bf16; {base.name}'s are already "
                         f"block-quantized (name the dense optimizer of its family: {cls.family}+bf16-states)")


# What runs when --optimizers is not given: every row above (each registered leanopt optimizer,
# then the peers), then any name added to OPTIMIZER_NAMES without a row. Training modes are
# never defaults: name them.
DEFAULT_CONTENDERS: tuple[str, ...] = tuple(CONTENDERS) + tuple(n for n in OPTIMIZER_NAMES if n not in CONTENDERS)


def decay_groups(named_params: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float) -> list[dict[str, Any]]:
    """Matrices decay, vectors (biases, norms) don't: the two groups the HF Trainer makes too."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for _, p in named_params:
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
