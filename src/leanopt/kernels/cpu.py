"""CPU fast paths of the update rules.

* AdamW whose states have the param's dtype (fp32, fp64 params): torch's own fused CPU
  kernel (``aten::_fused_adamw_``): one vectorised pass over all tensors of a group.
* Everything else: the reference function compiled once by Inductor with dynamic shapes,
  so a model's many shapes share one compiled kernel (no per-shape recompiles). Without a
  working compiler the reference runs eagerly; :func:`compiled` records why.
* Adafactor: the reference rule regrouped into three passes over cache-sized row blocks
  and ``torch._foreach_*`` ops, not compiled (see :func:`adafactor`): nothing to compile
  on the first step.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from leanopt.kernels import reference
from leanopt.quant.formats import TOWARD_ZERO_TOLERANCE

log = logging.getLogger(__name__)

# Why compiling failed (None while it works): reported by leanopt.kernels.describe().
COMPILE_ERROR: str | None = None


def _compile_disabled() -> bool:
    return os.environ.get("LEANOPT_NO_COMPILE", "") not in ("", "0")


def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` compiled with dynamic shapes on first call; ``fn`` itself if compiling fails."""
    state: dict[str, Any] = {}

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        global COMPILE_ERROR
        impl = state.get("impl")
        if impl is None:
            impl = fn
            if not _compile_disabled():
                impl = torch.compile(fn, dynamic=True, fullgraph=True)
            state["impl"] = impl
        if impl is fn:
            return fn(*args, **kwargs)
        try:
            return impl(*args, **kwargs)
        except Exception as err:  # no C++ compiler, unsupported platform...
            COMPILE_ERROR = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            log.warning("leanopt: compiling %s failed, using the reference (%s)", fn.__name__, COMPILE_ERROR)
            state["impl"] = fn
            return fn(*args, **kwargs)

    return run


def _adamw_tensor(p, g, m, v, vmax, step_size, bc2_sqrt, decay, beta1, beta2, eps, maximize: bool, amsgrad: bool):
    # The reference rule on tensors; scalars arrive as 0-dim fp64 tensors so that a new step
    # or lr doesn't recompile.
    pf = p.float()
    gf = g.float()
    if maximize:
        gf = -gf
    pf = pf * decay
    m.lerp_(gf, 1 - beta1)
    v.mul_(beta2).addcmul_(gf, gf, value=1 - beta2)
    if amsgrad:
        torch.maximum(vmax, v, out=vmax)
        denom = vmax.sqrt() / bc2_sqrt + eps
    else:
        denom = v.sqrt() / bc2_sqrt + eps
    pf = pf - step_size * (m / denom)
    p.copy_(pf)


_adamw_compiled = compiled(_adamw_tensor)


def adamw(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    max_exp_avg_sqs: Sequence[Tensor] | None,
    step_tensors: Sequence[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
) -> None:
    """AdamW over a list of CPU params; ``step_tensors`` already hold the new step."""
    same: list[int] = []
    mixed: list[int] = []
    for i, p in enumerate(params):
        if p.numel() == 0:
            continue
        fusable = exp_avgs[i].dtype == p.dtype == grads[i].dtype and not grads[i].is_sparse
        (same if fusable else mixed).append(i)
    amsgrad = max_exp_avg_sqs is not None
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i in same:
        by_dtype.setdefault(params[i].dtype, []).append(i)
    for idx in by_dtype.values():
        pick = lambda seq: [seq[i] for i in idx]  # noqa: E731
        torch._fused_adamw_(
            pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs),
            pick(max_exp_avg_sqs) if amsgrad else [], pick(step_tensors),
            lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=amsgrad, maximize=maximize,
        )  # fmt: skip
    for i in mixed:
        step = int(step_tensors[i].item())
        scalars = [
            torch.tensor(lr / (1 - beta1**step), dtype=torch.float64),
            torch.tensor((1 - beta2**step) ** 0.5, dtype=torch.float64),
            torch.tensor(1 - lr * weight_decay, dtype=torch.float64),
        ]
        _adamw_compiled(
            params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], max_exp_avg_sqs[i] if amsgrad else None,
            *scalars, beta1, beta2, eps, maximize, amsgrad,
        )  # fmt: skip


# ---- Adafactor --------------------------------------------------------------------------------
# Elements per row block of a factored param. A block's temporaries live in a reused
# workspace (no page faults from fresh allocations every step) and in cache, so each pass
# reads the gradient from memory once. 2^20 fp32 elements = 4 MiB: a few fit in this
# machine's L3 (32 MiB), and a 768 x 768 matrix is one block.
ADAFACTOR_BLOCK = 1 << 20

