"""Muon (orthogonalized momentum) for the whole model: ``Muon``, ``Muon8bit`` and ``Muon4bit``.

A Muon step of a matrix is two stages: the momentum, an elementwise rule
(:data:`leanopt.kernels.rules.MUON_MOMENTUM`), and the orthogonalization of its result by
Newton-Schulz (:mod:`leanopt.kernels.newton_schulz`), followed by decoupled weight decay and
the step. Every param group is stepped by a *rule runner*: an elementwise optimizer built over
one empty meta param (as :func:`leanopt.checkpoint._blank` builds one for its checks), whose
``state_layout``/``update``/``validate_group`` -- the placement seam every leanopt optimizer
gives -- Muon calls with its own groups and states:

* a group with ``use_muon=True`` (the default) runs :class:`MuonMomentum` (fp32 or bf16
  momentum) or its block-quantized sibling (``Muon8bit``, ``Muon4bit``: the storage of
  :class:`~leanopt.optim.lowbit.LowBit`, as ``SGD8bit``'s), on a scratch buffer that receives
  the update direction; Muon then orthogonalizes it and steps the param;
* a group with ``use_muon=False`` is the AdamW-family rule its ``aux`` names (``"adamw"``,
  ``"adamw8bit"``, ``"adamw4bit"``; bf16 states through ``state_dtype``), run by that
  optimizer's own code: embeddings, the output head, norms and biases
  (:func:`leanopt.muon_groups` makes the split from what a model's modules are).

So one optimizer holds the whole model: one ``state_dict``, one LR scheduler, one
``leanopt.estimate``. The group keys follow KellerJordan's ``MuonWithAuxAdam`` (``use_muon``,
and ``lr``/``betas``/``eps``/``weight_decay`` per aux group), so its files load.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch

from leanopt import kernels
from leanopt.kernels import newton_schulz, rules
from leanopt.kernels.newton_schulz import COEFFICIENTS, EPS, NS_STEPS
from leanopt.optim import muon_dist
from leanopt.optim.base import LeanOptimizer, as_float
from leanopt.optim.elementwise import ElementwiseOptimizer
from leanopt.optim.layout import StateSpec
from leanopt.optim.lowbit import STORAGE_OPTIONS, LowBit
from leanopt.optim.muon_dist import LOCAL, MatrixStage, Orthogonalized, check_placement, counted
from leanopt.optim.muon_groups import muon_groups
from leanopt.optim.param_step import ParamStep
from leanopt.optim.registry import optimizer_class, register
from leanopt.optim.rounding import LOW_PRECISION
from leanopt.optim.sharding import is_dtensor, local, shard_offset
from leanopt.optim.validation import check_flag, check_nonnegative
from leanopt.quant.bf16 import state_dtype_name

__all__ = ["AUX_RULES", "Muon", "Muon4bit", "Muon8bit", "MuonMomentum", "Orthogonalized", "adjusted_lr"]

# The rules a ``use_muon=False`` group may run, by registry name.
AUX_RULES = ("adamw", "adamw8bit", "adamw4bit")
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
# Group keys an aux group does not take from its rule runner's defaults: the identity is
# Muon's, and a bf16 param's rounding is the optimizer's choice for every group.
_NOT_FROM_RUNNER = ("optimizer", "rounding")


def _meta_param() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(0, device="meta"))


def adjusted_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """torch.optim.Muon's step size for a ``rows x cols`` matrix: ``lr * sqrt(max(1, rows/cols))``
    ("original", None) or ``lr * 0.2 * sqrt(max(rows, cols))`` ("match_rms_adamw": the RMS of
    AdamW's update, so AdamW's lr and weight decay carry over)."""
    if adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        ratio = math.sqrt(max(1, rows / cols))
    return lr * ratio


def _not_a_matrix(cls: str, label: str, p: torch.Tensor) -> str:
    return (f"{cls}: {label} has shape {tuple(p.shape)}: a Muon group (use_muon=True) takes params of >= 2 dims "
            "(torch.optim.Muon: 2-D only); put norms, biases, embeddings and the output head in a use_muon=False group, "
            "e.g. with leanopt.muon_groups(model)")  # fmt: skip


def check_muon_group(group: Mapping[str, Any]) -> None:
    """``ValueError`` for Muon options no step can run (torch's checks, and those it leaves to the step)."""
    check_nonnegative("lr", group["lr"])
    check_nonnegative("weight_decay", group["weight_decay"])
    coefficients = group["ns_coefficients"]
    if (not isinstance(coefficients, (tuple, list)) or len(coefficients) != 3
            or not all(isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) for c in coefficients)):  # fmt: skip
        raise ValueError(f"Invalid ns_coefficients: {coefficients!r} (Coefficients must be a tuple of exactly 3 values, finite numbers)")
    steps = group["ns_steps"]
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ValueError(f"Invalid ns_steps: {steps!r} (must be an int >= 0)")
    if steps >= 100:
        raise ValueError(f"Invalid ns_steps: {steps} (Number of steps must be less than 100 for computational efficiency)")
    eps = group["eps"]
    check_nonnegative("eps", eps)
    if eps == 0:
        # The update is divided by max(norm, eps): an all-zero update would become 0/0 = NaN.
        raise ValueError("Invalid eps: 0 (must be > 0: an all-zero update is divided by max(its norm, eps))")
    if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise ValueError(f"Adjust learning rate function {group['adjust_lr_fn']} is not supported (choose None, 'original' "
                         "or 'match_rms_adamw')")  # fmt: skip
    check_flag("flatten", group["flatten"])


