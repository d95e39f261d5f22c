"""Train with a leanopt optimizer in a plain Accelerate loop, then resume from a checkpoint.

    python examples/accelerate_train.py --optimizer adamw8bit --mixed-precision bf16

The loop is Accelerate's usual one: ``prepare(model, optimizer, dataloader)``, gradient
accumulation with ``accelerator.accumulate``, ``accelerator.backward``, and
``save_state``/``load_state``. It trains for ``--steps`` optimizer steps, saving at half-way;
then a fresh model and optimizer load that checkpoint and train the second half again, and the
script checks that both end with the same weights. Runs on the CPU as it is (``--cpu`` is the
default here; drop it on a GPU machine).
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

import leanopt
from leanopt.memory import resolve_optimizer


def make_data(n: int = 512, seed: int = 0) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 64, generator=g)
    y = (x[:, :8].sum(dim=1) > 0).long()
    return torch.utils.data.TensorDataset(x, y)


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    # The 64x128 and 128x128 weights are large enough to be quantized by the 8/4-bit optimizers.
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 128), torch.nn.GELU(), torch.nn.Linear(128, 2)
    )


def train(
    optimizer: str = "adamw",
    *,
    steps: int = 8,
    grad_accum: int = 2,
    batch_size: int = 16,
    mixed_precision: str = "bf16",
    cpu: bool = True,
    lr: float = 1e-3,
    save_at: int | None = None,
    checkpoint_dir: str | None = None,
    resume_from: str | None = None,
    model_seed: int = 0,
    optimizer_kwargs: dict | None = None,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[float]]:
    """``steps`` optimizer steps of ``grad_accum`` micro-batches each; returns model, optimizer, losses.

    ``losses`` holds one value per optimizer step: the mean loss over its micro-batches.

    ``save_at``: optimizer step after which ``save_state(checkpoint_dir)`` runs. ``resume_from``: a
    checkpoint of a run of the same settings; training continues from where it was saved.
    ``optimizer_kwargs``: more keywords for the optimizer (``momentum`` for SGD).
    """
    # One Accelerator per process is Accelerate's model; forget the previous one's settings.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = Accelerator(mixed_precision=mixed_precision, cpu=cpu, gradient_accumulation_steps=grad_accum)
    model = make_model(model_seed)
    cls = resolve_optimizer(optimizer)
    kwargs = {"lr": lr, "relative_step": False, "scale_parameter": False} if cls is leanopt.Adafactor else {"lr": lr}
    # A leanopt optimizer's params for the model (Muon: its matrices, and an AdamW group for the rest).
    params = cls.groups_for_model(model) if issubclass(cls, leanopt.optim.LeanOptimizer) else model.parameters()
    opt = cls(params, **kwargs, **(optimizer_kwargs or {}))
    loader = torch.utils.data.DataLoader(make_data(), batch_size=batch_size, shuffle=False)
    model, opt, loader = accelerator.prepare(model, opt, loader)

    done = 0
    if resume_from is not None:
        accelerator.load_state(resume_from)
        done = int(next(iter(opt.state.values()))["step"])  # optimizer steps taken before the save
    skip = (done * grad_accum) % len(loader)
    losses: list[float] = []
    micro_loss = 0.0
    while done < steps:
        # Resuming mid-epoch: skip the micro-batches already seen (the loader doesn't shuffle).
        for x, y in accelerator.skip_first_batches(loader, skip) if skip else loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.cross_entropy(model(x).float(), y)
                accelerator.backward(loss)
                opt.step()  # a no-op on the micro-batches that only accumulate
                opt.zero_grad()
            micro_loss += loss.item() / grad_accum
            if accelerator.sync_gradients:
                done += 1
                losses.append(micro_loss)
                micro_loss = 0.0
                if save_at is not None and done == save_at:
                    accelerator.save_state(checkpoint_dir)
                if done == steps:
                    break
        skip = 0
    return accelerator.unwrap_model(model), opt, losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--optimizer", default="adamw", help="adamw, adafactor, adamw8bit, adamw4bit")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--mixed-precision", default="bf16", choices=["no", "bf16", "fp16"])
    parser.add_argument("--gpu", action="store_true", help="use the accelerator device instead of the CPU")
    args = parser.parse_args(argv)

    common = dict(steps=args.steps, grad_accum=args.grad_accum, mixed_precision=args.mixed_precision, cpu=not args.gpu)
    half = args.steps // 2
    with tempfile.TemporaryDirectory() as tmp:
        model, opt, losses = train(args.optimizer, save_at=half, checkpoint_dir=tmp, **common)
        inner = getattr(opt, "optimizer", opt)
        print(f"{type(inner).__name__}: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {args.steps} steps")
        print(f"optimizer state: {leanopt.measure(inner)}")
        resumed, _, resumed_losses = train(args.optimizer, resume_from=tmp, model_seed=1, **common)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters()))
    print(f"resumed at step {half}: losses {resumed_losses[0]:.4f} -> {resumed_losses[-1]:.4f}; "
          f"same final weights as the uninterrupted run: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
