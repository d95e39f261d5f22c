"""leanopt: memory-balanced training in PyTorch."""

from leanopt.optim import AdamW

__version__ = "0.1.0"
__all__ = ["AdamW"]
