"""The names the command line checks before it imports torch: leanopt's built-in optimizers (by
family), the peers ``estimate`` knows, and the rounding modes.

Importing torch and the optimizers takes seconds; a mistyped name should be answered in less.
:data:`BUILTIN_OPTIMIZERS` is what :data:`leanopt.optim.REGISTRY` holds once the optimizer modules
have registered their classes, in their order (tests/test_newcomer.py holds the two equal); an
optimizer registered from outside (``leanopt.register``) lives in a Python process, never on the
command line, so the registry stays the one list for code.
"""

from __future__ import annotations

__all__ = ["BUILTIN_OPTIMIZERS", "PEER_NAMES", "ROUNDINGS", "TORCH_ADAMW", "TORCH_MUON", "known_optimizer", "optimizer_classes", "optimizer_families"]

# name -> (family, class): leanopt's own optimizers, in the registry's order. Optimizers of one
# family share an update rule and convert into each other; ``leanopt.<class>`` is exported from
# this table (the class itself comes from leanopt.optim, whose imports register it).
BUILTIN_OPTIMIZERS: dict[str, tuple[str, str]] = {
    "adamw": ("adamw", "AdamW"),
    "adamw8bit": ("adamw", "AdamW8bit"),
    "adamw4bit": ("adamw", "AdamW4bit"),
    "adafactor": ("adafactor", "Adafactor"),
    "lion": ("lion", "Lion"),
    "lion8bit": ("lion", "Lion8bit"),
    "lion4bit": ("lion", "Lion4bit"),
    "ademamix": ("ademamix", "AdEMAMix"),
    "ademamix8bit": ("ademamix", "AdEMAMix8bit"),
    "sgd": ("sgd", "SGD"),
    "sgd8bit": ("sgd", "SGD8bit"),
    "muon": ("muon", "Muon"),
    "muon8bit": ("muon", "Muon8bit"),
    "muon4bit": ("muon", "Muon4bit"),
}

# Peers, by hand: name -> "module:attribute", resolved lazily so that an optional peer is
# imported only when asked for.
PEER_NAMES: dict[str, str] = {
    "torch-adamw": "torch.optim:AdamW",
    "torch-adafactor": "torch.optim:Adafactor",
    "hf-adafactor": "transformers.optimization:Adafactor",
}
TORCH_ADAMW = "torch-adamw"  # plain torch.optim.AdamW, what `convert --to` writes for it
TORCH_MUON = "torch-muon"  # torch.optim.Muon, what `convert --to` writes for it

ROUNDINGS = ("nearest", "stochastic", "kahan")  # how a low-precision param takes its update


def optimizer_families() -> dict[str, list[str]]:
    """family -> its built-in optimizers' names, in registration order."""
    families: dict[str, list[str]] = {}
    for name, (family, _) in BUILTIN_OPTIMIZERS.items():
        families.setdefault(family, []).append(name)
    return families


def known_optimizer(name: str) -> str:
    """``name`` lower-cased if it is a built-in optimizer or a peer; ``ValueError`` naming the known ones
    (the message :func:`leanopt.memory.resolve_optimizer` gives)."""
    key = name.strip().lower()
    if key not in BUILTIN_OPTIMIZERS and key not in PEER_NAMES:
        raise ValueError(f"unknown optimizer {name!r}; known: {', '.join([*BUILTIN_OPTIMIZERS, *PEER_NAMES])}")
    return key


def optimizer_classes() -> list[str]:
    """The class names of leanopt's own optimizers (``leanopt.AdamW``, ...), in registry order."""
    return [cls for _, cls in BUILTIN_OPTIMIZERS.values()]
