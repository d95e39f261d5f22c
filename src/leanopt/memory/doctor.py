"""``leanopt doctor``: run real training steps, measure their peak, and say where the memory went.

:func:`doctor` runs ``steps`` training steps of the user's own setup -- a model, its optimizer and
a batch::

    with torch.autocast(device, dtype=autocast, enabled=autocast is not None):
        loss = model(**batch).loss          # or model(batch), or loss_fn(model, batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

and measures the last one with the torch profiler's memory events (``profile_memory``: every
allocation and free of the CPU allocator, or of CUDA's caching allocator, with its address and
size). The tensors live when the step starts are known by address (the weights and buffers, the
optimizer's state, the batch); the running sum of the events from there gives the step's tensor
peak, and what is live at that moment is attributed by what each block turned out to be:

* ``weights``: parameters and buffers; ``gradients``: the blocks ``.grad`` holds after backward;
* ``optimizer_state``: ``optimizer.state``'s tensors; ``master_weights``: the optimizer's own
  copies of the params it updates -- state tensors that are fp32 copies of low-precision params
  (a state key with ``master`` in its name), and with ``offload="cpu"`` the host copy of each
  param (:mod:`leanopt.optim.offload`: an fp32 master for bf16/fp16 params), where the host is
  the device measured (the CPU);
* ``activations``: blocks made in the forward pass and still live (saved for backward; under
  autocast, also its bf16 copies of the weights);
* ``temporaries``: the logits, the loss, the batch, backward's and the optimizer's scratch;
* ``runtime_overhead``: what the process needed beyond its tensors at their peak -- on the CPU
  the resident-set peak over the baseline less the tensor peak (one-time costs of the first
  steps, thread pools, library pages, what ``malloc`` keeps); on CUDA ``max_memory_reserved``
  less ``max_memory_allocated``, plus the context (``mem_get_info``).

The tensor categories add up to the tensor peak (to the byte, less any block the profiler saw
freed but not made); with ``runtime_overhead`` they add up to the process's measured peak. The
plan of the same configuration (:func:`leanopt.memory.plan.plan`) is put beside each category
where the setup is one ``plan`` knows (a transformers model, a registered optimizer,
``input_ids`` of ``[batch, seq]``).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from leanopt.memory.optimizer_internals import host_copies
from leanopt.memory.resident import reset_peak, status_kib

__all__ = ["CATEGORIES", "Diagnosis", "doctor"]

CATEGORIES = ("weights", "gradients", "optimizer_state", "master_weights", "activations", "temporaries", "runtime_overhead")
TENSOR_CATEGORIES = CATEGORIES[:-1]
_PLAN_KIND = {"weights": "weights", "gradients": "gradients", "optimizer_state": "optimizer_state",
              "activations": "activations", "other": "temporaries"}  # fmt: skip
_PHASES = ("forward", "backward", "step", "zero_grad")
MiB = 2**20


@dataclass
class Diagnosis:
    """What :func:`doctor` measured (bytes), the plan beside it, and what it says in words."""

    device: str
    steps: int
    tensor_peak_bytes: int  # the measured step's tensors at their highest point
    process_peak_bytes: int | None  # CPU: resident-set peak over the baseline; CUDA: reserved peak + context
    measured: dict[str, int]  # by CATEGORIES
    peak_phase: str  # forward, backward, step or zero_grad
    planned: dict[str, int] | None = None  # by CATEGORIES, from plan's row
    plan_row: dict[str, Any] | None = None
    plan_note: str = ""
    explanations: list[str] = field(default_factory=list)
    largest: list[tuple[str, int]] = field(default_factory=list)  # (what, bytes): the biggest blocks live at the peak
    method: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"device": self.device, "steps": self.steps, "tensor_peak_bytes": self.tensor_peak_bytes,
                "process_peak_bytes": self.process_peak_bytes, "measured": dict(self.measured),
                "planned": None if self.planned is None else dict(self.planned), "peak_phase": self.peak_phase,
                "plan_row": self.plan_row, "plan_note": self.plan_note, "explanations": list(self.explanations),
                "largest": [list(x) for x in self.largest], "method": self.method}  # fmt: skip


# ---- the step ------------------------------------------------------------------------------------
def _device_of(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    raise ValueError("doctor: the model has no parameters")


def _storages(tensors: Any, device: str | None = None) -> dict[int, int]:
    """data_ptr -> nbytes of each distinct storage of ``tensors`` (nested dicts/lists/objects), on
    ``device`` (a type: "cpu", "cuda") if given."""
    from leanopt.memory.plan_trace import state_tensors

    out: dict[int, int] = {}
    for t in state_tensors(tensors):
        if t.is_sparse or t.device.type == "meta" or (device is not None and t.device.type != device):
            continue
        st = t.untyped_storage()
        if st.nbytes():
            out[st.data_ptr()] = st.nbytes()
    return out


def _tensor_ptrs(value: Any) -> set[int]:
    return set(_storages(value))


def _loss_of(out: Any) -> torch.Tensor:
    loss = getattr(out, "loss", None) if not isinstance(out, torch.Tensor) else out
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError("doctor: the model's output has no scalar loss (pass labels in the batch, or loss_fn=)")
    return loss


class _Step:
    """One training step with its phases marked for the profiler and the blocks it made noted."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any,
                 autocast: torch.dtype | None, loss_fn: Callable[..., Any] | None) -> None:  # fmt: skip
        self.model, self.optimizer, self.batch, self.autocast, self.loss_fn = model, optimizer, batch, autocast, loss_fn
        self.device = _device_of(model)
        self.grad_ptrs: set[int] = set()
        self.output_ptrs: set[int] = set()

    def __call__(self, mark: bool = False) -> None:
        from torch.profiler import record_function

        rf = record_function if mark else (lambda name: contextlib.nullcontext())
        with rf("leanopt::forward"):
            with torch.autocast(self.device.type, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
                if self.loss_fn is not None:
                    out = self.loss_fn(self.model, self.batch)
                elif isinstance(self.batch, Mapping):
                    out = self.model(**self.batch)
                else:
                    out = self.model(self.batch)
            loss = _loss_of(out)
            self.output_ptrs = _tensor_ptrs([loss, getattr(out, "logits", None)])
            del out
        with rf("leanopt::backward"):
            loss.backward()
        self.grad_ptrs = _tensor_ptrs([p.grad for p in self.model.parameters() if p.grad is not None])
        with rf("leanopt::step"):
            self.optimizer.step()
        with rf("leanopt::zero_grad"):
            self.optimizer.zero_grad(set_to_none=True)
            del loss


def _profiled(step: _Step) -> Any:
    from torch.profiler import ProfilerActivity, profile

    from leanopt.compare.meter import _no_stderr

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if step.device.type == "cuda" else [])
    with _no_stderr(), profile(activities=activities, profile_memory=True) as prof:
        step(mark=True)
        if step.device.type == "cuda":
            torch.cuda.synchronize(step.device)
    return prof.profiler.kineto_results


