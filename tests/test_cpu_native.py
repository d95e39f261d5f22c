"""The native C++ kernel for quantized CPU states (kernels.cpu_native)
against the reference, ``reference.rule_step_``: same codes (>= 99.9 %), block scales within 2e-6
relative, params within 2e-6 of the reference's largest plus 1e-7 (tests/test_backends.py's
fp32 tolerance: torch's CPU ``sqrt`` goes through MKL's VML and is not correctly rounded -- it
is one ulp off on ~20 % of inputs here -- while the kernel's is, so an update may differ by an
ulp, which is a large relative error on a param that it nearly cancels), on fresh random inputs with 30 % exact-zero gradients (the decay
rounding), NaN/Inf gradients (safe-mode skips) and a partial last block (the caller's, by the
reference). Skipped where the extension cannot be built."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from leanopt.kernels import cpu_native, reference, twins
from leanopt.kernels.rules import ADAMW, ADEMAMIX, LION, RULES, SGD, rule_id
from leanopt.quant import BlockFormat
from leanopt.quant.codebooks import code_names
import repo_modules


@pytest.fixture(scope="module", autouse=True)
def _needs_extension() -> None:
    if not cpu_native.available():
        pytest.skip(f"native CPU kernel unavailable: {cpu_native.build_error()}")


# The code books per (rule, bits): the benchmark's, which are the optimizers' (AdamW8bit's
# pow3-s8 | pow6-u8, ...), plus a 4-bit AdEMAMix the kernel also takes.
_CODES = repo_modules.benchmark("cpu_native_speed").CODES
_RULES = {"adamw": ADAMW, "lion": LION, "ademamix": ADEMAMIX}


def _hp(name: str, maximize: bool, amsgrad: bool = False) -> dict:
    if name == "adamw":
        group = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, amsgrad=amsgrad, maximize=maximize)
    elif name == "lion":
        group = dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1, maximize=maximize)
    else:
        group = dict(lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, eps=1e-8, weight_decay=0.01, t_alpha=50,
                     t_beta3=50, maximize=maximize)  # fmt: skip
    return _RULES[name].hyperparameters(group)


def _grad(shape, gen: torch.Generator, scale: torch.Tensor, nonfinite: bool) -> torch.Tensor:
    g = torch.randn(shape, generator=gen) * scale
    g[torch.rand(shape, generator=gen) < 0.3] = 0.0
    if nonfinite:
        flat = g.view(-1)
        pick = torch.randint(0, flat.numel(), (12,), generator=gen)
        flat[pick[:8]] = float("nan")
        flat[pick[8:10]] = float("inf")
        flat[pick[10:]] = 3e19  # g * g overflows fp32
    return g


def _unpacked(q) -> torch.Tensor:
    return q.format._unpack(q.codes, q.numel).long()


def _compare(name: str, bits: int, *, maximize: bool = False, amsgrad: bool = False, steps: int = 6,
             shape=(61, 256 + 77), offset: int = 12345) -> None:  # fmt: skip
    rule, hp = _RULES[name], _hp(name, maximize, amsgrad)
    codes = _CODES[(name, bits)]
    if amsgrad:
        codes = codes + (codes[1],)
    bs = 256 if bits == 8 else 128
    gen = torch.Generator().manual_seed(zlib.crc32(repr((name, bits, maximize, amsgrad, shape)).encode()))
    n = math.prod(shape)
    # Per-element gradient scales over five decades, so blocks hold a mix of busy and quiet elements.
    scale = torch.exp(torch.randn(shape, generator=gen) * 2.0) * 1e-3
    param = torch.randn(shape, generator=gen)
    states = [BlockFormat(code, bs).zeros(shape, "cpu") for code in codes]
    for step in range(1, steps + 1):
        g = _grad(shape, gen, scale, nonfinite=step % 2 == 0)
        ours_p, ours_s = param.clone(), [q.clone() for q in states]
        reference.rule_step_(rule, param, g, states, step, hp, safe=True, offset=offset)
        assert cpu_native.takes(rule, ours_p, g, ours_s, hp)
        cpu_native.quantized(rule, [ours_p], [g], [ours_s], [step], hp, [offset])
        diff = (ours_p - param).abs().max().item()
        assert diff <= 2e-6 * param.abs().max().item() + 1e-7, f"step {step}: params {diff:.3g} apart"
        assert (ours_p == param).float().mean() >= 0.99, f"step {step}: params equal on < 99 %"
        for k, (q, r) in enumerate(zip(ours_s, states)):
            torch.testing.assert_close(q.absmax, r.absmax, rtol=2e-6, atol=0.0, msg=lambda m: f"state {k}: {m}")
            same = (_unpacked(q) == _unpacked(r)).float().mean().item()
            assert same >= 0.999, f"step {step}, state {k}: codes equal on {same:.5%}"
        assert n == param.numel()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("maximize", [False, True])
def test_adamw_matches_reference(bits: int, maximize: bool) -> None:
    _compare("adamw", bits, maximize=maximize)


@pytest.mark.parametrize("bits", [8, 4])
def test_adamw_amsgrad_matches_reference(bits: int) -> None:
    _compare("adamw", bits, amsgrad=True)


@pytest.mark.parametrize("bits", [8, 4])
def test_lion_matches_reference(bits: int) -> None:
    _compare("lion", bits)


@pytest.mark.parametrize("bits", [8, 4])
def test_ademamix_matches_reference(bits: int) -> None:
    _compare("ademamix", bits)


def test_whole_blocks_only_and_tiny_params() -> None:
    """A param smaller than one block is all tail (the reference); one of exactly one block is all native."""
    for shape in [(5,), (256,), (3, 256)]:
        _compare("adamw", 8, shape=shape, steps=3, offset=0)


def test_skipped_elements_are_kept() -> None:
    rule, hp = ADAMW, _hp("adamw", False)
    p = torch.randn(1024)
    g = torch.randn(1024) * 1e-3
    g[7], g[300] = float("nan"), float("inf")
    states = [BlockFormat(c, 256).zeros((1024,), "cpu") for c in _CODES[("adamw", 8)]]
    before = p.clone()
    cpu_native.quantized(rule, [p], [g], [states], [1], hp)
    assert p[7] == before[7] and p[300] == before[300]
    for q in states:  # 0, or the zero-free second-moment code's smallest value
        assert _unpacked(q)[[7, 300]].eq(q.format.book("cpu").zero_index).all()
    assert states[0].dequantize()[[7, 300]].eq(0).all()


def test_tables_first_made_in_a_memory_trace_are_real(monkeypatch) -> None:
    # leanopt.plan traces a step under FakeTensorMode, the code books made fake there: the
    # native kernel's tables, cached for the real steps after, must still be real tensors.
    from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

    from leanopt.memory.plan_trace import traced_kernels

    monkeypatch.setattr(cpu_native, "_TABLES", {})
    fmt = BlockFormat("pow3-s8", 256)
    with traced_kernels(), FakeTensorMode():
        book = fmt.book("cpu")
        assert is_fake(book.values)
        inside = cpu_native.tables(book)
        assert inside is not None and not any(is_fake(t) for t in inside if isinstance(t, torch.Tensor))
    real = cpu_native.tables(fmt.book("cpu"))
    assert real is not None and not any(is_fake(t) for t in real if isinstance(t, torch.Tensor))
    ref = cpu_native._tables(fmt.book("cpu"))
    for a, b in zip(real, ref):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_tables_first_made_under_a_dispatch_mode_are_right(monkeypatch) -> None:
    # leanopt.plan's storage tracker answers every data-dependent scalar (.item(), bool()) with
    # 1 or True: tables first made under it must still be computed from the real values.
    from torch.utils._python_dispatch import TorchDispatchMode

    class DummyScalars(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                return True if args[0].dtype == torch.bool else 1
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(cpu_native, "_TABLES", {})
    book = BlockFormat("pow6-u8", 256).book("cpu")
    with DummyScalars():
        inside = cpu_native.tables(book)
    ref = cpu_native._tables(book)
    assert inside is not None and ref is not None
    for a, b in zip(inside, ref):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.parametrize("code", code_names())
def test_tables_find_the_nearest_code_as_searchsorted(code: str) -> None:
    """The kernel's two searches, done here in torch on the kernel's tables: the clamped bucket
    table plus one comparison (8-bit codes, portable loops) and the descent of the midpoint tree
    (4-bit codes), against ``torch.searchsorted`` over every top-16-bit prefix of |y| <= 1 with
    several low halves, the midpoints themselves and their fp32 neighbours, +-0 and subnormals."""
    book = BlockFormat(code, 64).book("cpu")
    t = cpu_native.tables(book)
    assert t is not None
    mids = book.thresholds.float()
    prefixes = torch.arange(1 << 16, dtype=torch.int64) << 16
    lows = torch.tensor([0, 1, 0x00FF, 0x7FFF, 0x8000, 0xFFFE, 0xFFFF], dtype=torch.int64)
    bits = (prefixes[:, None] | lows[None, :]).reshape(-1)
    y = bits.to(torch.int32).view(torch.float32)
    near = torch.cat([mids, torch.nextafter(mids, torch.tensor(2.0)), torch.nextafter(mids, torch.tensor(-2.0))])
    tiny = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-40, -1e-40, 1.0, -1.0])
    y = torch.cat([y[torch.isfinite(y) & (y.abs() <= 1)], near[near.abs() <= 1], tiny])
    want = torch.searchsorted(mids, y)

    b = y.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rows = 128 - t.low
    e = ((b >> 23) & 0xFF).clamp(t.low, 127)
    key = (b >> 31) * (rows << 7) + ((e - t.low) << 7) + ((b >> 16) & 0x7F)
    k = t.buckets.long()[key]
    assert torch.equal(k + (t.thresholds[k] < y).long(), want)

    levels = t.values.numel().bit_length() - 1
    j = torch.ones_like(want)
    for _ in range(levels):
        j = 2 * j + (t.tree[j] < y).long()
    assert torch.equal(j - (1 << levels), want)


def test_dither_matches_the_formats_reference_across_two_to_the_32() -> None:
    """The decay rounding's dither, both loops, against ``formats.dither`` over element indices
    that cross 2^32 (the AVX-512 loop's carry into the high word) and an n that is not a multiple
    of 16. The end-to-end comparisons rarely see a dither decide a code, so it is checked here."""
    from leanopt.quant.formats import dither

    base, n = (1 << 32) - 1003, 2021
    for step in (1, 7, 123456):
        want = dither(torch.arange(base, base + n, dtype=torch.int64), step)
        assert torch.equal(cpu_native.dither(base, n, step), want)
        with cpu_native.portable():
            assert torch.equal(cpu_native.dither(base, n, step), want)


@pytest.mark.parametrize("name,bits", sorted(_CODES) + [("adamw-amsgrad", 8), ("adamw-amsgrad", 4)])
def test_avx512_and_portable_loops_agree_bit_for_bit(name: str, bits: int) -> None:
    """The AVX-512 loops (16 lanes; permutes for table reads) against the kernel's portable
    loops: same params, codes and block scales to the bit, over steps with 60 % exact-zero
    gradients (the decay rounding), NaN/Inf/overflowing gradients, a block size that is not a
    multiple of 16 (each block ends in the portable loops) and element indices that cross
    2^32 (the dither's carry)."""
    if not cpu_native.vectorized():
        pytest.skip("the kernel has no AVX-512 loops on this CPU: only the portable loops run")
    amsgrad = name == "adamw-amsgrad"
    name = "adamw" if amsgrad else name
    rule, hp = _RULES[name], _hp(name, False, amsgrad)
    codes = _CODES[(name, bits)] + ((_CODES[(name, bits)][1],) if amsgrad else ())
    gen = torch.Generator().manual_seed(zlib.crc32(repr((name, bits, amsgrad)).encode()))
    shape, bs, offset = (37, 400), 200, (1 << 32) - 5000
    scale = torch.exp(torch.randn(shape, generator=gen) * 2.0) * 1e-3
    ours_p = vec_p = torch.randn(shape, generator=gen)
    ours_p, vec_p = ours_p.clone(), vec_p.clone()
    ours_s = [BlockFormat(code, bs).zeros(shape, "cpu") for code in codes]
    vec_s = [q.clone() for q in ours_s]
    for step in range(1, 9):
        g = _grad(shape, gen, scale, nonfinite=step % 3 == 0)
        g[torch.rand(shape, generator=gen) < 0.45] = 0.0
        cpu_native.quantized(rule, [vec_p], [g], [vec_s], [step], hp, [offset])
        with cpu_native.portable():
            cpu_native.quantized(rule, [ours_p], [g], [ours_s], [step], hp, [offset])
        assert torch.equal(vec_p.view(torch.int32), ours_p.view(torch.int32)), f"step {step}: params differ"
        for k, (a, b) in enumerate(zip(vec_s, ours_s)):
            assert torch.equal(a.codes, b.codes), f"step {step}, state {k}: codes differ"
            assert torch.equal(a.absmax.view(torch.int32), b.absmax.view(torch.int32)), f"step {step}, state {k}: scales"


# ---- dense fp32 states ---------------------------------------------------------------------------
@pytest.mark.parametrize("name,safe,maximize,amsgrad", [
    ("adamw", True, False, False), ("adamw", True, True, False), ("adamw", True, False, True),
    ("adamw", False, False, True), ("lion", True, False, False), ("lion", False, True, False),
    ("ademamix", True, False, False), ("ademamix", False, False, False),
])  # fmt: skip
def test_dense_states_match_reference(name: str, safe: bool, maximize: bool, amsgrad: bool) -> None:
    """The dense loop (fp32 states stored as they are) against ``reference.rule_step_`` on the
    same states: params and states within the quantized tests' fp32 tolerance (an ulp from the
    correctly rounded sqrt), params equal on >= 95 % and states on >= 99.9 %; in safe mode NaN/Inf/overflowing gradients skip
    their element (param kept, states 0) and leave their neighbours as the reference does;
    outside it, they propagate as in the reference. Sizes: 1, one chunk less one, chunks and a
    tail."""
    rule, hp = _RULES[name], _hp(name, maximize, amsgrad)
    gen = torch.Generator().manual_seed(zlib.crc32(repr((name, safe, maximize, amsgrad)).encode()))
    for shape in [(1,), (255,), (7, 300)]:
        n = math.prod(shape)
        scale = torch.exp(torch.randn(shape, generator=gen) * 2.0) * 1e-3
        param = torch.randn(shape, generator=gen)
        states = [torch.zeros(shape) for _ in rule.states(hp)]
        for step in range(1, 6):
            g = _grad(shape, gen, scale, nonfinite=safe and step % 2 == 0 and n > 12)
            ours_p, ours_s = param.clone(), [s.clone() for s in states]
            reference.rule_step_(rule, param, g, states, step, hp, safe=safe)
            assert cpu_native.takes_dense(rule, ours_p, g, ours_s, hp)
            cpu_native.dense(rule, ours_p, g, ours_s, step, hp, safe)
            for what, got, want in [("params", ours_p, param)] + [(f"state {k}", a, b) for k, (a, b) in enumerate(zip(ours_s, states))]:
                diff = (got - want).abs().max().item()
                assert diff <= 2e-6 * want.abs().max().item() + 1e-7, f"{shape} step {step}: {what} {diff:.3g} apart"
                least = 0.95 if what == "params" else 0.999  # the sqrt's ulp reaches params only
                assert (got == want).float().mean() >= least, f"{shape} step {step}: {what} equal on < {least:.1%}"
            assert torch.isfinite(ours_p).all() and all(torch.isfinite(s).all() for s in ours_s)


@pytest.mark.parametrize("safe,maximize", [(False, False), (True, False), (False, True)])
def test_a_rule_without_states_matches_the_reference_to_the_bit(safe: bool, maximize: bool) -> None:
    """A twin's loop without states (SGD without a momentum, torch.optim.SGD's default): the
    param, to the bit, as the reference writes it (no square root: nothing to round
    differently); in safe mode a NaN/Inf/overflowing gradient keeps its element's param."""
    zero_state = [(name, twin) for name, twin in twins.NATIVE.items() if 0 in twin.states]
    assert zero_state, "no twin of the kernel takes a rule without states"
    for name, _ in zero_state:
        rule = RULES[name]
        hp = rule.hyperparameters(dict(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.3, nesterov=False,
                                       maximize=maximize))  # fmt: skip
        assert rule.states(hp) == ()
        gen = torch.Generator().manual_seed(zlib.crc32(repr((name, safe, maximize)).encode()))
        for shape in [(1,), (255,), (7, 300)]:
            scale = torch.exp(torch.randn(shape, generator=gen)) * 0.3  # gradients near the decay's size
            param = torch.randn(shape, generator=gen)
            for step in range(1, 4):
                g = _grad(shape, gen, scale, nonfinite=safe and step == 2 and math.prod(shape) > 12)
                ours = param.clone()
                reference.rule_step_(rule, param, g, [], step, hp, safe=safe)
                assert cpu_native.takes_dense(rule, ours, g, [], hp)
                cpu_native.dense(rule, ours, g, [], step, hp, safe)
                assert torch.equal(ours.view(torch.int32), param.view(torch.int32)), f"{name} {shape} step {step}"


@pytest.mark.parametrize("name,safe", [("adamw", False), ("adamw", True), ("lion", False), ("ademamix", True)])
def test_bf16_states_match_the_reference_across_the_dithers_32_bit_edge(name: str, safe: bool) -> None:
    """bf16 states (leanopt.quant.bf16): the kernel's loops against ``reference.rule_step_`` on a
    shard whose dither indices ((offset + i) * states + j) cross 2^32 within a chunk, and one
    from 0: the states to the bit, every step (they do not depend on the params); the params
    within the reference's fp32 rounding (AdamW outside safe mode takes torch's own square root
    there). One fp32 state among bf16 ones takes the loop for mixed states."""
    rule, hp = _RULES[name], _hp(name, False)
    n_states = len(rule.states(hp))
    gen = torch.Generator().manual_seed(zlib.crc32(repr((name, safe)).encode()))
    for offset, mixed in (((1 << 32) // n_states - 700, False), (0, False), ((1 << 32) // n_states - 700, True)):
        shape = (3, 517)
        param = torch.randn(shape, generator=gen)
        dtypes = [torch.float32 if mixed and j == 0 else torch.bfloat16 for j in range(n_states)]
        states = [torch.zeros(shape, dtype=d) for d in dtypes]
        ours_p, ours_s = param.clone(), [s.clone() for s in states]
        for step in range(1, 5):
            g = _grad(shape, gen, torch.full(shape, 1e-2), nonfinite=safe and step == 2)
            reference.rule_step_(rule, param, g, states, step, hp, safe=safe, offset=offset)
            assert cpu_native.takes_dense(rule, ours_p, g, ours_s, hp)
            cpu_native.dense(rule, ours_p, g, ours_s, step, hp, safe, offset)
            for k, (a, b) in enumerate(zip(ours_s, states)):
                bits = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
                assert torch.equal(a.view(bits), b.view(bits)), f"offset {offset} step {step}: state {k} differs"
            assert ((ours_p - param).abs().max() / param.abs().max()).item() <= 1e-6, f"offset {offset} step {step}"


def test_dense_not_taken_for_other_layouts() -> None:
    """Strided, fp64, fp16 or fake tensors are left to the compiled graph (bf16 states are taken:
    tests/test_cpu_paths.py)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    rule, hp = ADAMW, _hp("adamw", False)
    p, g = torch.randn(8, 8), torch.randn(8, 8)
    assert cpu_native.takes_dense(rule, p, g, [torch.zeros(8, 8), torch.zeros(8, 8)], hp)
    assert not cpu_native.takes_dense(rule, p.t(), g, [torch.zeros(8, 8), torch.zeros(8, 8)], hp)
    assert not cpu_native.takes_dense(rule, p.double(), g.double(), [torch.zeros(8, 8, dtype=torch.float64)] * 2, hp)
    assert cpu_native.takes_dense(rule, p, g, [torch.zeros(8, 8), torch.zeros(8, 8, dtype=torch.bfloat16)], hp)
    assert not cpu_native.takes_dense(rule, p, g, [torch.zeros(8, 8), torch.zeros(8, 8, dtype=torch.float16)], hp)
    with FakeTensorMode() as mode:
        fp = mode.from_tensor(p)
        assert not cpu_native.takes_dense(rule, fp, mode.from_tensor(g), [torch.zeros_like(fp)] * 2, hp)
    with cpu_native.disabled():
        assert not cpu_native.takes_dense(rule, p, g, [torch.zeros(8, 8), torch.zeros(8, 8)], hp)


def test_the_kernel_refuses_tensors_it_cannot_address() -> None:
    """The kernel takes addresses: a short, strided or mistyped tensor is a ValueError naming
    it, and nothing is written."""
    rule, hp = ADAMW, _hp("adamw", False)
    p, g = torch.randn(512), torch.randn(512)
    before = p.clone()
    with pytest.raises(ValueError, match="state must be a contiguous CPU torch.float32 tensor of >= 512"):
        cpu_native.dense(rule, p, g, [torch.zeros(512), torch.zeros(511)], 1, hp, True)
    with pytest.raises(ValueError, match="grad must be"):
        cpu_native.dense(rule, p, torch.randn(512, 2)[:, 0], [torch.zeros(512), torch.zeros(512)], 1, hp, True)
    states = [BlockFormat(c, 256).zeros((512,), "cpu") for c in _CODES[("adamw", 8)]]
    states[1].absmax = states[1].absmax[:1]
    with pytest.raises(ValueError, match="absmax must be"):
        cpu_native.step_blocks(rule, p, g, states, 1, hp, 0, 2)
    assert torch.equal(p, before)


def test_the_module_checks_its_arguments_before_it_runs() -> None:
    """The extension's own argument handling (Python's C API, under the checks above): a list
    argument that is not a list of numbers is a TypeError, a rule or state count the loops do
    not have, dtype bits out of range, or state bits, a step or an offset out of range, a
    ValueError, and neither writes anything; a right call writes the param."""
    module = cpu_native._module()
    p, g, m, v = torch.randn(64), torch.randn(64), torch.zeros(64), torch.zeros(64)
    before = p.clone()
    scalars = list(ADAMW.scalar_values(_hp("adamw", False), 1, True))
    addr = [m.data_ptr(), v.data_ptr()]
    with pytest.raises(TypeError):
        module.step_dense(0, 0, False, True, p.data_ptr(), g.data_ptr(), False, 64, 5, scalars, 0, 1, 0)
    with pytest.raises(TypeError):
        module.step_dense(0, 0, False, True, p.data_ptr(), g.data_ptr(), False, 64, addr, ["lr"], 0, 1, 0)
    with pytest.raises(TypeError):
        module.step_dense(0, 0, False, True, p.data_ptr(), g.data_ptr(), False, 64, addr)
    with pytest.raises(ValueError, match="wrong number of states"):
        module.step_dense(rule_id(ADAMW), 0, False, True, p.data_ptr(), g.data_ptr(), False, 64, addr[:1], scalars, 0, 1, 0)
    with pytest.raises(ValueError, match="too many scalars"):
        module.step_dense(rule_id(ADAMW), 0, False, True, p.data_ptr(), g.data_ptr(), False, 64, addr, [0.0] * 17, 0, 1, 0)
    for dtypes in (-1, 4):  # the param's and the gradient's bf16 bits: 0 to 3
        with pytest.raises(ValueError, match="dtypes"):
            module.step_dense(rule_id(ADAMW), 0, False, True, p.data_ptr(), g.data_ptr(), dtypes, 64, addr, scalars, 0, 1, 0)
    # One "stored" bit per state (bf16 states); a negative step or offset.
    for stored, step, offset in ((4, 1, 0), (-1, 1, 0), (0, -1, 0), (0, 1, -1)):
        with pytest.raises(ValueError, match="stored: one bit per state"):
            module.step_dense(rule_id(ADAMW), 0, False, True, p.data_ptr(), g.data_ptr(), 0, 64, addr, scalars, stored, step,
                              offset)  # fmt: skip
    # No block loop for a rule without states (SGD without a momentum: the dense loop only).
    sgd = list(SGD.scalar_values(SGD.hyperparameters(dict(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0,
                                                          nesterov=False, maximize=False)), 1, True))  # fmt: skip
    with pytest.raises(ValueError, match="no block loop"):
        module.step_blocks(rule_id(SGD), 0, 8, 64, False, p.data_ptr(), g.data_ptr(), 0, 1, *([[]] * 10), 1, 0, sgd,
                           0.0, 1.0, False)  # fmt: skip
    assert torch.equal(p, before) and not m.any() and not v.any()
    module.step_dense(rule_id(ADAMW), 0, False, True, p.data_ptr(), g.data_ptr(), False, 64, tuple(addr), scalars, 0, 1, 0)
    assert not torch.equal(p, before) and m.any() and v.any()
    assert isinstance(module.avx512(), bool)
