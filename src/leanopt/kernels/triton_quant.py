"""AdamW with block-quantized moments as one Triton kernel per param group: dequantize,
update and requantize in a single pass over memory.

The rule is :func:`leanopt.kernels.reference.adamw_quantized_` (second-moment floor;
gradients NaN/Inf or whose square overflows fp32 skipped, ``triton_common.skipped_elements``);
parity is tested under ``TRITON_INTERPRET=1`` on the CPU.

Layout of a program: ``NB`` whole quantization blocks of one tensor (chunks start at a tensor's
first element, and the chunk length is a multiple of the block size, so blocks never straddle
programs). Elements are handled as (even, odd) pairs, ``[NB, BS/2]`` each, which is how 4-bit
codes are packed (first element in the low nibble); 8-bit codes are simply stored twice as
often. A block's new scale is a reduction over its row of both halves. Encoding is a binary
search over the code book's midpoints (padded with +inf to a power of two), i.e. the nearest
code, the same as ``torch.searchsorted`` in the reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from leanopt.kernels.multi_tensor import TableCache
from leanopt.kernels.triton_common import TL_DTYPE, adam_safe_elementwise, to_param_dtype
from leanopt.quant.formats import TOWARD_ZERO_TOLERANCE as _TOLERANCE

TOWARD_ZERO_TOLERANCE: tl.constexpr = tl.constexpr(_TOLERANCE)

# Elements per program: a multiple of every supported block size.
CHUNK = 2048


@triton.jit
def _decode(codes_ptr, offs, mask, values_ptr, scale, BITS: tl.constexpr, HIGH: tl.constexpr):
    if BITS == 8:
        code = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
    else:
        byte = tl.load(codes_ptr + offs // 2, mask=mask, other=0).to(tl.int32)
        code = (byte >> 4) if HIGH else (byte & 15)
    return tl.load(values_ptr + code, mask=mask, other=0.0) * scale


@triton.jit
def _encode(x, scale, thresholds_ptr, LOG2_LEN: tl.constexpr):
    # Index of the nearest code = number of midpoints below y (searchsorted, left side).
    y = x / tl.where(scale > 0, scale, 1.0)
    idx = tl.zeros(y.shape, dtype=tl.int32)
    for k in tl.static_range(LOG2_LEN):
        # The stride of this level written inline: a constexpr assigned inside a static_range
        # is a reassignment on the second pass, which Triton's compiler (not its interpreter) refuses.
        t = tl.load(thresholds_ptr + idx + (((1 << LOG2_LEN) >> (k + 1)) - 1))
        idx = tl.where(t < y, idx + ((1 << LOG2_LEN) >> (k + 1)), idx)
    return idx


@triton.jit
def _encode_momentum(m, scale, g, thresholds_ptr, values_ptr, LOG2_LEN: tl.constexpr, ZERO: tl.constexpr):
    # Nearest code, except where the gradient is 0: there the code may not be larger in
    # magnitude than m, so that momentum decays to 0 as in fp32 instead of sticking to a code
    # (the reference's ``toward_zero``).
    idx = _encode(m, scale, thresholds_ptr, LOG2_LEN)
    y = m / tl.where(scale > 0, scale, 1.0)
    code_value = tl.load(values_ptr + idx)
    over = (g == 0) & (tl.abs(code_value) > tl.abs(y) * TOWARD_ZERO_TOLERANCE) & (idx != ZERO)
    return tl.where(over, tl.where(idx > ZERO, idx - 1, idx + 1), idx)


@triton.jit
def _adamw_quantized_kernel(
    p_ptrs, g_ptrs, mc_ptrs, ma_ptrs, vc_ptrs, va_ptrs,
    chunk_tensor, chunk_start, numels, step_size_table, bc2_sqrt_table, floor_div_table,
    m_values, m_thresholds, v_values, v_thresholds,
    decay, one_minus_beta1, beta2, one_minus_beta2, eps,
    P_DTYPE: tl.constexpr, BITS: tl.constexpr, BS: tl.constexpr, NB: tl.constexpr,
    M_LOG2: tl.constexpr, V_LOG2: tl.constexpr, M_ZERO: tl.constexpr, MAXIMIZE: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    t = tl.load(chunk_tensor + c)
    start = tl.load(chunk_start + c)
    n = tl.load(numels + t)
    p_ptr = tl.load(p_ptrs + t).to(tl.pointer_type(P_DTYPE))
    g_ptr = tl.load(g_ptrs + t).to(tl.pointer_type(P_DTYPE))
    mc_ptr = tl.load(mc_ptrs + t).to(tl.pointer_type(tl.uint8))
    vc_ptr = tl.load(vc_ptrs + t).to(tl.pointer_type(tl.uint8))
    ma_ptr = tl.load(ma_ptrs + t).to(tl.pointer_type(tl.float32))
    va_ptr = tl.load(va_ptrs + t).to(tl.pointer_type(tl.float32))
    step_size = tl.load(step_size_table + t)
    bc2_sqrt = tl.load(bc2_sqrt_table + t)
    floor_div = tl.load(floor_div_table + t)

    blk = tl.arange(0, NB)
    block_index = start // BS + blk  # int64
    block_mask = block_index * BS < n
    even = start + blk[:, None] * BS + 2 * tl.arange(0, BS // 2)[None, :]
    odd = even + 1
    mask_e = even < n
    mask_o = odd < n

    m_scale = tl.load(ma_ptr + block_index, mask=block_mask, other=0.0)[:, None]
    v_scale = tl.load(va_ptr + block_index, mask=block_mask, other=0.0)[:, None]
    m_e = _decode(mc_ptr, even, mask_e, m_values, m_scale, BITS, False)
    m_o = _decode(mc_ptr, odd, mask_o, m_values, m_scale, BITS, True)
    v_e = _decode(vc_ptr, even, mask_e, v_values, v_scale, BITS, False)
    v_o = _decode(vc_ptr, odd, mask_o, v_values, v_scale, BITS, True)

    p_e = tl.load(p_ptr + even, mask=mask_e, other=0.0).to(tl.float32)
    p_o = tl.load(p_ptr + odd, mask=mask_o, other=0.0).to(tl.float32)
    g_e = tl.load(g_ptr + even, mask=mask_e, other=0.0).to(tl.float32)
    g_o = tl.load(g_ptr + odd, mask=mask_o, other=0.0).to(tl.float32)

    p_e, m_e, v_e = adam_safe_elementwise(p_e, g_e, m_e, v_e, decay, one_minus_beta1, beta2, one_minus_beta2, floor_div,
                                      step_size, bc2_sqrt, eps, MAXIMIZE)  # fmt: skip
    p_o, m_o, v_o = adam_safe_elementwise(p_o, g_o, m_o, v_o, decay, one_minus_beta1, beta2, one_minus_beta2, floor_div,
                                      step_size, bc2_sqrt, eps, MAXIMIZE)  # fmt: skip
    tl.store(p_ptr + even, to_param_dtype(p_e, P_DTYPE), mask=mask_e)
    tl.store(p_ptr + odd, to_param_dtype(p_o, P_DTYPE), mask=mask_o)

    m_e = tl.where(mask_e, m_e, 0.0)
    m_o = tl.where(mask_o, m_o, 0.0)
    v_e = tl.where(mask_e, v_e, 0.0)
    v_o = tl.where(mask_o, v_o, 0.0)
    new_m_scale = tl.maximum(tl.max(tl.abs(m_e), axis=1), tl.max(tl.abs(m_o), axis=1))
    new_v_scale = tl.maximum(tl.max(v_e, axis=1), tl.max(v_o, axis=1))
    tl.store(ma_ptr + block_index, new_m_scale, mask=block_mask)
    tl.store(va_ptr + block_index, new_v_scale, mask=block_mask)

    mi_e = _encode_momentum(m_e, new_m_scale[:, None], g_e, m_thresholds, m_values, M_LOG2, M_ZERO)
    mi_o = _encode_momentum(m_o, new_m_scale[:, None], g_o, m_thresholds, m_values, M_LOG2, M_ZERO)
    vi_e = _encode(v_e, new_v_scale[:, None], v_thresholds, V_LOG2)
    vi_o = _encode(v_o, new_v_scale[:, None], v_thresholds, V_LOG2)
    if BITS == 8:
        tl.store(mc_ptr + even, mi_e.to(tl.uint8), mask=mask_e)
        tl.store(mc_ptr + odd, mi_o.to(tl.uint8), mask=mask_o)
        tl.store(vc_ptr + even, vi_e.to(tl.uint8), mask=mask_e)
        tl.store(vc_ptr + odd, vi_o.to(tl.uint8), mask=mask_o)
    else:
        # An odd tail element's high nibble is 0, as the reference packs it.
        mi_o = tl.where(mask_o, mi_o, 0)
        vi_o = tl.where(mask_o, vi_o, 0)
        tl.store(mc_ptr + even // 2, (mi_e | (mi_o << 4)).to(tl.uint8), mask=mask_e)
        tl.store(vc_ptr + even // 2, (vi_e | (vi_o << 4)).to(tl.uint8), mask=mask_e)


_PADDED: dict[tuple[str, torch.device], tuple[Tensor, Tensor, int]] = {}


def _padded_book(book, device: torch.device) -> tuple[Tensor, Tensor, int]:
    """(values, midpoints padded with +inf to a power of two, log2 of that length)."""
    key = (book.name, device)
    if key not in _PADDED:
        thr = book.thresholds.to(device=device, dtype=torch.float32)
        log2 = max(1, (thr.numel()).bit_length())
        padded = torch.full((1 << log2,), float("inf"), dtype=torch.float32, device=device)
        padded[: thr.numel()] = thr
        _PADDED[key] = (book.values.to(device=device, dtype=torch.float32), padded, log2)
    return _PADDED[key]


def adamw_quantized(
    cache: TableCache,
    key: str,
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence,
    exp_avg_sqs: Sequence,
    steps: Sequence[int],
    floor_divs: Sequence[float],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
) -> None:
    """One launch per (param dtype, formats) for params whose moments are QuantizedStates."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        if p.numel():
            groups.setdefault((p.dtype, exp_avgs[i].format, exp_avg_sqs[i].format), []).append(i)
    for (dtype, fmt_m, fmt_v), idx in groups.items():
        ps = [params[i] for i in idx]
        device = ps[0].device
        table = cache.chunks(ps, CHUNK)
        m_values, m_thr, m_log2 = _padded_book(fmt_m.book(device), device)
        v_values, v_thr, v_log2 = _padded_book(fmt_v.book(device), device)
        k = f"{key}/{dtype}/{fmt_m.name}/{fmt_v.name}"
        _adamw_quantized_kernel[(table.num_chunks,)](
            cache.addresses(k + "/p", ps, device),
            cache.addresses(k + "/g", [grads[i] for i in idx], device),
            cache.addresses(k + "/mc", [exp_avgs[i].codes for i in idx], device),
            cache.addresses(k + "/ma", [exp_avgs[i].absmax for i in idx], device),
            cache.addresses(k + "/vc", [exp_avg_sqs[i].codes for i in idx], device),
            cache.addresses(k + "/va", [exp_avg_sqs[i].absmax for i in idx], device),
            table.chunk_tensor, table.chunk_start, table.numel,
            cache.floats([lr / (1 - beta1 ** steps[i]) for i in idx], device),
            cache.floats([(1 - beta2 ** steps[i]) ** 0.5 for i in idx], device),
            cache.floats([floor_divs[i] for i in idx], device),
            m_values, m_thr, v_values, v_thr,
            1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, eps,
            P_DTYPE=TL_DTYPE[dtype], BITS=fmt_m.bits, BS=fmt_m.block_size, NB=CHUNK // fmt_m.block_size,
            M_LOG2=m_log2, V_LOG2=v_log2, M_ZERO=fmt_m.book("cpu").zero_index, MAXIMIZE=maximize,
        )  # fmt: skip