def _events(results: Any, device: str) -> tuple[list[tuple[int, int, int]], dict[str, tuple[int, int]]]:
    """(time, ptr, signed bytes) of the allocations on ``device`` in time order, and each
    phase's (start, end)."""
    from torch._C._profiler import _EventType

    allocs: list[tuple[int, int, int]] = []
    phases: dict[str, tuple[int, int]] = {}
    stack = list(results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation:
            f = e.extra_fields
            if f.device.type == device and f.alloc_size:
                allocs.append((e.start_time_ns, f.ptr, f.alloc_size))
        elif e.name.startswith("leanopt::") and e.name[9:] in _PHASES:
            phases[e.name[9:]] = (e.start_time_ns, e.end_time_ns)
    allocs.sort(key=lambda a: a[0])
    return allocs, phases


def _phase_at(t: int, phases: dict[str, tuple[int, int]]) -> str:
    for name, (a, b) in phases.items():
        if a <= t <= b:
            return name
    return "between"


@dataclass
class _Attributed:
    peak: int
    by_category: dict[str, int]
    phase: str
    largest: list[tuple[str, int]]


def _attribute(step: _Step, results: Any, start: dict[str, dict[int, int]], names: dict[int, str]) -> _Attributed:
    """Replay the step's allocations from the tensors live at its start; what is live at the
    highest point, by category."""
    allocs, phases = _events(results, step.device.type)
    owner: dict[int, str] = {}
    for category, blocks in start.items():
        for ptr in blocks:
            owner.setdefault(ptr, category)
    base = {c: 0 for c in TENSOR_CATEGORIES}
    for ptr, category in owner.items():
        base[category] += start[category][ptr]
    current = sum(base.values())
    live: dict[int, tuple[int, int, str]] = {}  # ptr -> (bytes, seq, phase)
    ends = {name: b for name, (_, b) in phases.items()}
    snap_after: dict[str, dict[int, int]] = {}  # phase -> ptr -> seq live at its end
    pending = sorted(ends.items(), key=lambda kv: kv[1])
    best, best_live, best_base, best_t = current, dict(live), dict(base), 0
    for seq, (t, ptr, size) in enumerate(allocs):
        while pending and pending[0][1] < t:
            snap_after[pending[0][0]] = {p: v[1] for p, v in live.items()}
            pending.pop(0)
        if size > 0:
            live[ptr] = (size, seq, _phase_at(t, phases))
            current += size
            if current > best:
                best, best_live, best_base, best_t = current, dict(live), dict(base), t
        else:
            if ptr in live:
                current -= live.pop(ptr)[0]
            else:  # a block live at the start, freed in the step (zero_grad of old gradients...)
                category = owner.pop(ptr, "temporaries")
                base[category] -= min(-size, base[category])
                current += size
    for name, _ in pending:
        snap_after[name] = {p: v[1] for p, v in live.items()}
    after_backward = snap_after.get("backward", {})
    after_forward = snap_after.get("forward", {})
    after_step = snap_after.get("step", {})
    state_ptrs = _tensor_ptrs(step.optimizer.state)
    out = dict(best_base)
    largest: list[tuple[str, int]] = []
    for ptr, (size, seq, phase) in best_live.items():
        if ptr in step.grad_ptrs and after_backward.get(ptr) == seq:
            category, what = "gradients", f"the gradient of {names.get(ptr, 'a param')}"
        elif ptr in state_ptrs and after_step.get(ptr) == seq:
            category, what = "optimizer_state", "optimizer state"
        elif phase == "forward" and not (ptr in step.output_ptrs and after_forward.get(ptr) == seq):
            category, what = "activations", "an activation saved in the forward pass"
        elif phase == "forward":
            category, what = "temporaries", "the logits or the loss"
        else:
            category, what = "temporaries", f"a temporary of the {phase}"
        out[category] += size
        largest.append((what, size))
    for ptr, category in owner.items():
        if category == "weights" and start["weights"].get(ptr, 0) >= MiB:
            largest.append((f"the weight {names.get(ptr, '?')}", start["weights"][ptr]))
        elif category in ("optimizer_state", "master_weights") and start[category].get(ptr, 0) >= MiB:
            largest.append((f"optimizer state of {names.get(ptr, 'a param')}", start[category][ptr]))
    largest.sort(key=lambda x: -x[1])
    return _Attributed(best, out, _phase_at(best_t, phases) if best_t else "before the step", largest[:5])


def _start_blocks(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any) -> dict[str, dict[int, int]]:
    """The blocks live when the step starts, by category, on the model's device (the profiler's
    events of that device are the ones replayed)."""
    dev = _device_of(model).type
    weights = _storages([*model.parameters(), *model.buffers()], dev)
    master: dict[int, int] = {}
    state: dict[int, int] = {}
    for p, st in optimizer.state.items():
        for key, value in (st.items() if isinstance(st, Mapping) else []):
            blocks = _storages(value, dev)
            low = isinstance(p, torch.Tensor) and p.dtype in (torch.bfloat16, torch.float16)
            (master if low and "master" in str(key).lower() else state).update(blocks)
    master.update(_storages([copy for _, copy in host_copies(optimizer)], dev))
    grads = _storages([p.grad for p in model.parameters() if p.grad is not None], dev)
    inputs = _storages(list(batch.values()) if isinstance(batch, Mapping) else batch, dev)
    return {"weights": weights, "gradients": grads, "optimizer_state": state, "master_weights": master,
            "activations": {}, "temporaries": inputs}  # fmt: skip


def _names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    out: dict[int, str] = {}
    for name, p in model.named_parameters():
        if p.device.type != "meta":
            out.setdefault(p.untyped_storage().data_ptr(), name)
            if p.grad is not None:
                out.setdefault(p.grad.untyped_storage().data_ptr(), name)
    by_param = {id(p): n for n, p in model.named_parameters()}
    for param, st in optimizer.state.items():
        for ptr in _storages(st):
            out.setdefault(ptr, by_param.get(id(param), "a param"))
    return out


# ---- the process ---------------------------------------------------------------------------------
# ---- public --------------------------------------------------------------------------------------
def doctor(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    *,
    steps: int = 3,
    autocast: torch.dtype | None = None,
    loss_fn: Callable[..., Any] | None = None,
    rss_baseline: int | None = None,
    plan: bool = True,
) -> Diagnosis:
    """Run ``steps`` real training steps (they change the model and the optimizer, as training
    does), measure the last, and attribute its peak (see the module docstring).

    ``batch``: a mapping passed as ``model(**batch)`` (e.g. ``input_ids`` and ``labels``), or one
    value passed as ``model(batch)``; ``loss_fn(model, batch)`` instead returns the loss (or an
    output with ``.loss``). ``autocast``: a dtype to run the forward under ``torch.autocast``
    (``torch.bfloat16`` as ``Trainer(bf16=True)``). ``rss_baseline`` (CPU, bytes): the resident
    set to measure the process's peak over (the CLI passes the one before the model was built);
    by default the resident set at the call less the step's tensors then live, with the
    high-water mark reset. ``plan``: put ``leanopt plan``'s row beside the measurement.
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 2:
        raise ValueError(f"steps must be a whole number >= 2 (warm-up steps, then the measured one), got {steps!r}")
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"doctor: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"doctor: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if autocast is not None and autocast not in (torch.bfloat16, torch.float16):
        raise ValueError(f"autocast must be torch.bfloat16, torch.float16 or None, got {autocast!r}")
    step = _Step(model, optimizer, batch, autocast, loss_fn)
    device = step.device
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"doctor measures cpu and cuda, not {device.type}")
    model.train()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        reserved_before = torch.cuda.memory_reserved(device)
        allocated_before = torch.cuda.memory_allocated(device)
    else:
        start_tensors = sum(sum(b.values()) for b in _start_blocks(model, optimizer, batch).values())
        rss = status_kib("VmRSS")
        if rss_baseline is None and rss is not None and reset_peak():
            rss_baseline = rss * 1024 - start_tensors
    for _ in range(steps - 1):
        step()
    gc.collect()
    process_peak: int | None = None
    if cuda:
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        context = int(total - free - torch.cuda.memory_reserved(device))
        reserved_peak = torch.cuda.max_memory_reserved(device) - reserved_before + allocated_before
        process_peak = reserved_peak + max(context, 0)
    else:
        hwm = status_kib("VmHWM")
        if hwm is not None and rss_baseline is not None:
            process_peak = hwm * 1024 - rss_baseline
    start = _start_blocks(model, optimizer, batch)
    names = _names(model, optimizer)
    results = _profiled(step)
    got = _attribute(step, results, start, names)
    measured = {c: got.by_category.get(c, 0) for c in TENSOR_CATEGORIES}
    tensor_peak = sum(measured.values())
    if cuda:
        allocated_peak = torch.cuda.max_memory_allocated(device) - allocated_before + sum(sum(b.values()) for b in start.values())
        process_peak = max(process_peak or 0, allocated_peak)
    reused = 0
    if process_peak is not None and process_peak < tensor_peak:
        # A warm process: the step reused memory its allocator already held (freed by earlier
        # steps, in the baseline), so the resident set grew less than the tensors did.
        reused, process_peak = tensor_peak - process_peak, tensor_peak
    measured["runtime_overhead"] = (process_peak or tensor_peak) - tensor_peak
    if cuda:
        method = ("profiler memory events of CUDA's caching allocator (the measured step); runtime overhead = "
                  "max_memory_reserved growth + the tensors at the start + the CUDA context (mem_get_info) - the tensor peak")  # fmt: skip
    else:
        method = ("profiler memory events of the CPU allocator (the measured step); runtime overhead = the resident-set "
                  "high-water mark (VmHWM) over the baseline - the tensor peak")  # fmt: skip
    out = Diagnosis(device.type, steps, tensor_peak, process_peak, measured, got.phase, largest=got.largest, method=method)
    if reused:
        out.method += (f"; the resident set grew {_mib(reused)} less than the tensors (memory the process already "
                       "held, reused): the process peak is the tensor peak")  # fmt: skip
    if plan:
        _add_plan(out, model, optimizer, batch, autocast)
    out.explanations = _explain(out, model, optimizer)
    return out


def _optimizer_name(optimizer: torch.optim.Optimizer) -> str | None:
    from leanopt.memory.estimate import OPTIMIZER_NAMES, resolve_optimizer

    declared = optimizer.defaults.get("optimizer")
    if isinstance(declared, str):
        return declared
    for name in OPTIMIZER_NAMES:
        with contextlib.suppress(ValueError):
            if resolve_optimizer(name) is type(optimizer):
                return name
    return None


def _add_plan(out: Diagnosis, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any, autocast: Any) -> None:
    from leanopt.memory.plan import plan

    name = _optimizer_name(optimizer)
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if name is None:
        out.plan_note = f"no plan: {type(optimizer).__name__} is not an optimizer leanopt plan knows"
        return
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        out.plan_note = "no plan: the batch has no input_ids of [batch, seq] (plan traces model(input_ids=, labels=))"
        return
    dtype = next(iter(model.parameters())).dtype
    precision = "bf16" if dtype == torch.bfloat16 else ("bf16-mixed" if autocast == torch.bfloat16 else "fp32")
    if dtype not in (torch.float32, torch.bfloat16) or autocast == torch.float16:
        out.plan_note = "no plan: plan knows fp32, bf16-mixed (autocast bf16) and pure bf16"
        return
    rounding = optimizer.defaults.get("rounding", "nearest") if precision == "bf16" else None
    name_ckpt = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else "is_gradient_checkpointing"
    ckpt = bool(getattr(model, name_ckpt, False))
    offloaded = getattr(optimizer, "offload", None) == "cpu"
    if offloaded and precision == "bf16-mixed":
        out.plan_note = "no plan: plan's offload='cpu' rows are fp32 and pure bf16 (bf16-mixed's masters are the model's own params)"
        return
    try:
        rows = plan(model, batch=int(ids.shape[0]), seq=int(ids.shape[1]), optimizers=[name], precisions=[precision],
                    roundings=[rounding] if rounding else None, checkpointing=[ckpt], grad_release=[False],
                    device=out.device, offload=offloaded)  # fmt: skip
    except ValueError as err:
        out.plan_note = f"no plan: {str(err).splitlines()[0]}"
        return
    (row,) = [r for r in rows if r.offload == offloaded]
    planned = {c: 0 for c in CATEGORIES}
    for kind, value in row.breakdown.items():
        planned[_PLAN_KIND[kind]] += value
    if offloaded and out.device == "cpu":
        # The offloaded row's breakdown is the device's; on the CPU the host copies (fp32 masters
        # of bf16 params) and the states are in the same memory, live throughout the step.
        from leanopt.memory.training import training_memory

        host = training_memory(model, name, precision=precision, offload=True)
        planned["master_weights"] += host.host_copies
        planned["optimizer_state"] += host.state.bytes
    planned["runtime_overhead"] = (row.process_bytes - row.peak_bytes) if row.process_bytes is not None else 0
    out.planned = planned
    out.plan_row = row.as_dict()
    rounded = f" {rounding}" if rounding else ""
    out.plan_note = (f"plan: {name}, {precision}{rounded}, checkpointing {'on' if ckpt else 'off'}, batch {ids.shape[0]}, "
                     f"seq {ids.shape[1]}; its runtime overhead is the one-time cost of a first step ({row.process_source})")  # fmt: skip


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.0f} %" if whole else "-"


def _mib(n: int) -> str:
    return f"{n / MiB:,.1f} MiB"


def _explain(d: Diagnosis, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The biggest items, in words, with what would lower them."""
    m, peak = d.measured, d.tensor_peak_bytes
    lines = [f"the step's tensors peaked at {_mib(peak)} during {d.peak_phase}"
             + (f"; the process needed {_mib(d.process_peak_bytes)}" if d.process_peak_bytes else "")]
    params = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    ranked = sorted(TENSOR_CATEGORIES, key=lambda c: -m[c])
    for c in ranked[:3]:
        share = m[c] / peak if peak else 0.0
        if share < 0.05:
            continue
        text = f"{c.replace('_', ' ')} are {_pct(m[c], peak)} of this step's peak ({_mib(m[c])})"
        if c == "activations":
            text += ": activation checkpointing or a smaller micro-batch (leanopt plan --accum K) lowers them"
        elif c == "optimizer_state":
            per = m[c] / numel if numel else 0.0
            text = f"the optimizer state is {_pct(m[c], peak)} of this step's peak ({_mib(m[c])}, {per:.2f} B/param)"
            if per >= 3.5:
                text += ": AdamW8bit keeps ~2 B/param, AdamW4bit ~1, Adafactor ~0.02 (leanopt estimate MODEL)"
        elif c == "gradients":
            text += ": leanopt.release_gradients steps each param in backward and frees its gradient at once"
        elif c == "temporaries":
            text += " (the logits and loss, backward's and the optimizer's scratch)"
        elif c == "weights" and next(iter(params), torch.empty(0)).dtype == torch.float32:
            text += ": fp32 weights are 4 B/param; pure bf16 (leanopt plan --precisions bf16) halves them"
        lines.append(text)
    min_quant = [g for g in optimizer.param_groups if isinstance(g.get("min_quant_size"), int) and g.get("quantize", True)]
    small = [p for g in min_quant for p in g["params"] if p.numel() < g["min_quant_size"]]
    if small:
        n = sum(p.numel() for p in small)
        lines.append(f"these {n:,} params (in {len(small)} tensors) are under min_quant_size "
                     f"({min_quant[0]['min_quant_size']:,}) and keep fp32 states")  # fmt: skip
    ddp = getattr(torch.nn.parallel, "DistributedDataParallel", None)
    if ddp is not None and isinstance(model, ddp):
        view = getattr(model, "gradient_as_bucket_view", False)
        lines.append("DDP buckets hold a second copy of the gradients" + ("" if not view else " (gradient_as_bucket_view=True shares them)")
                     + f" (bucket_cap_mb {getattr(model, 'bucket_bytes_cap', 25 * MiB) / MiB:.0f})")  # fmt: skip
    if d.largest:
        what, size = d.largest[0]
        lines.append(f"the largest block live at the peak: {what}, {_mib(size)}")
    over = m["runtime_overhead"]
    if d.process_peak_bytes and over:
        lines.append(f"runtime overhead {_mib(over)} ({_pct(over, d.process_peak_bytes)} of what the process needed): "
                     + ("the CUDA context and the caching allocator's reserve" if d.device == "cuda" else
                        "one-time costs of the first steps (imports, thread pools, library pages) and what malloc keeps"))  # fmt: skip
    planned = d.planned
    if planned is not None:
        gaps = sorted(TENSOR_CATEGORIES, key=lambda c: -abs(m[c] - planned[c]))
        c = gaps[0]
        gap = m[c] - planned[c]
        if peak and abs(gap) > 0.02 * peak:
            lines.append(f"plan vs measured: {c.replace('_', ' ')} differ most, measured {_mib(m[c])}, planned {_mib(planned[c])}"
                         + (" (autocast's bf16 weight copies: planned as weights, measured as activations)"
                            if c in ("weights", "activations") and d.plan_row and d.plan_row["precision"] == "bf16-mixed" else ""))  # fmt: skip
    return lines


def _fmt_row(values: dict[str, int] | None, c: str) -> str:
    return "-" if values is None else f"{values[c] / MiB:,.1f}"


def render(d: Diagnosis) -> list[str]:
    """The table (markdown-ish lines) and explanations, as ``leanopt doctor`` prints them."""
    lines = ["| category | measured MiB | share | planned MiB |", "|---|---:|---:|---:|"]
    total = d.process_peak_bytes or d.tensor_peak_bytes
    for c in CATEGORIES:
        lines.append(f"| {c.replace('_', ' ')} | {d.measured[c] / MiB:,.1f} | {_pct(d.measured[c], total)} | {_fmt_row(d.planned, c)} |")
    planned_total = None if d.planned is None else sum(d.planned.values())
    lines.append(f"| **process peak** | {total / MiB:,.1f} | | {'-' if planned_total is None else f'{planned_total / MiB:,.1f}'} |")
    planned_peak = "-" if d.plan_row is None else f"{d.plan_row['peak_bytes'] / MiB:,.1f}"
    lines.append(f"| tensor peak | {d.tensor_peak_bytes / MiB:,.1f} | | {planned_peak} |")
    return lines



def build_and_diagnose(spec: str, *, batch: int, seq: int, optimizer: str = "adamw", precision: str = "fp32",
                       rounding: str | None = None, checkpointing: bool = False, steps: int = 3,
                       device: str = "cpu") -> Diagnosis:  # fmt: skip
    """``leanopt doctor MODEL``: the model built with random weights (a preset, config or Hub id,
    as ``leanopt plan`` takes), random input ids of ``[batch, seq]`` and the model's natural labels,
    the optimizer by name; the process's peak over its resident set just before the model was built."""
    import warnings

    from leanopt.memory.estimate import resolve_optimizer
    from leanopt.memory.plan import PLAN_PRECISIONS
    from leanopt.memory.plan_model import check_positions, num_labels, over_model, task_of, vocab_size
    from leanopt.memory.presets import resolve_model

    for name, value in (("batch", batch), ("seq", seq)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    if precision not in PLAN_PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; known: {', '.join(PLAN_PRECISIONS)}")
    kind = str(device).split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: doctor knows 'cpu' and 'cuda'")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda': no CUDA device visible to torch")
    cls = resolve_optimizer(optimizer)  # one-line ValueError for unknown names
    source = resolve_model(spec)
    if not source.exact_shapes:
        raise ValueError(f"{spec!r} is a bare parameter count: doctor needs the model (a preset, config.json or Hub id)")
    meta = source.params
    task = task_of(meta)
    check_positions(meta, seq)
    if checkpointing and not getattr(meta, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(meta).__name__} does not support activation checkpointing")
    vocab, labels_n = vocab_size(meta), num_labels(meta)
    baseline = status_kib("VmRSS")
    with torch.device(device):
        model = type(meta)(meta.config)
    if precision == "bf16":
        model.to(torch.bfloat16)
    if checkpointing:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    kwargs = {"rounding": rounding} if rounding and precision == "bf16" else {}
    try:
        opt = cls(over_model(cls, model), **kwargs)
    except TypeError as err:
        raise ValueError(f"{optimizer} takes no rounding= ({err})") from None
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    labels = torch.randint(0, labels_n, (batch,), device=device) if task == "classification" else ids
    return doctor(model, opt, {"input_ids": ids, "labels": labels}, steps=steps,
                  autocast=torch.bfloat16 if precision == "bf16-mixed" else None,
                  rss_baseline=None if kind == "cuda" or baseline is None else baseline * 1024)  # fmt: skip
