"""PyTorch Lightning with a leanopt optimizer: bf16 weights without fp32 master weights.

    python examples/lightning_train.py            # AdamW8bit, 40 steps on the CPU
    python examples/lightning_train.py lion4bit

``precision="bf16-true"`` makes Lightning keep the weights themselves in bf16 (no fp32 master
copy: 2 B/param instead of 4 + 2). Each update is then rounded to bf16, and updates smaller
than half a bf16 unit are lost; ``rounding="kahan"`` keeps what the rounding lost in a bf16
compensation buffer (2 B/param) and adds it back on the next step, so training follows the
fp32 run closely (docs/integrations.md). The optimizer is returned from
``configure_optimizers`` as any torch optimizer is; Lightning's schedulers, clipping and
checkpoints work with it as with torch's.
"""

from __future__ import annotations

import sys

import lightning as L
import torch

import leanopt


class Regressor(L.LightningModule):
    """A small MLP fitting a fixed random linear map, trained by any registered leanopt optimizer."""

    def __init__(self, optimizer: str = "adamw8bit", lr: float = 1e-3, **optimizer_kwargs: object) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8))
        self.optimizer_name, self.lr, self.optimizer_kwargs = optimizer, lr, optimizer_kwargs
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y.float())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        cls = leanopt.optim.optimizer_class(self.optimizer_name)
        # Its params (Muon: its matrices, and an AdamW group for the rest: leanopt.muon_groups).
        return cls(cls.groups_for_model(self), lr=self.lr, rounding="kahan", **self.optimizer_kwargs)


def data(steps: int, batch: int = 32, seed: int = 0) -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(steps * batch, 64, generator=gen)
    y = x @ torch.randn(64, 8, generator=gen) * 0.1
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)


def train(module: Regressor, steps: int) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", devices=1, precision="bf16-true", max_steps=steps, max_epochs=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    trainer.fit(module, data(steps))
    return trainer


if __name__ == "__main__":
    name = sys.argv[1] if len(sys.argv) > 1 else "adamw8bit"
    torch.manual_seed(0)
    model = Regressor(name)
    train(model, 40)
    print(f"{name}: loss {model.losses[0]:.4f} -> {model.losses[-1]:.4f} in {len(model.losses)} steps, "
          f"weights {next(model.parameters()).dtype}")
