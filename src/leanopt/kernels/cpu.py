"""CPU fast paths of the update rules.

* AdamW whose states have the param's dtype (fp32, fp64 params): torch's own fused CPU
  kernel (``aten::_fused_adamw_``): one vectorised pass over all tensors of a group.
* Everything else: the reference function compiled once by Inductor with dynamic shapes,
  so a model's many shapes share one compiled kernel (no per-shape recompiles). Without a
  working compiler the reference runs eagerly; :func:`compiled` records why.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from leanopt.kernels import reference

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


__all__ = ["adamw", "compiled", "reference"]
