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
from leanopt.memory.training import PRECISIONS, TrainingMemory, training_memory

__all__ = [
    "OPTIMIZER_NAMES",
    "PRECISIONS",
    "StateEstimate",
    "StateMeasurement",
    "TrainingMemory",
    "available_optimizers",
    "compute_optimizer_size",
    "estimate",
    "measure",
    "register_layout",
    "resolve_optimizer",
    "training_memory",
]
