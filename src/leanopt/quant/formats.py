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

A :class:`QuantizedState` is codes + one fp32 scale per block + the format that says how to
read them. Optimizers call ``dequantize()`` and ``quantize_(x)``; how bits are packed is the
format's business alone. In ``optimizer.state`` a quantized entry is a ``QuantizedState``; in a
``state_dict`` it is a plain dict of tensors, ints and strings (:meth:`QuantizedState.to_state_dict`),
so checkpoints load with ``torch.load(weights_only=True)``.

Code written for tensor states meets a ``QuantizedState`` in ``optimizer.state`` and treats it as
one where it can: ``torch.tensor(state)`` (the DistilBERT lesson's ``compute_optimizer_size``
calls it on every value) and ``torch.from_dlpack(state)`` give a copy of its memory as one flat
uint8 tensor (:meth:`QuantizedState.as_bytes`: ``numel() * element_size()`` is its true size),
``state.to(device, non_blocking=...)``, ``.cpu()`` and ``.cuda()`` move it, and ``.nbytes`` is
its size. It is not a ``torch.Tensor``: a walk that moves only ``isinstance(v, torch.Tensor)``
values leaves it where it is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from leanopt.quant.codebooks import CodeBook, code_bits, codebook

# Decay rounding: the nearest code counts as progress only below this fraction of the previous
# stored magnitude (an ulp of the new block scale must not decide between nearest and dither).
DECAY_PROGRESS = 1 - 1e-5

# Decay rounding: the dither may store a larger magnitude than the element held (its block's
# scale rose) only between codes at most this far apart; across a wider gap (the bottom of every
# code: 0 to its smallest value, and the next one or two) it rounds toward zero instead, so that
# a block scale rising for many steps (the first steps of training) cannot carry a decaying
# momentum upward. math.inf: unbiased dither everywhere (more accurate on average, a heavier
# tail on the hazard scenario: benchmarks/accuracy_vs_peers.py).
DECAY_GROWTH_RATIO = 2.0


