"""leanopt: memory-balanced training in PyTorch."""

from leanopt.optim import Adafactor, AdamW
from leanopt.memory import compute_optimizer_size, estimate, measure

__version__ = "0.1.0"
__all__ = ["Adafactor", "AdamW", "compute_optimizer_size", "estimate", "measure"]
