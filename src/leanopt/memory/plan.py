"""Will a training run fit, and what is the most precise setup that does?

:func:`plan` predicts the **peak memory of one steady-state training step** for each
configuration — optimizer × precision (with the rounding of pure bf16) × activation
checkpointing × gradient release — by running that step on fake tensors (nothing allocated;
see :mod:`leanopt.memory.plan_trace`)::

    with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16-mixed"):
        loss = model(input_ids=ids, labels=labels).loss      # ids: [batch, seq]
    loss.backward()          # under release_gradients: each param is stepped here
    optimizer.step()         # under release_gradients: a no-op
    optimizer.zero_grad(set_to_none=True)

Labels are the model's natural ones: class ids for a sequence-classification head, the input
ids for a causal / masked / seq2seq LM. Precisions: ``fp32``; ``bf16-mixed`` (fp32 weights,
forward under autocast bf16 — ``Trainer(bf16=True)``); ``bf16`` (the model in bf16, no master
weights, the optimizer built with ``rounding=`` one of ``roundings``: ``kahan`` and
``stochastic`` by default, ``nearest`` on request; optimizers without ``rounding=`` get
``nearest`` rows only).

How the step is put together. The forward/backward and the optimizer step are traced
separately (the first does not depend on the optimizer, the second not on checkpointing) and
combined exactly: in steady state the optimizer's state and whatever it keeps between steps
(a workspace) are live through forward and backward, and the gradients through the step::

    peak = max(peak(forward + backward) + kept by the optimizer,
               peak(optimizer.step, second step, with the gradients) + left after backward)

Under gradient release (``grad_release`` True; leanopt's optimizers) the same forward/backward
trace is counted a second time as if each gradient were freed when its hook runs, noting what
is live at each hook; the step of one param of each shape is traced on its own, and::

    peak = max(peak(forward + backward, gradients freed at their hooks),
               max over params p (live when p's hook runs + what p's step adds)) + kept by the optimizer

``gpus`` > 1: the per-rank peak under FSDP2 (``fully_shard`` on each transformer block and the
root, batch per rank = ``batch``), traced as rank 0 of a fake process group
(:mod:`leanopt.memory.plan_fsdp`); rows get ``gpus`` = N. FSDP2 rows are fp32 / bf16-mixed
without release: ``release_gradients`` and ``rounding="stochastic"|"kahan"`` refuse DTensor params.

``device="cuda"``: the step as one GPU runs it, traced on the same fake CPU tensors (fake CUDA
tensors abort a CPU-only torch build) with what a GPU does differently put in
(:mod:`leanopt.memory.plan_trace`, "CUDA"): the caching allocator's 512-byte blocks, the fused
attention kernel torch picks (no seq x seq matrix saved), CUDA autocast's fp32 ops, leanopt's
Triton kernels (in place) and torch's foreach default. One GPU only (``gpus`` 1).

``offload=True``: rows with ``offload="cpu"`` (:mod:`leanopt.optim.offload`) are added for
leanopt's optimizers in ``fp32`` and pure ``bf16`` (``rounding="nearest"``: the fp32 master on
the host leaves nothing for another rounding; ``bf16-mixed``'s masters are the model's own
params), with and without release. The device keeps weights, gradients and activations: the
optimizer state and the host copies (fp32 masters of bf16 params) are in host memory, counted
in ``host_bytes`` (:meth:`leanopt.optim.offload.Offload.host_bytes`: host copies, states and
host gradient buffers), not in ``peak_bytes``. The device's step is the same trace without
an optimizer on it::

    peak = max(peak(forward + backward), weights + gradients + left after backward)
    released: peak(forward + backward, gradients freed at their hooks)

On the CPU the host *is* the device: an offloaded row's budget is compared with what it needs
plus ``host_bytes``. Offloaded rows rank after every on-device row, so :func:`recommend` picks one
only when nothing on the device fits.

Each row also says what the *process* needs (``process_bytes``, compared with ``budget``): the
step's peak plus, on the CPU, the one-time costs of a first step (measured once in a subprocess,
cached), on CUDA the context, cuBLAS's workspace and the allocator's segments
(:mod:`leanopt.memory.process`). ``accum`` > 1: the step of that many micro-batches, gradients
held across them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from leanopt.memory import process as process_needs
from leanopt.memory.estimate import resolve_optimizer
from leanopt.memory.plan_model import (
    PARAM_DTYPE,
    check_positions,
    load_model,
    orthogonalization_flops,
    param_shapes,
    task_of,
    trainable_params,
)
from leanopt.memory.plan_step import StepPeak, Traces, combine, combine_offloaded, combine_released
from leanopt.memory.plan_trace import KINDS
from leanopt.optim.base import LeanOptimizer

__all__ = [
    "DEFAULT_OPTIMIZERS",
    "DEFAULT_ROUNDINGS",
    "FLOPS_PER_PARAM_TOKEN",
    "KINDS",
    "NewtonSchulzCost",
    "PLAN_PRECISIONS",
    "ROUNDINGS",
    "PlanRequest",
    "PlanRow",
    "Setup",
    "check_request",
    "evaluate",
    "newton_schulz_cost",
    "nothing_fits",
    "parse_bytes",
    "plan",
    "recommend",
    "setups",
    "step_peak",
]

# Ranked by precision kept: what a user gives up first is last. Pure bf16 keeps no fp32 master
# weights; of its roundings Kahan keeps what each rounding lost, stochastic keeps it on average,
# nearest loses updates under half an ulp (see leanopt.optim.rounding).
PLAN_PRECISIONS = ("fp32", "bf16-mixed", "bf16")
ROUNDINGS = ("kahan", "stochastic", "nearest")
DEFAULT_ROUNDINGS = ("kahan", "stochastic")
# Exact fp32 moments, then 8-bit and 4-bit block-quantized moments, then a factored second
# moment without a first moment (a different algorithm, the least information kept).
# Muon (another rule: orthogonalized momentum) after them, its fp32, 8-bit and 4-bit momentum in that order.
_OPTIMIZER_RANK = ("adamw", "torch-adamw", "adamw8bit", "adamw4bit", "adafactor", "hf-adafactor", "torch-adafactor",
                   "muon", "muon8bit", "muon4bit")  # fmt: skip
DEFAULT_OPTIMIZERS = ("adamw", "adamw8bit", "adamw4bit", "adafactor")


# The model's forward and backward FLOPs per token: the usual estimate, 2 per param and token
# forward, 4 backward, over every trainable param (embeddings included; attention's seq^2 terms
# left out).
FLOPS_PER_PARAM_TOKEN = 6


@dataclass(frozen=True)
class NewtonSchulzCost:
    """What one optimizer step spends orthogonalizing (Muon: Newton-Schulz, ``flops``) beside the
    model's forward and backward over the step's ``tokens`` (``model_flops``: 6 x ``params``
    trainable params x ``tokens``, :data:`FLOPS_PER_PARAM_TOKEN`). ``share``: their ratio."""

    flops: int
    model_flops: int
    params: int
    tokens: int

    @property
    def share(self) -> float:
        return self.flops / self.model_flops if self.model_flops else float("inf")

    def as_dict(self) -> dict[str, Any]:
        return {"flops": self.flops, "model_flops": self.model_flops, "share": self.share, "trainable_params": self.params,
                "tokens": self.tokens, "model_flops_estimate": f"{FLOPS_PER_PARAM_TOKEN} x trainable_params x tokens"}  # fmt: skip


@dataclass(frozen=True)
class PlanRow:
    """The predicted peak of one configuration; ``fits`` is None without a budget.

    ``peak_bytes``: the steady-state step's tensors at their highest point (``breakdown``).
    ``process_bytes``: what the process needs, ``peak_bytes`` plus ``one_time`` (CPU: the
    one-time costs of a first step, measured once and cached; CUDA: the context, cuBLAS's
    workspace, the allocator's segment margin; :mod:`leanopt.memory.process`), None where they
    are not known (``process_source`` says why). ``compared``: which of the two ``fits`` was
    decided on (``"process_bytes"``, or ``"peak_bytes"`` where ``process_bytes`` is None).
    On the CPU ``process_bytes`` is for glibc's default allocator, what a user who changes
    nothing runs with: ``one_time["glibc_heap"]`` is what its heap keeps over the live tensors;
    ``process_bytes_pinned`` is the figure without it, for a process that called
    :func:`leanopt.pin_allocator` first (or set ``MALLOC_MMAP_THRESHOLD_=65536``).

    ``newton_schulz``: for an optimizer that orthogonalizes matrices (Muon), the Newton-Schulz
    FLOPs of a step beside the model's forward and backward FLOPs (:class:`NewtonSchulzCost`);
    None (and no ``newton_schulz`` key in :meth:`as_dict`) for the others.

    ``peak_in``: where the step peaks, ``"forward/backward"``, ``"optimizer step"`` (the breakdown
    then has no activations: they were freed; checkpointing does not lower such a peak) or
    ``"backward"`` (gradient release steps each param in it). ``floor_bytes``: what the setup needs at
    any batch and sequence length, a lower bound: the optimizer's step with every gradient (with
    release: the weights, the state and one param's gradient and step), the one-time costs where
    known, an offloaded row's host memory on the CPU. Above the budget, no batch fits."""

    optimizer: str
    precision: str
    checkpointing: bool
    grad_release: bool
    gpus: int
    peak_bytes: int
    fits: bool | None
    breakdown: dict[str, int] = field(default_factory=dict)
    rounding: str | None = None  # pure bf16: the optimizer's rounding=; None for fp32 and bf16-mixed
    process_bytes: int | None = None
    one_time: dict[str, int] = field(default_factory=dict)
    process_source: str = ""
    accum: int = 1
    compared: str | None = None
    offload: bool = False  # offload="cpu": state and host copies in host memory (host_bytes)
    host_bytes: int | None = None  # offloaded rows: host copies, states and host gradient buffers
    process_bytes_pinned: int | None = None  # process_bytes with leanopt.pin_allocator() (no glibc heap margin)
    peak_in: str = ""  # forward/backward, optimizer step, backward (release)
    floor_bytes: int = 0  # needed at any batch and seq (a lower bound)
    newton_schulz: NewtonSchulzCost | None = None  # an optimizer that orthogonalizes matrices (Muon): its FLOPs per step

    def as_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer,
            "precision": self.precision,
            "rounding": self.rounding,
            "checkpointing": self.checkpointing,
            "grad_release": self.grad_release,
            "gpus": self.gpus,
            "accum": self.accum,
            "peak_bytes": self.peak_bytes,
            "process_bytes": self.process_bytes,
            "process_bytes_pinned": self.process_bytes_pinned,
            "fits": self.fits,
            "compared": self.compared,
            "breakdown": dict(self.breakdown),
            "one_time": dict(self.one_time),
            "process_source": self.process_source,
            "offload": self.offload,
            "host_bytes": self.host_bytes,
            "peak_in": self.peak_in,
            "floor_bytes": self.floor_bytes,
            # only for an optimizer that orthogonalizes (Muon): the other rows keep their keys
            **({"newton_schulz": self.newton_schulz.as_dict()} if self.newton_schulz is not None else {}),
        }


