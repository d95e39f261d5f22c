"""``assert_same``: two state dicts (or any nesting of dicts, lists and tensors) equal bit for bit,
the tests that convert or gather checkpoints share it."""

from __future__ import annotations

import torch


def assert_same(a, b, where: str = "") -> None:
    """``a`` and ``b`` equal: dicts with the same keys in any order (DCP's metadata orders them its
    own way), lists and tuples item by item, tensors of one dtype with equal elements, the rest by
    ``==``; ``where`` names the path of a difference."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and sorted(map(str, a)) == sorted(map(str, b)), (where, list(a), b)
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, (where, a, b)
