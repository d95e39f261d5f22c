"""torchrun worker: Muon under DDP and FSDP2 against one process, its count, DCP, and its refusals.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 tests/dist_scripts/muon_parity.py OUT_DIR NAME [NAME...]

One launch runs every case (a launch costs more than the cases). For each optimizer NAME
(``muon``, ``muon8bit``, ...), on :func:`make_model` (every shape class Muon takes: tall, square,
wide, a conv weight, stacked experts, a one-row matrix that leaves one FSDP2 shard empty):

* ``ddp`` and ``fsdp``: ``STEPS`` steps on a global batch split over the ranks, against the same
  steps in one process on the two half-batches accumulated (the ranks' exact gradient
  arithmetic); rank 0 runs the one-process run. Each step records ``optimizer.orthogonalized``
  on every rank. The fsdp run saves ``get_state_dict`` with ``torch.distributed.checkpoint``
  after ``SAVE_AT`` steps (``OUT_DIR/dcp_NAME``).
* ``fsdp_exact``: the fsdp run, and its one-process run, on the reference backend
  (:data:`EXACT`), saved as ``OUT_DIR/dcp_NAME_exact`` for the one-process load in the test.
* ``fsdp_buckets`` (``muon``): the fsdp_exact run with exchange buckets small enough for two per step.
* ``refusals`` (once): a ``Shard(1)`` DTensor in a Muon group; a process group that is not the
  DTensor's mesh's ranks; one model per rank (no DDP) with the
  default process group, then with ``process_group="local"``; ranks that step different params;
  a bf16 param with stochastic rounding, and ``offload="cpu"``, under DDP.

Rank 0 writes ``OUT_DIR/results.json``; a case that raised has an ``error`` entry (the traceback).
Every case is symmetric on the ranks, so a refusal on one is a refusal on the other.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback

import teardown
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import leanopt
from leanopt.integrations.distributed import is_dtensor
from leanopt.memory import resolve_optimizer
from leanopt.optim import muon_dist

STEPS = 6
SAVE_AT = 3
GLOBAL_BATCH = 16
# Muon's lr at AdamW's scale for every group (match_rms_adamw), so both rules move the weights.
KWARGS = {"lr": 0.02, "adjust_lr_fn": "match_rms_adamw"}
# FSDP2 cuts each bias in two, and on the CPU the biases' fp32 AdamW group is stepped by torch's
# fused AdamW kernel, whose vectorised body and scalar tail round a few v elements differently
# where a tensor is cut (tests/test_distributed.py): seen to move a bias by one ulp on an AVX-512
# CPU. The bit-for-bit runs take every rule through the reference backend, whose arithmetic is
# the same however a tensor is cut; Newton-Schulz and the exchanges are the same on every backend.
EXACT = {"backend": "reference"}


class Experts(nn.Module):
    """A stacked ``[experts, in, out]`` weight: Muon orthogonalizes each expert's matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 12, 8) * 0.3)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bi,eio->bo", h, self.weight)


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv1d(2, 4, 3, padding=1),  # [4, 2, 3]: the 4 x 6 matrix of its flattening
        nn.Flatten(),
        nn.Linear(32, 48),  # tall 48 x 32
        nn.Tanh(),
        nn.Linear(48, 48),  # square
        nn.Tanh(),
        nn.Linear(48, 12),  # wide 12 x 48
        nn.Tanh(),
        Experts(),  # 3 matrices of 12 x 8, sharded 2 + 1 experts
        nn.Tanh(),
        nn.Linear(8, 1),  # one row: rank 1's shard is empty
    )


def muon_params(model: nn.Module) -> dict[str, tuple[int, int, int]]:
    """``name -> (params, elements, matrices)`` of each param Muon orthogonalizes."""
    out = {}
    for group in leanopt.muon_groups(model):
        if group["use_muon"]:
            for p in group["params"]:
                name = next(n for n, q in model.named_parameters() if q is p)
                count = p.shape[0] if p.dim() == 3 and not group.get("flatten") else 1  # a conv weight: one matrix
                out[name] = (1, p.numel(), count)
    return out


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 2, 8, generator=g)
    y = torch.sin(x[:, 0, :1]) + x[:, 1, 1:2] * x[:, 0, 2:3]
    return x, y


def rank_batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step)
    n = GLOBAL_BATCH // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def counts(opt) -> dict:
    o = opt.orthogonalized
    return {"params": o.params, "elements": o.elements, "matrices": o.matrices, "total_params": o.total_params,
            "total_elements": o.total_elements, "total_matrices": o.total_matrices, "world_size": o.world_size}  # fmt: skip


