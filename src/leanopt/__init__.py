"""leanopt: memory-balanced training in PyTorch."""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from typing import TYPE_CHECKING, Any

# numpy is not a dependency; without it, importing torch warns "Failed to initialize NumPy"
# (torch/csrc/utils/tensor_numpy.cpp), twice on `leanopt --version`. Nothing leanopt does needs it.
if importlib.util.find_spec("numpy") is None:
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

# Defining an optimizer outside leanopt (docs/adding_an_optimizer.md): a rule, its class, its
# quantized sibling, its registration.
from leanopt.kernels.rules import Rule, StateKind
from leanopt.memory import OPTIMIZER_NAMES, compute_optimizer_size, estimate, measure, training_memory
from leanopt.memory.resident import pin_allocator
from leanopt.optim import (
    SGD,
    Adafactor,
    AdamW,
    AdamW4bit,
    AdamW8bit,
    AdEMAMix,
    AdEMAMix8bit,
    ElementwiseOptimizer,
    Lion,
    Lion4bit,
    Lion8bit,
    LowBit,
    Muon,
    Muon4bit,
    Muon8bit,
    SGD8bit,
    muon_groups,
    register,
)
from leanopt.optim.release import release_gradients

if TYPE_CHECKING:
    from leanopt.memory.doctor import doctor
    from leanopt.memory.plan import plan

__version__ = "0.1.0"
__all__ = ["OPTIMIZER_NAMES", "AdEMAMix", "AdEMAMix8bit", "Adafactor", "AdamW", "AdamW4bit", "AdamW8bit", "ElementwiseOptimizer",
           "Lion", "Lion4bit", "Lion8bit", "LowBit", "Muon", "Muon4bit", "Muon8bit", "Rule", "SGD", "SGD8bit", "StateKind", "compute_optimizer_size", "doctor", "estimate",
           "measure", "muon_groups", "pin_allocator", "plan", "register", "release_gradients", "training_memory"]  # fmt: skip

# The planner (memory/plan*.py: a FakeTensorMode tracer and its CUDA emulation) and the doctor
# are imported on first use, so that `import leanopt` for an optimizer does not pay for them
# (tests/test_imports.py).
_LAZY = {"plan": "leanopt.memory.plan", "doctor": "leanopt.memory.doctor"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
