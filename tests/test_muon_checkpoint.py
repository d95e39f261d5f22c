"""Muon's files: conversion between Muon, Muon8bit, Muon4bit, bf16 momentum and torch.optim.Muon,
KellerJordan's MuonWithAuxAdam files read, and ``leanopt convert`` / ``inspect`` on them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import leanopt
from leanopt.checkpoint import TORCH_MUON, convert_checkpoint, state_dict_layout
from leanopt.memory.inspect import inspect_file

ROOT = Path(__file__).resolve().parent.parent


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))


def step(m: torch.nn.Module, opt: torch.optim.Optimizer, k: int) -> None:
    opt.zero_grad()
    m(torch.randn(16, 64, generator=torch.Generator().manual_seed(k))).square().mean().backward()
    opt.step()


def trained(cls: type, steps: int = 3, **kwargs) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    m = model()
    opt = cls(m, lr=0.02, **kwargs)
    for k in range(steps):
        step(m, opt, k)
    return m, opt


@pytest.mark.parametrize("source,target", [("muon", "muon8bit"), ("muon8bit", "muon4bit"), ("muon4bit", "muon"),
                                           ("muon8bit", "muon")])  # fmt: skip
def test_members_convert_and_continue_as_a_load_into_the_target_would(source: str, target: str) -> None:
    # A converted file equals what the target's own load_state_dict makes of the source: the
    # same next steps, bit for bit.
    m, opt = trained(leanopt.optim.optimizer_class(source))
    sd = opt.state_dict()
    conv = convert_checkpoint(sd, target)
    assert (conv.source, conv.target, state_dict_layout(conv.state_dict)) == (source, target, target)
    cls = leanopt.optim.optimizer_class(target)
    twins = []
    for saved in (conv.state_dict, sd):
        twin = model()
        twin.load_state_dict(m.state_dict())
        twin_opt = cls(twin, lr=0.02)
        twin_opt.load_state_dict(saved)
        for k in range(3, 6):
            step(twin, twin_opt, k)
        twins.append(twin)
    assert all(torch.equal(a, b) for a, b in zip(twins[0].parameters(), twins[1].parameters()))


def test_bf16_momentum_converts_both_ways() -> None:
    _, opt = trained(leanopt.Muon)
    bf16 = convert_checkpoint(opt.state_dict(), "muon", state_dtype=torch.bfloat16).state_dict
    assert {g["state_dtype"] for g in bf16["param_groups"]} == {"bfloat16"}
    assert bf16["state"][0]["momentum_buffer"].dtype == torch.bfloat16
    back = convert_checkpoint(bf16, "muon8bit").state_dict
    assert back["state"][0]["momentum_buffer"]["format"] == "pow3-s8/b256"


def test_to_torch_muon_writes_what_torch_loads_and_continues_bit_identically() -> None:
    torch.manual_seed(0)
    w = [torch.nn.Parameter(torch.randn(48, 24)), torch.nn.Parameter(torch.randn(16, 40))]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in w]
    opt = leanopt.Muon(w, lr=0.02)
    grads = [[torch.randn(p.shape) for p in w] for _ in range(6)]
    for g in grads[:3]:
        for p, gp in zip(w, g):
            p.grad = gp.clone()
        opt.step()
    conv = convert_checkpoint(opt.state_dict(), TORCH_MUON)
    assert conv.notes == ["step of 2 params left out: torch.optim.Muon keeps no step count"]
    theirs = torch.optim.Muon(twin, lr=0.02)
    for p, q in zip(twin, w):
        p.data.copy_(q.data)
    theirs.load_state_dict(conv.state_dict)
    for g in grads[3:]:
        for p, q, gp in zip(w, twin, g):
            p.grad, q.grad = gp.clone(), gp.clone()
        opt.step()
        theirs.step()
    assert all(torch.equal(p, q) for p, q in zip(w, twin))


def test_to_torch_muon_refuses_what_torch_has_no_place_for() -> None:
    _, opt = trained(leanopt.Muon)
    with pytest.raises(ValueError, match=r"param group 1 is an aux \(adamw\) group"):
        convert_checkpoint(opt.state_dict(), TORCH_MUON)
    conv = torch.nn.Parameter(torch.randn(8, 3, 3, 3))
    o = leanopt.Muon([{"params": [conv], "flatten": True}])
    conv.grad = torch.randn_like(conv)
    o.step()
    with pytest.raises(ValueError, match=r"has shape \(8, 3, 3, 3\); torch.optim.Muon takes 2-D params only"):
        convert_checkpoint(o.state_dict(), TORCH_MUON)
    with pytest.raises(ValueError, match="cannot convert the muon state_dict to adamw"):
        convert_checkpoint(opt.state_dict(), "adamw")


def kellerjordan_file(m: torch.nn.Module) -> dict:
    """A MuonWithAuxAdam state_dict as KellerJordan's muon.py saves it (its Muon group's params
    sorted largest first; aux states with an int step)."""
    groups = leanopt.muon_groups(m)
    matrices = sorted(groups[0]["params"], key=lambda p: p.size(), reverse=True)
    aux = groups[1]["params"]
    state = {i: {"momentum_buffer": torch.randn(p.shape) * 1e-3} for i, p in enumerate(matrices)}
    state.update({len(matrices) + i: {"exp_avg": torch.randn(p.shape) * 1e-3, "exp_avg_sq": torch.rand(p.shape) * 1e-6,
                                      "step": 4} for i, p in enumerate(aux)})  # fmt: skip
    return {
        "state": state,
        "param_groups": [
            {"params": list(range(len(matrices))), "lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "use_muon": True},
            {"params": list(range(len(matrices), len(matrices) + len(aux))), "lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10,
             "weight_decay": 0.0, "use_muon": False},
        ],  # fmt: skip
    }


def test_kellerjordan_file_is_read_as_muon_and_converts(tmp_path) -> None:
    sd = kellerjordan_file(model())
    assert state_dict_layout(sd) == "muon"
    conv = convert_checkpoint(sd, "muon8bit")
    assert conv.state_dict["param_groups"][1]["eps"] == 1e-10 and conv.state_dict["param_groups"][1]["optimizer"] == "muon8bit"
    path = tmp_path / "optimizer.pt"
    torch.save(sd, path)
    assert inspect_file(path).layout == "MuonWithAuxAdam (KellerJordan)"
    out = tmp_path / "converted.pt"
    run = subprocess.run([sys.executable, "-m", "leanopt", "convert", str(path), str(out), "--to", "muon8bit"], cwd=ROOT,
                         capture_output=True, text=True, env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert state_dict_layout(torch.load(out, weights_only=True)) == "muon8bit"
    refused = subprocess.run([sys.executable, "-m", "leanopt", "convert", str(path), str(tmp_path / "t.pt"), "--to", TORCH_MUON],
                             cwd=ROOT, capture_output=True, text=True, env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert refused.returncode == 2 and "aux" in refused.stderr and not (tmp_path / "t.pt").exists()
