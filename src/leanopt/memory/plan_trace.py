"""Trace a training step on fake tensors and keep the peak of live storage, by kind.

Nothing is allocated: the model's parameters are swapped for ``FakeTensorMode`` tensors of the
same shapes, and every aten op's outputs are followed to their storage (one Python object per
storage, freed when the last tensor over it dies). The live bytes after each op, and the
storages live at the highest point, give the peak and its breakdown. The same Python code as a
real step runs (HF forward, autograd, the optimizer's own ``step``), so whatever a real step
keeps alive (saved activations, autocast's bf16 weight copies, foreach temporaries, a reused
workspace) is kept alive here too.

Two things a fake tensor cannot do are answered here, both without effect on memory:

* ``.item()`` (a data-dependent scalar: an optimizer's step count, a mask check in a model)
  returns 1 (``True`` for booleans). A model whose *shapes* depend on its data (dynamic
  output sizes) cannot be traced and is a ``ValueError``.
* leanopt's CPU kernels that ``torch.compile`` builds cannot run on fake tensors. They are
  stubbed with a function that changes nothing and allocates, for a moment, what the compiled
  kernel allocates: for the block-quantized AdamW update, :data:`QUANTIZED_TEMP_BYTES` bytes per
  element of the param; the dense update of small tensors (< 4096 elements) allocates nothing
  that matters. The mixed-dtype AdamW update (bf16 params with fp32 state: pure bf16, which
  :func:`~leanopt.memory.plan.plan` does not offer yet) is stubbed with nothing, unmeasured.

Under FSDP2 (:mod:`~leanopt.memory.plan_fsdp`, ``LiveStorage.distributed``) DTensor ops are let
through to their local ops, ``UntypedStorage.resize_`` (how FSDP2 frees and refills unsharded
params) is followed, and an eager ``wait_tensor`` returns its input, as it does for real.

Caches the optimizers fill on first use (code books, lookup tables, Adafactor's workspace)
are emptied for the trace, so that the fake ones are created and counted, and put back after.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

KINDS = ("weights", "gradients", "optimizer_state", "activations", "other")

# Bytes per param element the compiled CPU quantized-AdamW update allocates while it runs, by
# code bits. Measured here (torch 2.13 Inductor, 2 cores; VmHWM over one step of one param,
# MALLOC_MMAP_THRESHOLD_=65536): 8-bit 8.97 and 8.97, 4-bit 13.03 and 13.04 B/element for
# 4.2M- and 22.3M-element params. Re-measure when that kernel changes.
QUANTIZED_TEMP_BYTES = {8: 9, 4: 13}

# What a new storage is, by the phase that made it, until something relabels it.
_PHASE_KIND = {"setup": "other", "forward": "activations", "backward": "other", "step": "other"}


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


class LiveStorage(TorchDispatchMode):
    """Counts the bytes of live tensor storage after every aten op (use inside FakeTensorMode)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "setup"
        self.current = 0
        self._live: dict[int, _Block] = {}
        self._by_storage: weakref.WeakKeyDictionary[Any, _Block] = weakref.WeakKeyDictionary()
        self._peak = 0
        self._at_peak: list[tuple[_Block, int]] = []
        self.autocast_copies = False
        # FSDP2 (see plan_fsdp): follow ``UntypedStorage.resize_`` (how FSDP2 frees and refills an
        # unsharded param's storage; not an aten op), let DTensor ops run down to their local ops.
        self.distributed = False
        self._orig_resize: Any = None

    def __enter__(self) -> LiveStorage:  # noqa: PYI034
        if self.distributed and self._orig_resize is None:
            orig = self._orig_resize = torch.UntypedStorage.resize_
            tracker = self

            def resize_(st: Any, size: int) -> Any:
                out = orig(st, size)
                block = tracker._by_storage.get(st)
                if block is not None and block.nbytes != st.nbytes():
                    tracker.current += st.nbytes() - block.nbytes
                    block.nbytes = st.nbytes()
                    tracker._note()
                return out

            torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *args: object) -> None:
        if self._orig_resize is not None:
            torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
            self._orig_resize = None
        super().__exit__(*args)

    # ---- bookkeeping -------------------------------------------------------------------------
    def _free(self, key: int) -> None:
        block = self._live.pop(key, None)
        if block is not None:
            self.current -= block.nbytes

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
            block = _Block(st.nbytes(), kind or _PHASE_KIND[self.phase])
            self._by_storage[st] = block
            self._live[id(block)] = block
            weakref.finalize(st, self._free, id(block))
            self.current += block.nbytes
            self._note()
        elif kind is not None:
            block.kind = kind

    def kind_of(self, t: torch.Tensor) -> str | None:
        if hasattr(t, "__tensor_flatten__"):
            t = getattr(t, t.__tensor_flatten__()[0][0])
        block = self._by_storage.get(t.untyped_storage())
        return block.kind if block is not None else None

    def _note(self) -> None:
        if self.current > self._peak:
            self._peak = self.current
            self._at_peak = [(b, b.nbytes) for b in self._live.values()]  # sizes then (resize_ changes them)

    def reset_peak(self) -> None:
        self._peak = self.current
        self._at_peak = [(b, b.nbytes) for b in self._live.values()]

    def peak(self) -> Peak:
        out = Peak(self._peak)
        for block, nbytes in self._at_peak:
            out.breakdown[block.kind] += nbytes
        return out

    def live_by_kind(self) -> dict[str, int]:
        out = dict.fromkeys(KINDS, 0)
        for block in self._live.values():
            out[block.kind] += block.nbytes
        return out

    # ---- dispatch ----------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.distributed:
            if any(getattr(t, "__name__", "") == "DTensor" for t in types):
                return NotImplemented  # DTensor runs, and its local ops come back here
            if func is torch.ops._c10d_functional.wait_tensor.default:
                return args[0]  # eager wait returns its input; the fake kernel would make a new tensor
        if func is torch.ops.aten._local_scalar_dense.default:
            # A data-dependent scalar: no memory depends on it (see the module docstring).
            t = args[0]
            return True if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 1)
        out = func(*args, **kwargs)
        kind = None
        if (
            self.autocast_copies
            and func is torch.ops.aten._to_copy.default
            and isinstance(args[0], torch.Tensor)
            and self.kind_of(args[0]) == "weights"
        ):
            kind = "weights"  # autocast's low-precision copy of a weight, kept until backward
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t, kind)
        return out


