"""Host-side tables that let one kernel launch cover many tensors.

A launch processes a list of tensors in fixed-size chunks; program ``c`` of the grid handles
chunk ``c``, and reads from small device tables which tensor that is (``chunk_tensor``),
where the chunk starts (``chunk_start``) and the tensors' addresses (one int64 table per
operand). Shapes never reach the compiler, so there is no per-shape recompilation, and a
whole param group is one launch per kernel.

Tables that depend only on the parameters (sizes, addresses of params and states) are cached
and rebuilt only when an address or size changes; gradient addresses are rebuilt each step
(``zero_grad(set_to_none=True)`` gives new gradient tensors). Building them reads only host
metadata: no device synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from leanopt import tracing


def _to_device(t: Tensor, device: torch.device) -> Tensor:
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class ChunkTable:
    """Which tensor and offset each program of a multi-tensor launch works on."""

    def __init__(self, numels: Sequence[int], chunk: int, device: torch.device) -> None:
        self.chunk = chunk
        self.numels = tuple(int(n) for n in numels)
        tensor_of_chunk: list[int] = []
        start_of_chunk: list[int] = []
        for i, n in enumerate(self.numels):
            count = -(-n // chunk)
            tensor_of_chunk.extend([i] * count)
            start_of_chunk.extend(range(0, count * chunk, chunk))
        self.num_chunks = len(tensor_of_chunk)
        self.chunk_tensor = _to_device(torch.tensor(tensor_of_chunk, dtype=torch.int32), device)
        self.chunk_start = _to_device(torch.tensor(start_of_chunk, dtype=torch.int64), device)
        self.numel = _to_device(torch.tensor(self.numels, dtype=torch.int64), device)


class TableCache:
    """Caches ChunkTables and address tables per key, keyed also by the addresses they hold."""

    def __init__(self) -> None:
        self._chunks: dict[tuple, ChunkTable] = {}
        self._addresses: dict[tuple, tuple[tuple[int, ...], Tensor]] = {}

    def chunks(self, tensors: Sequence[Tensor], chunk: int) -> ChunkTable:
        device = tensors[0].device
        key = (device, chunk, tuple(t.numel() for t in tensors))
        table = self._chunks.get(key)
        if table is None:
            table = self._chunks[key] = ChunkTable(key[2], chunk, device)
        return table

    def addresses(self, name: str, tensors: Sequence[Tensor | None], device: torch.device) -> Tensor:
        if tracing.active() is not None:  # fake tensors have no data pointers; a traced launch reads none
            return torch.zeros(len(tensors), dtype=torch.int64)
        ptrs = tuple(0 if t is None else t.data_ptr() for t in tensors)
        cached = self._addresses.get((name, device))
        if cached is not None and cached[0] == ptrs:
            return cached[1]
        table = _to_device(torch.tensor(ptrs, dtype=torch.int64), device)
        self._addresses[(name, device)] = (ptrs, table)
        return table

    def floats(self, values: Sequence[float], device: torch.device) -> Tensor:
        return _to_device(torch.tensor(values, dtype=torch.float32), device)

    def ints(self, values: Sequence[int], device: torch.device) -> Tensor:
        return _to_device(torch.tensor(values, dtype=torch.int64), device)
