"""Triton helpers shared by leanopt's kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def to_param_dtype(x, P_DTYPE: tl.constexpr):
    """fp32 -> the param dtype, rounding to nearest-even.

    For bf16 the rounding is written out on the bits: the Triton CPU interpreter truncates on
    ``.to(tl.bfloat16)`` while CUDA rounds to nearest-even, and the kernels must agree with
    the reference (which rounds) on both.
    """
    if P_DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = bits + 0x7FFF + ((bits >> 16) & 1)
        # NaN keeps a quiet-NaN pattern instead of rounding into the exponent.
        rounded = tl.where(x != x, 0x7FC00000, rounded)
        return (rounded >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(P_DTYPE)


@triton.jit
def is_finite(x):
    return (x == x) & (tl.abs(x) < float("inf"))