class _Count:
    """The running count of a step's orthogonalizations (:attr:`Muon.orthogonalized`): the
    first count after a finished step starts the next step's."""

    def __init__(self) -> None:
        self.last = Orthogonalized()
        self.open = False

    def add(self, more: Orthogonalized) -> None:
        self.last = (self.last if self.open else Orthogonalized()) + more
        self.open = True

    def close(self) -> None:
        """The end of ``step()``: a step that orthogonalized nothing counts zero."""
        if not self.open:
            self.last = Orthogonalized()
        self.open = False


class MuonMomentum(ElementwiseOptimizer):
    """Muon's momentum stage as an elementwise optimizer: the buffer's storage (fp32, bf16 through
    ``state_dtype``) and its rule on every backend. Not an optimizer to train with: :class:`Muon`
    holds one over an empty meta param and runs it on the items it passes (``param``: the
    scratch buffer the update direction is written to). It keeps a ``step`` count, which
    torch's Muon does not: the stochastic rounding of bf16 states and the decay rounding of
    quantized ones key their random numbers on it."""

    name = "muon-momentum"
    family = "muon"
    rule = rules.MUON_MOMENTUM

    def __init__(self, params: Iterable[Any], momentum: float = 0.95, nesterov: bool = True, *, backend: str = "auto",
                 state_dtype: torch.dtype | str = torch.float32, offload: str | None = None) -> None:  # fmt: skip
        super().__init__(params, dict(momentum=momentum, nesterov=nesterov), backend=backend, state_dtype=state_dtype,
                         offload=offload)  # fmt: skip

    def validate_group(self, group: Mapping[str, Any], *, loaded: bool = False) -> None:
        check_nonnegative("momentum", group["momentum"])
        check_flag("nesterov", group["nesterov"])


class MuonMomentum8bit(LowBit, MuonMomentum):
    """The momentum on 8-bit codes (``pow3-s8``, SGD8bit's) with one fp32 scale per 256 elements."""

    name = "muon-momentum8bit"
    state_bits = 8
    momentum_buffer_code = "pow3-s8"
    default_block_size = 256


class MuonMomentum4bit(LowBit, MuonMomentum):
    """The momentum on 4-bit codes (``pow2-s4``, AdamW4bit's first moment's) with one fp32 scale per 128 elements."""

    name = "muon-momentum4bit"
    state_bits = 4
    momentum_buffer_code = "pow2-s4"
    default_block_size = 128


