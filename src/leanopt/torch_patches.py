"""Every attribute of torch that leanopt may replace, in one table, and the one way to replace one for a thread.

leanopt's own code offers seams (:mod:`leanopt.tracing`); torch offers none for what a memory
trace must change in it, so those few attributes are replaced, and only these:

* ``torch.nn.functional.scaled_dot_product_attention`` and CUDA autocast's fp32 ops on
  ``torch``, ``torch.nn.functional`` and ``torch.Tensor``: a step planned for a GPU runs on fake
  CPU tensors as a GPU runs it (:func:`leanopt.memory.cuda_emulation.cuda_forward`);
* ``torch.UntypedStorage.resize_``: how FSDP2 frees and refills an unsharded param's storage,
  which is no aten op, followed by a trace under FSDP2 (``ShardedLiveStorage``);
* ``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_`` (and their defining module's
  names): for the whole process, but only while a gradient release is in effect or an
  offloaded optimizer holds released gradients on the host (:func:`leanopt.optim.clipping.engage`;
  the last ``disengage`` puts torch's own back). Loops that clip through torch's function
  (Trainer, Accelerate, plain loops) would otherwise clip host-held gradients not at all and
  gradients already applied silently; torch has no extension point for where a gradient is.
  Every call over params no release concerns is torch's own.

One attribute of a peer is replaced too, under the same condition and only once that peer is
imported: ``accelerate.Accelerator.clip_grad_norm_`` (:data:`PEER_PATCHES`), which since
accelerate 1.16 clips with ``get_total_norm`` over ``p.grad`` and so would clip released
gradients silently not at all (:func:`leanopt.optim.clipping.route_accelerate`).

:data:`TORCH_PATCHES` lists them; :func:`thread_patch` refuses any other pair (``ValueError``),
and tests/test_patch_points.py fails if a listed attribute is gone from the installed torch or a
replacement in ``src/`` is not listed. This module imports nothing of leanopt's, so any layer may
use it.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional
import torch.nn.utils.clip_grad

__all__ = ["PEER_PATCHES", "TORCH_PATCHES", "Patch", "owner_name", "patchable", "thread_patch"]


@dataclass(frozen=True)
class Patch:
    """Attributes ``names`` of ``owner`` that ``by`` replaces, for the calling thread only
    (``scope="thread"``, through :func:`thread_patch`) or for the whole process."""

    owner: Any
    names: frozenset[str]
    by: str  # the leanopt function that replaces them
    scope: str  # "thread" or "process"


_CUDA_FORWARD = "leanopt.memory.cuda_emulation.cuda_forward"

TORCH_PATCHES: tuple[Patch, ...] = (
    Patch(torch.nn.functional, frozenset({"scaled_dot_product_attention"}), _CUDA_FORWARD, "thread"),
    # CUDA autocast's fp32 ops (cuda_emulation.CUDA_AUTOCAST_FP32 and _FP32_OUTPUT), where torch defines them
    Patch(torch, frozenset({
        "acos", "asin", "cosh", "cosine_similarity", "dist", "erfinv", "exp", "expm1", "group_norm", "layer_norm", "log",
        "log10", "log1p", "log2", "logsumexp", "pow", "reciprocal", "renorm", "rsqrt", "sinh", "tan",
        "cumprod", "cumsum", "log_softmax", "prod", "softmax", "sum",
    }), _CUDA_FORWARD, "thread"),  # fmt: skip
    Patch(torch.nn.functional, frozenset({
        "cosine_similarity", "group_norm", "layer_norm", "softplus", "log_softmax", "softmax",
    }), _CUDA_FORWARD, "thread"),  # fmt: skip
    Patch(torch.Tensor, frozenset({
        "__pow__", "__rpow__", "acos", "asin", "cosh", "dist", "erfinv", "exp", "expm1", "log", "log10", "log1p", "log2",
        "logsumexp", "pow", "reciprocal", "renorm", "rsqrt", "sinh", "tan",
        "cumprod", "cumsum", "log_softmax", "prod", "softmax", "sum",
    }), _CUDA_FORWARD, "thread"),  # fmt: skip
    Patch(torch.UntypedStorage, frozenset({"resize_"}), "leanopt.memory.plan_trace.ShardedLiveStorage", "thread"),
    Patch(torch.nn.utils, frozenset({"clip_grad_norm_", "clip_grad_value_"}), "leanopt.optim.clipping.engage", "process"),
    Patch(torch.nn.utils.clip_grad, frozenset({"clip_grad_norm_", "clip_grad_value_"}), "leanopt.optim.clipping.engage", "process"),
)


# (module, class, attribute, the leanopt function that replaces it): a peer's attributes replaced
# for the whole process once the module is imported (never imported here: the peers are optional).
PEER_PATCHES: tuple[tuple[str, str, str, str], ...] = (
    ("accelerate.accelerator", "Accelerator", "clip_grad_norm_", "leanopt.optim.clipping.route_accelerate"),
)


def owner_name(owner: Any) -> str:
    """``owner``'s dotted name: ``torch.nn.functional``, ``torch.Tensor``."""
    if isinstance(owner, type):
        module = "torch" if owner.__module__.startswith("torch") and getattr(torch, owner.__name__, None) is owner else owner.__module__
        return f"{module}.{owner.__qualname__}"
    return str(getattr(owner, "__name__", repr(owner)))


