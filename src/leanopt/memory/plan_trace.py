"""Trace a training step on fake tensors and keep the peak of live storage, by kind.

Nothing is allocated: the model's parameters are swapped for ``FakeTensorMode`` tensors of the
same shapes, and every aten op's outputs are followed to their storage (one Python object per
storage, freed when the last tensor over it dies). The live bytes after each op, and the
storages live at the highest point, give the peak and its breakdown. The same Python code as a
real step runs (HF forward, autograd, the optimizer's own ``step``), so whatever a real step
keeps alive (saved activations, autocast's bf16 weight copies, foreach temporaries, a reused
workspace) is kept alive here too.

What a fake tensor cannot do, or does not show, is answered here:

* ``.item()`` (a data-dependent scalar: an optimizer's step count, a mask check in a model)
  returns 1 (``True`` for booleans). A model whose *shapes* depend on its data (dynamic
  output sizes) cannot be traced and is a ``ValueError``.
* leanopt's own kernels answer for the trace (:func:`traced_kernels`, :mod:`leanopt.tracing`),
  in the tracing thread only: ``kernels.select`` decides for fake tensors what it decides for
  plain ones, so the trace runs the implementation a real step runs; the CPU graphs that
  ``torch.compile`` builds, which cannot run on fake tensors, are stand-ins that change nothing
  and allocate, for a moment, what the compiled graph allocates: for block-quantized states,
  :data:`QUANTIZED_TEMP_BYTES` bytes per element of the param; for dense states nothing
  (measured: 0.00 B per element, fp32 and bf16 params).
  Block-quantized states of fp32 and bf16 params go to the native C++ kernel where it builds
  (:mod:`leanopt.kernels.cpu_native`, as a real step does): in place, a block-sized buffer per
  thread, so nothing of the param's size is counted.
* A CPU norm with an output dtype wider than its input converts the input first, a copy fake
  tensors do not make: it is counted for a moment (:func:`_norm_upcast_bytes`).

Adafactor's row blocks and a rounded param's chunks, the same allocations over and over, are
walked first, second and last only (:data:`TRIM_REPEATED_BLOCKS`): the same peak, in seconds
instead of minutes for a 7B model.
Gradient release is counted in the same forward/backward trace (``count_released``), and
one param's step on its own by :func:`traced_param_steps`.

Under FSDP2 (:mod:`~leanopt.memory.plan_fsdp`, :class:`ShardedLiveStorage`) DTensor ops are let
through to their local ops, ``UntypedStorage.resize_`` (how FSDP2 frees and refills unsharded
params) is followed, and an eager ``wait_tensor`` returns its input, as it does for real.

Caches the optimizers fill on first use (code books, lookup tables, Adafactor's workspace)
are the trace's own, so that the fake ones are created and counted, and gone after it. The
model is never changed (the planner traces a copy with fake weights), and what must change in
torch's own functions for a trace changes for the tracing thread only
(:func:`leanopt.torch_patches.thread_patch`, of the pairs listed in its ``TORCH_PATCHES``): a
step in another thread, during a plan, runs as it would without one.

A step planned for a GPU (``device="cuda"``) is traced on the same fake CPU tensors, with what a
GPU does differently (allocator blocks, fused attention, CUDA autocast) put in by
:mod:`leanopt.memory.cuda_emulation`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from leanopt import tracing
from leanopt.kernels import cpu_elementwise
from leanopt.memory.cuda_emulation import cuda_block_bytes, cuda_forward
from leanopt.memory.optimizer_internals import init_state
from leanopt.torch_patches import thread_patch

KINDS = ("weights", "gradients", "optimizer_state", "activations", "other")

# Bytes per param element the compiled CPU quantized update allocates while it runs, by code bits
# (measured; the kernel's own figure, which its stand-in in a trace allocates).
QUANTIZED_TEMP_BYTES = cpu_elementwise.QUANTIZED_TEMP_BYTES

# A param group's options other than its params, hashable (sorted (key, value) pairs): ``()`` for
# an optimizer built over a plain list of params. A traced param is known by its
# ``(shape, dtype, options)`` (:data:`ParamKey`): a Muon matrix and an embedding of the same shape
# are stepped by different rules.
Options = tuple[tuple[str, Any], ...]
ParamKey = tuple[tuple[int, ...], torch.dtype, Options]

# What a new storage is, by the phase that made it, until something relabels it.
# A forward under autocast ("autocast forward") also keeps a low-precision copy of each weight it
# casts until backward: LiveStorage counts such a copy as weights.
_PHASE_KIND = {"setup": "other", "forward": "activations", "autocast forward": "activations", "backward": "other", "step": "other"}


class _Block:
    """One storage: its bytes and what it holds (relabelled after the fact)."""

    __slots__ = ("__weakref__", "kind", "nbytes")

    def __init__(self, nbytes: int, kind: str) -> None:
        self.nbytes = nbytes
        self.kind = kind


@dataclass
class Peak:
    """The highest live bytes seen and the storages live at that moment, summed by kind."""

    bytes: int = 0
    breakdown: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    sizes: list[int] = field(default_factory=list)  # of the storages live then (a CUDA plan's segment margin)


def _summed(nbytes: int, blocks: list[tuple[_Block, int]]) -> Peak:
    out = Peak(nbytes)
    for block, size in blocks:
        out.breakdown[block.kind] += size
        out.sizes.append(size)
    return out


class CpuMemory:
    """How the CPU counts a storage: its bytes. A CPU norm with an output dtype wider than its
    input also converts the input first, a copy fake tensors do not make (:func:`_norm_upcast_bytes`)."""

    device = "cpu"

    def size(self, nbytes: int) -> int:
        return nbytes

    def hidden_copy(self, func: Any, args: Any, kwargs: dict[str, Any]) -> int:
        return _norm_upcast_bytes(func, args, kwargs)


class CudaMemory(CpuMemory):
    """How a GPU counts a storage planned on fake CPU tensors: as the CUDA caching allocator counts
    it (:func:`cuda_block_bytes`); the CPU kernel's hidden norm copy is not made there."""

    device = "cuda"

    def size(self, nbytes: int) -> int:
        return cuda_block_bytes(nbytes)

    def hidden_copy(self, func: Any, args: Any, kwargs: dict[str, Any]) -> int:
        return 0