_workspaces = threading.local()


def _workspace(slot: int, numel: int, dtype: torch.dtype) -> Tensor:
    """A reused flat buffer of at least ``numel`` elements (one per thread, slot and dtype)."""
    key = (slot, dtype)
    pool = _workspaces.__dict__.setdefault("pool", {})
    buf = pool.get(key)
    if buf is None or buf.numel() < numel:
        buf = pool[key] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


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
        vs = [exp_avg_sqs[i] for i in unfactored]
        sq = torch._foreach_mul(gs, gs)
        torch._foreach_add_(sq, eps1)
        torch._foreach_mul_(vs, beta2t)
        torch._foreach_add_(vs, sq, alpha=1.0 - beta2t)
        updates = torch._foreach_rsqrt(vs)
        torch._foreach_mul_(updates, gs)
        # Squared norms, not sums of squares: the reference's reduction, rounded the same way.
        for i, norm in zip(unfactored, torch._foreach_norm(updates)):
            update_sq[i] = norm.square()
    for i, f in factored.items():
        update_sq[i] = f.stats(eps1, beta2t)

    # The reference: RMS(u) / clip_threshold, at least 1, divides the update.
    clip = torch.stack(update_sq).sqrt_().div_(sqrt_numel).div_(clip_threshold).clamp_(min=1.0)
    decay = step_size * -weight_decay if weight_decay != 0 and scale_parameter else None
    clips, steps = clip.tolist(), step_size.tolist()

    if unfactored:
        ps = [params[i] for i in unfactored]
        pfs = [p.to(ct) for p in ps]
        torch._foreach_div_(updates, [clips[i] for i in unfactored])
        torch._foreach_mul_(updates, [steps[i] for i in unfactored])
        if beta1 is not None:
            ms = [exp_avgs[i] for i in unfactored]
            torch._foreach_mul_(ms, beta1)
            torch._foreach_add_(ms, updates, alpha=1 - beta1)
            updates = ms  # type: ignore[assignment]
        if decay is not None:
            # (step_size * -wd) rounded to the compute dtype first, as the reference does.
            torch._foreach_addcmul_(pfs, pfs, [decay[i] for i in unfactored])
        elif weight_decay != 0:
            torch._foreach_add_(pfs, pfs, alpha=-weight_decay * rho)
        torch._foreach_sub_(pfs, updates)
        for p, pf in zip(ps, pfs):
            if pf is not p:
                p.copy_(pf)
    for i, f in factored.items():
        f.apply(
            -steps[i] / clips[i],
            exp_avgs[i] if beta1 is not None else None,
            beta1 or 0.0,
            decay[i] if decay is not None else None,
            -weight_decay * rho if weight_decay != 0 and not scale_parameter else 0.0,
        )


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
        self.spans = [(i, min(i + rows, n)) for i in range(0, n, rows)]
        self.block_shape = (batch, rows, m)
        self.row_factor = self.col_factor = torch.empty(0)

    def _block(self, slot: int, rows: int) -> Tensor:
        batch, _, m = self.block_shape
        return _workspace(slot, batch * rows * m, self.ct).view(batch, rows, m)

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


# ---- AdamW with block-quantized moments (AdamW8bit / AdamW4bit) ---------------------------
def _adam_safe(pf, gf, m, v, step_size, bc2_sqrt, decay, floor_div, beta1: float, beta2: float, eps: float):
    # reference.adamw_quantized_'s elementwise rule on fp32 tensors, without host syncs:
    # second-moment floor, and non-finite elements skipped (param kept, moments zeroed).
    pn = pf * decay
    m = m.lerp(gf, 1 - beta1)
    v = v * beta2 + (1 - beta2) * gf * gf
    v = torch.maximum(v, m * m / floor_div)
    bad = ~(torch.isfinite(m) & torch.isfinite(v))
    m = torch.where(bad, 0.0, m)
    v = torch.where(bad, 0.0, v)
    pn = pn - step_size * (m / (v.sqrt() / bc2_sqrt + eps))
    return torch.where(bad, pf, pn), m, v


def _dense_safe_tensor(p, g, m, v, step_size, bc2_sqrt, decay, floor_div, beta1: float, beta2: float, eps: float,
                       maximize: bool):  # fmt: skip
    gf = -g.float() if maximize else g.float()
    pn, m_new, v_new = _adam_safe(p.float(), gf, m, v, step_size, bc2_sqrt, decay, floor_div, beta1, beta2, eps)
    p.copy_(pn)
    m.copy_(m_new)
    v.copy_(v_new)


