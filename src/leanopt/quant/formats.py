"""Block-wise quantized formats: a code book, a block size, and how codes are packed into bytes.

A :class:`BlockFormat` is what :class:`~leanopt.optim.layout.StateSpec` calls ``quant`` and what
a :class:`~leanopt.quant.QuantizedState` calls ``format``: it sizes, allocates, encodes and
decodes. Elements are taken in flat (row-major) order, cut into blocks of ``block_size`` (the
last one may be shorter); each block stores one fp32 ``absmax`` and one code per element, the
index of the nearest code-book value to ``x / absmax``. 8-bit codes take a byte each; 4-bit codes
are packed two to a byte, the first element in the low nibble.

Memory of ``n`` elements: ``code_bytes(n) + 4 * ceil(n / block_size)`` bytes, e.g. 8-bit blocks
of 256: 1.015625 B/element; 4-bit blocks of 128: 0.53125 B/element.

A format is named ``"<code>/b<block_size>"`` (``"pow3-s8/b256"``); the name is what a
checkpoint stores, and :func:`format_by_name` turns it back into the format. Block sizes are at
most :data:`MAX_BLOCK_SIZE`: a name read from a file decides how much work decoding does, so a
hostile ``"pow3-s8/b134217728"`` must not be taken at its word.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import is_fake

from leanopt.quant.codebooks import CodeBook, code_bits, codebook
from leanopt.quant.state import QuantizedState


# Round toward zero only where the nearest code exceeds |y| by more than this factor.
TOWARD_ZERO_TOLERANCE = 1 + 1e-5

# Largest block (elements per fp32 scale). The optimizers use 128 and 256; past a few thousand a
# block's scale is set by its outliers and the codes lose their resolution, so nothing useful
# is lost, and a checkpoint cannot ask for 2**27-element blocks.
MAX_BLOCK_SIZE = 2**16


def may_hold_true(mask: torch.Tensor) -> bool:
    """``mask.any()``, except that a tensor without data (meta, or fake under
    ``FakeTensorMode``: shape-only traces such as memory planning) answers True, so such a
    trace takes every branch instead of failing on ``.item()``."""
    if mask.device.type == "meta" or is_fake(mask):
        return True
    return bool(mask.any())


@dataclass(frozen=True)
class BlockFormat:
    """``code``: a code-book name from :mod:`leanopt.quant.codebooks`; ``block_size``: elements
    per fp32 scale."""

    code: str
    block_size: int

    def __post_init__(self) -> None:
        bits = code_bits(self.code)  # validates the name
        if bits not in (4, 8):
            raise ValueError(f"{self.code}: only 4- and 8-bit codes are supported")
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        if self.block_size > MAX_BLOCK_SIZE:
            raise ValueError(f"block_size {self.block_size} is larger than the maximum, {MAX_BLOCK_SIZE}")

    # ---- naming ----------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return f"{self.code}/b{self.block_size}"

    @property
    def bits(self) -> int:
        return code_bits(self.code)

    def book(self, device: torch.device | str) -> CodeBook:
        return codebook(self.code, device)

    # ---- sizes (the StateSpec protocol) -----------------------------------------------------
    def num_blocks(self, numel: int) -> int:
        return math.ceil(numel / self.block_size)

    def code_bytes(self, numel: int) -> int:
        return numel if self.bits == 8 else (numel + 1) // 2

    def nbytes(self, numel: int) -> int:
        return self.code_bytes(numel) + 4 * self.num_blocks(numel)

    def elements(self, numel: int) -> int:
        """Tensor elements held: codes (uint8) plus block scales (fp32)."""
        return self.code_bytes(numel) + self.num_blocks(numel)

    # ---- allocation -------------------------------------------------------------------------
    def zeros(self, shape: tuple[int, ...], device: torch.device | str) -> QuantizedState:
        numel = math.prod(shape)
        zi = self.book(device).zero_index
        fill = zi if self.bits == 8 else zi | (zi << 4)
        codes = torch.full((self.code_bytes(numel),), fill, dtype=torch.uint8, device=device)
        absmax = torch.zeros(self.num_blocks(numel), dtype=torch.float32, device=device)
        return QuantizedState(codes, absmax, self, tuple(shape))

    def from_dense(self, dense: torch.Tensor) -> QuantizedState:
        state = self.zeros(tuple(dense.shape), dense.device)
        state.quantize_(dense)
        return state

    # ---- encode / decode --------------------------------------------------------------------
    def decode(self, codes: torch.Tensor, absmax: torch.Tensor, numel: int) -> torch.Tensor:
        """fp32 flat tensor of ``numel`` elements, owning exactly its memory (no padding kept:
        a view of a padded buffer would be saved whole by ``torch.save``)."""
        vals = self.book(codes.device).values[self._unpack(codes, numel).long()]
        full, bs = numel // self.block_size, self.block_size
        vals[: full * bs].view(full, bs).mul_(absmax[:full].view(full, 1))
        if full * bs < numel:  # the last, shorter block
            vals[full * bs :].mul_(absmax[full])
        return vals

    def encode_(
        self, flat: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, toward_zero: torch.Tensor | None = None
    ) -> None:
        """Write ``flat`` (finite values; any float dtype) into ``codes`` and ``absmax``: the
        nearest code, or where the boolean mask ``toward_zero`` is set, the nearest code whose
        magnitude does not exceed the value's."""
        numel = flat.numel()
        nb = self.num_blocks(numel)
        x = torch.nn.functional.pad(flat.float(), (0, nb * self.block_size - numel)).view(nb, self.block_size)
        scale = x.abs().amax(dim=1)
        # An all-zero block keeps scale 0 and encodes as the code nearest 0: it decodes to 0.
        y = (x / torch.where(scale > 0, scale, torch.ones_like(scale)).view(nb, 1)).view(-1)[:numel]
        codes.copy_(self._pack(self.code_indices(y, toward_zero).to(torch.uint8)))
        absmax.copy_(scale)

    def code_indices(self, y: torch.Tensor, toward_zero: torch.Tensor | None = None) -> torch.Tensor:
        """Code-book index of each scaled value ``y`` (in [-1, 1]): the nearest value, or where
        ``toward_zero`` is set, the nearest value no larger in magnitude."""
        book = self.book(y.device)
        idx = torch.searchsorted(book.thresholds, y)
        if toward_zero is not None and may_hold_true(toward_zero):
            # The tolerance keeps a value sitting on a code there: a block whose elements all
            # decay by b1 has its scale decay by b1 too, so y lands exactly on its old code, and
            # an ulp of rounding must not decide whether momentum drops a whole code.
            overshoot = toward_zero & (book.values[idx].abs() > y.abs() * TOWARD_ZERO_TOLERANCE) & (idx != book.zero_index)
            idx = torch.where(overshoot, idx - torch.sign(idx - book.zero_index), idx)
        return idx

    def _pack(self, idx: torch.Tensor) -> torch.Tensor:
        if self.bits == 8:
            return idx
        if idx.numel() % 2:
            idx = torch.cat([idx, idx.new_zeros(1)])
        pairs = idx.view(-1, 2)
        return pairs[:, 0] | (pairs[:, 1] << 4)

    def _unpack(self, codes: torch.Tensor, numel: int) -> torch.Tensor:
        if self.bits == 8:
            return codes
        return torch.stack([codes & 0x0F, codes >> 4], dim=1).view(-1)[:numel]


def format_by_name(name: str) -> BlockFormat:
    """Inverse of :attr:`BlockFormat.name`: ``"pow3-s8/b256"`` -> ``BlockFormat("pow3-s8", 256)``.

    ``name`` usually comes from a file: anything but a known code and a block size of 1 to
    :data:`MAX_BLOCK_SIZE` is a ``ValueError``.
    """
    if not isinstance(name, str) or "/b" not in name:
        raise ValueError(f"not a quantized format name: {_shown(name)}")
    code, _, block = name.rpartition("/b")
    if not (block.isascii() and block.isdigit()):
        raise ValueError(f"not a quantized format name: {_shown(name)}")
    if len(block) > len(str(MAX_BLOCK_SIZE)) or int(block) > MAX_BLOCK_SIZE:
        raise ValueError(f"quantized format {_shown(name)}: block size larger than the maximum, {MAX_BLOCK_SIZE}")
    return BlockFormat(code, int(block))


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
