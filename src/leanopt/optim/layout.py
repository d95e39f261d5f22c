"""The one description of an optimizer's state, from which both allocation and estimates derive.

Every leanopt optimizer answers ``state_layout(shape, dtype, group)`` with a list of
:class:`StateSpec`. ``_init_state`` allocates exactly those specs and
:func:`leanopt.estimate` sums their ``nbytes()``; the two cannot drift apart because there is
no second formula.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch


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
