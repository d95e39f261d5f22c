"""A training step as a GPU runs it, emulated on the fake CPU tensors of a memory trace.

:func:`leanopt.plan` with ``device="cuda"`` traces the step on fake *CPU* tensors: on a CPU-only
torch build, fake CUDA tensors abort the process (a C++ ``terminate``, "PyTorch is not linked with
support for cuda devices", from the device guard) at the first op autograd records or a composite
op runs in C++, and ``torch.autocast("cuda")`` is disabled without a GPU. What a GPU does
differently is put in here, each from a torch fact:

* **the caching allocator's block sizes** (:func:`cuda_block_bytes`; ``LiveStorage`` counts every
  storage so): c10's ``CUDACachingAllocator`` rounds a request up to ``kMinBlockSize`` = 512 bytes,
  and ``torch.cuda.memory_allocated`` counts the rounded size;
* **attention**: ``scaled_dot_product_attention`` runs the fused CUDA kernel torch's
  ``sdp_utils`` would pick on an sm80+ GPU (:func:`sdpa_cuda_kernel`: flash, then
  memory-efficient, then math, with their dtype, mask and head-dim conditions), as that kernel's
  own aten op, whose meta kernel and autograd formula run on the fake tensors, so what it saves
  for backward (q, k, v, the output and a logsumexp; no seq x seq matrix) is traced; a boolean
  mask becomes the additive bias the memory-efficient kernel takes, padded as torch pads it
  (:func:`cuda_sdpa`);
* **CUDA autocast's fp32 ops** (``pow``, ``softmax``, ``layer_norm``...: :data:`CUDA_AUTOCAST_FP32`
  and :data:`CUDA_AUTOCAST_FP32_OUTPUT`, from ATen's ``AT_FORALL_FP32`` and
  ``AT_FORALL_FP32_SET_OPT_DTYPE`` lists in ``autocast_mode.h``), which CPU
  autocast leaves in bf16 (:func:`cuda_forward`).

The last two replace torch functions for the tracing thread only
(:func:`leanopt.torch_patches.thread_patch`, from the audited list
:data:`leanopt.torch_patches.TORCH_PATCHES`). The optimizers' Triton kernels are not emulated here:
their launch code runs on the fake tensors, the launches left out
(:func:`leanopt.memory.plan_trace.traced_kernels` with ``device="cuda"``, :mod:`leanopt.tracing`);
torch's own optimizers take their CUDA default (foreach), which the planner asks for.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_map

from leanopt.torch_patches import patchable, thread_patch

__all__ = [
    "CUDA_AUTOCAST_FP32",
    "CUDA_AUTOCAST_FP32_OUTPUT",
    "CUDA_BLOCK_BYTES",
    "autocast_patch_points",
    "cuda_block_bytes",
    "cuda_forward",
    "cuda_sdpa",
    "sdpa_cuda_kernel",
]


class HostOutputs(Protocol):
    """What :func:`cuda_sdpa` tells a tracker: an output that a GPU keeps in host memory."""

    def untrack(self, t: torch.Tensor) -> None: ...


CUDA_BLOCK_BYTES = 512  # the caching allocator rounds every block up to a multiple of 512 bytes


def cuda_block_bytes(nbytes: int) -> int:
    """What ``torch.cuda.memory_allocated`` counts for a tensor of ``nbytes``: nothing for an
    empty one, else ``nbytes`` rounded up to 512 (``kMinBlockSize``; also the smallest block).

    Not modelled: a cached large block reused whole when splitting it would leave <= 1 MiB
    (the allocator then counts the whole block), and ``PYTORCH_CUDA_ALLOC_CONF`` settings
    (``roundup_power2_divisions``, expandable segments)."""
    return 0 if nbytes <= 0 else -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES


_LOW = (torch.float16, torch.bfloat16)


def sdpa_cuda_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None, enable_gqa: bool = False
) -> str:
    """``"flash"``, ``"efficient"`` or ``"math"``: the kernel torch's ``scaled_dot_product_attention``
    picks on an sm80+ GPU (A100, H100, H200) with the default backends, tried in torch's order.

    Flash: fp16/bf16, no mask, head dim <= 256 and a multiple of 8. Memory-efficient: fp32, fp16
    or bf16, any mask, head dim a multiple of 16 bytes' worth of elements (4 in fp32, 8 in 16-bit),
    no grouped-query heads. Otherwise the math path (the seq x seq matrix, as on the CPU)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or not (q.dtype == k.dtype == v.dtype):
        return "math"
    d, dv = q.shape[-1], v.shape[-1]
    gqa = k.shape[1] != q.shape[1]
    if gqa and not enable_gqa:
        return "math"
    if q.dtype in _LOW and attn_mask is None and d == dv and d <= 256 and d % 8 == 0:
        return "flash"
    align = 4 if q.dtype == torch.float32 else 8
    if q.dtype in (torch.float32, *_LOW) and not gqa and d % align == 0 and dv % align == 0:
        return "efficient"
    return "math"


