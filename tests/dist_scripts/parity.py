"""torchrun worker: every leanopt optimizer (``tests/registry.py``) under DDP and FSDP2 against the
same run in one process.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 tests/dist_scripts/parity.py OUT_DIR NAME [NAME...]

One launch runs every check (a launch costs more than the checks): for each optimizer NAME,

* ``ddp`` and ``fsdp``: ``STEPS`` (10) steps on a global batch split over the ranks, against the same
  steps in one process (rank 0 runs them) two ways: on the whole batch (``vs_full``), and as
  two accumulated half-batches (``vs_accumulated``: the ranks' exact gradient arithmetic, since
  halving is exact in floating point, so any difference left comes from the optimizer).
* ``fsdp``: the state of each DTensor param is a DTensor (its placements are recorded), and
  ``measure_global`` against ``leanopt.estimate`` and ``leanopt.measure`` of the one-process run.
* ``load_one_process``: the one-process run's ``state_dict()`` loads into an FSDP2 optimizer
  (each rank keeps its shard) and gathers back to the same state.
* ``example``: ``examples/fsdp2_train.py`` runs in this same launch (its ``main``), so the
  documented example is tested without a launch of its own.
* ``dcp``: the fsdp run saves ``get_state_dict`` with ``torch.distributed.checkpoint`` after
  ``SAVE_AT`` (5) steps, and rank 0 the same optimizer state gathered whole
  (``OUT_DIR/full_NAME.pt``, leanopt's ``get_state_dict`` with ``full_state_dict=True``); a fresh
  model and optimizer on 2 ranks load the checkpoint with ``set_state_dict`` and train the steps
  after it again: the losses and weights must be identical. Both stay in OUT_DIR for
  ``test_distributed.py``: the one-process load, and ``leanopt convert`` of the DCP folder
  against the gathered file.

Rank 0 writes ``OUT_DIR/results.json``: ``{NAME: {mode: {metric: value}}}``, and an ``error``
entry (the traceback) for a case that raised. The checks are symmetric on both ranks, so an
exception in one case does not leave the other rank waiting in a collective.
"""

from __future__ import annotations

import datetime
import inspect
import json
import os
import sys
import traceback

import teardown
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import leanopt
from leanopt.integrations.distributed import ShardQuantizedState, checkpoint_value, is_dtensor, measure_global
from leanopt.integrations.distributed import get_state_dict as leanopt_get_state_dict
from leanopt.memory import resolve_optimizer
from leanopt.quant import QuantizedState

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from registry import OPTIMIZERS  # noqa: E402  (tests/registry.py: the one list of optimizers)

STEPS = 10
SAVE_AT = 5
GLOBAL_BATCH = 32

# Adafactor also runs its relative scale (an RMS all-reduced under FSDP2) and weight decay here.
_EXTRA = {"adafactor": {"scale_parameter": True, "weight_decay": 0.01}}


def _kwargs(case) -> dict:
    kwargs = {**case.kwargs, **_EXTRA.get(case.name, {})}
    if hasattr(case.cls, "state_bits"):  # block-quantized states: the low-bit elementwise rules, Muon's momentum
        # Sharded quantized states always run the reference rule (shard-aware block scales); the
        # one-process runs use it too, so that "exact" compares the same arithmetic.
        kwargs["backend"] = "reference"
    return kwargs


# Per-optimizer constructor kwargs, from the registry's: the same in tests/test_distributed.py
# (it imports these). Those that run on FSDP2 params (``sharded``).
KWARGS = {case.name: _kwargs(case) for case in OPTIMIZERS if case.sharded}
_GROUPS = {case.name: case.param_groups for case in OPTIMIZERS if case.sharded}


def build(name: str, model: torch.nn.Module, *, alone: bool = False):
    """Optimizer ``name`` over ``model`` as the registry builds it (its param groups, its kwargs).
    ``alone``: a run of this process alone while the 2-rank group is initialized (the
    one-process reference on rank 0): an optimizer that spreads its step over the process group
    (it takes ``process_group``) is told to keep it local."""
    cls = resolve_optimizer(name)
    local = {"process_group": "local"} if alone and "process_group" in inspect.signature(cls).parameters else {}
    return cls(_GROUPS[name](model), **KWARGS[name], **local)