@register
class Muon(LeanOptimizer):
    r"""Muon: ``torch.optim.Muon``'s rule, signature, defaults and state, for the whole model.

    .. math::
        \begin{aligned}
        &B_t \leftarrow \mu B_{t-1} + (1-\mu) g_t \quad (\texttt{lerp}), \qquad
          \tilde B_t \leftarrow (1-\mu) g_t + \mu B_t \text{ (nesterov) or } B_t \\
        &O_t \leftarrow \mathrm{NS}^{(a,b,c)}_k(\tilde B_t;\ \varepsilon), \qquad
          \theta_t \leftarrow \theta_{t-1}(1 - \gamma\lambda) - \mathrm{AdjustLR}(\gamma; m, n)\, O_t
        \end{aligned}

    ``NS`` is torch's bf16 Newton-Schulz iteration (:mod:`leanopt.kernels.newton_schulz`);
    ``AdjustLR`` is ``gamma * sqrt(max(1, m/n))`` (``adjust_lr_fn=None``/``"original"``) or
    ``0.2 * gamma * sqrt(max(m, n))`` (``"match_rms_adamw"``) for an ``m x n`` matrix. On the
    reference backend a 2-D fp32 param gets torch.optim.Muon's bits (tests/test_muon.py holds
    it to torch over 100 steps).

    **Param groups.** ``params`` may be a model (``leanopt.Muon(model)``): its groups are then
    :func:`leanopt.muon_groups`'s. A group with ``use_muon=True`` (the default) takes params of >= 2 dims
    (any other floating one is a ``ValueError`` naming it; torch refuses every non-2-D one): a 2-D param is
    one matrix; with ``"flatten": True`` (what :func:`leanopt.muon_groups` sets for conv
    weights) a param is the matrix of its 2-D flattening ``[shape[0], prod(shape[1:])]``, as
    KellerJordan's Muon treats a conv weight; any other param of more than 2 dims is a stack of
    matrices over its leading dims (MoE experts ``[E, rows, cols]``), each orthogonalized on
    its own. A group with ``use_muon=False`` runs the AdamW-family rule its ``aux`` key names
    (default: the constructor's ``aux``) with that rule's own code, keys (``lr``, ``betas``,
    ``eps``, ``weight_decay``, ``amsgrad``, ``maximize``) and state: keys such a group does not
    set take that rule's defaults (AdamW's: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight
    decay 0.01), not Muon's. ``leanopt.muon_groups(model)`` builds both kinds of groups.

    **State.** ``momentum_buffer`` (fp32 for fp32/bf16/fp16 params, fp64 for fp64; bf16 with
    ``state_dtype=torch.bfloat16``) and a ``step`` count torch does not keep: 4 B/param plus
    4 bytes per param. ``torch.optim.Muon`` state_dicts load (their buffers continue; the step
    count they lack starts at 1) and leanopt's load into torch's Muon (it ignores ``step``).
    Aux groups hold their rule's state (AdamW: ``exp_avg``, ``exp_avg_sq``, ``step``).

    **Temporaries.** Params are stepped one at a time: the fp32 update direction of one param
    and the bf16 iterate and Gram matrices of one matrix (:func:`~leanopt.kernels.newton_schulz.temporary_bytes`).
    Under ``torch.distributed`` the exchange holds the step's bf16 directions and results at once.

    Args:
        params: parameters or param groups (see above: ``use_muon``, ``flatten``, ``aux``).
        lr: learning rate (default 1e-3, torch's).
        weight_decay: decoupled weight decay, ``p *= 1 - lr * weight_decay`` (default 0.1).
        momentum: momentum factor (default 0.95).
        nesterov: Nesterov momentum (default True).
        ns_coefficients: ``(a, b, c)`` of the quintic iteration (default (3.4445, -4.775, 2.0315)).
        eps: the floor of the norm the update is divided by (default 1e-7; must be > 0).
        ns_steps: Newton-Schulz iterations (default 5; fewer than 100).
        adjust_lr_fn: ``None``/``"original"`` or ``"match_rms_adamw"`` (see above).
        aux: the rule of ``use_muon=False`` groups that do not name one: ``"adamw"`` (default),
            ``"adamw8bit"`` or ``"adamw4bit"``.
        aux_betas, aux_eps: the ``betas`` and ``eps`` of ``use_muon=False`` groups that do not set
            them (default: the aux rule's own, AdamW's ``(0.9, 0.999)`` and ``1e-8``).
        rounding: how the update is written into a bf16/fp16 param: ``"nearest"`` (default),
            ``"stochastic"`` or ``"kahan"``; see :mod:`leanopt.optim.rounding`.
        backend: the momentum's and the aux rule's backend (``"auto"``, ``"reference"``,
            ``"cpu"``, ``"triton"``); the orthogonalization is the same matrix products on each.
        state_dtype: ``torch.float32`` (default) or ``torch.bfloat16`` for the dense states of
            every group (momentum and aux moments), stochastically rounded.
        offload: ``None`` or ``"cpu"`` (states on the host; see docs/muon.md).
        process_group: under ``torch.distributed``, the ranks each step's matrices are spread
            over (:mod:`leanopt.optim.muon_dist`): ``None`` (default: a DTensor param's mesh, else
            the default group once initialized with more than one rank), a process group, or
            ``"local"`` (each rank orthogonalizes its own matrices: one model per rank).

    **Distributed.** Under DDP and FSDP2 (``Shard(0)`` DTensors on a 1-D mesh) each matrix is
    orthogonalized whole, exactly once per step, by one owner rank, and every rank gets its
    shard (DDP: all) of the result: the params are bit-identical to one process's.
    :attr:`orthogonalized` counts what the last step orthogonalized, on this rank and in total.

    Example:
        >>> import torch, leanopt
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        >>> opt = leanopt.Muon(leanopt.muon_groups(model), lr=0.02)
        >>> model(torch.randn(4, 8)).square().mean().backward()
        >>> opt.step()
        >>> [sorted(opt.state[p]) for p in (model[0].weight, model[0].bias)]
        [['momentum_buffer', 'step'], ['exp_avg', 'exp_avg_sq', 'step']]
    """

    name = "muon"
    fsdp_planned = False  # each matrix goes to its owner rank and back (muon_dist)
    family = "muon"
    references: ClassVar[tuple[str, ...]] = ("torch.optim.Muon",)
    # How the Muon groups' momentum is stored: fp32/bf16 here, block-quantized in the siblings.
    momentum_storage: ClassVar[type[MuonMomentum]] = MuonMomentum

    def __init__(
        self,
        params: Iterable[Any] | torch.nn.Module,
        lr: float | torch.Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = COEFFICIENTS,
        eps: float = EPS,
        ns_steps: int = NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        aux: str = "adamw",
        aux_betas: tuple[float, float] | None = None,
        aux_eps: float | None = None,
        rounding: str = "nearest",
        backend: str = "auto",
        state_dtype: torch.dtype | str = torch.float32,
        offload: str | None = None,
        process_group: Any = None,
    ) -> None:
        # What an aux group that does not set betas or eps takes instead of its rule's defaults
        # (Trainer's adam_beta1/2 and adam_epsilon through optimizer_cls_and_kwargs); never saved:
        # each group holds its own once added.
        self._aux_options = {k: v for k, v in (("betas", aux_betas), ("eps", aux_eps)) if v is not None}
        if process_group is not None and isinstance(process_group, str) and process_group != LOCAL:
            raise ValueError(f"Invalid process_group: {process_group!r} (None, a torch.distributed process group, or {LOCAL!r})")
        # Not a hyper-parameter (never saved): the ranks a step's matrices are spread over.
        self.process_group = process_group
        self._stages: list[MatrixStage] = []
        self._queued = 0  # elements (global) of the stages queued
        self._exchange: Any = None
        self._in_step = False
        self._exchanges = 0  # exchanges run so far, the same on every rank: where owners start
        self._count = _Count()
        if isinstance(params, torch.nn.Module):
            params = muon_groups(params)  # the whole model, split by what its modules are
        coefficients = tuple(ns_coefficients) if isinstance(ns_coefficients, list) else ns_coefficients  # as torch saves them
        hyper: dict[str, Any] = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                     ns_coefficients=coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)  # fmt: skip
        check_muon_group({**hyper, "flatten": False})
        # The block-quantized siblings' storage keywords (block_size, min_quant_size), set by their __init__.
        storage = self.__dict__.pop("_storage_options", {})
        runner = self.momentum_storage([_meta_param()], momentum, nesterov, state_dtype=state_dtype, **storage)
        self._runners: dict[str, ElementwiseOptimizer] = {"muon": runner}
        kept = {k: runner.defaults[k] for k in STORAGE_OPTIONS if k in runner.defaults}
        if aux not in AUX_RULES:
            raise ValueError(f"Invalid aux: {aux!r} (the rule of use_muon=False groups: one of {', '.join(AUX_RULES)})")
        defaults = {**hyper, "use_muon": True, "flatten": False, "aux": aux, "rounding": rounding, **kept}
        super().__init__(params, defaults, backend=backend, offload=offload)

    @classmethod
    def groups_for_model(cls, model: torch.nn.Module) -> Any:
        return muon_groups(model)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for key, make in (("_runners", dict), ("_stages", list), ("_count", _Count)):
            self.__dict__.setdefault(key, make())
        for key, value in (("process_group", None), ("_exchange", None), ("_in_step", False), ("_exchanges", 0), ("_queued", 0)):
            self.__dict__.setdefault(key, value)

    @property
    def orthogonalized(self) -> Orthogonalized:
        """What the last step orthogonalized (Newton-Schulz run): params, elements and matrices on
        this rank, and in total over the ranks of the process group. Under DDP and FSDP2 the
        total is every Muon-group param that had a gradient, each once."""
        return self._count.last

    # ---- the rule runners ------------------------------------------------------------------
    def _runner(self, group: Mapping[str, Any]) -> ElementwiseOptimizer:
        """The runner of ``group``'s rule (built on first use; its backend follows this optimizer's)."""
        kind = "muon" if group.get("use_muon", True) else group.get("aux", self.defaults["aux"])
        runner = self._runners.get(kind)
        if runner is None:
            if kind == "muon":
                storage = {k: self.defaults[k] for k in ("block_size", "min_quant_size") if k in self.defaults}
                runner = self.momentum_storage([_meta_param()], state_dtype=self.defaults["state_dtype"], **storage)
            elif kind in AUX_RULES:
                make: Any = optimizer_class(kind)  # a registered class's constructor takes params alone
                runner = make([_meta_param()], state_dtype=self.defaults["state_dtype"])
            else:
                raise ValueError(f"Invalid aux: {kind!r} (the rule of use_muon=False groups: one of {', '.join(AUX_RULES)})")
            self._runners[kind] = runner
        runner.backend = self.backend
        return runner

    def _aux_defaults(self, group: Mapping[str, Any]) -> dict[str, Any]:
        """What an aux ``group`` takes for the keys it does not set: its rule's defaults."""
        options = {k: v for k, v in self._runner(group).defaults.items() if k not in _NOT_FROM_RUNNER}
        return {**options, **self.__dict__.get("_aux_options", {})}

    def group_defaults(self, group: Mapping[str, Any]) -> dict[str, Any]:
        if group.get("use_muon", self.defaults["use_muon"]):
            return dict(self.defaults)
        return {**self.defaults, **self._aux_defaults({**self.defaults, **group})}

    def storage(self, group: Mapping[str, Any]) -> LeanOptimizer:
        return self._runner(group)

    def state_keys(self, group: Mapping[str, Any]) -> list[str]:
        """The state keys (besides ``step``) of ``group``'s rule: Muon's buffer, or the aux rule's moments."""
        return self._runner(group).state_keys(group)

    # ---- groups ------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if isinstance(param_group, Mapping):
            param_group = dict(param_group)
            gi = len(self.param_groups)
            if "state_dtype" in param_group:
                param_group["state_dtype"] = state_dtype_name(param_group["state_dtype"])
            use_muon = param_group.get("use_muon", self.defaults["use_muon"])
            check_flag("use_muon", use_muon)
            try:
                if not use_muon:
                    for k, v in self._aux_defaults({"use_muon": False, "aux": param_group.get("aux", self.defaults["aux"])}).items():
                        param_group.setdefault(k, v)
                self.validate_group({**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}})
            except ValueError as err:
                raise ValueError(f"{type(self).__name__}: param group {gi}: {err}") from None
            params = param_group.get("params")
            if use_muon and params is not None and not isinstance(params, set):
                param_group["params"] = params = [params] if isinstance(params, torch.Tensor) else list(params)
                for i, item in enumerate(params):
                    self._check_muon_param(item, gi, i)
        super().add_param_group(param_group)

    def _check_muon_param(self, item: Any, gi: int, i: int) -> None:
        name, p = (item[0], item[1]) if isinstance(item, tuple) and len(item) == 2 else (None, item)
        if not isinstance(p, torch.Tensor) or p.is_complex():
            return  # torch, or the complex check, says what is wrong with it
        label = f"param {i}{f' {name!r}' if name else ''} of group {gi}"
        if p.dim() < 2 and p.is_floating_point():  # an integer one is never stepped (_check_grad refuses a gradient)
            raise ValueError(_not_a_matrix(type(self).__name__, label, p))
        if is_dtensor(p):
            check_placement(p, label, type(self).__name__)  # a placement it cannot gather is refused by name

    def _check_grad(self, p: torch.Tensor, gi: int, pi: int) -> None:
        super()._check_grad(p, gi, pi)
        group = self.param_groups[gi]
        if p.grad is not None and p.dim() < 2 and group["use_muon"]:
            raise ValueError(_not_a_matrix(type(self).__name__, f"param {pi} of group {gi}", p))
        if group["use_muon"] and self._exchange is not None and group["rounding"] != "nearest" and p.dtype in LOW_PRECISION:
            raise ValueError(self._not_distributed(f"rounding={group['rounding']!r} of a {p.dtype} param", gi, pi))

    def _not_distributed(self, what: str, gi: int | None = None, pi: int = 0) -> str:
        where = "" if gi is None else f" {self._label(gi, pi)}:"
        return (f"{type(self).__name__}:{where} {what} is not built for Muon's distributed step "
                f"(its update is applied after the ranks' exchange); use rounding='nearest' and offload=None, "
                f"or process_group={LOCAL!r} for one model per rank")  # fmt: skip

    def _label(self, gi: int, pi: int) -> str:
        names = self.param_groups[gi].get("param_names")
        return f"param {pi}{f' {names[pi]!r}' if names else ''} of group {gi}"

    # ---- distributed -------------------------------------------------------------------------
    def _exchange_group(self) -> Any:
        """The process group of this step's matrix stage, or None (see :mod:`leanopt.optim.muon_dist`)."""
        params = [(self._label(gi, pi), p) for gi, g in enumerate(self.param_groups) if g["use_muon"]
                  for pi, p in enumerate(g["params"])]  # fmt: skip
        group = muon_dist.exchange_group(self.process_group, params, type(self).__name__)
        if group is not None and self.offload is not None:
            raise ValueError(self._not_distributed(f"offload={self.offload!r}"))
        return group

    def _check_ranks_agree(self, candidates: list[tuple[int, int, torch.Tensor]]) -> None:
        """Collective, before anything changes: the ranks are about to step the same Muon params,
        and their replicated params and gradients agree (:func:`~leanopt.optim.muon_dist.check_ranks_agree`)."""
        entries = []
        for gi, i, p in candidates:
            group = self.param_groups[gi]
            if group["use_muon"] and p.grad is not None:
                label = self._label(gi, i)
                entries.append((label, p, p.grad, is_dtensor(p) and check_placement(p, label, type(self).__name__)))
        muon_dist.check_ranks_agree(entries, self._exchange, type(self).__name__)

    def _flush(self) -> None:
        """Collective: the queued matrix stages orthogonalized over the ranks and applied."""
        import torch.distributed as dist

        stages, self._stages, self._queued = self._stages, [], 0
        group = self._exchange
        if not stages:  # the ranks agreed on what they step (_check_ranks_agree): none has any
            return
        world = dist.get_world_size(group)
        # The ranks queue the same matrices in the same order and flush together: the same
        # costs and the same exchange count give every rank the same owners.
        costs = [newton_schulz.flops(s.shape, s.steps, s.flatten) + muon_dist.numel(s.shape) for s in stages]
        owner = muon_dist.owners(costs, world, first=self._exchanges % world)
        self._exchanges += 1

        def run(whole: torch.Tensor, s: MatrixStage) -> torch.Tensor:
            return newton_schulz.orthogonalize(whole, s.coefficients, s.steps, s.eps, flatten=s.flatten)

        results, count = muon_dist.orthogonalize_stages(stages, owner, group, run)
        for s, piece in zip(stages, results):
            s.apply(piece)
        self._count.add(count)

    @kernels.eager
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One update of every param that has a gradient (see the class; under
        ``torch.distributed`` the matrix stage is spread over the ranks: collective)."""
        loss = self._closure_loss(closure)
        self._exchange = self._exchange_group()
        if self._exchange is not None:
            self._check_ranks_agree([(gi, i, p) for gi, g in enumerate(self.param_groups) for i, p in enumerate(g["params"])
                                     if self.placement.has_gradient(p)])  # fmt: skip
        self._in_step = True
        self._stages, self._queued = [], 0
        try:
            self.placement.step()
            if self._exchange is not None:
                self._flush()
        finally:
            self._in_step = False
            self._stages, self._queued = [], 0
        self._count.close()
        return loss

    def _step_params(self, gi: int, params: Any, key: str) -> None:
        if self._in_step:
            super()._step_params(gi, params, key)
            return
        # Outside step() (step_param, a released gradient): this call's matrices are exchanged now.
        self._exchange = self._exchange_group()
        if self._exchange is not None:
            self._check_ranks_agree([(gi, i, p) for i, p in params])
        self._stages, self._queued = [], 0
        try:
            super()._step_params(gi, params, key)
            if self._exchange is not None:
                self._flush()
        finally:
            self._stages, self._queued = [], 0

    def _step_rounded(self, gi: int, group: Mapping[str, Any], item: ParamStep, rounding: str, key: str) -> None:
        if group["use_muon"] and self._exchange is not None:
            raise ValueError(self._not_distributed(f"rounding={rounding!r} of a {item.param.dtype} param", gi, item.index[1]))
        super()._step_rounded(gi, group, item, rounding, key)

    def validate_group(self, group: Mapping[str, Any], *, loaded: bool = False) -> None:
        check_flag("use_muon", group["use_muon"])
        if group["aux"] not in AUX_RULES:
            raise ValueError(f"Invalid aux: {group['aux']!r} (the rule of use_muon=False groups: one of {', '.join(AUX_RULES)})")
        if group["use_muon"]:
            check_muon_group(group)
        self._runner(group).validate_group(group, loaded=loaded)

    def _loaded_defaults(self, saved: Mapping[str, Any], group: Mapping[str, Any]) -> dict[str, Any]:
        # A saved group is of the live group's kind: one that does not say (torch.optim.Muon's)
        # is taken as the live group's, and its states must then fit that rule; KellerJordan's
        # aux groups say use_muon=False and take the aux rule's defaults for the keys they lack
        # (amsgrad, maximize).
        use_muon = saved.get("use_muon", group["use_muon"])
        if use_muon != group["use_muon"]:
            raise ValueError(f"the state_dict's group has use_muon={use_muon!r}, this optimizer's use_muon="
                             f"{group['use_muon']!r} (a group is stepped by Muon or by its aux rule, not both)")  # fmt: skip
        defaults = self.group_defaults({"aux": group["aux"], **saved, "use_muon": use_muon})
        return {**{k: v for k, v in defaults.items() if k not in saved}, "use_muon": use_muon}

    def _kept_on_load(self, group: Mapping[str, Any]) -> dict[str, Any]:
        # Storage (the momentum's and the aux rule's, and which aux rule) is this optimizer's:
        # a loaded state is converted to it, as between AdamW and AdamW8bit.
        return {**self._runner(group)._kept_on_load(group), "aux": group["aux"]}

    def _missing_state(self, spec: StateSpec, p: torch.Tensor, saved: Mapping[str, Any]) -> Any:
        # torch.optim.Muon saves its buffer and no step: a buffer means at least one step was taken.
        if spec.key == "step" and "momentum_buffer" in saved:
            return torch.tensor(1.0)
        return self._runner({"use_muon": False, "aux": "adamw"})._missing_state(spec, p, saved)

    # ---- layout and step -------------------------------------------------------------------
    def is_chunkable(self, group: Mapping[str, Any]) -> bool:
        # Newton-Schulz reads a whole matrix; the aux rules are elementwise.
        return not group["use_muon"] and self._runner(group).is_chunkable(group)

    def state_layout(self, shape: tuple[int, ...], dtype: torch.dtype, group: Mapping[str, Any]) -> list[StateSpec]:
        return self._runner(group).state_layout(shape, dtype, group)

    def _momentum(self, runner: ElementwiseOptimizer, gi: int, group: Mapping[str, Any], it: ParamStep, key: str) -> torch.Tensor:
        """The momentum step of ``it``: its buffer updated, the update direction returned.

        The rule (:data:`~leanopt.kernels.rules.MUON_MOMENTUM`) runs through the runner, on the
        reference backend and for bf16 or quantized buffers, into a scratch buffer it writes the
        direction to (zeros in safe mode: a skipped element contributes none). Where the buffer is
        a plain tensor of the compute dtype, the other backends take torch.optim.Muon's own two
        ops in place: the rule's arithmetic (``torch.lerp`` is the rule's ``lerp`` eagerly) without
        the scratch, its copies and a compiled call per param; tests/test_muon.py holds both to
        torch.optim.Muon's bits."""
        # A DTensor (FSDP2) param's momentum runs on its local shard, as an elementwise rule does.
        p, buf, grad = local(it.param), it.state.get("momentum_buffer"), local(it.grad)
        buf = local(buf) if is_dtensor(buf) else buf
        compute = torch.float64 if p.dtype == torch.float64 else torch.float32
        plain = (self.backend != "reference" and not runner.safe and type(buf) is torch.Tensor and buf.dtype == compute
                 and grad.dtype == compute and buf.shape == grad.shape)  # fmt: skip
        if plain:
            assert isinstance(buf, torch.Tensor)
            momentum = float(group["momentum"])
            buf.lerp_(grad, 1 - momentum)
            return torch.lerp(grad, buf, momentum) if group["nesterov"] else buf
        make = torch.zeros if runner.safe else torch.empty
        direction = make(p.shape, dtype=compute, device=p.device)
        # The scratch is a plain tensor: the shard's offset keys the decay rounding's dither.
        runner.update(gi, group, [dataclasses.replace(it, param=direction, offset=it.offset + shard_offset(it.param))],
                      f"{key}/momentum")  # fmt: skip
        return direction

    def update(self, gi: int, group: Mapping[str, Any], items: list[ParamStep], key: str) -> None:
        runner = self._runner(group)
        if not group["use_muon"]:
            runner.update(gi, group, items, key)
            return
        lr, decay = as_float(group["lr"]), group["weight_decay"]
        if self._exchange is not None:  # the matrix stage runs in the ranks' exchange (_flush)
            for it in items:
                direction = self._momentum(runner, gi, group, it, key).to(torch.bfloat16)  # Newton-Schulz's first cast
                label = self._label(gi, it.index[1])
                sharded = is_dtensor(it.param) and check_placement(it.param, label, type(self).__name__)
                _, rows, cols = newton_schulz.matrices(it.param.shape, group["flatten"])
                self._stages.append(MatrixStage(
                    it.param, direction, it.index, label, tuple(it.param.shape), sharded, group["flatten"],
                    tuple(group["ns_coefficients"]), group["ns_steps"], group["eps"], 1 - lr * decay,
                    adjusted_lr(lr, group["adjust_lr_fn"], rows, cols)))  # fmt: skip
                self._queued += muon_dist.numel(it.param.shape)
                if self._queued >= muon_dist.BUCKET_ELEMENTS:
                    self._flush()  # a bucket's worth: what the step holds at once stays bounded
            return
        for it in items:  # one param's direction and one matrix's iteration at a time
            p = it.param
            direction = self._momentum(runner, gi, group, it, key)
            # Offloaded, the momentum runs on the host and the orthogonalization on the params'
            # device: the direction goes there as the bf16 it is cast to first, and comes back.
            device = self.placement.matrix_device(p)
            if device != direction.device:
                direction = direction.to(device=device, dtype=torch.bfloat16)
            ortho = newton_schulz.orthogonalize(direction, group["ns_coefficients"], group["ns_steps"], group["eps"],
                                                flatten=group["flatten"]).to(p.device)  # fmt: skip
            del direction
            _, rows, cols = newton_schulz.matrices(p.shape, group["flatten"])
            p.mul_(1 - lr * decay)
            p.add_(ortho, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], rows, cols))
            params, elements, matrices = counted(p.shape, group["flatten"])
            self._count.add(Orthogonalized(params, elements, matrices, params, elements, matrices))


