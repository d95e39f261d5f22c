"""Every elementwise rule, once: registry, parity of every backend with the reference, the
fp32 rules against plain formulas and against bitsandbytes, and the low-bit optimizers' drift
from fp32 side by side with bitsandbytes' 8-bit ones.

Tolerances. Backend parity (fresh random inputs; gradients whose scales span 1e-4..1 inside
each block, 30 % exact zeros): fp32 params within 2e-6 of the reference's largest |value| plus
1e-7 after 6 steps (the kernels evaluate the same expressions with fused multiply-adds);
bf16/fp16 params within two ulps (one rounding each of two steps) on >= 99 % of elements.
Quantized states: the fused paths dequantize, update and requantize as the reference does but
not in the same floating-point order, so a value within an ulp of a code boundary may take the
other code; to compare one update and not the divergence after such a flip, both runs take 5
reference steps, then one step of the backend under test, with a NaN gradient element per
tensor: params within the dense tolerance on >= 99 % of elements (one ulp for bf16/fp16) and
all within lr / 10, codes equal on >= 99 %, block scales within 1e-5 relative. Against bitsandbytes' 32-bit rules: 1e-6 of the largest
|param| after 20 steps.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math

import pytest
import torch

import leanopt
from leanopt.kernels import cpu_native, rules
from leanopt.optim.elementwise import ElementwiseOptimizer
from leanopt.quant import QuantizedState
import repo_modules
from registry import GENERIC, OPTIMIZERS, OptimizerCase, representatives

drift = repo_modules.benchmark("lowbit_vs_bnb")

# The library's elementwise optimizers and those defined outside it (tests/external_optimizer.py),
# and of the bf16-state variants the one that represents them: every variant's rule is held to
# the reference on every backend, fp32 and bf16 params, by tests/test_bf16_states.py.
ELEMENTWISE = [c for c in GENERIC if issubclass(c.cls, ElementwiseOptimizer) and (c.family != "bf16-states" or c.represents)]
BACKENDS = ["cpu"] + (["triton"] if importlib.util.find_spec("triton") else [])
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
SHAPES = [(1,), (7,), (300,), (2049,), (33, 65), (0,)]


@pytest.fixture(autouse=True)
def gpu_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton kernels interpreted at the chunk the GPU runs (2,048 elements a program, where
    the other tests' interpreted runs take 8x as many): SHAPES straddle it, so each rule's
    parity holds across programs of one tensor."""
    if "triton" in BACKENDS:
        from leanopt.kernels import triton_elementwise

        monkeypatch.setattr(triton_elementwise, "INTERPRETED_CHUNK", triton_elementwise.CHUNK)


def test_registry_lists_every_registered_optimizer() -> None:
    # One list: the tests' registry covers exactly the library's.
    assert sorted(c.name for c in OPTIMIZERS) == sorted(leanopt.optim.REGISTRY)
    for c in OPTIMIZERS:
        assert leanopt.optim.REGISTRY[c.name] is c.cls and c.cls.name == c.name


def test_every_family_has_one_representative() -> None:
    # Tests of a mechanism the rule does not enter run on registry.representatives(...): each
    # family (tests/registry.py) must have exactly one, of its own family, in every list.
    cases = GENERIC
    families = {c.family for c in cases}
    assert "" not in families, [c.name for c in cases if not c.family]
    for family in families:
        assert [c.represents for c in cases if c.family == family].count(True) == 1, family
    assert {c.family for c in representatives(cases)} == families


def test_unknown_name_is_a_value_error_listing_the_known() -> None:
    with pytest.raises(ValueError, match="lion8bit"):
        leanopt.optim.optimizer_class("lion16bit")
    assert leanopt.optim.optimizer_class("Lion8bit") is leanopt.Lion8bit


