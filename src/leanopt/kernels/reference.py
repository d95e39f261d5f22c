"""The update rules as plain tensor maths, one parameter at a time.

This module *is* the definition of each algorithm in leanopt: every faster backend is tested
against it. Maths runs in fp32 (or fp64 for fp64 params); bf16/fp16 params are upcast for the
update and rounded back once at the end.
"""

from __future__ import annotations


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
