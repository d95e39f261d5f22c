"""The peak of one configuration's training step, put together from traces (see :mod:`leanopt.memory.plan`).

The forward/backward and the optimizer step are traced separately (the first does not depend on
the optimizer, the second not on checkpointing) and combined exactly (:func:`combine`,
:func:`combine_released`, :func:`combine_offloaded`). :class:`Traces` makes each trace once per
request: the forward/backward once per precision and checkpointing, the step once per optimizer,
rounding and param dtype (fp32 and bf16-mixed step the same fp32 params).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from leanopt.memory.cuda_emulation import cuda_block_bytes
from leanopt.memory.plan_model import (
    PARAM_DTYPE,
    Shapes,
    checkpointing,
    fake_copy,
    fake_mode,
    num_labels,
    one_line,
    optimizer_factory,
    param_keys,
    steps_each_param_alone,
    vocab_size,
)
from leanopt.memory.plan_trace import (
    KINDS,
    LiveStorage,
    ParamKey,
    ParamSteps,
    Peak,
    rounded_step_peak,
    traced_batch,
    traced_forward_backward,
    traced_kernels,
    traced_param_steps,
    traced_steps,
    track_module,
)

__all__ = [
    "ForwardBackward",
    "Step",
    "StepPeak",
    "Traces",
    "combine",
    "combine_offloaded",
    "combine_released",
    "trace_forward_backward",
    "trace_param_steps",
    "trace_step",
]


@dataclass
class ForwardBackward:
    peak: Peak
    left: dict[str, int]  # live after backward, other than weights and gradients (loss, inputs)
    # Under gradient release: the peak with each gradient freed at its hook, and (param index,
    # what was live) at each hook. None where not traced (FSDP2).
    released: Peak | None = None
    hooks: list[tuple[int, Peak]] = field(default_factory=list)
    shapes: Shapes = field(default_factory=list)  # of the params, by index


@dataclass
class Step:
    peak: Peak
    kept: dict[str, int]  # live after step + zero_grad, other than weights (state, workspaces)


@dataclass(frozen=True)
class StepPeak:
    """A configuration's step at its highest point: bytes, by kind, the sizes of the storages live
    then (a CUDA plan's segment margin) and where it is (``phase``); and ``floor``, what the step
    needs at any batch and sequence length: the part of it that no activation is in (a lower bound)."""

    bytes: int
    breakdown: dict[str, int]
    sizes: list[int]
    phase: str  # "forward/backward", "optimizer step", or "backward" (gradient release: the step is in it)
    floor: int


def _nbytes(shapes: Shapes, device: str) -> list[int]:
    nbytes = [math.prod(shape) * torch.empty((), dtype=dtype, device="meta").element_size() for shape, dtype in shapes]
    return [cuda_block_bytes(n) for n in nbytes] if device == "cuda" else nbytes


def trace_forward_backward(
    model: torch.nn.Module, task: str, batch: int, seq: int, precision: str, ckpt: bool, released: bool = False,
    device: str = "cpu", accum: int = 1,
) -> ForwardBackward:  # fmt: skip
    """``accum`` > 1: two micro-batches are traced one after the other, the second with the first's
    gradients in ``.grad`` (autograd adds each new gradient into them); the third and later are
    the second again, so the peak is the peak of both."""
    mode = fake_mode()
    tracker = LiveStorage(device)
    mixed = precision == "bf16-mixed"
    vocab, labels_n = vocab_size(model), num_labels(model)
    work, params = fake_copy(model, mode, PARAM_DTYPE[precision])
    name = type(work).__name__
    with checkpointing(work, ckpt):
        work.train()
        with mode, tracker:
            track_module(tracker, work)
            input_ids, labels = traced_batch(tracker, task, vocab, labels_n, batch, seq)
            loss = traced_forward_backward(tracker, work, input_ids, labels, params, mixed, name, released=released)
            if accum > 1:
                del loss
                loss = traced_forward_backward(tracker, work, input_ids, labels, params, mixed, name)
            live = tracker.live_by_kind()
            out = ForwardBackward(tracker.peak(), {k: v for k, v in live.items() if k not in ("weights", "gradients")})
            if tracker.released is not None:
                out.released = tracker.released.peak()
                out.hooks = tracker.released.hook_moments()
                out.shapes = [(tuple(p.shape), p.dtype) for p in params]
            del loss, input_ids, labels
    return out


def trace_step(
    model: torch.nn.Module, optimizer: str, dtype: torch.dtype, gpus: int = 1, rounding: str | None = None,
    param_steps: ParamSteps | None = None, *, fast: bool = True, device: str = "cpu",
) -> Step:  # fmt: skip
    """The steady-state ``optimizer.step()`` of ``model``'s params in ``dtype``, the optimizer built
    over them as over the model (:func:`~leanopt.memory.plan_model.param_keys`: Muon's groups). A
    step that updates each param alone (:func:`~leanopt.memory.plan_model.steps_each_param_alone`)
    is put together from the step of one param of each shape and group (``param_steps``, traced
    here if not given) unless ``fast`` is False."""
    cls = optimizer_factory(optimizer, rounding, device)
    keys = param_keys(model, optimizer, dtype)
    options = [o for _, _, o in keys]
    if gpus > 1:
        from leanopt.memory.plan_fsdp import trace_step as trace_sharded

        return Step(*trace_sharded(keys, cls, gpus))
    if fast and steps_each_param_alone(optimizer, rounding, dtype):
        steps = param_steps or trace_param_steps(keys, optimizer, rounding, device)
        return Step(*rounded_step_peak(keys, steps, device))
    tracker = LiveStorage(device)
    with traced_kernels(device), fake_mode(), tracker:
        params = [torch.nn.Parameter(torch.empty(s, dtype=dt)) for s, dt, _ in keys]
        peak, kept = traced_steps(tracker, params, cls, fast=fast, options=options)
    return Step(peak, kept)


def trace_param_steps(keys: list[ParamKey], optimizer: str, rounding: str | None, device: str = "cpu") -> ParamSteps:
    """The step of one param of each shape and group, alone (:func:`~leanopt.memory.plan_trace.traced_param_steps`)."""
    with traced_kernels(device), fake_mode():
        return traced_param_steps(keys, optimizer_factory(optimizer, rounding, device), device)


# ---- combining the traces -------------------------------------------------------------------------
def _by_kind(breakdown: dict[str, int]) -> dict[str, int]:
    return {k: breakdown[k] for k in KINDS}


def combine(fb: ForwardBackward, step: Step) -> StepPeak:
    """In steady state the optimizer's state and workspaces are live through forward and backward,
    what backward left (loss, inputs) through the step. The optimizer's step itself, with every
    gradient, is what any batch needs (its floor)."""
    during_fb = fb.peak.bytes + sum(step.kept.values())
    during_step = step.peak.bytes + sum(fb.left.values())
    at, extra = (fb.peak, step.kept) if during_fb >= during_step else (step.peak, fb.left)
    breakdown = dict(at.breakdown)
    for k, v in extra.items():
        breakdown[k] += v
    phase = "forward/backward" if during_fb >= during_step else "optimizer step"
    return StepPeak(max(during_fb, during_step), _by_kind(breakdown), [*at.sizes, *(v for v in extra.values() if v)], phase,
                    step.peak.bytes)  # fmt: skip


def combine_released(fb: ForwardBackward, step: Step, param_steps: ParamSteps) -> StepPeak:
    """The step under gradient release: backward with each gradient freed at its hook, where the
    param's update adds its transient; ``optimizer.step()`` after it is a no-op. The optimizer's
    state and workspaces (``step.kept``) are live throughout."""
    assert fb.released is not None
    best, extra = fb.released, 0
    keys = param_steps.keys
    assert [(s, d) for s, d, _ in keys] == fb.shapes, "the per-param steps were traced for another model's params"
    for index, live in fb.hooks:
        added = param_steps.transient[keys[index]]
        if live.bytes + added > best.bytes + extra:
            best, extra = live, added
    breakdown = dict(best.breakdown)
    breakdown["other"] += extra
    for k, v in step.kept.items():
        breakdown[k] += v
    sizes = [*best.sizes, *([extra] if extra else []), *(v for v in step.kept.values() if v)]
    # At any batch: the weights and what the optimizer keeps, and at some hook a param's gradient
    # and its step's transient.
    weights = sum(_nbytes(fb.shapes, "cpu"))
    stepped = max((n + param_steps.transient[key] for n, key in zip(_nbytes(fb.shapes, "cpu"), keys)), default=0)
    floor = weights + sum(step.kept.values()) + stepped
    return StepPeak(best.bytes + extra + sum(step.kept.values()), _by_kind(breakdown), sizes, "backward", floor)


def combine_offloaded(fb: ForwardBackward, release: bool, shapes: Shapes, device: str) -> StepPeak:
    """The device's step with ``offload="cpu"``: nothing of the optimizer is on the device. Without
    release ``step()`` reads the gradients (copied to the host chunk by chunk) while weights,
    gradients and what backward left are live; with release the gradients leave at their hooks,
    where the host, not the device, steps each param."""
    nbytes = _nbytes(shapes, device)
    if release:  # at any batch: the weights and, at some hook, a param's gradient
        assert fb.released is not None
        floor = sum(nbytes) + max(nbytes, default=0)
        return StepPeak(fb.released.bytes, _by_kind(fb.released.breakdown), list(fb.released.sizes), "backward", floor)
    during_step = 2 * sum(nbytes) + sum(fb.left.values())
    if fb.peak.bytes >= during_step:
        return StepPeak(fb.peak.bytes, _by_kind(fb.peak.breakdown), list(fb.peak.sizes), "forward/backward", 2 * sum(nbytes))
    breakdown = dict.fromkeys(KINDS, 0)
    breakdown.update(weights=sum(nbytes), gradients=sum(nbytes))
    for k, v in fb.left.items():
        breakdown[k] += v
    return StepPeak(during_step, breakdown, [*nbytes, *nbytes, *(v for v in fb.left.values() if v)], "optimizer step", 2 * sum(nbytes))


# ---- the traces of one request ----------------------------------------------------------------------
class Traces:
    """The traces a plan combines, each made once: the forward/backward per (precision,
    checkpointing) -- counting gradient release where ``released`` asks for it at that precision --
    and the step and the per-param steps per (optimizer, rounding, param dtype). A trace that fails
    is a one-line ValueError naming the model, the setup and the first line of the cause."""

    def __init__(self, module: torch.nn.Module, label: str, task: str, *, batch: int, seq: int, gpus: int = 1,
                 device: str = "cpu", accum: int = 1, released: frozenset[str] = frozenset()) -> None:  # fmt: skip
        self.module, self.label, self.task = module, label, task
        self.batch, self.seq, self.gpus, self.device, self.accum = batch, seq, gpus, device, accum
        self.released = released  # precisions whose forward/backward counts gradient release
        self._fb: dict[tuple[str, bool], ForwardBackward] = {}
        self._steps: dict[tuple[str, str | None, torch.dtype], Step] = {}
        self._param_steps: dict[tuple[str, str | None, torch.dtype], ParamSteps] = {}

    def forward_backward(self, precision: str, ckpt: bool) -> ForwardBackward:
        key = (precision, ckpt)
        if key not in self._fb:
            try:
                if self.gpus > 1:
                    from leanopt.memory import plan_fsdp

                    peak, left = plan_fsdp.trace_forward_backward(self.module, self.task, self.batch, self.seq, precision, ckpt, self.gpus)
                    self._fb[key] = ForwardBackward(peak, left)
                else:
                    self._fb[key] = trace_forward_backward(self.module, self.task, self.batch, self.seq, precision, ckpt,
                                                           precision in self.released, self.device, self.accum)  # fmt: skip
            except ValueError:
                raise
            except Exception as err:
                raise ValueError(
                    f"cannot trace a training step of {self.label} ({type(self.module).__name__}) at batch {self.batch}, seq {self.seq}, "
                    f"{precision}{', checkpointing' if ckpt else ''}: {one_line(err)}"
                ) from None
        return self._fb[key]

    def step(self, optimizer: str, rounding: str | None, precision: str, *, release: bool) -> tuple[Step, ParamSteps | None]:
        """The step of ``optimizer`` (``rounding``: its ``rounding=``, None for torch's) over the params
        of ``precision``, and the per-param steps where gradient release or the rounding needs them."""
        dtype = PARAM_DTYPE[precision]
        key = (optimizer, rounding, dtype)
        what = f"{optimizer}.step() on fake tensors ({precision}{f', rounding={rounding}' if rounding else ''})"
        try:
            if key not in self._param_steps and (release or steps_each_param_alone(optimizer, rounding, dtype)):
                self._param_steps[key] = trace_param_steps(param_keys(self.module, optimizer, dtype), optimizer, rounding, self.device)
            if key not in self._steps:
                self._steps[key] = trace_step(self.module, optimizer, dtype, self.gpus, rounding, self._param_steps.get(key),
                                              device=self.device)  # fmt: skip
        except Exception as err:
            raise ValueError(f"cannot trace {what}: {one_line(err)}") from None
        return self._steps[key], self._param_steps.get(key)
