"""AdamW8bit / AdamW4bit: code books and formats, memory, accuracy against torch and the peers,
the v->0 hazard, NaN isolation, and a short real training run.

The accuracy and hazard scenarios are defined once, in ``benchmarks/accuracy_vs_peers.py``,
which prints the same comparison as a table.
"""

from __future__ import annotations

import inspect
import math
import re

import pytest
import torch

import leanopt
from leanopt.kernels import rules
from leanopt.optim.adamw_lowbit import LowBitAdamW
from leanopt.quant import BlockFormat, QuantizedState, codebook, format_by_name
from leanopt.quant.codebooks import code_names, dynamic_tree_values
import repo_modules
from registry import OPTIMIZERS, representatives

bench = repo_modules.benchmark("accuracy_vs_peers")

LOW_BIT = [leanopt.AdamW8bit, leanopt.AdamW4bit]
low_bit = pytest.mark.parametrize("cls", LOW_BIT, ids=["8bit", "4bit"])
FORMATS = [BlockFormat("pow3-s8", 256), BlockFormat("pow6-u8", 256), BlockFormat("pow2-s4", 128), BlockFormat("pow3-u4", 128)]

# FACTS.md: peers on the randn scenario (max |dp|, mean |dp|).
FACTS_BNB_8BIT = (8.3e-4, 6.7e-5)
FACTS_TORCHAO_4BIT = (1.1e-2, 9.1e-4)


def _state_bytes(state: dict) -> int:
    total = 0
    for value in state.values():
        tensors = value.tensors() if isinstance(value, QuantizedState) else (value,)
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


# ---- code books and formats ---------------------------------------------------------------------
@pytest.mark.parametrize("name", code_names())
def test_code_books_are_sorted_bounded_and_shared(name: str) -> None:
    book = codebook(name)
    assert book.values.numel() == 2**book.bits and book.values.dtype == torch.float32
    distinct = book.values[: book.thresholds.numel() + 1]
    assert torch.all(distinct[1:] > distinct[:-1])
    assert distinct[-1].item() == 1.0
    if book.signed:
        assert distinct[0].item() == -1.0 and book.values[book.zero_index].item() == 0.0
        assert torch.equal(distinct, -distinct.flip(0))  # symmetric: no drift from rounding
    else:
        assert distinct[0].item() >= 0.0
    assert codebook(name) is book  # one code book per (name, device), never one per state


def test_second_moment_codes_of_the_optimizers_have_no_zero() -> None:
    for cls in LOW_BIT:
        assert codebook(cls.exp_avg_sq_code).values.min().item() > 0
        assert codebook(cls.exp_avg_code).signed and not codebook(cls.exp_avg_sq_code).signed


def test_dynamic_tree_follows_the_published_layout() -> None:
    # Signed 8-bit: sign, e zero bits, indicator, 6-e fraction bits -> 2^(6-e) values in decade 10^-e.
    pos = [x for x in dynamic_tree_values(8, True) if x > 0]
    for e in range(7):
        in_decade = [x for x in pos if 10.0 ** -(e + 1) < x <= 10.0**-e * (1 + 1e-12)]
        assert len(in_decade) == 2 ** (6 - e), e
    assert len(dynamic_tree_values(8, False)) == 256 and 0.0 in dynamic_tree_values(8, False)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("numel", [1, 7, 127, 256, 257, 1000, 4097])
def test_format_round_trip_error_is_within_half_a_code_step(fmt: BlockFormat, numel: int) -> None:
    torch.manual_seed(numel)
    x = torch.randn(numel)
    if not codebook(fmt.code).signed:
        x = x.square()
    state = fmt.from_dense(x)
    assert state.codes.dtype == torch.uint8 and state.codes.numel() == fmt.code_bytes(numel)
    assert state.absmax.dtype == torch.float32 and state.absmax.numel() == math.ceil(numel / fmt.block_size)
    assert fmt.nbytes(numel) == sum(t.numel() * t.element_size() for t in state.tensors())
    back = state.dequantize()
    assert back.shape == x.shape and back.dtype == torch.float32
    vals = codebook(fmt.code).values[: codebook(fmt.code).thresholds.numel() + 1]
    max_gap = (vals[1:] - vals[:-1]).max().item()
    scale = state.absmax.repeat_interleave(fmt.block_size)[:numel]
    assert torch.all((back - x).abs() <= scale * max_gap / 2 * (1 + 1e-5) + 1e-12)
    # The block maximum is exact.
    assert torch.isclose(back.abs().max(), x.abs().max(), rtol=1e-6)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_format_zeros_decode_to_zero_and_names_round_trip(fmt: BlockFormat) -> None:
    z = fmt.zeros((3, 100), torch.device("cpu"))
    assert torch.equal(z.dequantize(), torch.zeros(3, 100))
    assert format_by_name(fmt.name) == fmt
    sd = z.to_state_dict()
    assert isinstance(sd["format"], str) and isinstance(sd["shape"], list)
    again = QuantizedState.from_state_dict(sd)
    assert again.format == fmt and torch.equal(again.codes, z.codes)


