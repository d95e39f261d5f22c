"""leanopt.Adafactor against transformers' Adafactor, its two fixed defects, its layout and checks."""

from __future__ import annotations

import io
import itertools
import zlib

import pytest
import torch

import leanopt
from registry import ADAFACTOR_INVALID

hf_optimization = pytest.importorskip("transformers.optimization")
HFAdafactor = hf_optimization.Adafactor

RTOL = 1e-5
STEPS = 20
# The rule itself is compared with transformers here; the fast backends ("cpu", "triton") sum
# in other orders and are compared with the reference in test_backends_adafactor.py.
BACKEND = "reference"
# (shape, init scale): 1-D, 2-D, 3-D, and a 2-D one whose RMS stays under eps2 = 1e-3, so
# scale_parameter takes its floor branch.
PARAM_SPECS = [((7,), 1.0), ((5, 6), 1.0), ((3, 4, 5), 1.0), ((4, 3), 1e-4)]


def _flag_grid() -> list:
    cases = []
    for scale_parameter, relative_step, warmup_init, beta1, weight_decay in itertools.product(
        (True, False), (True, False), (False, True), (None, 0.9), (0.0, 0.01)
    ):
        if warmup_init and not relative_step:
            continue  # transformers refuses it too
        kw = dict(
            scale_parameter=scale_parameter,
            relative_step=relative_step,
            warmup_init=warmup_init,
            beta1=beta1,
            weight_decay=weight_decay,
        )
        if not relative_step:
            kw["lr"] = 1e-2
        name = "-".join(f"{k}={v}" for k, v in kw.items())
        cases.append(pytest.param(kw, id=name))
    return cases


def _seed(request: pytest.FixtureRequest) -> int:
    return zlib.crc32(request.node.nodeid.encode())


def _make_params(gen: torch.Generator, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [(torch.randn(shape, generator=gen) * scale).to(dtype) for shape, scale in PARAM_SPECS]


def _grads(gen: torch.Generator, params: list[torch.Tensor], t: int) -> list[torch.Tensor | None]:
    """Step ``t``'s gradients: every param misses some steps, scales vary (clipping engages), zero rows."""
    out: list[torch.Tensor | None] = []
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen) * 10.0 ** torch.empty(()).uniform_(-2, 1, generator=gen).item()
        if (t + i) % 4 == 0:
            out.append(None)
            continue
        if g.ndim >= 2 and t % 3 == 0:
            g[..., 0, :] = 0.0  # a zero row now and then
        # Always zero (1-D element 0, the last param's row 0): that second moment is eps1 alone.
        if g.ndim == 1:
            g[0] = 0.0
        elif i == len(params) - 1:
            g[..., 0, :] = 0.0
        out.append(g.to(p.dtype))
    return out


