"""AdamW8bit / AdamW4bit: every backend against the reference rule, on fresh random inputs.

The fused paths (compiled CPU graph, Triton kernel under the interpreter) dequantize, update
and requantize as ``reference.adamw_quantized_`` does, but not in the same floating-point
operation order (fused multiply-adds, a reciprocal instead of a division), so a value within
an ulp of the boundary between two codes may take the other code. To compare one update and
not the divergence that follows such a flip, both runs take 5 identical reference steps and
then one step with the backend under test, with one NaN gradient element per tensor and
gradients whose scales span 1e-4..1 inside each block, 30% of them exactly 0. Criteria:

* params: >= 99% of elements within the dense tolerance of the param dtype (fp32: 2e-6 of
  the largest |param| + 1e-7; bf16/fp16: one unit in the last place), every element within
  lr / 10 (a flipped code changes the step by a fraction of lr);
* codes equal on >= 99% of elements, block scales within 1e-5 relative;
* the NaN element's param is unchanged on that step and its moments are reset (test below).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import leanopt
from leanopt.quant import QuantizedState

SHAPES = [(1,), (0,), (5,), (300,), (2049,), (4097,), (33, 65), (3, 0)]
LR = 1e-2
BACKENDS = ["cpu"] + (["triton"] if importlib.util.find_spec("triton") else [])
CASES = [
    # (dtype, kwargs): kept few, each cpu case compiles a graph once
    (torch.float32, {}),
    (torch.bfloat16, {}),
    (torch.float16, {"weight_decay": 0.0}),
    (torch.float32, {"maximize": True, "weight_decay": 0.1}),
]


def ulp(x: torch.Tensor) -> torch.Tensor:
    mant = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[x.dtype]
    mag = x.detach().float().abs().clamp_min(torch.finfo(x.dtype).tiny)
    return torch.exp2(torch.floor(torch.log2(mag)) - mant)


def run(cls, backend: str, dtype: torch.dtype, seed: int, kwargs: dict, steps: int = 6):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in SHAPES]
    def grad(shape: tuple[int, ...]) -> torch.Tensor:
        scale = 10.0 ** torch.randint(-4, 1, shape, generator=gen).float()  # 1e-4..1 in a block
        keep = torch.rand(shape, generator=gen) > 0.3  # and exact zeros (momentum rounds toward 0)
        return (torch.randn(shape, generator=gen) * scale * keep).to(dtype)

    grads = [[grad(s) for s in SHAPES] for _ in range(steps)]
    for g in grads[-1]:
        if g.numel() > 1:
            g.view(-1)[1] = float("nan")
    # min_quant_size=100 so that small shapes exercise the quantized path, with a dense tail
    opt = cls(params, lr=LR, min_quant_size=100, backend="reference", **kwargs)
    for step in range(steps):
        if step == steps - 1:
            opt.backend = backend  # only the last update differs between the compared runs
        for i, p in enumerate(params):
            p.grad = None if (step + i) % 5 == 4 else grads[step][i].clone()
        opt.step()
    return params, opt


@pytest.mark.parametrize("cls", [leanopt.AdamW8bit, leanopt.AdamW4bit], ids=lambda c: c.__name__)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,kwargs", CASES, ids=lambda v: str(v))
def test_quantized_backend_matches_reference(cls, backend: str, dtype: torch.dtype, kwargs: dict) -> None:
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    ours, opt = run(cls, backend, dtype, seed, kwargs)
    ref, ref_opt = run(cls, "reference", dtype, seed, kwargs)
    quantized_seen = 0
    for p, r in zip(ours, ref):
        if p.numel() == 0:
            continue
        diff = (p.float() - r.float()).abs()
        if dtype == torch.float32:
            close = diff <= 2e-6 * r.abs().max() + 1e-7
        else:
            close = diff <= ulp(r) * 1.001
        assert close.float().mean() >= 0.99, f"seed {seed}: {close.float().mean()}"
        assert diff.max() <= LR / 10, f"seed {seed}: {diff.max()}"
        for key in ("exp_avg", "exp_avg_sq"):
            got, want = opt.state[p][key], ref_opt.state[r][key]
            assert type(got) is type(want)
            if isinstance(want, QuantizedState):
                quantized_seen += 1
                assert got.format == want.format and got.shape == want.shape
                same = (got.codes == want.codes).float().mean()
                assert same >= 0.99, f"{key} codes, seed {seed}: {same}"
                assert torch.allclose(got.absmax, want.absmax, rtol=1e-5, atol=0), f"{key} scales, seed {seed}"
            else:
                assert torch.allclose(got, want, rtol=1e-4, atol=1e-10), f"{key}, seed {seed}"
    assert quantized_seen >= 8


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_gradient_element_is_skipped_in_fused_paths(backend: str) -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(1024))
    opt = leanopt.AdamW8bit([w], lr=1e-2, min_quant_size=1, backend=backend)
    w.grad = torch.randn(1024)
    opt.step()
    before = w.detach().clone()
    g = torch.randn(1024)
    g[7] = float("nan")
    g[300] = float("inf")
    w.grad = g
    opt.step()
    assert w[7] == before[7] and w[300] == before[300]
    assert torch.isfinite(w).all()
    m = opt.state[w]["exp_avg"].dequantize()
    assert m[7] == 0 and m[300] == 0 and torch.isfinite(m).all()
    assert torch.isfinite(opt.state[w]["exp_avg"].absmax).all()
