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


@triton.jit
def skipped_elements(g, m, v):
    """reference.skipped_elements: ``g * g`` not finite (g NaN/Inf or ``|g| >= 2^64`` in fp32)
    or a new moment not finite. The square is tested on its own, since ``(1 - b2) * g * g``
    stays finite up to ~5.8e20."""
    return ~(is_finite(g * g) & is_finite(m) & is_finite(v))


@triton.jit
def adam_safe_elementwise(p, g, m, v, decay, one_minus_beta1, beta2, one_minus_beta2, floor_div, step_size, bc2_sqrt, eps,
                      MAXIMIZE: tl.constexpr):  # fmt: skip
    """The rule of reference.adamw_quantized_ on fp32 values: decay, moments, second-moment
    floor, elements of :func:`skipped_elements` skipped (param kept, moments zeroed).
    Returns (p, m, v)."""
    if MAXIMIZE:
        g = -g
    p_new = p * decay
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * g * g
    v = tl.maximum(v, m * m / floor_div)  # the second-moment floor (no v->0 hazard)
    bad = skipped_elements(g, m, v)
    m = tl.where(bad, 0.0, m)
    v = tl.where(bad, 0.0, v)
    p_new = p_new - step_size * (m / (tl.sqrt(v) / bc2_sqrt + eps))
    p_new = tl.where(bad, p, p_new)
    return p_new, m, v