def patchable(owner: Any, scope: str = "thread") -> frozenset[str]:
    """The names of ``owner`` that :data:`TORCH_PATCHES` lets leanopt replace in ``scope``."""
    out: set[str] = set()
    for patch in TORCH_PATCHES:
        if patch.owner is owner and patch.scope == scope:
            out |= patch.names
    return frozenset(out)


# ---- replaced for the calling thread only ------------------------------------------------------
# The attribute is replaced by a dispatcher that runs the replacement for the threads inside a
# thread_patch block and the original for every other thread; the first block that needs it
# installs it, the last to leave restores the original.
_PATCH_LOCK = threading.Lock()
_PATCHES: dict[tuple[int, str], list[Any]] = {}  # (id(owner), name) -> [original, owned, users]


class _Overrides(threading.local):
    """This thread's replacements, by (id(owner), name)."""

    def __init__(self) -> None:
        self.table: dict[tuple[int, str], Any] = {}


_OVERRIDES = _Overrides()


@contextlib.contextmanager
def thread_patch(owner: Any, name: str, make: Callable[[Any], Any]) -> Iterator[None]:
    """``owner.name`` is ``make(original)`` for calls from this thread until the block ends.

    Only a pair :data:`TORCH_PATCHES` lists for ``scope="thread"`` (a ``ValueError`` names any
    other): what leanopt replaces in torch is read in one place."""
    if name not in patchable(owner):
        raise ValueError(
            f"thread_patch: {owner_name(owner)}.{name} is not in leanopt.torch_patches.TORCH_PATCHES "
            "(the audited list of torch attributes leanopt may replace); add it there with why"
        )
    key = (id(owner), name)
    with _PATCH_LOCK:
        entry = _PATCHES.get(key)
        if entry is None:
            original = getattr(owner, name)

            def dispatch(*args: Any, **kwargs: Any) -> Any:
                impl = _OVERRIDES.table.get(key)
                return (original if impl is None else impl)(*args, **kwargs)

            functools.update_wrapper(dispatch, original)
            entry = _PATCHES[key] = [original, name in vars(owner), 0]
            setattr(owner, name, dispatch)
        entry[2] += 1
    previous = _OVERRIDES.table.get(key)
    _OVERRIDES.table[key] = make(entry[0])
    try:
        yield
    finally:
        if previous is None:
            _OVERRIDES.table.pop(key, None)
        else:
            _OVERRIDES.table[key] = previous
        with _PATCH_LOCK:
            entry[2] -= 1
            if entry[2] == 0:
                del _PATCHES[key]
                if entry[1] or not isinstance(owner, type):
                    setattr(owner, name, entry[0])
                else:
                    delattr(owner, name)  # an inherited method (torch.Tensor's, from TensorBase)