class StepGate(torch.nn.Module):
    """Zeroes its input's units [0, 64) while ``closed`` (every third step, set by ``train``):
    the next Linear's weight columns for them get exactly-zero gradients, so a low-bit
    optimizer's momentum there only decays and takes the decay rounding, whose dither is keyed
    on global indices: a shard must pass its offset to store the one-process codes."""

    closed = False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([h[:, :64] * 0.0, h[:, 64:]], dim=1) if self.closed else h


def set_gates(model: torch.nn.Module, step: int) -> None:
    for m in model.modules():
        if isinstance(m, StepGate):
            m.closed = step % 3 == 2


def make_model(seed: int = 0) -> torch.nn.Sequential:
    """Shapes that exercise sharding: a square matrix (Adafactor's row and column statistics
    share a shape); 33 and 3 rows (shards of unequal size on 2 ranks); a 1-row head (one rank's
    shard is empty: Adafactor updates it whole); two 4096+-element matrices (quantized by the
    low-bit optimizers), one of which (33 x 128) has a 256-block straddling its two shards;
    both get exactly-zero gradient columns every third step (:class:`StepGate`)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 128),
        torch.nn.Tanh(),
        StepGate(),
        torch.nn.Linear(128, 128),
        torch.nn.Tanh(),
        StepGate(),
        torch.nn.Linear(128, 33),
        torch.nn.Tanh(),
        torch.nn.Linear(33, 3),
        torch.nn.Tanh(),
        torch.nn.Linear(3, 1),
    )


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 16, generator=g)
    y = torch.sin(x[:, :1]) + x[:, 1:2] * x[:, 2:3] + 0.3 * x[:, 3:6].sum(dim=1, keepdim=True)
    return x, y


def rank_batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step)
    n = GLOBAL_BATCH // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def train(model, opt, steps: range, rank: int, world: int) -> list[float]:
    """Mean-squared error on this rank's slice; the returned loss is the global-batch mean."""
    losses = []
    for step in steps:
        x, y = rank_batch(step, rank, world)
        opt.zero_grad()
        set_gates(model, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if world > 1:
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
    return losses


def full(t):
    return t.full_tensor() if is_dtensor(t) else t


def dense(value, p) -> torch.Tensor | None:
    """Collective for a DTensor param: a state value, whole, as a plain tensor (quantized states
    dequantized, as they are checkpointed); None for non-tensors."""
    if is_dtensor(p):
        value = checkpoint_value(value, p)
    if hasattr(value, "dequantize") and not isinstance(value, torch.Tensor):
        return value.dequantize()
    if isinstance(value, torch.Tensor):
        return full(value)
    return None


def gathered_state(opt, model) -> dict[str, dict[str, torch.Tensor]]:
    """Collective: every state entry of every param, whole, keyed by param name."""
    out = {}
    for name, p in model.named_parameters():
        st = opt.state.get(p, {})
        out[name] = {k: d for k, v in sorted(st.items()) if (d := dense(v, p)) is not None}
    return out


def whole_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective for a sharded model: every param, whole."""
    return {n: full(p).detach().clone() for n, p in model.named_parameters()}


def compare(ref_losses, losses, ref_model, params, ref_state, state) -> dict:
    """Rank 0 only, no collectives: ``params``/``state`` were gathered before."""
    rel = [abs(a - b) / abs(a) for a, b in zip(ref_losses, losses)]
    ref_params = dict(ref_model.named_parameters())
    param_diff = max(float((p - ref_params[n].detach()).abs().max()) for n, p in params.items())
    state_diff: dict[str, float] = {}
    state_rel: dict[str, float] = {}
    for name, entries in ref_state.items():
        for key, ref in entries.items():
            got = state[name][key]
            d = float((got.double() - ref.double()).abs().max()) if ref.numel() else 0.0
            scale = float(ref.double().abs().max()) if ref.numel() else 0.0
            state_diff[key] = max(state_diff.get(key, 0.0), d)
            state_rel[key] = max(state_rel.get(key, 0.0), d / scale if scale else d)
    return {
        "ref_losses": ref_losses,
        "losses": losses,
        "max_loss_rel_diff": max(rel),
        "max_param_abs_diff": param_diff,
        "max_state_abs_diff": state_diff,
        "max_state_rel_diff": state_rel,
        "same_state_keys": {n: sorted(e) for n, e in ref_state.items()} == {n: sorted(e) for n, e in state.items()},
    }


def shard(model: torch.nn.Module) -> torch.nn.Module:
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def reference_run(name: str, micro_batches: int) -> tuple:
    """One process; each step's global batch as ``micro_batches`` accumulated slices."""
    model = make_model()
    opt = build(name, model, alone=True)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        set_gates(model, step)
        total = torch.zeros(())
        for r in range(micro_batches):
            x, y = rank_batch(step, r, micro_batches)
            loss = torch.nn.functional.mse_loss(model(x), y)
            (loss / micro_batches).backward()
            total += loss.detach()
        opt.step()
        losses.append((total / micro_batches).item())
    return model, opt, losses


def against_references(refs: dict, losses, params, state) -> dict:
    out = {}
    for label, (ref_model, ref_opt, ref_losses) in refs.items():
        out[label] = compare(ref_losses, losses, ref_model, params, gathered_state(ref_opt, ref_model), state)
    out["reference_measure"] = leanopt.measure(refs["vs_full"][1]).bytes
    return out


def run_ddp(name: str, rank: int, world: int, ref) -> dict:
    model = DistributedDataParallel(make_model())
    opt = build(name, model.module)
    losses = train(model, opt, range(STEPS), rank, world)
    state = gathered_state(opt, model.module)
    mg = measure_global(opt)
    params = whole_params(model.module)
    if rank != 0:
        return {}
    out = against_references(ref, losses, params, state)
    out["measure"] = {"rank_bytes": mg.rank_bytes, "total": mg.total_bytes, "unsharded": mg.unsharded_bytes}
    return out


def run_fsdp_and_dcp(name: str, rank: int, world: int, ref, out_dir: str) -> tuple[dict, dict]:
    model = shard(make_model())
    opt = build(name, model)
    losses = train(model, opt, range(SAVE_AT), rank, world)
    checkpoint = os.path.join(out_dir, f"dcp_{name}")
    model_sd, optim_sd = get_state_dict(model, opt)
    declared = sorted({str(g.get("optimizer")) for g in optim_sd["param_groups"]})  # the name saved with it
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint)
    # The same optimizer state gathered whole (rank 0's file): what converting the DCP folder
    # with ``leanopt convert`` must reproduce exactly (tests/test_distributed.py).
    gathered = os.path.join(out_dir, f"full_{name}.pt")
    _, whole = leanopt_get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(whole, gathered)
    dist.barrier()
    losses += train(model, opt, range(SAVE_AT, STEPS), rank, world)

    placements = {}
    for pname, p in model.named_parameters():
        placements[pname] = {
            k: (str(tuple(v.placements)) if is_dtensor(v) else type(v).__name__) for k, v in opt.state[p].items()
        }
    mg = measure_global(opt)
    # A block that straddles the 2 shards keeps its scale on both ranks: 4 bytes more each.
    shared = sum(v.n_shared for st in opt.state.values() for v in st.values() if isinstance(v, ShardQuantizedState))
    state = gathered_state(opt, model)
    final = whole_params(model)

    # A fresh model (other weights) and optimizer on the same 2 ranks load step SAVE_AT and go on.
    resumed = shard(make_model(seed=1))
    resumed_opt = build(name, resumed)
    model_sd, optim_sd = get_state_dict(resumed, resumed_opt)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=checkpoint)
    set_state_dict(resumed, resumed_opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    resumed_losses = train(resumed, resumed_opt, range(SAVE_AT, STEPS), rank, world)
    resumed_state = gathered_state(resumed_opt, resumed)
    resumed_final = whole_params(resumed)
    if rank != 0:
        return {}, {}

    fsdp = against_references(ref, losses, final, state)
    fsdp["state_placements"] = placements
    fsdp["measure"] = {"rank_bytes": mg.rank_bytes, "total": mg.total_bytes, "unsharded": mg.unsharded_bytes}
    fsdp["shared_blocks"] = shared
    fsdp["estimate"] = leanopt.estimate(make_model(), name, **KWARGS[name]).bytes
    same_state = all(
        torch.equal(resumed_state[n][k], v) for n, entries in state.items() for k, v in entries.items()
    )
    resume = {
        "continued_losses": losses[SAVE_AT:],
        "resumed_losses": resumed_losses,
        "identical_losses": resumed_losses == losses[SAVE_AT:],
        "identical_weights": all(torch.equal(final[n], resumed_final[n]) for n in final),
        "identical_state": same_state,
        "declared": declared,
        "checkpoint": checkpoint,
        "gathered": gathered,
    }
    return fsdp, resume


def run_example(name: str, out_dir: str) -> dict:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    import fsdp2_train

    argv = ["--optimizer", name, "--steps", "6", "--width", "64", "--depth", "1"]
    same = fsdp2_train.main(argv + ["--checkpoint", os.path.join(out_dir, "example_checkpoint")])
    return {"same_final_weights": same}


def load_one_process_state(name: str, rank: int, ref) -> dict:
    """A one-process ``state_dict`` (every rank gets rank 0's) loaded into an FSDP2 optimizer."""
    box = [ref["vs_full"][1].state_dict() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    model = shard(make_model())
    opt = build(name, model)
    opt.load_state_dict(box[0])
    # Each rank keeps its shard: DTensors, quantized shards, and plain scalars only.
    sharded = all(
        is_dtensor(v) or isinstance(v, QuantizedState) and v.numel < p.numel() or v.ndim == 0
        for p, st in opt.state.items()
        for v in st.values()
    )
    state = gathered_state(opt, model)
    if rank != 0:
        return {}
    ref_state = gathered_state(ref["vs_full"][1], ref["vs_full"][0])
    diff = max(float((state[n][k] - v).abs().max()) for n, e in ref_state.items() for k, v in e.items() if v.numel())
    return {"max_state_abs_diff": diff, "sharded": sharded, "same_state_keys": {n: sorted(e) for n, e in state.items()} == {n: sorted(e) for n, e in ref_state.items()}}


def guarded(results: dict, name: str, modes: tuple[str, ...], fn) -> None:
    try:
        outs = fn()
    except Exception:  # recorded, and the next case runs (both ranks raise alike)
        err = traceback.format_exc()
        print(f"[rank {dist.get_rank()}] {name} {modes}: {err}", file=sys.stderr, flush=True)
        for mode in modes:
            results.setdefault(name, {})[mode] = {"error": err}
        return
    for mode, out in zip(modes, outs):
        results.setdefault(name, {})[mode] = out


def main() -> None:
    out_dir, names = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=int(os.environ.get("LEANOPT_DIST_TIMEOUT", "120"))))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    results: dict = {"world_size": world}
    for name in names:
        ref = None
        if rank == 0:
            ref = {"vs_full": reference_run(name, 1), "vs_accumulated": reference_run(name, world)}
        guarded(results, name, ("ddp",), lambda: (run_ddp(name, rank, world, ref),))
        guarded(results, name, ("fsdp", "dcp"), lambda: run_fsdp_and_dcp(name, rank, world, ref, out_dir))
        guarded(results, name, ("load_one_process",), lambda: (load_one_process_state(name, rank, ref),))
        dist.barrier()
    example_name = "adafactor" if "adafactor" in names else names[0]
    guarded(results, "example", (example_name,), lambda: (run_example(example_name, out_dir),))
    if rank == 0:
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
    teardown.finish()


if __name__ == "__main__":
    main()
