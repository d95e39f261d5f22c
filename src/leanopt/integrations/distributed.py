"""leanopt under ``torch.distributed``: DDP as it is, FSDP2's DTensor params, state memory over ranks.

**DDP** needs nothing: every rank holds whole params, DDP averages the gradients, every rank
runs the same optimizer step on the same state.

**FSDP2** (``torch.distributed.fsdp.fully_shard``): each param is a DTensor sharded on dim 0,
and its optimizer state is sharded alike; :mod:`leanopt.optim.sharding` says how (it is
what the optimizers call). ``torch.distributed.checkpoint`` with ``get_state_dict`` /
``set_state_dict`` saves and loads it, on the same or another number of ranks.

:func:`measure_global` adds up the state memory of every rank (``leanopt.measure`` reports this
rank's own bytes, counting a DTensor by its local shard).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from leanopt.memory.measure import StateCounter, StateMeasurement, leaf_tensors, measure
from leanopt.optim.sharding import (
    ShardQuantizedState,
    allocate_state,
    checkpoint_value,
    is_dtensor,
    load_value,
    local,
    quantized_shard,
    shardable,
    shared_blocks,
    state_placements,
    update_whole,
)

__all__ = [
    "DistributedMeasurement",
    "ShardQuantizedState",
    "allocate_state",
    "checkpoint_value",
    "get_state_dict",
    "is_dtensor",
    "load_value",
    "local",
    "measure_global",
    "quantized_shard",
    "shardable",
    "shared_blocks",
    "state_placements",
    "update_whole",
]


def get_state_dict(model: torch.nn.Module, optimizers: Any, **kwargs: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``torch.distributed.checkpoint.state_dict.get_state_dict`` with every quantized state dense.

    Use it (with ``torch.distributed.checkpoint`` and torch's ``set_state_dict``) to checkpoint
    leanopt's low-bit optimizers (``AdamW8bit``, ``Lion4bit``, ``AdEMAMix8bit``, ...: every
    :class:`~leanopt.optim.lowbit.LowBit` of the registry) when the run that loads may be
    sharded differently: FSDP2 on any number of ranks, DDP, or one process. On a DTensor param
    a quantized state is already saved dense (fp32, sharded like the param); on a plain param
    torch's function keeps the compact ``{"codes", "absmax", "format", "shape"}`` dict, whose
    keys a sharded checkpoint doesn't have. Here both are fp32 tensors, and loading quantizes
    them again (exactly: the dequantize -> quantize round trip gives back the same codes and
    scales). For the optimizers with dense states (``AdamW``, ``Lion``, ``AdEMAMix``,
    ``Adafactor``) it returns what torch's does. The dense copies cost 4 bytes per element while
    the state dict is alive. The param groups keep the name each optimizer declares
    (``"optimizer"``), so the optimizer that loads checks the checkpoint is of its family.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict as torch_get_state_dict

    model_sd, optim_sd = torch_get_state_dict(model, optimizers, **kwargs)
    return model_sd, _dense_quantized(optim_sd)


def _dense_quantized(value: Any) -> Any:
    from leanopt.quant import QuantizedState

    if isinstance(value, Mapping):
        if QuantizedState.is_state_dict(value) and isinstance(value.get("codes"), torch.Tensor):
            return QuantizedState.from_state_dict(value).dequantize()
        return {k: _dense_quantized(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_dense_quantized(v) for v in value]
    return value


@dataclass
class DistributedMeasurement:
    """State memory over all ranks of a process group.

    ``rank``: this rank's :func:`leanopt.measure` (a DTensor counts its local shard).
    ``rank_bytes``: each rank's ``rank.bytes``, in rank order; ``total_bytes``: their sum, the
    memory the optimizer state takes over the whole job. ``unsharded_bytes``: the bytes of the
    same state in one process (replicated entries counted once): ``leanopt.estimate`` of the
    model, plus 4 bytes for each rank beyond the first that holds the scale of a quantization
    block straddling shards. ``by_key``: ``total_bytes`` per state key.
    """

    rank: StateMeasurement
    rank_bytes: list[int]
    total_bytes: int
    unsharded_bytes: int
    by_key: dict[str, int] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return len(self.rank_bytes)

    def __str__(self) -> str:
        per_rank = ", ".join(f"{b:,}" for b in self.rank_bytes)
        return (
            f"{self.total_bytes:,} bytes over {self.world_size} ranks ({per_rank}); "
            f"{self.unsharded_bytes:,} bytes unsharded"
        )


def _sharded_and_replicated_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """This rank's state bytes split into sharded (to be summed over ranks) and replicated (count once)."""
    sharded, replicated = StateCounter(), StateCounter()
    for param, state in optimizer.state.items():
        values = state.values() if isinstance(state, Mapping) else [state]
        for value in values:
            for leaf in _outer_leaves(value):
                target = replicated
                if is_dtensor(leaf):
                    if any(not pl.is_replicate() for pl in leaf.placements):
                        target = sharded
                elif is_dtensor(param) and leaf.ndim > 0:
                    target = sharded  # a local-shard state of a sharded param
                target.add(leaf, "", 0)
    return sharded.result.bytes, replicated.result.bytes


def _outer_leaves(value: Any) -> list[torch.Tensor]:
    # Like measure's leaves, but a DTensor stays whole so that its placements can be read.
    if is_dtensor(value):
        return [value]
    if isinstance(value, torch.Tensor):
        return list(leaf_tensors(value))
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _outer_leaves(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _outer_leaves(v)]
    return list(leaf_tensors(value))


def measure_global(optimizer: torch.optim.Optimizer, group: Any = None) -> DistributedMeasurement:
    """:func:`leanopt.measure` on every rank, all-reduced. A collective: call it on all ranks.

    Without an initialized process group it describes this process alone (world size 1).
    """
    opt = optimizer
    while hasattr(opt, "optimizer") and isinstance(opt.optimizer, torch.optim.Optimizer):
        opt = opt.optimizer  # Accelerate's wrapper
    mine = measure(opt)
    sharded, replicated = _sharded_and_replicated_bytes(opt)
    keys = sorted(mine.by_key)
    if not (dist.is_available() and dist.is_initialized()):
        return DistributedMeasurement(mine, [mine.bytes], mine.bytes, sharded + replicated, dict(mine.by_key))
    world = dist.get_world_size(group)
    # Every rank must agree on the keys to all-reduce them: gather the key names first.
    all_keys: list[list[str]] = [[] for _ in range(world)]
    dist.all_gather_object(all_keys, keys, group=group)
    keys = sorted({k for ks in all_keys for k in ks})
    backend_device = _collective_device(group)
    rank_bytes = torch.zeros(world, dtype=torch.int64, device=backend_device)
    rank_bytes[dist.get_rank(group)] = mine.bytes
    per_key = torch.tensor([mine.by_key.get(k, 0) for k in keys] + [sharded], dtype=torch.int64, device=backend_device)
    dist.all_reduce(rank_bytes, group=group)
    dist.all_reduce(per_key, group=group)
    totals = per_key.tolist()
    return DistributedMeasurement(
        rank=mine,
        rank_bytes=rank_bytes.tolist(),
        total_bytes=int(rank_bytes.sum()),
        unsharded_bytes=int(totals[-1]) + replicated,
        by_key=dict(zip(keys, (int(v) for v in totals[:-1]))),
    )


def _collective_device(group: Any) -> torch.device:
    backend = dist.get_backend(group)
    if "nccl" in str(backend) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
