"""Elementwise rules as Triton kernels: one launch per param group, dense or block-quantized.

Both kernels take the rules with a Triton twin (:data:`leanopt.kernels.twins.TRITON`) through
their helpers in ``triton_rules`` (``RULE`` is :func:`leanopt.kernels.rules.rule_id`, ``FLAGS``
the rule's flags as bits), with up to three states (zero too, dense), fp32 maths,
and every step-dependent number from a per-tensor scalar table formed on the host (in double,
rounded once). Shapes never reach the compiler: a launch walks a list of tensors in chunks
(:mod:`leanopt.kernels.multi_tensor`).

The quantized kernel dequantizes, updates and requantizes in one pass over memory. A program
holds ``NB`` whole quantization blocks of one tensor (chunks start at a tensor's first element
and the chunk is a multiple of the block size, so blocks never straddle programs). Elements are
handled as (even, odd) pairs, ``[NB, BS/2]`` each, which is how 4-bit codes are packed (first
element in the low nibble); 8-bit codes are simply stored twice as often. A block's new scale
is a reduction over its row of both halves. Encoding is a binary search over the code book's
midpoints (padded with +inf to a power of two): the nearest code, as ``torch.searchsorted`` in
the reference. Parity is tested under ``TRITON_INTERPRET=1`` on the CPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from leanopt import tracing
from leanopt.kernels import triton_interpreted
from leanopt.kernels.multi_tensor import TableCache
from leanopt.kernels.rules import Rule, rule_id
from leanopt.kernels.triton_common import TL_DTYPE, to_param_dtype
from leanopt.kernels.triton_rules import rule_update, skipped_elements
from leanopt.kernels.twins import flag_bits
from leanopt.quant.formats import DECAY_GROWTH_RATIO as _GROWTH
from leanopt.quant.formats import DECAY_PROGRESS as _PROGRESS

DECAY_PROGRESS: tl.constexpr = tl.constexpr(_PROGRESS)
DECAY_GROWTH_RATIO: tl.constexpr = tl.constexpr(_GROWTH)

# Elements per program: a multiple of every block size the quantized kernel takes (kernels.select
# sends it block sizes that divide 2,048).
CHUNK = 2048
# Under Triton's interpreter (TRITON_INTERPRET=1: the tests' CPU runs, the GPU check's dry run)
# the programs of a launch run one after another, each at a fixed Python cost (~0.1 s for the
# quantized kernel on this project's 2-core machine), so a program there takes 8x as many
# elements: the same kernel code, for any power-of-two multiple of the block size (the tests'
# Triton cases ran in half the time, 2026-12-05). The GPU's 2,048 is compiled for sm_90 by the
# GPU check's dry run; tests/test_rules.py interprets its parity at 2,048 too (its shapes straddle
# those chunks).
INTERPRETED_CHUNK = 8 * CHUNK


def chunk_size() -> int:
    """Elements per program of a launch now: :data:`CHUNK`, or :data:`INTERPRETED_CHUNK` under
    Triton's interpreter."""
    return INTERPRETED_CHUNK if triton_interpreted() else CHUNK


def _scalar_table(cache: TableCache, rule: Rule, hp: Mapping[str, Any], steps: Sequence[int], safe: bool, device) -> tuple[Tensor, int]:
    rows = [rule.scalar_values(hp, s, safe) for s in steps]
    width = len(rows[0])
    return cache.floats([v for row in rows for v in row], device), width


# ---- dense states ---------------------------------------------------------------------------
@triton.jit
def _load_dense(ptrs, t, offs, mask, S_BF16: tl.constexpr):
    # One dense state as fp32: fp32, or bf16 (leanopt.quant.bf16) read exactly.
    if S_BF16:
        return tl.load(tl.load(ptrs + t).to(tl.pointer_type(tl.bfloat16)) + offs, mask=mask).to(tl.float32)
    else:
        return tl.load(tl.load(ptrs + t).to(tl.pointer_type(tl.float32)) + offs, mask=mask)


