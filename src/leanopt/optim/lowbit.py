"""Block-quantized storage for any elementwise optimizer's states.

:class:`LowBit` is mixed in before an :class:`~leanopt.optim.elementwise.ElementwiseOptimizer`
(``class AdamW8bit(LowBit, AdamW)``): it stores each of the rule's states block-quantized
(:mod:`leanopt.quant`), on the code its class declares as ``<state key>_code`` (a signed code
for a first moment, an unsigned zero-free one for a second moment), in blocks of
``block_size`` with one fp32 scale each, and runs the rule in safe mode. Params with fewer than
``min_quant_size`` elements, and every param of a group with ``"quantize": False``, keep dense
states. Nothing here knows which rule it stores.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from leanopt.optim.elementwise import ElementwiseOptimizer
from leanopt.optim.layout import StateSpec
from leanopt.optim.validation import check_block_size, check_flag, check_min_quant_size
from leanopt.quant import BlockFormat

# Options that say how states are stored rather than how the optimizer steps. On load they
# keep this optimizer's values (the loaded states are converted to them), so an 8-bit
# checkpoint loads into the 4-bit optimizer as 4-bit and an fp32 one gains them.
STORAGE_OPTIONS = ("quantize", "block_size", "min_quant_size", "state_bits", "state_dtype")


class LowBit(ElementwiseOptimizer):
    """Quantized states for the elementwise optimizer it is mixed into (see the module).

    A subclass sets ``state_bits``, ``default_block_size`` and ``<key>_code`` for each of its
    rule's state keys. Constructor keywords ``block_size`` (default: ``default_block_size``) and
    ``min_quant_size`` (default 4096) are checked and kept by :meth:`_set_storage`; the rest
    are the optimizer's.
    """

    safe = True
    # Complex states would need a complex code book: complex params are refused.
    supports_complex = False
    state_bits: ClassVar[int]
    default_block_size: ClassVar[int]

    def __init__(self, params: Any, *args: Any, block_size: int | None = None, min_quant_size: int = 4096,
                 **kwargs: Any) -> None:  # fmt: skip
        # For a quantized sibling that spells out no constructor of its own (one defined outside
        # leanopt: ``class RMSprop8bit(LowBit, RMSprop)``); leanopt's own spell theirs out and
        # call :meth:`_set_storage`, then their optimizer's constructor past this one.
        self._set_storage(block_size, min_quant_size)
        super().__init__(params, *args, **kwargs)

    def _set_storage(self, block_size: int | None, min_quant_size: int) -> None:
        """Check and keep the storage keywords (``block_size`` None: ``default_block_size``)."""
        block_size = self.default_block_size if block_size is None else block_size
        check_block_size(block_size, self.state_bits)
        check_min_quant_size(min_quant_size)
        self._storage = dict(quantize=True, block_size=block_size, min_quant_size=min_quant_size, state_bits=self.state_bits)

    def _complete_defaults(self, defaults: dict[str, Any]) -> dict[str, Any]:
        return {**super()._complete_defaults(defaults), **self._storage}

    def validate_group(self, group: Mapping[str, Any], *, loaded: bool = False) -> None:
        super().validate_group(group, loaded=loaded)
        check_block_size(group["block_size"], self.state_bits)
        check_min_quant_size(group["min_quant_size"])
        check_flag("quantize", group["quantize"])
        if group.get("state_bits", self.state_bits) != self.state_bits:
            raise ValueError(f"{type(self).__name__} keeps {self.state_bits}-bit states; state_bits cannot be changed")

    # ---- layout ---------------------------------------------------------------------------
    def state_format(self, key: str, group: Mapping[str, Any]) -> BlockFormat:
        """The format of state ``key`` of quantized params in ``group``."""
        return BlockFormat(getattr(self, f"{key}_code"), group["block_size"])

    def quantizes(self, shape: tuple[int, ...], group: Mapping[str, Any]) -> bool:
        """Whether a param of (global) ``shape`` in ``group`` gets quantized states."""
        return bool(group["quantize"]) and math.prod(shape) >= group["min_quant_size"]

    def state_layout(self, shape: tuple[int, ...], dtype: torch.dtype, group: Mapping[str, Any]) -> list[StateSpec]:
        shape = tuple(shape)
        specs = self.step_layout(dtype, group)
        quantized = self.quantizes(shape, group)
        for key in self.state_keys(group):
            if quantized:
                specs.append(StateSpec(key, shape, torch.float32, quant=self.state_format(key, group)))
            else:
                specs.append(StateSpec(key, shape, self.dense_state_dtype(dtype, group)))
        return specs

    # ---- save / load ----------------------------------------------------------------------
    def _kept_on_load(self, group: Mapping[str, Any]) -> dict[str, Any]:
        return {**super()._kept_on_load(group), **{k: group[k] for k in STORAGE_OPTIONS if k in group}}