# (dtype, kwargs over the registry's): kept few, each cpu case compiles a graph once (a
# quantized one: 10-30 s on 2 cores). Every rule runs fp32 and bf16 params on every backend;
# fp16 params and maximize are the kernels' plumbing around the rule (a conversion of the param
# on load and store, a negated gradient before the rule runs), the same code for every rule of a
# family and independent of each other: one case per family runs both, in one graph. Decoupled
# weight decay is each rule's own and is held to the published implementation on every backend
# (test_matches_its_reference's variants).
RULE_VARIANTS = [
    (torch.float32, {}),
    (torch.bfloat16, {}),
]
FAMILY_VARIANTS = [
    (torch.float16, {"maximize": True, "weight_decay": 0.1}),
]
VARIANTS = RULE_VARIANTS + FAMILY_VARIANTS


def _parity_params(cases: list[OptimizerCase], backends: list[str]) -> list:
    """(case, backend, dtype, kwargs): RULE_VARIANTS for every case, FAMILY_VARIANTS too for
    each family's representative."""
    return [
        pytest.param(case, backend, dtype, kwargs, id=f"{dtype}-{kwargs}-{backend}-{case.name}")
        for case in cases for backend in backends
        for dtype, kwargs in RULE_VARIANTS + (FAMILY_VARIANTS if case.represents else [])
    ]  # fmt: skip


def _ulp(x: torch.Tensor) -> torch.Tensor:
    mant = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[x.dtype]
    mag = x.detach().float().abs().clamp_min(torch.finfo(x.dtype).tiny)
    return torch.exp2(torch.floor(torch.log2(mag)) - mant)


