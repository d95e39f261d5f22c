"""Quantized optimizer states: the container type, its formats and code books."""

from leanopt.quant.formats import QuantizedState
from leanopt.quant.formats import MAX_BLOCK_SIZE, BlockFormat, format_by_name
from leanopt.quant.codebooks import CodeBook, codebook

__all__ = ["MAX_BLOCK_SIZE", "BlockFormat", "CodeBook", "QuantizedState", "codebook", "format_by_name"]
