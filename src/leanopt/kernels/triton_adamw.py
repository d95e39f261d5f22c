"""AdamW as one Triton kernel per param group (multi-tensor, fp32 maths).

Same rule as :func:`leanopt.kernels.reference.adamw_`; parity is tested under
``TRITON_INTERPRET=1`` on the CPU and on CUDA where available.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from leanopt.kernels.multi_tensor import TableCache
from leanopt.kernels.triton_common import TL_DTYPE, adam_safe_elementwise, to_param_dtype

CHUNK = 2048


@triton.jit
def _adamw_kernel(
    p_ptrs, g_ptrs, m_ptrs, v_ptrs, vmax_ptrs,
    chunk_tensor, chunk_start, numels, step_size_table, bc2_sqrt_table, floor_div_table,
    decay, one_minus_beta1, beta2, one_minus_beta2, eps,
    P_DTYPE: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr, SAFE: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    t = tl.load(chunk_tensor + c)
    offs = tl.load(chunk_start + c) + tl.arange(0, CHUNK)
    mask = offs < tl.load(numels + t)
    p_ptr = tl.load(p_ptrs + t).to(tl.pointer_type(P_DTYPE))
    g_ptr = tl.load(g_ptrs + t).to(tl.pointer_type(P_DTYPE))
    m_ptr = tl.load(m_ptrs + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(v_ptrs + t).to(tl.pointer_type(tl.float32))

    p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    step_size = tl.load(step_size_table + t)
    bc2_sqrt = tl.load(bc2_sqrt_table + t)
    if SAFE:
        # The rule of the quantized optimizers for their dense (small) states.
        floor_div = tl.load(floor_div_table + t)
        p, m, v = adam_safe_elementwise(p, g, m, v, decay, one_minus_beta1, beta2, one_minus_beta2, floor_div,
                                        step_size, bc2_sqrt, eps, MAXIMIZE)  # fmt: skip
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
    else:
        if MAXIMIZE:
            g = -g
        p = p * decay
        m = m + one_minus_beta1 * (g - m)
        v = v * beta2 + one_minus_beta2 * g * g
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        if AMSGRAD:
            vmax_ptr = tl.load(vmax_ptrs + t).to(tl.pointer_type(tl.float32))
            v = tl.maximum(tl.load(vmax_ptr + offs, mask=mask), v)
            tl.store(vmax_ptr + offs, v, mask=mask)
        p = p - step_size * (m / (tl.sqrt(v) / bc2_sqrt + eps))
    tl.store(p_ptr + offs, to_param_dtype(p, P_DTYPE), mask=mask)


def supports(param: Tensor) -> bool:
    return param.dtype in TL_DTYPE


def adamw(
    cache: TableCache,
    key: str,
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    max_exp_avg_sqs: Sequence[Tensor] | None,
    steps: Sequence[int],
    floor_divs: Sequence[float] | None = None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
) -> None:
    """One launch per param dtype for a list of params of one group (states fp32, contiguous).

    With ``floor_divs`` (one per param) the rule is the quantized optimizers' one
    (:func:`leanopt.kernels.reference.adamw_quantized_` on dense states)."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, p in enumerate(params):
        if p.numel():
            by_dtype.setdefault(p.dtype, []).append(i)
    for dtype, idx in by_dtype.items():
        ps = [params[i] for i in idx]
        device = ps[0].device
        table = cache.chunks(ps, CHUNK)
        # Scalars are formed in double on the host, as the reference does, then rounded once.
        step_size = cache.floats([lr / (1 - beta1 ** steps[i]) for i in idx], device)
        bc2 = cache.floats([(1 - beta2 ** steps[i]) ** 0.5 for i in idx], device)
        k = f"{key}/{dtype}"
        vmax = cache.addresses(k + "/vmax", [max_exp_avg_sqs[i] for i in idx], device) if max_exp_avg_sqs else table.numel
        _adamw_kernel[(table.num_chunks,)](
            cache.addresses(k + "/p", ps, device),
            cache.addresses(k + "/g", [grads[i] for i in idx], device),
            cache.addresses(k + "/m", [exp_avgs[i] for i in idx], device),
            cache.addresses(k + "/v", [exp_avg_sqs[i] for i in idx], device),
            vmax,
            table.chunk_tensor, table.chunk_start, table.numel, step_size, bc2,
            cache.floats([floor_divs[i] for i in idx], device) if floor_divs is not None else bc2,
            1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, eps,
            P_DTYPE=TL_DTYPE[dtype], AMSGRAD=bool(max_exp_avg_sqs), MAXIMIZE=maximize,
            SAFE=floor_divs is not None, CHUNK=CHUNK,
        )  # fmt: skip
