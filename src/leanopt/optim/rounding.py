"""How an fp32 update is written into a bf16/fp16 param without fp32 master weights.

``rounding="nearest"`` (the default) rounds the updated value to the nearest bf16/fp16 number:
updates under half a unit in the last place are lost, so pure-bf16 training with a small lr
stalls. The two alternatives, for every leanopt optimizer:

* ``"stochastic"``: round up or down at random, with the probability that makes the rounding
  unbiased (``E[round(x)] = x``), so small updates survive on average. No extra state. The
  random bits come from a generator seeded with the param's position and step count, so a run
  is reproducible and a resumed checkpoint continues identically.
* ``"kahan"``: Kahan-compensated summation. A ``kahan_comp`` buffer of the param's dtype (2 B
  per param for bf16, part of the state layout: ``leanopt.estimate`` counts it) holds what the
  last rounding lost; the update is computed on ``param + kahan_comp`` in fp32 and the new
  value is split again into its nearest bf16 value and the remainder.

Each rounded param is updated through an fp32 copy of itself (and of its gradient), one param
at a time: a transient of 8 B per element of the largest param, not of the model. fp32 and fp64
params ignore the option.
"""

from __future__ import annotations

import torch

from leanopt.catalog import ROUNDINGS

LOW_PRECISION = (torch.bfloat16, torch.float16)

__all__ = ["LOW_PRECISION", "ROUNDINGS", "check_rounding", "generator_for", "stochastic_round"]


def check_rounding(value: object) -> None:
    if value not in ROUNDINGS:
        raise ValueError(f"Invalid rounding: {value!r} (choose from {', '.join(ROUNDINGS)})")


def generator_for(device: torch.device, step: int, group: int, index: int) -> torch.Generator:
    """The random bits of one param's stochastic rounding at ``step``: a function of where the
    param is and how far it has trained, so runs and resumed checkpoints repeat them."""
    gen = torch.Generator(device=device)
    gen.manual_seed((0x5EED_0F_1EA0 + step * 1_000_003 + group * 10_007 + index * 101) % (2**63 - 1))
    return gen


def stochastic_round(x: torch.Tensor, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """``x`` (fp32) rounded to ``dtype``, up or down with probabilities that keep the mean."""
    near = x.to(dtype)
    back = near.float()
    err = x - back
    toward = torch.where(err > 0, torch.inf, -torch.inf).to(dtype)
    other = torch.nextafter(near, toward)
    gap = (other.float() - back).abs()
    # err / gap is in [0, 0.5]: round away from `near` with that probability. gap is 0 or inf
    # only where x is not finite or at the end of the range; there `near` stands.
    prob = torch.where((gap > 0) & torch.isfinite(gap), err.abs() / gap, torch.zeros_like(err))
    u = torch.rand(x.shape, generator=generator, device=x.device)
    return torch.where(u < prob, other, near)