def _run(case: OptimizerCase, backend: str, dtype: torch.dtype, seed: int, kwargs: dict, steps: int = 6, switch_at: int = 0,
         peaks: dict | None = None):
    """``peaks``, when given, gets each dense state's largest magnitude per element over the steps."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in SHAPES]
    safe = hasattr(case.cls, "state_bits")

    def grad(shape):
        scale = 10.0 ** torch.randint(-4, 1, shape, generator=gen).float()  # 1e-4..1 in a block
        keep = torch.rand(shape, generator=gen) > 0.3  # exact zeros: momentum rounds toward 0
        return (torch.randn(shape, generator=gen) * scale * keep).to(dtype)

    grads = [[grad(s) for s in SHAPES] for _ in range(steps)]
    if safe:
        for g in grads[-1]:
            if g.numel() > 1:
                g.view(-1)[1] = float("nan")  # skipped: param kept, states reset
    kwargs = {**case.kwargs, **kwargs}
    if safe:
        kwargs["min_quant_size"] = 100  # small shapes take the quantized path, with a dense tail
    opt = case.cls(case.param_groups(params), backend="reference" if switch_at else backend, **kwargs)
    for step in range(steps):
        if switch_at and step == switch_at:
            opt.backend = backend
        for i, p in enumerate(params):
            p.grad = None if (step + i) % 5 == 4 else grads[step][i].clone()
        opt.step()
        for i, p in enumerate(params if peaks is not None else ()):
            for key, s in opt.state[p].items():
                if isinstance(s, torch.Tensor) and s.is_floating_point() and key != "step":
                    now = s.detach().float().abs()
                    peaks[i, key] = torch.maximum(peaks[i, key], now) if (i, key) in peaks else now
    return params, opt


@pytest.mark.parametrize("case,backend,dtype,kwargs", _parity_params(ELEMENTWISE, BACKENDS))
def test_backend_matches_reference(case: OptimizerCase, backend: str, dtype: torch.dtype, kwargs: dict) -> None:
    # "cpu" runs fp32 params with quantized states in the native C++ kernel where it builds.
    _matches_reference(case, backend, dtype, kwargs)


@pytest.mark.parametrize("case", representatives([c for c in ELEMENTWISE if hasattr(c.cls, "state_bits")]), ids=str)
@pytest.mark.parametrize("dtype,kwargs", RULE_VARIANTS, ids=lambda v: str(v))
def test_compiled_cpu_path_matches_reference(case: OptimizerCase, dtype: torch.dtype, kwargs: dict) -> None:
    # The compiled graph, where the native kernel does not run (or does not build), for the
    # cases the native kernel takes when it does: fp32 and bf16 params. One per family: the
    # graph's rule is held to the reference for every rule by the dense graphs and, with fp16
    # params (which the kernel never takes), by each family's representative in
    # test_backend_matches_reference; a rule without a twin here (RMSprop8bit) runs this graph
    # for every dtype there. The kernel is held to the bit to this graph (compiled and run
    # eagerly with fp32 params, run eagerly with bf16 params) and to the reference, for every
    # rule with a twin here, in tests/test_cpu_paths.py.
    with cpu_native.disabled():
        _matches_reference(case, "cpu", dtype, kwargs)


def _matches_reference(case: OptimizerCase, backend: str, dtype: torch.dtype, kwargs: dict) -> None:
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    quantized = hasattr(case.cls, "state_bits")
    # Quantized: the last step only, so that one flipped code is not followed by divergence.
    peaks: dict = {}
    ours, opt = _run(case, backend, dtype, seed, kwargs, switch_at=5 if quantized else 0, peaks=peaks)
    ref, ref_opt = _run(case, "reference", dtype, seed, kwargs, peaks=peaks)
    lr = case.kwargs["lr"]
    quantized_seen = 0
    for i, (p, r) in enumerate(zip(ours, ref)):
        if p.numel() == 0:
            continue
        diff = (p.float() - r.float()).abs()
        if dtype == torch.float32:
            close = diff <= 2e-6 * r.abs().max() + 1e-7
        else:
            # Dense: two ulps (one rounding each of two steps may go the other way); quantized: one.
            close = diff <= (1 if quantized else 2) * _ulp(r) * 1.001
        # bf16 states: a stochastic rounding may go the other way where the backends' fp32
        # arithmetic differs in the last bit (tests/test_bf16_states.py: <= 0.2 % of elements).
        bf16_states = case.kwargs.get("state_dtype") == torch.bfloat16
        need = 0.99 if quantized or dtype != torch.float32 else 0.998 if bf16_states else 1.0
        assert close.float().mean() >= need, f"seed {seed}"
        # No element off by a wrong update: within lr/10, or where a bf16/fp16 param rounds to a
        # coarser grid, two of its ulps (a bf16 state rounded the other way one step earlier moves
        # the next update a little, and the param's rounding of it can go the other way: one ulp,
        # 0.0039 at |p| ~ 0.5, more than lr/10 here).
        bound = lr / 10 if dtype == torch.float32 else torch.clamp(2 * _ulp(r) * 1.001, min=lr / 10)
        assert (diff <= bound).all(), f"seed {seed}: {diff.max()}"
        for key, want in ref_opt.state[r].items():
            got = opt.state[p][key]
            assert type(got) is type(want), key
            if isinstance(want, QuantizedState):
                quantized_seen += 1
                assert got.format == want.format and got.shape == want.shape
                assert (got.codes == want.codes).float().mean() >= 0.99, f"{key} codes, seed {seed}"
                torch.testing.assert_close(got.absmax, want.absmax, rtol=1e-5, atol=0, msg=lambda m: f"{key} absmax, seed {seed}: {m}")
            elif key != "step" and bf16_states:
                # A rounding that went the other way is one bf16 ulp of the state as it was then, and
                # later steps scale that gap by a decay <= 1 (the gradients do not depend on the
                # params): two such roundings are within two ulps of the element's largest magnitude
                # in either run. Not of its present one: a moment that decays to ~0 keeps its gap.
                gap = (got.float() - want.float()).abs()
                peak = peaks[i, key].to(torch.bfloat16)
                assert (gap <= 2 * _ulp(peak) * 1.001).all(), f"{key}, seed {seed}"
                assert (gap == 0).float().mean() >= 0.99, f"{key}, seed {seed}"
            elif key != "step":
                assert (got - want).abs().max() <= 2e-5 * want.abs().max() + 1e-7, f"{key}, seed {seed}"
    assert quantized_seen >= (3 if quantized else 0)  # 300, 2049 and 33x65 elements: quantized


def _plain_lion(p, grads, lr, b1, b2, wd):
    p, m = p.clone(), torch.zeros_like(p)
    for g in grads:
        p = p * (1 - lr * wd) - lr * torch.sign(b1 * m + (1 - b1) * g)
        m = b2 * m + (1 - b2) * g
    return p


def _plain_ademamix(p, grads, lr, b1, b2, b3, alpha, eps, wd, t_alpha=None, t_beta3=None):
    p, m1, m2, nu = p.clone(), torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p)
    for t, g in enumerate(grads, 1):
        a = min(t * alpha / t_alpha, alpha) if t_alpha else alpha
        b3t = b3
        if t_beta3:
            s = t / t_beta3
            b3t = min(math.exp(math.log(b1) * math.log(b3) / ((1 - s) * math.log(b3) + s * math.log(b1))), b3)
        m1 = b1 * m1 + (1 - b1) * g
        m2 = b3t * m2 + (1 - b3t) * g
        nu = b2 * nu + (1 - b2) * g * g
        p = p * (1 - lr * wd) - lr * (m1 / (1 - b1**t) + a * m2) / (nu.sqrt() / math.sqrt(1 - b2**t) + eps)
    return p


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
def test_fp32_rules_match_their_plain_formulas(backend: str) -> None:
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(4099, generator=gen, dtype=torch.float64)
    grads = [torch.randn(4099, generator=gen, dtype=torch.float64) for _ in range(20)]
    for make, plain in [
        (lambda ps: leanopt.Lion(ps, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, backend=backend),
         lambda: _plain_lion(p0, grads, 1e-3, 0.9, 0.99, 0.1)),
        (lambda ps: leanopt.AdEMAMix(ps, lr=1e-3, alpha=5.0, t_alpha=7, t_beta3=11, backend=backend),
         lambda: _plain_ademamix(p0, grads, 1e-3, 0.9, 0.999, 0.9999, 5.0, 1e-8, 1e-2, 7, 11)),
    ]:  # fmt: skip
        # fp64 (the triton backend takes fp32: run it there, compare at fp32 precision)
        dtype = torch.float32 if backend == "triton" else torch.float64
        w = torch.nn.Parameter(p0.to(dtype).clone())
        opt = make([w])
        for g in grads:
            w.grad = g.to(dtype)
            opt.step()
        want = plain()
        # fp32: the param itself is rounded to fp32 on each of the 20 steps, half an ulp each
        # (20 * 2**-24 = 1.2e-6 of |p|), besides its moments: 2.5e-6 of max |p| (measured up to
        # 1.2e-6 over 12 seeds; a seed drawn per run failed the 1e-6 bound this had).
        tol = 2.5e-6 if dtype == torch.float32 else 1e-12
        assert (w.double() - want).abs().max() <= tol * want.abs().max()


def _reference_class(path: str):
    module, name = path.rsplit(".", 1)
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return None
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("case", [c for c in GENERIC if c.reference is not None], ids=str)
@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
def test_matches_its_reference(case: OptimizerCase, backend: str) -> None:
    """Each optimizer against the published implementation of its rule (``case.reference``:
    torch's, bitsandbytes' 32-bit, transformers'), every declared variant, on fresh random
    inputs: after its steps every param within ``rtol`` of the reference's largest |value|."""
    ref = case.reference
    theirs_cls = _reference_class(ref.path)
    if theirs_cls is None:
        pytest.skip(f"{ref.path} is not installed")
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    gen = torch.Generator().manual_seed(seed)
    for variant in ref.variants:
        kwargs = {**case.kwargs, **variant}
        p0 = torch.randn(ref.shape, generator=gen)
        grads = [torch.randn(ref.shape, generator=gen) * 0.1 for _ in range(ref.steps)]
        out = []
        for make in (lambda ps: case.cls(ps, backend=backend, **kwargs), lambda ps: theirs_cls(ps, **kwargs, **ref.extra)):
            w = torch.nn.Parameter(p0.clone())
            opt = make([w])
            for g in grads:
                w.grad = g.clone()
                opt.step()
            out.append(w.detach())
        err = ((out[0] - out[1]).abs().max() / out[1].abs().max()).item()
        assert err <= ref.rtol, f"{variant}: {err:.3g} relative, seed {seed}"


@pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes not installed")
@pytest.mark.parametrize("case", [c for c in OPTIMIZERS if c.peer_drift is not None], ids=str)
def test_lowbit_drift_from_fp32_no_worse_than_bitsandbytes_8bit(case: OptimizerCase) -> None:
    """Side by side on the CPU (benchmarks/lowbit_vs_bnb.py): each optimizer's mean distance
    from its own fp32 rule after every step, on dense gaussian and on sparse, spiky gradients,
    3 seeds each, within ``case.peer_drift`` times bitsandbytes' 8-bit optimizer's from its own
    32-bit one (tests/registry.py: 1.05 for the 8-bit ones, their largest distance within
    1.5x); all finite. Lion's distances are counts of sign flips, 2 lr each."""
    bound = case.peer_drift
    for row in drift.compare(case.name, seeds=range(3), steps=120):
        assert row["finite"], row
        assert row["mean"] <= row["bnb_mean"] * bound[row["workload"]] + 1e-9, row
        if bound["max"] is not None:
            assert row["max"] <= row["bnb_max"] * bound["max"] + 1e-9, row


@pytest.mark.parametrize("case", GENERIC, ids=str)
def test_bytes_per_param(case: OptimizerCase) -> None:
    # A 1024 x 1024 weight with the registry's kwargs: its state, the 4-byte step left out.
    n = 1 << 20
    nbytes = leanopt.estimate(torch.nn.Linear(1024, 1024, bias=False, device="meta"), case.cls, **case.kwargs).bytes
    assert (nbytes - 4) / n <= case.bytes_per_param, (nbytes - 4) / n


def _nan_params() -> list:
    """Every quantized case on the reference (its states' reset codes); the fast backends apply
    the same skip mask (rules.skipped_elements) and are held to the reference, a NaN element included,
    for every rule by test_backend_matches_reference: one per family on them."""
    quantized = [c for c in ELEMENTWISE if hasattr(c.cls, "state_bits")]
    return [pytest.param(c, b, id=f"{b}-{c.name}") for c in quantized for b in ["reference", *BACKENDS] if b == "reference" or c.represents]


@pytest.mark.parametrize("case,backend", _nan_params())
def test_lowbit_nan_element_skipped_without_touching_neighbours(case: OptimizerCase, backend: str) -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(1024))
    opt = case.cls(case.param_groups([w]), backend=backend, min_quant_size=1, **case.kwargs)
    w.grad = torch.randn(1024)
    opt.step()
    twin = torch.nn.Parameter(w.detach().clone())
    twin_opt = case.cls([twin], backend=backend, min_quant_size=1, **case.kwargs)
    twin_opt.load_state_dict(opt.state_dict())
    g = torch.randn(1024)
    bad, zero = g.clone(), g.clone()
    bad[7] = float("nan")
    zero[7] = 0.0
    before = w.detach().clone()
    w.grad, twin.grad = bad, zero
    opt.step()
    twin_opt.step()
    assert w[7] == before[7]  # skipped: param kept
    assert torch.isfinite(w).all()
    keep = torch.arange(1024) != 7
    # Neighbours in the same block: what they would be with that element's gradient 0 (its
    # states reset instead, so the block scale can differ only through element 7 itself).
    assert (w.detach()[keep] - twin.detach()[keep]).abs().max() <= case.kwargs["lr"] / 10
    for key, value in opt.state[w].items():
        if isinstance(value, QuantizedState):
            # Reset to 0: the code nearest 0 (a second moment's zero-free code: its smallest value).
            smallest = value.format.book("cpu").values.abs().min() * value.absmax[7 // value.format.block_size]
            assert value.dequantize()[7].abs() <= smallest * (1 + 1e-6), key


def test_ademamix_slow_moment_bound_follows_the_beta3_schedule() -> None:
    # K_t by the recurrence with beta3_t equals the exact sum of (w_k^2 / u_k) over the history.
    hp = dict(beta1=0.9, beta2=0.999, beta3=0.9999, t_beta3=50, t_alpha=None, alpha=5.0)
    betas = [rules.ademamix_alpha_beta3(hp, t)[1] for t in range(1, 31)]
    for t in (1, 5, 30):
        total = 0.0
        for k in range(1, t + 1):
            w = (1 - betas[k - 1]) * math.prod(betas[j - 1] for j in range(k + 1, t + 1))
            u = (1 - hp["beta2"]) * hp["beta2"] ** (t - k)
            total += w * w / u
        assert rules.slow_moment_bound(hp, t) == pytest.approx(total, rel=1e-9)


# ---- one description, read by every backend; select routes around each backend's limits ------
def test_every_twin_reads_its_rule_as_the_rule_declares_it() -> None:
    # Each compiled twin declares the scalars it reads at each position and the flags it reads;
    # they must be the rule's, or the twin would never run (select routes around a mismatch).
    from leanopt.kernels import twins

    assert set(twins.NATIVE) <= set(rules.RULES) and set(twins.TRITON) <= set(rules.RULES)
    # Every shipped rule has a twin (Muon's momentum the C++ one only: a compiled graph on CUDA).
    assert set(twins.NATIVE) | set(twins.TRITON) == set(rules.RULES)
    for table in (twins.TRITON, twins.NATIVE):
        for name, twin in table.items():
            rule = rules.RULES[name]
            assert (twin.scalars, twin.flags) == (rule.scalars, rule.flags), name
            assert max(twin.states) <= rule.max_states, name
    # One numbering: the rules' order, read by the Triton helpers and (as -D flags) the C++ kernel.
    assert [rules.rule_id(r) for r in rules.RULES.values()] == list(range(len(rules.RULES)))
    assert all(f"-DLEANOPT_RULE_{n.upper()}={rules.rule_id(rules.RULES[n])}" in cpu_native._CFLAGS for n in twins.NATIVE)


def test_a_rule_describes_itself_and_its_schedule_must_agree() -> None:
    hp = rules.SGD.hyperparameters(dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=True, maximize=False))
    assert rules.SGD.flag_values(hp) == (True,) and len(rules.SGD.states(hp)) == 1
    assert rules.SGD.scalar_values(hp, 1, False) == (0.0, 0.9, 0.0, 1.0, 0.1)  # step 1: the buffer is d
    bad = dataclasses.replace(rules.SGD, scalars=("weight_decay", "momentum", "buffer_decay", "buffer_weight", "step_size"))
    with pytest.raises(ValueError, match="step_size"):
        bad.scalar_values(hp, 1, False)
    with pytest.raises(ValueError, match="distinct identifiers"):
        dataclasses.replace(rules.SGD, scalars=("lr", "lr"))
    assert rules.rule_id(bad) is None  # not the shipped rule: no twin runs it


