"""How leanopt's kernels and code books answer inside a memory trace: the one seam between them and the planner.

:func:`leanopt.plan` runs a training step's own Python on fake tensors (``FakeTensorMode``) and
counts the storage it makes (:mod:`leanopt.memory.plan_trace`). Some kernel code cannot run
there, or would count the wrong thing: a graph ``torch.compile`` built cannot take fake tensors,
a Triton launch has no memory to write, a cache must not keep a fake code book for the real
steps after the trace. The kernels ask :func:`active` and answer for the trace themselves:

* ``cpu_elementwise``'s compiled graphs: a stand-in that changes nothing and allocates, for a
  moment, what the compiled graph allocates (``cpu_elementwise.QUANTIZED_TEMP_BYTES``);
* :func:`leanopt.kernels.select`: decides for fake tensors what it decides for real ones;
* :func:`launch`: a Triton launch does nothing (it writes in place and allocates nothing);
* :func:`leanopt.kernels.resolve_backend` and the multi-tensor address tables: a step planned
  for a GPU (``device="cuda"``) takes the Triton backend on the fake CPU tensors;
* every cache the kernels fill on first use (code books, lookup tables, launch tables,
  workspaces) is the trace's own (:func:`cache`): made, and counted, inside the trace, and gone
  with it;
* the pieces a step walks one after the other (Adafactor's row blocks, a rounded param's chunks)
  are walked first, second and last only (``trim_repeated_blocks``, :func:`walked`).

The trace is the calling thread's alone (``threading.local``): a step in another thread, during
a plan, runs exactly as it would without one. Nothing of leanopt's is patched for a trace. This
module imports nothing of leanopt's, so every layer (``quant`` at the bottom) may ask it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

__all__ = ["Trace", "active", "as_if_real", "cache", "launch", "tracing"]

K = TypeVar("K")
V = TypeVar("V")


@dataclass
class Trace:
    """What a trace in this thread asks of the kernels."""

    device: str = "cpu"  # the device the planned step runs on ("cpu" or "cuda"); the tensors are fake CPU ones
    trim_repeated_blocks: bool = True
    caches: dict[int, dict[Any, Any]] = field(default_factory=dict)  # id(shared cache) -> the trace's own


_local = threading.local()


def active() -> Trace | None:
    """The trace this thread is inside, or None (every real step)."""
    return getattr(_local, "trace", None)


_Part = TypeVar("_Part")


def walked(parts: list[_Part]) -> list[_Part]:
    """The pieces a step walks one after the other (a param's chunks, Adafactor's row blocks),
    as it walks them: all of them, except in a trace that trims repeated blocks, which walks the
    first, the second and the last. On fake tensors each piece between the second and the last
    repeats the second's allocations in the same sizes, with the same leftovers of the piece
    before it still alive (a loop's variables hold them until the next piece replaces them: the
    first piece has none), so they reach its peak and no other; the last may be smaller. A 7B
    model's steps are traced in seconds instead of minutes (tests/test_plan.py holds both
    shortcuts to the full walk)."""
    trace = active()
    if trace is not None and trace.trim_repeated_blocks and len(parts) > 3:
        return [parts[0], parts[1], parts[-1]]
    return parts


@contextlib.contextmanager
def tracing(device: str = "cpu", *, trim_repeated_blocks: bool = True) -> Iterator[Trace]:
    """Kernels called from this thread answer for a trace until the block ends (nested: the inner
    trace has caches of its own)."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"tracing device must be 'cpu' or 'cuda', got {device!r}")
    previous = active()
    _local.trace = trace = Trace(device, trim_repeated_blocks)
    try:
        yield trace
    finally:
        _local.trace = previous


def cache(shared: dict[K, V]) -> dict[K, V]:
    """``shared`` (a module's cache), or, inside a trace, the trace's own dict in its place."""
    trace = active()
    if trace is None:
        return shared
    return trace.caches.setdefault(id(shared), {})


def launch(kernel: Any, grid: Any) -> Callable[..., Any]:
    """``kernel[grid]``: a Triton launch, or inside a trace a call that does nothing."""
    if active() is not None:
        return _nothing
    return kernel[grid]


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def as_if_real(t: Any) -> Any:
    """A fake CPU tensor as a plain one of the same shape and dtype that holds no memory (one
    element, expanded), for code that decides by a tensor's type; anything else as it is."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import _disable_current_modes

    if not isinstance(t, FakeTensor) or t.device.type != "cpu":
        return t
    with _disable_current_modes():
        return torch.empty((), dtype=t.dtype).expand(t.shape)
