"""torch's generic optimizer contract, ported to every optimizer in ``registry.REGISTERED`` (the
library's and those defined outside it).

torch runs one suite over every optimizer it ships (``test/test_optim.py::TestOptimRenewed``
driven by ``OptimizerInfo`` entries in ``torch/testing/_internal/common_optimizers.py``). These
are our own equivalents of its checks that ``test_generic.py`` does not already make:
non-contiguous params, complex params, ``torch.compile``, validation of loaded groups and
states, tensor learning rates, check-before-change on bad gradients, non-param keys in
``optimizer.state``, old state dicts, the hook / state_dict / param-group contract, and a step
that autograd sees as an in-place update (version counters).

Where a check applies to ``torch.optim.AdamW`` as well, the same test also runs it (id
``torch_adamw_sanity``): it must pass there, which shows the harness itself is right.

Which cases. A check of what the update rule decides (its hyper-parameters, its loaded groups,
its defaults, its state) runs on every registered optimizer; a check of a mechanism that the
rule does not enter runs on one optimizer per family (``registry.representatives``: the code
path a step takes, module docstring of tests/registry.py), on each of its backends. Each test
says which, and why. Every backend's arithmetic for every rule is held to the reference by
tests/test_rules.py (``test_backend_matches_reference``), tests/test_backends_adafactor.py and
tests/test_bf16_states.py: a fast backend here only adds what its plumbing does (strided
copies, groups, tensor learning rates, version counters, a load), which is the rule's no more
than the reference's is.

Tolerances (see :func:`parity_tol`): a run compared with a run on the reference backend is
bitwise when it runs on the reference backend too (a strided param must give exactly what its
contiguous copy gives). The fused backends (``cpu``, ``triton``) evaluate the same expressions
with fused multiply-adds and another operation order, so fp32 results are held to
``test_backends.py``'s bound, ``2e-6 * max|ref| + 1e-7``. For the quantized optimizers the bound
is ``1e-5 * max|ref| + 1e-6``: every step requantizes the moments, so a rounding difference in
the fp32 update is carried into the codes and block scales and through the later steps, and
the fused kernels round differently from the reference (``test_backends_quant.py``). On the
fixed inputs here the fused paths are measured within 2e-7 relative of the reference (no code
flips); the wider bound is margin, and a wrong element order or a write outside the param is
off by 1e-3 or more, far above it. ``torch.compile`` and tensor-lr runs are held to 1e-6
relative of their eager / float-lr twins (max |diff| <= 1e-6 * max |p|).
"""

from __future__ import annotations

import copy
import io
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch

import leanopt
from leanopt.optim.identity import IDENTITY_KEY
from leanopt.quant import QuantizedState
from registry import REGISTERED, OptimizerCase, representatives


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # not installed, or installed without a working backend
        return False
    return True


HAS_TRITON = _triton_importable()

# torch's own AdamW through the same harness: a check it fails is a bug in the check.
TORCH_ADAMW = OptimizerCase("torch_adamw_sanity", torch.optim.AdamW, {"lr": 1e-2}, supports_complex=True, backends=())


def _backend_params(with_torch: bool = False, cases: list[OptimizerCase] = REGISTERED) -> list[Any]:
    out = []
    for case in cases:
        for backend in case.backends:
            marks = [pytest.mark.skip(reason="triton is not installed")] if backend == "triton" and not HAS_TRITON else []
            out.append(pytest.param(case, backend, id=f"{case.name}-{backend}", marks=marks))
    if with_torch:
        out.append(pytest.param(TORCH_ADAMW, None, id=TORCH_ADAMW.name))
    return out


def _case_params(with_torch: bool = False, cases: list[OptimizerCase] = REGISTERED) -> list[Any]:
    out = [pytest.param(case, id=case.name) for case in cases]
    if with_torch:
        out.append(pytest.param(TORCH_ADAMW, id=TORCH_ADAMW.name))
    return out


def _rule_params(with_torch: bool = False) -> list[Any]:
    """Every case on its CPU backend (the rule), and each family's representative on its other
    backends (the backend's plumbing)."""
    return [p for p in _backend_params(with_torch) if p.values[1] in ("cpu", None) or p.values[0].represents]


REPRESENTATIVES = representatives(REGISTERED)
# A check of what the rule decides: every case.
every_case = pytest.mark.parametrize("case", _case_params())
every_case_and_torch = pytest.mark.parametrize("case", _case_params(with_torch=True))
# A check of a mechanism the rule does not enter: one case per family.
every_family = pytest.mark.parametrize("case", _case_params(cases=REPRESENTATIVES))
every_family_and_torch = pytest.mark.parametrize("case", _case_params(with_torch=True, cases=REPRESENTATIVES))
every_family_backend_and_torch = pytest.mark.parametrize("case,backend", _backend_params(with_torch=True, cases=REPRESENTATIVES))
# What the rule reads (its hyper-parameters, its state) on the CPU backend for every case, and
# the same through each other backend's plumbing for one case per family.
every_rule_and_family_backend_and_torch = pytest.mark.parametrize("case,backend", _rule_params(with_torch=True))


# ---- helpers ---------------------------------------------------------------------------------
def make(case: OptimizerCase, params: Any, backend: str | None = None, **override: Any) -> torch.optim.Optimizer:
    """``case``'s optimizer with the registry kwargs, ``override`` on top; ``backend`` when given."""
    kwargs = {**case.kwargs, **override}
    if backend is not None:
        kwargs["backend"] = backend
    return case.cls(case.param_groups(params), **kwargs)


