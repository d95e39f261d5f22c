"""The checks of an optimizer's options, for leanopt's optimizers and those defined outside it.

Each raises ``ValueError`` naming the option and the value it got, as torch's optimizers do;
an optimizer's ``validate_group`` calls them for the constructor, ``add_param_group`` and
``load_state_dict`` alike (docs/adding_an_optimizer.md).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from leanopt.quant.formats import MAX_BLOCK_SIZE

__all__ = ["check_beta", "check_betas", "check_block_size", "check_flag", "check_min_quant_size", "check_nonnegative", "number"]


def number(name: str, value: Any) -> float:
    """``value`` as a float if it is a real number (or a one-element real floating tensor)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise ValueError(f"Tensor {name} must be a one-element floating tensor, got shape {tuple(value.shape)} {value.dtype}")
        if value.device.type == "meta":
            return 0.0  # no value to check: a model being estimated, nothing will step
        return float(value.item())
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def check_nonnegative(name: str, value: Any) -> None:
    """A finite number >= 0; ``lr`` may also be a one-element tensor (as in torch)."""
    if isinstance(value, torch.Tensor) and name != "lr":
        raise ValueError(f"{name} must be a number, got a tensor")
    x = number(name, value)
    if not (x >= 0.0 and math.isfinite(x)):  # also rejects NaN
        raise ValueError(f"Invalid {name}: {value!r} (must be a finite number >= 0)")


def check_beta(name: str, value: Any) -> None:
    """A number in [0, 1): a decay coefficient."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"Invalid {name}: {value!r} (must be in [0, 1))")


def check_flag(name: str, value: Any) -> None:
    """True or False (not 1, not "yes")."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def check_betas(betas: Any) -> None:
    """A pair of decay coefficients, each in [0, 1)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    check_beta("beta1 (betas[0])", betas[0])
    check_beta("beta2 (betas[1])", betas[1])


def check_block_size(value: Any, bits: int | None = None) -> None:
    """``value`` is a block size states of ``bits``-bit codes can take (any width if None)."""
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_BLOCK_SIZE:
        raise ValueError(f"Invalid block_size: {value!r} (must be an int in [1, {MAX_BLOCK_SIZE}])")
    # 4-bit codes are packed two to a byte in flat order: an odd block would start mid-byte
    # every other block, and the fast paths (rows of block/2 bytes) and a state's tail or shard
    # (views from a byte offset) need whole bytes per block.
    if bits == 4 and value % 2:
        even = f"{value - 1} or {value + 1}" if value > 1 else "2"
        raise ValueError(f"Invalid block_size: {value} (4-bit codes are packed two to a byte, so a block must "
                         f"hold an even number of elements: use {even})")  # fmt: skip


def check_min_quant_size(value: Any) -> None:
    """An int >= 0: params with fewer elements keep dense states."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"Invalid min_quant_size: {value!r} (must be an int >= 0)")