def _hp(rule, **group):
    return rule.hyperparameters({"maximize": False, **group})


def test_select_routes_a_rule_without_a_twin_to_the_cpu_paths() -> None:
    from leanopt import kernels
    from leanopt.quant import BlockFormat
    from external_optimizer import RMSPROP

    p, g = torch.randn(5000), torch.randn(5000)
    hp = _hp(RMSPROP, lr=1e-3, alpha=0.99, eps=1e-8, weight_decay=0.0)
    assert kernels.select("cpu", RMSPROP, p, g, [torch.zeros(5000)], hp) == "cpu-dense"
    assert not cpu_native.eligible_dense(RMSPROP, p, g, [torch.zeros(5000)], hp)  # the compiled graph runs it
    q = BlockFormat("pow6-u8", 256).zeros((5000,), p.device)
    assert kernels.select("cpu", RMSPROP, p, g, [q], hp) == "cpu-quantized"
    assert not cpu_native.eligible(RMSPROP, p, g, [q], hp)
    if BACKENDS[-1] == "triton":  # interpreted: CPU tensors; the Triton kernels have no helper for it
        assert kernels.select("triton", RMSPROP, p, g, [torch.zeros(5000)], hp) == "cpu-dense"
        assert kernels.select("triton", RMSPROP, p, g, [q], hp) == "cpu-quantized"


