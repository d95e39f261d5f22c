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

import inspect
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from leanopt.optim.base import check_flag
from leanopt.optim.elementwise import ElementwiseOptimizer
from leanopt.optim.layout import StateSpec
from leanopt.quant import BlockFormat
from leanopt.quant.formats import MAX_BLOCK_SIZE

# Options that say how states are stored rather than how the optimizer steps. On load they
# keep this optimizer's values (the loaded states are converted to them), so an 8-bit
# checkpoint loads into the 4-bit optimizer as 4-bit and an fp32 one gains them.
STORAGE_OPTIONS = ("quantize", "block_size", "min_quant_size", "state_bits", "state_dtype")


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
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"Invalid min_quant_size: {value!r} (must be an int >= 0)")


class LowBit(ElementwiseOptimizer):
    """Quantized states for the elementwise optimizer it is mixed into (see the module).

    A subclass sets ``state_bits``, ``default_block_size`` and ``<key>_code`` for each of its
    rule's state keys. Constructor keywords ``block_size`` (default: ``default_block_size``) and
    ``min_quant_size`` (default 4096) are taken here; the rest go to the optimizer.
    """

    safe = True
    # Complex states would need a complex code book: complex params are refused.
    supports_complex = False
    state_bits: ClassVar[int]
    default_block_size: ClassVar[int]

    def __init__(self, params: Any, *args: Any, block_size: int | None = None, min_quant_size: int = 4096,
                 **kwargs: Any) -> None:  # fmt: skip
        block_size = self.default_block_size if block_size is None else block_size
        check_block_size(block_size, self.state_bits)
        check_min_quant_size(min_quant_size)
        self._storage = dict(quantize=True, block_size=block_size, min_quant_size=min_quant_size, state_bits=self.state_bits)
        super().__init__(params, *args, **kwargs)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Each subclass's __init__ shows its optimizer's signature plus the storage keywords
        # (for help(), IDEs and inspect.signature), though one __init__ serves them all.
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            return
        sibling = next(k for k in cls.__mro__[1:] if not issubclass(k, LowBit) and "__init__" in k.__dict__)
        base = inspect.signature(sibling.__init__)
        storage = [
            # None stands for the class's default_block_size: the signature shows that number.
            inspect.Parameter("block_size", inspect.Parameter.KEYWORD_ONLY, default=getattr(cls, "default_block_size", None),
                              annotation="int | None"),  # fmt: skip
            inspect.Parameter("min_quant_size", inspect.Parameter.KEYWORD_ONLY, default=4096, annotation="int"),
        ]
        params = list(base.parameters.values())
        at = next((i for i, q in enumerate(params) if q.name == "rounding"), len(params))

        def __init__(self: Any, *args: Any, **kw: Any) -> None:
            LowBit.__init__(self, *args, **kw)

        # Set by name: a function's __signature__, a class's constructor.
        setattr(__init__, "__signature__", base.replace(parameters=params[:at] + storage + params[at:]))
        __init__.__qualname__ = f"{cls.__qualname__}.__init__"
        setattr(cls, "__init__", __init__)

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
