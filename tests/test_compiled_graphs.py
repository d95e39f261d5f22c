"""A compiled path on every device: a rule without a Triton twin runs as Inductor-compiled graphs
on a GPU, several params per call (kernels.graphs), and ``backend="compiled"`` runs them anywhere.

* The decision (``kernels.select``) for a GPU step, emulated here by a trace of a CUDA step
  (:mod:`leanopt.tracing`): every registered rule goes to its Triton twin where it has one taking
  its number of states, else to its compiled graphs (dense, bf16 or block-quantized states);
  ``backend="compiled"`` to the compiled graphs on either device. On CPU tensors nothing changes.
* The graphs over lists of params against the reference, on the CPU, for every registered
  elementwise optimizer (``backend="compiled"``; tests/test_rules.py's tolerances): traced by
  dynamo and run eagerly (the ``dynamo_only`` fixture: Inductor's CPU code of the same update
  functions is held to the reference by tests/test_cpu_paths.py), and once compiled by Inductor.
* A planned GPU step on fake tensors compiles nothing and allocates what the CPU graph does.

On a GPU, scripts/gpu_check.py's ``twins`` stage holds the Triton twins, these graphs compiled
for the GPU and the reference against each other (benchmarks/backend_parity.py).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import leanopt
from leanopt import kernels, tracing
from leanopt.kernels import graphs, rules, twins
from leanopt.optim.elementwise import ElementwiseOptimizer
from leanopt.quant import BlockFormat, QuantizedState
from external_optimizer import RMSPROP, RMSprop, RMSprop8bit
from registry import GENERIC, representatives
from test_rules import _matches_reference
from test_user_rules import dynamo_only  # noqa: F401 - the fixture

ELEMENTWISE = [c for c in GENERIC if issubclass(c.cls, ElementwiseOptimizer)]


def _stepped(case, shapes=((300,), (33, 65), (5,))) -> tuple[list[torch.nn.Parameter], ElementwiseOptimizer]:
    """The case's optimizer after one reference step: its params carry real states."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    opt = case.cls(params, **{**case.kwargs, "backend": "reference", **({"min_quant_size": 100} if hasattr(case.cls, "state_bits") else {})})
    for p in params:
        p.grad = torch.randn(p.shape)
    opt.step()
    return params, opt


@pytest.mark.parametrize("case", ELEMENTWISE, ids=str)
def test_on_a_gpu_every_rule_runs_its_twin_or_its_compiled_graph(case) -> None:
    params, opt = _stepped(case)
    group = opt.param_groups[0]
    hp = opt.rule.hyperparameters(group)
    keys = opt.state_keys(group)
    for p in params:
        states = [opt.state[p][k] for k in keys]
        quantized = bool(states) and all(isinstance(s, QuantizedState) for s in states)
        with tracing.tracing("cuda"):
            auto = kernels.select("auto", opt.rule, p, p.grad, states, hp)
            compiled = kernels.select("compiled", opt.rule, p, p.grad, states, hp)
            reference = kernels.select("reference", opt.rule, p, p.grad, states, hp)
        kind = "quantized" if quantized else "dense"
        has_twin = twins.takes(twins.TRITON, opt.rule, hp, len(states))
        assert auto == (f"triton-{kind}" if has_twin else f"compiled-{kind}"), (case.name, tuple(p.shape), auto)
        assert compiled == f"compiled-{kind}" and reference == "reference"
        # On CPU tensors: backend="compiled" takes the same graphs; auto keeps the CPU paths.
        assert kernels.select("compiled", opt.rule, p, p.grad, states, hp) == f"compiled-{kind}"
        assert kernels.select("auto", opt.rule, p, p.grad, states, hp) == f"cpu-{kind}"