def test_select_routes_zero_states_and_more_states_than_a_kernel_takes() -> None:
    from leanopt import kernels

    p, g = torch.randn(5000), torch.randn(5000)
    plain = _hp(rules.SGD, lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False)
    # Zero states: both kernels have SGD's loop without a momentum; the C++ kernel has none for
    # Lion without its state, so the CPU path compiles the rule there.
    assert kernels.select("cpu", rules.SGD, p, g, [], plain) == "cpu-dense"
    assert cpu_native.eligible_dense(rules.SGD, p, g, [], plain)
    with_buffer = {**plain, "momentum": 0.9}
    assert cpu_native.eligible_dense(rules.SGD, p, g, [torch.zeros(5000)], with_buffer)
    lion = _hp(rules.LION, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0)
    assert cpu_native.eligible_dense(rules.LION, p, g, [torch.zeros(5000)], lion)
    assert not cpu_native.eligible_dense(rules.LION, p, g, [], lion)
    adamw = _hp(rules.ADAMW, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=True)
    four = [torch.zeros(5000) for _ in range(4)]
    assert not cpu_native.eligible_dense(rules.ADAMW, p, g, four, adamw)
    if BACKENDS[-1] == "triton":
        assert kernels.select("triton", rules.SGD, p, g, [], plain) == "triton-dense"
        # Four states: more than the Triton kernels take; the CPU paths run it.
        assert kernels.select("triton", rules.ADAMW, p, g, four, adamw) == "cpu-dense"
        assert kernels.select("triton", rules.ADAMW, p, g, four[:3], adamw) == "triton-dense"