DEVICE_MEMORY = {"cpu": CpuMemory(), "cuda": CudaMemory()}


class LiveStorage(TorchDispatchMode):
    """Counts the bytes of live tensor storage after every aten op (use inside FakeTensorMode), as
    ``device`` (``"cpu"`` or ``"cuda"``: :data:`DEVICE_MEMORY`) counts them.

    ``phase`` says what the trace is running (``_PHASE_KIND``); in an ``"autocast forward"`` the
    copy autocast makes of a weight (``_to_copy``) is counted as weights: it is kept until backward."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.memory = DEVICE_MEMORY[device]
        self.phase = "setup"
        self.current = 0
        self._live: dict[int, _Block] = {}
        self._by_storage: weakref.WeakKeyDictionary[Any, _Block] = weakref.WeakKeyDictionary()
        self._peak = 0
        self._at_peak: list[tuple[_Block, int]] = []
        self.released: ReleasedCount | None = None  # count_released()

    @property
    def device(self) -> str:
        return self.memory.device

    def count_released(self) -> ReleasedCount:
        """Count the rest of the trace a second time, as under gradient release (:class:`ReleasedCount`)."""
        if self.released is None:
            self.released = ReleasedCount(self)
        return self.released

    # ---- bookkeeping -------------------------------------------------------------------------
    def _allocated(self, key: Any, nbytes: int) -> None:
        """A new storage (``key``, counted ``nbytes``) or transient buffer: for a subclass's record."""

    def _freed(self, key: Any) -> None:
        """The storage ``key`` freed: for a subclass's record."""

    def _free(self, key: int) -> None:
        block = self._live.pop(key, None)
        if block is not None:
            self._freed(key)
            self.current -= block.nbytes
        if self.released is not None:
            self.released.free(key)

    def track(self, t: torch.Tensor, kind: str | None = None) -> None:
        """Count ``t``'s storage (once); ``kind`` relabels it."""
        if not isinstance(t, torch.Tensor) or t.is_sparse:
            return
        if hasattr(t, "__tensor_flatten__"):  # a wrapper subclass (DTensor): its inner tensors hold the memory
            names, _ = t.__tensor_flatten__()
            for name in names:
                self.track(getattr(t, name), kind)
            return
        st = t.untyped_storage()
        block = self._by_storage.get(st)
        if block is None:
            block = _Block(self.memory.size(st.nbytes()), kind or _PHASE_KIND[self.phase])
            self._by_storage[st] = block
            self._live[id(block)] = block
            weakref.finalize(st, self._free, id(block))
            self._allocated(id(block), block.nbytes)
            self.current += block.nbytes
            self._note()
        elif kind is not None:
            block.kind = kind

    def untrack(self, t: torch.Tensor) -> None:
        """``t``'s storage holds no memory of the device planned (a CUDA kernel's host-side
        output, such as memory-efficient attention's philox seed and offset)."""
        block = self._by_storage.get(t.untyped_storage())
        if block is not None and block.nbytes:
            self.current -= block.nbytes
            block.nbytes = 0

    def kind_of(self, t: torch.Tensor) -> str | None:
        if hasattr(t, "__tensor_flatten__"):
            t = getattr(t, t.__tensor_flatten__()[0][0])
        block = self._by_storage.get(t.untyped_storage())
        return block.kind if block is not None else None

    def _note(self) -> None:
        if self.current > self._peak:
            self._peak = self.current
            self._at_peak = [(b, b.nbytes) for b in self._live.values()]  # sizes then (resize_ changes them)
        if self.released is not None:
            self.released.note()

    def transient(self, nbytes: int) -> None:
        """A buffer of ``nbytes`` that an op allocates and frees inside itself (kind ``other``)."""
        block = _Block(self.memory.size(nbytes), "other")
        self._live[id(block)] = block
        self._allocated(id(block), block.nbytes)
        self.current += block.nbytes
        self._note()
        self._free(id(block))

    def reset_peak(self) -> None:
        self._peak = self.current
        self._at_peak = [(b, b.nbytes) for b in self._live.values()]
        if self.released is not None:
            self.released.reset()

    def peak(self) -> Peak:
        return _summed(self._peak, self._at_peak)

    def live_by_kind(self) -> dict[str, int]:
        out = dict.fromkeys(KINDS, 0)
        for block in self._live.values():
            out[block.kind] += block.nbytes
        return out

    # ---- dispatch ----------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            # A data-dependent scalar: no memory depends on it (see the module docstring).
            t = args[0]
            return True if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 1)
        hidden = self.memory.hidden_copy(func, args, kwargs)
        if hidden:
            self.transient(hidden)
        out = func(*args, **kwargs)
        kind = None
        if (
            func is torch.ops.aten._to_copy.default
            and self.phase == "autocast forward"
            and isinstance(args[0], torch.Tensor)
            and self.kind_of(args[0]) == "weights"
        ):
            kind = "weights"  # autocast's low-precision copy of a weight, kept until backward
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t, kind)
        return out


