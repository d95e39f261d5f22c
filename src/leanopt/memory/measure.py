"""True bytes of any optimizer's state.

Walks ``optimizer.state`` and counts each distinct storage once: tensors that share memory
are not double-counted, tensor subclasses (torchao's quantized states, DTensor) are counted
through their inner tensors, nested dicts and lists (bitsandbytes) are followed, and leanopt's
:class:`~leanopt.quant.QuantizedState` counts its codes and scales. Python numbers in a state
(transformers Adafactor's ``step`` and ``RMS``) hold no tensor memory and count 0 bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from leanopt.quant import QuantizedState

MiB = 1024**2


def size_text(nbytes: int) -> str:
    """A size in a unit that shows it (never ``0 MB``): ``16 B``, ``41.1 KiB``, and from 1 MiB on
    ``5.4 MB``, ``502 MB`` (MB are MiB, as in the lesson's 502 MB)."""
    if nbytes < 1024:
        return f"{nbytes:,} B"
    if nbytes < MiB:
        return f"{nbytes / 1024:.1f} KiB"
    mb = nbytes / MiB
    return f"{mb:.1f} MB" if mb < 10 else f"{mb:,.0f} MB"


@dataclass
class StateMeasurement:
    """Bytes and elements of optimizer state, in total and broken down."""

    bytes: int = 0
    elements: int = 0
    tensors: int = 0
    by_key: dict[str, int] = field(default_factory=dict)
    elements_by_key: dict[str, int] = field(default_factory=dict)
    by_group: dict[int, int] = field(default_factory=dict)

    @property
    def megabytes(self) -> float:
        return self.bytes / MiB

    def __str__(self) -> str:
        keys = ", ".join(f"{k}: {size_text(v)}" for k, v in self.by_key.items())
        return f"{self.bytes:,} bytes ({size_text(self.bytes)}), {self.elements:,} elements [{keys}]"


def leaf_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Plain tensors holding the memory of a state value."""
    if isinstance(value, QuantizedState):
        yield from value.tensors()
    elif isinstance(value, torch.Tensor):
        if type(value) not in (torch.Tensor, torch.nn.Parameter) and hasattr(value, "__tensor_flatten__"):
            attrs, _ = value.__tensor_flatten__()
            for name in attrs:
                yield from leaf_tensors(getattr(value, name))
        else:
            yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from leaf_tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from leaf_tensors(v)


class StateCounter:
    """Adds tensors to a measurement, counting each storage once."""

    def __init__(self) -> None:
        self.result = StateMeasurement()
        self._storages: set[tuple[str, int]] = set()
        self._views: set[tuple[str, int, int, tuple[int, ...]]] = set()

    def add(self, value: Any, key: str, group: int) -> None:
        r = self.result
        for t in leaf_tensors(value):
            nbytes, elements = self._new_bytes_and_elements(t)
            if nbytes == 0 and elements == 0:
                continue
            r.bytes += nbytes
            r.elements += elements
            r.tensors += 1
            r.by_key[key] = r.by_key.get(key, 0) + nbytes
            r.elements_by_key[key] = r.elements_by_key.get(key, 0) + elements
            r.by_group[group] = r.by_group.get(group, 0) + nbytes

    def _new_bytes_and_elements(self, t: torch.Tensor) -> tuple[int, int]:
        if t.device.type == "meta":
            return t.numel() * t.element_size(), t.numel()
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        device = str(t.device)
        view = (device, t.data_ptr(), t.element_size(), tuple(t.shape))
        elements = 0 if view in self._views else t.numel()
        self._views.add(view)
        if (device, ptr) in self._storages or (ptr == 0 and storage.nbytes() == 0):
            return 0, elements
        self._storages.add((device, ptr))
        return storage.nbytes(), elements


def measure(optimizer: torch.optim.Optimizer) -> StateMeasurement:
    """Measure the state memory an optimizer holds now (after at least one step for most).

    >>> import torch, leanopt
    >>> w = torch.nn.Parameter(torch.zeros(1000))
    >>> opt = torch.optim.AdamW([w]); w.grad = torch.ones(1000); opt.step()
    >>> leanopt.measure(opt).bytes   # exp_avg + exp_avg_sq + a 4-byte step
    8004
    """
    group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
    counter = StateCounter()
    for param, state in optimizer.state.items():
        group = group_of.get(id(param), -1)
        if isinstance(state, Mapping):
            for key, value in state.items():
                counter.add(value, str(key), group)
        else:
            counter.add(state, "<state>", group)
    return counter.result


def compute_optimizer_size(states: Iterable[Any]) -> tuple[float, int]:
    """``(megabytes, elements)`` of optimizer states, e.g. ``optimizer.state.values()``.

    The lesson's helper, made correct: shared storages count once, tensor subclasses and
    nested dicts are followed, and no tensor is copied. Megabytes are MiB (bytes / 1024²).
    """
    counter = StateCounter()
    for state in states:
        if isinstance(state, Mapping):
            for key, value in state.items():
                counter.add(value, str(key), 0)
        else:
            counter.add(state, "<state>", 0)
    return counter.result.bytes / MiB, counter.result.elements
