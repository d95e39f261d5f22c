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

import contextlib
import functools
import inspect
import math
import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from leanopt.memory.cuda_emulation import cuda_block_bytes
from leanopt.memory.estimate import (
    resolve_optimizer,
    unique_params,
)
from leanopt.memory.plan_trace import (
    KINDS,
    LiveStorage,
    ParamSteps,
    Peak,
    rounded_step_peak,
    swapped_copy,
    traced_batch,
    traced_forward_backward,
    traced_kernels,
    traced_param_steps,
    traced_steps,
    track_module,
)
from leanopt.optim.base import LeanOptimizer
from leanopt.optim.rounding import LOW_PRECISION

__all__ = [
    "DEFAULT_OPTIMIZERS",
    "DEFAULT_ROUNDINGS",
    "PLAN_PRECISIONS",
    "ROUNDINGS",
    "PlanRow",
    "parse_bytes",
    "plan",
    "recommend",
]

# Ranked by precision kept: what a user gives up first is last. Pure bf16 keeps no fp32 master
# weights; of its roundings Kahan keeps what each rounding lost, stochastic keeps it on average,
# nearest loses updates under half an ulp (see leanopt.optim.rounding).
PLAN_PRECISIONS = ("fp32", "bf16-mixed", "bf16")
ROUNDINGS = ("kahan", "stochastic", "nearest")
DEFAULT_ROUNDINGS = ("kahan", "stochastic")
_PARAM_DTYPE = {"fp32": torch.float32, "bf16-mixed": torch.float32, "bf16": torch.bfloat16}
# Exact fp32 moments, then 8-bit and 4-bit block-quantized moments, then a factored second
# moment without a first moment (a different algorithm, the least information kept).
_OPTIMIZER_RANK = ("adamw", "torch-adamw", "adamw8bit", "adamw4bit", "adafactor", "hf-adafactor", "torch-adafactor")
DEFAULT_OPTIMIZERS = ("adamw", "adamw8bit", "adamw4bit", "adafactor")


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
    :func:`leanopt.pin_allocator` first (or set ``MALLOC_MMAP_THRESHOLD_=65536``)."""

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


# ---- the model -------------------------------------------------------------------------------
def _model(spec: Any) -> tuple[torch.nn.Module, str]:
    if isinstance(spec, torch.nn.Module):
        return spec, type(spec).__name__
    if not isinstance(spec, str):
        raise ValueError(f"expected a model name, config path or torch.nn.Module, got {type(spec).__name__}")
    from leanopt.memory.presets import resolve_model

    source = resolve_model(spec)  # one-line ValueError for unknown names and architectures
    if not source.exact_shapes:
        raise ValueError(f"{spec!r} is a bare parameter count: a plan needs the model (a preset, config.json or Hub id)")
    return source.params, source.name


def _task(model: torch.nn.Module) -> str:
    """``"classification"`` or ``"lm"`` (labels = input ids); ValueError for anything else."""
    name = type(model).__name__
    if name.endswith("ForSequenceClassification"):
        return "classification"
    if name.endswith(("ForCausalLM", "LMHeadModel", "ForMaskedLM", "ForConditionalGeneration")):
        return "lm"
    raise ValueError(
        f"cannot trace a training step of {name}: no head with a loss (plan takes models for sequence "
        "classification, causal, masked or seq2seq LM)"
    )


def _vocab_size(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if vocab is None and config is not None and hasattr(config, "get_text_config"):
        vocab = getattr(config.get_text_config(), "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"cannot trace {type(model).__name__}: its config has no vocab_size for the input ids")
    return vocab


def _num_labels(model: torch.nn.Module) -> int:
    return int(getattr(getattr(model, "config", None), "num_labels", 2) or 2)


def _check_positions(model: torch.nn.Module, seq: int) -> None:
    """A model with learned position embeddings takes no sequence longer than its table (fake
    tensors would not notice the out-of-range lookup that fails a real step)."""
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not isinstance(positions, int) or seq <= positions:
        return
    if any(isinstance(m, torch.nn.Embedding) and m.num_embeddings == positions for m in model.modules()):
        raise ValueError(f"cannot trace {type(model).__name__} at seq {seq}: it has learned positions for {positions} tokens")


def _fake_copy(model: torch.nn.Module, fake_mode: Any, dtype: torch.dtype) -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
    """A copy of ``model`` with every parameter and buffer a fake CPU tensor (floating ones of
    ``dtype``), tied weights kept tied, and its unique trainable parameters. ``model`` is not
    touched (another thread may be training it)."""
    trainable: list[torch.nn.Parameter] = []

    def fake(t: torch.Tensor) -> torch.Tensor:
        with fake_mode:
            data = torch.empty(tuple(t.shape), dtype=dtype if t.is_floating_point() else t.dtype, device="cpu")
            if not isinstance(t, torch.nn.Parameter):
                return data
            new = torch.nn.Parameter(data, requires_grad=t.requires_grad)
        if t.requires_grad:
            trainable.append(new)
        return new

    return swapped_copy(model, fake), trainable


@contextlib.contextmanager
def _checkpointing(model: torch.nn.Module, on: bool) -> Iterator[None]:
    if not on:
        yield
        return
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support activation checkpointing")
    enable = getattr(model, "activation_checkpointing_enable", None) or getattr(model, "gradient_checkpointing_enable", None)
    disable = getattr(model, "activation_checkpointing_disable", None) or getattr(model, "gradient_checkpointing_disable", None)
    if not callable(enable) or not callable(disable):
        raise ValueError(
            f"{type(model).__name__} says it supports activation checkpointing but has no callable "
            "gradient_checkpointing_enable/_disable (or activation_checkpointing_enable/_disable)"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        enable()
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            disable()


def _fake_mode() -> Any:
    from torch._subclasses import FakeTensorMode

    # Real constants a model makes on the fly (torch.tensor(0.5)) become fake; nothing else is real.
    return FakeTensorMode(allow_non_fake_inputs=True)


def _one_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


@dataclass
class _ForwardBackward:
    peak: Peak
    left: dict[str, int]  # live after backward, other than weights and gradients (loss, inputs)
    # Under gradient release: the peak with each gradient freed at its hook, and (param index,
    # what was live) at each hook. None where not traced (FSDP2).
    released: Peak | None = None
    hooks: list[tuple[int, Peak]] = field(default_factory=list)
    shapes: list[tuple[tuple[int, ...], torch.dtype]] = field(default_factory=list)  # of the params, by index


@dataclass
class _Step:
    peak: Peak
    kept: dict[str, int]  # live after step + zero_grad, other than weights (state, workspaces)


def _trace_forward_backward(
    model: torch.nn.Module, task: str, batch: int, seq: int, precision: str, checkpointing: bool, released: bool = False,
    device: str = "cpu", accum: int = 1,
) -> _ForwardBackward:  # fmt: skip
    """``accum`` > 1: two micro-batches are traced one after the other, the second with the first's
    gradients in ``.grad`` (autograd adds each new gradient into them); the third and later are
    the second again, so the peak is the peak of both."""
    fake_mode = _fake_mode()
    tracker = LiveStorage()
    tracker.device = device
    mixed = precision == "bf16-mixed"
    vocab = _vocab_size(model)
    num_labels = _num_labels(model)
    model, params = _fake_copy(model, fake_mode, _PARAM_DTYPE[precision])
    with _checkpointing(model, checkpointing):
        model.train()
        with fake_mode, tracker:
            track_module(tracker, model)
            input_ids, labels = traced_batch(tracker, task, vocab, num_labels, batch, seq)
            loss = traced_forward_backward(
                tracker, model, input_ids, labels, params, mixed, type(model).__name__, released=released, device=device
            )
            if accum > 1:
                del loss
                loss = traced_forward_backward(tracker, model, input_ids, labels, params, mixed, type(model).__name__, device=device)
            peak = tracker.peak()
            live = tracker.live_by_kind()
            left = {k: v for k, v in live.items() if k not in ("weights", "gradients")}
            out = _ForwardBackward(peak, left)
            if released:
                out.released = tracker.peak_released()
                out.hooks = tracker.hook_moments()
                out.shapes = [(tuple(p.shape), p.dtype) for p in params]
            del loss, input_ids, labels
    return out


def _trace_forward_backward_fsdp(model: torch.nn.Module, task: str, batch: int, seq: int, precision: str, checkpointing: bool, gpus: int) -> _ForwardBackward:
    from leanopt.memory import plan_fsdp

    peak, left = plan_fsdp.trace_forward_backward(
        model, task, batch, seq, precision, checkpointing, gpus,
        fake_mode=_fake_mode(), fake_copy=_fake_copy, checkpointing_cm=_checkpointing,
        vocab=_vocab_size(model), num_labels=_num_labels(model),
        dtype=_PARAM_DTYPE[precision],
    )  # fmt: skip
    return _ForwardBackward(peak, left)


def _optimizer_factory(optimizer: str, rounding: str | None, device: str = "cpu") -> Any:
    cls = resolve_optimizer(optimizer)
    # The class as the constructor it is: the keywords bound below are the concrete class's own
    # (foreach: found in its signature; rounding: every leanopt optimizer's __init__), not its base's.
    make: Callable[..., torch.optim.Optimizer] = cls
    if not issubclass(cls, LeanOptimizer):
        # torch's optimizers take foreach by default for CUDA params (the fake ones are CPU tensors)
        takes_foreach = device == "cuda" and "foreach" in inspect.signature(cls).parameters
        return functools.partial(make, foreach=True) if takes_foreach else cls
    return cls if rounding is None else functools.partial(make, rounding=rounding)


def _shapes(model: torch.nn.Module, dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(tuple(p.shape), dtype if p.is_floating_point() else p.dtype) for p in unique_params(list(_trainable(model)))]


def _rounded(optimizer: str, rounding: str | None, dtype: torch.dtype) -> bool:
    """Whether a step updates each param on its own, through an fp32 copy (stochastic or Kahan
    rounding of bf16/fp16 params by a leanopt optimizer: ``LeanOptimizer._step_rounded``)."""
    return rounding in ("stochastic", "kahan") and dtype in LOW_PRECISION and issubclass(resolve_optimizer(optimizer), LeanOptimizer)


def _trace_step(
    model: torch.nn.Module, optimizer: str, dtype: torch.dtype, gpus: int = 1, rounding: str | None = None,
    param_steps: ParamSteps | None = None, *, fast: bool = True, device: str = "cpu",
) -> _Step:  # fmt: skip
    """The steady-state ``optimizer.step()`` of ``model``'s params in ``dtype``. A rounded step
    (:func:`_rounded`) is put together from the step of one param of each shape
    (``param_steps``, traced here if not given) unless ``fast`` is False."""
    cls = _optimizer_factory(optimizer, rounding, device)
    fake_mode = _fake_mode()
    shapes = _shapes(model, dtype)
    if gpus > 1:
        from leanopt.memory.plan_fsdp import trace_step

        return _Step(*trace_step(shapes, cls, gpus, fake_mode))
    if fast and _rounded(optimizer, rounding, dtype):
        steps = param_steps or _trace_param_steps(shapes, optimizer, rounding, device)
        return _Step(*rounded_step_peak(shapes, steps, device))
    tracker = LiveStorage()
    tracker.device = device
    with traced_kernels(device), fake_mode, tracker:
        peak, kept = traced_steps(tracker, [torch.nn.Parameter(torch.empty(s, dtype=dt)) for s, dt in shapes], cls, fast=fast)
    return _Step(peak, kept)


def _trace_param_steps(
    shapes: list[tuple[tuple[int, ...], torch.dtype]], optimizer: str, rounding: str | None, device: str = "cpu"
) -> ParamSteps:
    """The step of one param of each shape, alone (:func:`~leanopt.memory.plan_trace.traced_param_steps`)."""
    with traced_kernels(device), _fake_mode():
        return traced_param_steps(shapes, _optimizer_factory(optimizer, rounding, device), device)


def _trainable(model: torch.nn.Module) -> Iterable[torch.nn.Parameter]:
    return (p for p in model.parameters() if p.requires_grad)


def _combine(fb: _ForwardBackward, step: _Step) -> tuple[int, dict[str, int], list[int]]:
    during_fb = fb.peak.bytes + sum(step.kept.values())
    during_step = step.peak.bytes + sum(fb.left.values())
    if during_fb >= during_step:
        breakdown = dict(fb.peak.breakdown)
        extra = step.kept
        sizes = fb.peak.sizes
    else:
        breakdown = dict(step.peak.breakdown)
        extra = fb.left
        sizes = step.peak.sizes
    for k, v in extra.items():
        breakdown[k] += v
    return max(during_fb, during_step), {k: breakdown[k] for k in KINDS}, [*sizes, *(v for v in extra.values() if v)]


def _combine_released(fb: _ForwardBackward, step: _Step, param_steps: ParamSteps) -> tuple[int, dict[str, int], list[int]]:
    """The step under gradient release: backward with each gradient freed at its hook, where the
    param's update adds its transient; ``optimizer.step()`` after it is a no-op. The optimizer's
    state and workspaces (``step.kept``) are live throughout."""
    assert fb.released is not None
    best, extra = fb.released, 0
    for index, live in fb.hooks:
        added = param_steps.transient[fb.shapes[index]]
        if live.bytes + added > best.bytes + extra:
            best, extra = live, added
    breakdown = dict(best.breakdown)
    breakdown["other"] += extra
    for k, v in step.kept.items():
        breakdown[k] += v
    sizes = [*best.sizes, *([extra] if extra else []), *(v for v in step.kept.values() if v)]
    return best.bytes + extra + sum(step.kept.values()), {k: breakdown[k] for k in KINDS}, sizes


def _combine_offloaded(fb: _ForwardBackward, release: bool, shapes: list[tuple[tuple[int, ...], torch.dtype]],
                       device: str) -> tuple[int, dict[str, int], list[int]]:  # fmt: skip
    """The device's step with ``offload="cpu"``: nothing of the optimizer is on the device. Without
    release ``step()`` reads the gradients (copied to the host chunk by chunk) while weights,
    gradients and what backward left are live; with release the gradients leave at their hooks,
    where the host, not the device, steps each param."""
    if release:
        assert fb.released is not None
        best = fb.released
        return best.bytes, {k: best.breakdown[k] for k in KINDS}, list(best.sizes)
    nbytes = [math.prod(shape) * torch.empty((), dtype=dtype, device="meta").element_size() for shape, dtype in shapes]
    if device == "cuda":
        nbytes = [cuda_block_bytes(n) for n in nbytes]
    during_step = 2 * sum(nbytes) + sum(fb.left.values())
    if fb.peak.bytes >= during_step:
        return fb.peak.bytes, {k: fb.peak.breakdown[k] for k in KINDS}, list(fb.peak.sizes)
    breakdown = dict.fromkeys(KINDS, 0)
    breakdown.update(weights=sum(nbytes), gradients=sum(nbytes))
    for k, v in fb.left.items():
        breakdown[k] += v
    return during_step, breakdown, [*nbytes, *nbytes, *(v for v in fb.left.values() if v)]


def _host_bytes(module: torch.nn.Module, optimizer: str, precision: str, release: bool) -> int:
    """What an offloaded optimizer of ``module``'s trainable params holds in host memory
    (:func:`leanopt.training_memory`, which counts what :class:`~leanopt.optim.offload.Offload` does)."""
    from leanopt.memory.training import training_memory

    return training_memory(module, optimizer, precision=precision, grad_release=release, offload=True).host_bytes


def _rank(row: PlanRow) -> tuple[bool, int, int, int, bool, bool]:
    opt = _OPTIMIZER_RANK.index(row.optimizer) if row.optimizer in _OPTIMIZER_RANK else len(_OPTIMIZER_RANK)
    rounding = ROUNDINGS.index(row.rounding) if row.rounding in ROUNDINGS else -1
    return (row.offload, PLAN_PRECISIONS.index(row.precision), rounding, opt, row.grad_release, row.checkpointing)


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


# ---- public ----------------------------------------------------------------------------------
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
    if allocator not in ("pinned", "glibc"):
        raise ValueError(f"allocator must be 'pinned' or 'glibc', got {allocator!r}")
    if not isinstance(offload, bool):
        raise ValueError(f"offload must be True or False, got {offload!r}")  # noqa: TRY004 - one-line ValueErrors
    for name, value in (("batch", batch), ("seq", seq), ("accum", accum)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise ValueError(f"gpus must be a whole number >= 1, got {gpus!r}")
    device = _device(device)
    if device == "cuda" and gpus > 1:
        raise ValueError("device='cuda' with gpus > 1 is not planned yet (FSDP2 over NCCL): plan one GPU, or --gpus on the CPU")
    budget_bytes = parse_bytes(budget) if budget is not None else None
    names = [n.lower() for n in (optimizers or DEFAULT_OPTIMIZERS)]
    lean = {n: issubclass(resolve_optimizer(n), LeanOptimizer) for n in names}  # one-line ValueError for unknown names
    precs = list(dict.fromkeys(precisions or PLAN_PRECISIONS))
    for p in precs:
        if p not in PLAN_PRECISIONS:
            raise ValueError(f"unknown precision {p!r}; known: {', '.join(PLAN_PRECISIONS)}")
    rounds = list(dict.fromkeys(roundings or DEFAULT_ROUNDINGS))
    for r in rounds:
        if r not in ROUNDINGS:
            raise ValueError(f"unknown rounding {r!r}; known: {', '.join(ROUNDINGS)}")
    releases = _flags(grad_release, "grad_release")
    ckpts = [bool(c) for c in checkpointing]
    if accum > 1:
        if gpus > 1:
            raise ValueError("accum > 1 is not planned under FSDP2 (--gpus > 1) yet")
        if releases == [True]:
            raise ValueError("accum > 1 with gradient release: release_gradients steps each param inside every backward, "
                             "so gradients cannot accumulate (plan --grad-release off)")  # fmt: skip
        releases = [False]
    if gpus > 1:
        # release_gradients and rounding="stochastic"|"kahan" refuse DTensor (FSDP2) params.
        if precisions is not None and precs == ["bf16"]:
            raise ValueError("pure bf16 is not planned under FSDP2 (--gpus > 1): rounding='stochastic'/'kahan' refuse DTensor params")
        if releases == [True]:
            raise ValueError("gradient release is not planned under FSDP2 (--gpus > 1): release_gradients refuses DTensor params")
        precs = [p for p in precs if p != "bf16"]
        releases = [False]
    if offload and gpus > 1:
        raise ValueError("offload is not planned under FSDP2 (--gpus > 1): offload='cpu' refuses DTensor params")
    if offload and not any(lean.values()):
        raise ValueError(f"offload needs a leanopt optimizer (offload='cpu'); none of {', '.join(names)} is one")
    if releases == [True] and not any(lean.values()):
        raise ValueError(f"gradient release needs a leanopt optimizer; none of {', '.join(names)} is one")
    module, label = _model(model)
    task = _task(module)
    _check_positions(module, seq)
    if any(ckpts) and not getattr(module, "supports_gradient_checkpointing", False):
        ckpts = [c for c in ckpts if not c]
    if not ckpts:
        raise ValueError(f"{type(module).__name__} does not support activation checkpointing, and no row without it was asked for")
    if gpus > 1:
        from leanopt.memory.plan_fsdp import check_shardable

        check_shardable(module, gpus)

    def configurations(precision: str) -> list[tuple[str, str | None, bool, bool]]:
        """(optimizer, rounding, grad_release, offload) rows of ``precision``."""
        out = []
        for name in names:
            for rounding in (rounds if precision == "bf16" else [None]):
                if rounding not in (None, "nearest") and not lean[name]:
                    continue  # no rounding= option: its bf16 step is a nearest one
                for release in releases:
                    if release and not lean[name]:
                        continue
                    out.append((name, rounding, release, False))
            if offload and lean[name] and precision != "bf16-mixed":
                # The fp32 master on the host: pure bf16 rounds to nearest only.
                out.extend((name, "nearest" if precision == "bf16" else None, release, True) for release in releases)
        return out

    rows = []
    for precision in precs:
        configs = configurations(precision)
        if not configs:
            continue
        dtype = _PARAM_DTYPE[precision]
        released = any(release for _, _, release, _ in configs)
        forward_backward: dict[bool, _ForwardBackward] = {}
        for ckpt in ckpts:
            try:
                if gpus > 1:
                    forward_backward[ckpt] = _trace_forward_backward_fsdp(module, task, batch, seq, precision, ckpt, gpus)
                else:
                    forward_backward[ckpt] = _trace_forward_backward(module, task, batch, seq, precision, ckpt, released, device,
                                                                     accum)
            except ValueError:
                raise
            except Exception as err:
                raise ValueError(
                    f"cannot trace a training step of {label} ({type(module).__name__}) at batch {batch}, seq {seq}, "
                    f"{precision}{', checkpointing' if ckpt else ''}: {_one_line(err)}"
                ) from None
        steps: dict[tuple[str, str | None], _Step] = {}
        param_steps: dict[tuple[str, str | None], ParamSteps] = {}
        for name, rounding, release, offloaded in configs:
            if offloaded:
                host = _host_bytes(module, name, precision, release)
                for ckpt in ckpts:
                    peak, breakdown, sizes = _combine_offloaded(forward_backward[ckpt], release, _shapes(module, dtype), device)
                    cost = _one_time(module, precision, device, sizes, name, rounding, gpus, heap=None) if process else None
                    needed = None if cost is None or cost.bytes is None else peak + cost.bytes
                    compared = None if budget_bytes is None else ("peak_bytes" if needed is None else "process_bytes")
                    # On the CPU the host memory is the device's.
                    shared = host if device == "cpu" else 0
                    fits = None if budget_bytes is None else (needed if needed is not None else peak) + shared <= budget_bytes
                    source = "process=False" if cost is None else cost.source
                    rows.append(PlanRow(name, precision, ckpt, release, gpus, peak, fits, breakdown, rounding, needed,
                                        dict(cost.parts) if cost is not None else {}, source, accum, compared, True, host,
                                        process_bytes_pinned=needed))  # fmt: skip
                continue
            key = (name, rounding if lean[name] else None)
            what = f"{name}.step() on fake tensors ({precision}{f', rounding={rounding}' if rounding else ''})"
            try:
                if key not in param_steps and (release or _rounded(name, key[1], dtype)):
                    param_steps[key] = _trace_param_steps(_shapes(module, dtype), name, key[1], device)
                if key not in steps:
                    steps[key] = _trace_step(module, name, dtype, gpus, key[1], param_steps.get(key), device=device)
            except Exception as err:
                raise ValueError(f"cannot trace {what}: {_one_line(err)}") from None
            for ckpt in ckpts:
                fb = forward_backward[ckpt]
                if release:
                    peak, breakdown, sizes = _combine_released(fb, steps[key], param_steps[key])
                else:
                    peak, breakdown, sizes = _combine(fb, steps[key])
                heap = {"batch": batch, "seq": seq, "checkpointing": ckpt, "grad_release": release, "accum": accum}
                cost = _one_time(module, precision, device, sizes, name, key[1], gpus,
                                 heap=heap if allocator == "glibc" else PINNED) if process else None
                needed = None if cost is None or cost.bytes is None else peak + cost.bytes
                compared = None if budget_bytes is None else ("peak_bytes" if needed is None else "process_bytes")
                fits = None if budget_bytes is None else (needed if needed is not None else peak) <= budget_bytes
                source = "process=False" if cost is None else cost.source
                pinned = None if needed is None or cost is None else needed - cost.parts.get("glibc_heap", 0)
                rows.append(PlanRow(name, precision, ckpt, release, gpus, peak, fits, breakdown, rounding, needed,
                                    dict(cost.parts) if cost is not None else {}, source, accum, compared,
                                    process_bytes_pinned=pinned))  # fmt: skip
    if not rows:  # pure bf16 only, for optimizers without rounding=, and nearest not asked for
        raise ValueError(f"no configuration to plan: {', '.join(names)} take no rounding= (their pure-bf16 steps round "
                         "to nearest: ask for --roundings nearest)")  # fmt: skip
    return sorted(rows, key=_rank)


PINNED: dict[str, Any] = {}  # _one_time's heap= for allocator="pinned": no heap margin, and the source says for what process


def _one_time(module: torch.nn.Module, precision: str, device: str, sizes: list[int], optimizer: str, rounding: str | None,
              gpus: int = 1, *, heap: dict[str, Any] | None = None) -> Any:  # fmt: skip
    """What the process needs besides the step's tensors (:mod:`leanopt.memory.process`; the CPU's
    one-time costs are cached on disk after their first measurement). ``heap``: the row's batch,
    seq, checkpointing, grad_release and accum, for the margin glibc's default heap keeps
    (:func:`~leanopt.memory.process.glibc_heap_margin`); None: not modelled for this row (offload),
    and the source says so."""
    from leanopt.memory import process

    if gpus > 1:
        return process.OneTimeCost(None, "not measured for FSDP2 ranks (--gpus > 1): the budget is compared with the step's peak")
    if device == "cuda":
        return process.cuda_one_time(sizes)
    cost = process.cpu_one_time(module, precision, optimizer, rounding)
    if cost.bytes is None:
        return cost
    from leanopt.memory.resident import allocator

    if heap is PINNED:
        return process.OneTimeCost(cost.bytes, f"{cost.source}; for a process that calls leanopt.pin_allocator() (glibc's "
                                   "defaults keep more: allocator='glibc', --allocator glibc)", dict(cost.parts))  # fmt: skip
    if heap is None:
        return process.OneTimeCost(cost.bytes, f"{cost.source}; glibc's heap margin not modelled for offloaded rows (the figure "
                                   "is for leanopt.pin_allocator())", dict(cost.parts))  # fmt: skip
    if allocator() == "other":
        return process.OneTimeCost(cost.bytes, f"{cost.source}; not glibc here: no heap margin modelled", dict(cost.parts))
    try:
        margin = process.glibc_heap_margin(module, precision=precision, optimizer=optimizer, rounding=rounding, **heap)
    except Exception as err:
        return process.OneTimeCost(cost.bytes, f"{cost.source}; glibc's heap margin not modelled ({_one_line(err)}): the figure "
                                   "is for leanopt.pin_allocator()", dict(cost.parts))  # fmt: skip
    parts = {**cost.parts, "glibc_heap": margin}
    return process.OneTimeCost(cost.bytes + margin, f"{cost.source}; glibc's default heap modelled (+{margin / 2**20:.0f} MiB; "
                               "process_bytes_pinned: with leanopt.pin_allocator())", parts)  # fmt: skip


def _device(device: Any) -> str:
    """``"cpu"`` or ``"cuda"`` (``"cuda:1"``, ``torch.device("cuda")`` too); else a one-line ValueError."""
    kind = str(device).split(":")[0] if isinstance(device, (str, torch.device)) else None
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: plan knows 'cpu' and 'cuda'")
    return kind


def recommend(rows: Sequence[PlanRow]) -> PlanRow | None:
    """The most precise configuration that fits (rows as :func:`plan` ranks them); None if none does
    or there was no budget."""
    return next((r for r in sorted(rows, key=_rank) if r.fits), None)
