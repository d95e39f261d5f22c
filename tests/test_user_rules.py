"""A rule written outside leanopt that is wrong is refused as itself, naming the rule, and
changes nothing else in the process.

* An error raised by a rule's function (a typo) propagates as that error with the rule's name,
  on every backend; the compiled CPU path does not take it for a compile failure, and every
  graph compiled afterwards (another rule, bf16 states) is compiled as before.
* A compile that genuinely fails (dynamo cannot trace the function) makes that graph alone run
  eagerly, said once with its name; the next graph compiles.
* A rule that returns more or fewer states than it declares, or a param or state of another
  shape than the param's, is refused at its first step on every backend, before any param or
  state changes; a rule that is right is checked once per signature, not per step.

``torch.compile`` is given dynamo's ``eager`` backend here: dynamo traces (and fails) as it
always does, without Inductor's code generation, which would take ~20 s per graph on 2 cores.
"""

from __future__ import annotations

import logging
import traceback

import pytest
import torch

import leanopt
from leanopt import kernels
from leanopt.kernels import cpu, cpu_elementwise, graphs

BACKENDS = ["reference", "cpu", "triton"] if kernels.triton_available() else ["reference", "cpu"]


@pytest.fixture
def dynamo_only(monkeypatch):
    """torch.compile traced by dynamo, run by its eager backend; no earlier failure recorded. The
    graphs made meanwhile are the test's own: none outlives it to be run by a later test."""
    real = torch.compile
    for module, cache in ((graphs, "_LISTS"), (cpu_elementwise, "_DENSE"), (cpu_elementwise, "_ROUNDED"),
                          (cpu_elementwise, "_QUANTIZED")):  # fmt: skip
        monkeypatch.setattr(module, cache, {}, raising=False)

    def compile_(fn, **kwargs):
        return real(fn, backend="eager", **kwargs)

    monkeypatch.setattr(torch, "compile", compile_)
    monkeypatch.setattr(cpu, "_FAILED", {}, raising=False)
    monkeypatch.setattr(cpu, "COMPILE_ERROR", None, raising=False)  # how a failure was recorded before
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _schedule(hp, step, safe):
    return dict(lr=hp["lr"], beta=0.9)


def _rule(name: str, elementwise, states: int = 1) -> leanopt.Rule:
    return leanopt.Rule(
        name,
        states=lambda hp: tuple(leanopt.StateKind(f"buf{k}", signed=True) for k in range(states)),
        hyperparameters=lambda group: {"lr": float(group["lr"]), "maximize": bool(group["maximize"])},
        scalars=("lr", "beta"),
        schedule=_schedule,
        elementwise=elementwise,
        max_states=states,
    )


def _optimizer(rule: leanopt.Rule) -> type:
    class Momentum(leanopt.ElementwiseOptimizer):
        name = family = rule.name

        def __init__(self, params, lr=1e-2, *, maximize=False, backend="auto"):
            super().__init__(params, dict(lr=lr, maximize=maximize), backend=backend)

        def validate_group(self, group, *, loaded=False):
            if not group["lr"] >= 0:
                raise ValueError(f"Invalid lr: {group['lr']!r}")

    Momentum.rule = rule
    return Momentum


def _typo(p, g, states, c, flags, safe):
    m = states[0] * c["beta"] + g
    return p - c["lr"] * m * scale, [m]  # noqa: F821 - the typo under test


def _good(p, g, states, c, flags, safe):
    m = states[0] * c["beta"] + g
    return p - c["lr"] * m, [m]


def _params(n: int = 3000) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(n))
    w.grad = torch.randn(n)
    return [w]


def _notes(err: BaseException) -> str:
    return "".join(traceback.format_exception(type(err), err, err.__traceback__))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rules_own_error_surfaces_as_itself_naming_the_rule(dynamo_only, backend: str, caplog) -> None:
    params = _params()
    before = params[0].detach().clone()
    opt = _optimizer(_rule("typo_rule", _typo))(params, backend=backend)
    with caplog.at_level(logging.WARNING, logger="leanopt"), pytest.raises(NameError, match="scale") as info:
        opt.step()
    assert "Rule 'typo_rule'" in _notes(info.value)
    assert torch.equal(params[0].detach(), before), "a param changed before the error"
    assert not cpu.compile_failures() and cpu.can_compile()
    assert not [r for r in caplog.records if "failed" in r.getMessage()], [r.getMessage() for r in caplog.records]


def test_graphs_built_after_a_rules_error_are_compiled(dynamo_only) -> None:
    with pytest.raises(NameError):
        _optimizer(_rule("typo_rule", _typo))(_params(), backend="cpu").step()
    # Another rule, and a graph of bf16 states (a rule without a twin in the native kernel, which
    # would take a shipped rule's bf16 states), are compiled, not run eagerly.
    _optimizer(_rule("good_rule", _good))(_params(), backend="cpu").step()
    _optimizer(_rule("good_rule", _good))([{"params": _params(), "state_dtype": torch.bfloat16}], backend="cpu").step()
    graphs = [g for g in cpu_elementwise._DENSE.values() if "good_rule" in g.__name__]
    graphs += [g for g in cpu_elementwise._ROUNDED.values() if g.__name__.startswith("good_rule_bf16_states")]
    per_dtype = [f for g in graphs for f in g.graphs.values()]
    statuses = {f.name: f.status() for f in per_dtype}
    assert any("good_rule_dense" in name for name in statuses), statuses
    assert any("good_rule_bf16" in name for name in statuses), statuses
    assert all(s == "compiled" for s in statuses.values()), statuses
    assert not cpu.compile_failures()


