"""Trainer's own features with one registered optimizer per family: gradient clipping
(``max_grad_norm``), gradient accumulation, ``bf16=True`` and the LR schedulers Trainer builds,
each checked against the same Trainer run with ``torch.optim.AdamW``: the same learning rate at
every step, the same first gradient (nothing has been updated yet), clipped norms within the
bound. Resume with ``save_only_model=False`` (Trainer's default) is
``test_trainer.py::test_resume_from_checkpoint_ends_with_the_uninterrupted_weights``; gradient
release runs with ``max_grad_norm=0``
(``test_trainer.py::test_released_gradients_under_trainer_equal_the_usual_run``).

Each feature acts on the gradients before ``step`` (clipping, accumulation, autocast) or on the
groups' ``lr`` (the schedulers), which every rule reads as tests/test_contract.py checks: the
rule does not enter it, so one optimizer per family runs it (``registry.representatives``);
every registered optimizer trains, saves and resumes under Trainer in tests/test_trainer.py."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from registry import REGISTERED, OptimizerCase, representatives

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from leanopt.integrations.transformers import optimizer_cls_and_kwargs, unwrap_optimizer  # noqa: E402
from test_trainer import TokenDataset, tiny_distilbert, training_args  # noqa: E402

STEPS = 4
FEATURES: dict[str, dict[str, Any]] = {
    "clip": {"max_grad_norm": 0.05},
    "accumulation": {"gradient_accumulation_steps": 2},
    "bf16": {"bf16": True},
    "cosine-warmup": {"lr_scheduler_type": "cosine", "warmup_steps": 2},
    "polynomial": {"lr_scheduler_type": "polynomial", "lr_scheduler_kwargs": {"power": 2.0}},
}


def _run(name: str, extra: dict[str, Any], feature: str, tmp_path) -> dict[str, Any]:
    model = tiny_distilbert()
    seen: dict[str, Any] = {"lrs": [], "norms": [], "forwards": 0}

    def count(*_: Any) -> None:
        seen["forwards"] += 1

    model.register_forward_pre_hook(count)
    args = training_args(tmp_path / f"{name}-{feature}", max_steps=STEPS, **FEATURES[feature])
    trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenDataset(),
                                   optimizer_cls_and_kwargs=optimizer_cls_and_kwargs(name, args, **extra))  # fmt: skip
    trainer.create_optimizer()

    def before_step(opt: torch.optim.Optimizer, *_: Any) -> None:
        seen["lrs"].append(float(opt.param_groups[0]["lr"]))
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        seen["norms"].append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in grads])).item())

    opt = unwrap_optimizer(trainer.optimizer)
    opt.register_step_pre_hook(before_step)
    result = trainer.train()
    seen.update(optimizer=opt, model=model, loss=result.training_loss, global_step=trainer.state.global_step)
    return seen


@functools.cache
def _reference(feature: str, tmp: str) -> dict[str, Any]:
    from pathlib import Path

    return _run("torch-adamw", {}, feature, Path(tmp))


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("case", representatives(REGISTERED), ids=str)
def test_trainer_feature_with_every_family(case: OptimizerCase, feature: str, tmp_path_factory) -> None:
    ref = _reference(feature, str(tmp_path_factory.getbasetemp() / "reference"))
    run = _run(case.name, case.state_kwargs, feature, tmp_path_factory.mktemp(case.name))
    assert run["global_step"] == STEPS and len(run["lrs"]) == STEPS, run["lrs"]
    assert run["lrs"] == ref["lrs"]  # Trainer's scheduler drives the optimizer's lr, step by step
    assert torch.isfinite(torch.tensor(run["loss"]))
    # The first step's gradient (clipped, accumulated, under autocast) is the reference's: the
    # optimizer has changed nothing yet.
    assert run["norms"][0] == pytest.approx(ref["norms"][0], rel=1e-6)
    if feature == "clip":
        assert max(run["norms"]) <= 0.05 * (1 + 1e-5), run["norms"]
    if feature == "accumulation":
        assert run["forwards"] == 2 * STEPS == ref["forwards"]
    if feature == "bf16":  # autocast: fp32 weights, fp32 (or quantized) states
        assert all(p.dtype == torch.float32 for p in run["model"].parameters())
        states = [v for st in run["optimizer"].state.values() for v in st.values()
                  if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0]  # fmt: skip
        assert all(v.dtype == torch.float32 for v in states)
