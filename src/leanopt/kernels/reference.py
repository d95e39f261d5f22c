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


# ---- AdamW on quantized states ----------------------------------------------------------------

# Slack on the second-moment floor below: fp32 rounding of an exact history may put m^2/K a few
# ulps above v (at step 1 the bound is an equality), and the floor must never touch such a state.
MOMENT_BOUND_SLACK = 1e-3


def adam_moment_bound(beta1: float, beta2: float, step: int) -> float:
    """``K_t``: the largest ``m_t^2 / v_t`` that Adam's moment estimates can reach at ``step``.

    With ``m_t = (1-b1) sum b1^(t-k) g_k`` and ``v_t = (1-b2) sum b2^(t-k) g_k^2``, Cauchy-Schwarz
    gives ``m_t^2 <= K_t v_t`` with ``K_t = (1-b1)^2/(1-b2) * sum_{j<t} (b1^2/b2)^j`` -- and
    ``K_{t+1} = (b1^2/b2) K_t + (1-b1)^2/(1-b2)``, so one exact step from a state that satisfies
    the bound satisfies the next one. ``inf`` when there is no finite bound (``b2 = 0``, or
    ``b1^2 >= b2`` for long enough to overflow).
    """
    if beta2 == 0.0:
        return math.inf
    base = (1.0 - beta1) ** 2 / (1.0 - beta2)
    r = beta1 * beta1 / beta2
    if r == 1.0:
        return base * step
    try:
        return base * (1.0 - r**step) / (1.0 - r)
    except OverflowError:
        return math.inf


def skipped_elements(g: Tensor, m: Tensor, v: Tensor) -> Tensor:
    """The elements :func:`adamw_quantized_` skips for a step (a bool mask), written once for
    every backend (the compiled CPU path traces this function; the Triton kernels spell out the
    same test in ``triton_common.skipped_elements``).

    ``g`` is the gradient in the compute dtype, ``m``/``v`` the new moments. An element is
    skipped where ``g * g`` computed in that dtype is not finite -- ``g`` NaN/Inf, or
    ``|g| >= sqrt(finfo.max)``: from ``2^64 ~ 1.845e19`` in fp32 (fp32, bf16 and fp16 params),
    ``~1.34e154`` in fp64 -- or where ``m`` or ``v`` is not finite. The square is tested on its
    own: ``v``'s ``(1 - b2) * g * g`` may be finite for larger ``|g|`` (up to ~5.8e20 with
    ``b2 = 0.999`` in fp32), depending only on the order of the multiplications.
    """
    return ~(torch.isfinite(g * g) & torch.isfinite(m) & torch.isfinite(v))


def adamw_quantized_(
    param: Tensor,
    grad: Tensor,
    exp_avg: "QuantizedState | Tensor",
    exp_avg_sq: "QuantizedState | Tensor",
    step: int,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
) -> None:
    """One AdamW update of ``param`` whose moments may be block-quantized; the rule of
    ``leanopt.AdamW8bit``/``AdamW4bit``.

    Each state is a :class:`~leanopt.quant.QuantizedState` or a dense tensor in the compute
    dtype (updated in place). The moments are dequantized to fp32 (fp64 for fp64 params), the
    update runs in :func:`adamw_`'s order, and the new moments are requantized last: the step
    itself uses the fp32 moments, so quantization error enters only through the stored state.
    With dense states and finite gradients the result is bit-identical to :func:`adamw_`.

    Additions to the fp32 rule (the first is a no-op on any state fp32 AdamW can reach):

    * **Second-moment floor (the v->0 hazard).** After the moment updates,
      ``v <- max(v, m^2 / K_t)`` with ``K_t`` from :func:`adam_moment_bound` (plus a 1e-3
      slack). Exact moments always satisfy ``m^2 <= K_t v``; quantized ones need not: when
      ``v / absmax`` falls under a code's smallest value it may round to 0 while ``m`` does
      not, and a later zero gradient then moves the weight by ``lr * m_hat / eps`` (19.5 seen
      in torchao 8-bit on CPU, 330 for bitsandbytes/torchao on a GPU). With the floor every
      step obeys fp32 AdamW's own worst case, ``|dp| <= lr * sqrt(K_t) * sqrt(1-b2^t) / (1-b1^t)``
      (about ``lr`` in the first steps, ``7.3 lr`` for betas (0.9, 0.999) later), whatever the
      code book and however the state was rounded or converted. The floored ``v`` is stored.
    * **Zero gradients.** Elements whose gradient is exactly 0 (sparse rows, dead units)
      store their decayed first moment rounded toward zero, not to the nearest code, so
      momentum dies out instead of sticking on a code and moving the weight forever.
    * **Non-finite gradients.** An element whose gradient is NaN/Inf or so large that its
      square overflows in the compute dtype (``|g| >= 2^64 ~ 1.845e19`` in fp32, ``~1.34e154``
      in fp64), or whose new moments are not finite (:func:`skipped_elements`), is left
      untouched for this step (no decay, no update) and both of its moments are reset to 0.
      It is excluded before the block scales are computed, so its block neighbours' scale,
      codes and params are exactly what they would be were it absent from the block, whichever
      of these reasons skipped it (bitsandbytes does the same on CUDA; torchao 4-bit turns the
      whole block to NaN).
    """
    from leanopt.quant import QuantizedState
    from leanopt.quant.formats import may_hold_true

    ct = _compute_dtype(param)
    p = param.to(dtype=ct, copy=True)
    g = grad.to(ct)
    if maximize:
        g = -g
    m = exp_avg.dequantize().to(ct) if isinstance(exp_avg, QuantizedState) else exp_avg
    v = exp_avg_sq.dequantize().to(ct) if isinstance(exp_avg_sq, QuantizedState) else exp_avg_sq
    if weight_decay != 0:
        p.mul_(1 - lr * weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bound = adam_moment_bound(beta1, beta2, step)
    if math.isfinite(bound):
        torch.maximum(v, m.square().div_(bound * (1 + MOMENT_BOUND_SLACK)), out=v)
    bad = skipped_elements(g, m, v)
    any_bad = may_hold_true(bad)
    if any_bad:
        m.masked_fill_(bad, 0.0)
        v.masked_fill_(bad, 0.0)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
    p.addcdiv_(m, denom, value=-lr / bias_correction1)
    if any_bad:
        p = torch.where(bad, param.to(ct), p)
    param.copy_(p)
    if isinstance(exp_avg, QuantizedState):
        # Where the gradient is 0 the first moment only decays, by b1 per step; nearest
        # rounding would put 0.9 m back on m's code wherever codes are more than ~20% apart
        # (near 0 in every code), and the weight would keep moving at a constant speed with no
        # gradient. Rounding those elements toward zero lets momentum die out as in fp32.
        exp_avg.quantize_(m, toward_zero=g == 0)
    if isinstance(exp_avg_sq, QuantizedState):
        exp_avg_sq.quantize_(v)
