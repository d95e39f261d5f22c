"""Adafactor as a handful of multi-tensor Triton launches per param group (fp32 maths).

Same rule as :func:`leanopt.kernels.reference.adafactor_`; parity is tested under
``TRITON_INTERPRET=1`` on the CPU (and on CUDA where available).

Layout. A factored param (``ndim >= 2``) is seen as ``B`` matrices ``[n, m]`` (``B`` = the
product of the leading dims) and cut into tiles of ``TILE_ROWS x TILE_COLS``; program ``k`` of
a tile launch owns tile ``k`` of the whole group (a table says which tensor; the tile's batch,
row block and column block follow from its index). Unfactored params (``ndim < 2``) are cut
into chunks of ``CHUNK`` elements, as in :mod:`leanopt.kernels.multi_tensor`. Shapes live in
small device tables, never in the compiled code: no per-shape recompiles, and one launch of
each kernel covers every tensor of a group and dtype.

Passes (factored; ``G = g^2 + eps1``):

1. ``_factored_stats`` (reads g, and p with ``scale_parameter``): per tile, row sums of G
   over the tile's columns and column sums over its rows go to scratch partials, and the
   tile's ``sum(p^2)`` to a per-tile partial. Partials instead of atomics: every sum is
   formed in a fixed order, so results are deterministic run to run.
2. ``_factored_finalize`` (tiny): per row chunk, the row EMA ``R = b2 R + (1-b2) mean(G)`` from
   the row partials and a partial sum of the new ``R`` (for ``mean(R)``); per column chunk,
   the column EMA from the column partials.
3. ``_factored_update_sq`` (reads g): ``u = rsqrt(R/mean(R)) rsqrt(C) g`` recomputed per tile,
   its ``sum(u^2)`` to a per-tile partial. ``u`` is never written.
4. ``_scalars`` (one program per tensor, all tensors of the group): sums the partials of its
   tensor into ``max(1, RMS(u)/clip)`` and the step size ``max(eps2, RMS(p)) rho``, kept in
   device memory for the next launch: no ``.item()``, no host sync.
5. ``_factored_apply`` (reads g, p, exp_avg; writes p, exp_avg): ``u`` again, divided by the
   clip, times the step size; first moment; weight decay; ``p -= u``; rounded once to the
   param dtype.

Unfactored params take two passes around the same ``_scalars`` launch:
``_unfactored_stats`` (second-moment EMA written, ``sum(u^2)`` and ``sum(p^2)`` partials) and
``_unfactored_apply``.

The update of a factored param depends on two global reductions in sequence (the column
sums, then ``RMS(u)``), so the gradient is read three times: bytes moved per fp32 param are
3 x 4 (g) + 2 x 4 (p read) + 4 (p written) = 24, plus 8 with ``beta1``; bf16 params and
gradients: 12 (+8). The floor of a one-pass update would be 12; the scratch traffic is
about ``N/TILE_ROWS + N/TILE_COLS`` floats, under 1% of N.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from leanopt import tracing
from leanopt.kernels.multi_tensor import ChunkTable, TableCache, _to_device
from leanopt.kernels.triton_common import TL_DTYPE, to_param_dtype

# Tile of a factored param: TILE_ROWS x TILE_COLS elements, loaded SUB_ROWS rows at a time.
TILE_ROWS = 128
TILE_COLS = 256
SUB_ROWS = 8
# Rows / columns finalised per program of _factored_finalize.
FIN_ROWS = 1024
FIN_COLS = 1024
# Elements per program of the unfactored kernels; partials summed per step by _scalars.
CHUNK = 2048
REDUCE_BLOCK = 1024

# Per-tensor int64 metadata of a factored param, one row each: n, m, row blocks, column blocks,
# B, first tile, offsets into the row partials, column partials, first finalize program,
# offset into the partial sums of R, finalize row chunks per batch.
# Fields of a factored tensor's row of the meta table (built by _layout), by offset.
META_ROWS: tl.constexpr = tl.constexpr(0)
META_COLS: tl.constexpr = tl.constexpr(1)
META_ROW_BLOCKS: tl.constexpr = tl.constexpr(2)
META_COL_BLOCKS: tl.constexpr = tl.constexpr(3)
META_BATCH: tl.constexpr = tl.constexpr(4)
META_FIRST_TILE: tl.constexpr = tl.constexpr(5)
META_ROW_PARTIALS: tl.constexpr = tl.constexpr(6)
META_COL_PARTIALS: tl.constexpr = tl.constexpr(7)
META_FIRST_FIN: tl.constexpr = tl.constexpr(8)
META_ROW_SUMS: tl.constexpr = tl.constexpr(9)
META_FIN_ROWS_PER_MATRIX: tl.constexpr = tl.constexpr(10)
META_WIDTH = 11
# Per-tensor fp32 scalars of this step, one row each: rho_t, eps2 * rho_t, beta2_t,
# 1 - beta2_t, sqrt(numel).
HP_WIDTH = 5


@triton.jit
def _tile_coords(k, tile_tensor, meta, META: tl.constexpr):
    t = tl.load(tile_tensor + k)
    mt = meta + t * META
    n = tl.load(mt + META_ROWS)
    m = tl.load(mt + META_COLS)
    nrb = tl.load(mt + META_ROW_BLOCKS)
    ncb = tl.load(mt + META_COL_BLOCKS)
    local = k - tl.load(mt + META_FIRST_TILE)
    cb = local % ncb
    rb = (local // ncb) % nrb
    b = local // (ncb * nrb)
    return t, mt, n, m, nrb, ncb, b, rb, cb


@triton.jit
def _row_mean(rsum, mt, b, n, RB: tl.constexpr):
    # mean(R) of batch b from the partial sums _factored_finalize left.
    nfr = tl.load(mt + META_FIN_ROWS_PER_MATRIX)
    base = rsum + tl.load(mt + META_ROW_SUMS) + b * nfr
    acc = tl.zeros([RB], dtype=tl.float32)
    for i in range(0, nfr, RB):
        offs = i + tl.arange(0, RB)
        acc += tl.load(base + offs, mask=offs < nfr, other=0.0)
    return tl.sum(acc, axis=0) / n.to(tl.float32)


@triton.jit
def _factored_stats(
    g_ptrs, p_ptrs, tile_tensor, meta, rowp, colp, psq, eps1,
    G_DTYPE: tl.constexpr, P_DTYPE: tl.constexpr, SCALE_PARAMETER: tl.constexpr,
    TR: tl.constexpr, TC: tl.constexpr, SR: tl.constexpr, META: tl.constexpr,
):  # fmt: skip
    k = tl.program_id(0)
    t, mt, n, m, nrb, ncb, b, rb, cb = _tile_coords(k, tile_tensor, meta, META)
    g_ptr = tl.load(g_ptrs + t).to(tl.pointer_type(G_DTYPE))
    p_ptr = tl.load(p_ptrs + t).to(tl.pointer_type(P_DTYPE))
    rowp_t = rowp + tl.load(mt + META_ROW_PARTIALS)
    cols = cb * TC + tl.arange(0, TC)
    cmask = cols < m
    col_acc = tl.zeros([TC], dtype=tl.float32)
    p_acc = tl.zeros([SR, TC], dtype=tl.float32)
    for r in range(0, tl.minimum(n - rb * TR, TR), SR):  # the tile's rows that exist
        rows = rb * TR + r + tl.arange(0, SR)
        rmask = rows < n
        mask = rmask[:, None] & cmask[None, :]
        offs = (b * n + rows)[:, None] * m + cols[None, :]
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        sq = tl.where(mask, g * g + eps1, 0.0)
        tl.store(rowp_t + (b * n + rows) * ncb + cb, tl.sum(sq, axis=1), mask=rmask)
        col_acc += tl.sum(sq, axis=0)
        if SCALE_PARAMETER:
            p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            p_acc += p * p
    tl.store(colp + tl.load(mt + META_COL_PARTIALS) + (b * nrb + rb) * m + cols, col_acc, mask=cmask)
    if SCALE_PARAMETER:
        tl.store(psq + k, tl.sum(tl.sum(p_acc, axis=1), axis=0))


@triton.jit
def _factored_finalize(
    row_ptrs, col_ptrs, fin_tensor, meta, hp, rowp, colp, rsum,
    FR: tl.constexpr, FC: tl.constexpr, META: tl.constexpr, HP: tl.constexpr,
):  # fmt: skip
    k = tl.program_id(0)
    t = tl.load(fin_tensor + k)
    mt = meta + t * META
    n = tl.load(mt + META_ROWS)
    m = tl.load(mt + META_COLS)
    batch = tl.load(mt + META_BATCH)
    nfr = tl.load(mt + META_FIN_ROWS_PER_MATRIX)
    local = k - tl.load(mt + META_FIRST_FIN)
    beta2t = tl.load(hp + t * HP + 2)
    one_minus_beta2t = tl.load(hp + t * HP + 3)
    if local < batch * nfr:
        # Rows [c*FR, (c+1)*FR) of batch b: R = b2 R + (1-b2) mean(G), and a partial sum of R.
        ncb = tl.load(mt + META_COL_BLOCKS)
        b = local // nfr
        c = local % nfr
        rows = c * FR + tl.arange(0, FR)
        rmask = rows < n
        idx = b * n + rows
        part = rowp + tl.load(mt + META_ROW_PARTIALS) + idx * ncb
        s = tl.zeros([FR], dtype=tl.float32)
        for col_block in range(0, ncb):
            s += tl.load(part + col_block, mask=rmask, other=0.0)
        row_ptr = tl.load(row_ptrs + t).to(tl.pointer_type(tl.float32))
        row = tl.load(row_ptr + idx, mask=rmask, other=0.0)
        row = row * beta2t + one_minus_beta2t * (s / m.to(tl.float32))
        tl.store(row_ptr + idx, row, mask=rmask)
        tl.store(rsum + tl.load(mt + META_ROW_SUMS) + b * nfr + c, tl.sum(tl.where(rmask, row, 0.0), axis=0))
    else:
        # Columns j of the flattened [B, m] column state: C = b2 C + (1-b2) mean(G). (Names
        # differ from the row branch: Triton wants a name to keep one type across branches.)
        nrb = tl.load(mt + META_ROW_BLOCKS)
        j = (local - batch * nfr) * FC + tl.arange(0, FC)
        jmask = j < batch * m
        j_batch = j // m
        col_part = colp + tl.load(mt + META_COL_PARTIALS) + j_batch * nrb * m + (j - j_batch * m)
        col_sum = tl.zeros([FC], dtype=tl.float32)
        for i in range(0, nrb):
            col_sum += tl.load(col_part + i * m, mask=jmask, other=0.0)
        col_ptr = tl.load(col_ptrs + t).to(tl.pointer_type(tl.float32))
        col = tl.load(col_ptr + j, mask=jmask, other=0.0)
        col = col * beta2t + one_minus_beta2t * (col_sum / n.to(tl.float32))
        tl.store(col_ptr + j, col, mask=jmask)


@triton.jit
def _factored_update_sq(
    g_ptrs, row_ptrs, col_ptrs, tile_tensor, meta, rsum, usq,
    G_DTYPE: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr, SR: tl.constexpr,
    META: tl.constexpr, RB: tl.constexpr,
):  # fmt: skip
    k = tl.program_id(0)
    t, mt, n, m, nrb, ncb, b, rb, cb = _tile_coords(k, tile_tensor, meta, META)
    row_mean = _row_mean(rsum, mt, b, n, RB)
    g_ptr = tl.load(g_ptrs + t).to(tl.pointer_type(G_DTYPE))
    row_ptr = tl.load(row_ptrs + t).to(tl.pointer_type(tl.float32))
    col_ptr = tl.load(col_ptrs + t).to(tl.pointer_type(tl.float32))
    cols = cb * TC + tl.arange(0, TC)
    cmask = cols < m
    col_factor = tl.rsqrt(tl.load(col_ptr + b * m + cols, mask=cmask, other=1.0))
    acc = tl.zeros([SR, TC], dtype=tl.float32)
    for r in range(0, tl.minimum(n - rb * TR, TR), SR):  # the tile's rows that exist
        rows = rb * TR + r + tl.arange(0, SR)
        rmask = rows < n
        mask = rmask[:, None] & cmask[None, :]
        row_factor = tl.rsqrt(tl.load(row_ptr + b * n + rows, mask=rmask, other=1.0) / row_mean)
        g = tl.load(g_ptr + (b * n + rows)[:, None] * m + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u = (row_factor[:, None] * col_factor[None, :]) * g
        acc += u * u
    tl.store(usq + k, tl.sum(tl.sum(acc, axis=1), axis=0))


@triton.jit
def _scalars(
    part_off, psq, usq, hp, out, clip_threshold,
    SCALE_PARAMETER: tl.constexpr, RB: tl.constexpr, HP: tl.constexpr,
):  # fmt: skip
    # Tensor t: the divisor max(1, RMS(u)/clip) and the step size max(eps2, RMS(p)) * rho.
    t = tl.program_id(0)
    lo = tl.load(part_off + t)
    hi = tl.load(part_off + t + 1)
    u_acc = tl.zeros([RB], dtype=tl.float32)
    p_acc = tl.zeros([RB], dtype=tl.float32)
    for i in range(lo, hi, RB):
        offs = i + tl.arange(0, RB)
        mask = offs < hi
        u_acc += tl.load(usq + offs, mask=mask, other=0.0)
        if SCALE_PARAMETER:
            p_acc += tl.load(psq + offs, mask=mask, other=0.0)
    rho = tl.load(hp + t * HP + 0)
    sqrt_numel = tl.load(hp + t * HP + 4)
    clip = tl.maximum(tl.sqrt(tl.sum(u_acc, axis=0)) / sqrt_numel / clip_threshold, 1.0)
    if SCALE_PARAMETER:
        step_size = tl.maximum(tl.sqrt(tl.sum(p_acc, axis=0)) / sqrt_numel * rho, tl.load(hp + t * HP + 1))
    else:
        step_size = rho
    tl.store(out + 2 * t, clip)
    tl.store(out + 2 * t + 1, step_size)


@triton.jit
def _finish(p_ptr, offs, mask, u, m_ptr, step_size, beta1, neg_weight_decay,
            P_DTYPE: tl.constexpr, BETA1: tl.constexpr, WEIGHT_DECAY: tl.constexpr):  # fmt: skip
    # First moment of the scaled update, decoupled decay, p -= u, one rounding to P_DTYPE.
    if BETA1:
        avg = tl.load(m_ptr + offs, mask=mask, other=0.0)
        avg = avg * beta1 + (1.0 - beta1) * u
        tl.store(m_ptr + offs, avg, mask=mask)
        u = avg
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if WEIGHT_DECAY:
        p = p + p * (step_size * neg_weight_decay)
    p = p - u
    tl.store(p_ptr + offs, to_param_dtype(p, P_DTYPE), mask=mask)


@triton.jit
def _factored_apply(
    p_ptrs, g_ptrs, m_ptrs, row_ptrs, col_ptrs, tile_tensor, meta, rsum, out,
    beta1, neg_weight_decay,
    P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, BETA1: tl.constexpr, WEIGHT_DECAY: tl.constexpr,
    TR: tl.constexpr, TC: tl.constexpr, SR: tl.constexpr, META: tl.constexpr, RB: tl.constexpr,
):  # fmt: skip
    k = tl.program_id(0)
    t, mt, n, m, nrb, ncb, b, rb, cb = _tile_coords(k, tile_tensor, meta, META)
    row_mean = _row_mean(rsum, mt, b, n, RB)
    clip = tl.load(out + 2 * t)
    step_size = tl.load(out + 2 * t + 1)
    p_ptr = tl.load(p_ptrs + t).to(tl.pointer_type(P_DTYPE))
    g_ptr = tl.load(g_ptrs + t).to(tl.pointer_type(G_DTYPE))
    m_ptr = tl.load(m_ptrs + t).to(tl.pointer_type(tl.float32))
    row_ptr = tl.load(row_ptrs + t).to(tl.pointer_type(tl.float32))
    col_ptr = tl.load(col_ptrs + t).to(tl.pointer_type(tl.float32))
    cols = cb * TC + tl.arange(0, TC)
    cmask = cols < m
    col_factor = tl.rsqrt(tl.load(col_ptr + b * m + cols, mask=cmask, other=1.0))
    for r in range(0, tl.minimum(n - rb * TR, TR), SR):  # the tile's rows that exist
        rows = rb * TR + r + tl.arange(0, SR)
        rmask = rows < n
        mask = rmask[:, None] & cmask[None, :]
        offs = (b * n + rows)[:, None] * m + cols[None, :]
        row_factor = tl.rsqrt(tl.load(row_ptr + b * n + rows, mask=rmask, other=1.0) / row_mean)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = (row_factor[:, None] * col_factor[None, :]) * g
        u = u / clip * step_size
        _finish(p_ptr, offs, mask, u, m_ptr, step_size, beta1, neg_weight_decay, P_DTYPE, BETA1, WEIGHT_DECAY)


@triton.jit(do_not_specialize=["part_base", "hp_base"])
def _unfactored_stats(
    p_ptrs, g_ptrs, v_ptrs, chunk_tensor, chunk_start, numels, hp, psq, usq, part_base, hp_base, eps1,
    P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, SCALE_PARAMETER: tl.constexpr,
    CHUNK: tl.constexpr, HP: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    t = tl.load(chunk_tensor + c)
    offs = tl.load(chunk_start + c) + tl.arange(0, CHUNK)
    mask = offs < tl.load(numels + t)
    row = hp + (hp_base + t) * HP
    g_ptr = tl.load(g_ptrs + t).to(tl.pointer_type(G_DTYPE))
    v_ptr = tl.load(v_ptrs + t).to(tl.pointer_type(tl.float32))
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=1.0)
    v = v * tl.load(row + 2) + tl.load(row + 3) * (g * g + eps1)
    tl.store(v_ptr + offs, v, mask=mask)
    u = tl.where(mask, tl.rsqrt(v) * g, 0.0)
    tl.store(usq + part_base + c, tl.sum(u * u, axis=0))
    if SCALE_PARAMETER:
        p_ptr = tl.load(p_ptrs + t).to(tl.pointer_type(P_DTYPE))
        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(psq + part_base + c, tl.sum(p * p, axis=0))


@triton.jit(do_not_specialize=["hp_base"])
def _unfactored_apply(
    p_ptrs, g_ptrs, m_ptrs, v_ptrs, chunk_tensor, chunk_start, numels, out, hp_base, beta1, neg_weight_decay,
    P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, BETA1: tl.constexpr, WEIGHT_DECAY: tl.constexpr,
    CHUNK: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    t = tl.load(chunk_tensor + c)
    offs = tl.load(chunk_start + c) + tl.arange(0, CHUNK)
    mask = offs < tl.load(numels + t)
    s = hp_base + t
    clip = tl.load(out + 2 * s)
    step_size = tl.load(out + 2 * s + 1)
    p_ptr = tl.load(p_ptrs + t).to(tl.pointer_type(P_DTYPE))
    g_ptr = tl.load(g_ptrs + t).to(tl.pointer_type(G_DTYPE))
    m_ptr = tl.load(m_ptrs + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(v_ptrs + t).to(tl.pointer_type(tl.float32))
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=1.0)
    u = tl.rsqrt(v) * g
    u = u / clip * step_size
    _finish(p_ptr, offs, mask, u, m_ptr, step_size, beta1, neg_weight_decay, P_DTYPE, BETA1, WEIGHT_DECAY)


@dataclass(frozen=True)
class _Layout:
    """Device tables of one group's shapes, and where each scratch array starts."""

    num_factored: int
    num_tiles: int
    num_fin: int
    tile_tensor: Tensor | None  # int32 [num_tiles]
    fin_tensor: Tensor | None  # int32 [num_fin]
    meta: Tensor | None  # int64 [num_factored, META_WIDTH]
    part_off: Tensor  # int64 [num_tensors + 1]: each tensor's range of sum(u^2)/sum(p^2) partials
    chunks: ChunkTable | None  # the unfactored params
    sizes: tuple[int, ...]  # rowp, colp, rsum, psq, usq, out
    tiles: tuple[int, int, int, int, int, int]


