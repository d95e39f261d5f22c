"""An optimizer from outside leanopt (tests/external_optimizer.py: torch's RMSprop rule in ~50
lines of leanopt's public API, no edit to src/) gets what an in-tree one gets.

The registry's generic suite (tests/test_generic.py), backend parity
(tests/test_rules.py::test_backend_matches_reference, ``test_compiled_cpu_path_matches_reference``)
and the comparison with ``torch.optim.RMSprop`` on every backend
(``test_matches_its_reference``: 1e-6 of the largest |param| after 20 steps) run it through
``registry.EXTERNAL``. Here: what is particular to coming from outside -- which backends run it,
its 8-bit sibling's bytes and drift, checkpoints between the two, lookups by name while
registered and none after.
"""

from __future__ import annotations

import pytest
import torch

import leanopt
from leanopt import kernels
from leanopt.kernels import cpu_native, rules
from leanopt.optim.registry import REGISTRY
from leanopt.quant import QuantizedState
from external_optimizer import RMSPROP, RMSprop, RMSprop8bit
from registry import EXTERNAL, registered

FP32, EIGHT_BIT = EXTERNAL


def test_defined_outside_and_registered_only_while_its_tests_run() -> None:
    assert RMSprop.__module__ == "external_optimizer" and "rmsprop" not in REGISTRY
    assert rules.rule_id(RMSPROP) is None  # no Triton or C++ twin: never the shipped kernels
    with registered(FP32):
        assert REGISTRY["rmsprop"] is RMSprop and REGISTRY["rmsprop8bit"] is RMSprop8bit
        assert leanopt.optim.optimizer_class("RMSprop8bit") is RMSprop8bit
        meta = torch.nn.Linear(1024, 1024, bias=False, device="meta")
        assert leanopt.estimate(meta, "rmsprop8bit").bytes == leanopt.estimate(meta, RMSprop8bit).bytes
    assert "rmsprop" not in REGISTRY and "rmsprop8bit" not in REGISTRY
    with pytest.raises(ValueError, match="taken"):  # a name is one optimizer's
        leanopt.register(type("Other", (RMSprop,), {"name": "sgd"}))


def test_runs_on_the_reference_and_the_compiled_cpu_path() -> None:
    p, g = torch.randn(5000), torch.randn(5000)
    hp = RMSPROP.hyperparameters(dict(lr=1e-3, alpha=0.99, eps=1e-8, weight_decay=0.0, maximize=False))
    assert kernels.select("reference", RMSPROP, p, g, [torch.zeros(5000)], hp) == "reference"
    assert kernels.select("cpu", RMSPROP, p, g, [torch.zeros(5000)], hp) == "cpu-dense"
    assert not cpu_native.eligible_dense(RMSPROP, p, g, [torch.zeros(5000)], hp)  # compiled, not C++
    # Both agree with torch's RMSprop (the registry's reference test holds every backend to 1e-6).
    torch.manual_seed(0)
    p0, grads = torch.randn(4096), [torch.randn(4096) for _ in range(10)]
    out = []
    for make in (lambda ps: RMSprop(ps, lr=1e-3, backend="cpu"), lambda ps: torch.optim.RMSprop(ps, lr=1e-3)):
        w = torch.nn.Parameter(p0.clone())
        opt = make([w])
        for g in grads:
            w.grad = g.clone()
            opt.step()
        out.append(w.detach())
    assert (out[0] - out[1]).abs().max() <= 1e-6 * out[1].abs().max()


def test_eight_bit_sibling_stores_its_state_in_8_bits_and_drifts_little() -> None:
    torch.manual_seed(0)
    p0 = torch.randn(1 << 16)
    grads = [torch.randn(1 << 16) * 10.0 ** torch.randint(-3, 1, (1 << 16,)) for _ in range(30)]
    ws = []
    for cls in (RMSprop, RMSprop8bit):
        w = torch.nn.Parameter(p0.clone())
        opt = cls([w], lr=1e-3)
        for g in grads:
            w.grad = g.clone()
            opt.step()
        ws.append(w.detach())
    state = opt.state[w]
    assert isinstance(state["square_avg"], QuantizedState) and state["square_avg"].format.bits == 8
    assert leanopt.measure(opt).bytes == leanopt.estimate([w], RMSprop8bit).bytes  # estimate == measure
    assert (leanopt.measure(opt).bytes - 4) / w.numel() <= 1.02
    # 30 steps of lr 1e-3 move each weight by at most 0.03 (|g| / sqrt(v) <= 1 / sqrt(1 - alpha)
    # per step bounds more loosely); the 8-bit state's path stays within a tenth of that.
    moved = (ws[0] - p0).abs().max()
    assert torch.isfinite(ws[1]).all() and (ws[1] - ws[0]).abs().max() <= 0.1 * moved


def test_checkpoints_convert_between_the_siblings_and_refuse_another_family() -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8192))
    with registered(FP32):
        fp32 = RMSprop([w], lr=1e-3)
        w.grad = torch.randn(8192)
        fp32.step()
        sd = fp32.state_dict()
        assert {g["optimizer"] for g in sd["param_groups"]} == {"rmsprop"}
        eight = RMSprop8bit([torch.nn.Parameter(w.detach().clone())], lr=1e-3)
        eight.load_state_dict(sd)  # fp32 -> 8-bit, as AdamW -> AdamW8bit
        (q,) = [st["square_avg"] for st in eight.state.values()]
        assert isinstance(q, QuantizedState)
        dense = sd["state"][0]["square_avg"]
        assert (q.dequantize() - dense).abs().max() <= 0.1 * dense.abs().max()
        back = RMSprop([torch.nn.Parameter(w.detach().clone())], lr=1e-3)
        back.load_state_dict(eight.state_dict())  # and back
        assert back.state_dict()["state"][0]["square_avg"].dtype == torch.float32
        adamw = leanopt.AdamW([torch.nn.Parameter(w.detach().clone())])
        with pytest.raises(ValueError, match=r"saved by RMSprop \(rmsprop rule\); AdamW runs the adamw rule"):
            adamw.load_state_dict(sd)
