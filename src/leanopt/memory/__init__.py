"""Memory accounting: predict state bytes from layouts, measure them after, whole-training breakdown."""

from leanopt.memory.estimate import (
    OPTIMIZER_NAMES,
    StateEstimate,
    available_optimizers,
    estimate,
    register_layout,
    resolve_optimizer,
)
from leanopt.memory.measure import StateMeasurement, compute_optimizer_size, measure

__all__ = [
    "OPTIMIZER_NAMES",
    "StateEstimate",
    "StateMeasurement",
    "available_optimizers",
    "compute_optimizer_size",
    "estimate",
    "measure",
    "register_layout",
    "resolve_optimizer",
]