# ---- budgets ---------------------------------------------------------------------------------
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip
_BYTES = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str | int) -> int:
    """``"24GiB"`` -> 25769803776, ``"24GB"`` -> 24 * 10**9, ``"500MiB"``, ``"1000"`` (bytes).

    GB/MB are powers of ten, GiB/MiB powers of two. Anything else is a one-line ``ValueError``.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise ValueError(f"budget {text}: must be > 0 bytes")
        return text
    m = _BYTES.match(str(text))
    if m is None or m[2].lower() not in _UNITS:
        raise ValueError(f"budget {text!r}: expected a size such as 24GiB, 24GB, 500MiB or a number of bytes")
    value = int(float(m[1]) * _UNITS[m[2].lower()])
    if value <= 0:
        raise ValueError(f"budget {text!r}: must be > 0 bytes")
    return value


# ---- the request ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanRequest:
    """What :func:`plan` was asked, checked: the model and its task, the batch, and the options
    each setup is crossed from (narrowed to what the model and ``gpus`` allow)."""

    module: torch.nn.Module
    label: str
    task: str
    batch: int
    seq: int
    budget: int | None
    gpus: int
    optimizers: tuple[str, ...]
    leanopt: dict[str, bool]  # optimizer name -> whether it is one of leanopt's (rounding=, release, offload)
    precisions: tuple[str, ...]
    roundings: tuple[str, ...]
    releases: tuple[bool, ...]
    checkpointing: tuple[bool, ...]
    device: str
    accum: int
    process: bool
    offload: bool
    allocator: str


def _whole(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")


def _known(values: Sequence[str], known: Sequence[str], what: str) -> tuple[str, ...]:
    for v in values:
        if v not in known:
            raise ValueError(f"unknown {what} {v!r}; known: {', '.join(known)}")
    return tuple(dict.fromkeys(values))


def check_request(model: str | torch.nn.Module, *, batch: int, seq: int, budget: str | int | None, gpus: int,
                  optimizers: Sequence[str] | None, precisions: Sequence[str] | None, checkpointing: Sequence[bool],
                  grad_release: Sequence[bool], roundings: Sequence[str] | None, device: str, accum: int, process: bool,
                  offload: bool, allocator: str) -> PlanRequest:  # fmt: skip
    """:func:`plan`'s arguments checked (one-line ValueErrors) and narrowed: FSDP2 (``gpus`` > 1)
    and ``accum`` > 1 plan no release rows, FSDP2 no pure bf16, a model without activation
    checkpointing no checkpointing rows."""
    if allocator not in ("pinned", "glibc"):
        raise ValueError(f"allocator must be 'pinned' or 'glibc', got {allocator!r}")
    if not isinstance(offload, bool):
        raise ValueError(f"offload must be True or False, got {offload!r}")  # noqa: TRY004 - one-line ValueErrors
    for name, value in (("batch", batch), ("seq", seq), ("accum", accum), ("gpus", gpus)):
        _whole(name, value)
    device = _device(device)
    if device == "cuda" and gpus > 1:
        raise ValueError("device='cuda' with gpus > 1 is not planned yet (FSDP2 over NCCL): plan one GPU, or --gpus on the CPU")
    budget_bytes = parse_bytes(budget) if budget is not None else None
    names = tuple(n.lower() for n in (optimizers or DEFAULT_OPTIMIZERS))
    lean = {n: issubclass(resolve_optimizer(n), LeanOptimizer) for n in names}  # one-line ValueError for unknown names
    if gpus > 1:
        # An optimizer whose step exchanges matrices between the ranks (Muon) is not traced under FSDP2.
        unplanned = [n for n in names if not getattr(resolve_optimizer(n), "fsdp_planned", True)]
        if unplanned and (optimizers is not None or len(unplanned) == len(names)):
            raise ValueError(f"{', '.join(unplanned)} under FSDP2 (--gpus > 1) is not planned yet: its step sends each matrix "
                             "to one rank and back, which the plan does not trace; plan --gpus 1 for one process's step")  # fmt: skip
        names = tuple(n for n in names if n not in unplanned)
        lean = {n: lean[n] for n in names}
    precs = _known(precisions or PLAN_PRECISIONS, PLAN_PRECISIONS, "precision")
    rounds = _known(roundings or DEFAULT_ROUNDINGS, ROUNDINGS, "rounding")
    releases = tuple(_flags(grad_release, "grad_release"))
    if accum > 1:
        if gpus > 1:
            raise ValueError("accum > 1 is not planned under FSDP2 (--gpus > 1) yet")
        if releases == (True,):
            raise ValueError("accum > 1 with gradient release: release_gradients steps each param inside every backward, "
                             "so gradients cannot accumulate (plan --grad-release off)")  # fmt: skip
        releases = (False,)
    if gpus > 1:
        # release_gradients and rounding="stochastic"|"kahan" refuse DTensor (FSDP2) params.
        if precisions is not None and precs == ("bf16",):
            raise ValueError("pure bf16 is not planned under FSDP2 (--gpus > 1): rounding='stochastic'/'kahan' refuse DTensor params")
        if releases == (True,):
            raise ValueError("gradient release is not planned under FSDP2 (--gpus > 1): release_gradients refuses DTensor params")
        precs, releases = tuple(p for p in precs if p != "bf16"), (False,)
    if offload and gpus > 1:
        raise ValueError("offload is not planned under FSDP2 (--gpus > 1): offload='cpu' refuses DTensor params")
    if offload and not any(lean.values()):
        raise ValueError(f"offload needs a leanopt optimizer (offload='cpu'); none of {', '.join(names)} is one")
    if releases == (True,) and not any(lean.values()):
        raise ValueError(f"gradient release needs a leanopt optimizer; none of {', '.join(names)} is one")
    module, label = load_model(model)
    task = task_of(module)
    check_positions(module, seq)
    ckpts = tuple(bool(c) for c in checkpointing)
    if any(ckpts) and not getattr(module, "supports_gradient_checkpointing", False):
        ckpts = tuple(c for c in ckpts if not c)
    if not ckpts:
        raise ValueError(f"{type(module).__name__} does not support activation checkpointing, and no row without it was asked for")
    if gpus > 1:
        from leanopt.memory.plan_fsdp import check_shardable

        check_shardable(module, gpus)
    return PlanRequest(module, label, task, batch, seq, budget_bytes, gpus, names, lean, precs, rounds, releases, ckpts, device,
                       accum, process, offload, allocator)  # fmt: skip


def _device(device: Any) -> str:
    """``"cpu"`` or ``"cuda"`` (``"cuda:1"``, ``torch.device("cuda")`` too); else a one-line ValueError."""
    kind = str(device).split(":")[0] if isinstance(device, (str, torch.device)) else None
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: plan knows 'cpu' and 'cuda'")
    return kind


def _flags(values: Sequence[bool], what: str) -> list[bool]:
    out = []
    for v in values:
        if not isinstance(v, bool):
            raise ValueError(f"{what} takes True/False values, got {v!r}")  # noqa: TRY004 - one-line ValueErrors
        if v not in out:
            out.append(v)
    if not out:
        raise ValueError(f"{what} is empty")
    return out


# ---- the setups ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    """One row to plan: an optimizer, a precision (with pure bf16's rounding), checkpointing,
    gradient release and offload."""

    optimizer: str
    precision: str
    rounding: str | None  # pure bf16's rounding= (nearest for an optimizer without it); None otherwise
    grad_release: bool
    offload: bool
    checkpointing: bool
    leanopt: bool  # the optimizer is one of leanopt's: rounding= is passed to it

    @property
    def step_rounding(self) -> str | None:
        """The ``rounding=`` the optimizer is built with (None: not passed, torch's optimizers)."""
        return self.rounding if self.leanopt else None


def setups(request: PlanRequest) -> list[Setup]:
    """Every row of ``request``: optimizer x precision (pure bf16: x rounding; leanopt's optimizers
    only, others round to nearest) x gradient release (leanopt's) x checkpointing, and with
    ``offload`` the offloaded rows of leanopt's optimizers in fp32 and pure bf16 (nearest: the
    fp32 master on the host leaves nothing for another rounding)."""
    out: list[Setup] = []
    for precision in request.precisions:
        for name in request.optimizers:
            lean = request.leanopt[name]
            for rounding in request.roundings if precision == "bf16" else [None]:
                if rounding not in (None, "nearest") and not lean:
                    continue  # no rounding= option: its bf16 step is a nearest one
                for release in request.releases:
                    if not release or lean:
                        out.extend(Setup(name, precision, rounding, release, False, c, lean) for c in request.checkpointing)
            if request.offload and lean and precision != "bf16-mixed":
                rounding = "nearest" if precision == "bf16" else None
                for release in request.releases:
                    out.extend(Setup(name, precision, rounding, release, True, c, lean) for c in request.checkpointing)
    if not out:  # pure bf16 only, for optimizers without rounding=, and nearest not asked for
        raise ValueError(f"no configuration to plan: {', '.join(request.optimizers)} take no rounding= (their pure-bf16 steps round "
                         "to nearest: ask for --roundings nearest)")  # fmt: skip
    return out


# ---- one row -------------------------------------------------------------------------------------
def step_peak(request: PlanRequest, setup: Setup, traces: Traces) -> StepPeak:
    """The peak of ``setup``'s step, from ``traces``."""
    fb = traces.forward_backward(setup.precision, setup.checkpointing)
    if setup.offload:
        shapes = param_shapes(request.module, PARAM_DTYPE[setup.precision])
        return combine_offloaded(fb, setup.grad_release, shapes, request.device)
    step, param_steps = traces.step(setup.optimizer, setup.step_rounding, setup.precision, release=setup.grad_release)
    if not setup.grad_release:
        return combine(fb, step)
    assert param_steps is not None  # traced for every released setup
    return combine_released(fb, step, param_steps)


def probe_setting(setup: Setup) -> tuple[str, str, str | None]:
    """What the CPU's one-time cost of ``setup`` is measured for: (precision, optimizer, the rounding it is built with)."""
    return setup.precision, setup.optimizer, setup.rounding if setup.offload else setup.step_rounding


def evaluate(request: PlanRequest, setup: Setup, peak: StepPeak, measured: dict[Any, process_needs.OneTimeCost] | None = None) -> PlanRow:
    """The row of ``setup``: its step's ``peak``, what its process needs besides
    (:func:`leanopt.memory.process.one_time_cost`; ``measured``: the CPU's one-time costs read or
    measured for the plan), and whether that fits the budget."""
    host = None
    if setup.offload:
        host = _host_bytes(request.module, setup.optimizer, setup.precision, setup.grad_release)
        heap: Any = None  # glibc's heap margin is not modelled for offloaded rows
    else:
        heap = "pinned" if request.allocator == "pinned" else {
            "batch": request.batch, "seq": request.seq, "checkpointing": setup.checkpointing,
            "grad_release": setup.grad_release, "accum": request.accum}  # fmt: skip
    cost = None
    if request.process:
        cost = process_needs.one_time_cost(request.module, *probe_setting(setup), device=request.device, sizes=peak.sizes,
                                     gpus=request.gpus, heap=heap, measured=measured)  # fmt: skip
    needed = None if cost is None or cost.bytes is None else peak.bytes + cost.bytes
    fits = compared = None
    if request.budget is not None:
        compared = "peak_bytes" if needed is None else "process_bytes"
        # On the CPU an offloaded row's host memory is the device's.
        shared = host if host is not None and request.device == "cpu" else 0
        fits = (needed if needed is not None else peak.bytes) + shared <= request.budget
    pinned = needed if needed is None or cost is None else needed - cost.parts.get("glibc_heap", 0)
    floor = peak.floor + (needed - peak.bytes if needed is not None else 0) + (host if host is not None and request.device == "cpu" else 0)
    return PlanRow(setup.optimizer, setup.precision, setup.checkpointing, setup.grad_release, request.gpus, peak.bytes, fits,
                   peak.breakdown, setup.rounding, needed, dict(cost.parts) if cost is not None else {},
                   "process=False" if cost is None else cost.source, request.accum, compared, setup.offload, host,
                   process_bytes_pinned=pinned, peak_in=peak.phase, floor_bytes=floor,
                   newton_schulz=newton_schulz_cost(request, setup.optimizer))  # fmt: skip


def newton_schulz_cost(request: PlanRequest, optimizer: str) -> NewtonSchulzCost | None:
    """The Newton-Schulz FLOPs of ``optimizer``'s step over the model beside the model's forward
    and backward over one step's tokens (``batch`` x ``seq`` x ``accum``, one process); None for
    an optimizer that does not orthogonalize."""
    flops = orthogonalization_flops(request.module, optimizer)
    if flops is None:
        return None
    params, tokens = trainable_params(request.module), request.batch * request.seq * request.accum
    return NewtonSchulzCost(flops, FLOPS_PER_PARAM_TOKEN * params * tokens, params, tokens)


def _host_bytes(module: torch.nn.Module, optimizer: str, precision: str, release: bool) -> int:
    """What an offloaded optimizer of ``module``'s trainable params holds in host memory
    (:func:`leanopt.training_memory`, which counts what :class:`~leanopt.optim.offload.Offload` does)."""
    from leanopt.memory.training import training_memory

    return training_memory(module, optimizer, precision=precision, grad_release=release, offload=True).host_bytes


def _rank(row: PlanRow | Setup) -> tuple[bool, int, int, int, bool, bool]:
    opt = _OPTIMIZER_RANK.index(row.optimizer) if row.optimizer in _OPTIMIZER_RANK else len(_OPTIMIZER_RANK)
    rounding = ROUNDINGS.index(row.rounding) if row.rounding in ROUNDINGS else -1
    return (row.offload, PLAN_PRECISIONS.index(row.precision), rounding, opt, row.grad_release, row.checkpointing)


# ---- public --------------------------------------------------------------------------------------
def plan(
    model: str | torch.nn.Module,
    *,
    batch: int,
    seq: int,
    budget: str | int | None = None,
    gpus: int = 1,
    optimizers: Sequence[str] | None = None,
    precisions: Sequence[str] | None = None,
    checkpointing: Sequence[bool] = (False, True),
    grad_release: Sequence[bool] = (False, True),
    roundings: Sequence[str] | None = None,
    device: str = "cpu",
    accum: int = 1,
    process: bool = True,
    offload: bool = False,
    allocator: str = "pinned",
) -> list[PlanRow]:
    """Predicted peak memory of a steady-state training step, per configuration, ranked by precision kept.

    ``model``: a preset, config.json, folder or Hub id (as for ``leanopt estimate``) or a
    transformers model (on any device, ``meta`` included; it is not changed). ``budget``: bytes or
    a size such as ``"24GiB"``; ``fits`` is None without one. Rows are ordered fp32 → bf16-mixed →
    bf16 (Kahan, then stochastic, then nearest rounding), then by how much the optimizer keeps
    (adamw, 8-bit, 4-bit, adafactor), gradient release off before on, checkpointing off before
    on: the first row that fits is :func:`recommend`'s answer.

    ``roundings`` (default ``kahan, stochastic``): the ``rounding=`` of pure-``bf16`` rows, for
    leanopt's optimizers; others get a ``bf16`` row only for ``nearest`` (their only rounding).
    ``grad_release``: rows with :func:`leanopt.release_gradients` (leanopt's optimizers only; one
    process only). Models that do not support activation checkpointing get no checkpointing
    rows. Nothing is allocated.

    ``device``: ``"cpu"`` (default) or ``"cuda"``: the peak of ``torch.cuda.max_memory_allocated``
    for the step on one GPU (see the module docstring; ``gpus`` must be 1).

    ``accum``: micro-batches per optimizer step (gradient accumulation: ``batch`` sequences per
    micro-batch, ``(loss / accum).backward()`` each, then one ``step()``); the peak of such a
    step, gradients held across the micro-batches. Not with gradient release (it steps inside
    each backward) nor under FSDP2 (not planned yet).

    ``process``: give each row ``process_bytes`` (:class:`PlanRow`); on the CPU the first plan of
    a model class, precision and optimizer measures their one-time costs in a subprocess (~10-50 s,
    then cached: :mod:`leanopt.memory.process`; not for FSDP2 ranks, ``gpus`` > 1). False: ``process_bytes`` is None, budgets are
    compared with ``peak_bytes``.

    ``offload``: also the rows of ``offload="cpu"`` (the module docstring): ``peak_bytes`` is the
    device's, ``host_bytes`` what the host holds; ranked after every on-device row.

    ``allocator`` (the CPU's ``process_bytes``): ``"pinned"`` (default) is the figure for a
    training process that calls :func:`leanopt.pin_allocator` first (glibc's mmap threshold fixed
    at 64 KiB: freed large blocks go back to the system), which ``process_source`` says;
    ``"glibc"`` models glibc's default heap for a process that changes nothing, whose dynamic
    threshold keeps freed blocks (:func:`leanopt.memory.process.glibc_heap_margin`: one more
    trace per row, seconds each on a first plan, then cached), and fills ``process_bytes_pinned``
    with the pinned figure beside it.
    """
    request = check_request(model, batch=batch, seq=seq, budget=budget, gpus=gpus, optimizers=optimizers, precisions=precisions,
                            checkpointing=checkpointing, grad_release=grad_release, roundings=roundings, device=device,
                            accum=accum, process=process, offload=offload, allocator=allocator)  # fmt: skip
    wanted = sorted(setups(request), key=_rank)
    traces = Traces(request.module, request.label, request.task, batch=batch, seq=seq, gpus=request.gpus, device=request.device,
                    accum=accum, released=frozenset(s.precision for s in wanted if s.grad_release))  # fmt: skip
    costs = None
    if request.process and request.device == "cpu" and request.gpus == 1:
        # One probe process for every setting not cached (the most precise rows' first), measuring
        # while the traces run here.
        costs = process_needs.OneTimeCosts(request.module, [probe_setting(s) for s in wanted])
    try:
        peaks = [step_peak(request, s, traces) for s in wanted]
    except BaseException:
        if costs is not None:
            costs.cancel()
        raise
    measured = costs.result() if costs is not None else None
    return [evaluate(request, s, peak, measured) for s, peak in zip(wanted, peaks)]


def nothing_fits(rows: Sequence[PlanRow], budget: int, *, batch: int, seq: int, device: str = "cpu") -> str:
    """What to say when no row fits ``budget``: whether a smaller batch or sequence would fit (the
    rows' ``floor_bytes``), and else what would (offload on a GPU, more devices, a smaller model)."""
    smallest = min(rows, key=lambda r: r.floor_bytes)
    what = (f"{smallest.optimizer}, {smallest.precision}{f' {smallest.rounding}' if smallest.rounding else ''}"
            f"{', gradient release' if smallest.grad_release else ''}{', offload' if smallest.offload else ''}")  # fmt: skip
    needs = (f"the smallest setup ({what}) needs {_mib(smallest.floor_bytes)} MiB before any activation (weights, "
             "gradients, optimizer state and step" + (", the process's one-time costs" if smallest.process_bytes is not None else "")
             + (", host memory" if smallest.offload and device == "cpu" else "") + ")")  # fmt: skip
    if smallest.floor_bytes <= budget:
        return (f"nothing fits in {_mib(budget)} MiB at batch {batch}, seq {seq}: lower --batch or --seq (--accum K "
                f"keeps the batch in K micro-batches), or shard over more devices; {needs}")  # fmt: skip
    helps = []
    if device == "cuda" and not any(r.offload for r in rows):
        helps.append("--offload (optimizer state and fp32 masters in host memory)")
    if device == "cpu":
        helps.append("sharding over more devices (FSDP2: weights, gradients and state split N ways; plan it with --gpus N)")
    helps.append("a smaller model")
    return f"nothing fits in {_mib(budget)} MiB at any batch or seq: {needs}; what would: " + ", or ".join(helps)


def _mib(nbytes: int) -> str:
    mib = nbytes / 2**20
    return f"{mib:.1f}" if mib < 10 else f"{mib:,.0f}"


def recommend(rows: Sequence[PlanRow]) -> PlanRow | None:
    """The most precise configuration that fits (rows as :func:`plan` ranks them); None if none does
    or there was no budget."""
    return next((r for r in sorted(rows, key=_rank) if r.fits), None)
