"""The same suite over every optimizer in ``registry.GENERIC``: the library's and those defined outside it.

A test of what the rule decides (the loss it reaches, its state through save, load and copies,
its hyper-parameters, its memory) runs on every case (``cases``); a test of a mechanism of
LeanOptimizer that the rule does not enter runs on one case per family (``families``,
``registry.representatives``), and says why."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import inspect
import io

import pytest
import torch

import leanopt
from registry import GENERIC, OptimizerCase, representatives

cases = pytest.mark.parametrize("case", GENERIC, ids=str)
families = pytest.mark.parametrize("case", representatives(GENERIC), ids=str)


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    # The first weight has 8192 elements, so quantized optimizers quantize it; the rest stay small.
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1)).to(dtype)


def batch(seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 32, generator=g)
    y = torch.sin(x[:, :1] * 2) + 0.5 * x[:, 1:2]
    return x.to(dtype), y.to(dtype)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, start: int = 0) -> list[float]:
    losses = []
    for s in range(start, start + steps):
        x, y = batch(s, next(model.parameters()).dtype)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def params_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@cases
def test_loss_goes_down(case: OptimizerCase) -> None:
    model = make_model()
    x, y = batch(10_000)  # held out

    def held_out_loss() -> float:
        with torch.no_grad():
            return torch.nn.functional.mse_loss(model(x), y).item()

    before = held_out_loss()
    train(model, case.cls(case.param_groups(model), **case.kwargs), 30)
    assert held_out_loss() < 0.6 * before


@cases
def test_state_dict_round_trip_continues_bit_identically(case: OptimizerCase, tmp_path) -> None:
    model = make_model()
    opt = case.cls(case.param_groups(model), **case.kwargs)
    train(model, opt, 5)
    path = tmp_path / "optimizer.pt"
    torch.save(opt.state_dict(), path)
    twin = copy.deepcopy(model)
    twin_opt = case.cls(case.param_groups(twin), **case.kwargs)
    twin_opt.load_state_dict(torch.load(path, weights_only=True))
    train(model, opt, 5, start=5)
    train(twin, twin_opt, 5, start=5)
    assert_same(params_of(model), params_of(twin))


@cases
def test_deepcopy_continues_bit_identically(case: OptimizerCase) -> None:
    model = make_model()
    opt = case.cls(case.param_groups(model), **case.kwargs)
    train(model, opt, 3)
    twin_model = copy.deepcopy(model)
    twin_opt = case.cls(case.param_groups(twin_model), **case.kwargs)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    copied = copy.deepcopy(opt)  # a deepcopy of the optimizer itself is independent
    train(model, opt, 3, start=3)
    train(twin_model, twin_opt, 3, start=3)
    assert_same(params_of(model), params_of(twin_model))
    assert len(copied.state) == len([p for p in model.parameters()])


# One per family: LeanOptimizer.step leaves params without a gradient out (_stepped_params) before any rule runs.
@families
def test_params_without_grad_untouched_and_stateless(case: OptimizerCase) -> None:
    torch.manual_seed(1)
    used = torch.nn.Parameter(torch.randn(64, 80))
    unused = torch.nn.Parameter(torch.randn(64, 80))
    frozen = torch.nn.Parameter(torch.randn(10), requires_grad=False)
    before = unused.detach().clone(), frozen.detach().clone()
    opt = case.cls(case.param_groups([used, unused, frozen]), **case.kwargs)
    for _ in range(3):
        used.grad = torch.randn_like(used)
        opt.step()
    assert torch.equal(unused, before[0]) and torch.equal(frozen, before[1])
    assert unused not in opt.state and frozen not in opt.state
    assert used in opt.state


# One per family: kernels.select sends empty params to the reference, whose loops do nothing;
# states of a zero-size shape are allocated by the family's state layout.
@families
def test_zero_size_params(case: OptimizerCase) -> None:
    empty = [torch.nn.Parameter(torch.zeros(0)), torch.nn.Parameter(torch.zeros(0, 5)), torch.nn.Parameter(torch.zeros(3, 0, 2))]
    w = torch.nn.Parameter(torch.randn(4, 4))
    opt = case.cls(case.param_groups(empty + [w]), **case.kwargs)
    for _ in range(2):
        for p in empty + [w]:
            p.grad = torch.randn_like(p)
        opt.step()
    assert all(p.numel() == 0 for p in empty)
    assert torch.isfinite(w).all()


# One per family: LeanOptimizer.step runs the closure (_closure_loss) before any rule runs.
@families
def test_closure_runs_with_grad_and_returns_loss(case: OptimizerCase) -> None:
    model = make_model()
    opt = case.cls(case.param_groups(model), **case.kwargs)
    x, y = batch(0)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # fails if the closure ran under no_grad
        return loss

    before = params_of(model)
    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.item() > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, params_of(model)))


@cases
def test_tiny_lr_group_leaves_params_unchanged(case: OptimizerCase) -> None:
    if case.lr_key is None:
        pytest.skip("optimizer has no plain learning rate")
    model = make_model()
    first, rest = list(model.parameters())[:2], list(model.parameters())[2:]
    opt = case.cls(case.param_groups([{"params": first, case.lr_key: 1e-30}, {"params": rest}]), **case.kwargs)
    before = params_of(model)
    train(model, opt, 3)
    after = params_of(model)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    assert not torch.equal(before[2], after[2])


# One per family: LeanOptimizer.add_param_group fills the group from the defaults, whatever the rule.
@families
def test_add_param_group(case: OptimizerCase) -> None:
    model = make_model()
    params = list(model.parameters())
    opt = case.cls(case.param_groups(params[:2]), **case.kwargs)
    train(model, opt, 2)
    before_tail = params_of(model)[2:]
    n = len(opt.param_groups)
    for group in case.param_groups([{"params": params[2:]}]):
        opt.add_param_group(group)
    assert len(opt.param_groups) > n
    for k, v in case.kwargs.items():
        # defaults fill the new group (a dtype as its name: param groups hold plain values)
        assert opt.param_groups[n][k] == (str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v)
    train(model, opt, 2, start=2)
    assert all(not torch.equal(a, b) for a, b in zip(before_tail, params_of(model)[2:]))
    assert all(p in opt.state for p in params[2:])


@cases
def test_invalid_hyperparameters_raise_value_error(case: OptimizerCase) -> None:
    assert case.invalid, "every optimizer declares invalid hyper-parameters"
    w = torch.nn.Parameter(torch.randn(3))
    for bad in case.invalid:
        with pytest.raises(ValueError):
            case.cls(case.param_groups([w]), **{**case.kwargs, **bad})


# One per family: LeanOptimizer.load_state_dict checks each saved state against the param's
# layout before loading anything; the layouts differ by family (dense, quantized, factored).
@families
def test_mismatched_state_dict_names_the_parameter(case: OptimizerCase) -> None:
    a = torch.nn.Parameter(torch.randn(64, 80))
    b = torch.nn.Parameter(torch.randn(5))
    opt = case.cls(case.param_groups([a, b]), **case.kwargs)
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    opt.step()
    sd = opt.state_dict()
    other = case.cls(case.param_groups([torch.nn.Parameter(torch.randn(80, 64)), torch.nn.Parameter(torch.randn(5))]), **case.kwargs)
    with pytest.raises(ValueError, match=r"param 0 .*shape \(80, 64\)"):
        other.load_state_dict(sd)
    assert len(other.state) == 0  # nothing was half-loaded


# A step allocates the state (LeanOptimizer._init_state, from the layout estimate reads too)
# before any backend runs, and no backend writes a state entry (they update in place): bf16
# params step on the reference backend here, which compiles nothing. Each rule's bf16 step on
# the fast backends is held to the reference by tests/test_rules.py::test_backend_matches_reference,
# and estimate = measure after it by tests/test_lesson_helper.py (one optimizer per family).
BF16_STEP = {"backend": "reference"}


@cases
def test_estimate_equals_measure_to_the_byte(case: OptimizerCase) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        model = make_model(dtype=dtype)
        whole = torch.nn.ModuleDict({"net": model, "frozen": torch.nn.Linear(3, 3).to(dtype)})
        whole.frozen.requires_grad_(False)  # no grad -> no state, and not in the estimate
        backend = BF16_STEP if dtype == torch.bfloat16 else {}
        opt = case.cls(case.param_groups([p for p in whole.parameters() if p.requires_grad]), **case.kwargs, **backend)
        train(model, opt, 1)
        measured = leanopt.measure(opt)
        predicted = leanopt.estimate(whole, case.cls, **case.kwargs)
        assert predicted.bytes == measured.bytes, (dtype, predicted.by_key, measured.by_key)
        assert predicted.elements == measured.elements
        assert predicted.by_key == measured.by_key


@cases
def test_low_precision_params_keep_fp32_state_through_save_load(case: OptimizerCase) -> None:
    # The state's dtype is decided where it is allocated, before any backend runs (BF16_STEP).
    model = make_model(dtype=torch.bfloat16)
    opt = case.cls(case.param_groups(model), **case.kwargs, **BF16_STEP)
    train(model, opt, 2)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    twin = case.cls(case.param_groups(model), **case.kwargs, **BF16_STEP)
    twin.load_state_dict(torch.load(buf, weights_only=True))
    for p in model.parameters():
        for key, value in opt.state[p].items():
            loaded = twin.state[p][key]
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                stored = torch.bfloat16 if key != "step" and case.kwargs.get("state_dtype") == torch.bfloat16 else torch.float32
                assert value.dtype == stored and loaded.dtype == stored, key
                assert torch.equal(value, loaded), key


# One per family: torch's load_state_dict hooks run around LeanOptimizer.load_state_dict.
@families
def test_load_state_dict_hooks_see_the_full_state(case: OptimizerCase) -> None:
    model = make_model()
    opt = case.cls(case.param_groups(model), **case.kwargs)
    train(model, opt, 1)
    sd = opt.state_dict()
    seen = []
    twin = case.cls(case.param_groups(model), **case.kwargs)
    twin.register_load_state_dict_pre_hook(lambda o, s: seen.append(("pre", len(s["state"]))))
    twin.register_load_state_dict_post_hook(lambda o: seen.append(("post", len(o.state))))
    twin.load_state_dict(sd)
    n = len(list(model.parameters()))
    assert seen == [("pre", n), ("post", n)]


@cases
def test_steps_on_the_meta_device_and_allocates_what_estimate_says(case: OptimizerCase) -> None:
    # Shape-only runs (models built on "meta" to size them) step without reading values:
    # AdamW8bit's reference path used to call Tensor.item() there.
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 3))
    opt = case.cls(case.param_groups(model), **case.kwargs)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.empty_like(p)
        opt.step()
    assert all(p.device.type == "meta" for p in model.parameters())
    assert leanopt.measure(opt).bytes == leanopt.estimate(model, case.cls, **case.kwargs).bytes


# One per family: LeanOptimizer.step checks every gradient (_check_grad) before any rule runs.
@families
def test_integer_params_with_a_gradient_are_refused_naming_them(case: OptimizerCase) -> None:
    # torch's AdamW raises for them; leanopt stepped them with truncation (5 -> 2 in 3 steps).
    w = torch.nn.Parameter(torch.randn(8, 8))
    counts = [torch.tensor([5, 5, 5]), torch.tensor([1, 0], dtype=torch.uint8), torch.tensor([True])]
    frozen = torch.tensor([7, 7])  # an integer tensor without a gradient is never stepped: fine, as in torch
    opt = case.cls(case.param_groups([{"params": [w, frozen]}, {"params": counts}]), **case.kwargs)
    for i, n in enumerate(counts):
        before = [t.clone() for t in (w.detach(), *counts)]
        w.grad = torch.randn_like(w)
        n.grad = torch.ones_like(n)
        with pytest.raises(ValueError, match=rf"param {i} of group 1 is {n.dtype}"):
            opt.step()
        assert not opt.state and all(torch.equal(a, b) for a, b in zip(before, (w.detach(), *counts)))
        n.grad = None
    opt.step()
    assert w in opt.state and torch.equal(frozen, torch.tensor([7, 7]))


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _reference_class(path: str) -> type | None:
    """The class at ``path`` ("package.module.Class"), None when its package is not installed."""
    module, _, name = path.rpartition(".")
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return None
    return getattr(importlib.import_module(module), name)


@cases
def test_positional_parameters_and_defaults_match_the_reference_classes(case: OptimizerCase) -> None:
    # A positional call ported from the class an optimizer mirrors must mean the same thing:
    # AdEMAMix took eps and weight_decay where bitsandbytes' AdEMAMix takes t_alpha and t_beta3.
    assert case.cls.references, f"{case.cls.__name__} declares the classes it mirrors (`references`)"
    ours = list(inspect.signature(case.cls.__init__).parameters.values())[2:]  # self, params
    positional = [q.name for q in ours if q.kind in _POSITIONAL]
    checked = []
    for path in case.cls.references:
        ref = _reference_class(path)
        if ref is None:
            continue
        theirs = list(inspect.signature(ref.__init__).parameters.values())[2:]
        assert positional == [q.name for q in theirs if q.kind in _POSITIONAL][: len(positional)], path
        their_defaults = {q.name: q.default for q in theirs}
        differ = {q.name for q in ours if q.name in their_defaults and q.default != their_defaults[q.name]}
        declared = set(case.reference_differences.get(path, {}))
        assert differ == declared, (path, {n: (next(q.default for q in ours if q.name == n), their_defaults[n]) for n in differ})
        checked.append(path)
    if not checked:
        pytest.skip(f"none of {case.cls.references} is installed")
