"""Trade-off report: train one task with each optimizer, measure memory, speed and loss.

Each optimizer's lr is tuned on a small grid centred on its usual default, the best is repeated
over seeds, and each gets a verdict against AdamW that knows the seed-to-seed noise.
``main(argv)`` is the ``leanopt compare`` command (also ``python -m leanopt.compare``);
``compare(plan, optimizers)`` runs a comparison from code, ``get_task(name).plan(...)`` makes
its plan (grid and seeds included). See docs/compare.md.
"""

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
