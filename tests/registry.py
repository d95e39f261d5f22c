"""Every leanopt optimizer, declared once; every generic, contract, backend-parity, memory,
integration and checkpoint test iterates this list.

Add an entry when you add an optimizer (``test_registry_lists_every_registered_optimizer``
fails until you do). ``kwargs`` are what the generic tests construct it
with (they must make a loss go down on a small regression in 30 steps); ``invalid`` lists
hyper-parameter sets that must raise ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import leanopt


@dataclass(frozen=True)
class OptimizerCase:
    name: str
    cls: type
    kwargs: dict[str, Any]
    invalid: list[dict[str, Any]] = field(default_factory=list)
    # Keyword for the learning rate (None: the optimizer has no plain lr to set to 1e-30).
    lr_key: str | None = "lr"
    # Complex params: True if stepped as torch does (on the real view), False if the
    # constructor (and add_param_group, estimate) must raise a ValueError naming the param.
    supports_complex: bool = False
    # Backends the generic suite runs (triton runs under TRITON_INTERPRET=1 when installed).
    backends: tuple[str, ...] = ("reference", "cpu", "triton")
    # Constructor defaults that differ on purpose from a class in ``cls.references`` (the classes
    # whose positional order and defaults it keeps): {reference path: {parameter: why}}.
    reference_differences: dict[str, dict[str, str]] = field(default_factory=dict)

    def __str__(self) -> str:  # pytest ids
        return self.name


ADAM_INVALID = [
    {"lr": -1e-3},
    {"eps": -1e-8},
    {"weight_decay": -0.1},
    {"betas": (1.0, 0.999)},
    {"betas": (0.9, 1.0)},
    {"betas": (-0.1, 0.999)},
    {"lr": float("nan")},
    {"rounding": "up"},
]

# Each set is invalid on its own and merged over the registry kwargs below (relative_step=False, lr set).
ADAFACTOR_INVALID = [
    {"lr": 1e-3, "relative_step": True},
    {"warmup_init": True, "relative_step": False, "lr": 1e-3},
    {"relative_step": False, "lr": None},
    {"lr": -1e-3, "relative_step": False},
    {"lr": float("nan"), "relative_step": False},
    {"eps": (-1e-30, 1e-3)},
    {"eps": (1e-30, -1e-3)},
    {"eps": 1e-3},
    {"eps": (1e-30,)},
    {"clip_threshold": -1.0},
    {"clip_threshold": 0.0},
    {"decay_rate": 0.5},
    {"beta1": 1.0},
    {"beta1": -0.1},
    {"weight_decay": -0.1},
    {"rounding": "truncate"},
]

# Quantized AdamW: amsgrad is refused, storage options are validated.
LOWBIT_INVALID = ADAM_INVALID + [{"amsgrad": True}] + [
    {"block_size": 0},
    {"block_size": 1.5},
    {"block_size": 2**20},  # past leanopt.quant.formats.MAX_BLOCK_SIZE
    {"min_quant_size": -1},
]

LION_INVALID = [
    {"lr": -1e-4},
    {"weight_decay": -0.1},
    {"betas": (1.0, 0.99)},
    {"betas": (0.9, 1.0)},
    {"betas": (0.9, 0.99, 0.999)},
    {"lr": float("nan")},
    {"rounding": "up"},
]

ADEMAMIX_INVALID = [
    {"lr": -1e-3},
    {"eps": -1e-8},
    {"weight_decay": -0.1},
    {"alpha": -1.0},
    {"betas": (0.9, 0.999)},
    {"betas": (0.9, 0.999, 1.0)},
    {"betas": (0.9, 1.0, 0.9999)},
    {"t_alpha": 0},
    {"t_beta3": 2.5},
    {"lr": float("nan")},
    {"rounding": "up"},
]

STORAGE_INVALID = [
    {"block_size": 0},
    {"block_size": 1.5},
    {"block_size": 2**20},  # past leanopt.quant.formats.MAX_BLOCK_SIZE
    {"min_quant_size": -1},
]

OPTIMIZERS: list[OptimizerCase] = [
    OptimizerCase("adamw", leanopt.AdamW, {"lr": 1e-2}, ADAM_INVALID, supports_complex=True),
    # The generic model's first weight (8192 elements) is quantized, the rest keep fp32 states.
    OptimizerCase("adamw8bit", leanopt.AdamW8bit, {"lr": 1e-2}, LOWBIT_INVALID),
    OptimizerCase("adamw4bit", leanopt.AdamW4bit, {"lr": 1e-2}, LOWBIT_INVALID),
    OptimizerCase(
        "adafactor",
        leanopt.Adafactor,
        # beta1 so the generic suite also saves, copies and measures the full-size exp_avg.
        {"lr": 1e-2, "beta1": 0.9, "relative_step": False, "scale_parameter": False},
        ADAFACTOR_INVALID,
        lr_key="lr",
    ),
    OptimizerCase("lion", leanopt.Lion, {"lr": 1e-3}, LION_INVALID),
    OptimizerCase("lion8bit", leanopt.Lion8bit, {"lr": 1e-3}, LION_INVALID + STORAGE_INVALID),
    OptimizerCase("lion4bit", leanopt.Lion4bit, {"lr": 1e-3}, LION_INVALID + STORAGE_INVALID),
    OptimizerCase("ademamix", leanopt.AdEMAMix, {"lr": 1e-2}, ADEMAMIX_INVALID),
    OptimizerCase("ademamix8bit", leanopt.AdEMAMix8bit, {"lr": 1e-2, "t_alpha": 10, "t_beta3": 10},
                  ADEMAMIX_INVALID + STORAGE_INVALID),
]