def train(model, opt, steps: range, rank: int, world: int, micro_batches: int = 1) -> tuple[list[float], list[dict]]:
    """Each step: ``micro_batches`` accumulated slices of this rank's batch; the global-batch loss
    and ``orthogonalized`` after each step."""
    losses, counted = [], []
    for step in steps:
        opt.zero_grad()
        x, y = rank_batch(step, rank, world)
        total = torch.zeros(())
        n = x.shape[0] // micro_batches
        for m in range(micro_batches):
            loss = nn.functional.mse_loss(model(x[m * n : (m + 1) * n]), y[m * n : (m + 1) * n])
            (loss / micro_batches).backward()
            total += loss.detach() / micro_batches
        opt.step()
        if world > 1:
            dist.all_reduce(total)
            total /= world
        losses.append(total.item())
        counted.append(counts(opt))
    return losses, counted


def one_process(name: str, world: int, **options) -> tuple[nn.Module, list[float], list[dict]]:
    """The reference: one process, each step's global batch as ``world`` accumulated halves."""
    model = make_model()
    # "local": rank 0 runs it alone while the 2-rank process group is initialized.
    opt = resolve_optimizer(name)(leanopt.muon_groups(model), process_group="local", **KWARGS, **options)
    losses, counted = train(model, opt, range(STEPS), 0, 1, micro_batches=world)
    return model, losses, counted


def whole(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective for a sharded model: every param, whole."""
    return {n: (p.full_tensor() if is_dtensor(p) else p).detach().clone() for n, p in model.named_parameters()}


def shard(model: nn.Module) -> nn.Module:
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(model)
    return model


def compare(ref, params: dict[str, torch.Tensor], losses: list[float], counted: list[dict], everyone: list) -> dict:
    ref_model, ref_losses, ref_counts = ref
    ref_params = dict(ref_model.named_parameters())
    diffs = {n: float((p - ref_params[n].detach()).abs().max()) for n, p in params.items()}
    return {
        "max_param_abs_diff": diffs,
        "identical_params": all(torch.equal(p, ref_params[n].detach()) for n, p in params.items()),
        "max_loss_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
        "losses": losses,
        "ref_losses": ref_losses,
        "counts": everyone,  # [rank][step] -> counts
        "ref_counts": ref_counts,
        "muon_params": {n: list(c) for n, c in muon_params(make_model()).items()},
    }


def gather_counts(counted: list[dict]) -> list:
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, counted)
    return everyone


def run_ddp(name: str, rank: int, world: int, ref) -> dict:
    model = DistributedDataParallel(make_model())
    opt = resolve_optimizer(name)(leanopt.muon_groups(model.module), **KWARGS)
    losses, counted = train(model, opt, range(STEPS), rank, world)
    everyone = gather_counts(counted)
    params = whole(model.module)
    return compare(ref, params, losses, counted, everyone) if rank == 0 else {}


def run_fsdp(name: str, rank: int, world: int, ref, out_dir: str, tag: str = "", **options) -> dict:
    model = shard(make_model())
    opt = resolve_optimizer(name)(leanopt.muon_groups(model), **KWARGS, **options)
    losses, counted = train(model, opt, range(SAVE_AT), rank, world)
    checkpoint = os.path.join(out_dir, f"dcp_{name}{tag}")
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint)
    more, more_counted = train(model, opt, range(SAVE_AT, STEPS), rank, world)
    everyone = gather_counts(counted + more_counted)
    placements = {n: str(tuple(opt.state[p]["momentum_buffer"].placements)) if is_dtensor(opt.state[p]["momentum_buffer"])
                  else type(opt.state[p]["momentum_buffer"]).__name__
                  for n, p in model.named_parameters() if "momentum_buffer" in opt.state[p]}  # fmt: skip
    params = whole(model)
    if rank != 0:
        return {}
    out = compare(ref, params, losses + more, counted + more_counted, everyone)
    out["checkpoint"] = checkpoint
    out["momentum_placements"] = placements
    out["exchanges"] = opt._exchanges
    return out


def run_buckets(name: str, rank: int, world: int, ref, out_dir: str) -> dict:
    """The fsdp_exact run with buckets of 2,000 elements: the 48 x 32 and 48 x 48 matrices (3,840
    elements) go in one exchange, the other four in the step's last: two per step."""
    kept = muon_dist.BUCKET_ELEMENTS
    muon_dist.BUCKET_ELEMENTS = 2000
    try:
        return run_fsdp(name, rank, world, ref, out_dir, tag="_buckets", **EXACT)
    finally:
        muon_dist.BUCKET_ELEMENTS = kept


def refusal(fn) -> str | None:
    """The ``ValueError`` ``fn`` raised, as ``Type: message``; None if it raised none."""
    try:
        fn()
    except ValueError as err:
        return f"ValueError: {err}"
    return None


def run_refusals(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    out: dict = {}
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    column_sharded = nn.Parameter(distribute_tensor(torch.randn(8, 8), mesh, [Shard(1)]))
    out["shard1"] = refusal(lambda: leanopt.Muon([column_sharded]))

    def other_ranks():
        row_sharded = nn.Parameter(distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)]))
        row_sharded.grad = distribute_tensor(torch.ones(8, 8), mesh, [Shard(0)])
        opt = leanopt.Muon([row_sharded], process_group=first_rank_only)
        opt.step()

    first_rank_only = dist.new_group([0])  # every rank makes it; rank 1 is not in it
    out["mismatch"] = refusal(other_ranks)

    def own_model(process_group):
        model = make_model(seed=rank)  # not replicas: one model per rank, no DDP
        opt = leanopt.Muon(leanopt.muon_groups(model), process_group=process_group, **KWARGS)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        error = refusal(lambda: train(model, opt, range(1), rank, world))
        moved = any(not torch.equal(before[n], p) for n, p in model.named_parameters() if p.dim() >= 2)
        return error, moved, counts(opt)

    out["own_model_default"], out["own_model_default_moved"], _ = own_model(None)
    out["own_model_local"], out["own_model_local_moved"], out["own_model_local_counts"] = own_model("local")

    def different_params():
        model = DistributedDataParallel(make_model(), find_unused_parameters=True)
        opt = leanopt.Muon(leanopt.muon_groups(model.module), **KWARGS)
        train(model, opt, range(1), rank, world)
        if rank == 1:  # rank 1 steps one matrix fewer
            model.module[4].weight.grad = None
        opt.step()

    out["different_params"] = refusal(different_params)

    def rounded():
        model = DistributedDataParallel(make_model().to(torch.bfloat16))
        opt = leanopt.Muon(leanopt.muon_groups(model.module), rounding="stochastic", **KWARGS)
        x, y = rank_batch(0, rank, world)
        nn.functional.mse_loss(model(x.to(torch.bfloat16)), y.to(torch.bfloat16)).backward()
        before = [p.detach().clone() for p in model.parameters()]
        try:
            opt.step()
        finally:
            out["rounded_unchanged"] = all(torch.equal(b, p) for b, p in zip(before, model.parameters()))

    out["rounded"] = refusal(rounded)

    def offloaded():
        model = DistributedDataParallel(make_model())
        opt = leanopt.Muon(leanopt.muon_groups(model.module), offload="cpu", **KWARGS)
        x, y = rank_batch(0, rank, world)
        nn.functional.mse_loss(model(x), y).backward()
        before = [p.detach().clone() for p in model.parameters()]
        try:
            opt.step()
        finally:
            out["offloaded_unchanged"] = all(torch.equal(b, p) for b, p in zip(before, model.parameters())) and not opt.state

    out["offloaded"] = refusal(offloaded)
    return out if rank == 0 else {}


