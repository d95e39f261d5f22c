"""leanopt in Hugging Face ``Trainer``: the optimizer from a name, and its state memory in the logs.

``Trainer`` takes a custom optimizer two ways, and both work with every leanopt optimizer::

    Trainer(..., optimizers=(leanopt.AdamW(model.parameters(), lr=5e-5), None))
    Trainer(..., optimizer_cls_and_kwargs=optimizer_cls_and_kwargs("adamw8bit", args))

With ``optimizer_cls_and_kwargs`` Trainer builds two param groups (weight decay, and no decay
for biases and norms) and passes its kwargs unchanged: it does not inject
``TrainingArguments.learning_rate``. :func:`optimizer_cls_and_kwargs` fills the kwargs from the
``TrainingArguments`` the way Trainer does for its own ``optim`` names, for every name of
leanopt's registry (:data:`leanopt.optim.REGISTRY`) and the peers'.

Checkpoints resume exactly: leanopt's ``state_dict`` holds only tensors, numbers, strings, lists
and dicts (quantized states included), so Trainer's ``torch.load(weights_only=True)`` reads it.
Each param group declares the optimizer that saved it (``"optimizer": "lion8bit"``): resuming
with another member of its family converts the state (8-bit into 4-bit, into fp32, ...), and
with another family is refused by name, before anything is loaded. ``leanopt inspect`` and
``leanopt convert`` read the same name from a checkpoint's ``optimizer.pt``.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
from transformers import TrainerCallback

from leanopt.memory import StateMeasurement, measure, resolve_optimizer

logger = logging.getLogger("leanopt")

__all__ = ["ModelOptimizerFactory", "OptimizerStateCallback", "RelativeStepSchedule", "declared_name", "model_factory",
           "optimizer_cls_and_kwargs", "unwrap_optimizer"]


def optimizer_cls_and_kwargs(name: str | type, args: Any = None, **kwargs: Any) -> tuple[type, dict[str, Any]]:
    """``(class, kwargs)`` for ``Trainer(optimizer_cls_and_kwargs=...)`` from a name like ``"adamw8bit"``.

    Args:
        name: a name of :data:`leanopt.memory.OPTIMIZER_NAMES` (every optimizer of leanopt's
            registry, and the peers) or an optimizer class.
        args: ``TrainingArguments``, or ``None``. When given, ``lr`` comes from
            ``args.learning_rate``, and the rest by the rule the optimizer runs (its
            ``family``), as Trainer fills its own ``optim`` names: the AdamW family gets
            ``betas=(adam_beta1, adam_beta2)`` and ``eps=adam_epsilon``; Lion ``betas`` only
            (no eps: Lion has none); AdEMAMix ``betas=(adam_beta1, adam_beta2, beta3)`` with its
            own default ``beta3`` (Trainer has two Adam betas) and ``eps``. (``weight_decay`` is
            set per param group by Trainer itself, from ``args.weight_decay``.)
        **kwargs: override or extend the above.

    Note that Trainer's default ``adam_beta2`` is 0.999 where Lion's own is 0.99: pass
    ``betas=(0.9, 0.99)`` to keep Lion's (Trainer's ``optim="lion_32bit"`` also takes Adam's).

    Muon (``"muon"``, ``"muon8bit"``, ``"muon4bit"``) returns a factory
    (:class:`ModelOptimizerFactory`, which transformers' Trainer calls with the model): its
    groups are :func:`leanopt.muon_groups`'s, and with ``args`` it gets ``weight_decay``,
    ``adjust_lr_fn="match_rms_adamw"`` (so that Trainer's one ``learning_rate`` suits both the
    Muon and the AdamW groups) and the aux groups' ``aux_betas``/``aux_eps``.

    Adafactor gets ``relative_step=False, scale_parameter=False`` (what Trainer does for
    ``optim="adafactor"``): Trainer's learning-rate scheduler then scales its ``lr``. (A
    relative-step Adafactor runs under Trainer too, but sets its own step size and warns that
    the schedule is ignored.) Without ``args`` and ``lr`` it raises, for that reason.

    >>> from leanopt.integrations.transformers import optimizer_cls_and_kwargs
    >>> optimizer_cls_and_kwargs("adamw", lr=3e-4)
    (<class 'leanopt.optim.adamw.AdamW'>, {'lr': 0.0003})
    """
    cls = resolve_optimizer(name)
    family = _family(cls)
    out: dict[str, Any] = {}
    if args is not None:
        out["lr"] = args.learning_rate
        betas = (args.adam_beta1, args.adam_beta2)
        if family == "adamw":
            out.update(betas=betas, eps=args.adam_epsilon)
        elif family == "lion":
            out["betas"] = betas
        elif family == "ademamix":
            out.update(betas=(*betas, _default_betas(cls)[2]), eps=args.adam_epsilon)
    if family == "muon":
        if args is not None:
            # One learning rate for both rules: match_rms_adamw gives Muon's update AdamW's RMS.
            out.update(weight_decay=args.weight_decay, adjust_lr_fn="match_rms_adamw", aux_betas=betas, aux_eps=args.adam_epsilon)
        out.update(kwargs)
        return model_factory(cls), out
    if family == "adafactor":
        out.update(relative_step=False, scale_parameter=False)
        if "lr" not in out and kwargs.get("lr") is None and kwargs.get("relative_step", False) is False:
            raise ValueError(
                "Adafactor in Trainer needs a learning rate: pass args=TrainingArguments(...) or lr=... "
                "(Trainer's LR scheduler scales each group's lr; relative_step=True has none)"
            )
    out.update(kwargs)
    return cls, out


class RelativeStepSchedule(torch.optim.lr_scheduler.LRScheduler):
    """The schedule of a relative-step Adafactor (``leanopt.Adafactor()``'s default) in
    ``Trainer(optimizers=(optimizer, RelativeStepSchedule(optimizer)))``: it leaves each group's
    ``lr`` as the optimizer writes it, the relative step size it takes (``min(1e-2, 1/sqrt(t))``:
    1e-2 up to step 10,000; ``min(1e-6 t, 1/sqrt(t))`` with ``warmup_init=True``; times each
    param's RMS with ``scale_parameter=True``), so that the ``learning_rate`` Trainer
    logs is the one in use. With ``(optimizer, None)`` Trainer makes its own schedule, which
    the optimizer ignores (and says so once) while Trainer logs it. transformers'
    ``AdafactorSchedule`` is the same for its own Adafactor.

    >>> import torch, leanopt
    >>> from leanopt.integrations.transformers import RelativeStepSchedule
    >>> p = torch.nn.Parameter(torch.ones(4, 4))
    >>> opt = leanopt.Adafactor([p], warmup_init=True)
    >>> schedule = RelativeStepSchedule(opt)
    >>> for _ in range(4):
    ...     p.grad = torch.ones(4, 4)
    ...     opt.step()
    ...     schedule.step()
    >>> schedule.get_last_lr()  # 1e-6 * 4
    [4e-06]
    """

    def get_lr(self) -> list[float]:  # type: ignore[override]  # torch's is typed list[float | Tensor]
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_last_lr(self) -> list[float]:  # type: ignore[override]
        # Live: Trainer reads it between the optimizer's step and the schedule's, when the group
        # holds the step size just taken.
        return self.get_lr()


class ModelOptimizerFactory:
    """transformers' optimizer-factory protocol (``transformers.trainer_optimizer.is_optimizer_factory``)
    for an optimizer whose groups follow what a model's modules are (:class:`leanopt.Muon`):
    Trainer calls ``factory()(model, **kwargs)`` in place of ``cls(decay_groups, **kwargs)``.

    The groups are :func:`leanopt.muon_groups`'s, with Trainer's weight-decay rule: the Muon
    matrices and the aux params of >= 2 dims (embeddings, heads) take ``weight_decay``, the aux
    params of < 2 dims (biases, norms) none. The aux groups take ``lr``, ``aux_betas`` and
    ``aux_eps`` (:func:`optimizer_cls_and_kwargs` fills them from ``TrainingArguments``).
    """

    optimizer_class: type

    def __call__(self, model: torch.nn.Module, *, aux_betas: tuple[float, float] | None = None, aux_eps: float | None = None,
                 **kwargs: Any) -> torch.optim.Optimizer:  # fmt: skip
        from leanopt.optim.muon_groups import muon_groups_with_decay

        groups = muon_groups_with_decay(model, kwargs.get("weight_decay"), aux_lr=kwargs.get("lr"), aux_betas=aux_betas, aux_eps=aux_eps)
        return self.optimizer_class(groups, **kwargs)


_FACTORIES: dict[type, type[ModelOptimizerFactory]] = {}


def model_factory(cls: type) -> type[ModelOptimizerFactory]:
    """The :class:`ModelOptimizerFactory` class of optimizer ``cls`` (one per class)."""
    if cls not in _FACTORIES:
        _FACTORIES[cls] = type(f"{cls.__name__}Factory", (ModelOptimizerFactory,), {"optimizer_class": cls})
    return _FACTORIES[cls]


def _family(cls: type) -> str | None:
    """The rule ``cls`` runs: leanopt's optimizers declare it (``cls.family``); a peer's class
    (torch's, bitsandbytes', torchao's AdamW, bitsandbytes' Lion and AdEMAMix, transformers'
    Adafactor) is told by its name. torch's Adafactor takes none of the options filled here."""
    family = getattr(cls, "family", None)
    if isinstance(family, str):
        return family
    name = cls.__name__.lower()
    if name.startswith("adam"):
        return "adamw"
    for rule in ("ademamix", "lion"):
        if name.startswith(rule):
            return rule
    if cls.__module__.startswith("transformers.") and name == "adafactor":
        return "adafactor"
    return None


def _default_betas(cls: type) -> tuple[float, ...]:
    return tuple(inspect.signature(cls).parameters["betas"].default)


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The optimizer inside Accelerate's (and so Trainer's) ``AcceleratedOptimizer`` wrappers."""
    seen = 0
    while hasattr(optimizer, "optimizer") and isinstance(optimizer.optimizer, torch.optim.Optimizer) and seen < 8:
        optimizer, seen = optimizer.optimizer, seen + 1
    return optimizer


def declared_name(optimizer: Any) -> str:
    """The registry name the optimizer's param groups declare (``"adamw8bit"``), or, for a
    peer's optimizer, which declares none, its class name."""
    opt = unwrap_optimizer(optimizer)
    names = {g.get("optimizer") for g in opt.param_groups}
    name = names.pop() if len(names) == 1 else None
    return name if isinstance(name, str) else type(opt).__name__


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


class OptimizerStateCallback(TrainerCallback):
    """Logs the optimizer's measured state memory once, after its first step.

    The measurement (:func:`leanopt.measure`, so quantized and factored states are counted as
    they are stored) goes to the ``leanopt`` logger, to ``trainer.state.log_history`` as one
    record ``{"optimizer_state_bytes": ..., "optimizer_state_mb": ..., "step": ...}`` (kept in
    checkpoints, so a resumed run does not log it again), and to :attr:`measurement`. Under
    ``torch.distributed`` with more than one rank it adds ``optimizer_state_bytes_all_ranks``
    (every rank calls callbacks, so the all-reduce is collective).

    >>> from leanopt.integrations.transformers import OptimizerStateCallback
    >>> cb = OptimizerStateCallback()   # Trainer(..., callbacks=[cb]); cb.measurement after a step
    """

    KEY = "optimizer_state_bytes"

    def __init__(self) -> None:
        self.measurement: StateMeasurement | None = None
        self.record: dict[str, Any] | None = None

    def on_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        if self.record is not None or optimizer is None:
            return
        if any(self.KEY in entry for entry in state.log_history):  # resumed: logged before
            self.record = next(entry for entry in state.log_history if self.KEY in entry)
            return
        opt = unwrap_optimizer(optimizer)
        self.measurement = measure(opt)
        # Bytes per param on this rank: a DTensor param counts its local shard, as measure() does.
        params = sum(_local(p).numel() for g in opt.param_groups for p in g["params"])
        record: dict[str, Any] = {
            "optimizer": declared_name(opt),
            self.KEY: self.measurement.bytes,
            "optimizer_state_mb": round(self.measurement.megabytes, 3),
            "optimizer_state_bytes_per_param": round(self.measurement.bytes / params, 4) if params else 0.0,
        }
        if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            from leanopt.integrations.distributed import measure_global

            record["optimizer_state_bytes_all_ranks"] = measure_global(opt).total_bytes
        record["step"] = state.global_step + 1
        self.record = record
        state.log_history.append(record)
        logger.info(
            "%s state: %s bytes (%.1f MB, %.3f B/param)",
            record["optimizer"],
            f"{record[self.KEY]:,}",
            self.measurement.megabytes,
            record["optimizer_state_bytes_per_param"],
        )