@triton.jit
def _store_dense(ptrs, t, offs, mask, x, index, step, S_BF16: tl.constexpr):
    # fp32 as it is, or bf16 with leanopt.quant.bf16.stochastic_bf16 on the dither of ``index``
    # and ``step``: the top half of bits(x) + floor(u * 2^16); NaN as a quiet NaN.
    if S_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = bits + (_dither(index, step) * 65536.0).to(tl.uint32)
        rounded = tl.where(x != x, 0x7FC00000, rounded)
        out = (rounded >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        tl.store(tl.load(ptrs + t).to(tl.pointer_type(tl.bfloat16)) + offs, out, mask=mask)
    else:
        tl.store(tl.load(ptrs + t).to(tl.pointer_type(tl.float32)) + offs, x, mask=mask)


@triton.jit
def _dense_kernel(
    p_ptrs, g_ptrs, s0_ptrs, s1_ptrs, s2_ptrs, chunk_tensor, chunk_start, numels, scalars, dither_keys,
    K: tl.constexpr, P_DTYPE: tl.constexpr, RULE: tl.constexpr, N_STATES: tl.constexpr, FLAGS: tl.constexpr,
    SAFE: tl.constexpr, MAXIMIZE: tl.constexpr, CHUNK: tl.constexpr, S_BF16: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    t = tl.load(chunk_tensor + c)
    offs = tl.load(chunk_start + c) + tl.arange(0, CHUNK)
    mask = offs < tl.load(numels + t)
    p_ptr = tl.load(p_ptrs + t).to(tl.pointer_type(P_DTYPE))
    g_ptr = tl.load(g_ptrs + t).to(tl.pointer_type(P_DTYPE))

    p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    if MAXIMIZE:
        g = -g
    s0 = p  # placeholders where the rule keeps fewer states: passed through, never stored
    if N_STATES > 0:
        s0 = _load_dense(s0_ptrs, t, offs, mask, S_BF16)
    s1 = s0
    s2 = s0
    if N_STATES > 1:
        s1 = _load_dense(s1_ptrs, t, offs, mask, S_BF16)
    if N_STATES > 2:
        s2 = _load_dense(s2_ptrs, t, offs, mask, S_BF16)
    p_new, s0, s1, s2 = rule_update(p, g, s0, s1, s2, scalars + t * K, RULE, FLAGS, SAFE, N_STATES)
    if SAFE:
        bad = skipped_elements(g, s0, s1, s2, N_STATES)
        p_new = tl.where(bad, p, p_new)
        s0 = tl.where(bad, 0.0, s0)
        s1 = tl.where(bad, 0.0, s1)
        s2 = tl.where(bad, 0.0, s2)
    tl.store(p_ptr + offs, to_param_dtype(p_new, P_DTYPE), mask=mask)
    # The stochastic rounding's dither key of bf16 states: this tensor's step and the global
    # index of its element 0; state j of element i draws index i * N_STATES + j.
    step = tl.load(dither_keys + 2 * t)
    index = (tl.load(dither_keys + 2 * t + 1) + offs) * N_STATES
    if N_STATES > 0:
        _store_dense(s0_ptrs, t, offs, mask, s0, index, step, S_BF16)
    if N_STATES > 1:
        _store_dense(s1_ptrs, t, offs, mask, s1, index + 1, step, S_BF16)
    if N_STATES > 2:
        _store_dense(s2_ptrs, t, offs, mask, s2, index + 2, step, S_BF16)


def dense(rule: Rule, cache: TableCache, key: str, params, grads, states, steps: Sequence[int], hp: Mapping[str, Any], *,
          safe: bool, offsets: Sequence[int] | None = None) -> None:  # fmt: skip
    """One launch per (param dtype, state dtype); ``states[i]`` are param ``i``'s states,
    contiguous, all fp32 or all bf16 (written with stochastic rounding, :mod:`leanopt.quant.bf16`);
    ``offsets[i]`` (default 0): the flat index of param ``i``'s element 0 in its whole tensor."""
    offsets = [0] * len(params) if offsets is None else offsets
    by_dtype: dict[tuple[torch.dtype, bool], list[int]] = {}
    for i, p in enumerate(params):
        if p.numel():
            bf16 = bool(states[i]) and states[i][0].dtype == torch.bfloat16
            by_dtype.setdefault((p.dtype, bf16), []).append(i)
    for (dtype, bf16), idx in by_dtype.items():
        ps = [params[i] for i in idx]
        device = ps[0].device
        n = len(states[idx[0]])
        chunk = chunk_size()
        table = cache.chunks(ps, chunk)
        scalars, width = _scalar_table(cache, rule, hp, [steps[i] for i in idx], safe, device)
        keys = cache.ints([v for i in idx for v in (steps[i], offsets[i])], device)
        k = f"{key}/{rule.name}/{dtype}" + ("/bf16-states" if bf16 else "")
        # Tables for three states whatever the rule keeps (the kernel reads only N_STATES of
        # them): the last state repeated, or the params where there is none.
        state_tables = [cache.addresses(f"{k}/s{j}", [states[i][min(j, n - 1)] if n else params[i] for i in idx], device)
                        for j in range(3)]  # fmt: skip
        tracing.launch(_dense_kernel, (table.num_chunks,))(
            cache.addresses(k + "/p", ps, device), cache.addresses(k + "/g", [grads[i] for i in idx], device),
            *state_tables, table.chunk_tensor, table.chunk_start, table.numel, scalars, keys,
            K=width, P_DTYPE=TL_DTYPE[dtype], RULE=rule_id(rule), N_STATES=n, FLAGS=flag_bits(rule, hp), SAFE=safe,
            MAXIMIZE=bool(hp["maximize"]), CHUNK=chunk, S_BF16=bf16,
        )  # fmt: skip


# ---- block-quantized states -----------------------------------------------------------------
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
def _dither(index, step):
    # leanopt.quant.formats.dither in uint32 arithmetic (products wrap mod 2^32): the same bits.
    h = index.to(tl.uint32) ^ ((index >> 32).to(tl.uint32) * 0x9E3779B9)
    h = h * 0x9E3779B1 + step.to(tl.uint32) * 0x85EBCA77
    h = h ^ (h >> 16)
    h = h * 0x7FEB352D
    h = h ^ (h >> 15)
    h = h * 0x846CA68B
    h = h ^ (h >> 16)
    return (h >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _decay_rounded(idx, y, values_ptr, prev_y, u, ZERO: tl.constexpr, LAST: tl.constexpr):
    # leanopt.quant.formats.decay_rounded, for elements that only decay (their gradient is 0).
    near = tl.abs(tl.load(values_ptr + idx))
    progress = near < prev_y * DECAY_PROGRESS
    over = (near > tl.abs(y)) & (idx != ZERO)
    a = tl.where(over, tl.where(idx > ZERO, idx - 1, idx + 1), idx)
    b = tl.minimum(tl.maximum(a + tl.where(y < 0, -1, 1), 0), LAST)
    va = tl.abs(tl.load(values_ptr + a))
    vb = tl.abs(tl.load(values_ptr + b))
    gap = vb - va
    frac = tl.where(gap > 0, (tl.abs(y) - va) / tl.where(gap > 0, gap, 1.0), 0.0)
    up = (u < frac) & ~((vb * DECAY_PROGRESS > prev_y) & (vb > va * DECAY_GROWTH_RATIO))
    return tl.where(progress, idx, tl.where(up, b, a))


@triton.jit
def _encode_state(x, scale, g, old, index, step, thresholds_ptr, values_ptr, LOG2_LEN: tl.constexpr,
                  ZERO: tl.constexpr, LAST: tl.constexpr, DECAYS: tl.constexpr):  # fmt: skip
    # Nearest code; for a DECAYS state (a first moment), where the gradient is 0, the decay
    # rounding of the reference (``BlockFormat.code_indices``), keyed on the global ``index``.
    idx = _encode(x, scale, thresholds_ptr, LOG2_LEN)
    if DECAYS:
        safe = tl.where(scale > 0, scale, 1.0)
        y = x / safe
        decayed = _decay_rounded(idx, y, values_ptr, tl.abs(old) / safe, _dither(index, step), ZERO, LAST)
        idx = tl.where(g == 0, decayed, idx)
    return idx


@triton.jit
def _load_state(codes_ptrs, scales_ptrs, t, values, block_index, block_mask, even, odd, mask_e, mask_o,
                BITS: tl.constexpr):  # fmt: skip
    codes = tl.load(codes_ptrs + t).to(tl.pointer_type(tl.uint8))
    scales = tl.load(scales_ptrs + t).to(tl.pointer_type(tl.float32))
    scale = tl.load(scales + block_index, mask=block_mask, other=0.0)[:, None]
    return _decode(codes, even, mask_e, values, scale, BITS, False), _decode(codes, odd, mask_o, values, scale, BITS, True)


@triton.jit
def _store_state(x_e, x_o, g_e, g_o, old_e, old_o, base, step, codes_ptrs, scales_ptrs, t, values, thresholds,
                 block_index, block_mask, even, odd, mask_e, mask_o, BITS: tl.constexpr, LOG2: tl.constexpr,
                 ZERO: tl.constexpr, LAST: tl.constexpr, DECAYS: tl.constexpr):  # fmt: skip
    codes = tl.load(codes_ptrs + t).to(tl.pointer_type(tl.uint8))
    scales = tl.load(scales_ptrs + t).to(tl.pointer_type(tl.float32))
    x_e = tl.where(mask_e, x_e, 0.0)
    x_o = tl.where(mask_o, x_o, 0.0)
    scale = tl.maximum(tl.max(tl.abs(x_e), axis=1), tl.max(tl.abs(x_o), axis=1))
    tl.store(scales + block_index, scale, mask=block_mask)
    i_e = _encode_state(x_e, scale[:, None], g_e, old_e, base + even, step, thresholds, values, LOG2, ZERO, LAST, DECAYS)
    i_o = _encode_state(x_o, scale[:, None], g_o, old_o, base + odd, step, thresholds, values, LOG2, ZERO, LAST, DECAYS)
    if BITS == 8:
        tl.store(codes + even, i_e.to(tl.uint8), mask=mask_e)
        tl.store(codes + odd, i_o.to(tl.uint8), mask=mask_o)
    else:
        # An odd tail element's high nibble is 0, as the reference packs it.
        i_o = tl.where(mask_o, i_o, 0)
        tl.store(codes + even // 2, (i_e | (i_o << 4)).to(tl.uint8), mask=mask_e)


@triton.jit
def _quantized_kernel(
    p_ptrs, g_ptrs, c0_ptrs, a0_ptrs, c1_ptrs, a1_ptrs, c2_ptrs, a2_ptrs,
    chunk_tensor, chunk_start, numels, scalars, dither_keys,
    values0, thresholds0, values1, thresholds1, values2, thresholds2,
    K: tl.constexpr, P_DTYPE: tl.constexpr, RULE: tl.constexpr, N_STATES: tl.constexpr, FLAGS: tl.constexpr,
    MAXIMIZE: tl.constexpr, BITS: tl.constexpr, BS: tl.constexpr, NB: tl.constexpr,
    LOG2_0: tl.constexpr, ZERO_0: tl.constexpr, LAST_0: tl.constexpr, DECAYS_0: tl.constexpr,
    LOG2_1: tl.constexpr, ZERO_1: tl.constexpr, LAST_1: tl.constexpr, DECAYS_1: tl.constexpr,
    LOG2_2: tl.constexpr, ZERO_2: tl.constexpr, LAST_2: tl.constexpr, DECAYS_2: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    t = tl.load(chunk_tensor + c)
    start = tl.load(chunk_start + c)
    n = tl.load(numels + t)
    p_ptr = tl.load(p_ptrs + t).to(tl.pointer_type(P_DTYPE))
    g_ptr = tl.load(g_ptrs + t).to(tl.pointer_type(P_DTYPE))

    blk = tl.arange(0, NB)
    block_index = start // BS + blk  # int64
    block_mask = block_index * BS < n
    even = start + blk[:, None] * BS + 2 * tl.arange(0, BS // 2)[None, :]
    odd = even + 1
    mask_e = even < n
    mask_o = odd < n

    s0_e, s0_o = _load_state(c0_ptrs, a0_ptrs, t, values0, block_index, block_mask, even, odd, mask_e, mask_o, BITS)
    s1_e, s1_o = s0_e, s0_o
    s2_e, s2_o = s0_e, s0_o
    if N_STATES > 1:
        s1_e, s1_o = _load_state(c1_ptrs, a1_ptrs, t, values1, block_index, block_mask, even, odd, mask_e, mask_o, BITS)
    if N_STATES > 2:
        s2_e, s2_o = _load_state(c2_ptrs, a2_ptrs, t, values2, block_index, block_mask, even, odd, mask_e, mask_o, BITS)

    p_e = tl.load(p_ptr + even, mask=mask_e, other=0.0).to(tl.float32)
    p_o = tl.load(p_ptr + odd, mask=mask_o, other=0.0).to(tl.float32)
    g_e = tl.load(g_ptr + even, mask=mask_e, other=0.0).to(tl.float32)
    g_o = tl.load(g_ptr + odd, mask=mask_o, other=0.0).to(tl.float32)
    if MAXIMIZE:
        g_e = -g_e
        g_o = -g_o
    cp = scalars + t * K
    # The decay rounding's dither key: this tensor's step and the global index of its element 0.
    step = tl.load(dither_keys + 2 * t)
    base = tl.load(dither_keys + 2 * t + 1)
    o0_e, o0_o, o1_e, o1_o, o2_e, o2_o = s0_e, s0_o, s1_e, s1_o, s2_e, s2_o
    new_e, s0_e, s1_e, s2_e = rule_update(p_e, g_e, s0_e, s1_e, s2_e, cp, RULE, FLAGS, True, N_STATES)
    new_o, s0_o, s1_o, s2_o = rule_update(p_o, g_o, s0_o, s1_o, s2_o, cp, RULE, FLAGS, True, N_STATES)
    bad_e = skipped_elements(g_e, s0_e, s1_e, s2_e, N_STATES)
    bad_o = skipped_elements(g_o, s0_o, s1_o, s2_o, N_STATES)
    tl.store(p_ptr + even, to_param_dtype(tl.where(bad_e, p_e, new_e), P_DTYPE), mask=mask_e)
    tl.store(p_ptr + odd, to_param_dtype(tl.where(bad_o, p_o, new_o), P_DTYPE), mask=mask_o)

    _store_state(tl.where(bad_e, 0.0, s0_e), tl.where(bad_o, 0.0, s0_o), g_e, g_o, o0_e, o0_o, base, step, c0_ptrs,
                 a0_ptrs, t, values0, thresholds0, block_index, block_mask, even, odd, mask_e, mask_o, BITS, LOG2_0,
                 ZERO_0, LAST_0, DECAYS_0)  # fmt: skip
    if N_STATES > 1:
        _store_state(tl.where(bad_e, 0.0, s1_e), tl.where(bad_o, 0.0, s1_o), g_e, g_o, o1_e, o1_o, base, step,
                     c1_ptrs, a1_ptrs, t, values1, thresholds1, block_index, block_mask, even, odd, mask_e, mask_o,
                     BITS, LOG2_1, ZERO_1, LAST_1, DECAYS_1)  # fmt: skip
    if N_STATES > 2:
        _store_state(tl.where(bad_e, 0.0, s2_e), tl.where(bad_o, 0.0, s2_o), g_e, g_o, o2_e, o2_o, base, step,
                     c2_ptrs, a2_ptrs, t, values2, thresholds2, block_index, block_mask, even, odd, mask_e, mask_o,
                     BITS, LOG2_2, ZERO_2, LAST_2, DECAYS_2)  # fmt: skip


_PADDED: dict[tuple[str, torch.device], tuple[Tensor, Tensor, int]] = {}


def _padded_book(book, device: torch.device) -> tuple[Tensor, Tensor, int]:
    """(values, midpoints padded with +inf to a power of two, log2 of that length)."""
    key = (book.name, device)
    books = tracing.cache(_PADDED)
    if key not in books:
        thr = book.thresholds.to(device=device, dtype=torch.float32)
        log2 = max(1, (thr.numel()).bit_length())
        padded = torch.full((1 << log2,), float("inf"), dtype=torch.float32, device=device)
        padded[: thr.numel()] = thr
        books[key] = (book.values.to(device=device, dtype=torch.float32), padded, log2)
    return books[key]


def quantized(rule: Rule, cache: TableCache, key: str, params, grads, states, steps: Sequence[int],
              hp: Mapping[str, Any], offsets: Sequence[int] | None = None) -> None:  # fmt: skip
    """One launch per (param dtype, formats) for params whose states are all QuantizedStates of
    one bit width and a block size dividing :data:`CHUNK` (``kernels.select`` checked that);
    ``offsets[i]``: the flat index of param ``i``'s element 0 in its whole tensor (default 0)."""
    offsets = [0] * len(params) if offsets is None else offsets
    kinds = rule.states(hp)
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        if p.numel():
            groups.setdefault((p.dtype, tuple(q.format for q in states[i])), []).append(i)
    for (dtype, formats), idx in groups.items():
        ps = [params[i] for i in idx]
        device = ps[0].device
        n = len(formats)
        chunk = chunk_size()
        table = cache.chunks(ps, chunk)
        scalars, width = _scalar_table(cache, rule, hp, [steps[i] for i in idx], True, device)
        keys = cache.ints([v for i in idx for v in (steps[i], offsets[i])], device)
        k = f"{key}/{rule.name}/{dtype}/" + "/".join(f.name for f in formats)
        pointers, books, consts = [], [], {}
        for j in range(3):
            s = min(j, n - 1)
            pointers += [cache.addresses(f"{k}/c{j}", [states[i][s].codes for i in idx], device),
                         cache.addresses(f"{k}/a{j}", [states[i][s].absmax for i in idx], device)]  # fmt: skip
            values, thresholds, log2 = _padded_book(formats[s].book(device), device)
            books += [values, thresholds]
            book = formats[s].book("cpu")
            consts.update({f"LOG2_{j}": log2, f"ZERO_{j}": book.zero_index, f"LAST_{j}": book.thresholds.numel(),
                           f"DECAYS_{j}": kinds[s].decays})  # fmt: skip
        fmt = formats[0]
        tracing.launch(_quantized_kernel, (table.num_chunks,))(
            cache.addresses(k + "/p", ps, device), cache.addresses(k + "/g", [grads[i] for i in idx], device),
            *pointers, table.chunk_tensor, table.chunk_start, table.numel, scalars, keys, *books,
            K=width, P_DTYPE=TL_DTYPE[dtype], RULE=rule_id(rule), N_STATES=n, FLAGS=flag_bits(rule, hp),
            MAXIMIZE=bool(hp["maximize"]), BITS=fmt.bits, BS=fmt.block_size, NB=chunk // fmt.block_size, **consts,
        )  # fmt: skip