def guarded(results: dict, key: tuple[str, str], fn) -> None:
    try:
        out = fn()
    except Exception:  # recorded, and the next case runs (both ranks raise alike)
        err = traceback.format_exc()
        print(f"[rank {dist.get_rank()}] {key}: {err}", file=sys.stderr, flush=True)
        out = {"error": err}
    results.setdefault(key[0], {})[key[1]] = out


def main() -> None:
    out_dir, names = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=int(os.environ.get("LEANOPT_DIST_TIMEOUT", "120"))))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    results: dict = {"world_size": world}
    for name in names:
        ref = one_process(name, world) if rank == 0 else None
        exact_ref = one_process(name, world, **EXACT) if rank == 0 else None
        guarded(results, (name, "ddp"), lambda: run_ddp(name, rank, world, ref))
        guarded(results, (name, "fsdp"), lambda: run_fsdp(name, rank, world, ref, out_dir))
        guarded(results, (name, "fsdp_exact"), lambda: run_fsdp(name, rank, world, exact_ref, out_dir, "_exact", **EXACT))
        if name == "muon":
            guarded(results, (name, "fsdp_buckets"), lambda: run_buckets(name, rank, world, exact_ref, out_dir))
        dist.barrier()
    guarded(results, ("refusals", "all"), lambda: run_refusals(rank, world))
    if rank == 0:
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
    teardown.finish()


if __name__ == "__main__":
    main()
