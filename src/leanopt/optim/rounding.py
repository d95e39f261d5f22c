"""How an fp32 update is written into a bf16/fp16 param without fp32 master weights.

``rounding="nearest"`` (the default) rounds the updated value to the nearest bf16/fp16 number:
updates under half a unit in the last place are lost, so pure-bf16 training with a small lr
stalls. The two alternatives, for every leanopt optimizer:

* ``"stochastic"``: round up or down at random, with the probability that makes the rounding
  unbiased (``E[round(x)] = x``), so small updates survive on average. No extra state. The
  random numbers are :func:`leanopt.quant.formats.dither` of each element's flat index, keyed
  by the param's position and step count: a run is reproducible, a resumed checkpoint continues
  identically, and a param rounded in chunks gets the numbers it gets whole.
* ``"kahan"``: Kahan-compensated summation. A ``kahan_comp`` buffer of the param's dtype (2 B
  per param for bf16, part of the state layout: ``leanopt.estimate`` counts it) holds what the
  last rounding lost; the update is computed on ``param + kahan_comp`` in fp32 and the new
  value is split again into its nearest bf16 value and the remainder.

Each rounded param is updated through an fp32 copy of itself (and of its gradient), one param
at a time, and a param of an elementwise rule in chunks of at most :data:`ROUNDING_CHUNK`
elements: the step's temporaries are those of one chunk (10 MiB with Kahan, 64 MiB stochastic), not of the
model nor of the largest param (Adafactor's factored statistics need a whole matrix: its largest
param's). fp32 and fp64 params ignore the option.
"""

from __future__ import annotations

import torch

from leanopt.catalog import ROUNDINGS
from leanopt.quant.formats import dither

# Elements of a param rounded at once (a chunkable rule's). Measured peaks of an AdamW step over
# the memory before it (tests/test_rounding.py): the fp32 copies, the rule's temporaries and the
# rounding's come to ~10 B per element with Kahan and ~64 B with stochastic rounding (its dither
# works in int64): 9.9 and 63.9 MiB per chunk of 2**20, against 80 and 480 MiB for a whole
# 2**23-element param; on DistilBERT-cased's embedding whole params made 828 MiB of temporaries.
ROUNDING_CHUNK = 1 << 20
LOW_PRECISION = (torch.bfloat16, torch.float16)

__all__ = ["LOW_PRECISION", "ROUNDINGS", "ROUNDING_CHUNK", "check_rounding", "rounding_dither", "stochastic_round"]


def check_rounding(value: object) -> None:
    if value not in ROUNDINGS:
        raise ValueError(f"Invalid rounding: {value!r} (choose from {', '.join(ROUNDINGS)})")


def rounding_dither(numel: int, offset: int, step: int, group: int, index: int, device: torch.device) -> torch.Tensor:
    """The uniform numbers of the stochastic rounding of elements ``offset .. offset + numel - 1``
    (flat indices) of param ``index`` of ``group`` at ``step``: a function of where the param is
    and how far it has trained (a 32-bit key, so that params of one shape draw differently)."""
    key = (0x5EED_0F_1EA0 + step * 1_000_003 + group * 10_007 + index * 101) % (1 << 32)
    return dither(torch.arange(offset, offset + numel, dtype=torch.int64, device=device), key)


def stochastic_round(x: torch.Tensor, dtype: torch.dtype, u: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32) rounded to ``dtype``, up or down with probabilities that keep the mean;
    ``u``: a uniform number in [0, 1) per element (flat, :func:`rounding_dither`)."""
    near = x.to(dtype)
    back = near.float()
    err = x - back
    toward = torch.where(err > 0, torch.inf, -torch.inf).to(dtype)
    other = torch.nextafter(near, toward)
    gap = (other.float() - back).abs()
    # err / gap is in [0, 0.5]: round away from `near` with that probability. gap is 0 or inf
    # only where x is not finite or at the end of the range; there `near` stands.
    prob = torch.where((gap > 0) & torch.isfinite(gap), err.abs() / gap, torch.zeros_like(err))
    return torch.where(u.view(x.shape) < prob, other, near)
