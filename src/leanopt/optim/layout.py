"""The one description of an optimizer's state, from which both allocation and estimates derive.

Every leanopt optimizer answers ``state_layout(shape, dtype, group)`` with a list of
:class:`StateSpec`. ``_init_state`` allocates exactly those specs and
:func:`leanopt.estimate` sums their ``nbytes()``; the two cannot drift apart because there is
no second formula.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from leanopt.quant import QuantizedState


class QuantFormat(Protocol):
    """What a state spec needs from a quantized format (implemented in :mod:`leanopt.quant`)."""

    def nbytes(self, numel: int) -> int: ...

    def elements(self, numel: int) -> int: ...

    def zeros(self, shape: tuple[int, ...], device: torch.device) -> Any: ...

    def from_dense(self, dense: torch.Tensor) -> Any: ...


@dataclass(frozen=True)
class StateSpec:
    """One entry of a parameter's optimizer state.

    ``key`` is the state-dict key, ``shape`` and ``dtype`` describe a dense tensor (for a
    quantized entry: the logical shape and the dtype it dequantizes to). ``host`` marks
    entries torch keeps on the CPU whatever the parameter's device (AdamW's ``step``).
    ``quant`` is a quantized format, or ``None`` for a plain tensor. ``reduced_dim``: for a
    state that is the param reduced over one dim, that dim (it places a sharded param's state).
    """

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    host: bool = False
    quant: QuantFormat | None = None
    # A statistic of the param reduced over this dim (Adafactor's row/column second moments):
    # the state of a sharded (DTensor) param is replicated over that dim, sharded like the rest.
    reduced_dim: int | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def nbytes(self) -> int:
        if self.quant is not None:
            return self.quant.nbytes(self.numel)
        return self.numel * _itemsize(self.dtype)

    def elements(self) -> int:
        if self.quant is not None:
            return self.quant.elements(self.numel)
        return self.numel

    def allocate(self, device: torch.device) -> Any:
        if self.quant is not None:
            return self.quant.zeros(self.shape, device)
        return torch.zeros(self.shape, dtype=self.dtype, device="cpu" if self.host else device)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def convert_saved(spec: StateSpec, value: Any, p: torch.Tensor, where: str) -> Any:
    """One saved state value (a tensor, a number, a quantized state or its dict) -> the form
    ``spec`` asks for, on ``p``'s device; ``ValueError`` (prefixed by ``where``) if it cannot be."""
    if isinstance(value, Mapping) and QuantizedState.is_state_dict(value):
        try:
            value = QuantizedState.from_state_dict(value, device=p.device)
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{where}: corrupt quantized state ({err})") from None
    if isinstance(value, QuantizedState):
        if tuple(value.shape) != tuple(spec.shape):
            raise ValueError(f"{where} has shape {tuple(value.shape)}, expected {tuple(spec.shape)}")
        if spec.quant is not None and value.format == spec.quant:
            return value.to(p.device)
        value = value.dequantize()
    if isinstance(value, (int, float)) and not isinstance(value, bool) and spec.shape == ():
        value = torch.tensor(float(value))
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{where} is a {type(value).__name__}, expected a tensor")
    if tuple(value.shape) != tuple(spec.shape):
        raise ValueError(f"{where} has shape {tuple(value.shape)}, expected {tuple(spec.shape)}")
    if spec.quant is not None:
        return spec.quant.from_dense(value.to(device=p.device, dtype=torch.float32))
    device = torch.device("cpu") if spec.host else p.device
    # A fresh contiguous tensor: states are kept in the param's logical (row-major) element
    # order whatever the saved strides (a channels_last param's state saved by torch).
    dtype = spec.dtype if (value.is_floating_point() or value.is_complex() or spec.dtype.is_floating_point) else value.dtype
    return value.to(device=device, dtype=dtype, copy=True, memory_format=torch.contiguous_format)
