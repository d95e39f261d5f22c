"""The probe behind a CPU plan's process_bytes (leanopt.memory.probe): every setup a plan needs
measured by one probe process, held to the definition -- a fresh process per setup --, and what a
first plan says while it measures. (Its speed: benchmarks/plan_first_run.py.)"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
import transformers

from leanopt.memory import probe, process
from leanopt.memory.plan import plan

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
LINUX = Path("/proc/self/clear_refs").exists()
TINY_GPT2 = {"vocab_size": 2000, "n_positions": 64, "n_embd": 64, "n_layer": 2, "n_head": 4}


def tiny_gpt2() -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(**TINY_GPT2))


class _Spawned:
    """The probe processes started meanwhile (subprocess.Popen as the probe module calls it)."""

    def __init__(self, monkeypatch) -> None:
        self.procs: list[subprocess.Popen] = []
        real = subprocess.Popen

        def popen(*args, **kwargs):
            proc = real(*args, **kwargs)
            self.procs.append(proc)
            return proc

        monkeypatch.setattr(probe.subprocess, "Popen", popen)


@pytest.mark.skipif(not LINUX, reason="the probe reads Linux /proc")
def test_one_probe_process_measures_setups_as_a_fresh_process_each_does(monkeypatch):
    """Forked from one process that imported once, each setup's growth is the growth of a fresh
    process of its own (the definition, and the fallback where /proc/self/pagemap cannot be read):
    without the touch of the parent's file pages a fork counts ~20 MiB of library pages more."""
    spawned = _Spawned(monkeypatch)
    specs = [probe.probe_spec(tiny_gpt2(), "fp32", optimizer, None) for optimizer in ("adamw", "adafactor")]
    reported = []
    together = probe.measure(specs, lambda i, result: reported.append(i))
    assert len(spawned.procs) == 1 and sorted(reported) == [0, 1]
    for spec, got in zip(specs, together):
        assert isinstance(got, dict), got
        alone = probe._probe_alone(spec, probe.PROBE_TIMEOUT_S)
        assert isinstance(alone, dict), alone
        assert abs(got["peak"] - alone["peak"]) <= 5 * MiB, (spec["optimizer"], got, alone)
        assert abs(got["built"] - alone["built"]) <= 5 * MiB and got["param_bytes"] == alone["param_bytes"]
        assert got["peak"] > got["built"] > got["param_bytes"] > 0


@pytest.mark.skipif(not LINUX, reason="the probe reads Linux /proc")
def test_a_plan_that_fails_stops_its_probe_and_caches_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("LEANOPT_CACHE", str(tmp_path))
    spawned = _Spawned(monkeypatch)
    model = tiny_gpt2()

    def failing(*args, **kwargs):
        time.sleep(2)  # the probe has started meanwhile
        raise RuntimeError("boom")

    model.transformer.h[0].attn.forward = failing
    with pytest.raises(ValueError, match="cannot trace a training step of GPT2LMHeadModel.*RuntimeError: boom"):
        plan(model, batch=1, seq=8, optimizers=["adamw"], precisions=["fp32"], checkpointing=[False], grad_release=[False])
    (proc,) = spawned.procs
    assert proc.poll() is not None  # stopped, not left running
    assert not list(tmp_path.rglob("cpu-*.json"))


def test_cached_settings_start_no_probe(monkeypatch, tmp_path):
    monkeypatch.setenv("LEANOPT_CACHE", str(tmp_path))
    spawned = _Spawned(monkeypatch)
    costs = process.OneTimeCosts(tiny_gpt2(), [("fp32", "adamw", None)], measure=False)
    (cost,) = costs.result().values()
    assert cost.bytes is None and "not measured yet" in cost.source and not spawned.procs


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_a_terminal_sees_what_plan_does_at_once(tmp_path):
    """stderr a terminal: the first line says what is being done before anything is traced; a
    script's stderr (not a terminal) keeps nothing but one-line errors (tests/test_cli.py)."""
    transformers.GPT2Config(**TINY_GPT2).to_json_file(tmp_path / "config.json")
    leader, follower = os.openpty()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "LEANOPT_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, "-m", "leanopt", "plan", str(tmp_path), "--batch", "2", "--seq", "16", "--optimizers",
                             "adamw", "--precisions", "fp32", "--grad-release", "off", "--no-process"], stdout=subprocess.PIPE,
                            stderr=follower, stdin=subprocess.DEVNULL, env=env)  # fmt: skip
    os.close(follower)
    said = b""
    deadline = time.monotonic() + 300
    while b"\n" not in said and time.monotonic() < deadline:
        if select.select([leader], [], [], 5)[0]:
            said += os.read(leader, 4096)
    out, _ = proc.communicate(timeout=300)
    os.close(leader)
    assert proc.returncode == 0
    first = said.decode().splitlines()[0]
    assert first.startswith(f"leanopt plan: tracing a training step of {tmp_path} per setup on fake tensors"), first
    assert "adamw" in out.decode() and "step MB" in out.decode()
