"""Quantized optimizer states: the container type, its formats and code books."""

from leanopt.quant.codebooks import CodeBook, codebook
from leanopt.quant.formats import MAX_BLOCK_SIZE, BlockFormat, QuantizedState, format_by_name

__all__ = ["MAX_BLOCK_SIZE", "BlockFormat", "CodeBook", "QuantizedState", "codebook", "format_by_name"]