@pytest.mark.skipif("triton" not in BACKENDS, reason="triton not installed")
def test_triton_kernel_refuses_a_rule_it_has_no_helper_for() -> None:
    # Its last branch used to run AdEMAMix for any unknown rule number.
    from leanopt.kernels import triton_elementwise
    from leanopt.kernels.multi_tensor import TableCache
    from external_optimizer import RMSPROP

    p, g, v = torch.randn(64), torch.randn(64), torch.zeros(64)
    before = p.clone()
    hp = _hp(RMSPROP, lr=1e-3, alpha=0.99, eps=1e-8, weight_decay=0.0)
    with pytest.raises(Exception, match="no Triton helper"):
        triton_elementwise.dense(RMSPROP, TableCache(), "t", [p], [g], [[v]], [1], hp, safe=False)
    assert torch.equal(p, before)


def test_native_kernel_refuses_a_rule_number_it_has_no_loop_for() -> None:
    if not cpu_native.available():
        pytest.skip(f"native CPU kernel unavailable: {cpu_native.build_error()}")
    module = cpu_native._module()
    p, g, s = torch.zeros(8), torch.zeros(8), torch.zeros(8)
    with pytest.raises(ValueError, match="no loop for this rule number"):
        module.step_dense(len(rules.RULES), 0, False, False, p.data_ptr(), g.data_ptr(), False, 8, [s.data_ptr()], [0.0] * 5,
                          0, 1, 0)  # fmt: skip


@pytest.mark.parametrize("case", GENERIC, ids=str)
def test_constructor_defaults_step_save_and_load(case: OptimizerCase) -> None:
    # Every optimizer once with nothing but its own defaults (SGD: momentum 0, no state at all).
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 80), torch.nn.Tanh(), torch.nn.Linear(80, 1))
    opt = case.cls(case.param_groups(model))
    x, y = torch.randn(32, 64), torch.randn(32, 1)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    assert leanopt.estimate(model, case.cls).bytes == leanopt.measure(opt).bytes
    twin = case.cls(case.param_groups(model))
    twin.load_state_dict(opt.state_dict())
    assert twin.state_dict()["state"].keys() == opt.state_dict()["state"].keys()
