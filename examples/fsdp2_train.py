"""FSDP2 with a leanopt optimizer: sharded state, its memory over ranks, a DCP checkpoint and resume.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 examples/fsdp2_train.py --optimizer adafactor

On the CPU it uses gloo; with CUDA devices, nccl (one device per rank). Each param becomes a
DTensor sharded on dim 0 by ``fully_shard``, and leanopt gives its state the same sharding
(Adafactor's column statistics, a mean over the sharded rows, are all-reduced and replicated).
Half-way the script saves model and optimizer with ``torch.distributed.checkpoint``; a fresh
model and optimizer then load it and train the second half again, ending on the same weights.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import leanopt
from leanopt.integrations.distributed import measure_global
from leanopt.memory import resolve_optimizer


def make_model(width: int, depth: int, seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)  # the same full weights on every rank, before sharding
    layers: list[torch.nn.Module] = [torch.nn.Linear(32, width), torch.nn.GELU()]
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    layers.append(torch.nn.Linear(width, 1))
    return torch.nn.Sequential(*layers)


def shard(model: torch.nn.Sequential) -> torch.nn.Sequential:
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def batch(step: int, rank: int, world: int, per_rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)  # the global batch of this step; each rank takes its slice
    x = torch.randn(per_rank * world, 32, generator=g)[rank * per_rank : (rank + 1) * per_rank]
    return x.to(device), torch.sin(x[:, :4].sum(dim=1, keepdim=True)).to(device)


def train(model, opt, steps: range, rank: int, world: int, args, device) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step, rank, world, args.batch_per_rank, device)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
    return losses


def optimizer_kwargs(name: str, lr: float) -> dict:
    return {"lr": lr, "relative_step": False} if name == "adafactor" else {"lr": lr}


def main(argv: list[str] | None = None) -> bool:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--optimizer", default="adamw", help="adamw, adafactor, adamw8bit, adamw4bit")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch-per-rank", type=int, default=16)
    parser.add_argument("--checkpoint", help="directory for the DCP checkpoint (default: a temporary one)")
    args = parser.parse_args(argv)

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    cls = resolve_optimizer(args.optimizer)
    kwargs = optimizer_kwargs(args.optimizer, args.lr)
    half = args.steps // 2

    model = shard(make_model(args.width, args.depth, seed=0).to(device))
    opt = cls(model.parameters(), **kwargs)
    losses = train(model, opt, range(half), rank, world, args, device)

    tmp = None if args.checkpoint or rank != 0 else tempfile.mkdtemp()
    shared = [args.checkpoint or tmp]
    dist.broadcast_object_list(shared, src=0)  # every rank writes into the same directory
    checkpoint = shared[0]
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint)
    losses += train(model, opt, range(half, args.steps), rank, world, args, device)
    memory = measure_global(opt)  # a collective: every rank calls it
    final = [p.full_tensor() for p in model.parameters()]

    resumed = shard(make_model(args.width, args.depth, seed=1).to(device))
    resumed_opt = cls(resumed.parameters(), **kwargs)
    model_sd, optim_sd = get_state_dict(resumed, resumed_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=checkpoint)
    set_state_dict(resumed, resumed_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    resumed_losses = train(resumed, resumed_opt, range(half, args.steps), rank, world, args, device)
    same = all(torch.equal(a, b.full_tensor()) for a, b in zip(final, resumed.parameters()))

    if rank == 0:
        unsharded = leanopt.estimate(make_model(args.width, args.depth, seed=0), args.optimizer, **kwargs)
        print(f"{cls.__name__} on {world} ranks: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps")
        print(f"state: {memory}; estimate for one process: {unsharded.bytes:,} bytes")
        print(f"resumed from step {half}: loss {resumed_losses[-1]:.4f}; same final weights: {same}")
        if tmp is not None:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    if own_group:
        dist.destroy_process_group()
    return same


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
