"""Will a training run fit, and what is the most precise setup that does?

:func:`plan` predicts the **peak memory of one steady-state training step** for each
configuration — optimizer × precision × activation checkpointing — by running that step on
fake tensors (nothing allocated; see :mod:`leanopt.memory.plan_trace`)::

    with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16-mixed"):
        loss = model(input_ids=ids, labels=labels).loss      # ids: [batch, seq]
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

Labels are the model's natural ones: class ids for a sequence-classification head, the input
ids for a causal / masked / seq2seq LM. Precisions: ``fp32``; ``bf16-mixed`` (fp32 weights,
forward under autocast bf16 — ``Trainer(bf16=True)``). Pure ``bf16`` is not planned yet.

How the step is put together. The forward/backward and the optimizer step are traced
separately (the first does not depend on the optimizer, the second not on checkpointing) and
combined exactly: in steady state the optimizer's state and whatever it keeps between steps
(a workspace) are live through forward and backward, and the gradients through the step::

    peak = max(peak(forward + backward) + kept by the optimizer,
               peak(optimizer.step, second step, with the gradients) + left after backward)

``gpus`` > 1: the per-rank peak under FSDP2 (``fully_shard`` on each transformer block and the
root, batch per rank = ``batch``), traced as rank 0 of a fake process group
(:mod:`leanopt.memory.plan_fsdp`); rows get ``gpus`` = N.

Not covered yet: gradient release (``grad_release`` is False in every row), CUDA (``device`` other than ``"cpu"`` is a ``ValueError``: on
the GPU attention and the optimizers take other kernels, with other temporaries).
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from leanopt.memory.estimate import (
    resolve_optimizer,
    unique_params,
)
from leanopt.memory.plan_trace import (
    KINDS,
    LiveStorage,
    Peak,
    isolated_kernel_caches,
    track_module,
    traced_forward_backward,
    traced_steps,
)

__all__ = [
    "DEFAULT_OPTIMIZERS",
    "PLAN_PRECISIONS",
    "PlanRow",
    "parse_bytes",
    "plan",
    "recommend",
]

# Ranked by precision kept: what a user gives up first is last. Pure bf16 is traced the same way
# but not offered: against real steps here it was 21 % low (AdamW) and 17 % high (Adafactor) on
# DistilBERT, for a cause not yet found (memory kept below the aten ops the trace follows?).
PLAN_PRECISIONS = ("fp32", "bf16-mixed")
_PARAM_DTYPE = {"fp32": torch.float32, "bf16-mixed": torch.float32, "bf16": torch.bfloat16}
# Exact fp32 moments, then 8-bit and 4-bit block-quantized moments, then a factored second
# moment without a first moment (a different algorithm, the least information kept).
_OPTIMIZER_RANK = ("adamw", "torch-adamw", "adamw8bit", "adamw4bit", "adafactor", "hf-adafactor", "torch-adafactor")
DEFAULT_OPTIMIZERS = ("adamw", "adamw8bit", "adamw4bit", "adafactor")


@dataclass(frozen=True)
class PlanRow:
    """The predicted peak of one configuration; ``fits`` is None without a budget."""

    optimizer: str
    precision: str
    checkpointing: bool
    grad_release: bool
    gpus: int
    peak_bytes: int
    fits: bool | None
    breakdown: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer,
            "precision": self.precision,
            "checkpointing": self.checkpointing,
            "grad_release": self.grad_release,
            "gpus": self.gpus,
            "peak_bytes": self.peak_bytes,
            "fits": self.fits,
            "breakdown": dict(self.breakdown),
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
        raise ValueError(f"expected a model name, config path or torch.nn.Module, got {type(spec).__name__}")  # noqa: TRY004
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


@contextlib.contextmanager
def _fake_weights(model: torch.nn.Module, fake_mode: Any, dtype: torch.dtype) -> Iterator[list[torch.nn.Parameter]]:
    """``model`` with every parameter and buffer swapped for a fake CPU tensor (floating ones of
    ``dtype``), tied weights kept tied; the originals are put back after. Yields the unique
    trainable parameters."""
    swapped: list[tuple[dict[str, Any], str, Any]] = []
    memo: dict[int, torch.Tensor] = {}
    trainable: list[torch.nn.Parameter] = []
    try:
        with fake_mode:
            for mod in model.modules():
                for table in (mod._parameters, mod._buffers):
                    for name, t in list(table.items()):
                        if t is None:
                            continue
                        new = memo.get(id(t))
                        if new is None:
                            dt = dtype if t.is_floating_point() else t.dtype
                            data = torch.empty(tuple(t.shape), dtype=dt, device="cpu")
                            if isinstance(t, torch.nn.Parameter):
                                new = torch.nn.Parameter(data, requires_grad=t.requires_grad)
                                if t.requires_grad:
                                    trainable.append(new)
                            else:
                                new = data
                            memo[id(t)] = new
                        swapped.append((table, name, t))
                        table[name] = new
        yield trainable
    finally:
        for table, name, t in reversed(swapped):
            table[name] = t


@contextlib.contextmanager
def _checkpointing(model: torch.nn.Module, on: bool) -> Iterator[None]:
    if not on:
        yield
        return
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support activation checkpointing")
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
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


@dataclass
class _Step:
    peak: Peak
    kept: dict[str, int]  # live after step + zero_grad, other than weights (state, workspaces)


def _trace_forward_backward(model: torch.nn.Module, task: str, batch: int, seq: int, precision: str, checkpointing: bool) -> _ForwardBackward:
    fake_mode = _fake_mode()
    tracker = LiveStorage()
    mixed = precision == "bf16-mixed"
    vocab = _vocab_size(model)
    num_labels = _num_labels(model)
    was_training = model.training
    with _fake_weights(model, fake_mode, _PARAM_DTYPE[precision]) as params, _checkpointing(model, checkpointing):
        model.train()
        try:
            with fake_mode, tracker:
                track_module(tracker, model)
                input_ids = torch.randint(0, vocab, (batch, seq))
                labels = torch.randint(0, num_labels, (batch,)) if task == "classification" else input_ids
                tracker.track(input_ids)
                tracker.track(labels)
                loss = traced_forward_backward(tracker, model, input_ids, labels, params, mixed, type(model).__name__)
                peak = tracker.peak()
                live = tracker.live_by_kind()
                left = {k: v for k, v in live.items() if k not in ("weights", "gradients")}
                del loss, input_ids, labels
        finally:
            model.train(was_training)
    return _ForwardBackward(peak, left)


def _trace_forward_backward_fsdp(model: torch.nn.Module, task: str, batch: int, seq: int, precision: str, checkpointing: bool, gpus: int) -> _ForwardBackward:
    from leanopt.memory import plan_fsdp

    peak, left = plan_fsdp.trace_forward_backward(
        model, task, batch, seq, precision, checkpointing, gpus,
        fake_mode=_fake_mode(), fake_weights=_fake_weights, checkpointing_cm=_checkpointing,
        vocab=_vocab_size(model), num_labels=_num_labels(model),
        dtype=_PARAM_DTYPE[precision],
    )  # fmt: skip
    return _ForwardBackward(peak, left)


def _trace_step(model: torch.nn.Module, optimizer: str, dtype: torch.dtype, gpus: int = 1) -> _Step:
    cls = resolve_optimizer(optimizer)
    fake_mode = _fake_mode()
    shapes = [(tuple(p.shape), dtype if p.is_floating_point() else p.dtype) for p in unique_params(list(_trainable(model)))]
    if gpus > 1:
        from leanopt.memory.plan_fsdp import trace_step

        return _Step(*trace_step(shapes, cls, gpus, fake_mode))
    with isolated_kernel_caches(), fake_mode, LiveStorage() as tracker:
        peak, kept = traced_steps(tracker, [torch.nn.Parameter(torch.empty(s, dtype=dt)) for s, dt in shapes], cls)
    return _Step(peak, kept)


def _trainable(model: torch.nn.Module) -> Iterable[torch.nn.Parameter]:
    return (p for p in model.parameters() if p.requires_grad)


def _combine(fb: _ForwardBackward, step: _Step) -> tuple[int, dict[str, int]]:
    during_fb = fb.peak.bytes + sum(step.kept.values())
    during_step = step.peak.bytes + sum(fb.left.values())
    if during_fb >= during_step:
        breakdown = dict(fb.peak.breakdown)
        extra = step.kept
    else:
        breakdown = dict(step.peak.breakdown)
        extra = fb.left
    for k, v in extra.items():
        breakdown[k] += v
    return max(during_fb, during_step), {k: breakdown[k] for k in KINDS}


def _rank(row: PlanRow) -> tuple[int, int, bool]:
    opt = _OPTIMIZER_RANK.index(row.optimizer) if row.optimizer in _OPTIMIZER_RANK else len(_OPTIMIZER_RANK)
    return (PLAN_PRECISIONS.index(row.precision), opt, row.checkpointing)


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
    device: str = "cpu",
) -> list[PlanRow]:
    """Predicted peak memory of a steady-state training step, per configuration, ranked by precision kept.

    ``model``: a preset, config.json, folder or Hub id (as for ``leanopt estimate``) or a
    transformers model (on any device, ``meta`` included; it is not changed). ``budget``: bytes or
    a size such as ``"24GiB"``; ``fits`` is None without one. Rows are ordered fp32 → bf16-mixed,
    then by how much the optimizer keeps (adamw, 8-bit, 4-bit, adafactor), checkpointing off
    before on: the first row that fits is :func:`recommend`'s answer. Models that do not support
    activation checkpointing get no checkpointing rows. Nothing is allocated.
    """
    for name, value in (("batch", batch), ("seq", seq)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise ValueError(f"gpus must be a whole number >= 1, got {gpus!r}")
    if device != "cpu":
        raise ValueError(f"device {device!r}: plan traces CPU steps only for now (CUDA kernels keep other temporaries)")
    budget_bytes = parse_bytes(budget) if budget is not None else None
    names = [n.lower() for n in (optimizers or DEFAULT_OPTIMIZERS)]
    for n in names:
        resolve_optimizer(n)  # one-line ValueError for unknown or unavailable names
    precs = list(precisions or PLAN_PRECISIONS)
    for p in precs:
        if p == "bf16":
            raise ValueError("pure bf16 is not planned yet (its traces missed real steps by up to 21 %); use fp32 or bf16-mixed")
        if p not in PLAN_PRECISIONS:
            raise ValueError(f"unknown precision {p!r}; known: {', '.join(PLAN_PRECISIONS)}")
    ckpts = [bool(c) for c in checkpointing]
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

    forward_backward: dict[tuple[str, bool], _ForwardBackward] = {}
    steps: dict[tuple[str, torch.dtype], _Step] = {}
    rows = []
    for precision in precs:
        for ckpt in ckpts:
            try:
                if gpus > 1:
                    forward_backward[precision, ckpt] = _trace_forward_backward_fsdp(module, task, batch, seq, precision, ckpt, gpus)
                else:
                    forward_backward[precision, ckpt] = _trace_forward_backward(module, task, batch, seq, precision, ckpt)
            except ValueError:
                raise
            except Exception as err:  # noqa: BLE001 - whatever a model's code raises on fake tensors: one line
                raise ValueError(
                    f"cannot trace a training step of {label} ({type(module).__name__}) at batch {batch}, seq {seq}, "
                    f"{precision}{', checkpointing' if ckpt else ''}: {_one_line(err)}"
                ) from None
        for name in names:
            key = (name, _PARAM_DTYPE[precision])
            if key not in steps:
                try:
                    steps[key] = _trace_step(module, name, _PARAM_DTYPE[precision], gpus)
                except Exception as err:  # noqa: BLE001 - as above, for the optimizer's code
                    raise ValueError(f"cannot trace {name}.step() on fake tensors ({precision}): {_one_line(err)}") from None
            for ckpt in ckpts:
                peak, breakdown = _combine(forward_backward[precision, ckpt], steps[key])
                fits = None if budget_bytes is None else peak <= budget_bytes
                rows.append(PlanRow(name, precision, ckpt, False, gpus, peak, fits, breakdown))
    return sorted(rows, key=_rank)


def recommend(rows: Sequence[PlanRow]) -> PlanRow | None:
    """The most precise configuration that fits (rows as :func:`plan` ranks them); None if none does
    or there was no budget."""
    return next((r for r in sorted(rows, key=_rank) if r.fits), None)
