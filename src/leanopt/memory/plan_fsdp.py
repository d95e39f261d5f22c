"""The per-rank step under FSDP2, traced on fake tensors: what ``plan(..., gpus=N)`` runs.

The step planned is the one-process step with the model sharded by
``torch.distributed.fsdp.fully_shard`` over N ranks: each transformer block (the classes the
model lists in ``_no_split_modules``) and then the root, default ``reshard_after_forward=True``,
the batch per rank = ``batch``. It is traced as rank 0 of a *fake* process group
(``torch.testing._internal.distributed.fake_pg``: collectives return at once, nothing is sent)
under ``FakeTensorMode``, with the same count as one process
(:class:`~leanopt.memory.plan_trace.ShardedLiveStorage`), which follows, in addition:

* DTensor ops down to the local ops on this rank's shards (sharded weights, gradients and the
  optimizer's state are shards: ceil(dim0 / N) rows per tensor);
* ``UntypedStorage.resize_``: how FSDP2 allocates and frees the unsharded parameters of a block
  around its forward and backward (its all-gather buffers), and
* the reduce-scatter buffers FSDP2 makes for a block's gradients in backward.

The real FSDP2 code runs (its hooks, its copy-in/copy-out, its prefetching of the next block), so
whatever it keeps alive is counted. Rank 0 holds the largest shards (FSDP2 pads every rank's
shard to the same size), so its peak is every rank's peak.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from leanopt.memory.plan_model import PARAM_DTYPE, checkpointing, fake_copy, fake_mode, num_labels, vocab_size
from leanopt.memory.plan_trace import (
    ParamKey,
    Peak,
    ShardedLiveStorage,
    traced_batch,
    traced_forward_backward,
    traced_kernels,
    traced_steps,
    track_module,
)

__all__ = ["check_shardable", "fake_process_group", "shard_blocks", "trace_forward_backward", "trace_step"]


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks: modules of the classes in ``_no_split_modules``, or else the
    largest ``ModuleList`` of modules of one class (DistilBERT's ``transformer.layer``)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if found:
        return found
    lists = [
        list(m) for m in model.modules()
        if isinstance(m, torch.nn.ModuleList) and len(m) > 0 and len({type(c) for c in m}) == 1
        and any(True for _ in m.parameters())
    ]  # fmt: skip
    return max(lists, key=lambda ms: sum(p.numel() for c in ms for p in c.parameters()), default=[])


def check_shardable(model: torch.nn.Module, gpus: int) -> None:
    """One-line ValueError where N ranks cannot shard ``model`` sensibly."""
    blocks = _blocks(model)
    if not blocks:
        raise ValueError(
            f"cannot plan FSDP2 for {type(model).__name__}: no transformer blocks found to shard (neither _no_split_modules nor a ModuleList of layers)"
        )
    params = [p for p in model.parameters() if p.requires_grad]
    smallest = min((p.shape[0] for p in params if p.dim() > 0), default=0)
    if smallest < gpus:
        raise ValueError(
            f"cannot plan FSDP2 over {gpus} ranks for {type(model).__name__}: a parameter has only {smallest} rows "
            "on dim 0 (some ranks would hold nothing of it)"
        )


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A default process group of ``world_size`` fake ranks (this process is rank 0), destroyed after."""
    import torch.distributed as dist

    if not dist.is_available():
        raise ValueError("planning FSDP2 needs torch.distributed, which this torch build lacks")
    if dist.is_initialized():
        raise ValueError("cannot plan FSDP2 inside an initialized process group: plan in a process of its own")
    import sys

    from torch.testing._internal.distributed.fake_pg import FakeStore

    hook = sys.excepthook  # init_process_group wraps it to prefix "[rank0]:"; put it back after
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


def default_mesh() -> Any:
    """The 1-D mesh over every rank that ``fully_shard`` defaults to (made outside FakeTensorMode)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def shard_blocks(model: torch.nn.Module, mesh: Any = None) -> None:
    """``fully_shard`` each transformer block, then the root (defaults: reshard after forward)."""
    from torch.distributed.fsdp import fully_shard

    for block in _blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def trace_forward_backward(
    model: torch.nn.Module, task: str, batch: int, seq: int, precision: str, ckpt: bool, gpus: int,
) -> tuple[Peak, dict[str, int]]:  # fmt: skip
    """Peak of rank 0's forward + backward under FSDP2, and what is left after it other than
    weights and gradients. Two steps are traced: the first makes FSDP2's lazy state, the
    second (gradients set to None before it, as ``zero_grad`` leaves them) is the one counted."""
    tracker = ShardedLiveStorage()
    mixed = precision == "bf16-mixed"
    mode = fake_mode()
    work, _ = fake_copy(model, mode, PARAM_DTYPE[precision])  # model itself is not touched
    with fake_process_group(gpus), checkpointing(work, ckpt):
        work.train()
        mesh = default_mesh()
        with mode:
            shard_blocks(work, mesh)
        params = [p for p in work.parameters() if p.requires_grad]
        with mode, tracker:
            track_module(tracker, work)
            input_ids, labels = traced_batch(tracker, task, vocab_size(model), num_labels(model), batch, seq)
            for it in range(2):
                if it == 1:
                    for p in params:
                        p.grad = None
                    tracker.phase = "setup"
                    tracker.reset_peak()
                loss = traced_forward_backward(tracker, work, input_ids, labels, params, mixed, type(model).__name__)
                for p in params:  # FSDP2 swaps the sharded params back in after backward
                    tracker.track(p, "weights")
                del loss
            peak = tracker.peak()
            live = tracker.live_by_kind()
            left = {k: v for k, v in live.items() if k not in ("weights", "gradients")}
            del input_ids, labels, params
    return peak, left


class _Holder(torch.nn.Module):
    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__()
        self.params = torch.nn.ParameterList(params)


def trace_step(keys: list[ParamKey], optimizer_cls: Any, gpus: int) -> tuple[Peak, dict[str, int]]:
    """Peak of rank 0's second ``optimizer.step()`` on params sharded as FSDP2 shards them (with
    their sharded gradients), and what it keeps between steps other than weights."""
    from torch.distributed.fsdp import fully_shard

    tracker = ShardedLiveStorage()
    mode = fake_mode()
    with fake_process_group(gpus), traced_kernels():
        mesh = default_mesh()
        with mode:
            holder = _Holder([torch.nn.Parameter(torch.empty(s, dtype=dt)) for s, dt, _ in keys])
            fully_shard(holder, mesh=mesh)
        params = list(holder.parameters())
        with mode, tracker:
            # Two whole steps: the layout-and-throwaway shortcut of the one-process trace would fill the
            # caches from unsharded params.
            peak, kept = traced_steps(tracker, params, optimizer_cls, fast=False, options=[o for _, _, o in keys])
            del params, holder
    return peak, kept
