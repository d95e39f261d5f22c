"""The one list of leanopt's optimizers: name -> class.

Every optimizer module registers its classes with :func:`register`; the CLI, ``estimate``,
``inspect``/``convert``, the transformers integration and ``compare`` look names up here, and
the name is what each param group of a ``state_dict`` saves under ``"optimizer"`` (the
optimizer's declared identity).
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch

# Every registered class is a LeanOptimizer subclass (leanopt's own and those defined outside
# it). This module sits below the base class (which looks names up here), so the values are
# typed as any class: callers get LeanOptimizer's attributes without the base importing back.
REGISTRY: dict[str, Any] = {}

_Optimizer = TypeVar("_Optimizer", bound=type)


def register(cls: _Optimizer) -> _Optimizer:
    """Class decorator: add ``cls`` (a ``torch.optim.Optimizer`` subclass that declares its own
    ``name`` and a ``family``) under its ``name`` (lower case, unique)."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or not isinstance(getattr(cls, "family", None), str):
        raise ValueError(f"{getattr(cls, '__name__', cls)!r} must be a torch.optim.Optimizer subclass with a `family` to be registered")
    name = cls.__dict__.get("name")
    if not isinstance(name, str) or name != name.lower() or not name:
        raise ValueError(f"{cls.__name__} must declare its own lower-case `name` to be registered")
    if name in REGISTRY and REGISTRY[name] is not cls:
        raise ValueError(f"optimizer name {name!r} is taken by {REGISTRY[name].__qualname__}")
    REGISTRY[name] = cls
    return cls


def optimizer_class(name: Any) -> Any:
    """The registered class of ``name`` (case-insensitive); ``ValueError`` naming the known ones."""
    cls = REGISTRY.get(name.lower()) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown leanopt optimizer {name!r}; known: {', '.join(REGISTRY)}")
    return cls