def _set_grads(params: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone()


def _max_rel_err(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> float:
    """Largest elementwise |a - b| / |b| over the list (a tensor's exact zeros must match)."""
    worst = 0.0
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape and a.dtype == b.dtype
        a64, b64 = a.detach().double(), b.detach().double()
        assert torch.equal(a64 == 0, b64 == 0)
        err = (a64 - b64).abs() / b64.abs().clamp(min=torch.finfo(torch.float64).tiny)
        worst = max(worst, err.max().item() if err.numel() else 0.0)
    return worst


def _compare_to_hf(
    ours_params: list[torch.Tensor], ours: leanopt.Adafactor, hf_params: list[torch.Tensor], hf: HFAdafactor
) -> float:
    a_list, b_list = list(ours_params), list(hf_params)
    for p_ours, p_hf in zip(ours_params, hf_params):
        s_ours, s_hf = ours.state[p_ours], hf.state[p_hf]
        assert set(s_ours) == set(s_hf) - {"RMS"}
        if not s_hf:
            continue
        assert s_ours["step"].dtype == torch.float32 and s_ours["step"].device.type == "cpu"
        assert int(s_ours["step"].item()) == int(s_hf["step"])
        for key in sorted(set(s_ours) - {"step"}):
            assert s_ours[key].dtype == torch.float32
            a_list.append(s_ours[key])
            b_list.append(s_hf[key])
    return _max_rel_err(a_list, b_list)


def _run_both(kw: dict, seed: int, steps: int = STEPS) -> float:
    gen = torch.Generator().manual_seed(seed)
    init = _make_params(gen)
    ours_params = [p.clone().requires_grad_() for p in init]
    hf_params = [p.clone().requires_grad_() for p in init]
    ours, hf = leanopt.Adafactor(ours_params, backend=BACKEND, **kw), HFAdafactor(hf_params, **kw)
    for t in range(1, steps + 1):
        grads = _grads(gen, init, t)
        _set_grads(ours_params, grads)
        _set_grads(hf_params, grads)
        ours.step()
        hf.step()
    return _compare_to_hf(ours_params, ours, hf_params, hf)


@pytest.mark.parametrize("kw", _flag_grid())
def test_matches_transformers(kw: dict, request: pytest.FixtureRequest) -> None:
    err = _run_both(kw, _seed(request))
    assert err <= RTOL, f"max relative error {err:.3g} vs transformers"


def test_defaults_match_transformers() -> None:
    import inspect

    ours = dict(inspect.signature(leanopt.Adafactor).parameters)
    theirs = inspect.signature(HFAdafactor).parameters
    # leanopt's additions are keyword-only, after transformers' parameters.
    assert ours.pop("backend").kind is inspect.Parameter.KEYWORD_ONLY
    assert ours.pop("rounding").kind is inspect.Parameter.KEYWORD_ONLY
    assert ours.pop("offload").kind is inspect.Parameter.KEYWORD_ONLY
    assert list(ours) == list(theirs)
    assert {k: v.default for k, v in ours.items()} == {k: v.default for k, v in theirs.items()}


# ---- defect 1: transformers runs the closure under no_grad, so its backward() fails -------------
def test_closure_runs_with_grad_enabled() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(16, 4), torch.randn(16, 3)
    opt = leanopt.Adafactor(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.grad_fn is not None
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert torch.is_grad_enabled()  # step's no_grad did not leak


# ---- defect 2: fp32 state of low-precision params must survive a checkpoint round trip -----------
def _save_load(obj: dict) -> dict:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("beta1", [None, 0.9])
def test_low_precision_state_stays_fp32_through_checkpoint(
    dtype: torch.dtype, beta1: float | None, request: pytest.FixtureRequest
) -> None:
    gen = torch.Generator().manual_seed(_seed(request))
    init = _make_params(gen, dtype)
    kw = dict(beta1=beta1, weight_decay=0.01)
    params = [p.clone().requires_grad_() for p in init]
    opt = leanopt.Adafactor(params, **kw)
    grads = [_grads(gen, init, t) for t in range(1, 13)]
    for g in grads[:6]:
        _set_grads(params, g)
        opt.step()

    resumed_params = [p.detach().clone().requires_grad_() for p in params]
    resumed = leanopt.Adafactor(resumed_params, **kw)
    resumed.load_state_dict(_save_load(opt.state_dict()))
    for p, q in zip(params, resumed_params):
        assert set(resumed.state[q]) == set(opt.state[p])
        for key, value in resumed.state[q].items():
            assert value.dtype == torch.float32, key
            assert torch.equal(value, opt.state[p][key]), key

    # The bf16 params changed in bf16 with fp32 maths: a resumed run continues bit for bit.
    for g in grads[6:]:
        _set_grads(params, g)
        _set_grads(resumed_params, g)
        opt.step()
        resumed.step()
    for p, q in zip(params, resumed_params):
        assert p.dtype == dtype and torch.equal(p, q)
        for key in opt.state[p]:
            assert torch.equal(opt.state[p][key], resumed.state[q][key]), key


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_params_follow_transformers(dtype: torch.dtype, request: pytest.FixtureRequest) -> None:
    # Both upcast, compute in fp32 and round to the param dtype once per step: the same arithmetic.
    gen = torch.Generator().manual_seed(_seed(request))
    init = _make_params(gen, dtype)
    ours_params = [p.clone().requires_grad_() for p in init]
    hf_params = [p.clone().requires_grad_() for p in init]
    kw = dict(beta1=0.9, weight_decay=0.01)
    ours, hf = leanopt.Adafactor(ours_params, backend=BACKEND, **kw), HFAdafactor(hf_params, **kw)
    for t in range(1, 11):
        grads = _grads(gen, init, t)
        _set_grads(ours_params, grads)
        _set_grads(hf_params, grads)
        ours.step()
        hf.step()
    assert all(p.dtype == dtype for p in ours_params)
    assert _compare_to_hf(ours_params, ours, hf_params, hf) <= RTOL


# ---- resuming from a transformers checkpoint ----------------------------------------------------
@pytest.mark.parametrize("kw", [{}, dict(beta1=0.9, weight_decay=0.01), dict(lr=1e-2, relative_step=False)])
def test_loads_transformers_state_dict_and_continues(kw: dict, request: pytest.FixtureRequest) -> None:
    gen = torch.Generator().manual_seed(_seed(request))
    init = _make_params(gen) + [torch.randn(3, 2, generator=gen)]  # the last one never gets a gradient
    hf_params = [p.clone().requires_grad_() for p in init]
    hf = HFAdafactor(hf_params, **kw)
    grads = [_grads(gen, init[:-1], t) + [None] for t in range(1, 16)]
    for g in grads[:7]:
        _set_grads(hf_params, g)
        hf.step()

    sd = _save_load(hf.state_dict())
    assert isinstance(sd["state"][0]["step"], int)  # what transformers saves: a python int step
    ours_params = [p.detach().clone().requires_grad_() for p in hf_params]
    ours = leanopt.Adafactor(ours_params, backend=BACKEND, **kw)
    ours.load_state_dict(sd)
    for p, q in zip(ours_params, hf_params):
        assert "RMS" not in ours.state[p]
        if hf.state[q]:
            step = ours.state[p]["step"]
            assert step.shape == () and step.dtype == torch.float32 and step.device.type == "cpu"
            assert step.item() == hf.state[q]["step"]
    # With relative_step, transformers' lr is None; ours reports the relative step size to come.
    # ours adds its own options (rounding) and declared identity ("optimizer": "adafactor").
    reported = lambda g: {k: v for k, v in g.items() if k not in ("params", "rounding", "optimizer") and not (k == "lr" and g["relative_step"])}  # noqa: E731
    assert [reported(g) for g in ours.param_groups] == [reported(g) for g in hf.param_groups]
    assert all(g["optimizer"] == "adafactor" for g in ours.param_groups)
    for g in ours.param_groups:
        assert g["lr"] == (min(1e-2, 1 / 8**0.5) if g["relative_step"] else kw["lr"])

    for g in grads[7:]:
        _set_grads(ours_params, g)
        _set_grads(hf_params, g)
        ours.step()
        hf.step()
    assert _compare_to_hf(ours_params, ours, hf_params, hf) <= RTOL


# ---- layout: exactly what is allocated ----------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("beta1", [None, 0.9])
def test_layout_is_what_is_allocated(dtype: torch.dtype, beta1: float | None) -> None:
    shapes = [(), (5,), (4, 6), (2, 3, 4), (2, 1, 3, 5)]
    params = [torch.randn(s, dtype=dtype, requires_grad=True) for s in shapes]
    opt = leanopt.Adafactor(params, beta1=beta1)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    for p in params:
        layout = opt.state_layout(tuple(p.shape), p.dtype, opt.param_groups[0])
        state = opt.state[p]
        assert [s.key for s in layout] == list(state)
        for spec in layout:
            t = state[spec.key]
            assert (tuple(t.shape), t.dtype) == (spec.shape, spec.dtype), spec.key
            assert t.device.type == "cpu"
        assert sum(s.nbytes() for s in layout) == sum(t.numel() * t.element_size() for t in state.values())
        keys = {"step"} | ({"exp_avg"} if beta1 is not None else set())
        keys |= {"exp_avg_sq_row", "exp_avg_sq_col"} if p.ndim >= 2 else {"exp_avg_sq"}
        assert set(state) == keys
        if p.ndim >= 2:
            assert state["exp_avg_sq_row"].shape == p.shape[:-1]
            assert state["exp_avg_sq_col"].shape == p.shape[:-2] + p.shape[-1:]
            assert state["exp_avg_sq_row"].dtype == state_dtype
    # FACTS: a 2-D [n, m] fp32 param costs 4(n + m) bytes (+ 4nm with beta1), plus the 4-byte step.
    spec_bytes = sum(s.nbytes() for s in opt.state_layout((4, 6), torch.float32, opt.param_groups[0]))
    assert spec_bytes == 4 * (4 + 6) + (4 * 4 * 6 if beta1 is not None else 0) + 4


# ---- hyper-parameters ---------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ADAFACTOR_INVALID, ids=repr)
def test_invalid_hyperparameters(bad: dict) -> None:
    p = [torch.zeros(3, requires_grad=True)]
    with pytest.raises(ValueError):
        leanopt.Adafactor(p, **bad)
    with pytest.raises(ValueError):
        leanopt.Adafactor(p, **{"lr": 1e-2, "relative_step": False, "scale_parameter": False, **bad})


def test_transformers_messages_and_group_checks() -> None:
    p, q = torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match="Cannot combine manual `lr` and `relative_step=True`"):
        leanopt.Adafactor([p], lr=1e-3)
    with pytest.raises(ValueError, match="`warmup_init=True` requires `relative_step=True`"):
        leanopt.Adafactor([p], lr=1e-3, relative_step=False, warmup_init=True)
    opt = leanopt.Adafactor([p])  # relative_step: a group may not bring its own lr
    with pytest.raises(ValueError):
        opt.add_param_group({"params": [q], "lr": 1e-3})
    opt.add_param_group({"params": [q], "relative_step": False, "lr": 1e-3, "eps": [1e-30, 1e-3]})
    assert opt.param_groups[1]["eps"] == (1e-30, 1e-3)


def test_sparse_gradient_raises() -> None:
    p = torch.zeros(4, 3, requires_grad=True)
    opt = leanopt.Adafactor([p])
    p.grad = torch.zeros(4, 3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()



def test_zero_size_params_keep_finite_state() -> None:
    # transformers' column mean over an empty dim is NaN; an empty param has nothing to update.
    empty = [torch.zeros(0, 5, requires_grad=True), torch.zeros(3, 0, 2, requires_grad=True)]
    opt = leanopt.Adafactor(empty, beta1=0.9)
    for _ in range(2):
        for p in empty:
            p.grad = torch.zeros_like(p)
        opt.step()
    for p in empty:
        assert opt.state[p]["step"].item() == 2
        assert all(torch.isfinite(v).all() for v in opt.state[p].values())


@pytest.mark.parametrize("release", [False, True], ids=["kept", "released"])
def test_the_reported_step_size_is_the_same_offloaded(release: bool) -> None:
    # relative_step reports its step size as each group's lr. Params with different step counts
    # (one gets a gradient every other step): the offloaded step, one param at a time, reports
    # what the on-device step does -- the group's most advanced param's -- not the last one's.
    runs = []
    for offload in (None, "cpu"):
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({"often": torch.nn.Linear(8, 8), "seldom": torch.nn.Linear(8, 8)})
        opt = leanopt.Adafactor(model.parameters(), warmup_init=True, offload=offload)
        handle = leanopt.release_gradients(model, opt) if release and offload else None
        lrs = []
        for step in range(6):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            y = model["often"](x) + (model["seldom"](x) if step % 2 == 0 else 0)
            y.square().mean().backward()
            opt.step()
            opt.zero_grad()
            lrs.append(opt.param_groups[0]["lr"])
        if handle is not None:
            handle.remove()
        runs.append((lrs, opt.state_dict()))
    (lrs, sd), (off_lrs, off_sd) = runs
    assert off_lrs == lrs and lrs[-1] == pytest.approx(6e-6)  # min(1e-6 * t, 1/sqrt(t)) at t = 6
    assert off_sd["param_groups"] == sd["param_groups"]
    assert all(torch.equal(a, b) for st, off in zip(sd["state"].values(), off_sd["state"].values())
               for a, b in zip(st.values(), off.values()))  # fmt: skip
