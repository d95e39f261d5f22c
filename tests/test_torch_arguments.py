"""Drop-in means the mirrored class's constructor arguments are accepted: every
registered optimizer whose ``references`` name a torch or transformers class takes every
parameter of that class's ``__init__``, a call written for that class means the same, and
torch's implementation flags (``foreach``, ``fused``, ``capturable``, ``differentiable``) either
choose a backend or are refused by name (:func:`leanopt.optim.base.backend_for_torch_flags`)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect

import pytest
import torch

from registry import OPTIMIZERS, OptimizerCase

MIRRORED_PACKAGES = ("torch", "transformers")


def mirrored(case: OptimizerCase) -> list[type]:
    """The installed torch/transformers classes ``case`` declares it mirrors."""
    out = []
    for path in case.cls.references:
        module, _, name = path.rpartition(".")
        if module.split(".")[0] in MIRRORED_PACKAGES and importlib.util.find_spec(module.split(".")[0]):
            out.append(getattr(importlib.import_module(module), name))
    return out


PAIRS = [(case, ref) for case in OPTIMIZERS for ref in mirrored(case)]
pairs = pytest.mark.parametrize("case,ref", PAIRS, ids=[f"{c.name}-{r.__name__}" for c, r in PAIRS])


def their_parameters(ref: type) -> dict[str, inspect.Parameter]:
    params = list(inspect.signature(ref.__init__).parameters.values())[2:]  # self, params
    return {q.name: q for q in params if q.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)}


def takes_flag(ref: type, flag: str) -> bool:
    return flag in their_parameters(ref)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    # Under min_quant_size: the low-bit optimizers keep dense states and step as their fp32 rule.
    # Matrices only, so that torch.optim.Muon (2-D params only) takes it as Muon does.
    return torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.Tanh(), torch.nn.Linear(16, 2, bias=False))


def run(make, steps: int = 3) -> list[torch.Tensor]:
    net = model()
    opt = make(net.parameters())
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        net(torch.randn(4, 8, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in net.parameters()]


def test_the_registry_mirrors_torch_and_transformers_classes() -> None:
    # The test below must have something to check: AdamW's and SGD's torch classes, Adafactor's transformers one.
    assert {ref.__module__.split(".")[0] for _, ref in PAIRS} == set(MIRRORED_PACKAGES)


@pairs
def test_every_parameter_of_the_mirrored_class_is_accepted(case: OptimizerCase, ref: type) -> None:
    ours = inspect.signature(case.cls.__init__).parameters
    missing = [name for name in their_parameters(ref) if name not in ours]
    assert not missing, f"{case.cls.__name__} does not take {ref.__module__}.{ref.__name__}'s {missing}"


@pairs
def test_a_call_with_every_mirrored_argument_means_the_same(case: OptimizerCase, ref: type) -> None:
    # Every parameter of the mirrored class spelled out at its default: the call builds both, and
    # both take the same steps (to rounding: the fp32 rule, in another order of operations).
    spelled = {name: q.default for name, q in their_parameters(ref).items() if q.default is not inspect.Parameter.empty}
    theirs = run(lambda ps: ref(ps, **spelled))
    ours = run(lambda ps: case.cls(ps, **spelled))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pairs
@pytest.mark.parametrize("flags", [{"fused": True}, {"foreach": True}, {"fused": False}], ids=str)
def test_fused_and_foreach_choose_leanopt_s_fast_path(case: OptimizerCase, ref: type, flags: dict) -> None:
    if not all(takes_flag(ref, f) for f in flags):
        pytest.skip(f"{ref.__name__} has no {list(flags)}")
    opt = case.cls(case.param_groups(model()), **case.kwargs, **flags)
    assert opt.backend == "auto"
    assert all(torch.equal(a, b) for a, b in zip(run(lambda ps: case.cls(ps, **case.kwargs, **flags)),
                                                  run(lambda ps: case.cls(ps, **case.kwargs))))  # fmt: skip


@pairs
@pytest.mark.parametrize("flags", [{"foreach": False}, {"foreach": False, "fused": False}], ids=str)
def test_foreach_false_is_the_reference_backend(case: OptimizerCase, ref: type, flags: dict) -> None:
    if not all(takes_flag(ref, f) for f in flags):
        pytest.skip(f"{ref.__name__} has no {list(flags)}")
    assert case.cls(case.param_groups(model()), **case.kwargs, **flags).backend == "reference"
    assert all(torch.equal(a, b) for a, b in zip(run(lambda ps: case.cls(ps, **case.kwargs, **flags)),
                                                  run(lambda ps: case.cls(ps, **case.kwargs, backend="reference"))))  # fmt: skip


@pairs
@pytest.mark.parametrize("flag", ["capturable", "differentiable"])
def test_what_cannot_be_honoured_is_refused_by_name(case: OptimizerCase, ref: type, flag: str) -> None:
    if not takes_flag(ref, flag):
        pytest.skip(f"{ref.__name__} has no {flag}")
    case.cls(case.param_groups(model()), **case.kwargs, **{flag: False})
    with pytest.raises(ValueError, match=f"{flag}=True is not supported"):
        case.cls(case.param_groups(model()), **case.kwargs, **{flag: True})
    with pytest.raises(ValueError, match=flag):
        case.cls(case.param_groups(model()), **case.kwargs, **{flag: "yes"})


@pairs
def test_contradictory_flags_are_refused(case: OptimizerCase, ref: type) -> None:
    if not (takes_flag(ref, "fused") and takes_flag(ref, "foreach")):
        pytest.skip(f"{ref.__name__} has no fused/foreach")
    params = list(model().parameters())
    with pytest.raises(ValueError, match="fused=True and foreach=True"):
        case.cls(case.param_groups(params), **case.kwargs, fused=True, foreach=True)
    with pytest.raises(ValueError, match="fused=True asks for a fast backend, but backend='reference'"):
        case.cls(case.param_groups(params), **case.kwargs, fused=True, backend="reference")
    with pytest.raises(ValueError, match="foreach=False asks for the reference backend, but backend='cpu'"):
        case.cls(case.param_groups(params), **case.kwargs, foreach=False, backend="cpu")
    with pytest.raises(ValueError, match="fused must be True, False or None"):
        case.cls(case.param_groups(params), **case.kwargs, fused=1)
    assert case.cls(case.param_groups(params), **case.kwargs, fused=True, backend="cpu").backend == "cpu"