# ---- state the optimizers cache between calls -------------------------------------------------
@contextlib.contextmanager
def isolated_kernel_caches() -> Iterator[None]:
    """Empty leanopt's kernel caches for the trace (fake entries get made and counted), restore after;
    stub the compiled CPU kernels (fused, in place: no memory of their own)."""
    from leanopt.kernels import cpu
    from leanopt.quant import codebooks

    saved_dicts = []
    for owner, name in ((codebooks, "_CACHE"), (cpu, "_ENCODE_TABLES"), (cpu, "_QUANTIZED")):
        d = getattr(owner, name, None)
        if isinstance(d, dict):
            saved_dicts.append((d, dict(d)))
            d.clear()
    pool = cpu._workspaces.__dict__.pop("pool", None)
    stubs = {name: getattr(cpu, name) for name in ("_adamw_compiled", "_dense_safe_compiled", "_quantized_compiled") if hasattr(cpu, name)}
    nothing: Callable[..., None] = lambda *args, **kwargs: None

    def quantized(*args: Any) -> None:
        # (p as [blocks, block], g, codes and scales of m and v, ..., bits, zero index)
        p, bits = args[0], args[-2]
        temp = torch.empty(p.numel() * QUANTIZED_TEMP_BYTES.get(bits, 13), dtype=torch.uint8)
        del temp

    for name in stubs:
        setattr(cpu, name, quantized if name == "_quantized_compiled" else nothing)
    try:
        yield
    finally:
        for name, fn in stubs.items():
            setattr(cpu, name, fn)
        cpu._workspaces.__dict__.pop("pool", None)
        if pool is not None:
            cpu._workspaces.pool = pool
        for d, before in saved_dicts:
            d.clear()
            d.update(before)


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


def traced_forward_backward(
    tracker: LiveStorage, model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
    params: list[torch.nn.Parameter], mixed: bool, name: str,
) -> torch.Tensor:  # fmt: skip
    """One ``model(input_ids=, labels=).loss.backward()`` under ``tracker``, as a training step
    runs it: the forward under bf16 autocast when ``mixed``, the gradients counted after.
    Returns the loss: the caller's step holds it until it lets go."""
    tracker.phase = "forward"
    tracker.autocast_copies = mixed
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
        out = model(input_ids=input_ids, labels=labels)
    loss = out.loss if hasattr(out, "loss") else None
    if not isinstance(loss, torch.Tensor):
        raise ValueError(f"cannot trace {name}: its forward returned no loss")  # noqa: TRY004
    tracker.track(loss, "other")
    if isinstance(getattr(out, "logits", None), torch.Tensor):
        tracker.track(out.logits, "other")
    del out  # as `model(**batch).loss` does: logits live on only if backward saved them
    tracker.autocast_copies = False
    tracker.phase = "backward"
    loss.backward()
    for p in params:
        if p.grad is not None:
            tracker.track(p.grad, "gradients")
    return loss


def traced_steps(tracker: LiveStorage, params: list[torch.nn.Parameter], optimizer_cls: Any) -> tuple[Peak, dict[str, int]]:
    """Two ``optimizer.step(); zero_grad(set_to_none=True)`` under ``tracker``; the peak of the
    second (the steady state: its state exists before it) and what stays between steps other
    than weights."""
    for p in params:
        tracker.track(p, "weights")
    opt = optimizer_cls(params)
    for it in range(2):
        tracker.phase = "setup"
        for p in params:
            p.grad = torch.empty_like(p)
            tracker.track(p.grad, "gradients")
        if it == 1:
            tracker.reset_peak()
        tracker.phase = "step"
        opt.step()
        for st in opt.state.values():
            for t in state_tensors(st):
                tracker.track(t, "optimizer_state")
        opt.zero_grad(set_to_none=True)
    kept = {k: v for k, v in tracker.live_by_kind().items() if k != "weights"}
    return tracker.peak(), kept