class ReleasedCount:
    """A second count of the same trace, as if each gradient were freed when its param's
    post-accumulate-grad hook ran (where :func:`leanopt.release_gradients` steps the param): its
    own peak, and for each hook what was live when it ran."""

    def __init__(self, tracker: LiveStorage) -> None:
        self.tracker = tracker
        self._freed: dict[int, int] = {}  # block id -> bytes, gradients this count has freed
        self._freed_bytes = 0
        self._any = False
        self._peak = 0
        self._at_peak: list[tuple[_Block, int]] = []
        self.hooks: list[tuple[int, int, list[tuple[_Block, int]]]] = []  # (param index, live bytes, live blocks)

    def _unreleased(self) -> list[tuple[_Block, int]]:
        return [(b, b.nbytes) for key, b in self.tracker._live.items() if key not in self._freed]

    def note(self) -> None:
        live = self.tracker.current - self._freed_bytes
        if live > self._peak:
            self._peak = live
            # Until the first gradient is released both counts are the same (no second snapshot).
            self._at_peak = self._unreleased() if self._any else self.tracker._at_peak

    def free(self, key: int) -> None:
        nbytes = self._freed.pop(key, None)
        if nbytes is not None:
            self._freed_bytes -= nbytes

    def hook(self, index: int, p: torch.Tensor) -> None:
        """What ``release_gradients``' hook would see for param ``index``: its gradient counted,
        what is live then noted (the optimizer steps it at this moment), and the gradient freed in
        this count (the traced step itself keeps it, as the usual loop does)."""
        if p.grad is None:
            return
        tracker = self.tracker
        tracker.track(p.grad, "gradients")
        self.hooks.append((index, tracker.current - self._freed_bytes, self._unreleased()))
        block = tracker._by_storage.get(p.grad.untyped_storage())
        if block is not None and id(block) not in self._freed:
            self._freed[id(block)] = block.nbytes
            self._freed_bytes += block.nbytes
            self._any = True

    def reset(self) -> None:
        self._peak = self.tracker.current - self._freed_bytes
        self._at_peak = self._unreleased()
        self.hooks.clear()

    def peak(self) -> Peak:
        return _summed(self._peak, self._at_peak)

    def hook_moments(self) -> list[tuple[int, Peak]]:
        """(param index, what was live) at each hook, in the order they ran."""
        return [(index, _summed(nbytes, blocks)) for index, nbytes, blocks in self.hooks]


