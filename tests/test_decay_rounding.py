"""The decay rounding of a quantized first moment where the gradient is exactly 0.

What it promises (``leanopt.quant.formats.BlockFormat.code_indices``): the dither is a fixed
32-bit hash of (global index, step), the same bits on every backend and however a tensor is
split; the stored value is the fp32 decay in expectation; it never stores a larger magnitude
across a gap of more than ``DECAY_GROWTH_RATIO`` between codes, and never leaves 0; and every
backend stores the same codes as the reference. Tolerances: the hash is compared bit for bit;
the expectation within 4 standard errors of the sample mean; backend codes equal on >= 99.9 %
(a value within an ulp of a dither threshold may go the other way: the backends compute the
same expressions in another floating-point order).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import leanopt
from leanopt.kernels import reference, rules
from leanopt.quant.formats import DECAY_GROWTH_RATIO, BlockFormat, Decay, dither

BACKENDS = ["cpu"] + (["triton"] if importlib.util.find_spec("triton") else [])
DECAYING = [leanopt.AdamW8bit, leanopt.AdamW4bit, leanopt.AdEMAMix8bit]


def _plain_hash(index: int, step: int) -> float:
    # The documented hash, in Python integers.
    m = 0xFFFFFFFF
    h = (index & m) ^ (((index >> 32) * 0x9E3779B9) & m)
    h = (h * 0x9E3779B1 + step * 0x85EBCA77) & m
    h ^= h >> 16
    h = (h * 0x7FEB352D) & m
    h ^= h >> 15
    h = (h * 0x846CA68B) & m
    h ^= h >> 16
    return (h >> 8) / 2**24


def _indices() -> torch.Tensor:
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    small = torch.arange(64)
    large = torch.randint(0, 2**40, (64,), generator=gen)  # past 2^32: the high word counts
    return torch.cat([small, large, torch.tensor([2**32 - 1, 2**32, 2**33 + 5])])


def test_dither_is_the_documented_hash() -> None:
    index = _indices()
    for step in (1, 2, 1000, 2**31 - 1):
        got = dither(index, step)
        want = torch.tensor([_plain_hash(int(i), step) for i in index], dtype=torch.float32)
        assert torch.equal(got, want), step


def test_dither_is_uniform_and_changes_with_step() -> None:
    u1, u2 = dither(torch.arange(200_000), 1), dither(torch.arange(200_000), 2)
    counts = torch.histc(u1, bins=10, min=0, max=1)
    # 20,000 expected per bin; a binomial's standard deviation is ~134.
    assert (counts - 20_000).abs().max() <= 700, counts
    assert (u1 == u2).float().mean() < 0.01
    assert 0 <= u1.min() and u1.max() < 1


if importlib.util.find_spec("triton") is not None:
    import triton
    import triton.language as tl

    from leanopt.kernels.triton_elementwise import _dither

    @triton.jit
    def _dither_kernel(index_ptr, step_ptr, out_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(out_ptr + offs, _dither(tl.load(index_ptr + offs), tl.load(step_ptr)))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_dither_has_the_same_bits() -> None:
    index = _indices()
    n = triton.next_power_of_2(index.numel())
    padded = torch.cat([index, torch.zeros(n - index.numel(), dtype=torch.int64)])
    for step in (1, 7, 2**31 - 1):
        out = torch.empty(n, dtype=torch.float32)
        _dither_kernel[(1,)](padded, torch.tensor([step]), out, N=n)
        assert torch.equal(out[: index.numel()], dither(index, step)), step


def _decayed_codes(fmt: BlockFormat, y: float, prev: float, n: int, step: int = 1) -> torch.Tensor:
    # n elements scaled to y in blocks whose scale is 1 (an element at 1.0 leads each block),
    # all decaying; returns the stored values of the others.
    bs = fmt.block_size
    x = torch.full((n // (bs - 1) * bs,), y).view(-1, bs)
    x[:, 0] = 1.0
    previous = torch.full_like(x, prev)
    previous[:, 0] = 1.0
    state = fmt.zeros(tuple(x.shape), "cpu")
    state.quantize_(x, decay=Decay(torch.ones_like(x, dtype=torch.bool), previous, step))
    return state.dequantize()[:, 1:].reshape(-1)


@pytest.mark.parametrize("code", ["pow3-s8", "pow2-s4"])
def test_stored_momentum_is_the_decay_in_expectation(code: str) -> None:
    fmt = BlockFormat(code, 128)
    values = fmt.book("cpu").values.unique()
    # A value between two codes near the top (their ratio < 2): nearest rounding would stay on
    # the upper code (the momentum held it), so the dither decides.
    hi = values[-2].item()
    lo = values[-3].item()
    assert hi < lo * DECAY_GROWTH_RATIO
    y = lo + 0.7 * (hi - lo)
    got = _decayed_codes(fmt, y, prev=hi, n=127 * 400)
    assert set(got.unique().tolist()) <= {lo, hi}
    standard_error = (hi - lo) * 0.5 / got.numel() ** 0.5
    assert abs(got.mean().item() - y) <= 4 * standard_error, (got.mean().item(), y)
    # A negative momentum: the mirror image.
    neg = -_decayed_codes(fmt, -y, prev=-hi, n=127 * 400)
    assert abs(neg.mean().item() - y) <= 4 * standard_error


@pytest.mark.parametrize("code", ["pow3-s8", "pow2-s4"])
def test_no_growth_across_a_coarse_gap_and_zero_is_kept(code: str) -> None:
    fmt = BlockFormat(code, 128)
    values = fmt.book("cpu").values.unique()
    positive = values[values > 0]
    smallest, second = positive[0].item(), positive[1].item()
    assert second > smallest * DECAY_GROWTH_RATIO  # the bottom of the code is coarse
    # The block scale rose: the element held `smallest` and its new scaled value lies just
    # below `second`. Nearest rounding would grow it; the dither may not cross the gap upward.
    got = _decayed_codes(fmt, 0.9 * second, prev=smallest, n=127 * 50)
    assert got.max().item() <= smallest
    # Held 0, still 0 (0 is a code: y is exactly 0 where the momentum was 0).
    assert torch.equal(_decayed_codes(fmt, 0.0, prev=0.0, n=127 * 10), torch.zeros(127 * 10))


def test_split_tensor_stores_the_same_codes_as_whole() -> None:
    # A shard (or the CPU path's tail) passes the global index of its element 0: the dither and
    # so the codes are those of the whole tensor, split on a block boundary.
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    hp = rules.ADAMW.hyperparameters({"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                                      "amsgrad": False, "maximize": False})  # fmt: skip
    fmt_m, fmt_v = BlockFormat("pow2-s4", 128), BlockFormat("pow3-u4", 128)
    n, cut = 1024, 384
    p_whole = torch.randn(n, generator=gen)
    p_split = p_whole.clone()
    whole = [fmt_m.zeros((n,), "cpu"), fmt_v.zeros((n,), "cpu")]
    pieces = [[fmt_m.zeros((cut,), "cpu"), fmt_v.zeros((cut,), "cpu")],
              [fmt_m.zeros((n - cut,), "cpu"), fmt_v.zeros((n - cut,), "cpu")]]  # fmt: skip
    for step in range(1, 9):
        # Then sparse: most elements only decay while a few keep their blocks' scales up.
        g = torch.randn(n, generator=gen) * ((step <= 2) | (torch.rand(n, generator=gen) < 0.05))
        reference.rule_step_(rules.ADAMW, p_whole, g, whole, step, hp, safe=True)
        reference.rule_step_(rules.ADAMW, p_split[:cut], g[:cut], pieces[0], step, hp, safe=True)
        reference.rule_step_(rules.ADAMW, p_split[cut:], g[cut:], pieces[1], step, hp, safe=True, offset=cut)
    assert torch.equal(p_whole, p_split)
    for k in range(2):
        assert torch.equal(whole[k].codes, torch.cat([pieces[0][k].codes, pieces[1][k].codes]))
    # Without the offset the second piece's dither repeats the first's: other codes.
    other = [fmt_m.zeros((n - cut,), "cpu"), fmt_v.zeros((n - cut,), "cpu")]
    p_other = p_whole.clone()[cut:]
    gen2 = torch.Generator().manual_seed(0)
    for step in range(1, 9):
        g = torch.randn(n - cut, generator=gen2) * ((step <= 2) | (torch.rand(n - cut, generator=gen2) < 0.05))
        reference.rule_step_(rules.ADAMW, p_other, g, other, step, hp, safe=True)
    with_offset = [fmt_m.zeros((n - cut,), "cpu"), fmt_v.zeros((n - cut,), "cpu")]
    p_with = p_whole.clone()[cut:]
    gen2 = torch.Generator().manual_seed(0)
    for step in range(1, 9):
        g = torch.randn(n - cut, generator=gen2) * ((step <= 2) | (torch.rand(n - cut, generator=gen2) < 0.05))
        reference.rule_step_(rules.ADAMW, p_with, g, with_offset, step, hp, safe=True, offset=cut)
    assert not torch.equal(other[0].codes, with_offset[0].codes)


def _stopped_gradients(cls: type, backend: str, seed: int, switch_at: int):
    # Three tensors (one with a partial last block), 3 steps of gradients, then 5 sparse ones:
    # most of the first moment only decays while a few elements keep their blocks' scales up.
    # Reference until switch_at, then `backend`.
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen).requires_grad_() for s in [(4096,), (33, 65), (2049,)]]
    grads = [[torch.randn(p.shape, generator=gen) * ((t < 3) | (torch.rand(p.shape, generator=gen) < 0.05))
              for p in params] for t in range(8)]  # fmt: skip
    opt = cls(params, lr=1e-2, min_quant_size=100, backend="reference")
    for t in range(8):
        if t == switch_at:
            opt.backend = backend
        for p, g in zip(params, grads[t]):
            p.grad = g.clone()
        opt.step()
    return params, opt


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", DECAYING, ids=lambda c: c.__name__)
def test_backends_store_the_reference_codes_where_momentum_decays(cls: type, backend: str) -> None:
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    for switch_at in (3, 7):  # the first decaying step, and a later one
        ours, opt = _stopped_gradients(cls, backend, seed, switch_at)
        ref, ref_opt = _stopped_gradients(cls, "reference", seed, 8)
        key = opt.rule.states(opt.rule.hyperparameters(opt.param_groups[0]))[0].key
        for p, r in zip(ours, ref):
            got, want = opt.state[p][key], ref_opt.state[r][key]
            same = (got.codes == want.codes).float().mean().item()
            assert same >= 0.999, f"seed {seed}, switch at {switch_at}: {same}"
            assert torch.allclose(p, r, rtol=0, atol=1e-6), f"seed {seed}"


def _moved_ratio(cls: type, backend: str, lead_g: float, burst_scale: float, warm: int, seed: int) -> float:
    # Each block's first element gets the gradient lead_g every step (it holds its block's
    # scale); after `warm` steps every other element gets one gradient, burst_scale * randn,
    # then 30 steps of 0. How far those elements move in the 30 steps, over fp32 AdamW's.
    gen = torch.Generator().manual_seed(seed)
    n, bs = 128 * 256, 128
    burst = torch.randn(n, generator=gen) * burst_scale
    lead = torch.arange(n) % bs == 0
    moved = []
    for make, kwargs in ((leanopt.AdamW, {}), (cls, {"min_quant_size": 1, "backend": backend})):
        w = torch.nn.Parameter(torch.zeros(n))
        opt = make([w], lr=1e-3, weight_decay=0.0, **kwargs)
        for t in range(warm + 31):
            w.grad = torch.where(lead, lead_g, burst if t == warm else 0.0)
            opt.step()
            if t == warm:
                start = w.detach().clone()
        moved.append((w.detach() - start)[~lead].abs().mean().item())
    return moved[1] / moved[0]


# (optimizer, lead gradient, burst scale, warm-up steps, lowest ratio allowed). Measured with
# the reference (the CPU and Triton paths give the same ratios to 3 digits), rounding toward
# zero before the decay rounding in brackets: AdamW8bit 0.97 [0.74] and 0.95 [0.71], seeds 0-3;
# AdamW4bit 0.54-0.60 [0.16-0.17], seeds 0-7, and 0.43-0.70 (median 0.57, 1 % below 0.47)
# over 231 seeds: its floor of 0.5 failed on about one seed in twenty (CI draws a fresh seed
# per run), so it is 0.35, still twice the old rounding's. A 4-bit momentum that lands at the bottom of its
# code (below ~8 % of its block's scale, where codes are 4x apart) still dies early: 0.12 with
# lead 1, burst 1 (0.11 before). Triton's parity on this is the codes test above (the
# interpreter takes 35 s here).
MOVING = [
    (leanopt.AdamW8bit, 1.0, 0.3, 0, 0.9),
    (leanopt.AdamW8bit, 1.0, 1.0, 50, 0.9),
    (leanopt.AdamW4bit, 0.1, 0.3, 50, 0.35),
]


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("case", MOVING, ids=lambda c: f"{c[0].__name__}-lead{c[1]}-burst{c[2]}-warm{c[3]}")
def test_decaying_momentum_keeps_moving_the_weight_like_fp32(case: tuple, backend: str) -> None:
    # After one gradient, fp32 AdamW's momentum decays by b1 per step and keeps moving the
    # weight; in a block whose scale another element holds up, rounding toward zero made a
    # quantized momentum die within a few steps.
    cls, lead_g, burst_scale, warm, lowest = case
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    ratio = _moved_ratio(cls, backend, lead_g, burst_scale, warm, seed)
    assert lowest <= ratio <= 1.1, f"seed {seed}: {ratio}"
