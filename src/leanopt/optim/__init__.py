"""leanopt's optimizers, one module each, on the shared bookkeeping in ``base``."""

from leanopt.optim.adafactor import Adafactor
from leanopt.optim.adamw import AdamW
from leanopt.optim.adamw_lowbit import AdamW4bit, AdamW8bit
from leanopt.optim.base import LeanOptimizer
from leanopt.optim.layout import StateSpec

__all__ = ["Adafactor", "AdamW", "AdamW4bit", "AdamW8bit", "LeanOptimizer", "StateSpec"]