def test_a_graph_that_fails_to_compile_runs_eagerly_by_itself(dynamo_only, caplog) -> None:
    def untraceable(x):
        torch._dynamo.graph_break()  # dynamo refuses this under fullgraph=True: a genuine compile failure
        return x + 1

    def traceable(x):
        return x * 2

    fallbacks: list[int] = []

    def in_chunks(x):  # what the CPU paths give: the function over cache-sized chunks
        fallbacks.append(x.numel())
        return torch.cat([c + 1 for c in x.split(2)])

    broken, fine = cpu.compiled(untraceable, fallback=in_chunks), cpu.compiled(traceable)
    with caplog.at_level(logging.WARNING, logger="leanopt"):
        assert broken(torch.ones(3)).tolist() == [2.0, 2.0, 2.0]
        assert broken(torch.ones(3)).tolist() == [2.0, 2.0, 2.0]  # eager now: no second attempt, no second line
    assert fallbacks == [3, 3]  # the fallback, not the whole function, after the failure
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "untraceable" in lines[0] and "failed" in lines[0], lines
    assert broken.status().startswith("failed: ") and list(cpu.compile_failures()) == ["untraceable"]
    assert cpu.can_compile()
    assert fine(torch.ones(3)).tolist() == [2.0, 2.0, 2.0] and fine.status() == "compiled"


# ---- results held to the rule's declaration ------------------------------------------------------
def _two_states(p, g, states, c, flags, safe):
    m = states[0] * c["beta"] + g
    return p - c["lr"] * m, [m, m * m]


def _reduced_state(p, g, states, c, flags, safe):
    m = states[0] * c["beta"] + g
    return p - c["lr"] * m, [m.mean()]  # 0-dim: a copy_ would broadcast it over the state


def _reshaped_param(p, g, states, c, flags, safe):
    m = states[0] * c["beta"] + g
    return (p - c["lr"] * m)[None], [m]


def _no_list(p, g, states, c, flags, safe):
    return p - c["lr"] * g


WRONG = [
    (_two_states, r"elementwise returned 2 states for the 1 the rule declares \['buf0'\]"),
    (_reduced_state, r"elementwise returned a state 'buf0' of shape \(\) for a param of shape \(3000,\)"),
    (_reshaped_param, r"elementwise returned a param of shape \(1, 3000\) for a param of shape \(3000,\)"),
    (_no_list, r"elementwise must return \(param, \[states\]\), got a Tensor"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("elementwise,message", WRONG, ids=lambda v: getattr(v, "__name__", "msg"))
def test_a_result_that_breaks_the_declaration_is_refused_at_the_first_step(backend: str, elementwise, message: str) -> None:
    params = _params()
    before = params[0].detach().clone()
    name = f"wrong{elementwise.__name__}"
    opt = _optimizer(_rule(name, elementwise))(params, backend=backend)
    with pytest.raises((ValueError, TypeError), match=rf"Rule '{name}': {message}"):
        opt.step()
    assert torch.equal(params[0].detach(), before)
    assert all(torch.count_nonzero(v) == 0 for v in opt.state[params[0]].values() if isinstance(v, torch.Tensor)
               and v.dim() > 0)  # fmt: skip


def test_more_states_than_max_states_is_refused() -> None:
    rule = leanopt.Rule("too_many", states=lambda hp: (leanopt.StateKind("a", True), leanopt.StateKind("b", True)),
                        hyperparameters=lambda group: {"lr": float(group["lr"]), "maximize": bool(group["maximize"])},
                        scalars=("lr", "beta"), schedule=_schedule, elementwise=_two_states, max_states=1)  # fmt: skip
    with pytest.raises(ValueError, match=r"Rule 'too_many': states\(\) gives 2 states \['a', 'b'\], more than its max_states=1"):
        _optimizer(rule)(_params(), backend="reference").step()


def test_a_right_rule_is_checked_once_per_signature(monkeypatch) -> None:
    calls: list[str] = []

    def counted(p, g, states, c, flags, safe):
        calls.append(p.device.type)
        return _good(p, g, states, c, flags, safe)

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(50,), (50,), (7, 9)]]
    opt = _optimizer(_rule("counted", counted))(params, backend="reference")
    for _ in range(4):
        for p in params:
            p.grad = torch.randn(p.shape)
        opt.step()
    # Two signatures ((50,) and (7, 9)): two meta runs; the rest are the 4 x 3 real updates.
    assert calls.count("meta") == 2 and calls.count("cpu") == 12, calls
