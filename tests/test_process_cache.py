"""The process cache ($LEANOPT_CACHE/process/): a damaged or implausible entry is a miss, said in
one line, measured (or traced) again, never trusted and never fatal."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
import transformers

from leanopt.memory import probe, process

ROOT = Path(__file__).resolve().parents[1]
TINY_GPT2 = {"vocab_size": 2000, "n_positions": 64, "n_embd": 64, "n_layer": 2, "n_head": 4}
LOGGER = "leanopt.memory.process"


def tiny_gpt2() -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(**TINY_GPT2))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANOPT_CACHE", str(tmp_path))
    return tmp_path


def _one_time_path(model: torch.nn.Module, precision: str, optimizer: str) -> tuple[Path, dict]:
    key = process._key(probe.probe_spec(model, precision, optimizer, None))
    return process._cache_file(key), key


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


def _valid(key: dict) -> dict:
    return {"key": key, "when": "2026-12-03 10:00", "bytes": 1000, "parts": {"model_build": 600, "first_steps": 400}}


# Each kind of damage as the text of the file; None: the valid entry, changed by the function.
DAMAGE = {
    "a JSON list": lambda key: "[1, 2]",
    "not JSON": lambda key: "{not json",
    "not UTF-8": lambda key: b"\xff\xfe{".decode("latin-1"),
    "negative bytes": lambda key: json.dumps({**_valid(key), "bytes": -10**12, "parts": {"model_build": -10**12}}),
    "NaN bytes": lambda key: json.dumps(_valid(key)).replace('"bytes": 1000', '"bytes": NaN'),
    "absurdly large": lambda key: json.dumps({**_valid(key), "bytes": 10**30, "parts": {"model_build": 10**30}}),
    "float bytes": lambda key: json.dumps({**_valid(key), "bytes": 1000.0}),
    "text bytes": lambda key: json.dumps({**_valid(key), "bytes": "1000"}),
    "boolean bytes": lambda key: json.dumps({**_valid(key), "bytes": True, "parts": {"model_build": True}}),
    "no bytes": lambda key: json.dumps({k: v for k, v in _valid(key).items() if k != "bytes"}),
    "no key": lambda key: json.dumps({k: v for k, v in _valid(key).items() if k != "key"}),
    "another probe version": lambda key: json.dumps({**_valid(key), "key": {**key, "probe": key["probe"] - 1}}),
    "parts not an object": lambda key: json.dumps({**_valid(key), "parts": [600, 400]}),
    "a negative part": lambda key: json.dumps({**_valid(key), "parts": {"model_build": 1400, "first_steps": -400}}),
    "parts that do not add up": lambda key: json.dumps({**_valid(key), "parts": {"model_build": 600}}),
    "no date": lambda key: json.dumps({k: v for k, v in _valid(key).items() if k != "when"}),
}


def test_a_valid_entry_is_used(cache, caplog):
    model = tiny_gpt2()
    path, key = _one_time_path(model, "fp32", "adamw")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(_valid(key)))
    got = process.cpu_one_time(model, "fp32", "adamw", measure=False)
    assert (got.bytes, got.parts) == (1000, {"model_build": 600, "first_steps": 400}) and "cached in" in got.source
    assert not _warnings(caplog)


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_one_time_entry_is_a_miss_said_in_one_line(cache, caplog, damage):
    model = tiny_gpt2()
    path, key = _one_time_path(model, "fp32", "adamw")
    path.parent.mkdir(parents=True)
    path.write_text(DAMAGE[damage](key), encoding="latin-1")
    got = process.cpu_one_time(model, "fp32", "adamw", measure=False)
    assert got.bytes is None and got.parts == {}, damage
    (line,) = _warnings(caplog)
    assert "\n" not in line and str(path) in line and line.endswith("not used"), line


@pytest.mark.parametrize("table", ["[1, 2]", '{"H100|torch x": [1]}', '{"H100|torch x": {"bytes": -5}}',
                                   '{"H100|torch x": {"bytes": 1e30}}', '{"H100|torch x": {"bytes": 2000000000000}}', "{"])  # fmt: skip
def test_a_damaged_cuda_context_is_assumed_said_in_one_line(cache, caplog, table):
    path = cache / "process" / "cuda-context.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"H100|torch x": {"bytes": 400 * 2**20, "when": "2026-12-03"}}))
    assert process.cuda_context()[0] == 400 * 2**20  # a valid table is used
    assert process.cuda_context("H100")[0] == process.ASSUMED_CUDA_CONTEXT  # another torch: not this entry
    assert not _warnings(caplog)
    path.write_text(table)
    nbytes, source = process.cuda_context()
    assert nbytes == process.ASSUMED_CUDA_CONTEXT and "assumed" in source
    (line,) = _warnings(caplog)
    assert "\n" not in line and str(path) in line and "assumed" in line


def test_a_damaged_cuda_context_does_not_stop_a_plan(cache, caplog):
    pytest.importorskip("triton")
    from leanopt.memory.plan import plan

    (cache / "process").mkdir()
    (cache / "process" / "cuda-context.json").write_text("[1, 2]")
    (row,) = plan(tiny_gpt2(), batch=2, seq=16, optimizers=["adamw"], precisions=["fp32"], checkpointing=[False],
                  grad_release=[False], device="cuda", budget="1MiB")  # fmt: skip
    assert row.one_time["cuda_context"] == process.ASSUMED_CUDA_CONTEXT and row.fits is False
    assert len(_warnings(caplog)) == 1


@pytest.mark.parametrize("damage", ["[1, 2]", "negative", "another row"])
def test_a_damaged_heap_entry_is_traced_again(cache, caplog, damage):
    row = {"precision": "fp32", "optimizer": "adamw", "batch": 2, "seq": 16}
    model = tiny_gpt2()
    margin = process.glibc_heap_margin(model, **row)
    (path,) = (cache / "process").glob("heap-*.json")
    entry = json.loads(path.read_text())
    text = {"[1, 2]": "[1, 2]", "negative": json.dumps({**entry, "bytes": -10**12}),
            "another row": json.dumps({**entry, "key": {**entry["key"], "row": {**row, "batch": 3}}})}[damage]  # fmt: skip
    path.write_text(text)
    assert process.glibc_heap_margin(model, **row) == margin
    (line,) = _warnings(caplog)
    assert "\n" not in line and str(path) in line and "traced again" in line
    assert json.loads(path.read_text())["bytes"] == margin  # written again, whole


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="the probe reads Linux /proc")
def test_plan_measures_damaged_entries_again(tmp_path):
    """The command line over a cache whose entries are a JSON list and a negative one-time cost:
    each row measured again (one stderr line per entry), nothing fits 1 MiB, exit 0."""
    cache = tmp_path / "cache"
    model = tiny_gpt2()
    damaged = {}
    for optimizer, text in (("adamw", lambda key: "[1, 2]"), ("adafactor", DAMAGE["negative bytes"])):
        path, key = _one_time_path(model, "fp32", optimizer)
        damaged[path] = text(key)
    (cache / "process").mkdir(parents=True)
    for path, text in damaged.items():
        (cache / "process" / path.name).write_text(text)
    transformers.GPT2Config(**TINY_GPT2).to_json_file(tmp_path / "config.json")
    env = {**os.environ, "LEANOPT_CACHE": str(cache), "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-m", "leanopt", "plan", str(tmp_path), "--batch", "2", "--seq", "16", "--optimizers",
                          "adamw,adafactor", "--precisions", "fp32", "--grad-release", "off", "--budget", "1MiB", "--json"],
                         env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if "process cache entry" in line]
    assert len(lines) == 2 and all("measured again" in line for line in lines), out.stderr
    # what is measured, by one probe process, each setup as it is done, where it is cached
    said = out.stderr.splitlines()
    assert any("of 2 setups of GPT2LMHeadModel in one probe process" in line and f"cached in {cache / 'process'}" in line
               for line in said), out.stderr  # fmt: skip
    assert [line.split()[1] for line in said if line.startswith("leanopt:   ")] == ["1/2", "2/2"], out.stderr
    rows = json.loads(out.stdout)
    assert len(rows) == 4
    for r in rows:
        assert r["process_bytes"] > r["peak_bytes"] and r["fits"] is False and r["compared"] == "process_bytes", r
    for path in damaged:
        assert json.loads((cache / "process" / path.name).read_text())["bytes"] > 0  # measured and written again
