"""Quantized optimizer states: the container type, its formats and code books."""

from leanopt.quant.state import QuantizedState
from leanopt.quant.formats import BlockFormat, format_by_name
from leanopt.quant.codebooks import CodeBook, codebook

__all__ = ["BlockFormat", "CodeBook", "QuantizedState", "codebook", "format_by_name"]
