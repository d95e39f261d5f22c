"""Trade-off report: train one task with each optimizer, measure memory, speed and loss.

Each optimizer's lr is tuned on a small grid centred on its usual default, the best is repeated
over seeds, and each gets a verdict against AdamW that knows the seed-to-seed noise.
``main(argv)`` is the ``leanopt compare`` command (also ``python -m leanopt.compare``);
``compare(plan, optimizers)`` runs a comparison from code, ``get_task(name).plan(...)`` makes
its plan (grid and seeds included). See docs/compare.md.

The names below are imported on first use: ``main`` checks its arguments before torch is imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from leanopt.compare.command import main
    from leanopt.compare.contenders import CONTENDERS, DEFAULT_CONTENDERS
    from leanopt.compare.runner import Comparison, compare
    from leanopt.compare.tasks import BUILTIN_TASKS, Plan, TaskUnavailable, get_task

__all__ = [
    "BUILTIN_TASKS",
    "CONTENDERS",
    "DEFAULT_CONTENDERS",
    "Comparison",
    "Plan",
    "TaskUnavailable",
    "compare",
    "get_task",
    "main",
]

_LAZY = {
    "main": "leanopt.compare.command",
    **dict.fromkeys(["CONTENDERS", "DEFAULT_CONTENDERS"], "leanopt.compare.contenders"),
    **dict.fromkeys(["Comparison", "compare"], "leanopt.compare.runner"),
    **dict.fromkeys(["BUILTIN_TASKS", "Plan", "TaskUnavailable", "get_task"], "leanopt.compare.tasks"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