@dataclass(frozen=True)
class Decay:
    """What :meth:`BlockFormat.encode_` needs to round decaying elements (zero gradients).

    ``mask``: bool, one per element, set where the state only decays this step (its gradient
    is exactly 0); ``previous``: the values the state held before the step (dequantized, the
    same shape); ``step``: the 1-based step, which seeds the dither; ``offset``: the flat index,
    in the whole (global) tensor, of element 0 -- a shard passes its offset, so the dither does
    not depend on how the tensor is split.
    """

    mask: torch.Tensor
    previous: torch.Tensor
    step: int
    offset: int = 0

    def flat(self) -> Decay:
        return Decay(self.mask.reshape(-1), self.previous.reshape(-1), self.step, self.offset)

    def scaled(self, safe_scale: torch.Tensor, block_size: int, lead: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(mask, prev_y, u)`` for :meth:`BlockFormat.code_indices`, flat: ``prev_y`` is
        ``|previous|`` in units of the *new* block scales ``safe_scale`` (``[blocks, 1]``, no
        zeros) of blocks of ``block_size`` whose first starts ``lead`` elements before element
        0; ``u`` is the :func:`dither` of each element's global index and the step."""
        numel, nb = self.previous.numel(), safe_scale.shape[0]
        prev = torch.nn.functional.pad(self.previous.reshape(-1).float().abs(), (lead, nb * block_size - lead - numel))
        prev_y = (prev.view(nb, block_size) / safe_scale).view(-1)[lead : lead + numel]
        index = torch.arange(numel, dtype=torch.int64, device=prev.device) + self.offset
        return self.mask.reshape(-1), prev_y, dither(index, self.step)


_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x * k mod 2^32`` for int64 ``x`` in [0, 2^32), without int64 overflow."""
    lo = x * (k & 0xFFFF)
    hi = ((x * (k >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def dither(index: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
    """A uniform number in [0, 1) per element from its global flat ``index`` (int64 >= 0) and
    ``step`` (a number, or a 0-dim int64 tensor where a compiled graph takes it as an input):
    32-bit integer arithmetic only, so every backend computes the same bits.

    ``h = (index mod 2^32) xor ((index >> 32) * 0x9E3779B9)``, ``h = h * 0x9E3779B1 +
    step * 0x85EBCA77``, then the ``lowbias32`` finalizer (``h ^= h >> 16; h *= 0x7FEB352D;
    h ^= h >> 15; h *= 0x846CA68B; h ^= h >> 16``), every product mod 2^32; the result is
    ``(h >> 8) / 2^24``.
    """
    h = (index & _M32) ^ _mul32(index >> 32, 0x9E3779B9)
    h = (_mul32(h, 0x9E3779B1) + ((step * 0x85EBCA77) & _M32)) & _M32
    h = h ^ (h >> 16)
    h = _mul32(h, 0x7FEB352D)
    h = h ^ (h >> 15)
    h = _mul32(h, 0x846CA68B)
    h = h ^ (h >> 16)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def decay_rounded(
    idx: torch.Tensor, y: torch.Tensor, values: torch.Tensor, zero_index: int, last: int,
    mask: torch.Tensor, prev_y: torch.Tensor, u: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The decay rounding of :meth:`BlockFormat.code_indices`: ``idx`` (the nearest codes of
    ``y``, on the signed code book ``values`` whose 0 is ``zero_index`` and largest distinct
    value ``last``) with the elements of ``mask`` re-rounded. Tensor operations only (the
    compiled CPU path traces it; the Triton kernel has the same steps, ``_decay_rounded``)."""
    near = values[idx].abs()
    progress = near < prev_y * DECAY_PROGRESS
    # a: the code toward zero from y (nearest if it does not exceed |y|, else one code nearer
    # zero); b: the next code away from zero, clamped at both ends of the book.
    over = (near > y.abs()) & (idx != zero_index)
    a = torch.where(over, idx - torch.sign(idx - zero_index), idx)
    b = (a + torch.where(y < 0, -1, 1)).clamp(0, last)
    va, vb = values[a].abs(), values[b].abs()
    gap = vb - va
    frac = torch.where(gap > 0, (y.abs() - va) / torch.where(gap > 0, gap, 1.0), 0.0)
    up = (u < frac) & ~((vb * DECAY_PROGRESS > prev_y) & (vb > va * DECAY_GROWTH_RATIO))
    return torch.where(mask & ~progress, torch.where(up, b, a), idx)


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


_STATE_DICT_KEYS = ("codes", "absmax", "format", "shape")


class QuantizedState:
    """Block-wise quantized tensor: ``codes`` (uint8), ``absmax`` (fp32 per block), ``format``."""

    __slots__ = ("codes", "absmax", "format", "shape")

    def __init__(self, codes: torch.Tensor, absmax: torch.Tensor, format: Any, shape: tuple[int, ...]):
        self.codes = codes
        self.absmax = absmax
        self.format = format
        self.shape = tuple(int(s) for s in shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tensors that hold this state's memory (the code book is shared, not stored here)."""
        return (self.codes, self.absmax)

    def dequantize(self) -> torch.Tensor:
        """fp32 tensor of ``shape``."""
        return self.format.decode(self.codes, self.absmax, self.numel).view(self.shape)

    def quantize_(self, x: torch.Tensor, decay: Decay | None = None) -> None:
        """Store ``x`` (any float dtype, ``shape``) in place: each element becomes the nearest
        code, or, where ``decay.mask`` is set, the decay rounding of
        :meth:`BlockFormat.code_indices`."""
        self.format.encode_(x.reshape(-1), self.codes, self.absmax, decay=None if decay is None else decay.flat())

    @property
    def nbytes(self) -> int:
        """Bytes of memory held: codes plus fp32 block scales (``format.nbytes(numel)`` for a whole state)."""
        return self.codes.nbytes + self.absmax.nbytes

    def _like(self, codes: torch.Tensor, absmax: torch.Tensor) -> QuantizedState:
        """The same state (format, shape) over other ``codes`` and ``absmax`` tensors."""
        return QuantizedState(codes, absmax, self.format, self.shape)

    def to(self, *args: Any, copy: bool = False, **kwargs: Any) -> QuantizedState:
        """This state on another device, taking ``Tensor.to``'s forms as generic code calls
        them: ``to(device)``, ``to(device=..., non_blocking=...)``, ``to(other_tensor)`` (its
        device; its dtype is not taken), ``copy=True`` for new tensors on the same device.
        A ``dtype`` (``to(torch.float16)``, ``to(device, dtype)``) is a ``TypeError``: codes
        and block scales have no dtype to convert to (``dequantize()`` gives the fp32 values)."""
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        takes_tensor = bool(args) and isinstance(args[0], torch.Tensor)
        if dtype is not None and not takes_tensor:
            raise TypeError(
                f"QuantizedState.to: a quantized state ({self.format.name}) has no dtype to convert to {dtype}; "
                "move it with to(device), or dequantize() it"
            )
        device = self.device if device is None else device
        move = lambda t: t.to(device, non_blocking=non_blocking, copy=copy)  # noqa: E731
        return self._like(move(self.codes), move(self.absmax))

    def cpu(self) -> QuantizedState:
        return self.to("cpu")

    def cuda(self, device: torch.device | str | int | None = None, non_blocking: bool = False) -> QuantizedState:
        return self.to(torch.device("cuda") if device is None else torch.device("cuda", device) if isinstance(device, int)
                       else torch.device(device), non_blocking=non_blocking)  # fmt: skip

    def as_bytes(self) -> torch.Tensor:
        """A new flat uint8 tensor of this state's memory: the codes, then the block scales'
        bytes (``nbytes`` elements). What ``torch.tensor(state)`` returns; writing to it does
        not change the state."""
        return torch.cat([self.codes.reshape(-1), self.absmax.reshape(-1).contiguous().view(torch.uint8)])

    # DLPack export (what torch.tensor, torch.asarray and torch.from_dlpack read from an object
    # that is not a tensor): codes and scales are two tensors, so the export is always a copy,
    # which the protocol allows unless the consumer asks for copy=False.
    def __dlpack__(self, *, copy: bool | None = None, **kwargs: Any) -> Any:
        if copy is False:
            raise BufferError("a QuantizedState is two tensors (codes and block scales): it can only be exported as a copy")
        return self.as_bytes().__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[Any, int]:
        return self.codes.__dlpack_device__()

    def clone(self) -> QuantizedState:
        return self._like(self.codes.clone(), self.absmax.clone())

    def __deepcopy__(self, memo: dict) -> QuantizedState:
        return self.clone()

    def __repr__(self) -> str:
        return f"QuantizedState(shape={self.shape}, format={self.format.name}, device={self.device})"

    # ---- checkpoint form ------------------------------------------------------------------
    def to_state_dict(self) -> dict[str, Any]:
        return {"codes": self.codes, "absmax": self.absmax, "format": self.format.name, "shape": list(self.shape)}

    @staticmethod
    def is_state_dict(value: Mapping[str, Any]) -> bool:
        return all(k in value for k in _STATE_DICT_KEYS)

    @classmethod
    def from_state_dict(cls, value: Mapping[str, Any], device: torch.device | str | None = None) -> QuantizedState:
        """The state saved by :meth:`to_state_dict`, checked field by field before anything is
        allocated (the dict may come from an untrusted file): a known format with a bounded
        block size, a shape of non-negative ints, uint8 codes and floating-point block scales
        of exactly the lengths that shape and format give. ``ValueError`` otherwise."""
        fmt = format_by_name(value["format"])
        shape = _checked_shape(value["shape"])
        codes, absmax = value["codes"], value["absmax"]
        if not isinstance(codes, torch.Tensor) or not isinstance(absmax, torch.Tensor):
            raise ValueError("codes and absmax must be tensors")
        numel = math.prod(shape)
        if codes.dtype != torch.uint8 or codes.numel() != fmt.code_bytes(numel):
            raise ValueError(
                f"codes are {codes.dtype} x {codes.numel()}, format {fmt.name} needs uint8 x {fmt.code_bytes(numel)}"
            )
        if not absmax.is_floating_point() or absmax.numel() != fmt.num_blocks(numel):
            raise ValueError(
                f"absmax is {absmax.dtype} x {absmax.numel()}, format {fmt.name} needs "
                f"{fmt.num_blocks(numel)} floating-point block scales"
            )
        device = codes.device if device is None else device
        return cls(
            codes.to(device=device, copy=True).reshape(-1),
            absmax.to(device=device, dtype=torch.float32, copy=True).reshape(-1),
            fmt,
            shape,
        )


def _checked_shape(shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, (list, tuple, torch.Size)) or len(shape) > 64:
        raise ValueError(f"shape must be a list of ints, got {type(shape).__name__}")
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise ValueError(f"shape must be a list of non-negative ints, got {list(shape)[:8]!r}")
    return tuple(shape)


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

    def encode_(self, flat: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, decay: Decay | None = None) -> None:
        """Write ``flat`` (finite values; any float dtype) into ``codes`` and ``absmax``: the
        nearest code, or where ``decay.mask`` is set (flat), the decay rounding of
        :meth:`code_indices`."""
        numel = flat.numel()
        nb = self.num_blocks(numel)
        x = torch.nn.functional.pad(flat.float(), (0, nb * self.block_size - numel)).view(nb, self.block_size)
        scale = x.abs().amax(dim=1)
        # An all-zero block keeps scale 0 and encodes as the code nearest 0: it decodes to 0.
        safe_scale = torch.where(scale > 0, scale, torch.ones_like(scale)).view(nb, 1)
        y = (x / safe_scale).view(-1)[:numel]
        decay_y = decay.scaled(safe_scale, self.block_size) if decay is not None and may_hold_true(decay.mask) else None
        codes.copy_(self._pack(self.code_indices(y, decay_y).to(torch.uint8)))
        absmax.copy_(scale)

    def code_indices(self, y: torch.Tensor, decay: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Code-book index of each scaled value ``y`` (in [-1, 1]): the nearest value, except
        where ``decay`` says the element only decays.

        ``decay = (mask, prev_y, u)``: where ``mask`` is set (the element only decays), the
        nearest code if it is smaller in magnitude than ``prev_y`` (the previous stored
        magnitude in units of the new block scale) times :data:`DECAY_PROGRESS`; otherwise
        (nearest rounding would keep or grow the magnitude: a momentum stuck on its code, or a
        block scale that rose) the value is rounded stochastically between ``a``, the largest
        code no larger in magnitude than ``|y|``, and ``b``, the next code away from zero:
        ``b`` where ``u < (|y| - |a|) / (|b| - |a|)``, else ``a`` -- except that ``b`` is not
        taken where it exceeds ``prev_y`` and ``|b| > DECAY_GROWTH_RATIO * |a|``. The stored
        momentum is ``b1 m`` in expectation wherever that exception does not bite (a stuck
        momentum: ``b`` is its own code), never grows across a coarse gap, and dies out (0 is
        a code and never left).
        """
        book = self.book(y.device)
        idx = torch.searchsorted(book.thresholds, y)
        if decay is not None:
            idx = decay_rounded(idx, y, book.values, book.zero_index, book.thresholds.numel(), *decay)
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