class ShardedLiveStorage(LiveStorage):
    """:class:`LiveStorage` for a trace under FSDP2 (:mod:`~leanopt.memory.plan_fsdp`): DTensor ops
    run down to their local ops (which come back here), ``UntypedStorage.resize_`` -- how FSDP2
    frees and refills an unsharded param's storage, not an aten op -- is followed, and an eager
    ``wait_tensor`` returns its input, as it does for real."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__(device)
        self._orig_resize: Any = None  # the thread_patch of resize_ while entered

    def __enter__(self) -> ShardedLiveStorage:  # noqa: PYI034
        if self._orig_resize is None:
            tracker = self

            def following(orig: Any) -> Any:
                def resize_(st: Any, size: int) -> Any:
                    out = orig(st, size)
                    block = tracker._by_storage.get(st)
                    nbytes = tracker.memory.size(st.nbytes())
                    if block is not None and block.nbytes != nbytes:
                        tracker.current += nbytes - block.nbytes
                        block.nbytes = nbytes
                        tracker._note()
                    return out

                return resize_

            self._orig_resize = thread_patch(torch.UntypedStorage, "resize_", following)
            self._orig_resize.__enter__()
        super().__enter__()
        return self

    def __exit__(self, *args: object) -> None:
        if self._orig_resize is not None:
            self._orig_resize.__exit__(None, None, None)
            self._orig_resize = None
        super().__exit__(*args)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(getattr(t, "__name__", "") == "DTensor" for t in types):
            return NotImplemented  # DTensor runs, and its local ops come back here
        if func is torch.ops._c10d_functional.wait_tensor.default:
            return args[0]  # eager wait returns its input; the fake kernel would make a new tensor
        return super().__torch_dispatch__(func, types, args, kwargs)


def _norm_upcast_bytes(func: Any, args: Any, kwargs: dict[str, Any]) -> int:
    """Bytes of the hidden copy a CPU norm with an output ``dtype`` wider than its input makes.

    ``torch._foreach_norm(tensors, 2, dtype=torch.float32)`` and ``linalg.vector_norm(x,
    dtype=...)`` of bf16 tensors on the CPU convert each whole input to ``dtype`` first, one
    tensor at a time (measured: 4.0 B per element of the largest bf16 tensor for fp32, freed
    before the next; none without ``dtype``). Fake tensors only make the outputs. Adafactor's
    ``RMS(p)`` over bf16 params is such a norm: the largest param's fp32 copy is its step's peak.
    """
    if func is torch.ops.aten._foreach_norm.Scalar:
        tensors, dtype = args[0], (args[2] if len(args) > 2 else kwargs.get("dtype"))
    elif func is torch.ops.aten.linalg_vector_norm.default:
        tensors, dtype = [args[0]], kwargs.get("dtype")
    else:
        return 0
    if dtype is None:
        return 0
    item = torch.empty((), dtype=dtype, device="meta").element_size()
    sizes = [t.numel() * item for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype != dtype]
    return max(sizes, default=0)


# ---- leanopt's kernels inside the trace ---------------------------------------------------------
# Adafactor's CPU path walks a factored param in row blocks of ~1M elements, each block making and
# freeing the same buffers in a reused workspace: on fake tensors, thousands of identical ops for a
# 7B model (minutes). The trace walks the first block (full size) and the last (the rest) of each
# param only: the same allocations, so the same peak (tests/test_plan.py holds it to the full walk).
TRIM_REPEATED_BLOCKS = True


@contextlib.contextmanager
def traced_kernels(device: str = "cpu") -> Iterator[None]:
    """leanopt's kernels answering for a trace of a step on ``device``, in this thread only
    (:mod:`leanopt.tracing`): the trace's own caches (code books, lookup tables, workspaces: made
    and counted inside it), stand-ins for the compiled CPU graphs, no Triton launches; a step in
    another thread meanwhile runs as it would without a trace.

    ``device="cuda"``: leanopt's kernels are chosen for a GPU (Triton) and their launch code runs
    on the fake tensors (the chunk, address and scalar tables, Adafactor's scratch, the code books
    are traced); the launches themselves do nothing (on a GPU they update in place and allocate
    nothing). It needs the triton package."""
    if device == "cuda":
        try:
            import triton.runtime.jit  # noqa: F401

            from leanopt.kernels import triton_adafactor, triton_elementwise  # noqa: F401
        except Exception as err:  # noqa: BLE001 - one line, naming what failed
            text = str(err).strip().splitlines()
            raise ValueError(
                "planning device='cuda' runs leanopt's Triton launch code on fake tensors and needs triton "
                f"(pip install triton): {type(err).__name__}: {text[0] if text else ''}"
            ) from None
    with tracing.tracing(device, trim_repeated_blocks=TRIM_REPEATED_BLOCKS):
        yield


def swapped_copy(model: torch.nn.Module, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.nn.Module:
    """A deep copy of ``model`` in which every parameter and buffer ``t`` is ``make(t)`` (once per
    tensor: tied weights stay tied); ``model`` itself is not touched, so a thread training it
    meanwhile is not disturbed."""
    memo: dict[int, Any] = {}
    for mod in model.modules():
        for table in (mod._parameters, mod._buffers):
            for t in table.values():
                if t is not None and id(t) not in memo:
                    memo[id(t)] = make(t)
    return copy.deepcopy(model, memo)


def state_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor an optimizer state entry holds (plain, nested, or a quantized-state object)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from state_tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from state_tensors(v)
    elif hasattr(value, "__dict__"):
        for v in vars(value).values():
            if isinstance(v, torch.Tensor):
                yield v
    elif hasattr(value, "__slots__"):
        for name in value.__slots__:
            v = getattr(value, name, None)
            if isinstance(v, torch.Tensor):
                yield v


# ---- the traced step, shared by the one-process and the FSDP2 planners -------------------------
def track_module(tracker: LiveStorage, module: torch.nn.Module) -> None:
    """Count ``module``'s parameters as weights and its buffers as other memory."""
    for mod in module.modules():
        for p in mod._parameters.values():
            if p is not None:
                tracker.track(p, "weights")
        for b in mod._buffers.values():
            if b is not None:
                tracker.track(b, "other")


