"""The one list of leanopt's optimizers: name -> class.

Every optimizer module registers its classes with :func:`register`; the CLI, ``estimate``,
``inspect``/``convert``, the transformers integration and ``compare`` look names up here, and
the name is what each param group of a ``state_dict`` saves under ``"optimizer"`` (the
optimizer's declared identity).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # base imports this module (inside a function); the annotation only needs the name
    from leanopt.optim.base import LeanOptimizer

# Every registered class is a LeanOptimizer subclass (leanopt's own and the external ones of the
# contract suite): typed so, its ``name``, ``family`` and constructor are visible to mypy.
REGISTRY: dict[str, type[LeanOptimizer]] = {}

_Optimizer = TypeVar("_Optimizer", bound="type[LeanOptimizer]")


def register(cls: _Optimizer) -> _Optimizer:
    """Class decorator: add ``cls`` under its ``name`` (lower case, unique)."""
    name = cls.__dict__.get("name")
    if not isinstance(name, str) or name != name.lower() or not name:
        raise ValueError(f"{cls.__name__} must declare its own lower-case `name` to be registered")
    if name in REGISTRY and REGISTRY[name] is not cls:
        raise ValueError(f"optimizer name {name!r} is taken by {REGISTRY[name].__qualname__}")
    REGISTRY[name] = cls
    return cls


def optimizer_class(name: Any) -> type[LeanOptimizer]:
    """The registered class of ``name`` (case-insensitive); ``ValueError`` naming the known ones."""
    cls = REGISTRY.get(name.lower()) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown leanopt optimizer {name!r}; known: {', '.join(REGISTRY)}")
    return cls
