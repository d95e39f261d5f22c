"""The CPU quantized path's encoder (one gather from a packed 2^16-entry table) against the code
book's binary search, and its decay-rounding shortcut."""

from __future__ import annotations

import pytest
import torch

from leanopt.kernels import cpu_elementwise
from leanopt.kernels.cpu_elementwise import _nearest_code, encode_tables
from leanopt.quant.codebooks import code_names, codebook


def _probes(thresholds: torch.Tensor) -> torch.Tensor:
    """Every midpoint and its fp32 neighbours, +-0, +-1, and 2^21 random fp32 values in [-1, 1]."""
    t = thresholds.float()
    near = torch.cat([t, torch.nextafter(t, torch.full_like(t, 2.0)), torch.nextafter(t, torch.full_like(t, -2.0))])
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 0x3F800001, (1 << 21,), generator=gen, dtype=torch.int64).to(torch.int32)
    rand = bits.view(torch.float32)
    edges = torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, 1e-38, -1e-38])
    out = torch.cat([near, rand, -rand, edges])
    return out[(out >= -1) & (out <= 1)]


@pytest.mark.parametrize("name", code_names())
def test_packed_table_is_searchsorted(name: str) -> None:
    book = codebook(name)
    table = encode_tables(book, torch.device("cpu"))
    if table is None:
        pytest.skip(f"{name}: a bucket holds two midpoints (the reference encodes it)")
    assert table.dtype == torch.int64 and table.numel() == 1 << 16
    y = _probes(book.thresholds)
    assert torch.equal(_nearest_code(y, table), torch.searchsorted(book.thresholds, y))


@pytest.mark.parametrize("name", ["pow3-s8", "pow6-u8", "pow2-s4", "pow3-u4"])
def test_packed_table_whole_buckets(name: str) -> None:
    """Every fp32 of the buckets that hold a midpoint (where an off-by-one could hide)."""
    book = codebook(name)
    table = encode_tables(book, torch.device("cpu"))
    t = book.thresholds.float()
    buckets = torch.unique((t.view(torch.int32).to(torch.int64) >> 16) & 0xFFFF)
    low = torch.arange(1 << 16, dtype=torch.int64)
    for chunk in buckets.split(64):
        y = ((chunk[:, None] << 16) | low).reshape(-1).to(torch.int32).view(torch.float32)
        y = y[(y >= -1) & (y <= 1)]
        assert torch.equal(_nearest_code(y, table), torch.searchsorted(book.thresholds, y))


def test_has_zero() -> None:
    g = torch.randn(4096)
    assert not cpu_elementwise._has_zero(g)
    g[1234] = -0.0
    assert cpu_elementwise._has_zero(g)
    assert cpu_elementwise._has_zero(torch.empty(8, device="meta"))
