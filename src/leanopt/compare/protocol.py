"""The comparison's protocol as data, importing no torch: the default task, the lr grid and the
seeds of each protocol, the training modes a contender name may add and the precisions, so that
``leanopt compare`` checks its arguments before it imports torch."""

from __future__ import annotations

__all__ = ["DEFAULT_TASK", "LR_MULTIPLIERS", "MODES", "PRECISIONS", "SEEDS"]

DEFAULT_TASK = "bytes-gpt"

# The tuning protocol, by --quick: lr multipliers of each optimizer's centre, and seed count.
# The full one is sized to run every default optimizer in about half an hour on 2 loaded cores.
LR_MULTIPLIERS = {True: [1 / 3, 1.0, 3.0], False: [0.25, 0.5, 1.0, 2.0, 4.0]}
SEEDS = {True: 2, False: 3}

# ---- training modes ------------------------------------------------------------------------------
# What each mode suffix of a contender name switches on (``adamw+bf16-kahan``).
MODES: dict[str, str] = {
    "fp32": "fp32 weights, gradients and states; no autocast",
    "bf16-mixed": "fp32 weights (the master weights), gradients and states; forward under "
    "torch.autocast(bfloat16)",
    "bf16-nearest": "pure bf16: bf16 weights and gradients, no fp32 copy, no autocast; the optimizer's "
    "rounding='nearest' (updates under half a bf16 ulp are lost)",
    "bf16-stochastic": "pure bf16 (as bf16-nearest) with rounding='stochastic' (unbiased random rounding of "
    "each update)",
    "bf16-kahan": "pure bf16 (as bf16-nearest) with rounding='kahan' (a bf16 compensation buffer, 2 B/param, "
    "carries what each rounding lost)",
    "bf16-states": "the optimizer's moments stored in bf16 (state_dtype=torch.bfloat16, each write "
    "stochastically rounded): half of fp32 states' memory, without 8-bit's code books",
    "release": "leanopt.release_gradients(model, optimizer): each param stepped inside backward and its "
    "gradient freed at once (optimizer.step() and zero_grad() are no-ops; no clipping, no accumulation)",
}
# The precisions a name without a precision mode can train in (``--precision``).
PRECISIONS = ("fp32", "bf16-mixed")