def test_a_rule_without_a_twin_on_a_gpu_is_compiled_not_run_by_the_reference() -> None:
    p, g = torch.randn(5000), torch.randn(5000)
    hp = RMSPROP.hyperparameters(dict(lr=1e-3, alpha=0.99, eps=1e-8, weight_decay=0.0, maximize=False))
    q = BlockFormat("pow6-u8", 256).zeros((5000,), p.device)
    adamw = rules.ADAMW.hyperparameters(dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=True,
                                             maximize=False))  # fmt: skip
    four = [torch.zeros(5000) for _ in range(4)]
    with tracing.tracing("cuda"):
        assert kernels.select("triton", RMSPROP, p, g, [torch.zeros(5000)], hp) == "compiled-dense"
        assert kernels.select("auto", RMSPROP, p, g, [q], hp) == "compiled-quantized"
        # A shipped rule with more states than its twin takes: compiled too.
        assert kernels.select("auto", rules.ADAMW, p, g, four, adamw) == "compiled-dense"
        assert kernels.select("auto", rules.ADAMW, p, g, four[:3], adamw) == "triton-dense"
        # Adafactor (not a rule): its own kernels.
        assert kernels.select("compiled", "adafactor", torch.randn(3, 4), torch.randn(3, 4), [None, torch.zeros(3),
                              torch.zeros(4), None]) == "triton-adafactor"  # fmt: skip
        with pytest.raises(RuntimeError, match="backend='cpu' got tensors on cuda"):
            kernels.select("cpu", RMSPROP, p, g, [torch.zeros(5000)], hp)
    assert kernels.select("compiled", "adafactor", torch.randn(3, 4), torch.randn(3, 4), [None, torch.zeros(3),
                          torch.zeros(4), None]) == "cpu-adafactor"  # fmt: skip
    assert "compiled" in kernels.BACKENDS and leanopt.AdamW([torch.nn.Parameter(p)], backend="compiled").backend == "compiled"


def test_lists_of_params_take_few_lengths() -> None:
    assert [len(part) for part in graphs.lists(range(37))] == [16, 16, 4, 1]
    assert [len(part) for part in graphs.lists(range(16))] == [16]
    assert sum(graphs.lists(range(100)), []) == list(range(100))
    assert {len(part) for n in range(1, 200) for part in graphs.lists(range(n))} == {1, 2, 4, 8, 16}


@pytest.mark.parametrize("cls", [RMSprop, RMSprop8bit], ids=lambda c: c.__name__)
def test_a_planned_gpu_step_compiles_nothing_and_counts_the_graphs_temporaries(monkeypatch, cls) -> None:
    from leanopt.memory.plan_trace import traced_kernels, traced_param_steps

    def refuse(*args, **kwargs):
        raise AssertionError("a graph compiled inside a trace")

    monkeypatch.setattr(torch, "compile", refuse)
    shape = (64, 256)
    with FakeTensorMode(), traced_kernels("cuda"):
        steps = traced_param_steps([(shape, torch.float32, ())], cls, device="cuda")
    quantized = hasattr(cls, "state_bits")
    temporaries = graphs.QUANTIZED_TEMP_BYTES[8] * 64 * 256 if quantized else 0
    assert steps.transient[shape, torch.float32, ()] >= temporaries


# ---- the graphs against the reference, on the CPU --------------------------------------------------
@pytest.mark.usefixtures("dynamo_only")
@pytest.mark.parametrize("case", ELEMENTWISE, ids=str)
def test_compiled_backend_matches_reference(case) -> None:
    _matches_reference(case, "compiled", torch.float32, {})


# The param's conversion on load and store and the maximize sign: the same plumbing for every rule
# of a family, one case per family (dense, block-quantized, bf16 states, a user's rule).
@pytest.mark.parametrize("case", representatives(ELEMENTWISE), ids=str)
@pytest.mark.parametrize("dtype,kwargs", [(torch.bfloat16, {}), (torch.float32, {"maximize": True, "weight_decay": 0.1})],
                         ids=["bfloat16", "maximize"])  # fmt: skip
@pytest.mark.usefixtures("dynamo_only")
def test_compiled_backend_matches_reference_on_other_variants(case, dtype, kwargs) -> None:
    _matches_reference(case, "compiled", dtype, kwargs)


def test_a_list_graph_compiled_by_inductor_matches_the_cpu_path() -> None:
    """Inductor's code for a list of params (the form a GPU runs) gives the CPU path's bits: the
    same update functions, scalars from a table instead of one tensor each."""
    torch.manual_seed(0)
    shapes = [(300,), (33, 65), (2049,)]
    init = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(3)]
    out = {}
    for backend in ("compiled", "cpu"):
        params = [torch.nn.Parameter(p.clone()) for p in init]
        opt = RMSprop(params, lr=1e-3, weight_decay=0.01, backend=backend)
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step()
        out[backend] = [t.detach() for p in params for t in (p, opt.state[p]["square_avg"])]
    assert all(torch.equal(a, b) for a, b in zip(out["compiled"], out["cpu"])), [(a - b).abs().max().item() for a, b in zip(out["compiled"], out["cpu"])]
    # Three params: a list of two and a list of one, each one graph.
    lengths = {k[-1]: g.status() for k, g in graphs._LISTS.items() if k[0] is RMSPROP}
    assert lengths == {2: "compiled", 1: "compiled"}, lengths