def is_quantized(case: OptimizerCase) -> bool:
    """AdamW8bit / AdamW4bit (block-quantized moments)."""
    return hasattr(case.cls, "state_bits")


def parity_tol(case: OptimizerCase, backend: str | None) -> tuple[float, float]:
    """(relative to max|expected|, absolute) bound of a ``backend`` run against a reference run.

    Bitwise on the reference backend (and for torch's own optimizer); otherwise the bounds of the
    backend parity tests, looser for quantized states (module docstring).
    """
    if backend in (None, "reference"):
        return 0.0, 0.0
    if is_quantized(case):
        return 1e-5, 1e-6
    return 2e-6, 1e-7


def dense(value: Any) -> Any:
    """A state entry as a plain tensor (a QuantizedState dequantized), anything else as it is."""
    return value.dequantize() if isinstance(value, QuantizedState) else value


def max_diff(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max |got - want|, max |want|), complex tensors compared on their real view."""
    if got.is_complex():
        got = torch.view_as_real(got)
    if want.is_complex():
        want = torch.view_as_real(want)
    got, want = got.detach().double(), want.detach().double()
    if want.numel() == 0:
        return 0.0, 0.0
    return (got - want).abs().max().item(), want.abs().max().item()


def assert_close(got: torch.Tensor, want: torch.Tensor, rel: float, abs_: float, what: str) -> None:
    """``got`` equals ``want`` bitwise (``rel == abs_ == 0``) or within ``rel * max|want| + abs_``."""
    assert isinstance(got, torch.Tensor), f"{what}: got a {type(got).__name__}, expected a tensor"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if rel == 0 and abs_ == 0:
        if not torch.equal(got.detach(), want.detach()):
            diff, scale = max_diff(got, want)
            raise AssertionError(f"{what}: not bitwise equal (max |diff| {diff:.3g}, max |expected| {scale:.3g})")
        return
    diff, scale = max_diff(got, want)
    bound = rel * scale + abs_
    assert diff <= bound, f"{what}: max |diff| {diff:.3g} > {rel:g} * {scale:.3g} + {abs_:g}"


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """Where two (nested) values differ, or None. Tensors bitwise (NaN equal to NaN), dtype too."""
    where = path or "<root>"
    if isinstance(a, QuantizedState) or isinstance(b, QuantizedState):
        if type(a) is not type(b):
            return f"{where}: {type(a).__name__} vs {type(b).__name__}"
        if a.shape != b.shape or a.format != b.format:
            return f"{where}: quantized {a.shape}/{a.format} vs {b.shape}/{b.format}"
        return first_difference(a.codes, b.codes, path + ".codes") or first_difference(a.absmax, b.absmax, path + ".absmax")
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{where}: {type(a).__name__} vs {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        if a.device != b.device:
            return f"{where}: device {a.device} vs {b.device}"
        x, y = a.detach(), b.detach()
        if x.is_complex():
            x, y = torch.view_as_real(x), torch.view_as_real(y)
        same = x == y
        if x.is_floating_point():
            same |= x.isnan() & y.isnan()
        if not bool(same.all()):
            return f"{where}: tensor values differ"
        return None
    if isinstance(a, Mapping) or isinstance(b, Mapping):
        if not (isinstance(a, Mapping) and isinstance(b, Mapping)):
            return f"{where}: {type(a).__name__} vs {type(b).__name__}"
        if set(a) != set(b):
            return f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            found = first_difference(a[k], b[k], f"{path}[{k!r}]")
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return f"{where}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return None
    if type(a) is not type(b) or a != b:
        return f"{where}: {a!r} vs {b!r}"
    return None


def assert_same(a: Any, b: Any, what: str) -> None:
    found = first_difference(a, b)
    assert found is None, f"{what}: {found}"


def snapshot(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Everything an optimizer holds, copied: group options, params, state (by param position)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    index = {id(p): i for i, p in enumerate(params)}
    return {
        "groups": [
            {k: (len(v) if k == "params" else copy.deepcopy(v)) for k, v in g.items()} for g in opt.param_groups
        ],
        "params": [p.detach().clone() for p in params],
        "state": {
            (f"param {index[id(k)]}" if isinstance(k, torch.Tensor) else k): copy.deepcopy(dict(v) if isinstance(v, Mapping) else v)
            for k, v in opt.state.items()
        },
    }


def mlp(seed: int = 0) -> torch.nn.Module:
    """A small MLP whose first weight (16 x 256 = 4096 elements) quantized optimizers quantize."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.Tanh(), torch.nn.Linear(256, 4))


def mlp_batch(step: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 + step))


def mlp_backward(model: torch.nn.Module, step: int) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = model(mlp_batch(step)).square().mean()
    loss.backward()
    return loss


