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

from leanopt.catalog import optimizer_classes

if TYPE_CHECKING:
    from leanopt.kernels.rules import Rule, StateKind
    from leanopt.memory import OPTIMIZER_NAMES, compute_optimizer_size, estimate, measure, training_memory
    from leanopt.memory.doctor import doctor
    from leanopt.memory.plan import plan
    from leanopt.memory.resident import pin_allocator
    from leanopt.optim import *  # noqa: F403  (every optimizer class, with its own signature)
    from leanopt.optim import ElementwiseOptimizer, LowBit, register
    from leanopt.optim.muon_groups import muon_groups
    from leanopt.optim.release import release_gradients

__version__ = "0.1.0"
__all__ = ["OPTIMIZER_NAMES", "ElementwiseOptimizer", "LowBit", "Rule", "StateKind", "compute_optimizer_size", "doctor", "estimate",
           "measure", "muon_groups", "pin_allocator", "plan", "register", "release_gradients", "training_memory",
           *optimizer_classes()]  # fmt: skip

# Every public name is imported on first use, from the module that defines it: `import leanopt`
# imports neither torch nor anything else, so the `leanopt` command checks its arguments, model
# names and files before it pays for torch (seconds), and a process that uses the optimizers
# does not pay for the planner (a FakeTensorMode tracer and its CUDA emulation) or the doctor
# (tests/test_imports.py, tests/test_newcomer.py).
_LAZY = {
    **dict.fromkeys(["Rule", "StateKind"], "leanopt.kernels.rules"),
    **dict.fromkeys(["OPTIMIZER_NAMES", "compute_optimizer_size", "estimate", "measure", "training_memory"], "leanopt.memory"),
    "pin_allocator": "leanopt.memory.resident",
    **dict.fromkeys(["ElementwiseOptimizer", "LowBit", "register", *optimizer_classes()], "leanopt.optim"),
    "release_gradients": "leanopt.optim.release",
    "muon_groups": "leanopt.optim.muon_groups",
    "plan": "leanopt.memory.plan",
    "doctor": "leanopt.memory.doctor",
}  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:  # a subpackage: `leanopt.optim.REGISTRY`
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
