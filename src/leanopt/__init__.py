"""leanopt: memory-balanced training in PyTorch."""

from leanopt.optim import Adafactor, AdamW, AdEMAMix, AdEMAMix8bit, Lion, Lion4bit, Lion8bit
from leanopt.optim import AdamW4bit, AdamW8bit, SGD, SGD8bit
# Defining an optimizer outside leanopt (docs/adding_an_optimizer.md): a rule, its class, its
# quantized sibling, its registration.
from leanopt.kernels.rules import Rule, StateKind
from leanopt.optim import ElementwiseOptimizer, LowBit, register
from leanopt.optim.release import release_gradients
from leanopt.memory import compute_optimizer_size, estimate, measure
from leanopt.memory import training_memory
from leanopt.memory.plan import plan
from leanopt.memory.doctor import doctor

__version__ = "0.1.0"
__all__ = ["AdEMAMix", "AdEMAMix8bit", "Adafactor", "AdamW", "AdamW4bit", "AdamW8bit", "ElementwiseOptimizer",
           "Lion", "Lion4bit", "Lion8bit", "LowBit", "Rule", "SGD", "SGD8bit", "StateKind", "compute_optimizer_size", "doctor", "estimate",
           "measure", "plan", "register", "release_gradients", "training_memory"]  # fmt: skip
