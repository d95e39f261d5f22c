"""The low-bit optimizers' safe mode on every backend: NaN and overflowing gradient elements
are skipped without touching their neighbours, and fp64 params use the fp64 threshold.

(Every backend's parity with the reference, for every registered optimizer, is
``tests/test_rules.py::test_backend_matches_reference``.)
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import leanopt
from leanopt.quant import QuantizedState
from registry import OPTIMIZERS

SHAPES = [(1,), (0,), (5,), (300,), (2049,), (4097,), (33, 65), (3, 0)]
LR = 1e-2
BACKENDS = ["cpu"] + (["triton"] if importlib.util.find_spec("triton") else [])
# Every registered low-bit optimizer (tests/registry.py).
# Elementwise rules on quantized storage (Muon8bit's direction is orthogonalized whole: its
# skipped elements do not keep their params; tests/test_muon_lowbit.py).
LOW_BIT = [c.cls for c in OPTIMIZERS if hasattr(c.cls, "state_bits") and issubclass(c.cls, leanopt.ElementwiseOptimizer)]
# What each needs besides its defaults to keep a state (tests/registry.py: SGD8bit's momentum).
STATEFUL = {c.cls: c.state_kwargs for c in OPTIMIZERS}
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


# ---- gradients whose square overflows -----------------------------------------------------------
# In the compute dtype (fp32 here) g * g overflows from |g| = 2^64 ~ 1.8447e19 (sqrt(finfo.max)):
# such an element is skipped exactly as a NaN one, although (1 - b2) * g * g alone would not
# overflow below ~5.8e20. Positions: one per block for both block sizes (256 and 128); 1.85e19
# rounds to 2^64 in bf16, 1.84e19 to 2^64 - 2^56.
HUGE = {300: 3e19, 1000: 5e19, 2100: 1e20, 3500: -3e19, 3900: 1.85e19}
HUGE_SMALL = {10: 3e19, 50: 5e19, 100: 1e20, 150: -3e19, 250: 1.85e19}
BELOW = {3000: 1e19, 3700: 1.84e19}  # squares stay finite: a normal update
BELOW_SMALL = {200: 1e19, 280: -1.84e19}


def _run_with_big_gradients(cls, backend: str, dtype: torch.dtype, replace_with_nan: bool):
    gen = torch.Generator().manual_seed(1)
    big = torch.randn(4096, generator=gen).to(dtype).requires_grad_()  # quantized (min_quant_size 4096)
    small = torch.randn(300, generator=gen).to(dtype).requires_grad_()  # fp32 states
    opt = cls([big, small], lr=1e-2, weight_decay=0.1, backend=backend, **STATEFUL[cls])
    history = []
    for step in range(5):
        for p, huge, below in ((big, HUGE, BELOW), (small, HUGE_SMALL, BELOW_SMALL)):
            g = torch.randn(p.shape, generator=gen)
            if step == 3:
                for i, x in huge.items():
                    g[i] = float("nan") if replace_with_nan else x
                for i, x in below.items():
                    g[i] = x
            p.grad = g.to(dtype)
        before = [big.detach().clone(), small.detach().clone()]
        opt.step()
        history.append((before, [big.detach().clone(), small.detach().clone()], _snapshot(opt, (big, small))))
    return big, small, opt, history


def _snapshot(opt, params) -> list[torch.Tensor]:
    """Copies of every state tensor of ``params``: codes and scales, or the dense moments."""
    out = []
    for p in params:
        for key in opt.state_keys(opt.param_groups[0]):
            st = opt.state[p][key]
            out += [st.codes.clone(), st.absmax.clone()] if isinstance(st, QuantizedState) else [st.clone()]
    return out


def _states_equal(a, b) -> bool:
    if isinstance(a, QuantizedState):
        return torch.equal(a.codes, b.codes) and torch.equal(a.absmax, b.absmax)
    return torch.equal(a, b)


# Every rule, fp32 and bf16 params, on the reference and the CPU backends; Triton (interpreted:
# ~1.6 s a case) takes bf16 params for the family's representative only: g*g overflows in the
# rule's fp32 maths whatever the param's dtype, whose conversion on load and store is the
# kernel's plumbing around the rule.
REPRESENTATIVE = next(c.cls for c in OPTIMIZERS if c.cls in LOW_BIT and c.represents)
OVERFLOW_CASES = [
    pytest.param(cls, backend, dtype, id=f"{dtype}-{backend}-{cls.__name__}")
    for dtype in (torch.float32, torch.bfloat16) for backend in ["reference", *BACKENDS] for cls in LOW_BIT
    if not (backend == "triton" and dtype == torch.bfloat16 and cls is not REPRESENTATIVE)
]  # fmt: skip


@pytest.mark.parametrize("cls,backend,dtype", OVERFLOW_CASES)
def test_gradient_whose_square_overflows_is_skipped_like_nan(cls, backend: str, dtype: torch.dtype) -> None:
    huge_big, huge_small, huge_opt, history = _run_with_big_gradients(cls, backend, dtype, replace_with_nan=False)
    nan_big, nan_small, nan_opt, nan_history = _run_with_big_gradients(cls, backend, dtype, replace_with_nan=True)
    first = huge_opt.state_keys(huge_opt.param_groups[0])[0]
    assert isinstance(huge_opt.state[huge_big][first], QuantizedState)
    assert isinstance(huge_opt.state[huge_small][first], torch.Tensor)
    # Bit for bit the run in which those elements were NaN: params, codes, block scales and
    # dense states, right after that step and after one more ordinary step.
    for ours, twin in zip(history[3][1] + history[3][2], nan_history[3][1] + nan_history[3][2]):
        assert torch.equal(ours, twin)
    for ours, twin in ((huge_big, nan_big), (huge_small, nan_small)):
        assert torch.equal(ours, twin)
        for key in huge_opt.state_keys(huge_opt.param_groups[0]):
            assert _states_equal(huge_opt.state[ours][key], nan_opt.state[twin][key]), key
    # The skipped elements kept their param on that step; those just below the threshold moved.
    before, after, _ = history[3]
    for k, (huge, below) in enumerate(((HUGE, BELOW), (HUGE_SMALL, BELOW_SMALL))):
        for i in huge:
            assert after[k][i] == before[k][i], (k, i)
        for i in below:
            assert after[k][i] != before[k][i], (k, i)


@pytest.mark.parametrize("cls", LOW_BIT, ids=lambda c: c.__name__)
@pytest.mark.parametrize("backend", ["reference"] + BACKENDS)
def test_overflowing_gradient_resets_moments_on_that_step(cls, backend: str) -> None:
    gen = torch.Generator().manual_seed(2)
    big = torch.randn(4096, generator=gen).requires_grad_()
    small = torch.randn(300, generator=gen).requires_grad_()
    opt = cls([big, small], lr=1e-2, backend=backend, **STATEFUL[cls])
    for step in range(3):
        big.grad = torch.randn(4096, generator=gen)
        small.grad = torch.randn(300, generator=gen)
        if step == 2:
            for i, x in HUGE.items():
                big.grad[i] = x
            for i, x in HUGE_SMALL.items():
                small.grad[i] = x
        opt.step()
    for key in opt.state_keys(opt.param_groups[0]):
        q = opt.state[big][key]
        codes = q.format._unpack(q.codes, q.numel)
        for i in HUGE:
            assert codes[i] == q.format.book("cpu").zero_index, key  # the code nearest 0
        for i in HUGE_SMALL:
            assert opt.state[small][key][i] == 0, key
        # The scales of the blocks holding them are set by the ordinary gradients around them.
        assert q.absmax.max() < 10, key


def test_fp64_params_skip_above_the_fp64_threshold() -> None:
    # fp64 params compute in fp64: 3e19 squares to a finite value there, 1e155 does not.
    def run(bad: float) -> tuple[tuple[torch.Tensor, torch.Tensor], leanopt.AdamW8bit]:
        gen = torch.Generator().manual_seed(3)
        big = torch.randn(4096, generator=gen, dtype=torch.float64).requires_grad_()
        small = torch.randn(300, generator=gen, dtype=torch.float64).requires_grad_()
        opt = leanopt.AdamW8bit([big, small], lr=1e-2, backend="reference")
        for step in range(3):
            for p in (big, small):
                p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)
                if step == 2:
                    p.grad[7] = bad
                    p.grad[8] = 3e19
            opt.step()
        return (big, small), opt

    huge, huge_opt = run(1e155)
    nan, nan_opt = run(float("nan"))
    for ours, twin in zip(huge, nan):
        assert torch.equal(ours, twin)
        for key in ("exp_avg", "exp_avg_sq"):
            assert _states_equal(huge_opt.state[ours][key], nan_opt.state[twin][key]), key
        m = huge_opt.state[ours]["exp_avg"]
        m = m.dequantize() if isinstance(m, QuantizedState) else m
        assert m[8] != 0 and m[7] == 0  # 3e19 kept, 1e155 skipped
