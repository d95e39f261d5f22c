"""leanopt's optimizers, one module per rule, on the shared bookkeeping in ``base``.

Importing this package registers every optimizer (:mod:`leanopt.optim.registry`).
"""

# Import order is the registry's order (the CLI's tables, compare's default rows).
from leanopt.optim.adamw import AdamW  # isort: skip
from leanopt.optim.adamw_lowbit import AdamW4bit, AdamW8bit  # isort: skip
from leanopt.optim.adafactor import Adafactor  # isort: skip
from leanopt.optim.lion import Lion, Lion4bit, Lion8bit  # isort: skip
from leanopt.optim.ademamix import AdEMAMix, AdEMAMix8bit  # isort: skip
from leanopt.optim.sgd import SGD, SGD8bit  # isort: skip
from leanopt.optim.muon import Muon, Muon4bit, Muon8bit  # isort: skip
from leanopt.optim.base import LeanOptimizer
from leanopt.optim.elementwise import ElementwiseOptimizer
from leanopt.optim.layout import StateSpec
from leanopt.optim.lowbit import LowBit
from leanopt.optim.muon_groups import muon_groups
from leanopt.optim.registry import REGISTRY, optimizer_class, register

__all__ = ["REGISTRY", "AdEMAMix", "AdEMAMix8bit", "Adafactor", "AdamW", "AdamW4bit", "AdamW8bit",
           "ElementwiseOptimizer", "LeanOptimizer", "Lion", "Lion4bit", "Lion8bit", "LowBit", "Muon", "Muon4bit", "Muon8bit",
           "SGD", "SGD8bit", "StateSpec", "muon_groups", "optimizer_class", "register"]  # fmt: skip