_LOWBIT_DOC = """Muon with a {bits}-bit block-quantized momentum.

    ``leanopt.Muon``'s rule with the ``use_muon`` groups' ``momentum_buffer`` stored as
    {bits}-bit codes (``{code}``, signed) with one fp32 scale per ``block_size`` elements
    (default {block}): {bpp} B/param plus a 4-byte ``step`` per param (fp32 Muon: 4). Each step
    dequantizes the buffer, runs the momentum in fp32, requantizes it (where the gradient is
    exactly 0 with the decay rounding, so a buffer decays as fp32's does in expectation), then
    orthogonalizes the fp32 update direction as ``Muon`` does. Safe mode: a gradient element
    that is NaN/Inf contributes 0 to the direction and resets its buffer element. Params with
    fewer than ``min_quant_size`` elements (default 4096), and groups with ``"quantize": False``,
    keep an fp32 buffer. Aux groups keep their own rule's storage (``aux="adamw8bit"`` for 8-bit
    moments there too). Checkpoints convert between Muon, Muon8bit and Muon4bit on load.
    docs/quantized.md has the measured distance from fp32 Muon.

    Args: as :class:`leanopt.Muon`, plus ``block_size`` and ``min_quant_size``.
"""


class _LowBitMuon(Muon):
    """A Muon whose momentum storage is block-quantized (the class declares its bits and block)."""

    state_bits: ClassVar[int]
    default_block_size: ClassVar[int]

    def __init__(
        self,
        params: Iterable[Any] | torch.nn.Module,
        lr: float | torch.Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = COEFFICIENTS,
        eps: float = EPS,
        ns_steps: int = NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        aux: str = "adamw",
        aux_betas: tuple[float, float] | None = None,
        aux_eps: float | None = None,
        block_size: int | None = None,
        min_quant_size: int = 4096,
        rounding: str = "nearest",
        backend: str = "auto",
        state_dtype: torch.dtype | str = torch.float32,
        offload: str | None = None,
        process_group: Any = None,
    ) -> None:
        self._storage_options = dict(block_size=block_size, min_quant_size=min_quant_size)
        super().__init__(params, lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn, aux=aux,
                         aux_betas=aux_betas, aux_eps=aux_eps, rounding=rounding, backend=backend, state_dtype=state_dtype,
                         offload=offload,
                         process_group=process_group)  # fmt: skip


@register
class Muon8bit(_LowBitMuon):
    name = "muon8bit"
    momentum_storage = MuonMomentum8bit
    state_bits = 8
    default_block_size = 256


@register
class Muon4bit(_LowBitMuon):
    name = "muon4bit"
    momentum_storage = MuonMomentum4bit
    state_bits = 4
    default_block_size = 128


Muon8bit.__doc__ = _LOWBIT_DOC.format(bits=8, code="pow3-s8", block=256, bpp="1.016")
Muon4bit.__doc__ = _LOWBIT_DOC.format(bits=4, code="pow2-s4", block=128, bpp="0.531")
