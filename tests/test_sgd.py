"""leanopt.SGD against torch.optim.SGD: the state torch keeps (none without momentum), and
checkpoints that go both ways.

The update itself is held to torch.optim.SGD by the registry (tests/registry.py ``SGD_VARIANTS``:
every flag combination torch accepts, on every backend, 1e-6 of the largest |param| after 20
steps: tests/test_rules.py::test_matches_its_reference), SGD8bit's bytes and its drift beside
bitsandbytes' SGD8bit likewise (``test_bytes_per_param``, ``test_lowbit_drift_...``).
"""

from __future__ import annotations

import copy

import pytest
import torch

import leanopt


def _feed(opt, params, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((64, 80), (80,))]


@pytest.mark.parametrize("cls", [leanopt.SGD, leanopt.SGD8bit])
def test_without_momentum_nothing_is_kept_as_torch_keeps_nothing(cls) -> None:
    ours, theirs = _params(), _params()
    opt, ref = cls(ours, lr=0.1), torch.optim.SGD(theirs, lr=0.1)
    _feed(opt, ours, 3, 1)
    _feed(ref, theirs, 3, 1)
    assert opt.state_dict()["state"] == ref.state_dict()["state"] == {}
    assert leanopt.measure(opt).bytes == leanopt.estimate(ours, cls, lr=0.1).bytes == 0
    for a, b in zip(ours, theirs):  # torch's foreach add may fuse lr * d into one rounding
        assert (a - b).abs().max() <= 1e-6 * b.abs().max()


def test_with_momentum_the_buffer_under_torchs_key() -> None:
    ours, theirs = _params(), _params()
    opt = leanopt.SGD(ours, lr=0.1, momentum=0.9, dampening=0.1)
    ref = torch.optim.SGD(theirs, lr=0.1, momentum=0.9, dampening=0.1)
    _feed(opt, ours, 3, 2)
    _feed(ref, theirs, 3, 2)
    for pid, st in ref.state_dict()["state"].items():
        mine = opt.state_dict()["state"][pid]
        assert set(st) == {"momentum_buffer"} and set(mine) == {"momentum_buffer", "step"}  # leanopt's own count
        torch.testing.assert_close(mine["momentum_buffer"], st["momentum_buffer"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("direction", ["torch->leanopt", "leanopt->torch"])
def test_checkpoints_are_interchangeable_with_torch(direction: str) -> None:
    kwargs = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2)
    first, second = (torch.optim.SGD, leanopt.SGD) if direction == "torch->leanopt" else (leanopt.SGD, torch.optim.SGD)
    a, b = _params(), _params()
    opt_a = first(a, **kwargs)
    _feed(opt_a, a, 4, 3)
    with torch.no_grad():
        for x, y in zip(a, b):
            y.copy_(x)
    opt_b = second(b, **kwargs)
    # A copy, as through a file: torch's load keeps the tensors it is given (and steps them).
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    _feed(opt_a, a, 4, 4)
    _feed(opt_b, b, 4, 4)
    for x, y in zip(a, b):
        assert (x - y).abs().max() <= 1e-6 * x.abs().max()


def test_nesterov_needs_a_momentum_and_no_dampening() -> None:
    w = [torch.nn.Parameter(torch.randn(3))]
    for bad in (dict(nesterov=True), dict(nesterov=True, momentum=0.9, dampening=0.5)):
        with pytest.raises(ValueError, match="nesterov.*Nesterov momentum requires a momentum and zero dampening"):
            leanopt.SGD(w, **bad)


def test_sgd8bit_quantizes_the_buffer_and_converts_from_fp32_on_load() -> None:
    w = torch.nn.Parameter(torch.randn(8192))
    fp32 = leanopt.SGD([w], lr=0.1, momentum=0.9)
    _feed(fp32, [w], 2, 5)
    eight = leanopt.SGD8bit([torch.nn.Parameter(w.detach().clone())], lr=0.1, momentum=0.9)
    eight.load_state_dict(fp32.state_dict())
    (q,) = [st["momentum_buffer"] for st in eight.state.values()]
    assert q.format.bits == 8
    buf = fp32.state[w]["momentum_buffer"]
    assert (q.dequantize() - buf).abs().max() <= 0.05 * buf.abs().max()
    assert (leanopt.measure(eight).bytes - 4) / w.numel() <= 1.02
