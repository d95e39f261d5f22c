"""Predict an optimizer's state bytes without allocating it.

The optimizer is built on ``meta`` copies of the parameters (so its own validation and param
group handling run, for free), and each parameter's state is read off a layout: for leanopt's
optimizers, their own ``state_layout`` (the same description their allocation uses); for the
peers, the layouts below, written from their ``_init_group``. The tests hold every layout
to ``measure()`` after a real step, to the byte.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from leanopt.catalog import PEER_NAMES
from leanopt.memory.measure import size_text
from leanopt.optim.base import LeanOptimizer
from leanopt.optim.layout import StateSpec
from leanopt.optim.registry import REGISTRY

MiB = 1024**2



class _OptimizerNames(Mapping[str, str]):
    """Every name the library knows: leanopt's from its registry (leanopt.optim.REGISTRY, in
    registration order; "leanopt:<class>", resolved through the registry), then the peers.
    Read at each use, so an optimizer registered after import (``leanopt.register``) is listed."""

    def _names(self) -> dict[str, str]:
        return {**{name: f"leanopt:{cls.__name__}" for name, cls in REGISTRY.items()}, **PEER_NAMES}

    def __getitem__(self, name: str) -> str:
        return self._names()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def __repr__(self) -> str:
        return f"OPTIMIZER_NAMES({self._names()!r})"


OPTIMIZER_NAMES: Mapping[str, str] = _OptimizerNames()


def resolve_optimizer(optimizer: str | type) -> type:
    """A name from :data:`OPTIMIZER_NAMES` (case-insensitive) or an optimizer class -> the class."""
    if isinstance(optimizer, type):
        if not issubclass(optimizer, torch.optim.Optimizer):
            raise ValueError(f"{optimizer.__name__} is not a torch.optim.Optimizer subclass")
        return optimizer
    if not isinstance(optimizer, str):
        raise ValueError(f"optimizer must be a name or a class, got {optimizer!r}")
    registered = REGISTRY.get(optimizer.lower())
    if registered is not None:
        return registered
    target = OPTIMIZER_NAMES.get(optimizer.lower())
    if target is None:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZER_NAMES)}")
    module, attr = target.split(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"optimizer {optimizer!r} is not available here ({err})") from None
    return cls


def available_optimizers() -> list[str]:
    """The names in :data:`OPTIMIZER_NAMES` whose class can be imported here."""
    out = []
    for name in OPTIMIZER_NAMES:
        try:
            resolve_optimizer(name)
        except ValueError:
            continue
        out.append(name)
    return out


@dataclass
class StateEstimate:
    """Predicted optimizer state: totals and a per-key breakdown (bytes)."""

    optimizer: str
    bytes: int = 0
    elements: int = 0
    params: int = 0
    tensors: int = 0
    by_key: dict[str, int] = field(default_factory=dict)
    elements_by_key: dict[str, int] = field(default_factory=dict)

    @property
    def megabytes(self) -> float:
        return self.bytes / MiB

    @property
    def bytes_per_param(self) -> float:
        return self.bytes / self.params if self.params else 0.0

    def __str__(self) -> str:
        return (
            f"{self.optimizer}: {self.bytes:,} bytes ({size_text(self.bytes)}) for {self.params:,} params, "
            f"{self.bytes_per_param:.3f} B/param"
        )


# ---- peers' layouts ----------------------------------------------------------------------
LayoutFn = Callable[[torch.optim.Optimizer, torch.Tensor, Mapping[str, Any]], list[StateSpec]]


def _torch_adam_layout(opt: torch.optim.Optimizer, p: torch.Tensor, group: Mapping[str, Any]) -> list[StateSpec]:
    shape = tuple(p.shape)
    on_device = bool(group.get("fused") or group.get("capturable"))
    specs = [
        StateSpec("step", (), torch.float32, host=not on_device),
        StateSpec("exp_avg", shape, p.dtype),
        StateSpec("exp_avg_sq", shape, p.dtype),
    ]
    if group.get("amsgrad"):
        specs.append(StateSpec("max_exp_avg_sq", shape, p.dtype))
    return specs


def _torch_adafactor_layout(opt: torch.optim.Optimizer, p: torch.Tensor, group: Mapping[str, Any]) -> list[StateSpec]:
    shape = tuple(p.shape)
    specs = [StateSpec("step", (), torch.float32, host=True)]
    if len(shape) > 1:
        specs.append(StateSpec("row_var", shape[:-1] + (1,), p.dtype))
        specs.append(StateSpec("col_var", shape[:-2] + (1,) + shape[-1:], p.dtype))
    else:
        specs.append(StateSpec("variance", shape, p.dtype))
    return specs


def _hf_adafactor_layout(opt: torch.optim.Optimizer, p: torch.Tensor, group: Mapping[str, Any]) -> list[StateSpec]:
    # transformers keeps `step` as a Python int (no tensor memory), `RMS` as a 0-dim tensor
    # and its states in the gradient's dtype after upcasting bf16/fp16 to fp32.
    shape = tuple(p.shape)
    dtype = torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype
    specs = [StateSpec("RMS", (), dtype)]
    if group.get("beta1") is not None:
        specs.append(StateSpec("exp_avg", shape, dtype))
    if len(shape) >= 2:
        specs.append(StateSpec("exp_avg_sq_row", shape[:-1], dtype))
        specs.append(StateSpec("exp_avg_sq_col", shape[:-2] + shape[-1:], dtype))
    else:
        specs.append(StateSpec("exp_avg_sq", shape, dtype))
    return specs


PEER_LAYOUTS: dict[str, LayoutFn] = {
    "torch.optim.adamw.AdamW": _torch_adam_layout,
    "torch.optim.adam.Adam": _torch_adam_layout,
    "torch.optim.Adafactor": _torch_adafactor_layout,
    "torch.optim._adafactor.Adafactor": _torch_adafactor_layout,
    "transformers.optimization.Adafactor": _hf_adafactor_layout,
}


def register_layout(cls: type, layout: LayoutFn) -> None:
    """Teach :func:`estimate` the state layout of another optimizer class."""
    PEER_LAYOUTS[f"{cls.__module__}.{cls.__qualname__}"] = layout


def _layout_fn(cls: type) -> LayoutFn:
    if issubclass(cls, LeanOptimizer):
        # LayoutFn takes any torch Optimizer; this one is returned for LeanOptimizer classes only.
        return lambda opt, p, group: opt._param_layout(p, group)  # type: ignore[attr-defined]
    for klass in cls.__mro__:
        fn = PEER_LAYOUTS.get(f"{klass.__module__}.{klass.__qualname__}")
        if fn is not None:
            return fn
    raise ValueError(
        f"no state layout known for {cls.__module__}.{cls.__qualname__}; "
        "use leanopt.memory.register_layout, or measure() after a step"
    )


# ---- estimate ------------------------------------------------------------------------------
def _meta(p: torch.Tensor) -> torch.Tensor:
    # DTensor reports its global shape, so the estimate is the unsharded one.
    return torch.empty(tuple(p.shape), dtype=p.dtype, device="meta", requires_grad=True)


def _tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    """The same key for every tensor object that is the same parameter: one Parameter listed
    twice (tied weights), or two tensors over the same memory with the same shape and strides."""
    if t.device.type == "meta" or type(t) not in (torch.Tensor, torch.nn.Parameter):
        return ("id", id(t))  # no memory to compare (meta), or a wrapper (DTensor): identity
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without real storage (fake)
        ptr = 0
    if ptr == 0:
        return ("id", id(t))
    return (str(t.device), ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def unique_params(model_or_params: Any) -> Any:
    """``model_or_params`` with each parameter kept at its first appearance only.

    ``model.named_parameters(remove_duplicate=False)``, a list that names a tied weight twice,
    or param groups that repeat one would otherwise count it twice, where the optimizer (and
    :func:`~leanopt.measure`) keeps one state for it. A model's ``parameters()`` already
    lists each once, and a model is returned as it is; anything else becomes a list (a
    generator is consumed once). Groups that end up empty are dropped.
    """
    if isinstance(model_or_params, (torch.nn.Module, torch.Tensor)):
        return model_or_params
    seen: set[tuple[Any, ...]] = set()

    def first(t: Any) -> bool:
        if not isinstance(t, torch.Tensor):
            return True  # not a tensor: estimate() says what is wrong with it
        key = _tensor_key(t)
        if key in seen:
            return False
        seen.add(key)
        return True

    out: list[Any] = []
    for item in model_or_params:
        if isinstance(item, Mapping) and "params" in item:
            params = item["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            kept = [p for p in params if first(p)]
            if kept or not params:
                out.append({**item, "params": kept})
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
            if first(item[1]):
                out.append(item)
        elif first(item):
            out.append(item)
    return out


def _meta_params(model_or_params: Any) -> list[Any]:
    if isinstance(model_or_params, torch.nn.Module):
        return [_meta(p) for p in model_or_params.parameters() if p.requires_grad]
    if isinstance(model_or_params, torch.Tensor):
        return [_meta(model_or_params)]
    items = unique_params(model_or_params)
    out: list[Any] = []
    for item in items:
        if isinstance(item, Mapping):
            group = dict(item)
            params = group["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            group["params"] = [_meta(p) for p in params]
            out.append(group)
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
            out.append((item[0], _meta(item[1])))  # named parameters
        elif isinstance(item, torch.Tensor):
            out.append(_meta(item))
        else:
            raise ValueError(f"expected a model, tensors or param groups, got an item of type {type(item).__name__}")
    return out


def estimate(model_or_params: Any, optimizer: str | type = "adamw", **optimizer_kwargs: Any) -> StateEstimate:
    """Predict the state ``optimizer`` will hold for ``model_or_params`` after one step.

    Nothing is allocated: works for a model on the ``meta`` device. ``optimizer`` is a name
    (see :data:`OPTIMIZER_NAMES`) or a class; ``optimizer_kwargs`` go to its constructor.
    Assumes every parameter receives a gradient (a parameter that never does gets no state).
    A parameter listed more than once (tied weights in ``named_parameters(remove_duplicate=False)``)
    counts once, as the optimizer keeps one state for it.

    >>> import torch, leanopt
    >>> with torch.device("meta"):
    ...     model = torch.nn.Linear(1024, 1024)
    >>> leanopt.estimate(model, "adamw").bytes   # 2 x 4 B x 1,049,600 params + 2 steps x 4 B
    8396808
    """
    cls = resolve_optimizer(optimizer)
    layout = _layout_fn(cls)
    if isinstance(model_or_params, torch.nn.Module) and issubclass(cls, LeanOptimizer):
        model_or_params = cls.groups_for_model(model_or_params)  # Muon: its param groups of the model
    opt = cls(_meta_params(model_or_params), **optimizer_kwargs)
    name = optimizer if isinstance(optimizer, str) else f"{cls.__module__}.{cls.__qualname__}"
    result = StateEstimate(optimizer=name)
    for group in opt.param_groups:
        for p in group["params"]:
            result.params += p.numel()
            result.tensors += 1
            for spec in layout(opt, p, group):
                nbytes, elements = spec.nbytes(), spec.elements()
                result.bytes += nbytes
                result.elements += elements
                result.by_key[spec.key] = result.by_key.get(spec.key, 0) + nbytes
                result.elements_by_key[spec.key] = result.elements_by_key.get(spec.key, 0) + elements
    return result

