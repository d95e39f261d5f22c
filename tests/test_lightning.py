"""PyTorch Lightning with every registered optimizer: ``configure_optimizers`` returns
it, ``precision="bf16-true"`` keeps the weights in bf16 with ``rounding="kahan"``, and the run is
bit-identical to the same steps written as a plain loop (examples/lightning_train.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from registry import REGISTERED, OptimizerCase

STEPS = 12
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "lightning_train.py"


@pytest.fixture(scope="module")
def lightning_train() -> ModuleType:
    """examples/lightning_train.py, imported when a test here runs: lightning takes ~5 s of CPU
    to import, which collecting the suite on every pytest-xdist worker would pay."""
    pytest.importorskip("lightning")
    spec = importlib.util.spec_from_file_location("lightning_train", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("lightning_train", module)
    spec.loader.exec_module(module)
    return module


def _kwargs(case: OptimizerCase) -> dict:
    return {k: v for k, v in case.kwargs.items() if k not in ("lr", "rounding")}


def _lr(case: OptimizerCase) -> float:
    return float(case.kwargs.get(case.lr_key or "lr", 1e-3) or 1e-3)


def _plain_loop(lightning_train: ModuleType, case: OptimizerCase) -> tuple[list[float], list[torch.Tensor]]:
    """What Lightning's bf16-true run does, written out: the module and its inputs in bf16, the
    optimizer stepped with a closure that runs the training step and backward."""
    torch.manual_seed(0)
    module = lightning_train.Regressor(case.name, _lr(case), **_kwargs(case)).to(torch.bfloat16)
    opt = module.configure_optimizers()
    for x, y in lightning_train.data(STEPS):
        x, y = x.to(torch.bfloat16), y.to(torch.bfloat16)

        def closure() -> torch.Tensor:
            loss = module.training_step((x, y), 0)
            loss.backward()
            return loss

        opt.step(closure)
        opt.zero_grad()
    return module.losses, [p.detach().clone() for p in module.parameters()]


@pytest.mark.parametrize("case", REGISTERED, ids=str)
def test_lightning_bf16_true_with_kahan_is_the_plain_loop(lightning_train: ModuleType, case: OptimizerCase) -> None:
    torch.manual_seed(0)
    module = lightning_train.Regressor(case.name, _lr(case), **_kwargs(case))
    trainer = lightning_train.train(module, STEPS)
    opt = trainer.optimizers[0]
    assert type(opt).name == case.name and all(g["rounding"] == "kahan" for g in opt.param_groups)
    params = list(module.parameters())
    assert all(p.dtype == torch.bfloat16 for p in params)  # no fp32 master copy anywhere
    assert all("kahan_comp" in opt.state[p] for p in params)
    assert len(module.losses) == STEPS and module.losses[-1] < module.losses[0], module.losses
    losses, expected = _plain_loop(lightning_train, case)
    assert module.losses == losses
    for p, q in zip(params, expected):
        assert torch.equal(p.detach(), q)
