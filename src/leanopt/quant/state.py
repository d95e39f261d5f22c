"""The quantized-state container shared by every precision.

A :class:`QuantizedState` is codes + one fp32 scale per block + the format that says how to
read them (bits, block size, code book). Optimizers call ``dequantize()`` and
``quantize_(x)``; how bits are packed is the format's business alone.

In ``optimizer.state`` a quantized entry is a ``QuantizedState``; in a ``state_dict`` it is a
plain dict of tensors, ints and strings (see :meth:`to_state_dict`), so checkpoints load with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

_STATE_DICT_KEYS = ("codes", "absmax", "format", "shape")


class QuantizedState:
    """Block-wise quantized tensor: ``codes`` (uint8), ``absmax`` (fp32 per block), ``format``."""

    __slots__ = ("codes", "absmax", "format", "shape")

    def __init__(self, codes: torch.Tensor, absmax: torch.Tensor, format: Any, shape: tuple[int, ...]):
        self.codes = codes
        self.absmax = absmax
        self.format = format
        self.shape = tuple(int(s) for s in shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tensors that hold this state's memory (the code book is shared, not stored here)."""
        return (self.codes, self.absmax)

    def dequantize(self) -> torch.Tensor:
        """fp32 tensor of ``shape``."""
        return self.format.decode(self.codes, self.absmax, self.numel).view(self.shape)

    def quantize_(self, x: torch.Tensor, toward_zero: torch.Tensor | None = None) -> None:
        """Store ``x`` (any float dtype, ``shape``) in place: each element becomes the nearest
        code, or, where the boolean mask ``toward_zero`` is set, the nearest code no larger in
        magnitude."""
        mask = None if toward_zero is None else toward_zero.reshape(-1)
        self.format.encode_(x.reshape(-1), self.codes, self.absmax, toward_zero=mask)

    def to(self, device: torch.device | str) -> "QuantizedState":
        return QuantizedState(self.codes.to(device), self.absmax.to(device), self.format, self.shape)

    def clone(self) -> "QuantizedState":
        return QuantizedState(self.codes.clone(), self.absmax.clone(), self.format, self.shape)

    def __deepcopy__(self, memo: dict) -> "QuantizedState":
        return self.clone()

    def __repr__(self) -> str:
        return f"QuantizedState(shape={self.shape}, format={self.format.name}, device={self.device})"

    # ---- checkpoint form ------------------------------------------------------------------
    def to_state_dict(self) -> dict[str, Any]:
        return {"codes": self.codes, "absmax": self.absmax, "format": self.format.name, "shape": list(self.shape)}

    @staticmethod
    def is_state_dict(value: Mapping[str, Any]) -> bool:
        return all(k in value for k in _STATE_DICT_KEYS)

    @classmethod
    def from_state_dict(cls, value: Mapping[str, Any], device: torch.device | str | None = None) -> "QuantizedState":
        """The state saved by :meth:`to_state_dict`, checked field by field before anything is
        allocated (the dict may come from an untrusted file): a known format with a bounded
        block size, a shape of non-negative ints, uint8 codes and floating-point block scales
        of exactly the lengths that shape and format give. ``ValueError`` otherwise."""
        from leanopt.quant.formats import format_by_name

        fmt = format_by_name(value["format"])
        shape = _checked_shape(value["shape"])
        codes, absmax = value["codes"], value["absmax"]
        if not isinstance(codes, torch.Tensor) or not isinstance(absmax, torch.Tensor):
            raise ValueError("codes and absmax must be tensors")
        numel = math.prod(shape)
        if codes.dtype != torch.uint8 or codes.numel() != fmt.code_bytes(numel):
            raise ValueError(
                f"codes are {codes.dtype} x {codes.numel()}, format {fmt.name} needs uint8 x {fmt.code_bytes(numel)}"
            )
        if not absmax.is_floating_point() or absmax.numel() != fmt.num_blocks(numel):
            raise ValueError(
                f"absmax is {absmax.dtype} x {absmax.numel()}, format {fmt.name} needs "
                f"{fmt.num_blocks(numel)} floating-point block scales"
            )
        device = codes.device if device is None else device
        return cls(
            codes.to(device=device, copy=True).reshape(-1),
            absmax.to(device=device, dtype=torch.float32, copy=True).reshape(-1),
            fmt,
            shape,
        )


def _checked_shape(shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, (list, tuple, torch.Size)) or len(shape) > 64:
        raise ValueError(f"shape must be a list of ints, got {type(shape).__name__}")
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise ValueError(f"shape must be a list of non-negative ints, got {list(shape)[:8]!r}")
    return tuple(shape)