def test_corrupt_quantized_state_dict_is_rejected() -> None:
    fmt = BlockFormat("pow3-s8", 256)
    sd = fmt.from_dense(torch.randn(1000)).to_state_dict()
    with pytest.raises(ValueError):
        QuantizedState.from_state_dict({**sd, "codes": sd["codes"][:-1]})
    with pytest.raises(ValueError):
        QuantizedState.from_state_dict({**sd, "absmax": sd["absmax"][:-1]})
    with pytest.raises(ValueError):
        format_by_name("pow3-s8/bxx")
    with pytest.raises(ValueError):
        format_by_name("nope/b256")


def test_four_bit_codes_pack_two_per_byte_first_in_low_nibble() -> None:
    fmt = BlockFormat("pow2-s4", 128)
    x = torch.tensor([1.0, -1.0, 0.0])  # codes 14, 0, 7
    st = fmt.from_dense(x)
    assert st.codes.tolist() == [14 | (0 << 4), 7]
    assert torch.equal(st.dequantize(), x)


# ---- signature, layout, memory ------------------------------------------------------------------
@low_bit
def test_signature_matches_adamw_plus_storage_options(cls: type) -> None:
    ours = inspect.signature(cls.__init__).parameters
    theirs = inspect.signature(leanopt.AdamW.__init__).parameters
    for name, param in theirs.items():
        assert name in ours and ours[name].default == param.default and ours[name].kind == param.kind, name
    assert ours["min_quant_size"].default == 4096
    assert ours["block_size"].kind == inspect.Parameter.KEYWORD_ONLY
    w = torch.nn.Parameter(torch.randn(4))
    assert cls([w]).param_groups[0]["block_size"] == cls.default_block_size
    assert (leanopt.AdamW8bit.default_block_size, leanopt.AdamW4bit.default_block_size) == (256, 128)
    with pytest.raises(ValueError, match="amsgrad"):
        cls([w], amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad"):
        cls([{"params": [w], "amsgrad": True}])


@low_bit
def test_layout_quantizes_by_global_size_and_group_choice(cls: type) -> None:
    big, edge, small = (torch.nn.Parameter(torch.randn(s)) for s in [(64, 80), (4096,), (4095,)])
    emb = torch.nn.Parameter(torch.randn(100, 64))
    half = torch.nn.Parameter(torch.randn(64, 80, dtype=torch.bfloat16))
    opt = cls([{"params": [big, edge, small, half]}, {"params": [emb], "quantize": False}], backend="reference")
    for p in (big, edge, small, emb, half):
        p.grad = torch.randn_like(p)
    opt.step()
    for p in (big, edge, half):
        assert isinstance(opt.state[p]["exp_avg"], QuantizedState)
        assert isinstance(opt.state[p]["exp_avg_sq"], QuantizedState)
        assert opt.state[p]["exp_avg"].format.block_size == cls.default_block_size
    for p in (small, emb):
        for key in ("exp_avg", "exp_avg_sq"):
            assert isinstance(opt.state[p][key], torch.Tensor) and opt.state[p][key].dtype == torch.float32
    for st in opt.state.values():
        assert st["step"].device.type == "cpu" and st["step"].dtype == torch.float32 and st["step"].item() == 1
    # min_quant_size and block_size per group, and the layout seen by estimate().
    opt2 = cls([{"params": [small], "min_quant_size": 0, "block_size": 64}])
    small.grad = torch.randn_like(small)
    opt2.step()
    assert opt2.state[small]["exp_avg"].format.block_size == 64
    specs = {s.key: s for s in opt.state_layout((64, 80), torch.float32, opt.param_groups[0])}
    assert specs["exp_avg"].quant is not None and specs["exp_avg_sq"].quant is not None


@low_bit
def test_memory_per_param_on_a_1024_square(cls: type) -> None:
    w = torch.nn.Parameter(torch.zeros(1024, 1024))
    opt = cls([w])
    w.grad = torch.randn_like(w)
    opt.step()
    per_param = _state_bytes(opt.state[w]) / w.numel()
    limit = {leanopt.AdamW8bit: 2.035, leanopt.AdamW4bit: 1.07}[cls]
    assert per_param <= limit, per_param
    expected = {leanopt.AdamW8bit: 2 * (1 + 4 / 256), leanopt.AdamW4bit: 2 * (0.5 + 4 / 128)}[cls]
    assert per_param == pytest.approx(expected + 4 / w.numel(), rel=0, abs=1e-12)
    assert leanopt.measure(opt).bytes == _state_bytes(opt.state[w])
    assert leanopt.estimate([w], cls).bytes == leanopt.measure(opt).bytes


# ---- the update rule ----------------------------------------------------------------------------
@low_bit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_fp32_states_follow_leanopt_adamw_bit_for_bit(cls: type, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    init = [torch.randn(64, 80, dtype=dtype), torch.randn(7, dtype=dtype)]
    ours = [p.clone().requires_grad_() for p in init]
    ref = [p.clone().requires_grad_() for p in init]
    # The rule itself (fast backends are held to it in test_backends_quant.py).
    opt = cls([{"params": ours, "quantize": False}], lr=1e-2, weight_decay=0.1, maximize=True, backend="reference")
    ref_opt = leanopt.AdamW(ref, lr=1e-2, weight_decay=0.1, maximize=True, backend="reference")
    for _ in range(10):
        for a, b in zip(ours, ref):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        opt.step()
        ref_opt.step()
    for a, b in zip(ours, ref):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[a][key], ref_opt.state[b][key].to(opt.state[a][key].dtype))
        if dtype == torch.float32:
            # Safe mode's square root is correctly rounded on every path (kernels.rules.sqrt);
            # AdamW's is torch's, one ulp off on ~17 % of fp32 inputs: an ulp of the denominator.
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
            assert (a == b).float().mean() >= 0.5
        else:
            assert torch.equal(a, b)


def test_moment_bound_is_the_exact_adam_supremum() -> None:
    b1, b2 = 0.9, 0.999
    assert rules.adam_moment_bound(b1, b2, 1) == pytest.approx((1 - b1) ** 2 / (1 - b2))
    # K_{t+1} = (b1^2/b2) K_t + (1-b1)^2/(1-b2), and the constant gradient of the right
    # geometric shape reaches it (Cauchy-Schwarz equality: g_k proportional to (b1/b2)^(t-k)).
    for t in (1, 2, 5, 30):
        k_t, k_next = rules.adam_moment_bound(b1, b2, t), rules.adam_moment_bound(b1, b2, t + 1)
        assert k_next == pytest.approx(b1 * b1 / b2 * k_t + (1 - b1) ** 2 / (1 - b2))
        g = torch.tensor([(b1 / b2) ** (t - k) for k in range(1, t + 1)], dtype=torch.float64)
        m = sum((1 - b1) * b1 ** (t - k) * g[k - 1] for k in range(1, t + 1))
        v = sum((1 - b2) * b2 ** (t - k) * g[k - 1] ** 2 for k in range(1, t + 1))
        assert (m * m / v).item() == pytest.approx(k_t, rel=1e-9)
    assert rules.adam_moment_bound(0.9, 0.0, 3) == math.inf
    assert rules.adam_moment_bound(0.99, 0.5, 10**6) == math.inf  # b1^2 > b2: no finite bound


# One per family (registry.representatives): a low-precision param is read into fp32, updated and
# rounded back by the quantized family's plumbing, whatever the rule and the code width; every
# quantized optimizer's bf16 step is held to the reference in tests/test_rules.py.
@pytest.mark.parametrize("cls", [c.cls for c in representatives(OPTIMIZERS) if c.family == "quantized"], ids=lambda c: c.__name__)
def test_bf16_and_fp16_params_update_in_fp32(cls: type) -> None:
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        p32 = torch.randn(64, 80)
        low = torch.nn.Parameter(p32.to(dtype))
        ref = torch.nn.Parameter(p32.to(dtype).float())
        opt, ref_opt = cls([low], lr=1e-2), cls([ref], lr=1e-2)
        for _ in range(5):
            g = torch.randn(64, 80)
            low.grad, ref.grad = g.to(dtype), g.to(dtype).float()
            opt.step()
            ref_opt.step()
            ref.data.copy_(ref.data.to(dtype).float())  # the low-precision param rounds once per step
        assert low.dtype == dtype and torch.equal(low.float(), ref.detach())


# ---- accuracy against torch and the peers --------------------------------------------------------
@pytest.fixture(scope="module")
def randn_run():
    p0, grads = bench.randn_scenario()
    return p0, grads, bench.fp32_reference(p0, grads)


def _ours_distance(cls: type, randn_run) -> tuple[float, float]:
    p0, grads, ref = randn_run
    final, _ = bench.run(lambda ps: cls(ps, lr=bench.LR, weight_decay=0.0), p0, grads)
    return bench.distance(final, ref)


def test_8bit_accuracy_no_worse_than_bitsandbytes(randn_run) -> None:
    ours = _ours_distance(leanopt.AdamW8bit, randn_run)
    assert ours[0] <= FACTS_BNB_8BIT[0] and ours[1] <= FACTS_BNB_8BIT[1], ours
    factory = bench.bnb_factory()
    if factory is None:
        pytest.skip("bitsandbytes is not installed (the FACTS figures were checked)")
    p0, grads, ref = randn_run
    try:
        final, _ = bench.run(factory, p0, grads)
    except Exception as err:  # noqa: BLE001 - its CPU path may be missing in some builds
        pytest.skip(f"bitsandbytes AdamW8bit does not run here: {err}")
    peer = bench.distance(final, ref)
    assert ours[0] <= peer[0] and ours[1] <= peer[1], (ours, peer)


def test_4bit_accuracy_no_worse_than_torchao_facts(randn_run) -> None:
    ours = _ours_distance(leanopt.AdamW4bit, randn_run)
    assert ours[0] <= FACTS_TORCHAO_4BIT[0] and ours[1] <= FACTS_TORCHAO_4BIT[1], ours


@pytest.mark.slow
def test_4bit_accuracy_no_worse_than_torchao_measured(randn_run) -> None:
    factory = bench.torchao_factories().get("torchao AdamW4bit")
    if factory is None:
        pytest.skip("torchao is not installed")
    p0, grads, ref = randn_run
    with bench.eager_torch_compile():  # same maths, without a minute of compiling on CPU
        final, _ = bench.run(factory, p0, grads)
    peer = bench.distance(final, ref)
    ours = _ours_distance(leanopt.AdamW4bit, randn_run)
    assert ours[0] <= peer[0] and ours[1] <= peer[1], (ours, peer)


# ---- the v->0 hazard ------------------------------------------------------------------------------
def _step_bound(t: int, lr: float = bench.LR, b1: float = 0.9, b2: float = 0.999) -> float:
    """fp32 AdamW's largest possible |dp| at step t (weight decay 0)."""
    return lr * math.sqrt(rules.adam_moment_bound(b1, b2, t)) * math.sqrt(1 - b2**t) / (1 - b1**t)


@low_bit
def test_no_v_to_zero_hazard(cls: type) -> None:
    p0, grads, on = bench.hazard_scenario()
    ref = bench.fp32_reference(p0, grads)
    p = torch.nn.Parameter(p0.clone())
    opt = cls([p], lr=bench.LR, weight_decay=0.0)
    path_bound = 0.0
    for t, g in enumerate(grads, start=1):
        before = p.detach().clone()
        p.grad = g.clone()
        opt.step()
        # Every single step stays within fp32 AdamW's own worst case (~lr here).
        bound = _step_bound(t)
        path_bound += bound
        assert (p.detach() - before).abs().max().item() <= bound * (1 + 1e-3), t  # floor slack: 1e-3
    drift = (p.detach() - ref).abs()
    lr = bench.LR
    # Bound asserted: no element ends further from fp32 AdamW than the length of fp32's own
    # path (~20 lr): the worst an element does is stand still. Elements whose gradient is
    # 1e-4..1e-6 of their block's largest fall under the codes' resolution and lag that much
    # (bitsandbytes on CPU: 16 lr, torchao 4-bit: 17 lr; on a GPU both reach 330 000 lr).
    assert drift.max().item() <= path_bound, (drift.max().item(), path_bound)
    # The hazard's trigger -- elements whose gradient went to zero -- stays within 5 lr (their
    # momentum decays as fp32's in expectation; measured 4.85 lr for 8-bit with the decay
    # rounding).
    assert drift[~on].max().item() <= 5 * lr, drift[~on].max().item()
    # Elements the code resolves track fp32 closely (8-bit: within three decades of their
    # block's largest gradient; 4-bit, 15 levels: within one decade).
    decades, limit, mean_limit = {leanopt.AdamW8bit: (1e-3, 4 * lr, 2.5 * lr), leanopt.AdamW4bit: (1e-1, 10 * lr, 12 * lr)}[cls]
    block = cls.default_block_size
    block_max = grads[0].abs().view(-1, block).amax(1, keepdim=True)
    resolved = (grads[0].abs().view(-1, block) >= decades * block_max).view_as(on)
    assert drift[resolved].max().item() <= limit, drift[resolved].max().item()
    assert drift.mean().item() <= mean_limit, drift.mean().item()


class _ZeroCodeNoFloor(leanopt.AdamW8bit):
    exp_avg_code = "dyn-s8"
    exp_avg_sq_code = "dyn-u8"  # has a zero: v can round to 0


def test_hazard_scenario_catches_the_hazard_when_the_floor_is_off(monkeypatch) -> None:
    p0, grads, _ = bench.hazard_scenario(size=256)
    ref = bench.fp32_reference(p0, grads)
    make = lambda ps: _ZeroCodeNoFloor(ps, lr=bench.LR, weight_decay=0.0)  # noqa: E731
    safe, _ = bench.run(make, p0, grads)
    assert bench.distance(safe, ref)[0] <= 0.021  # the floor alone makes a zero-coded v safe
    monkeypatch.setattr(rules, "adam_moment_bound", lambda *a: math.inf)
    broken, _ = bench.run(make, p0, grads)
    assert bench.distance(broken, ref)[0] > 1.0  # lr * m / eps: a thousand lr and more


# ---- NaN / Inf isolation -------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 1e30], ids=["nan", "inf", "-inf", "overflow"])
@pytest.mark.parametrize("quantize", [True, False], ids=["quantized", "fp32-state"])
@low_bit
def test_non_finite_gradient_element_is_skipped_and_isolated(cls: type, bad: float, quantize: bool) -> None:
    torch.manual_seed(0)
    p0 = torch.randn(64, 80)
    i = 300  # inside the second block for both block sizes
    a = torch.nn.Parameter(p0.clone())
    b = torch.nn.Parameter(p0.clone())
    opt_a = cls([{"params": [a], "quantize": quantize}], lr=1e-2, weight_decay=0.1)
    opt_b = cls([{"params": [b], "quantize": quantize}], lr=1e-2, weight_decay=0.1)
    for step in range(4):
        g = torch.randn(64, 80)
        a.grad, b.grad = g.clone(), g.clone()
        if step in (0, 2):
            a.grad.view(-1)[i] = bad
            b.grad.view(-1)[i] = 0.0  # the twin simply has no gradient there
        before = a.detach().clone()
        opt_a.step()
        opt_b.step()
        assert torch.isfinite(a).all()
        if step in (0, 2):
            assert a.view(-1)[i].item() == before.view(-1)[i].item()  # skipped, not even decayed
            for key in ("exp_avg", "exp_avg_sq"):
                st = opt_a.state[a][key]
                if isinstance(st, QuantizedState):
                    # Reset to the code nearest 0 (the zero-free v code's smallest value).
                    assert st.format._unpack(st.codes, st.numel)[i].item() == st.format.book("cpu").zero_index
                    assert torch.isfinite(st.absmax).all()
                else:
                    assert st.view(-1)[i].item() == 0.0 and torch.isfinite(st).all()
        others = torch.ones(a.numel(), dtype=torch.bool)
        others[i] = False
        if step == 0:
            # From identical states, every other element (its block included) is bit-identical
            # to the twin: params, codes and block scales.
            assert torch.equal(a.view(-1)[others], b.view(-1)[others])
            for key in ("exp_avg", "exp_avg_sq"):
                sa, sb = opt_a.state[a][key], opt_b.state[b][key]
                if isinstance(sa, QuantizedState):
                    assert torch.equal(sa.absmax, sb.absmax) and torch.equal(sa.codes, sb.codes)
                else:
                    assert torch.equal(sa, sb)
        if step == 2:
            # Later, the params of the others still get exactly the twin's update (the step
            # uses the fp32 moments); the block's other codes may only differ by rounding.
            assert torch.equal(a.view(-1)[others], b.view(-1)[others])


# ---- a short real training run -------------------------------------------------------------------
def _digits_held_out_loss(make, steps: int = 300, seed: int = 0) -> float:
    # benchmarks/accuracy_vs_peers.py's run (the MLP and data of its training table).
    return bench.digits_run(make, seed, steps)[0]


def test_training_run_on_digits_matches_fp32_adamw() -> None:
    # backend="reference": the rule itself, and no compile time (the fast paths are held to
    # it in test_backends_quant.py).
    fp32 = _digits_held_out_loss(lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    q8 = _digits_held_out_loss(lambda ps: leanopt.AdamW8bit(ps, lr=1e-3, backend="reference"))
    q4 = _digits_held_out_loss(lambda ps: leanopt.AdamW4bit(ps, lr=1e-3, backend="reference"))
    assert abs(q8 / fp32 - 1) <= 0.01, (fp32, q8)
    # 4-bit: no worse than 3%. It ends lower than fp32 (seeds 0-4: 1.1-6.0 % with the decay
    # rounding, docs/quantized.md), so a two-sided 3% would not hold.
    assert q4 / fp32 - 1 <= 0.03, (fp32, q4)


def test_low_bit_classes_share_one_implementation() -> None:
    for cls in LOW_BIT:
        assert issubclass(cls, LowBitAdamW)
        # Each class spells out its constructor (its own block_size default, for readers and type
        # checkers) and defines nothing else: the state, the step and the rest are LowBitAdamW's.
        # (torch wraps ``step`` on the class at first use, so read the class body instead.)
        body = inspect.getsource(cls)
        assert re.findall(r"^\s*def (\w+)", body, flags=re.M) == ["__init__"], cls


# ---- hostile checkpoints ------------------------------------------------------------------------
def test_block_size_read_from_a_file_is_bounded() -> None:
    # A 2.9 KB file once named "b134217728": decoding padded every state to 134M floats.
    for name in ("pow3-s8/b134217728", "pow3-s8/b65537", "pow3-s8/b" + "9" * 5000, "pow3-s8/b²"):
        with pytest.raises(ValueError):
            format_by_name(name)
    assert format_by_name("pow3-s8/b65536").block_size == 65536
    sd = {"codes": torch.zeros(4096, dtype=torch.uint8), "absmax": torch.zeros(1),
          "format": "pow3-s8/b134217728", "shape": [4096]}
    with pytest.raises(ValueError, match="block"):
        QuantizedState.from_state_dict(sd)


@pytest.mark.parametrize(
    "change",
    [{"shape": [-1, -4096]}, {"shape": [4096.5]}, {"shape": [4096, True]}, {"shape": "4096"},
     {"absmax": torch.zeros(16, dtype=torch.int64)}, {"codes": torch.zeros(4096, dtype=torch.int8)},
     {"format": 256}],
    ids=["negative-dims", "float-dim", "bool-dims", "string-shape", "int-absmax", "int8-codes", "format-not-str"],
)
def test_quantized_state_dict_fields_are_checked_exactly(change: dict) -> None:
    sd = BlockFormat("pow3-s8", 256).from_dense(torch.randn(4096)).to_state_dict()
    with pytest.raises(ValueError):
        QuantizedState.from_state_dict({**sd, **change})


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_dequantized_tensor_owns_exactly_its_elements(fmt: BlockFormat) -> None:
    # 33 x 257 is not a whole number of blocks: the padded decode buffer must not leak out
    # (it made a converted fp32 checkpoint read 8.21 B/param in `leanopt inspect`).
    x = torch.randn(33, 257)
    dense = fmt.from_dense(x).dequantize()
    assert dense.shape == (33, 257) and dense.is_contiguous()
    assert dense.untyped_storage().nbytes() == 33 * 257 * 4
    buf = __import__("io").BytesIO()
    torch.save(dense, buf)
    assert buf.getbuffer().nbytes < 33 * 257 * 4 + 2048
