"""Code books: the sorted values a quantized state's codes stand for, per block, in [-1, 1].

A code book is a list of values; a block of ``block_size`` elements is divided by its absolute
maximum and each element becomes the index of the nearest value. Two families live here:

* **power codes** (leanopt's defaults): ``x_k = (k/K)^a`` -- signed ``±(k/K)^a`` with zero for
  the first moment, unsigned ``(k/K)^a`` *without* zero for the second moment. ``a`` trades
  resolution in the bulk of a block against reach towards tiny values.
* **dynamic tree** codes (Dettmers 2016, "8-bit approximations for parallelism in deep
  learning", used block-wise by Dettmers et al. 2022 and by bitsandbytes/torchao): a sign bit,
  then a run of zero bits giving a decimal exponent, an indicator bit, and the remaining bits as
  a linear fraction -- decade ``10^-e`` holds ``2^(F-e)`` evenly spaced values. Kept as the
  baseline that the power codes were measured against (``benchmarks/accuracy_vs_peers.py``).

Why power codes. Measured with ``benchmarks/accuracy_vs_peers.py`` (one 1024x1024 tensor,
20 steps at lr 1e-3, max / mean distance from fp32 ``torch.optim.AdamW``; "heavy": each
element's gradient scale is log-normal with sigma 1.5, like the mix of busy and quiet features
in a real layer; "hazard": gradients spanning 1e-6..1 in every block, then zero for half):

=====================================  =================  =================  =================
optimizer (codes m | v)                 randn*0.01         heavy              hazard
=====================================  =================  =================  =================
leanopt 8-bit, pow3 | pow6              5.5e-4 / 5.3e-5    4.8e-3 / 1.8e-4    1.1e-2 / 1.4e-3
leanopt 8-bit, dynamic tree (both)      6.4e-4 / 6.7e-5    1.4e-2 / 3.6e-4    1.6e-2 / 1.2e-3
bitsandbytes 8-bit (dynamic tree)       8.0e-4 / 6.7e-5    1.5e-2 / 6.7e-4    1.9e-2 / 6.3e-3
torchao 8-bit (dynamic tree)            6.8e-4 / 6.7e-5    43 / 1.9e-3        116 / 5.2
leanopt 4-bit, pow2 | pow3              8.2e-3 / 7.2e-4    1.8e-2 / 2.4e-3    1.9e-2 / 8.4e-3
torchao 4-bit (dynamic | linear)        1.1e-2 / 9.1e-4    1.7e-2 / 3.3e-3    2.2e-2 / 9.8e-3
=====================================  =================  =================  =================

(The dynamic tree's lower hazard mean is the second-moment floor standing in for the ``v`` it
rounds to 0 -- in this scenario the floor happens to equal fp32's step. leanopt's rows are with
the decay rounding of zero-gradient elements; before it the hazard column read 1.1e-2 / 1.7e-3 for pow3 |
pow6 and 5.6e-3 / 1.3e-3 for the dynamic tree.)

The first moment's error dominates the update's; the dynamic tree spends half its codes on
``[0.1, 1]`` of the block maximum and is coarse around ``0.05-0.3`` where most of a block's
``m`` lies, while ``(k/127)^3`` is finer there and still reaches ``5e-7`` (the tree stops at
``1e-6``). For the second moment ``(k/256)^6`` means ``sqrt(v)`` sits on a cubic grid just
like ``m``; its smallest value ``3.5e-15`` covers the squared range of ``m``, and it has no
zero, so a stored ``v`` is never 0 while its block is not (see the hazard note in
:func:`leanopt.kernels.reference.rule_step_` for the guarantee that does not depend on
the code at all).

Sparse gradients. On the ``sparse`` workload of ``benchmarks/accuracy_vs_peers.py``
(features active on 2 % of 300 steps; 128x512, seed 0; mean distance from fp32 AdamW / elements
further than 0.01), measured before the decay rounding, no other 4-bit book or block size
closed AdamW4bit's gap to torchao 4-bit (5.04e-3 / 8,034): as shipped then 6.13e-3 / 12,513; first moment on torchao's dynamic 4-bit code
7.40e-3 / 18,673, on ``(k/7)^3`` 6.57e-3 / 14,737; second moment on torchao's linear code
7.42e-3 / 18,414, on a log code (1e-4..1) 6.13e-3 / 12,636; blocks of 64 5.19e-3 / 7,905 (at
1.125 B/param), of 256 6.93e-3 / 16,550. The first moment's rounding where the gradient is 0
was what lost there; with the decay rounding (``leanopt.quant.formats``) AdamW4bit is ahead of
torchao 4-bit on that workload (docs/quantized.md).

Code books are built once per (name, device) and shared by every state: a state stores codes
and block scales only (:func:`codebook`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from leanopt import tracing


@dataclass(frozen=True)
class CodeBook:
    """``values``: sorted fp32 code values (length ``2**bits``); ``thresholds``: the midpoints
    between consecutive *distinct* values, so ``searchsorted(thresholds, x)`` is the index of
    the nearest value. ``zero_index`` is the code of 0 (signed) or of the smallest value."""

    name: str
    bits: int
    signed: bool
    values: torch.Tensor
    thresholds: torch.Tensor
    zero_index: int


def power_values(bits: int, signed: bool, power: float) -> list[float]:
    """``±(k/K)^power`` with zero (signed, ``K = 2^(bits-1) - 1``) or ``(k/K)^power``,
    ``k = 1..K`` without zero (unsigned, ``K = 2^bits``)."""
    if signed:
        k_max = 2 ** (bits - 1) - 1
        pos = [(k / k_max) ** power for k in range(1, k_max + 1)]
        return [-x for x in reversed(pos)] + [0.0] + pos
    k_max = 2**bits
    return [(k / k_max) ** power for k in range(1, k_max + 1)]


def dynamic_tree_values(bits: int, signed: bool, zero: bool = True) -> list[float]:
    """Dynamic tree code (Dettmers 2016): after the sign bit (signed only), ``e`` zero bits set
    the decimal exponent ``10^-e``, a one bit ends them, and the ``F - e`` bits left are a linear
    fraction over ``(0.1, 1]`` of that decade, ``F = bits - 2`` for signed codes and
    ``bits - 1`` for unsigned ones. The all-zero pattern is 0 (or, with ``zero=False``, dropped).
    Fraction values are the upper ends of their intervals, so every decade's top -- and 1.0 --
    is exact."""
    fraction_bits = bits - 2 if signed else bits - 1
    pos: list[float] = []
    for e in range(fraction_bits + 1):
        n = 2 ** (fraction_bits - e)
        scale = 10.0**-e
        pos += [scale * (0.1 + 0.9 * i / n) for i in range(1, n + 1)]
    pos = sorted(pos)
    if signed:
        return [-x for x in reversed(pos)] + [0.0] + pos
    return ([0.0] if zero else []) + pos


# name -> (bits, signed, values); the names are part of the checkpoint format: never reuse one.
_CODES: dict[str, tuple[int, bool, Callable[[], list[float]]]] = {
    "pow3-s8": (8, True, lambda: power_values(8, True, 3.0)),
    "pow6-u8": (8, False, lambda: power_values(8, False, 6.0)),
    "pow2-s4": (4, True, lambda: power_values(4, True, 2.0)),
    "pow3-u4": (4, False, lambda: power_values(4, False, 3.0)),
    "dyn-s8": (8, True, lambda: dynamic_tree_values(8, True)),
    "dyn-u8": (8, False, lambda: dynamic_tree_values(8, False, zero=True)),
    "dyn-u8nz": (8, False, lambda: dynamic_tree_values(8, False, zero=False)),
    "dyn-s4": (4, True, lambda: dynamic_tree_values(4, True)),
}

_CACHE: dict[tuple[str, torch.device], CodeBook] = {}


def code_names() -> list[str]:
    return sorted(_CODES)


def code_bits(name: str) -> int:
    return _spec(name)[0]


def _spec(name: str) -> tuple[int, bool, Callable[[], list[float]]]:
    try:
        return _CODES[name]
    except KeyError:
        raise ValueError(f"unknown code book {name!r} (known: {', '.join(code_names())})") from None


def codebook(name: str, device: torch.device | str = "cpu") -> CodeBook:
    """The shared code book ``name`` on ``device`` (built on first use, then cached)."""
    device = torch.device(device)
    key = (name, device)
    books = tracing.cache(_CACHE)  # inside a memory trace, the trace's own (fake) books
    book = books.get(key)
    if book is None:
        book = books[key] = _build(name, device)
    return book


def _build(name: str, device: torch.device) -> CodeBook:
    bits, signed, make = _spec(name)
    vals = sorted(make())
    size = 2**bits
    if len(vals) > size or len(set(vals)) != len(vals):
        raise AssertionError(f"code book {name} has {len(vals)} values for {size} codes")
    distinct = torch.tensor(vals, dtype=torch.float64)
    thresholds = (distinct[1:] + distinct[:-1]) / 2
    # Spare codes (a symmetric signed code has 2^bits - 1 values) repeat the largest value, so
    # that any byte decodes to something finite; the encoder never produces them.
    padded = vals + [vals[-1]] * (size - len(vals))
    zero_index = min(range(len(vals)), key=lambda i: abs(vals[i]))
    return CodeBook(
        name=name,
        bits=bits,
        signed=signed,
        values=torch.tensor(padded, dtype=torch.float32, device=device),
        thresholds=thresholds.to(dtype=torch.float32, device=device),
        zero_index=zero_index,
    )


def midpoints_below_buckets(thresholds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """For each of the 2^16 buckets named by the top 16 bits of an fp32: the number of the
    (sorted, fp32, CPU) ``thresholds`` below the bucket (int64), whether the bucket holds finite
    values only, and whether no finite bucket holds more than one threshold (then the bucket
    and one comparison give ``torch.searchsorted``'s answer)."""
    bits = torch.arange(1 << 16, dtype=torch.int64) << 16
    lo = bits.to(torch.int32).view(torch.float32)
    hi = (bits | 0xFFFF).to(torch.int32).view(torch.float32)
    low, high = torch.minimum(lo, hi), torch.maximum(lo, hi)
    below = torch.searchsorted(thresholds, low)
    inside = torch.searchsorted(thresholds, high, right=True) - below
    finite = torch.isfinite(low) & torch.isfinite(high)
    return below, finite, bool(((inside <= 1) | ~finite).all())
