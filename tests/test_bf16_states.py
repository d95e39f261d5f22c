"""bf16 states (``state_dtype=torch.bfloat16``, leanopt.quant.bf16): the rounding, every backend
against the reference, the byte count, validation, conversion and inspection.

The generic suite (tests/test_generic.py) runs one ``registry.BF16_STATES`` case per number of
states (1, 2, 3; ``registry.GENERIC``) too: loss goes down, state_dict round trips and deepcopies continue bit-identically (the
rounding's dither is a function of the step and the element's index), estimate == measure.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import leanopt
from leanopt.checkpoint import convert_state_dict, state_dict_layout
from leanopt.memory.inspect import inspect_state_dict
from leanopt.quant.bf16 import state_dither, stochastic_bf16
from registry import BF16_STATES, OptimizerCase, registered

BACKENDS = ["cpu"] + (["triton"] if importlib.util.find_spec("triton") else [])
# Every case on fp32 params on every backend; bf16 params for the family's representative only:
# the param's conversion on load and store is the kernels' plumbing around the rule, the same for
# every rule (as in tests/test_rules.py), and on the CPU each (rule, param dtype) is a graph of its
# own to compile (4-12 s on 2 cores).
CASE_BACKENDS = [
    pytest.param(c, b, dtype, id=f"{dtype}-{c.name}-{b}")
    for c in BF16_STATES for b in BACKENDS if b in c.backends
    for dtype in ([torch.float32, torch.bfloat16] if c.represents else [torch.float32])
]  # fmt: skip


def _ulp_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 numbers apart ``a`` and ``b`` (bf16, finite, same sign or zero) are."""
    return (a.view(torch.int16).to(torch.int32) - b.view(torch.int16).to(torch.int32)).abs()


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour() -> None:
    torch.manual_seed(0)
    x = torch.randn(64) * 10.0 ** torch.randint(-20, 20, (64,)).float()
    draws = 20_000
    u = state_dither(64 * draws, 0, 3, 0, 1).view(draws, 64)
    out = stochastic_bf16(x.expand(draws, 64), u).float()
    down = x.to(torch.bfloat16).float()
    lo, hi = torch.minimum(down, out.min(0).values), torch.maximum(down, out.max(0).values)
    assert torch.all(out.min(0).values >= lo) and torch.all(out.max(0).values <= hi)
    # At most two values per element, the neighbours of x; their mean is x to sampling error.
    assert all(len(torch.unique(out[:, i])) <= 2 for i in range(64))
    gap = (hi - lo).clamp(min=torch.finfo(torch.float32).tiny)
    bias = (out.mean(0) - x).abs() / gap
    assert bias.max() < 0.02, bias.max()
    exact = torch.tensor([0.0, -0.0, 1.0, -2.5, float("inf"), -float("inf")])
    assert torch.equal(stochastic_bf16(exact, torch.full((6,), 0.999)).float(), exact)
    assert torch.isnan(stochastic_bf16(torch.tensor([float("nan")]), torch.tensor([0.9]))).all()


def test_nearest_rounding_would_stall_the_second_moment_stochastic_does_not() -> None:
    # v = 0.999 v + 0.001 g^2 with g^2 = 2 v: +0.1% per step, under half a bf16 ulp (0.2-0.4%).
    v = torch.ones(4096)
    nearest, stochastic = v.bfloat16(), v.bfloat16()
    for step in range(1, 201):
        nearest = (0.999 * nearest.float() + 0.002 * v).bfloat16()
        stochastic = stochastic_bf16(0.999 * stochastic.float() + 0.002 * v, state_dither(4096, 0, step, 0, 1))
        v = 0.999 * v + 0.002 * v
    assert torch.all(nearest.float() == 1.0)  # stuck
    assert abs(stochastic.float().mean().item() / v[0].item() - 1) < 2e-3


