"""Adafactor's CPU fast path: the reference rule regrouped into three passes over
cache-sized row blocks and ``torch._foreach_*`` ops, not compiled (nothing to compile on the
first step)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from leanopt import tracing
from leanopt.kernels.cpu import spread, workspace

# Elements per row block of a factored param. A block's temporaries live in a reused
# workspace (no page faults from fresh allocations every step) and in cache, so each pass
# reads the gradient from memory once. 2^20 fp32 elements = 4 MiB: a few fit in this
# machine's L3 (32 MiB), and a 768 x 768 matrix is one block.
ADAFACTOR_BLOCK = 1 << 20

def _held(states: Sequence[Tensor | None], idx: Sequence[int], name: str) -> list[Tensor]:
    """The ``name`` states of params ``idx``, each of which holds one (the layout gives every
    < 2-D param an ``exp_avg_sq``, and every param an ``exp_avg`` when ``beta1`` is set)."""
    held = [s for i in idx if (s := states[i]) is not None]
    if len(held) != len(idx):
        raise ValueError(f"adafactor: {len(idx) - len(held)} of {len(idx)} unfactored params have no {name} state")
    return held


def adafactor(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor | None],
    exp_avg_sq_rows: Sequence[Tensor | None],
    exp_avg_sq_cols: Sequence[Tensor | None],
    exp_avg_sqs: Sequence[Tensor | None],
    rho: float,
    beta2t: float,
    *,
    eps1: float,
    eps2: float,
    clip_threshold: float,
    beta1: float | None,
    weight_decay: float,
    scale_parameter: bool,
) -> None:
    """Adafactor over CPU params that share one step (so one ``rho_t`` and one ``beta2_t``).

    Params must be contiguous and non-empty, gradients contiguous, states in the compute
    dtype (fp32, or fp64 for fp64 params): the dispatcher makes one call per compute dtype.

    The reference rule regrouped for fewer passes over memory, not compiled: compiling the
    reference with Inductor took ~30 s here for the first step and still read the gradient
    four times, once in a column-strided loop. ``RMS(p)`` of all params is one
    ``_foreach_norm`` (the reference's own reduction: the step size is bit-identical).
    Unfactored (< 2-D) params run the reference's ops through ``torch._foreach_*``. A
    factored param, seen as ``[B, n, m]``, is walked in row blocks of ``ADAFACTOR_BLOCK``
    elements whose temporaries live in a reused workspace:

    1. ``s = g^2`` -> row and column sums (``mean(g^2 + eps1) = sum(g^2) / len + eps1``), the
       row/column EMAs, ``r^2 = mean(R) / R`` and ``c^2 = 1 / C``;
    2. ``sum(u^2) = r^2 . (s @ c^2)``: one matrix-vector product on the ``s`` still in the
       workspace (recomputed per block for params of several blocks); ``u`` is never formed;
    3. ``p += -(alpha / clip) (g * c) * r`` as one ``addcmul``, after weight decay; with
       ``beta1`` the same product goes into ``exp_avg`` and ``p -= exp_avg``.

    Memory traffic for an fp32 param of one block: g read twice, p read twice and written
    once, 20 B/param (24 with several blocks), where the eager reference makes 11 full passes
    and allocates a full-size temporary. The sums run in other orders than the reference's,
    so results differ from it by rounding; on tensors of millions of elements the
    reference's fp32 ``vector_norm`` of the update drifts (3e-4 relative measured on 8M
    elements) while the matrix-vector product here stayed within 1e-7 of the fp64 value.
    """
    if not params:
        return
    ct = torch.float64 if params[0].dtype == torch.float64 else torch.float32
    sqrt_numel = torch.tensor([math.sqrt(p.numel()) for p in params], dtype=ct)
    if scale_parameter:
        # max(eps2, RMS(p)) * rho as reference.adafactor_ forms it: RMS * rho, clamped at eps2 * rho.
        norms = torch.stack(torch._foreach_norm(list(params), 2, dtype=ct))
        step_size = norms.div_(sqrt_numel).mul_(rho).clamp_(min=eps2 * rho)
    else:
        step_size = torch.full((len(params),), rho, dtype=ct)

    unfactored = [i for i, p in enumerate(params) if p.ndim < 2]
    factored = {
        i: _Factored(params[i], grads[i], exp_avg_sq_rows[i], exp_avg_sq_cols[i], ct)
        for i, p in enumerate(params)
        if p.ndim >= 2
    }
    update_sq = [torch.zeros((), dtype=ct)] * len(params)  # sum(u^2) of each param
    updates: list[Tensor] = []
    if unfactored:
        gs = [grads[i].to(ct) for i in unfactored]
        vs = _held(exp_avg_sqs, unfactored, "exp_avg_sq")
        sq = torch._foreach_mul(gs, gs)
        torch._foreach_add_(sq, eps1)
        torch._foreach_mul_(vs, beta2t)
        torch._foreach_add_(vs, sq, alpha=1.0 - beta2t)
        updates = list(torch._foreach_rsqrt(vs))
        torch._foreach_mul_(updates, gs)
        # Squared norms, not sums of squares: the reference's reduction, rounded the same way.
        for i, norm in zip(unfactored, torch._foreach_norm(updates)):
            update_sq[i] = norm.square()

    # The reference: RMS(u) / clip_threshold, at least 1, divides the update.
    def clip_of(sq: Tensor, i: int) -> Tensor:
        return sq.sqrt().div_(sqrt_numel[i]).div_(clip_threshold).clamp_(min=1.0)

    decay = step_size * -weight_decay if weight_decay != 0 and scale_parameter else None
    steps = step_size.tolist()
    clips = [clip_of(update_sq[i], i).item() if p.ndim < 2 else 0.0 for i, p in enumerate(params)]

    if unfactored:
        ps = [params[i] for i in unfactored]
        pfs = [p.to(ct) for p in ps]
        torch._foreach_div_(updates, [clips[i] for i in unfactored])
        torch._foreach_mul_(updates, [steps[i] for i in unfactored])
        if beta1 is not None:
            ms = _held(exp_avgs, unfactored, "exp_avg")
            torch._foreach_mul_(ms, beta1)
            torch._foreach_add_(ms, updates, alpha=1 - beta1)
            updates = ms
        if decay is not None:
            # (step_size * -wd) rounded to the compute dtype first, as the reference does.
            torch._foreach_addcmul_(pfs, pfs, [decay[i] for i in unfactored])
        elif weight_decay != 0:
            torch._foreach_add_(pfs, pfs, alpha=-weight_decay * rho)
        torch._foreach_sub_(pfs, updates)
        for p, pf in zip(ps, pfs):
            if pf is not p:
                p.copy_(pf)

    def step_factored(i: int) -> None:
        # A factored param's passes need nothing of the other params' but the step size: each
        # param runs whole on one thread (cpu.spread), its clip its own.
        f = factored[i]
        clip = clip_of(f.stats(eps1, beta2t), i).item()
        f.apply(
            -steps[i] / clip,
            exp_avgs[i] if beta1 is not None else None,
            beta1 or 0.0,
            decay[i] if decay is not None else None,
            -weight_decay * rho if weight_decay != 0 and not scale_parameter else 0.0,
        )

    # Largest first, so that the threads end together.
    spread(step_factored, sorted(factored, key=lambda i: -params[i].numel()), choose=("adafactor", tuple(params[i].numel() for i in factored)))


class _Factored:
    """A factored param seen as ``[B, n, m]`` (B = prod(shape[:-2])), walked in row blocks."""

    def __init__(self, p: Tensor, g: Tensor, row: Tensor | None, col: Tensor | None, ct: torch.dtype) -> None:
        n, m = p.shape[-2], p.shape[-1]
        self.p = p.view(-1, n, m)
        batch = self.p.shape[0]
        self.g = g.view(batch, n, m)
        assert row is not None and col is not None
        self.row, self.col = row.view(batch, n), col.view(batch, m)
        self.ct = ct
        rows = min(n, max(1, ADAFACTOR_BLOCK // max(1, batch * m)))
        # Traced, the first block (full size) and the last (the rest): the same peak.
        self.spans = tracing.walked([(i, min(i + rows, n)) for i in range(0, n, rows)])
        self.block_shape = (batch, rows, m)
        self.row_factor = self.col_factor = torch.empty(0)

    def _block(self, slot: int, rows: int) -> Tensor:
        batch, _, m = self.block_shape
        return workspace(slot, batch * rows * m, self.ct).view(batch, rows, m)

    def _grad(self, lo: int, hi: int) -> Tensor:
        g = self.g[:, lo:hi]
        return g if g.dtype == self.ct else self._block(1, hi - lo).copy_(g)

    def _grad_sq(self, lo: int, hi: int) -> Tensor:
        g = self._grad(lo, hi)
        return torch.mul(g, g, out=self._block(0, hi - lo))

    def stats(self, eps1: float, beta2t: float) -> Tensor:
        """Pass 1 (second-moment EMAs, factors) and pass 2; returns ``sum(u^2)``."""
        batch, n, m = self.p.shape
        if len(self.spans) == 1:
            sq = self._grad_sq(0, n)
            row_sum, col_sum = sq.sum(dim=-1), sq.sum(dim=-2)
        else:
            row_sum = torch.empty(batch, n, dtype=self.ct)
            col_sum = torch.zeros(batch, m, dtype=self.ct)
            for lo, hi in self.spans:
                sq = self._grad_sq(lo, hi)
                torch.sum(sq, dim=-1, out=row_sum[:, lo:hi])
                col_sum.add_(sq.sum(dim=-2))
        # EMA of mean(g^2 + eps1) = sum(g^2) / len + eps1.
        one_minus_beta2t = 1.0 - beta2t
        self.row.mul_(beta2t).add_(row_sum, alpha=one_minus_beta2t / m).add_(one_minus_beta2t * eps1)
        self.col.mul_(beta2t).add_(col_sum, alpha=one_minus_beta2t / n).add_(one_minus_beta2t * eps1)
        row_sq = torch.div(self.row.mean(dim=-1, keepdim=True), self.row)  # r^2 = mean(R) / R
        col_sq = self.col.reciprocal()  # c^2 = 1 / C
        self.row_factor, self.col_factor = row_sq.sqrt().unsqueeze(-1), col_sq.sqrt().unsqueeze(-2)
        col_sq = col_sq.unsqueeze(-1)
        if len(self.spans) == 1:  # the block still holds g^2
            weighted = torch.matmul(sq, col_sq)
        else:
            weighted = torch.empty(batch, n, 1, dtype=self.ct)
            for lo, hi in self.spans:
                torch.matmul(self._grad_sq(lo, hi), col_sq, out=weighted[:, lo:hi])
        return torch.dot(row_sq.view(-1), weighted.view(-1))

    def apply(self, scale: float, exp_avg: Tensor | None, beta1: float, decay: Tensor | None, alpha_decay: float) -> None:
        """Pass 3: ``p -= scale' * (g * c) * r`` with ``scale = -step_size / clip``."""
        batch, n, m = self.p.shape
        col_factor, row_factor = self.col_factor, self.row_factor
        avg = exp_avg.view(batch, n, m) if exp_avg is not None else None
        for lo, hi in self.spans:
            gc = torch.mul(self._grad(lo, hi), col_factor, out=self._block(0, hi - lo))
            p = self.p[:, lo:hi]
            pf = p if p.dtype == self.ct else self._block(2, hi - lo).copy_(p)
            if decay is not None:
                pf.addcmul_(pf, decay)
            elif alpha_decay != 0:
                pf.add_(pf, alpha=alpha_decay)
            if avg is None:
                pf.addcmul_(gc, row_factor[:, lo:hi], value=scale)
            else:
                m_blk = avg[:, lo:hi].mul_(beta1).addcmul_(gc, row_factor[:, lo:hi], value=-(1 - beta1) * scale)
                pf.sub_(m_blk)
            if pf is not p:
                p.copy_(pf)