def _shape3(p: Tensor) -> tuple[int, int, int]:
    n, m = p.shape[-2], p.shape[-1]
    return (p.numel() // (n * m), n, m)


def _cached_layout(*key: Any) -> _Layout:
    """:func:`_layout`, kept as a real step keeps it (on the device, between steps); inside a
    memory trace in the trace's own cache, since its tables are fake there."""
    if tracing.active() is None:
        return _layout(*key)
    layouts = tracing.cache(_TRACED_LAYOUTS)
    if key not in layouts:
        layouts[key] = _layout.__wrapped__(*key)
    return layouts[key]


_TRACED_LAYOUTS: dict[tuple, _Layout] = {}  # only ever stands for the trace's own (tracing.cache)


@functools.lru_cache(maxsize=64)
def _layout(device: torch.device, factored: tuple, unfactored: tuple, tiles: tuple) -> _Layout:
    tr, tc, fr, fc, chunk, _ = tiles
    meta: list[list[int]] = []
    tile_tensor: list[int] = []
    fin_tensor: list[int] = []
    part_off: list[int] = []
    rowp = colp = rsum = 0
    for t, (batch, n, m) in enumerate(factored):
        nrb, ncb, nfr = -(-n // tr), -(-m // tc), -(-n // fr)
        ntiles = batch * nrb * ncb
        nfin = batch * nfr + -(-(batch * m) // fc)
        meta.append([n, m, nrb, ncb, batch, len(tile_tensor), rowp, colp, len(fin_tensor), rsum, nfr])
        part_off.append(len(tile_tensor))
        tile_tensor.extend([t] * ntiles)
        fin_tensor.extend([t] * nfin)
        rowp += batch * n * ncb
        colp += batch * nrb * m
        rsum += batch * nfr
    chunks = ChunkTable(unfactored, chunk, device) if unfactored else None
    if chunks is not None:
        starts = [0]
        for numel in unfactored[:-1]:
            starts.append(starts[-1] + -(-numel // chunk))
        part_off.extend(len(tile_tensor) + s for s in starts)
    num_parts = len(tile_tensor) + (chunks.num_chunks if chunks is not None else 0)
    part_off.append(num_parts)
    on = lambda values, dtype: _to_device(torch.tensor(values, dtype=dtype), device)  # noqa: E731
    # Each scratch array starts 16-byte aligned, so kernels specialise the same way every step.
    pad = lambda size: -(-size // 4) * 4  # noqa: E731
    return _Layout(
        num_factored=len(factored),
        num_tiles=len(tile_tensor),
        num_fin=len(fin_tensor),
        tile_tensor=on(tile_tensor, torch.int32) if factored else None,
        fin_tensor=on(fin_tensor, torch.int32) if factored else None,
        meta=on(meta, torch.int64) if factored else None,
        part_off=on(part_off, torch.int64),
        chunks=chunks,
        sizes=tuple(pad(x) for x in (rowp, colp, rsum, num_parts, num_parts, 2 * (len(factored) + len(unfactored)))),
        tiles=tiles,
    )


def adafactor(
    cache: TableCache,
    key: str,
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor | None],
    exp_avg_sq_rows: Sequence[Tensor | None],
    exp_avg_sq_cols: Sequence[Tensor | None],
    exp_avg_sqs: Sequence[Tensor | None],
    rhos: Sequence[float],
    beta2ts: Sequence[float],
    *,
    eps1: float,
    eps2: float,
    clip_threshold: float,
    beta1: float | None,
    weight_decay: float,
    scale_parameter: bool,
) -> None:
    """One set of launches per (param dtype, grad dtype) for params of one group and device.

    Params and grads contiguous and non-empty, states fp32 and contiguous; ``rhos[i]`` and
    ``beta2ts[i]`` are param i's ``rho_t`` and ``beta2_t`` of this step (params that skipped
    steps have their own).
    """
    by_dtype: dict[tuple[torch.dtype, torch.dtype], list[int]] = {}
    for i, p in enumerate(params):
        by_dtype.setdefault((p.dtype, grads[i].dtype), []).append(i)
    for (p_dtype, g_dtype), idx in by_dtype.items():
        factored = [i for i in idx if params[i].ndim >= 2]
        unfactored = [i for i in idx if params[i].ndim < 2]
        order = factored + unfactored
        device = params[idx[0]].device
        tiles = (TILE_ROWS, TILE_COLS, FIN_ROWS, FIN_COLS, CHUNK, SUB_ROWS)
        layout = _cached_layout(
            device,
            tuple(_shape3(params[i]) for i in factored),
            tuple(params[i].numel() for i in unfactored),
            tiles,
        )
        # Scalars of this step, formed in double on the host and rounded once (as the reference).
        hp: list[float] = []
        for i in order:
            hp += [rhos[i], eps2 * rhos[i], beta2ts[i], 1.0 - beta2ts[i], math.sqrt(params[i].numel())]
        hp_table = cache.floats(hp, device)
        scratch = torch.empty(sum(layout.sizes), dtype=torch.float32, device=device)
        rowp, colp, rsum, psq, usq, out = torch.split(scratch, list(layout.sizes))
        k = f"{key}/{p_dtype}/{g_dtype}"
        addresses = lambda name, tensors, sel: cache.addresses(f"{k}/{name}", [tensors[i] for i in sel], device)  # noqa: E731
        P, G = TL_DTYPE[p_dtype], TL_DTYPE[g_dtype]
        has_beta1 = beta1 is not None
        consts = dict(TR=TILE_ROWS, TC=TILE_COLS, SR=SUB_ROWS, META=META_WIDTH)

        if factored:
            f_p, f_g = addresses("fp", params, factored), addresses("fg", grads, factored)
            f_row, f_col = addresses("frow", exp_avg_sq_rows, factored), addresses("fcol", exp_avg_sq_cols, factored)
            grid = (layout.num_tiles,)
            tracing.launch(_factored_stats, grid)(
                f_g, f_p, layout.tile_tensor, layout.meta, rowp, colp, psq, eps1,
                G_DTYPE=G, P_DTYPE=P, SCALE_PARAMETER=scale_parameter, **consts,
            )  # fmt: skip
        if unfactored:
            ch = layout.chunks
            assert ch is not None
            u_p, u_g = addresses("up", params, unfactored), addresses("ug", grads, unfactored)
            u_v = addresses("uv", exp_avg_sqs, unfactored)
            tracing.launch(_unfactored_stats, (ch.num_chunks,))(
                u_p, u_g, u_v, ch.chunk_tensor, ch.chunk_start, ch.numel, hp_table, psq, usq,
                layout.num_tiles, len(factored), eps1,
                P_DTYPE=P, G_DTYPE=G, SCALE_PARAMETER=scale_parameter, CHUNK=CHUNK, HP=HP_WIDTH,
            )  # fmt: skip
        if factored:
            tracing.launch(_factored_finalize, (layout.num_fin,))(
                f_row, f_col, layout.fin_tensor, layout.meta, hp_table, rowp, colp, rsum,
                FR=FIN_ROWS, FC=FIN_COLS, META=META_WIDTH, HP=HP_WIDTH,
            )  # fmt: skip
            tracing.launch(_factored_update_sq, grid)(
                f_g, f_row, f_col, layout.tile_tensor, layout.meta, rsum, usq, G_DTYPE=G, RB=REDUCE_BLOCK, **consts
            )
        tracing.launch(_scalars, (len(order),))(
            layout.part_off, psq, usq, hp_table, out, clip_threshold,
            SCALE_PARAMETER=scale_parameter, RB=REDUCE_BLOCK, HP=HP_WIDTH,
        )  # fmt: skip
        flags = dict(BETA1=has_beta1, WEIGHT_DECAY=weight_decay != 0)
        scalars = (beta1 if has_beta1 else 0.0, -weight_decay)
        if factored:
            # Without beta1 the exp_avg table holds zeros and the kernel never reads it.
            f_m = addresses("fm", exp_avgs, factored)
            tracing.launch(_factored_apply, grid)(
                f_p, f_g, f_m, f_row, f_col, layout.tile_tensor, layout.meta, rsum, out, *scalars,
                P_DTYPE=P, G_DTYPE=G, RB=REDUCE_BLOCK, **flags, **consts,
            )  # fmt: skip
        if unfactored:
            ch = layout.chunks
            assert ch is not None  # _layout builds the chunk table whenever there are unfactored params
            u_m = addresses("um", exp_avgs, unfactored)
            tracing.launch(_unfactored_apply, (ch.num_chunks,))(
                u_p, u_g, u_m, u_v, ch.chunk_tensor, ch.chunk_start, ch.numel, out, len(factored), *scalars,
                P_DTYPE=P, G_DTYPE=G, CHUNK=CHUNK, **flags,
            )  # fmt: skip
