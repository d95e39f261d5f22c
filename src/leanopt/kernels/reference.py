"""The update rules as plain tensor maths, one parameter at a time.

This module *is* the definition of each algorithm in leanopt: every faster backend is tested
against it. Maths runs in fp32 (or fp64 for fp64 params); bf16/fp16 params are upcast for the
update and rounded back once at the end.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _compute_dtype(p: Tensor) -> torch.dtype:
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def adamw_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    max_exp_avg_sq: Tensor | None,
    step: int,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
) -> None:
    """One AdamW update of ``param`` in place; ``step`` is the 1-based step count after this update.

    Same operation order as ``torch.optim.AdamW`` (single-tensor path), so fp32/fp64 results
    agree with torch to rounding: decoupled decay first, ``m.lerp_(g, 1-b1)``,
    ``v = b2 v + (1-b2) g^2``, ``p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)``.
    ``exp_avg``/``exp_avg_sq`` must already be in the compute dtype.
    """
    ct = _compute_dtype(param)
    low_precision = param.dtype != ct
    p = param.to(ct) if low_precision else param
    g = grad.to(ct)
    if maximize:
        g = -g
    if weight_decay != 0:
        p.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    if max_exp_avg_sq is not None:
        torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
        denom = (max_exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    else:
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    p.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
    if low_precision:
        param.copy_(p)


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

    if relative_step:
        rho = min(1e-6 * step if warmup_init else 1e-2, 1.0 / math.sqrt(step))
    else:
        assert lr is not None
        rho = lr
    # max(eps2, RMS) * rho as a 0-d tensor on the param's device (no host sync); the floor
    # eps2 * rho is formed in double and rounded once, as transformers' python float is.
    step_size: float | Tensor = (
        _root_mean_square(p).mul_(rho).clamp_(min=eps2 * rho) if scale_parameter else rho
    )

    beta2t = 1.0 - math.pow(step, decay_rate)
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