def weights(n: int = 2, seed: int = 0) -> list[torch.nn.Parameter]:
    """Params for a step: a 64x80 matrix (quantized by the low-bit optimizers), then small ones."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(64, 80), (5,), (3, 4)][:n]
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def set_grads(params: list[torch.Tensor], step: int) -> None:
    g = torch.Generator().manual_seed(7000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)


def clone_params(params: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


# ---- 1. non-contiguous params ------------------------------------------------------------------
LAYOUTS = ["view", "transposed", "channels_last"]
NONCONTIG_STEPS = 5


def noncontiguous(layout: str, seed: int) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
    """(param, gradient of each step, base buffer the param is a view of or None)."""
    g = torch.Generator().manual_seed(seed)
    if layout == "view":
        # A view (strides (160, 2)) of a larger leaf buffer; 5120 elements, so quantized states.
        base = torch.randn(64, 80, 2, generator=g)
        grads = [torch.randn(64, 80, 2, generator=g)[..., 0] for _ in range(NONCONTIG_STEPS)]
        return base[..., 0], grads, base
    if layout == "transposed":
        # 4800 elements: quantized, 2.3 of the GPU's Triton chunks of 2048 (one interpreted), a
        # partial last block of 256 and of 128.
        p = torch.nn.Parameter(torch.randn(40, 120, generator=g).t())
        grads = [torch.randn(40, 120, generator=g).t() for _ in range(NONCONTIG_STEPS)]
        return p, grads, None
    # A channels_last conv weight, 4608 elements. 8x4 filters of 12x12 rather than 64x8 of 3x3:
    # Adafactor's Triton kernels take ~10 s a step on 512 3x3 slices in the interpreter.
    cl = torch.channels_last
    p = torch.nn.Parameter(torch.randn(8, 4, 12, 12, generator=g).contiguous(memory_format=cl))
    grads = [torch.randn(8, 4, 12, 12, generator=g).contiguous(memory_format=cl) for _ in range(NONCONTIG_STEPS)]
    return p, grads, None


# One per family: kernels.row_major hands every implementation (the reference's too) row-major
# copies of strided tensors, and states are allocated from the param's logical shape; the
# rule never sees a stride. What differs is the implementation a family's step takes on each backend.
@every_family_backend_and_torch
@pytest.mark.parametrize("layout", LAYOUTS)
def test_noncontiguous_param_matches_contiguous_reference(case: OptimizerCase, backend: str | None, layout: str) -> None:
    p, grads, base = noncontiguous(layout, seed=LAYOUTS.index(layout))
    assert not p.is_contiguous()
    twin = torch.nn.Parameter(p.detach().clone(memory_format=torch.contiguous_format))
    base_before = None if base is None else base.clone()
    grads_before = [g.clone() for g in grads]
    opt = make(case, [p], backend)
    ref = make(case, [twin], None if backend is None else "reference")
    for step in range(NONCONTIG_STEPS):
        p.grad = grads[step]
        twin.grad = grads[step].contiguous()
        opt.step()
        ref.step()
    rel, abs_ = parity_tol(case, backend)
    what = f"{case.name} backend={backend} {layout} param {tuple(p.shape)} strides {p.stride()}"
    assert_close(p, twin, rel, abs_, f"{what}: params after {NONCONTIG_STEPS} steps vs the reference on a contiguous copy")
    assert p.stride() == grads[0].stride(), f"{what}: the param's strides changed to {p.stride()}"
    # States hold the same elements in the same (logical) order as the contiguous twin's.
    assert set(opt.state[p]) == set(ref.state[twin]), f"{what}: state keys {sorted(opt.state[p])} vs {sorted(ref.state[twin])}"
    for key, want in ref.state[twin].items():
        got = opt.state[p][key]
        assert type(got) is type(want), f"{what}: state {key!r} is a {type(got).__name__}, the contiguous twin's a {type(want).__name__}"
        got, want = dense(got), dense(want)
        if key == "step":
            assert torch.equal(torch.as_tensor(got), torch.as_tensor(want)), f"{what}: step {got} vs {want}"
            continue
        assert got.numel() == want.numel(), f"{what}: state {key!r} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        # Row-major (logical) order: a state kept in the param's memory order would differ here.
        assert_close(got.reshape(want.shape), want, rel, abs_, f"{what}: state {key!r} vs the contiguous twin's (same element order)")
    # Memory outside the param is the optimizer's to read at most.
    if base is not None:
        assert torch.equal(base[..., 1], base_before[..., 1]), f"{what}: the rest of the base buffer was written"
    for step, (g, before) in enumerate(zip(grads, grads_before)):
        assert torch.equal(g, before), f"{what}: the gradient of step {step} was modified"


# ---- 2. complex params -------------------------------------------------------------------------
COMPLEX_STEPS = 5
TORCH_TWIN = {leanopt.AdamW: torch.optim.AdamW}


def complex_data(seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    value = torch.randn(8, 6, dtype=torch.complex64, generator=g)
    return value, [torch.randn(8, 6, dtype=torch.complex64, generator=g) for _ in range(COMPLEX_STEPS)]


def _complex_params() -> list[Any]:
    return [p for p in _backend_params() if p.values[0].supports_complex] or [pytest.param(None, None, marks=pytest.mark.skip(reason="no registry case supports complex params"))]


def _real_only_params() -> list[Any]:
    return [p for p in _case_params() if not p.values[0].supports_complex] or [pytest.param(None, marks=pytest.mark.skip(reason="every registry case supports complex params"))]


@pytest.mark.parametrize("case,backend", _complex_params())
def test_complex_param_matches_torch_and_its_real_view(case: OptimizerCase, backend: str) -> None:
    value, grads = complex_data()
    kwargs = {"weight_decay": 0.1}  # decay must act on the complex value as a whole
    p = torch.nn.Parameter(value.clone())
    real = torch.nn.Parameter(torch.view_as_real(value.clone()).clone())
    opt = make(case, [p], backend, **kwargs)
    real_opt = make(case, [real], backend, **kwargs)
    torch_cls = TORCH_TWIN.get(case.cls)
    ref = torch.nn.Parameter(value.clone())
    ref_opt = torch_cls([ref], **{**case.kwargs, **kwargs}) if torch_cls else None
    for step in range(COMPLEX_STEPS):
        p.grad = grads[step].clone()
        real.grad = torch.view_as_real(grads[step].clone())
        ref.grad = grads[step].clone()
        opt.step()
        real_opt.step()
        if ref_opt is not None:
            ref_opt.step()
        assert p.dtype == torch.complex64 and torch.isfinite(torch.view_as_real(p)).all(), f"step {step}: {p}"
    what = f"{case.name} backend={backend}"
    if ref_opt is not None:
        assert_close(p, ref, 1e-6, 0.0, f"{what}: complex param vs {torch_cls.__module__}.{torch_cls.__name__} after {COMPLEX_STEPS} steps")
    rel, abs_ = parity_tol(case, backend)
    assert_close(torch.view_as_real(p), real, rel, abs_, f"{what}: complex param vs the same optimizer on its view_as_real param")


@pytest.mark.parametrize("case", [p for p in _case_params() if p.values[0].supports_complex] or [pytest.param(None, marks=pytest.mark.skip(reason="none"))])
def test_complex_param_estimate_equals_measure(case: OptimizerCase) -> None:
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.z = torch.nn.Parameter(torch.randn(64, 80, dtype=torch.complex64))
    model.lin = torch.nn.Linear(4, 3)
    opt = make(case, model.parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    measured = leanopt.measure(opt)
    predicted = leanopt.estimate(model, case.cls, **case.kwargs)
    assert predicted.bytes == measured.bytes, f"{case.name}: estimate {predicted.by_key} vs measure {measured.by_key}"
    assert predicted.by_key == measured.by_key, f"{case.name}: estimate {predicted.by_key} vs measure {measured.by_key}"


@pytest.mark.parametrize("case", _real_only_params())
def test_complex_param_refused_with_value_error_naming_it(case: OptimizerCase) -> None:
    real = torch.nn.Parameter(torch.randn(3))
    cplx = torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))
    with pytest.raises(ValueError) as err:
        make(case, [real, cplx])
    msg = str(err.value)
    assert "complex" in msg.lower(), f"{case.name}: the error should say the param is complex: {msg!r}"
    assert re.search(r"\bparam(eter)?s?\b\D{0,20}\b1\b", msg), f"{case.name}: the error should name param 1: {msg!r}"

    opt = make(case, [real])
    groups_before = len(opt.param_groups)
    with pytest.raises(ValueError, match="(?i)complex"):
        opt.add_param_group({"params": [cplx]})
    assert len(opt.param_groups) == groups_before, f"{case.name}: the refused group was added anyway"

    with pytest.raises(ValueError, match="(?i)complex"):
        leanopt.estimate(case.param_groups([real, cplx]), case.cls, **case.kwargs)


@pytest.mark.parametrize("case", representatives(REGISTERED), ids=str)
def test_an_fp64_scalar_param_steps_as_its_one_element_twin(case: OptimizerCase) -> None:
    # Mechanism (the check that refuses a model converted after its optimizer was built), one
    # optimizer per family: a 0-dim fp64 param's fp32 step count has the param's shape and is
    # no moment made for another dtype; it steps on, as the same value in shape (1,) does.
    runs = []
    for shape in ((), (1,)):
        p = torch.nn.Parameter(torch.full(shape, 0.5, dtype=torch.float64))
        opt = make(case, [p])
        for k in range(3):
            p.grad = torch.full(shape, 0.25 * (k + 1), dtype=torch.float64)
            opt.step()
        runs.append(p.detach().reshape(1))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], torch.tensor([0.5], dtype=torch.float64))


# ---- 4. bad loaded groups and steps ------------------------------------------------------------
def _corrupt_group(key: str, value: Any) -> Callable[[dict[str, Any]], str | None]:
    def corrupt(sd: dict[str, Any]) -> str | None:
        group = sd["param_groups"][0]
        if key not in group:
            return f"the group has no {key!r}"
        if key == "eps" and isinstance(group["eps"], (tuple, list)):
            group["eps"] = (value,) + tuple(group["eps"][1:])  # Adafactor's (eps1, eps2)
        else:
            group[key] = value
        return None

    return corrupt


def _corrupt_step(value: Callable[[], Any]) -> Callable[[dict[str, Any]], str | None]:
    def corrupt(sd: dict[str, Any]) -> str | None:
        last = max(sd["state"])  # the last param: everything before it must be checked too
        sd["state"][last]["step"] = value()
        return None

    return corrupt


CORRUPTIONS = {
    "lr=nan": _corrupt_group("lr", float("nan")),
    "lr='0.1'": _corrupt_group("lr", "0.1"),
    "betas=(2,5)": _corrupt_group("betas", (2, 5)),
    "eps=-1": _corrupt_group("eps", -1.0),
    "weight_decay=-1": _corrupt_group("weight_decay", -1.0),
    "step=-3": _corrupt_step(lambda: -3),
    "step=nan": _corrupt_step(lambda: float("nan")),
    "step=tensor(nan)": _corrupt_step(lambda: torch.tensor(float("nan"))),
}


# A corrupt group option: every case, each class validates its own options. A corrupt step:
# one per family, LeanOptimizer.load_state_dict checks every saved step (_check_step) whatever the rule.
@pytest.mark.parametrize("corruption,case", [
    pytest.param(corruption, case, id=f"{corruption}-{case.name}")
    for corruption in CORRUPTIONS for case in (REPRESENTATIVES if corruption.startswith("step=") else REGISTERED)
])  # fmt: skip
def test_bad_loaded_group_or_step_raises_and_changes_nothing(case: OptimizerCase, corruption: str) -> None:
    params = weights(3)
    opt = make(case, params)
    set_grads(params, 0)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    skip = CORRUPTIONS[corruption](sd)
    if skip:
        pytest.skip(skip)
    before = snapshot(opt)
    with pytest.raises(ValueError):
        opt.load_state_dict(sd)
    assert_same(snapshot(opt), before, f"{case.name}: a refused load_state_dict ({corruption}) changed the optimizer")


# ---- 5. tensor lr ------------------------------------------------------------------------------
def _lr(case: OptimizerCase) -> float:
    if case.lr_key is None or case.kwargs.get(case.lr_key) is None:
        pytest.skip("no plain learning rate in the registry kwargs")
    return case.kwargs[case.lr_key]


def _lockstep(a: torch.optim.Optimizer, pa: list, b: torch.optim.Optimizer, pb: list, steps: int, after: Callable[[], None] | None = None) -> None:
    for step in range(steps):
        set_grads(pa, step)
        set_grads(pb, step)
        a.step()
        b.step()
        if after:
            after()


# Each rule's hyperparameters() turns the group's lr into the number its kernels take: every
# case; the other backends take that number through the same plumbing: one per family.
@every_rule_and_family_backend_and_torch
def test_tensor_lr_matches_float_lr(case: OptimizerCase, backend: str | None) -> None:
    lr = _lr(case)
    pa, pb = weights(2), weights(2)
    opt = make(case, pa, backend, **{case.lr_key: torch.tensor(lr)})
    twin = make(case, pb, backend)
    _lockstep(opt, pa, twin, pb, 5)
    for i, (a, b) in enumerate(zip(pa, pb)):
        assert_close(a, b, 1e-6, 0.0, f"{case.name} backend={backend}: param {i} with lr=tensor({lr}) vs lr={lr}")
    assert isinstance(opt.param_groups[0][case.lr_key], torch.Tensor), "the tensor lr was replaced"


# One per family: the scheduler writes group["lr"] in place (torch's LRScheduler), and each rule
# reads a tensor lr as test_tensor_lr_matches_float_lr checks for every case.
@every_family_and_torch
@pytest.mark.parametrize("scheduler", ["StepLR", "LambdaLR"])
def test_tensor_lr_with_scheduler(case: OptimizerCase, scheduler: str) -> None:
    lr = _lr(case)

    def sched(opt: torch.optim.Optimizer) -> Any:
        if scheduler == "StepLR":
            return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (1 + epoch))

    pa, pb = weights(2), weights(2)
    opt = make(case, pa, **{case.lr_key: torch.tensor(lr)})
    twin = make(case, pb)
    sa, sb = sched(opt), sched(twin)
    _lockstep(opt, pa, twin, pb, 6, after=lambda: (sa.step(), sb.step()))
    got, want = opt.param_groups[0][case.lr_key], twin.param_groups[0][case.lr_key]
    assert isinstance(got, torch.Tensor), f"{case.name}: the scheduler replaced the tensor lr with {got!r}"
    assert math.isclose(float(got), want, rel_tol=1e-6), f"{case.name}: scheduled lr {float(got)} vs {want}"
    for i, (a, b) in enumerate(zip(pa, pb)):
        assert_close(a, b, 1e-6, 0.0, f"{case.name} {scheduler}: param {i} with a tensor lr vs a float lr")


@every_case_and_torch
def test_tensor_lr_with_two_elements_raises(case: OptimizerCase) -> None:
    lr = _lr(case)
    with pytest.raises(ValueError):
        make(case, weights(1), **{case.lr_key: torch.tensor([lr, lr])})


# ---- 6. check before change --------------------------------------------------------------------
# One per family: LeanOptimizer.step checks every gradient (_check_grads) before any rule runs.
@every_family
@pytest.mark.parametrize("groups", ["one_group", "two_groups"])
@pytest.mark.parametrize("stepped_before", [False, True], ids=["fresh", "after_a_step"])
def test_sparse_grad_on_last_param_raises_and_changes_nothing(case: OptimizerCase, groups: str, stepped_before: bool) -> None:
    params = weights(3)
    opt = make(case, params if groups == "one_group" else [{"params": params[:2]}, {"params": params[2:]}])
    if stepped_before:
        set_grads(params, 0)
        opt.step()
    set_grads(params, 1)
    params[-1].grad = params[-1].grad.to_sparse()
    before = snapshot(opt)
    with pytest.raises((RuntimeError, ValueError), match="(?i)sparse"):
        opt.step()
    after = snapshot(opt)
    if not stepped_before:
        assert len(opt.state) == 0, f"{case.name}: state created for {list(after['state'])} by a step that raised"
    assert_same(after, before, f"{case.name} ({groups}): a step that raised on the last param's sparse gradient changed")


# ---- 7. non-param keys in optimizer.state -------------------------------------------------------
# One per family: LeanOptimizer.state_dict / load_state_dict carry non-param keys as they are;
# every rule's own state round trips in test_weights_only_load_continues_bitwise_on_every_backend.
@every_family_and_torch
def test_non_param_key_in_state_survives_save_and_load(case: OptimizerCase) -> None:
    params = weights(2)
    opt = make(case, params)
    set_grads(params, 0)
    opt.step()
    opt.state["extra"] = {"x": 1}  # as a state_dict pre-hook or load post-hook may add
    sd = opt.state_dict()
    assert sd["state"].get("extra") == {"x": 1}, f"{case.name}: state_dict()['state'] lost the non-param key"
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    twin_params = clone_params(params)
    twin = make(case, twin_params)
    twin.load_state_dict(torch.load(buf, weights_only=True))
    assert twin.state.get("extra") == {"x": 1}, f"{case.name}: load_state_dict did not restore the non-param key"
    _lockstep(opt, params, twin, twin_params, 2)
    for i, (a, b) in enumerate(zip(params, twin_params)):
        assert torch.equal(a, b), f"{case.name}: param {i} after loading a state_dict with a non-param key"


# ---- 8. old state dicts -------------------------------------------------------------------------
ADAM_REQUIRED = {"params", "lr", "betas", "eps", "weight_decay"}
# Adafactor's group options since it exists (fairseq / transformers): none of them is optional.
ADAFACTOR_REQUIRED = {"params", "lr", "eps", "clip_threshold", "decay_rate", "beta1", "weight_decay", "scale_parameter", "relative_step", "warmup_init"}


@every_case_and_torch
@pytest.mark.parametrize("int_steps", [False, True], ids=["tensor_steps", "int_steps"])
def test_old_state_dict_without_optional_options_loads_with_defaults(case: OptimizerCase, int_steps: bool) -> None:
    params = weights(2)
    opt = make(case, params)
    set_grads(params, 0)
    opt.step()
    sd = opt.state_dict()
    old = copy.deepcopy(sd)
    if int_steps:  # torch < 1.12 saved ``step`` as a Python number
        for st in old["state"].values():
            st["step"] = int(st["step"])
    required = ADAFACTOR_REQUIRED if issubclass(case.cls, leanopt.Adafactor) else ADAM_REQUIRED
    if case.external:
        # An optimizer defined outside leanopt has no state_dicts older than its declared name,
        # and a state_dict without one is read from its state keys only for the rules leanopt
        # knows (leanopt.optim.identity): the name stays, the optional options go.
        required = required | {IDENTITY_KEY}
    deleted = set()
    for gi, group in enumerate(old["param_groups"]):
        for key in [k for k in group if k not in required]:
            deleted.add((gi, key))
            del group[key]

    full_params, old_params = clone_params(params), clone_params(params)
    full, loaded = make(case, full_params), make(case, old_params)
    full.load_state_dict(copy.deepcopy(sd))
    loaded.load_state_dict(old)
    for gi, key in sorted(deleted):
        # The default: the optimizer's (Muon's aux groups: their rule's), as the full state_dict holds it.
        got, default = loaded.param_groups[gi].get(key, "<missing>"), full.param_groups[gi][key]
        assert first_difference(got, default) is None, (
            f"{case.name}: option {key!r} absent from the old state_dict became {got!r}, the default is {default!r}"
        )
    _lockstep(full, full_params, loaded, old_params, 2)
    for i, (a, b) in enumerate(zip(old_params, full_params)):
        assert torch.equal(a, b), f"{case.name}: param {i} loaded without {sorted(k for _, k in deleted)} vs loaded from the full state_dict"


# ---- 9. the rest of torch's contract ------------------------------------------------------------
@every_case_and_torch
def test_state_dict_is_deterministic(case: OptimizerCase) -> None:
    def run() -> tuple[torch.optim.Optimizer, dict[str, Any]]:
        params = weights(3)
        opt = make(case, [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}])
        for step in range(3):
            set_grads(params, step)
            opt.step()
        return opt, opt.state_dict()

    opt, first = run()
    _, second = run()
    assert_same(first, second, f"{case.name}: two identical runs gave different state_dicts")
    assert_same(opt.state_dict(), first, f"{case.name}: state_dict() twice on the same optimizer differs")


# The rule's state is saved and loaded: every case; a backend continues from the loaded tensors
# through the same plumbing whatever the rule: one per family on the other backends.
@every_rule_and_family_backend_and_torch
def test_weights_only_load_continues_bitwise_on_every_backend(case: OptimizerCase, backend: str | None) -> None:
    params = weights(3)
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}]  # noqa: E731
    opt = make(case, groups(params), backend)
    for step in range(3):
        set_grads(params, step)
        opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    twin_params = clone_params(params)
    twin = make(case, groups(twin_params), backend)
    twin.load_state_dict(torch.load(buf, weights_only=True))
    for step in range(3, 6):
        set_grads(params, step)
        set_grads(twin_params, step)
        opt.step()
        twin.step()
    for i, (a, b) in enumerate(zip(params, twin_params)):
        assert torch.equal(a, b), f"{case.name} backend={backend}: param {i} after a weights_only round trip"
    assert_same(snapshot(twin)["state"], snapshot(opt)["state"], f"{case.name} backend={backend}: state after a weights_only round trip")


# One per family: torch.optim.Optimizer's hooks wrap LeanOptimizer.step, whatever the rule.
@every_family_and_torch
def test_step_hooks_run_once_per_step_in_order(case: OptimizerCase) -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    params = weights(2)
    opt = make(case, params)
    calls: list[tuple[str, bool]] = []
    value = lambda: params[0].detach().clone()  # noqa: E731
    seen = {}

    def hook(name: str) -> Callable[..., None]:
        def record(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
            if optimizer is not opt:
                return
            calls.append(name)
            seen[name] = value()

        return record

    handles = [
        register_optimizer_step_pre_hook(hook("global pre")),
        opt.register_step_pre_hook(hook("pre")),
        opt.register_step_post_hook(hook("post")),
        register_optimizer_step_post_hook(hook("global post")),
    ]
    try:
        for step in range(3):
            set_grads(params, step)
            before = value()
            opt.step()
            assert torch.equal(seen["pre"], before), f"{case.name}: the pre hook ran after the update"
            assert torch.equal(seen["post"], value()) and not torch.equal(seen["post"], before), f"{case.name}: the post hook ran before the update"
        assert calls == ["global pre", "pre", "post", "global post"] * 3, f"{case.name}: hook calls {calls}"
    finally:
        for h in handles:
            h.remove()
    set_grads(params, 3)
    opt.step()
    assert len(calls) == 12, f"{case.name}: removed hooks still ran"


# One per family: the hooks run around LeanOptimizer.state_dict, whatever the rule.
@every_family_and_torch
def test_state_dict_hooks(case: OptimizerCase) -> None:
    params = weights(2)
    opt = make(case, params)
    set_grads(params, 0)
    opt.step()
    calls: list[str] = []
    seen: dict[str, Any] = {}

    def pre(optimizer: torch.optim.Optimizer) -> None:
        calls.append("pre")

    def post(optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
        calls.append("post")
        seen["types"] = {pid: {k: type(v).__name__ for k, v in st.items()} for pid, st in sd["state"].items()}
        sd["added_by_hook"] = 42

    opt.register_state_dict_pre_hook(pre)
    opt.register_state_dict_post_hook(post)
    sd = opt.state_dict()
    assert calls == ["pre", "post"], f"{case.name}: state_dict hook calls {calls}"
    assert sd.get("added_by_hook") == 42, f"{case.name}: the key the post hook added is missing from the state_dict"
    returned = {pid: {k: type(v).__name__ for k, v in st.items()} for pid, st in sd["state"].items()}
    assert seen["types"] == returned, (
        f"{case.name}: the post hook saw state entries {seen['types']}, state_dict() returned {returned}: "
        "the hook must see the state_dict that is returned"
    )

    replacement = {"state": {}, "param_groups": sd["param_groups"], "replaced": True}
    opt.register_state_dict_post_hook(lambda o, s: replacement)
    assert opt.state_dict().get("replaced") is True, f"{case.name}: a post hook's returned state_dict was not used"


# Each rule reads its group's lr: every case; a backend launches each group's params apart
# through the same plumbing whatever the rule: one per family on the other backends.
@every_rule_and_family_backend_and_torch
def test_param_groups_with_different_lr_act_as_separate_optimizers(case: OptimizerCase, backend: str | None) -> None:
    lr = _lr(case)
    pa, pb = weights(3), weights(3)
    both = make(case, [{"params": pa[:2]}, {"params": pa[2:], case.lr_key: lr * 0.3}], backend)
    first = make(case, pb[:2], backend)
    second = make(case, pb[2:], backend, **{case.lr_key: lr * 0.3})
    for step in range(5):
        set_grads(pa, step)
        set_grads(pb, step)
        both.step()
        first.step()
        second.step()
    for i, (a, b) in enumerate(zip(pa, pb)):
        assert torch.equal(a, b), f"{case.name} backend={backend}: param {i} in a two-group optimizer vs its own optimizer"


def _direction_params() -> list[Any]:
    """Contiguous: every case on its CPU backend (the rule's direction) and each family's
    representative on its other backends; strided (row-major copies whatever the rule, as in
    test_noncontiguous_param_matches_contiguous_reference): one per family on each backend.
    channels_last is left to the parity test: Adafactor on 4-D params is slow in the Triton interpreter."""
    out = []
    for layout, params in [("contiguous", _rule_params(with_torch=True)),
                           ("view", _backend_params(with_torch=True, cases=REPRESENTATIVES)),
                           ("transposed", _backend_params(with_torch=True, cases=REPRESENTATIVES))]:  # fmt: skip
        out += [pytest.param(*p.values, layout, id=f"{layout}-{p.id}", marks=p.marks) for p in params]
    return out


DIRECTION_STEPS = 5  # each step takes the same kernel path; a descent shows in the first ones


@pytest.mark.parametrize("case,backend,layout", _direction_params())
def test_goes_right_direction(case: OptimizerCase, backend: str | None, layout: str) -> None:
    if layout == "contiguous":
        x = torch.nn.Parameter(torch.randn(64, 80, generator=torch.Generator().manual_seed(3)))
    else:
        x, _, _ = noncontiguous(layout, seed=3)
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(4))
    opt = make(case, [x], backend)

    def f() -> float:
        return (x.detach() - target).square().sum().item()

    start = f()
    for _ in range(DIRECTION_STEPS):
        # d/dx ||x - target||^2, in a gradient with the param's strides (as autograd gives it)
        x.grad = torch.empty_like(x).copy_(2 * (x.detach() - target))
        opt.step()
    end = f()
    assert end < start, f"{case.name} backend={backend} {layout}: f(x) = ||x - target||^2 went from {start:.6g} to {end:.6g} in {DIRECTION_STEPS} steps"


# One per family: LeanOptimizer.step leaves params without a gradient out before any rule runs.
@every_family_backend_and_torch
def test_step_without_grads_is_a_noop(case: OptimizerCase, backend: str | None) -> None:
    params = weights(3)
    opt = make(case, params, backend)
    before = [p.detach().clone() for p in params]
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before)), f"{case.name}: a step without gradients moved params"
    assert len(opt.state) == 0, f"{case.name}: a step without gradients created state"
    set_grads(params, 0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    before = snapshot(opt)
    opt.step()
    assert_same(snapshot(opt), before, f"{case.name}: a step after zero_grad(set_to_none=True) changed something")


# One per family: LeanOptimizer.zero_grad, whatever the rule.
@every_family_and_torch
def test_zero_grad(case: OptimizerCase) -> None:
    model = mlp()
    opt = make(case, model.parameters())
    mlp_backward(model, 0)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters()), f"{case.name}: zero_grad(set_to_none=False)"
    mlp_backward(model, 1)
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters()), f"{case.name}: zero_grad(set_to_none=True) left gradients"
    mlp_backward(model, 2)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters()), f"{case.name}: zero_grad() (set_to_none by default) left gradients"
    assert type(opt).__name__ in repr(opt), f"{case.name}: repr {repr(opt)!r}"


# ---- 3. torch.compile (last: every test resets dynamo, so the CPU path recompiles after it) ----
COMPILE_STEPS = 10
COMPILE_REL = 1e-6


def _compile_params() -> list[Any]:
    # One per family: kernels.eager runs every LeanOptimizer.step eagerly inside a compiled
    # region, whatever the rule (the compiled caller is the test's, not the rule's).
    out = [pytest.param(case, dict(case.kwargs), id=case.name) for case in REPRESENTATIVES]
    # Adafactor's defaults (relative_step, scale_parameter): its step size changes every step.
    out += [pytest.param(case, {}, id=f"{case.name}-defaults") for case in REPRESENTATIVES if issubclass(case.cls, leanopt.Adafactor)]
    return out


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _assert_same_as_eager(case: OptimizerCase, how: str, step: int, model: torch.nn.Module, eager: torch.nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        diff, scale = max_diff(p, q)
        assert diff <= COMPILE_REL * scale, (
            f"{case.name} {how}: step {step}, {name}: max |compiled - eager| {diff:.3g} > {COMPILE_REL:g} * max|p| ({scale:.3g})"
        )


@pytest.mark.parametrize("case,kwargs", _compile_params())
def test_compiled_step_matches_eager_every_step(case: OptimizerCase, kwargs: dict, fresh_dynamo) -> None:
    model, eager = mlp(), mlp()
    opt = case.cls(case.param_groups(model), **kwargs)
    eager_opt = case.cls(case.param_groups(eager), **kwargs)

    @torch.compile(fullgraph=False)
    def compiled_step() -> None:
        opt.step()

    for step in range(COMPILE_STEPS):
        mlp_backward(model, step)
        mlp_backward(eager, step)
        compiled_step()
        eager_opt.step()
        _assert_same_as_eager(case, f"{kwargs} torch.compile(opt.step)", step, model, eager)


@pytest.mark.parametrize("case,kwargs", _compile_params())
def test_compiled_training_step_matches_eager_every_step(case: OptimizerCase, kwargs: dict, fresh_dynamo) -> None:
    # The compiled region's forward and backward must give the eager gradients bit for bit, or
    # the comparison measures Inductor's rounding (amplified by requantization: a tanh/mean
    # model moved an 8-bit weight by 5e-6 through one flipped code), not the optimizer. ReLU,
    # matrix products (extern kernels) and a linear loss are exact; only the bias gradients
    # (batch sums, reordered) may differ by an ulp.
    def relu_mlp() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))

    model, eager = relu_mlp(), relu_mlp()
    target = torch.randn(8, 4, generator=torch.Generator().manual_seed(7))
    opt = case.cls(case.param_groups(model), **kwargs)
    eager_opt = case.cls(case.param_groups(eager), **kwargs)

    @torch.compile(fullgraph=False)
    def train_step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = (model(x) * target).sum()
        loss.backward()
        opt.step()
        return loss

    for step in range(COMPILE_STEPS):
        train_step(mlp_batch(step))
        eager_opt.zero_grad(set_to_none=True)
        (eager(mlp_batch(step)) * target).sum().backward()
        eager_opt.step()
        _assert_same_as_eager(case, f"{kwargs} compiled forward+backward+step", step, model, eager)


# One per family: kernels.step and kernels.adafactor bump the params' versions after whichever
# implementation ran, whatever the rule.
@every_family_backend_and_torch
def test_step_is_an_in_place_update_autograd_sees(case: OptimizerCase, backend: str | None) -> None:
    # torch's optimizers update params with in-place ops, which bump their version counters, so
    # a backward through a graph that saved a param the step has changed raises instead of
    # using the new values. Kernels that write a param's memory directly (the native CPU
    # kernel, Triton) must bump the counter themselves.
    params = weights(3)
    loss = sum((p * p).sum() for p in params)  # saves every param for backward
    loss.backward(retain_graph=True)
    versions = [p._version for p in params]
    make(case, params, backend).step()
    moved = [i for i, (p, v) in enumerate(zip(params, versions)) if p._version == v]
    assert not moved, f"{case.name} backend={backend}: params {moved} changed without a version bump"
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
