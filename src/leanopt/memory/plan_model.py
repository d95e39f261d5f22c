"""The model side of a planned training step, shared by the planner, its probes and ``doctor``.

What they read of a transformers model (its head's task, vocabulary, labels, positions), the
fake copy a step is traced on (:func:`fake_copy`: the model itself is never touched),
activation checkpointing turned on for a trace, and the optimizer each configuration builds.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from leanopt.memory.estimate import resolve_optimizer, unique_params
from leanopt.memory.plan_trace import Options, ParamKey, built_over, swapped_copy
from leanopt.optim.base import LeanOptimizer
from leanopt.optim.rounding import LOW_PRECISION

__all__ = [
    "PARAM_DTYPE",
    "Shapes",
    "check_positions",
    "checkpointing",
    "fake_copy",
    "fake_mode",
    "load_model",
    "num_labels",
    "one_line",
    "optimizer_factory",
    "orthogonalization_flops",
    "over_model",
    "param_keys",
    "param_shapes",
    "steps_each_param_alone",
    "task_of",
    "trainable_params",
    "vocab_size",
]

# The dtype of the params each precision trains: bf16-mixed keeps fp32 params (autocast makes the
# bf16 copies), pure bf16 has bf16 params.
PARAM_DTYPE = {"fp32": torch.float32, "bf16-mixed": torch.float32, "bf16": torch.bfloat16}

Shapes = list[tuple[tuple[int, ...], torch.dtype]]  # (shape, dtype) of each unique trainable param


def load_model(spec: Any) -> tuple[torch.nn.Module, str]:
    """``(model, label)`` of a preset, config or Hub id (meta tensors) or of a module as given."""
    if isinstance(spec, torch.nn.Module):
        return spec, type(spec).__name__
    if not isinstance(spec, str):
        raise ValueError(f"expected a model name, config path or torch.nn.Module, got {type(spec).__name__}")
    from leanopt.memory.presets import resolve_model

    source = resolve_model(spec)  # one-line ValueError for unknown names and architectures
    if not source.exact_shapes:
        raise ValueError(f"{spec!r} is a bare parameter count: a plan needs the model (a preset, config.json or Hub id)")
    return source.params, source.name


def task_of(model: torch.nn.Module) -> str:
    """``"classification"`` or ``"lm"`` (labels = input ids); ValueError for anything else."""
    name = type(model).__name__
    if name.endswith("ForSequenceClassification"):
        return "classification"
    if name.endswith(("ForCausalLM", "LMHeadModel", "ForMaskedLM", "ForConditionalGeneration")):
        return "lm"
    raise ValueError(
        f"cannot trace a training step of {name}: no head with a loss (plan takes models for sequence "
        "classification, causal, masked or seq2seq LM)"
    )


def vocab_size(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if vocab is None and config is not None and hasattr(config, "get_text_config"):
        vocab = getattr(config.get_text_config(), "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"cannot trace {type(model).__name__}: its config has no vocab_size for the input ids")
    return vocab


def num_labels(model: torch.nn.Module) -> int:
    return int(getattr(getattr(model, "config", None), "num_labels", 2) or 2)


def check_positions(model: torch.nn.Module, seq: int) -> None:
    """A model with learned position embeddings takes no sequence longer than its table (fake
    tensors would not notice the out-of-range lookup that fails a real step)."""
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not isinstance(positions, int) or seq <= positions:
        return
    if any(isinstance(m, torch.nn.Embedding) and m.num_embeddings == positions for m in model.modules()):
        raise ValueError(f"cannot trace {type(model).__name__} at seq {seq}: it has learned positions for {positions} tokens")


def fake_mode() -> Any:
    from torch._subclasses import FakeTensorMode

    # Real constants a model makes on the fly (torch.tensor(0.5)) become fake; nothing else is real.
    return FakeTensorMode(allow_non_fake_inputs=True)


def fake_copy(model: torch.nn.Module, mode: Any, dtype: torch.dtype) -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
    """A copy of ``model`` with every parameter and buffer a fake CPU tensor of ``mode`` (floating
    ones of ``dtype``), tied weights kept tied, and its unique trainable parameters. ``model`` is
    not touched (another thread may be training it)."""
    trainable: list[torch.nn.Parameter] = []

    def fake(t: torch.Tensor) -> torch.Tensor:
        with mode:
            data = torch.empty(tuple(t.shape), dtype=dtype if t.is_floating_point() else t.dtype, device="cpu")
            if not isinstance(t, torch.nn.Parameter):
                return data
            new = torch.nn.Parameter(data, requires_grad=t.requires_grad)
        if t.requires_grad:
            trainable.append(new)
        return new

    return swapped_copy(model, fake), trainable


@contextlib.contextmanager
def checkpointing(model: torch.nn.Module, on: bool) -> Iterator[None]:
    """Activation checkpointing on ``model`` (a fake copy) while inside, if ``on``."""
    if not on:
        yield
        return
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support activation checkpointing")
    enable = getattr(model, "activation_checkpointing_enable", None) or getattr(model, "gradient_checkpointing_enable", None)
    disable = getattr(model, "activation_checkpointing_disable", None) or getattr(model, "gradient_checkpointing_disable", None)
    if not callable(enable) or not callable(disable):
        raise ValueError(
            f"{type(model).__name__} says it supports activation checkpointing but has no callable "
            "gradient_checkpointing_enable/_disable (or activation_checkpointing_enable/_disable)"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        enable()
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            disable()


def optimizer_factory(optimizer: str, rounding: str | None, device: str = "cpu") -> Any:
    """A constructor of the registered ``optimizer`` over params or param groups (what
    :func:`~leanopt.memory.plan_trace.built_over` makes of :func:`param_keys`), with ``rounding=`` bound
    (leanopt's), or ``foreach=True`` bound where torch's own takes it on CUDA params."""
    cls = resolve_optimizer(optimizer)
    # The class as the constructor it is: the keywords bound below are the concrete class's own
    # (foreach: found in its signature; rounding: every leanopt optimizer's __init__), not its base's.
    make: Callable[..., torch.optim.Optimizer] = cls
    if not issubclass(cls, LeanOptimizer):
        # torch's optimizers take foreach by default for CUDA params (the fake ones are CPU tensors)
        takes_foreach = device == "cuda" and "foreach" in inspect.signature(cls).parameters
        return functools.partial(make, foreach=True) if takes_foreach else cls
    return cls if rounding is None else functools.partial(make, rounding=rounding)


def param_shapes(model: torch.nn.Module, dtype: torch.dtype) -> Shapes:
    """(shape, dtype) of each unique trainable param of ``model``, floating ones in ``dtype``."""
    return [(tuple(p.shape), dtype if p.is_floating_point() else p.dtype) for p in _unique_trainable(model)]


def over_model(cls: type, model: torch.nn.Module) -> Any:
    """What ``cls`` is built over to train the whole (real) ``model``: a leanopt optimizer's
    ``groups_for_model`` (Muon: its matrices and its aux group), another's ``model.parameters()``."""
    return cls.groups_for_model(model) if issubclass(cls, LeanOptimizer) else model.parameters()


def param_keys(model: torch.nn.Module, optimizer: str, dtype: torch.dtype) -> list[ParamKey]:
    """``(shape, dtype, group options)`` of each unique trainable param of ``model`` (floating ones
    in ``dtype``), in the order of ``model.parameters()``: the options of the param group
    ``optimizer`` puts it in when built over the whole model (``groups_for_model``: Muon's
    matrices, and its aux group of embeddings, head, norms and biases), ``()`` where it takes
    the optimizer's defaults."""
    cls = resolve_optimizer(optimizer)
    options: dict[int, Options] = {}
    if issubclass(cls, LeanOptimizer):
        for group in cls.groups_for_model(model):
            if isinstance(group, dict):
                frozen = _frozen_options(group)
                for p in group["params"]:
                    options.setdefault(id(p), frozen)
    return [(shape, dt, options.get(id(p), ())) for p, (shape, dt) in zip(_unique_trainable(model), param_shapes(model, dtype), strict=True)]


def orthogonalization_flops(model: torch.nn.Module, optimizer: str) -> int | None:
    """Floating-point operations of one ``optimizer.step()`` over ``model`` spent orthogonalizing
    matrices by Newton-Schulz (:func:`leanopt.kernels.newton_schulz.flops`, each param of a group
    with ``use_muon`` and ``ns_steps``, by the group's ``ns_steps`` and ``flatten``); None for an
    optimizer with no such group. Nothing is allocated (the optimizer is built over meta params)."""
    from leanopt.kernels import newton_schulz

    cls = resolve_optimizer(optimizer)
    if not issubclass(cls, LeanOptimizer):
        return None
    keys = param_keys(model, optimizer, torch.float32)
    params = [torch.nn.Parameter(torch.empty(shape, dtype=dtype, device="meta")) for shape, dtype, _ in keys]
    make: Callable[..., torch.optim.Optimizer] = cls  # the concrete class, as optimizer_factory builds it
    opt = make(built_over(params, [o for _, _, o in keys]))
    groups = [g for g in opt.param_groups if g.get("use_muon") and "ns_steps" in g]
    if not groups:
        return None
    return sum(newton_schulz.flops(tuple(p.shape), int(g["ns_steps"]), bool(g.get("flatten", False))) for g in groups for p in g["params"])


def trainable_params(model: torch.nn.Module) -> int:
    """Elements of ``model``'s unique trainable params."""
    return sum(p.numel() for p in _unique_trainable(model))


def _frozen_options(group: dict[str, Any]) -> Options:
    """A param group's options but its params, as sorted (key, value) pairs; lists as tuples."""
    items = []
    for k, v in sorted(group.items()):
        if k == "params":
            continue
        value = tuple(v) if isinstance(v, list) else v
        try:
            hash(value)
        except TypeError:
            raise ValueError(f"cannot plan a param group whose {k!r} is {type(v).__name__}") from None
        items.append((k, value))
    return tuple(items)


def _unique_trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return unique_params([p for p in model.parameters() if p.requires_grad])


def steps_each_param_alone(optimizer: str, rounding: str | None, dtype: torch.dtype) -> bool:
    """Whether a step updates each param on its own, through an fp32 copy (stochastic or Kahan
    rounding of bf16/fp16 params by a leanopt optimizer)."""
    return rounding in ("stochastic", "kahan") and dtype in LOW_PRECISION and issubclass(resolve_optimizer(optimizer), LeanOptimizer)


def one_line(err: BaseException) -> str:
    """``"TypeError: first line"``: an exception in one line."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__
