"""leanopt: memory-balanced training in PyTorch."""

from leanopt.optim import Adafactor, AdamW, AdEMAMix, AdEMAMix8bit, Lion, Lion4bit, Lion8bit
from leanopt.optim import AdamW4bit, AdamW8bit
from leanopt.optim.release import release_gradients
from leanopt.memory import compute_optimizer_size, estimate, measure
from leanopt.memory import training_memory
from leanopt.memory.plan import plan

__version__ = "0.1.0"
__all__ = ["AdEMAMix", "AdEMAMix8bit", "Adafactor", "AdamW", "AdamW4bit", "AdamW8bit", "Lion", "Lion4bit", "Lion8bit", "compute_optimizer_size", "estimate", "measure", "plan", "release_gradients", "training_memory"]
