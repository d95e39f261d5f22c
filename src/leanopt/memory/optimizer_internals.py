"""What the memory tools read of a leanopt optimizer beyond its documented use, in one place.

The planner makes an optimizer's state from its layout, as the first ``step()`` does; ``doctor``
reads the host copies of an offloaded optimizer (:class:`~leanopt.optim.offload.Offloaded`,
its ``placement``). When those get public equivalents, only this module changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["host_copies", "init_state"]


def init_state(optimizer: Any, p: torch.Tensor, group: Mapping[str, Any]) -> None:
    """Allocate ``p``'s state from its layout, as the first ``step()`` does."""
    optimizer._init_state(p, group)


def host_copies(optimizer: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(param, its host copy)`` for each param an ``offload="cpu"`` optimizer has stepped (the
    copy the update runs on: an fp32 master for bf16/fp16 params); empty without offload."""
    placement = getattr(optimizer, "placement", None)
    host_copy = getattr(placement, "host_copy", None)
    if host_copy is None:
        return []
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return [(p, t) for p in params if (t := host_copy(p)) is not None]
