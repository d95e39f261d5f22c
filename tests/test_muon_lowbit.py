"""Muon's momentum stored in 8 or 4 bits (Muon8bit, Muon4bit) or bf16: its bytes, its distance
from fp32 Muon (benchmarks/muon_drift.py, the figures of docs/quantized.md), a NaN gradient."""

from __future__ import annotations

import pytest
import torch

import leanopt
from leanopt.quant import QuantizedState
from repo_modules import benchmark

drift = benchmark("muon_drift")

# Matrix state bytes per param on a 4096 x 64 weight (as many elements as 512 x 512, whole blocks of
# both formats; tall and narrow: one step's Newton-Schulz is 64-wide, 0.3 GFLOP in bf16, where a
# square 1024 x 1024 costs 32 GFLOP, ~40 s on a CPU without bf16 matrix units), its 4-byte step
# left out: 8-bit codes and one fp32 scale per 256 (1.0156), 4-bit codes and one per 128 (0.5313),
# bf16 (2), fp32 (4).
BYTES = {"muon8bit": 1.0157, "muon4bit": 0.5313, "muon-bf16": 2.0, "muon": 4.0}
MAKERS = {
    "muon8bit": lambda ps: leanopt.Muon8bit(ps),
    "muon4bit": lambda ps: leanopt.Muon4bit(ps),
    "muon-bf16": lambda ps: leanopt.Muon(ps, state_dtype=torch.bfloat16),
    "muon": lambda ps: leanopt.Muon(ps),
}


@pytest.mark.parametrize("name", BYTES)
def test_matrix_bytes_per_param_estimate_equals_measure(name: str) -> None:
    w = torch.nn.Parameter(torch.zeros(4096, 64))
    opt = MAKERS[name]([w])
    w.grad = torch.randn_like(w)
    opt.step()
    measured = leanopt.measure(opt)
    assert measured.bytes == leanopt.estimate([w], type(opt), **({"state_dtype": torch.bfloat16} if name == "muon-bf16" else {})).bytes
    assert (measured.bytes - 4) / w.numel() <= BYTES[name]


def test_aux_params_keep_their_rules_own_bytes() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(512, 64), torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    for aux, per_param in (("adamw", 8.0), ("adamw8bit", None)):
        groups = leanopt.muon_groups(model, aux=aux)
        opt = leanopt.Muon8bit(groups)
        model(torch.randint(0, 512, (8,))).square().mean().backward()
        opt.step()
        aux_params = [p for g in groups if not g["use_muon"] for p in g["params"]]
        alone = leanopt.estimate(aux_params, aux)  # the aux rule's own optimizer on those params
        got = sum(leanopt.measure(opt).by_key.get(k, 0) for k in ("exp_avg", "exp_avg_sq"))
        assert got == alone.by_key["exp_avg"] + alone.by_key["exp_avg_sq"]
        if per_param is not None:
            assert got == per_param * sum(p.numel() for p in aux_params)
        assert isinstance(opt.state[model[1].weight]["momentum_buffer"], QuantizedState)
        model.zero_grad()


@pytest.mark.parametrize(
    "name,bound",
    # Measured 2026-12-03 (2 seeds x 100 steps, the relative distance of docs/quantized.md):
    # muon8bit 0.022 dense / 0.014 sparse, muon4bit 0.30 / 0.18, bf16 momentum 0.0069 / 0.0087.
    [("muon8bit", {"dense": 0.033, "sparse": 0.021}), ("muon4bit", {"dense": 0.45, "sparse": 0.28}),
     ("muon-bf16-momentum", {"dense": 0.011, "sparse": 0.013})],
)  # fmt: skip
def test_distance_from_fp32_muon_is_held_to_the_measured_figures(name: str, bound: dict) -> None:
    rows = drift.compare([name], seeds=range(2), steps=100)
    for row in rows:
        assert row["finite"], row
    for row in drift.summary(rows):
        assert row["relative"] <= bound[row["workload"]], row


def test_a_nan_gradient_element_resets_its_buffer_and_leaves_the_params_finite() -> None:
    torch.manual_seed(1)
    w = torch.nn.Parameter(torch.randn(64, 128))
    opt = leanopt.Muon8bit([w], lr=0.02)
    for k in range(3):
        w.grad = torch.randn_like(w)
        if k == 2:
            w.grad[5, 7] = float("nan")
        opt.step()
    assert torch.isfinite(w).all()
    assert opt.state[w]["momentum_buffer"].dequantize()[5, 7] == 0.0
