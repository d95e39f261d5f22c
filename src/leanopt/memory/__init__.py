"""Memory accounting: predict state bytes from layouts, measure them after, whole-training breakdown.

The names below are imported on first use, so that a module of this package that needs no torch
(:mod:`leanopt.memory.presets`, whose model names the command line checks first) imports none.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_LAZY = {
    **dict.fromkeys(["OPTIMIZER_NAMES", "StateEstimate", "available_optimizers", "estimate", "register_layout",
                     "resolve_optimizer"], "leanopt.memory.estimate"),
    **dict.fromkeys(["StateMeasurement", "compute_optimizer_size", "measure"], "leanopt.memory.measure"),
    **dict.fromkeys(["PRECISIONS", "TrainingMemory", "training_memory"], "leanopt.memory.training"),
}  # fmt: skip


class _Package(types.ModuleType):
    """This package, whose ``estimate`` and ``measure`` stay the functions when their modules of
    the same names are imported: the import system binds a submodule to its package's attribute
    after loading it, which an eager ``from ... import estimate`` used to undo."""

    def __getattr__(self, name: str) -> Any:
        if name not in _LAZY:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(_LAZY[name]), name)
        super().__setattr__(name, value)  # later lookups find it
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(__all__))


sys.modules[__name__].__class__ = _Package
