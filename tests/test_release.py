"""leanopt.release_gradients: every optimizer steps inside backward, bit-identical to the usual loop."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import leanopt
from registry import OPTIMIZERS, OptimizerCase

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except Exception:
    HAS_TRITON = False


def backends(case: OptimizerCase) -> list[str]:
    return [b for b in case.backends if b != "triton" or HAS_TRITON]


CASE_BACKENDS = [pytest.param(c, b, id=f"{c.name}-{b}") for c in OPTIMIZERS for b in backends(c)]


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    # 16 x 256 = 4096 elements: the low-bit optimizers quantize the first weight.
    return torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.Tanh(), torch.nn.Linear(256, 4))


def loss_of(m: torch.nn.Module, step: int) -> torch.Tensor:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
    return m(x).square().mean()


@pytest.mark.parametrize("case,backend", CASE_BACKENDS)
def test_released_training_is_bit_identical_to_the_usual_loop(case: OptimizerCase, backend: str) -> None:
    steps = 20 if backend != "triton" else 6  # the interpreter is slow
    ours, usual = model(), model()
    opt = case.cls(ours.parameters(), backend=backend, **case.kwargs)
    usual_opt = case.cls(usual.parameters(), backend=backend, **case.kwargs)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5) if case.lr_key else None
    usual_sched = torch.optim.lr_scheduler.StepLR(usual_opt, step_size=3, gamma=0.5) if case.lr_key else None
    handle = leanopt.release_gradients(ours, opt)
    for step in range(steps):
        # The existing loop, unchanged: zero_grad and step are no-ops while released.
        opt.zero_grad()
        loss_of(ours, step).backward()
        assert all(p.grad is None for p in ours.parameters()), "released gradients are freed in backward"
        opt.step()
        usual_opt.zero_grad()
        loss_of(usual, step).backward()
        usual_opt.step()
        for s in (sched, usual_sched):
            if s is not None:
                s.step()
        for a, b in zip(ours.parameters(), usual.parameters()):
            assert torch.equal(a, b), f"step {step}"
    for a, b in zip(ours.parameters(), usual.parameters()):
        for key, value in usual_opt.state[b].items():
            got = opt.state[a][key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(got, value), key
            else:  # QuantizedState
                assert torch.equal(got.codes, value.codes) and torch.equal(got.absmax, value.absmax), key
    handle.remove()
    loss_of(ours, 99).backward()
    assert all(p.grad is not None for p in ours.parameters()), "remove() restores the usual loop"


@pytest.mark.parametrize("case", OPTIMIZERS, ids=str)
def test_gradient_accumulation_is_refused(case: OptimizerCase) -> None:
    m = model()
    opt = case.cls(m.parameters(), **case.kwargs)
    with leanopt.release_gradients(m, opt):
        opt.zero_grad()
        loss_of(m, 0).backward()
        before = [p.detach().clone() for p in m.parameters()]
        with pytest.raises(RuntimeError, match="second gradient before optimizer.step"):
            loss_of(m, 1).backward()  # a second micro-batch before step(): accumulation
        # The error came before any param was stepped twice.
        assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
        opt.step()
        loss_of(m, 2).backward()  # after step(), the next backward is the next step


def test_a_loop_without_step_calls_takes_one_step_per_backward() -> None:
    m = model()
    opt = leanopt.AdamW(m.parameters())
    leanopt.release_gradients(m, opt)
    for step in range(3):
        loss_of(m, step).backward()
    assert {int(st["step"]) for st in opt.state.values()} == {3}


def test_refusals_are_value_errors() -> None:
    m = model()
    with pytest.raises(ValueError, match="leanopt optimizer"):
        leanopt.release_gradients(m, torch.optim.AdamW(m.parameters()))
    opt = leanopt.AdamW(m.parameters())
    handle = leanopt.release_gradients(m, opt)
    with pytest.raises(ValueError, match="already released"):
        leanopt.release_gradients(m, opt)
    handle.remove()
    leanopt.release_gradients(m, opt).remove()  # released again after remove()


_PEAK = textwrap.dedent(
    """
    import sys, torch, leanopt
    torch.manual_seed(0)
    layers = [torch.nn.Linear(1024, 1024) for _ in range(12)]
    model = torch.nn.Sequential(*layers)
    opt = leanopt.AdamW(model.parameters())
    if sys.argv[1] == "release":
        leanopt.release_gradients(model, opt)
    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    x = torch.randn(4, 1024)
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        if step == 2:
            base = rss("VmRSS:")
            open("/proc/self/clear_refs", "w").write("5")  # peak RSS := current RSS
        model(x).square().mean().backward()
        opt.step()
    print(rss("VmHWM:") - base)
    """
)


def test_peak_memory_drops_by_most_of_the_gradient_bytes() -> None:
    # The step's peak over the memory before it (weights and state live; no gradients), in a
    # fresh process whose large blocks are returned to the system when freed.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    grad_bytes = 12 * (1024 * 1024 + 1024) * 4
    peaks = {}
    for mode in ("usual", "release"):
        out = subprocess.run([sys.executable, "-c", _PEAK, mode], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        peaks[mode] = int(out.stdout.split()[-1])
    drop = peaks["usual"] - peaks["release"]
    assert drop >= 0.8 * grad_bytes, (peaks, grad_bytes)
    print(f"step peak over weights+state: usual {peaks['usual'] / 2**20:.1f} MiB, released "
          f"{peaks['release'] / 2**20:.1f} MiB; gradients {grad_bytes / 2**20:.1f} MiB, drop {drop / grad_bytes:.0%}")