def _unpack(codes, n: int, bits: int):
    if bits == 8:
        return codes.long()
    return torch.stack([codes & 15, codes >> 4], 1).view(-1)[:n].long()


def _pack(idx, n: int, bits: int):
    idx = idx.to(torch.uint8)
    if bits == 8:
        return idx
    pairs = torch.nn.functional.pad(idx, (0, n % 2)).view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def _quantized_tensor(p, g, mc, ma, vc, va, m_values, m_thresholds, v_values, v_thresholds,
                      step_size, bc2_sqrt, decay, floor_div, beta1: float, beta2: float, eps: float,
                      maximize: bool, bits: int, block: int, m_zero: int):  # fmt: skip
    # Dequantize -> update -> requantize in one compiled graph (Inductor fuses it into a few
    # loops over memory); same maths as reference.adamw_quantized_ and formats.BlockFormat.
    n = p.numel()
    nb = ma.numel()
    pad = nb * block - n
    m = (torch.nn.functional.pad(m_values[_unpack(mc, n, bits)], (0, pad)).view(nb, block) * ma.view(nb, 1)).view(-1)[:n]
    v = (torch.nn.functional.pad(v_values[_unpack(vc, n, bits)], (0, pad)).view(nb, block) * va.view(nb, 1)).view(-1)[:n]
    pf = p.view(-1).float()
    gf = -g.view(-1).float() if maximize else g.view(-1).float()
    pn, m, v = _adam_safe(pf, gf, m, v, step_size, bc2_sqrt, decay, floor_div, beta1, beta2, eps)
    p.view(-1).copy_(pn)
    mb = torch.nn.functional.pad(m, (0, pad)).view(nb, block)
    vb = torch.nn.functional.pad(v, (0, pad)).view(nb, block)
    m_scale = mb.abs().amax(1)
    v_scale = vb.amax(1)
    my = (mb / torch.where(m_scale > 0, m_scale, 1.0).view(nb, 1)).view(-1)[:n]
    vy = (vb / torch.where(v_scale > 0, v_scale, 1.0).view(nb, 1)).view(-1)[:n]
    mi = torch.searchsorted(m_thresholds, my)
    # Where the gradient is 0, momentum rounds toward zero (reference: ``toward_zero``).
    over = (gf == 0) & (m_values[mi].abs() > my.abs() * TOWARD_ZERO_TOLERANCE) & (mi != m_zero)
    mi = torch.where(over, mi - torch.sign(mi - m_zero), mi)
    mc.copy_(_pack(mi, n, bits))
    vc.copy_(_pack(torch.searchsorted(v_thresholds, vy), n, bits))
    ma.copy_(m_scale)
    va.copy_(v_scale)


_dense_safe_compiled = compiled(_dense_safe_tensor)
_quantized_compiled = compiled(_quantized_tensor)


def adamw_quantized(params, grads, exp_avgs, exp_avg_sqs, steps, floor_divs, *, lr, beta1, beta2, eps, weight_decay,
                    maximize) -> None:  # fmt: skip
    """AdamW8bit/4bit's rule on CPU params; each moment is a QuantizedState or a dense fp32 tensor."""
    from leanopt.quant import QuantizedState

    decay = torch.tensor(1 - lr * weight_decay, dtype=torch.float64)
    for i, p in enumerate(params):
        if p.numel() == 0:
            continue
        step = steps[i]
        scalars = (
            torch.tensor(lr / (1 - beta1**step), dtype=torch.float64),
            torch.tensor((1 - beta2**step) ** 0.5, dtype=torch.float64),
            decay,
            torch.tensor(floor_divs[i], dtype=torch.float64),
        )
        m, v = exp_avgs[i], exp_avg_sqs[i]
        if isinstance(m, QuantizedState):
            bm, bv = m.format.book(p.device), v.format.book(p.device)
            _quantized_compiled(
                p, grads[i], m.codes, m.absmax, v.codes, v.absmax, bm.values, bm.thresholds, bv.values, bv.thresholds,
                *scalars, beta1, beta2, eps, maximize, m.format.bits, m.format.block_size, bm.zero_index,
            )  # fmt: skip
        else:
            _dense_safe_compiled(p, grads[i], m, v, *scalars, beta1, beta2, eps, maximize)


__all__ = ["adafactor", "adamw", "adamw_quantized", "compiled", "reference"]