def _sdpa_bias(mask: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """The additive bias torch's SDPA gives the memory-efficient kernel: a boolean mask becomes
    a new tensor of ``q``'s dtype, and a last dim that is not a multiple of 16 is padded."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(mask.logical_not(), float("-inf"))
    size = mask.shape[-1]
    if size % 16:
        padded = torch.empty((*mask.shape[:-1], size + 16 - size % 16), dtype=mask.dtype)
        padded[..., :size] = mask
        mask = padded[..., :size]
    return mask


def cuda_sdpa(tracker: HostOutputs | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
              original: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:  # fmt: skip
    """``scaled_dot_product_attention`` by the aten op of the CUDA kernel :func:`sdpa_cuda_kernel`
    picks (its meta kernel and autograd formula run on the fake tensors)."""
    kernel = sdpa_cuda_kernel(q, k, v, attn_mask, enable_gqa)
    if kernel == "flash":
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)
        return out[0]
    if kernel == "efficient":
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        bias = _sdpa_bias(attn_mask, q)
        out = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, grad, dropout_p, is_causal, scale=scale)
        if tracker is not None:
            for t in out[2:]:  # philox seed and offset: host tensors on a GPU
                tracker.untrack(t)
        return out[0]
    fn = original or torch.nn.functional.scaled_dot_product_attention
    kwargs = {"enable_gqa": True} if enable_gqa else {}
    return fn(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kwargs)


# CUDA autocast runs these in fp32 (a bf16 input is cast up; for the reductions and softmaxes the
# output dtype is set to fp32); CPU autocast does not list them. By the name of the torch
# function or Tensor method. The losses, in both lists, are left to CPU autocast.
CUDA_AUTOCAST_FP32 = frozenset({
    "pow", "__pow__", "__rpow__", "exp", "expm1", "log", "log2", "log10", "log1p", "rsqrt", "reciprocal",
    "acos", "asin", "cosh", "sinh", "tan", "erfinv", "softplus", "layer_norm", "group_norm", "logsumexp",
    "cosine_similarity", "dist", "renorm",
})  # fmt: skip
CUDA_AUTOCAST_FP32_OUTPUT = frozenset({"softmax", "log_softmax", "sum", "cumsum", "cumprod", "prod"})


def _up(x: Any) -> Any:
    return x.float() if isinstance(x, torch.Tensor) and x.dtype in _LOW else x


def _autocast_fp32(fn: Callable[..., Any], set_dtype: bool) -> Callable[..., Any]:
    """``fn`` as CUDA autocast runs it: bf16/fp16 inputs cast to fp32 (``set_dtype``: the output
    dtype set to fp32 instead) while autocast is on (the trace's CPU autocast stands for CUDA's)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.is_autocast_enabled("cpu"):
            if not set_dtype:
                args, kwargs = tree_map(_up, args), tree_map(_up, kwargs)
            elif kwargs.get("dtype") is None and args and isinstance(args[0], torch.Tensor) and args[0].dtype in _LOW:
                kwargs = {**kwargs, "dtype": torch.float32}
        return fn(*args, **kwargs)

    return run


@contextlib.contextmanager
def cuda_forward(tracker: HostOutputs | None) -> Iterator[None]:
    """The forward and backward as a GPU runs them: ``scaled_dot_product_attention`` by the fused
    CUDA kernel (:func:`cuda_sdpa`) and CUDA autocast's fp32 ops (:data:`CUDA_AUTOCAST_FP32`),
    replaced in ``torch``, ``torch.nn.functional`` and ``torch.Tensor`` for this thread
    (:func:`thread_patch`; a ``TorchFunctionMode`` would not be seen by checkpointing's
    recomputation inside backward)."""
    functional = torch.nn.functional

    def attention(sdpa: Any) -> Any:
        return functools.partial(cuda_sdpa, tracker, original=sdpa)

    with contextlib.ExitStack() as stack:
        stack.enter_context(thread_patch(functional, "scaled_dot_product_attention", attention))
        for owner, name, set_dtype in autocast_patch_points():
            stack.enter_context(thread_patch(owner, name, functools.partial(_autocast_fp32, set_dtype=set_dtype)))
        yield


def autocast_patch_points() -> list[tuple[Any, str, bool]]:
    """(owner, name, sets the output dtype) for each function :func:`cuda_forward` runs as CUDA
    autocast does: the names of :data:`CUDA_AUTOCAST_FP32` and :data:`CUDA_AUTOCAST_FP32_OUTPUT`
    on ``torch``, ``torch.nn.functional`` and ``torch.Tensor``, where
    :data:`~leanopt.torch_patches.TORCH_PATCHES` lists them (tests/test_patch_points.py holds that
    list to where the installed torch defines them)."""
    out = []
    for names, set_dtype in ((CUDA_AUTOCAST_FP32, False), (CUDA_AUTOCAST_FP32_OUTPUT, True)):
        for owner in (torch, torch.nn.functional, torch.Tensor):
            allowed = patchable(owner)
            out += [(owner, name, set_dtype) for name in sorted(names) if name in allowed]
    return out
