"""AdamW8bit / AdamW4bit on sparse gradients: most elements zero on most steps.

The workload is :class:`SparseGradients` of ``benchmarks/accuracy_vs_peers.py`` (its second
table), here at 128x512 -- where leanopt 4-bit's gap to torchao 4-bit shows at the same size as at the
table's 256x1024 (measured, seed 0: leanopt 4-bit mean 6.13e-3 and 12,513 elements further than
0.01 from fp32 AdamW, torchao 4-bit 5.04e-3 and 8,034: +22 % and +56 %).
"""

from __future__ import annotations

import math

import pytest
import torch

import leanopt
import repo_modules

bench = repo_modules.benchmark("accuracy_vs_peers")

LOW_BIT = [leanopt.AdamW8bit, leanopt.AdamW4bit]
low_bit = pytest.mark.parametrize("cls", LOW_BIT, ids=["8bit", "4bit"])
SHAPE = (128, 512)


def _moment_bound(b1: float, b2: float, t: int) -> float:
    """K_t, the largest m^2/v exact Adam moments reach at step t (written out here, so that the
    test does not depend on where the kernels keep theirs)."""
    r = b1 * b1 / b2
    return (1 - b1) ** 2 / (1 - b2) * (1 - r**t) / (1 - r)


def _step_bound(t: int, lr: float = bench.LR, b1: float = 0.9, b2: float = 0.999) -> float:
    """fp32 AdamW's largest possible |dp| at step t (weight decay 0)."""
    return lr * math.sqrt(_moment_bound(b1, b2, t)) * math.sqrt(1 - b2**t) / (1 - b1**t)


def test_sparse_gradients_are_reproducible_and_as_sparse_as_described() -> None:
    grads = bench.SparseGradients(64, 1024, steps=60, seed=3)
    first, second = list(grads), list(grads)
    assert len(first) == 60 and all(torch.equal(a, b) for a, b in zip(first, second))
    nonzero = torch.stack([g != 0 for g in first])  # (steps, rows, cols)
    active = nonzero.any(dim=1)  # a column (input feature) is active or not, as a whole
    assert torch.equal(nonzero, active.unsqueeze(1).expand_as(nonzero))
    assert 0.015 <= active.float().mean().item() <= 0.025  # 2 % of the features per step
    assert torch.equal(grads.p0, bench.SparseGradients(64, 1024, steps=60, seed=3).p0)


@pytest.fixture(scope="module")
def sparse_run():
    grads = bench.SparseGradients(*SHAPE, seed=0)
    return grads, bench.fp32_reference(grads.p0, grads)


@low_bit
def test_every_step_within_fp32_worst_case_on_sparse_gradients(cls: type) -> None:
    # The second-moment floor: whatever the first moment's rounding, no step of any element is
    # larger than fp32 AdamW's own largest possible step (the floor's 1e-3 slack).
    grads = bench.SparseGradients(*SHAPE, steps=150, seed=1, spike_prob=0.01, spike_factor=30.0)
    p = torch.nn.Parameter(grads.p0.clone())
    opt = cls([p], lr=bench.LR, weight_decay=0.0)
    for t, g in enumerate(grads, start=1):
        before = p.detach().clone()
        p.grad = g
        opt.step()
        assert (p.detach() - before).abs().max().item() <= _step_bound(t) * (1 + 1e-3), t


@pytest.mark.slow
def test_4bit_sparse_drift_no_worse_than_torchao(sparse_run) -> None:
    factory = bench.torchao_factories().get("torchao AdamW4bit")
    if factory is None:
        pytest.skip("torchao is not installed")
    grads, ref = sparse_run
    with bench.eager_torch_compile():  # same maths, without a minute of compiling on CPU
        peer = bench.sparse_distance(bench.run(factory, grads.p0, grads)[0], ref)
    ours = bench.sparse_distance(bench.run(lambda ps: leanopt.AdamW4bit(ps, lr=bench.LR, weight_decay=0.0), grads.p0, grads)[0], ref)
    # mean distance and elements further than 0.01 (10 lr); the max is a single element's and
    # is reported by the benchmark, not asserted.
    assert ours[0] <= peer[0] and ours[1] <= peer[1], (ours, peer)


def test_8bit_sparse_drift_has_no_far_elements(sparse_run) -> None:
    # Measured at this size, seed 0: 0 elements further than 0.01 from fp32 AdamW (max 0.009;
    # bitsandbytes 8-bit on the table's 256x1024: 35-51 per seed).
    grads, ref = sparse_run
    ours = bench.sparse_distance(bench.run(lambda ps: leanopt.AdamW8bit(ps, lr=bench.LR, weight_decay=0.0), grads.p0, grads)[0], ref)
    assert ours[1] == 0 and ours[2] <= 0.012, ours