def traced_batch(tracker: LiveStorage, task: str, vocab: int, num_labels: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch a traced step trains on, counted: random input ids and labels (a class per
    sequence for ``task="classification"``, the ids themselves for a language model)."""
    input_ids = torch.randint(0, vocab, (batch, seq))
    labels = torch.randint(0, num_labels, (batch,)) if task == "classification" else input_ids
    tracker.track(input_ids)
    tracker.track(labels)
    return input_ids, labels


def traced_forward_backward(
    tracker: LiveStorage, model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
    params: list[torch.nn.Parameter], mixed: bool, name: str, *, released: bool = False,
) -> torch.Tensor:  # fmt: skip
    """One ``model(input_ids=, labels=).loss.backward()`` under ``tracker``, as a training step
    runs it: the forward under bf16 autocast when ``mixed``, the gradients counted after.
    Returns the loss: the caller's step holds it until it lets go.

    ``released``: also count the same pass under gradient release (:meth:`LiveStorage.count_released`):
    a post-accumulate-grad hook on every param, where ``release_gradients`` puts its own, notes
    what is live when it runs and frees the gradient in the second count.

    A tracker of ``device="cuda"``: the step as a GPU runs it (:func:`cuda_forward`: attention by the fused
    CUDA kernels, CUDA autocast's fp32 ops), on the same fake CPU tensors."""
    handles = []
    if released:
        count = tracker.count_released()
        for index, p in enumerate(params):
            handles.append(p.register_post_accumulate_grad_hook(functools.partial(count.hook, index)))
    try:
        with cuda_forward(tracker) if tracker.device == "cuda" else contextlib.nullcontext():
            return _forward_backward(tracker, model, input_ids, labels, params, mixed, name)
    finally:
        for handle in handles:
            handle.remove()


def _forward_backward(
    tracker: LiveStorage, model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
    params: list[torch.nn.Parameter], mixed: bool, name: str,
) -> torch.Tensor:  # fmt: skip
    tracker.phase = "autocast forward" if mixed else "forward"
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
        out = model(input_ids=input_ids, labels=labels)
    loss = out.loss if hasattr(out, "loss") else None
    if not isinstance(loss, torch.Tensor):
        raise ValueError(f"cannot trace {name}: its forward returned no loss")  # noqa: TRY004
    tracker.track(loss, "other")
    if isinstance(getattr(out, "logits", None), torch.Tensor):
        tracker.track(out.logits, "other")
    del out  # as `model(**batch).loss` does: logits live on only if backward saved them
    tracker.phase = "backward"
    loss.backward()
    for p in params:
        if p.grad is not None:
            tracker.track(p.grad, "gradients")
    return loss


def built_over(params: list[torch.nn.Parameter], options: list[Options] | None = None) -> list[Any]:
    """What an optimizer is built over: ``params`` as they are where each takes the optimizer's
    defaults, else one param group per distinct options (in the order first seen), as
    ``cls.groups_for_model`` groups the model's params (Muon's matrices and its aux group)."""
    if options is None or not any(options):
        return list(params)
    groups: dict[Options, list[torch.nn.Parameter]] = {}
    for p, o in zip(params, options, strict=True):
        groups.setdefault(o, []).append(p)
    return [{**dict(o), "params": ps} for o, ps in groups.items()]


def traced_steps(
    tracker: LiveStorage, params: list[torch.nn.Parameter], optimizer_cls: Any, *, fast: bool = True,
    options: list[Options] | None = None,
) -> tuple[Peak, dict[str, int]]:  # fmt: skip
    """``optimizer.step(); zero_grad(set_to_none=True)`` in steady state under ``tracker``: its
    peak (the state exists before it, as in every step after the first) and what stays between
    steps other than weights. ``options``: each param's group options (:func:`built_over`).

    The first step of a run makes the state and fills the optimizers' caches and workspaces; the
    trace needs only what it leaves. With ``fast`` and a leanopt optimizer it is not traced: the
    state is allocated from the layout (:func:`~leanopt.memory.optimizer_internals.init_state`, what the first step calls) and the caches
    are filled by a step of a second optimizer over one param of each distinct shape (for a 7B
    model, 6 params instead of 291). Otherwise (``fast=False``, or another optimizer) the step is
    simply run twice. Both give the same peak and breakdown, to the byte (tests/test_plan.py).
    """
    from leanopt.optim.base import LeanOptimizer

    for p in params:
        tracker.track(p, "weights")
    opt = optimizer_cls(built_over(params, options))
    steps = 2
    if fast and isinstance(opt, LeanOptimizer):
        steps = 1
        tracker.phase = "setup"
        for group in opt.param_groups:
            for p in group["params"]:
                init_state(opt, p, group)
        _track_state(tracker, opt)
        tracker.phase = "step"
        keys = [(tuple(p.shape), p.dtype, o) for p, o in zip(params, options or [()] * len(params), strict=True)]
        _fill_caches(optimizer_cls, keys)
    for it in range(steps):
        tracker.phase = "setup"
        for p in params:
            p.grad = torch.empty_like(p)
            tracker.track(p.grad, "gradients")
        if it == steps - 1:
            tracker.reset_peak()
        tracker.phase = "step"
        opt.step()
        _track_state(tracker, opt)
        opt.zero_grad(set_to_none=True)
    kept = {k: v for k, v in tracker.live_by_kind().items() if k != "weights"}
    return tracker.peak(), kept


def _track_state(tracker: LiveStorage, opt: torch.optim.Optimizer) -> None:
    for st in opt.state.values():
        for t in state_tensors(st):
            tracker.track(t, "optimizer_state")


def _fill_caches(optimizer_cls: Any, keys: list[ParamKey]) -> None:
    """One step of a throwaway optimizer over one param of each distinct (shape, dtype, group
    options): the caches and workspaces the optimizer's kernels keep (module-level) are made, as
    a first step makes them."""
    distinct = list(dict.fromkeys(keys))
    params = [torch.nn.Parameter(torch.empty(shape, dtype=dtype)) for shape, dtype, _ in distinct]
    opt = optimizer_cls(built_over(params, [o for _, _, o in distinct]))
    for p in params:
        p.grad = torch.empty_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    del opt, params


@dataclass
class ParamSteps:
    """Per distinct (shape, dtype, group options): what one param's steady-state step adds for a
    moment over what is live when it starts (``transient``), and the state such a param keeps
    (``state``); what the optimizer keeps besides (``kept_other``: caches, workspaces); and the
    key of each param traced for, in order (``keys``: a model's params by index)."""

    transient: dict[ParamKey, int]
    state: dict[ParamKey, int]
    kept_other: int
    keys: list[ParamKey] = field(default_factory=list)


def traced_param_steps(keys: list[ParamKey], optimizer_cls: Any, device: str = "cpu") -> ParamSteps:
    """The step of one param, alone, for each distinct (shape, dtype, group options) of ``keys``
    (run inside the fake mode and :func:`traced_kernels`; leanopt optimizers).

    Each is traced on one param of that shape, in a group of those options: a first ``step()`` makes its state (and the
    optimizer's workspaces), as earlier steps have in a run; then the second, counted, is what the
    hook of :func:`leanopt.release_gradients` runs, ``optimizer.step_param``, with the gradient
    present, and the gradient is dropped after, as the hook drops it. A leanopt optimizer's
    ``step()`` with ``rounding="stochastic"|"kahan"`` on bf16/fp16 params runs this same
    ``_step_rounded`` for one param after the other, nothing shared between them, so its peak is
    composed from these too (:func:`rounded_step_peak`).
    """
    transient: dict[ParamKey, int] = {}
    state: dict[ParamKey, int] = {}
    tracker = LiveStorage(device)
    with tracker:
        for key in dict.fromkeys(keys):
            shape, dtype, options = key
            tracker.phase = "setup"
            p = torch.nn.Parameter(torch.empty(shape, dtype=dtype))
            tracker.track(p, "weights")
            opt = optimizer_cls(built_over([p], [options]))
            p.grad = torch.empty_like(p)
            tracker.phase = "step"
            opt.step()
            _track_state(tracker, opt)
            opt.zero_grad(set_to_none=True)
            state[key] = tracker.live_by_kind()["optimizer_state"]
            tracker.phase = "setup"
            p.grad = torch.empty_like(p)
            tracker.track(p.grad, "gradients")
            tracker.phase = "step"
            tracker.reset_peak()
            before = tracker.current
            opt.step_param(p)
            p.grad = None
            transient[key] = tracker.peak().bytes - before
            del p, opt
        kept_other = tracker.live_by_kind()["other"]
    return ParamSteps(transient, state, kept_other, list(keys))


def rounded_step_peak(keys: list[ParamKey], steps: ParamSteps, device: str = "cpu") -> tuple[Peak, dict[str, int]]:
    """The peak of a steady-state ``step()`` that updates the params of ``keys`` one after the
    other (rounded bf16 params: ``LeanOptimizer._step_rounded``), with all gradients present, from
    :func:`traced_param_steps`; and what stays between steps other than weights."""
    nbytes = [math.prod(shape) * torch.empty((), dtype=dtype, device="meta").element_size() for shape, dtype, _ in keys]
    if device == "cuda":
        nbytes = [cuda_block_bytes(n) for n in nbytes]
    state = sum(steps.state[key] for key in keys)
    kept = {"gradients": 0, "optimizer_state": state, "activations": 0, "other": steps.kept_other}
    peak = Peak(0, {"weights": sum(nbytes), "gradients": sum(nbytes), "optimizer_state": state, "activations": 0,
                    "other": steps.kept_other + max((steps.transient[key] for key in keys), default=0)})  # fmt: skip
    peak.bytes = sum(peak.breakdown.values())
    peak.sizes = [*nbytes, *nbytes]  # weights and gradients (states and temporaries: not by block)
    return peak, kept
