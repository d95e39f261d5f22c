"""What the memory tools read of a leanopt optimizer beyond its public API, in one place.

The planner makes an optimizer's state from its layout and steps one param as gradient release
does; ``doctor`` and ``training_memory`` need the host copies and host bytes of an offloaded
optimizer. These reach into :class:`~leanopt.optim.base.LeanOptimizer` and
:class:`~leanopt.optim.offload.Offload`; when those get public equivalents, only this module
changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["host_copies", "init_state", "offload_host_bytes", "step_param"]


def init_state(optimizer: Any, p: torch.Tensor, group: Mapping[str, Any]) -> None:
    """Allocate ``p``'s state from its layout, as the first ``step()`` does."""
    optimizer._init_state(p, group)


def step_param(optimizer: Any, p: torch.Tensor, group_index: int = 0, index: int = 0) -> None:
    """Step one param from its gradient now, as the hook of :func:`leanopt.release_gradients` does."""
    optimizer._step_param(p, group_index, index)


def host_copies(optimizer: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(param, its host copy)`` for each param an ``offload="cpu"`` optimizer has stepped (the
    copy the update runs on: an fp32 master for bf16/fp16 params); empty without offload."""
    engine = getattr(optimizer, "_offload", None)
    if engine is None:
        return []
    twins: dict[int, torch.Tensor] = engine._twins
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return [(p, twins[id(p)]) for p in params if id(p) in twins]


def offload_host_bytes(optimizer: Any, *, released: bool) -> int:
    """What an ``offload="cpu"`` optimizer needs of host memory at most: host copies, states and
    host gradient buffers (:meth:`leanopt.optim.offload.Offload.host_bytes`)."""
    return int(optimizer._offload.host_bytes(released=released))
