"""An optimizer defined outside leanopt, with its public API only (docs/adding_an_optimizer.md):
torch.optim.RMSprop's rule (no momentum, not centered) and its 8-bit sibling. Nothing in src/
knows it; tests/registry.py lists it among the generic suite's cases and
tests/test_external_optimizer.py holds it to torch's RMSprop on every backend."""

from __future__ import annotations

import torch

import leanopt
from leanopt.optim.validation import check_beta, check_flag, check_nonnegative


def _schedule(hp, step, safe):
    return dict(alpha=hp["alpha"], one_minus_alpha=1 - hp["alpha"], eps=hp["eps"], lr=hp["lr"], weight_decay=hp["weight_decay"])


def _rmsprop(p, g, states, c, flags, safe):
    # torch.optim.RMSprop's order: g += wd p; v = alpha v + (1 - alpha) g g; p -= lr g / (sqrt(v) + eps)
    g = g + c["weight_decay"] * p
    v = states[0] * c["alpha"] + c["one_minus_alpha"] * g * g
    return p - c["lr"] * (g / (v.sqrt() + c["eps"])), [v]


RMSPROP = leanopt.Rule(
    "rmsprop",
    states=lambda hp: (leanopt.StateKind("square_avg", signed=False),),
    hyperparameters=lambda group: {**{k: float(group[k]) for k in ("lr", "alpha", "eps", "weight_decay")},
                                   "maximize": bool(group["maximize"])},  # fmt: skip
    scalars=("alpha", "one_minus_alpha", "eps", "lr", "weight_decay"),
    schedule=_schedule,
    elementwise=_rmsprop,
    max_states=1,
)


class RMSprop(leanopt.ElementwiseOptimizer):
    """torch.optim.RMSprop without momentum or centering."""

    name = family = "rmsprop"
    references = ("torch.optim.RMSprop",)
    rule = RMSPROP

    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, *, maximize=False, rounding="nearest",
                 backend="auto", state_dtype=torch.float32, offload=None):  # fmt: skip
        defaults = dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, maximize=maximize, rounding=rounding)
        super().__init__(params, defaults, backend=backend, state_dtype=state_dtype, offload=offload)

    def validate_group(self, group, *, loaded=False):
        # leanopt's own checks: lr may be a one-element tensor (as in torch), NaN is refused.
        for key in ("lr", "eps", "weight_decay"):
            check_nonnegative(key, group[key])
        check_beta("alpha", group["alpha"])
        check_flag("maximize", group["maximize"])


class RMSprop8bit(leanopt.LowBit, RMSprop):
    """RMSprop with its second moment on an 8-bit zero-free code, one fp32 scale per 256 elements."""

    name = "rmsprop8bit"
    state_bits = 8
    square_avg_code = "pow6-u8"
    default_block_size = 256