@pytest.mark.parametrize("case,backend,param_dtype", CASE_BACKENDS)
def test_backend_matches_the_reference(case: OptimizerCase, backend: str, param_dtype: torch.dtype) -> None:
    """Fresh random inputs, 6 steps. The backends write the same dither, so a state element
    differs from the reference's only where their fp32 maths differ by rounding and the dither
    falls between the two: at most one bf16 ulp, on at most 0.2% of elements; params within
    1e-5 relative (fp32) or one bf16 ulp (bf16). Where a state's update cancels to ~0, one fp32
    maths can leave a residue (measured: -8.7e-11 against the reference's 0, AdamW's exp_avg with
    bf16 gradients, scale ~0.05) that bf16 keeps: neighbours in value, thousands of ulps apart
    by bit pattern, so differences under 2^-20 of the state's largest magnitude count as none."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    n = 3001  # not a multiple of any chunk
    out = {}
    with registered(case):
        for b in ("reference", backend):
            gen = torch.Generator().manual_seed(seed)
            w = torch.nn.Parameter(torch.randn(n, generator=gen).to(param_dtype))
            opt = case.cls(case.param_groups([w]), backend=b, **case.kwargs)
            for _ in range(6):
                w.grad = (torch.randn(n, generator=gen) * 0.1).to(param_dtype)
                opt.step()
            out[b] = (w.detach().clone(), {k: v.clone() for k, v in opt.state[w].items() if k != "step"})
    (p_ref, s_ref), (p, s) = out["reference"], out[backend]
    for key, ref in s_ref.items():
        assert s[key].dtype == torch.bfloat16 and ref.dtype == torch.bfloat16, key
        apart = _ulp_steps(s[key], ref)
        residue = (s[key].float() - ref.float()).abs() <= 2**-20 * ref.float().abs().max()
        apart = torch.where(residue, 0, apart)
        assert apart.max() <= 1 and (apart > 0).float().mean() <= 2e-3, (key, apart.max(), (apart > 0).sum(), seed)
    if param_dtype == torch.float32:
        err = ((p - p_ref).abs().max() / p_ref.abs().max()).item()
        assert err <= 1e-5, (err, seed)
    else:
        assert _ulp_steps(p, p_ref).max() <= 1, seed


def test_same_bits_whatever_the_split() -> None:
    """The dither is keyed on global indices: a tensor stepped in two shards (offsets) stores
    what it stores stepped whole, on the reference and on the CPU path."""
    from leanopt import kernels
    from leanopt.kernels import rules

    torch.manual_seed(0)
    hp = rules.ADAMW.hyperparameters(dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False,
                                          maximize=False))  # fmt: skip
    p0, g = torch.randn(5000), torch.randn(5000)
    for backend in ("reference", "cpu"):
        whole_p, whole_s = p0.clone(), [torch.zeros(5000, dtype=torch.bfloat16) for _ in range(2)]
        kernels.step(backend, rules.ADAMW, None, "w", [whole_p], [g], [whole_s], [1], hp, safe=False)
        split_p, split_s = p0.clone(), [torch.zeros(5000, dtype=torch.bfloat16) for _ in range(2)]
        parts = [(0, 1234), (1234, 5000)]
        kernels.step(backend, rules.ADAMW, None, "w", [split_p[a:b] for a, b in parts], [g[a:b] for a, b in parts],
                     [[s[a:b] for s in split_s] for a, b in parts], [1, 1], hp, safe=False, offsets=[a for a, _ in parts])  # fmt: skip
        assert torch.equal(whole_p, split_p) and all(torch.equal(x, y) for x, y in zip(whole_s, split_s)), backend


def test_eager_cpu_path_stores_the_compiled_bits(monkeypatch) -> None:
    """Where the rules are not compiled, the CPU path runs the same function over chunks (each
    keyed by its global offset): the same states and params as the compiled graph."""
    from leanopt.kernels import cpu_elementwise

    out = []
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setattr(cpu_elementwise, "can_compile", lambda: False)
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(3 * cpu_elementwise.EAGER_CHUNK + 17))
        opt = leanopt.AdEMAMix([w], backend="cpu", state_dtype=torch.bfloat16)
        for _ in range(3):
            w.grad = torch.randn_like(w)
            opt.step()
        out.append((w.detach().clone(), [opt.state[w][k] for k in ("exp_avg_fast", "exp_avg_slow", "exp_avg_sq")]))
    (p0, s0), (p1, s1) = out
    assert all(torch.equal(a, b) for a, b in zip(s0, s1))
    assert ((p0 - p1).abs().max() / p0.abs().max()).item() <= 1e-6


def test_adamw_keeps_four_bytes_per_param_and_the_step() -> None:
    model = torch.nn.Linear(1024, 1024, bias=False, device="meta")
    est = leanopt.estimate(model, leanopt.AdamW, state_dtype=torch.bfloat16)
    assert est.bytes == 4 * 1024 * 1024 + 4
    w = torch.nn.Parameter(torch.randn(1024, 1024))
    opt = leanopt.AdamW([w], state_dtype=torch.bfloat16)
    w.grad = torch.randn_like(w)
    opt.step()
    assert leanopt.measure(opt).bytes == est.bytes


@pytest.mark.parametrize("value", [torch.int8, torch.float16, torch.float64, "bf16", "int8", 16])
def test_invalid_state_dtype_is_a_value_error_naming_it(value) -> None:
    w = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match="state_dtype"):
        leanopt.AdamW([w], state_dtype=value)
    opt = leanopt.Lion([w])
    with pytest.raises(ValueError, match="state_dtype"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(4))], "state_dtype": value})
    assert len(opt.param_groups) == 1


def test_a_group_may_store_its_states_in_bf16() -> None:
    a, b = torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(8))
    opt = leanopt.AdamW([{"params": [a]}, {"params": [b], "state_dtype": torch.bfloat16}])
    a.grad, b.grad = torch.randn(8), torch.randn(8)
    opt.step()
    assert opt.state[a]["exp_avg"].dtype == torch.float32 and opt.state[b]["exp_avg"].dtype == torch.bfloat16


def _trained(cls, steps: int = 3, **kwargs) -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(128, 64))
    opt = cls([w], **kwargs)
    for _ in range(steps):
        w.grad = torch.randn_like(w)
        opt.step()
    return w, opt


def test_checkpoints_convert_between_fp32_bf16_and_8bit_states() -> None:
    w, opt = _trained(leanopt.AdamW, state_dtype=torch.bfloat16)
    sd = opt.state_dict()
    assert state_dict_layout(sd) == "adamw" and sd["param_groups"][0]["state_dtype"] == "bfloat16"
    fp32 = convert_state_dict(sd, to="adamw")
    assert fp32["param_groups"][0]["state_dtype"] == "float32" and fp32["state"][0]["exp_avg"].dtype == torch.float32
    assert torch.equal(fp32["state"][0]["exp_avg"], sd["state"][0]["exp_avg"].float())  # exact upcast
    eight = convert_state_dict(sd, to="adamw8bit")
    assert state_dict_layout(eight) == "adamw8bit"
    back = convert_state_dict(eight, to="adamw", state_dtype=torch.bfloat16)
    assert back["state"][0]["exp_avg_sq"].dtype == torch.bfloat16
    deq = convert_state_dict(eight, to="adamw")["state"][0]["exp_avg_sq"]
    assert torch.equal(back["state"][0]["exp_avg_sq"], deq.to(torch.bfloat16))
    # Each loads and continues; the loading optimizer's state_dtype decides the storage.
    for converted, cls, kwargs, stored in [(fp32, leanopt.AdamW, {}, torch.float32),
                                           (fp32, leanopt.AdamW, {"state_dtype": torch.bfloat16}, torch.bfloat16),
                                           (back, leanopt.AdamW, {"state_dtype": torch.bfloat16}, torch.bfloat16),
                                           (sd, leanopt.AdamW, {}, torch.float32)]:  # fmt: skip
        twin = cls([w], **kwargs)
        twin.load_state_dict(converted)
        assert twin.state[w]["exp_avg"].dtype == stored
        w.grad = torch.randn_like(w)
        twin.step()
        assert torch.isfinite(w).all()
    with pytest.raises(ValueError, match="state_dtype"):
        convert_state_dict(sd, to="adamw", state_dtype=torch.float16)


def test_a_loaded_bf16_state_continues_bit_identically() -> None:
    w, opt = _trained(leanopt.AdamW, state_dtype=torch.bfloat16)
    twin_w = torch.nn.Parameter(w.detach().clone())
    twin = leanopt.AdamW([twin_w], state_dtype=torch.bfloat16)
    twin.load_state_dict(opt.state_dict())
    for _ in range(3):
        g = torch.randn_like(w)
        w.grad, twin_w.grad = g, g.clone()
        opt.step()
        twin.step()
    assert torch.equal(w, twin_w)
    assert all(torch.equal(opt.state[w][k], twin.state[twin_w][k]) for k in ("exp_avg", "exp_avg_sq"))


def test_inspect_shows_bf16_states() -> None:
    _, opt = _trained(leanopt.AdamW, state_dtype=torch.bfloat16)
    report = inspect_state_dict(opt.state_dict())
    assert report.dtypes_by_key["exp_avg"] == ["bfloat16"] and report.dtypes_by_key["exp_avg_sq"] == ["bfloat16"]
    _, fp32 = _trained(leanopt.AdamW)
    assert report.bytes * 2 - 4 == inspect_state_dict(fp32.state_dict()).bytes


def test_param_groups_hold_the_name_and_a_dcp_writer_takes_the_state_dict(tmp_path) -> None:
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    w = torch.nn.Parameter(torch.randn(8, 4))
    opt = leanopt.AdamW([w], state_dtype=torch.bfloat16)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(4))], "state_dtype": "float32"})
    assert [g["state_dtype"] for g in opt.param_groups] == ["bfloat16", "float32"]
    w.grad = torch.randn_like(w)
    opt.step()
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=str(tmp_path / "dcp"))  # refused a torch.dtype value
    assert opt.state[w]["exp_avg"].dtype == torch.bfloat16
