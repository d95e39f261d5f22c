"""leanopt's optimizers, one module per rule, on the shared bookkeeping in ``base``.

Importing a module registers the optimizers it defines (:func:`leanopt.optim.registry.register`):
the imports below are the one list of leanopt's own optimizers, in the registry's order (the CLI's
tables, compare's default rows), and the exports of this package and of ``leanopt`` are
generated from the registry they fill. Adding an optimizer: its module, its line here
(docs/adding_an_optimizer.md). (``X as X``: a re-export, in the type checkers' words.)
"""

from typing import TYPE_CHECKING

from leanopt.optim.adamw import AdamW as AdamW  # isort: skip
from leanopt.optim.adamw_lowbit import AdamW4bit as AdamW4bit, AdamW8bit as AdamW8bit  # isort: skip
from leanopt.optim.adafactor import Adafactor as Adafactor  # isort: skip
from leanopt.optim.lion import Lion as Lion, Lion4bit as Lion4bit, Lion8bit as Lion8bit  # isort: skip
from leanopt.optim.ademamix import AdEMAMix as AdEMAMix, AdEMAMix8bit as AdEMAMix8bit  # isort: skip
from leanopt.optim.sgd import SGD as SGD, SGD8bit as SGD8bit  # isort: skip
from leanopt.optim.muon import Muon as Muon, Muon4bit as Muon4bit, Muon8bit as Muon8bit  # isort: skip
from leanopt.optim.base import LeanOptimizer
from leanopt.optim.elementwise import ElementwiseOptimizer
from leanopt.optim.layout import StateSpec
from leanopt.optim.lowbit import LowBit
from leanopt.optim.muon_groups import muon_groups
from leanopt.optim.registry import REGISTRY, optimizer_class, register

# The registered classes' names: with the names above, what ``from leanopt.optim import *``
# (and so ``leanopt``) exports. A type checker, which cannot run this, takes every public name
# bound above instead: the same set, each with its own type.
OPTIMIZERS = tuple(cls.__name__ for cls in REGISTRY.values())

if not TYPE_CHECKING:
    __all__ = ["OPTIMIZERS", "REGISTRY", "ElementwiseOptimizer", "LeanOptimizer", "LowBit", "StateSpec", "muon_groups",
               "optimizer_class", "register", *OPTIMIZERS]  # fmt: skip
