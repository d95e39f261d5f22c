"""Quantized optimizer states: the container type, its formats and code books."""

from leanopt.quant.state import QuantizedState

__all__ = ["QuantizedState"]
