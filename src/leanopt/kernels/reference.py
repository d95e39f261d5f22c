"""The update rules as plain tensor maths, one parameter at a time.

This module *is* the definition of each algorithm in leanopt: every faster backend is tested
against it. Maths runs in fp32 (or fp64 for fp64 params); bf16/fp16 params are upcast for the
update and rounded back once at the end.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from leanopt.kernels.rules import Rule, skipped_elements

if TYPE_CHECKING:
    from leanopt.quant import QuantizedState


def _compute_dtype(p: Tensor) -> torch.dtype:
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def adafactor_schedule(
    step: int, *, lr: float | None, decay_rate: float, relative_step: bool, warmup_init: bool
) -> tuple[float, float]:
    """``(rho_t, beta2_t)`` of step ``step`` (1-based), in double as transformers forms them."""
    if relative_step:
        rho = min(1e-6 * step if warmup_init else 1e-2, 1.0 / math.sqrt(step))
    else:
        assert lr is not None
        rho = lr
    return rho, 1.0 - math.pow(step, decay_rate)


def adafactor_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor | None,
    exp_avg_sq_row: Tensor | None,
    exp_avg_sq_col: Tensor | None,
    exp_avg_sq: Tensor | None,
    step: int,
    *,
    lr: float | None,
    eps1: float,
    eps2: float,
    clip_threshold: float,
    decay_rate: float,
    beta1: float | None,
    weight_decay: float,
    scale_parameter: bool,
    relative_step: bool,
    warmup_init: bool,
) -> None:
    """One Adafactor update of ``param`` in place; ``step`` is the 1-based step count after this update.

    Same rule and operation order as ``transformers.Adafactor``: step size
    ``rho_t = min(1e-6 t if warmup_init else 1e-2, 1/sqrt(t))`` (or ``lr``), times
    ``max(eps2, RMS(param))`` with ``scale_parameter``; second moment of ``g^2 + eps1`` with
    ``beta2_t = 1 - t^decay_rate``, factored into row/column means for ``ndim >= 2`` (pass
    ``exp_avg_sq_row``/``exp_avg_sq_col``) or full (pass ``exp_avg_sq``); the normalized
    gradient is clipped to RMS ``clip_threshold`` and scaled by the step size; with ``beta1``
    ``exp_avg`` is an EMA of that scaled update; decoupled decay ``p -= wd * lr * p``; ``p -= update``.
    States must already be in the compute dtype.
    """
    if param.numel() == 0:
        return  # the mean over an empty dim would put NaN in exp_avg_sq_col for nothing
    ct = _compute_dtype(param)
    low_precision = param.dtype != ct
    p = param.to(ct) if low_precision else param
    g = grad.to(ct)

    rho, beta2t = adafactor_schedule(
        step, lr=lr, decay_rate=decay_rate, relative_step=relative_step, warmup_init=warmup_init
    )
    # max(eps2, RMS) * rho as a 0-d tensor on the param's device (no host sync); the floor
    # eps2 * rho is formed in double and rounded once, as transformers' python float is.
    step_size: float | Tensor = (
        _root_mean_square(p).mul_(rho).clamp_(min=eps2 * rho) if scale_parameter else rho
    )

    update = g.square().add_(eps1)
    if exp_avg_sq_row is not None and exp_avg_sq_col is not None:
        exp_avg_sq_row.mul_(beta2t).add_(update.mean(dim=-1), alpha=1.0 - beta2t)
        exp_avg_sq_col.mul_(beta2t).add_(update.mean(dim=-2), alpha=1.0 - beta2t)
        # rsqrt(V) ~ rsqrt(R C / mean(R)) as an outer product, written into the dead g^2 buffer.
        row_factor = (exp_avg_sq_row / exp_avg_sq_row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
        col_factor = exp_avg_sq_col.unsqueeze(-2).rsqrt()
        torch.mul(row_factor, col_factor, out=update).mul_(g)
    else:
        assert exp_avg_sq is not None
        exp_avg_sq.mul_(beta2t).add_(update, alpha=1.0 - beta2t)
        torch.rsqrt(exp_avg_sq, out=update).mul_(g)

    update.div_((_root_mean_square(update) / clip_threshold).clamp_(min=1.0))
    update.mul_(step_size)
    if beta1 is not None:
        assert exp_avg is not None
        exp_avg.mul_(beta1).add_(update, alpha=1 - beta1)
        update = exp_avg

    if weight_decay != 0:
        if isinstance(step_size, Tensor):
            # -wd * lr rounded to the compute dtype first, as transformers' alpha is.
            p.addcmul_(p, step_size * -weight_decay)
        else:
            p.add_(p, alpha=-weight_decay * step_size)
    p.sub_(update)
    if low_precision:
        param.copy_(p)


def _root_mean_square(t: Tensor) -> Tensor:
    return torch.linalg.vector_norm(t) / math.sqrt(t.numel())


# ---- elementwise rules (kernels.rules), on dense or block-quantized states -------------------
def rule_step_(
    rule: Rule,
    param: Tensor,
    grad: Tensor,
    states: Sequence[QuantizedState | Tensor],
    step: int,
    hp: Mapping[str, Any],
    *,
    safe: bool,
    offset: int = 0,
) -> None:
    """One update of ``param`` by ``rule`` (:mod:`leanopt.kernels.rules`), in place; ``step`` is
    the 1-based step count after this update. The definition every fast backend is held to.

    Each state is a :class:`~leanopt.quant.QuantizedState` or a dense tensor in the compute
    dtype (updated in place). Quantized states are dequantized to the compute dtype, the rule
    runs, and they are requantized last: the step itself uses the full-precision states, so
    quantization error enters only through what is stored.

    ``safe`` (the low-bit optimizers, on all their params): the rule's second-moment floors
    apply, and an element of :func:`~leanopt.kernels.rules.skipped_elements` -- gradient
    NaN/Inf or so large that its square overflows the compute dtype (``|g| >= 2^64 ~ 1.845e19``
    in fp32, ``~1.34e154`` in fp64), or a new state not finite -- is left untouched for this
    step (no decay, no update) and its states are reset to 0. It is excluded before block
    scales are computed, so its block neighbours' scale, codes and params are exactly what they
    would be were it absent from the block (bitsandbytes does the same on CUDA; torchao 4-bit
    turns the whole block to NaN).

    Where the gradient is exactly 0, a quantized state whose kind ``decays`` (a first moment)
    is stored with the decay rounding of
    :meth:`~leanopt.quant.formats.BlockFormat.code_indices`: the nearest code where that is
    smaller than what the element held, else a dithered choice between the two codes around the
    value, so that the stored momentum decays by ``b1`` in expectation. Nearest rounding alone
    would put ``b1 m`` back on ``m``'s code wherever codes are more than ~20% apart (near 0 in
    every code) and keep the weight moving with no gradient; rounding toward zero (leanopt's
    earlier rule) drops a 4-bit momentum by at least one of its 7 levels per step, so it
    dies within a few steps instead of fp32's ~10 and the weight lags fp32's.

    ``offset``: the flat index of ``param``'s element 0 in the whole tensor (a shard's start,
    or a tail's): the decay rounding's dither is keyed on global indices, so a tensor updated
    in pieces stores the same codes as one updated whole.

    A bf16 state (``state_dtype=torch.bfloat16``) is read in the compute dtype and written back
    with the stochastic rounding of :mod:`leanopt.quant.bf16`: state ``j`` of element ``i`` (its
    global index, ``offset`` counted) rounded by the dither of ``i * len(states) + j`` and ``step``.

    Without ``safe`` and with dense states this is the rule as written (for AdamW:
    ``torch.optim.AdamW``'s single-tensor path, to rounding).
    """
    from leanopt.quant import QuantizedState
    from leanopt.quant.bf16 import state_dither, stochastic_bf16
    from leanopt.quant.formats import Decay, may_hold_true

    ct = _compute_dtype(param)
    p = param.to(dtype=ct, copy=True)
    g = grad.to(ct)
    if hp["maximize"]:
        g = -g
    # bf16 states (leanopt.quant.bf16) are read as the compute dtype and written back rounded.
    dense = [s.dequantize().to(ct) if isinstance(s, QuantizedState) else s.to(ct) if s.dtype == torch.bfloat16 else s
             for s in states]  # fmt: skip
    new_p, new = rule.apply(p, g, dense, rule.scalar_values(hp, step, safe), rule.flag_values(hp), safe)
    if safe:
        bad = skipped_elements(g, new)
        if may_hold_true(bad):
            new = [s.masked_fill(bad, 0.0) for s in new]
            new_p = torch.where(bad, p, new_p)
    param.copy_(new_p)
    zero_grad = None
    for j, (kind, state, old, value) in enumerate(zip(rule.states(hp), states, dense, new)):
        if isinstance(state, QuantizedState):
            # Decaying elements (gradient exactly 0) of a momentum: decay rounding, so that the
            # stored momentum decays as fp32's does in expectation; see BlockFormat.code_indices.
            decay = None
            if kind.decays:
                if zero_grad is None:
                    zero_grad = g == 0
                decay = Decay(zero_grad, old, step, offset)
            state.quantize_(value, decay=decay)
        elif state.dtype == torch.bfloat16:
            u = state_dither(value.numel(), offset, step, j, len(states), value.device).view(value.shape)
            state.copy_(stochastic_bf16(value.float(), u))
        else:
            state.copy_(value)


def partial_block(rule: Rule, p: Tensor, g: Tensor, states: Sequence[QuantizedState], step: int,
                  hp: Mapping[str, Any], offset: int, full: int) -> None:  # fmt: skip
    """Elements ``full:`` of the flat ``p``/``g`` (the last, partial block, independent of the
    others) by the reference, on views of the states; ``offset``: the flat index of element 0."""
    from leanopt.quant import QuantizedState

    fmt = states[0].format
    start, first = fmt.code_bytes(full), full // fmt.block_size
    tail = [QuantizedState(q.codes[start:], q.absmax[first:], q.format, (p.numel() - full,)) for q in states]
    rule_step_(rule, p[full:], g[full:], tail, step, hp, safe=True, offset=offset + full)
