"""One param's update as data: the tensors a rule reads and writes, passed to it explicitly.

Every way leanopt steps a param -- ``optimizer.step()``, gradient release inside ``backward``,
the host step of ``offload="cpu"``, a bf16 param's fp32 copy under stochastic or Kahan
rounding -- builds :class:`ParamStep` items and hands them to the optimizer's ``update``. The
item says which tensor is updated (the param itself, its host copy, its fp32 copy, or a chunk of
any of these), with which gradient and which states, so no path has to lend a tensor a place in
``optimizer.state`` to reuse the maths.

A rule whose update of an element reads only that element (``chunkable`` on the class: every
elementwise rule) may be stepped in pieces: :func:`chunks` cuts an item into items of at most
``limit`` elements -- views of the param, the gradient and each state (a quantized state from a
block boundary) -- whose ``offset`` is their first element's flat index in the whole param, which
keys every position-dependent random number (the decay rounding's dither, stochastic rounding),
so a param stepped in chunks gets the bits it gets whole.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from leanopt import tracing
from leanopt.quant import QuantizedState

__all__ = ["CHUNK_ELEMENTS", "ParamStep", "chunk_elements", "chunks", "spans", "state_chunk"]

# Elements of one param stepped at once where a path bounds its temporaries (the host step of
# offload, the fp32 copy of a rounded bf16 param): 2**22, a 16 MiB fp32 buffer. TinyLlama-1.1B's
# 65.5M-element embedding would otherwise need 256 MiB of fp32 copy and gradient per step.
CHUNK_ELEMENTS = 1 << 22


@dataclass(slots=True)
class ParamStep:
    """The update of one param (or of elements ``offset ..`` of one): ``param`` is written in
    place from ``grad`` and ``state`` (its states by key, views of the same elements for a
    chunk), ``step`` the param's step count after this update (0 where it keeps none),
    ``index`` its (group, position) in the optimizer, for messages and for the random streams
    keyed by where a param is."""

    param: torch.Tensor
    grad: torch.Tensor
    state: Mapping[str, Any]
    step: int
    index: tuple[int, int]
    offset: int = 0

    def states(self, keys: Iterable[str]) -> list[Any]:
        """The states under ``keys``, in that order (a rule's order)."""
        return [self.state[k] for k in keys]


def spans(numel: int, chunk: int | None) -> list[tuple[int, int]] | None:
    """The ``[start, stop)`` ranges of a flat param of ``numel`` elements stepped one after the
    other, or None where it is stepped whole (no ``chunk``, or no more elements than one)."""
    if chunk is None or numel <= chunk:
        return None
    return [(start, min(start + chunk, numel)) for start in range(0, numel, chunk)]


def chunk_elements(chunkable: bool, p: torch.Tensor, block_sizes: Iterable[int], limit: int = CHUNK_ELEMENTS) -> int | None:
    """Elements per chunk of ``p`` for a rule that is ``chunkable``, or None where it is stepped
    whole: a rule that is not, complex or non-contiguous params. A chunk is a multiple of each
    of ``block_sizes`` (its quantized states'), so no block straddles two chunks."""
    if not chunkable or p.is_complex() or not p.is_floating_point() or not p.is_contiguous():
        return None
    block = math.lcm(1, *block_sizes)
    return max(block, limit // block * block)


def state_chunk(value: Any, start: int, stop: int) -> Any:
    """Elements ``[start, stop)`` of a param's state: a view of a dense state's flat memory, a
    quantized state over its codes and block scales from ``start`` (a block boundary), or a
    scalar (``step``) as it is."""
    if isinstance(value, QuantizedState):
        fmt = value.format
        byte0, byte1 = fmt.code_bytes(start), fmt.code_bytes(stop)
        block0 = start // fmt.block_size
        return QuantizedState(value.codes[byte0:byte1], value.absmax[block0:block0 + fmt.num_blocks(stop - start)], fmt,
                              (stop - start,))  # fmt: skip
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return value.view(-1)[start:stop]
    return value


def chunks(item: ParamStep, chunk: int | None) -> Iterator[ParamStep]:
    """``item`` as items of at most ``chunk`` elements (flat views), or itself where it is
    stepped whole. The param, gradient and dense states must be contiguous."""
    parts = spans(item.param.numel(), chunk)
    if parts is None:
        yield item
        return
    param, grad = item.param.view(-1), item.grad.reshape(-1)
    for start, stop in tracing.walked(parts):
        yield dataclasses.replace(
            item, param=param[start:stop], grad=grad[start:stop],
            state={k: state_chunk(v, start, stop) for k, v in item.state.items()}, offset=item.offset + start,
        )  # fmt: skip
