"""Every AdamW backend against the reference rule, on fresh random inputs.

Triton kernels run on the CPU through Triton's interpreter (conftest sets TRITON_INTERPRET=1),
so shapes stay small. Tolerances: fp32 params and states within 2e-6 relative of the
reference's largest value plus 1e-7 absolute (the kernels evaluate the same expressions with fused multiply-adds
and a different operation order); bf16/fp16 params within two units in the last place of the
param dtype after the six steps, and equal on at least 99% of elements. (One ulp per rounding: a
param rounded the other way at one step is updated from a different value at the next, so two
roundings can add up; seed 1260788837 gave one fp16 element of 2145 off by two ulps, triton, amsgrad.
The ulp is the one of the largest magnitude the param can have had in those steps, |r| + 6 lr:
seed 858276720 (cpu, maximize, weight decay) left an fp16 element at -0.00765 off by 1.5e-5, four
ulps there and one ulp of the 0.06 it may have passed through.)
"""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch

import leanopt

SHAPES = [(1,), (0,), (7,), (2049,), (4097,), (33, 65), (3, 5, 7), (0, 4)]
BACKENDS = ["cpu"] + (["triton"] if importlib.util.find_spec("triton") else [])
LR = 1e-2
FLAGS = [dict(amsgrad=a, maximize=m, weight_decay=w) for a, m, w in itertools.product([False, True], [False, True], [0.0, 0.1])]


def run(backend: str, dtype: torch.dtype, seed: int, flags: dict, steps: int = 6):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in SHAPES]
    grads = [[torch.randn(s, generator=gen).to(dtype) for s in SHAPES] for _ in range(steps)]
    opt = leanopt.AdamW(params, lr=LR, backend=backend, **flags)
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = None if (step + i) % 5 == 4 else grads[step][i].clone()
        opt.step()
    return params, opt


def ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of the param dtype at each element of ``x``."""
    finfo = torch.finfo(x.dtype)
    mag = x.detach().float().abs().clamp_min(finfo.tiny)
    return torch.exp2(torch.floor(torch.log2(mag)) - (finfo.nmant if hasattr(finfo, "nmant") else _mantissa(x.dtype)))


def _mantissa(dtype: torch.dtype) -> int:
    return {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[dtype]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_adamw_backend_matches_reference(backend: str, dtype: torch.dtype, flags: dict) -> None:
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    ours, opt = run(backend, dtype, seed, flags)
    ref, ref_opt = run("reference", dtype, seed, flags)
    for p, r in zip(ours, ref):
        if p.numel() == 0:
            continue
        if dtype == torch.float32:
            assert (p - r).abs().max() <= 2e-6 * r.abs().max() + 1e-7, f"seed {seed}"
        else:
            diff = (p.float() - r.float()).abs()
            # A rounding the other way happened at some step, where the param may have been larger:
            # Adam moves it by at most about lr per step, so its spacing then is at most that of |r| + steps * lr.
            assert (diff <= 2 * ulp((r.detach().float().abs() + 6 * LR).to(dtype)) * 1.001).all(), f"seed {seed}: {diff.max()}"
            assert (diff == 0).float().mean() >= 0.99, f"seed {seed}"
        for key, value in ref_opt.state[r].items():
            got = opt.state[p][key]
            assert got.dtype == value.dtype and got.shape == value.shape
            if key == "step":
                assert torch.equal(got, value)
            else:
                assert (got - value).abs().max() <= 2e-6 * value.abs().max() + 1e-7, f"{key}, seed {seed}"


def test_unknown_backend_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="backend"):
        leanopt.AdamW([torch.nn.Parameter(torch.zeros(2))], backend="cuda-graphs")


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch) -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    w = torch.nn.Parameter(torch.zeros(2))
    w.grad = torch.ones(2)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        leanopt.AdamW([w], backend="triton").step()
