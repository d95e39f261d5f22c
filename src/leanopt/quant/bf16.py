"""bf16 storage of an optimizer's dense states, written with stochastic rounding.

A state stored in bf16 (``state_dtype=torch.bfloat16`` on an elementwise optimizer) is read as
fp32, the rule runs in fp32 (fp64 for fp64 params), and the new value is written back rounded
to one of its two neighbouring bf16 numbers, up with the probability that makes the rounding
unbiased: ``E[stored] = value``. Round-to-nearest would lose every update under half a unit in
the last place (2^-9 relative): a second moment with ``beta2 = 0.999`` moves by ~1e-3 of itself
per step, so ``exp_avg_sq`` would stop tracking the gradient's scale; stochastic rounding keeps
it unbiased, at the price of noise of at most one bf16 ulp per write.

The random numbers are :func:`leanopt.quant.formats.dither` of the element's global flat
index and the step (32-bit integer arithmetic, the same bits on every backend), not torch's
generator: a run is reproducible and a resumed checkpoint continues identically, whatever the
backend. State ``j`` of ``n`` of element ``i`` draws from index ``i * n + j``, so that the
moments of one element are rounded independently. The rounding itself is on the bits: the top
16 bits of ``bits(x) + floor(u * 2^16)``, which rounds the magnitude up exactly when ``u`` is
below the dropped fraction (an fp32 is sign-magnitude). NaN stays NaN; +-inf stays inf.
"""

from __future__ import annotations

import torch
from torch import Tensor

from leanopt.quant.formats import dither

# The stored dtypes an elementwise optimizer's dense states may take (``state_dtype``).
STATE_DTYPES = (torch.float32, torch.bfloat16)

__all__ = ["STATE_DTYPES", "check_state_dtype", "state_dither", "state_dtype_name", "stochastic_bf16"]


def check_state_dtype(value: object) -> torch.dtype:
    """The dtype ``value`` names if it is a ``state_dtype`` leanopt stores (:data:`STATE_DTYPES`;
    a ``torch.dtype`` or its name, as param groups hold it), else ``ValueError``."""
    if isinstance(value, str):
        value = getattr(torch, value.removeprefix("torch."), value)
    if not isinstance(value, torch.dtype) or value not in STATE_DTYPES:
        raise ValueError(
            f"Invalid state_dtype: {value!r} (choose torch.float32, the default, or torch.bfloat16; "
            "for 8-bit or 4-bit states use the optimizer's 8bit/4bit sibling)"
        )
    return value


def state_dtype_name(value: object) -> str:
    """How a param group holds ``state_dtype``: its name ("float32", "bfloat16"), a plain string,
    so that every checkpoint writer takes it (torch.distributed.checkpoint refuses a torch.dtype)."""
    return str(check_state_dtype(value)).removeprefix("torch.")


def state_dither(numel: int, offset: int, step: int, j: int, n: int, device: torch.device | str = "cpu") -> Tensor:
    """The uniform numbers of state ``j`` (of ``n``) of elements ``offset .. offset + numel - 1``
    (global flat indices) at ``step``."""
    index = (torch.arange(numel, dtype=torch.int64, device=device) + offset) * n + j
    return dither(index, step)


def stochastic_bf16(x: Tensor, u: Tensor) -> Tensor:
    """``x`` (fp32) rounded to bf16, away from zero where ``u`` (in [0, 1), of ``x``'s shape)
    is below the fraction of a bf16 ulp that rounding toward zero drops (see the module)."""
    bits = x.float().contiguous().view(torch.int32)
    r = (u * 65536.0).to(torch.int32)
    # int32 wraps like uint32 here; masking the low half leaves the bf16 pattern in the top half.
    rounded = ((bits + r) & -65536).view(torch.float32)
    return torch.where(torch.isnan(x), x.float(), rounded).to(torch.bfloat16)
