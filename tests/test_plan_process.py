"""plan's process_bytes (what the process needs: the step's peak plus the one-time costs of a first
step), --budget against it, --accum, and the CUDA margin model."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
import transformers

from leanopt import cli
from leanopt.compare.meter import TensorPeak
from leanopt.memory import probe, process
from leanopt.memory.plan import plan

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
LINUX = Path("/proc/self/clear_refs").exists()
TINY_GPT2 = {"vocab_size": 2000, "n_positions": 64, "n_embd": 64, "n_layer": 2, "n_head": 4}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One probe cache for the module (each probe is a ~10 s subprocess)."""
    folder = tmp_path_factory.mktemp("leanopt-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LEANOPT_CACHE", str(folder))
        yield folder


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_gpt2() -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(**TINY_GPT2))


# One row (tiny GPT-2, AdamW, fp32, no checkpointing, no release), the process bytes its probe measured.
ROW = {"batch": 2, "seq": 16, "optimizers": ["adamw"], "precisions": ["fp32"], "checkpointing": [False], "grad_release": [False]}


@pytest.fixture(scope="module")
def pinned_row(cache):
    (row,) = plan(tiny_gpt2(), **ROW)
    return row


# ---- the independent check: a fresh process as a user runs it -------------------------------------
# benchmarks/process_peak.py: a fresh process, the resident set just before the model is built, the
# model built and trained three steps, the resident-set high-water mark; none of leanopt's memory
# code. The probe behind process_bytes runs a smaller model of the same class (128 wide, 4 x 64),
# so this also checks that the one-time cost carries over to another size. Both allocators: glibc's
# defaults (process_bytes: what a user who changes nothing sees) and pin_allocator()'s setting
# (process_bytes_pinned), each in its own fresh process.
@pytest.mark.skipif(not LINUX, reason="needs Linux /proc for the resident set")
@pytest.mark.parametrize("row", [("tiny-distilbert", "adamw", "fp32", False),
                                 pytest.param(("narrow-gpt2-2seq", "adamw8bit", "bf16-mixed", False), marks=pytest.mark.slow)])  # fmt: skip
def test_process_bytes_within_5_percent_of_a_fresh_process(cache, row):
    bench = _load("process_peak")
    predicted = bench.predict(*row)
    assert predicted.process_bytes is not None, predicted.process_source
    assert predicted.process_bytes - predicted.process_bytes_pinned == predicted.one_time["glibc_heap"] > 0
    # Pinned, a fresh process's peak repeats within 0.2 %: one process. Under glibc's defaults it does
    # not: the tiny GPT-2 row (8 sequences) falls in two clusters ~35 MiB apart (eleven fresh processes
    # on the idle machine, 2026-12-03: 342-358 MiB and 382-411 MiB; docs/plan.md); the bf16-mixed
    # row here runs the half-wide GPT-2 on 2 sequences (bf16 matmuls are slow on a CPU without bf16
    # instructions; 9 s a process against 14 s for the 256-wide one): five processes on 2026-12-05,
    # 313-317 MiB against 319 MiB predicted, pinned +0.4 % (the 256-wide one on 2026-12-04: 335-346
    # against 347 MiB, pinned +0.25 %). So three processes, and the
    # model (opt-in, plan(allocator="glibc")) is held to the cluster it errs on: not more than 10 %
    # under the largest (the side where a plan would say "fits" and the process would not), not
    # more than 20 % over the smallest.
    pinned = bench.measure(*row)
    defaults = sorted(bench.measure(*row, default_malloc=True) for _ in range(3))
    assert predicted.peak_bytes < pinned < defaults[0]  # the step's peak alone is under what the process needed
    figures = (row, predicted.peak_bytes, predicted.process_bytes_pinned, pinned, predicted.process_bytes, defaults)
    assert abs(predicted.process_bytes_pinned - pinned) <= 0.05 * pinned, figures
    assert 0.90 * defaults[-1] <= predicted.process_bytes <= 1.20 * defaults[0], figures


# ---- glibc's default heap, modelled ----------------------------------------------------------------
KiB = 1024


def chunk(n: int) -> int:
    return process._chunk(n)


def test_glibc_heap_model_by_hand():
    peak = process.glibc_resident_peak
    assert peak([]) == (0, 0)
    # under the 128 KiB threshold: from the heap, and its chunk stays the extent after the free
    assert peak([("a", 1000), ("a", -1)]) == (chunk(1000), 1000)
    # a 1 MiB block is mapped (page-rounded) while the threshold is 128 KiB
    mapping = -(-(MiB + 16 + 64) // 4096) * 4096
    assert peak([("a", MiB), ("a", -1)]) == (mapping, MiB)
    # its free raises the threshold to its size: the next one comes from the heap
    assert peak([("a", MiB), ("a", -1), ("b", MiB)]) == (mapping, MiB)  # heap chunk (< the mapping) after it went
    # a freed heap chunk is reused by a request that fits (the threshold given: nothing mapped)
    assert peak([("b", MiB), ("c", 1000), ("b", -1), ("d", MiB)], threshold=2 * MiB) == (chunk(MiB) + chunk(1000), MiB + 1000)
    # holes do not merge: two freed 64 KiB chunks next to each other do not take a 128 KiB request
    small = [("x", 64 * KiB), ("y", 64 * KiB), ("bar", 100), ("x", -1), ("y", -1), ("z", 120 * KiB)]
    assert peak(small) == (2 * chunk(64 * KiB) + chunk(100) + chunk(120 * KiB), 2 * 64 * KiB + 100)
    # best fit: the smallest hole that fits is used (the 64 KiB one, not the 96 KiB one)
    fit = [("p", 96 * KiB), ("b1", 100), ("q", 64 * KiB), ("b2", 100), ("p", -1), ("q", -1), ("r", 60 * KiB)]
    assert peak(fit)[0] == chunk(96 * KiB) + chunk(64 * KiB) + 2 * chunk(100)
    # a freed chunk at the top gives the top back
    assert peak([("a", 1000), ("a", -1), ("b", 2000)])[0] == chunk(2000)


def test_row_carries_both_figures(cache, pinned_row):
    kw = {**ROW, "allocator": "glibc"}
    pinned = pinned_row  # the default: no heap trace
    assert "glibc_heap" not in pinned.one_time and "leanopt.pin_allocator()" in pinned.process_source
    (row,) = plan(tiny_gpt2(), **kw)
    assert row.process_bytes_pinned == pinned.process_bytes == pinned.process_bytes_pinned
    with pytest.raises(ValueError, match="allocator must be 'pinned' or 'glibc'"):
        plan(tiny_gpt2(), **{**kw, "allocator": "jemalloc"})
    assert row.process_bytes_pinned == row.process_bytes - row.one_time["glibc_heap"] >= row.peak_bytes
    assert "glibc's default heap modelled" in row.process_source and "pin_allocator" in row.process_source
    d = row.as_dict()
    assert d["process_bytes_pinned"] == row.process_bytes_pinned and d["one_time"]["glibc_heap"] == row.one_time["glibc_heap"]
    # the margin is cached: a second plan traces nothing and gives the same figure
    assert list((cache / "process").glob("heap-*.json"))
    (again,) = plan(tiny_gpt2(), **kw)
    assert again.one_time["glibc_heap"] == row.one_time["glibc_heap"]


def test_pin_allocator(tmp_path):
    import leanopt
    from leanopt.memory import resident

    for bad in (0, -1, 1.5, True, resident.GLIBC_MMAP_THRESHOLD_MAX + 1, "64KiB"):
        with pytest.raises(ValueError, match="mmap_threshold"):
            leanopt.pin_allocator(bad)
    with pytest.raises(ValueError, match="trim_threshold"):
        resident.set_malloc(trim_threshold=-1)
    # in a fresh process (it changes the allocator for the rest of the process)
    code = ("import leanopt; from leanopt.memory import resident as r; a = r.allocator(); ok = leanopt.pin_allocator(); "
            "b = r.allocator(); r.set_malloc(mmap_threshold=32 << 20); print(a, ok, b, r.allocator())")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()
    if out[0] == "other":
        assert out == ["other", "False", "other", "other"]  # not glibc: nothing to pin
    else:
        assert out == ["glibc", "True", "pinned", "glibc"]
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    # resident.py alone (it imports the standard library only): what it reads of the variable
    code = ("import importlib.util as u; s = u.spec_from_file_location('resident', " + repr(resident.__file__) + "); "
            "r = u.module_from_spec(s); s.loader.exec_module(r); print(r.allocator())")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out[0] in ("pinned", "other")


# ---- the probe and its cache ---------------------------------------------------------------------
def test_the_one_time_cost_is_measured_once_and_cached(cache):
    model = tiny_gpt2()
    first = process.cpu_one_time(model, "fp32", "adamw")
    assert first.bytes is not None and first.bytes > 0, first.source
    assert sum(first.parts.values()) == first.bytes
    again = process.cpu_one_time(model, "fp32", "adamw", measure=False)
    assert again.bytes == first.bytes and again.source.startswith("measured") and "cached in" in again.source
    entries = {f: json.loads(f.read_text()) for f in (cache / "process").glob("cpu-*.json")}
    files = [f for f, e in entries.items() if e["key"]["model"].endswith("GPT2LMHeadModel") and e["key"]["precision"] == "fp32"
             and e["key"]["optimizer"] == "adamw"]  # fmt: skip
    assert len(files) == 1 and entries[files[0]]["key"]["torch"] == torch.__version__
    # another precision or optimizer is another key; nothing cached for it yet
    assert process.cpu_one_time(model, "bf16-mixed", "adamw", measure=False).bytes is None
    assert process.cpu_one_time(model, "fp32", "adafactor", measure=False).bytes is None
    # a damaged cache file is not trusted (tests/test_process_cache.py: every kind of damage)
    for f in files:
        f.write_text("{not json")
    assert process.cpu_one_time(model, "fp32", "adamw", measure=False).bytes is None
    for f, entry in entries.items():  # as it was, for the module's later plans (pinned_row)
        f.write_text(json.dumps(entry))
    assert process.cpu_one_time(model, "fp32", "adamw", measure=False).bytes == first.bytes


def test_cache_folder_follows_leanopt_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("LEANOPT_CACHE", str(tmp_path / "x"))
    assert process.cache_dir() == tmp_path / "x"
    monkeypatch.delenv("LEANOPT_CACHE")
    assert process.cache_dir() == Path.home() / ".cache" / "leanopt"


def test_small_config_keeps_the_architecture():
    config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                      num_attention_heads=32, num_key_value_heads=8, vocab_size=32000)  # fmt: skip
    small = probe.small_config(config)
    assert (small["hidden_size"], small["num_hidden_layers"], small["num_attention_heads"]) == (128, 2, 4)
    assert small["num_key_value_heads"] == 2 and small["vocab_size"] == 4000  # still grouped-query attention
    with torch.device("meta"):
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**small))


# ---- budgets -------------------------------------------------------------------------------------
def test_budget_is_compared_with_process_bytes(cache, pinned_row):
    row = pinned_row
    assert row.process_bytes == row.peak_bytes + sum(row.one_time.values()) > row.peak_bytes
    between = (row.peak_bytes + row.process_bytes) // 2
    (judged,) = plan(tiny_gpt2(), budget=between, **ROW)
    assert judged.fits is False and judged.compared == "process_bytes"
    (step_only,) = plan(tiny_gpt2(), budget=between, process=False, **ROW)
    assert step_only.fits is True and step_only.compared == "peak_bytes" and step_only.process_bytes is None
    d = judged.as_dict()
    assert d["peak_bytes"] == row.peak_bytes and d["process_bytes"] == row.process_bytes and d["compared"] == "process_bytes"


def test_cli_table_says_what_it_compared(cache, tmp_path, capsys, pinned_row):
    transformers.GPT2Config(**TINY_GPT2).to_json_file(tmp_path / "config.json")
    base = ["plan", str(tmp_path), "--batch", "2", "--seq", "16", "--optimizers", "adamw", "--precisions", "fp32",
            "--grad-release", "off", "--json"]  # fmt: skip
    assert cli.main([*base, "--budget", str(pinned_row.process_bytes)]) == 0  # the same model's first row: it just fits
    rows = json.loads(capsys.readouterr().out)
    assert all(r["process_bytes"] > r["peak_bytes"] for r in rows)
    assert rows[0]["process_bytes"] == pinned_row.process_bytes and rows[0]["fits"] and rows[0]["compared"] == "process_bytes"
    assert cli.main([*base[:-1], "--budget", str(pinned_row.process_bytes)]) == 0
    out = capsys.readouterr().out
    assert "process MB" in out and "step MB" in out and "budget compared with process MB" in out and "✔" in out
    assert cli.main([*base[:-1], "--budget", str(rows[0]["peak_bytes"] + 1), "--no-process"]) == 0
    assert "✔ (step)" in capsys.readouterr().out


# ---- gradient accumulation -----------------------------------------------------------------------
def _real_accum_peak(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, k: int) -> int:
    """The tensor peak of one K-micro-batch step, measured (profiler), over what lives at its start."""
    start = sum(p.untyped_storage().nbytes() for p in model.parameters())
    start += sum(t.untyped_storage().nbytes() for st in opt.state.values() for t in st.values() if torch.is_tensor(t))
    start += ids.untyped_storage().nbytes()
    meter = TensorPeak()
    assert meter.start()
    for _ in range(k):
        loss = model(input_ids=ids, labels=ids).loss / k
        loss.backward()
        del loss
    opt.step()
    opt.zero_grad(set_to_none=True)
    growth = meter.stop()
    assert growth is not None
    return start + growth


@pytest.mark.parametrize("optimizer", ["adamw", "adafactor"])
def test_accum_peak_matches_a_real_accumulated_step(optimizer):
    from leanopt.memory.estimate import resolve_optimizer

    kw = {"batch": 8, "seq": 32, "optimizers": [optimizer], "precisions": ["fp32"], "checkpointing": [False],
          "grad_release": [False], "process": False}  # fmt: skip
    (one,) = plan(tiny_gpt2(), **kw)
    (four,) = plan(tiny_gpt2(), accum=4, **kw)
    (two,) = plan(tiny_gpt2(), accum=2, **kw)
    assert four.accum == 4 and four.peak_bytes == two.peak_bytes >= one.peak_bytes  # micro-batch 2 on repeats
    torch.manual_seed(1)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**TINY_GPT2)).train()
    opt = resolve_optimizer(optimizer)(model.parameters())
    ids = torch.randint(0, 2000, (8, 32))
    for _ in range(2):  # the state exists
        _real_accum_peak(model, opt, ids, 4)
    real = _real_accum_peak(model, opt, ids, 4)
    assert abs(four.peak_bytes - real) <= 0.05 * real, (four.peak_bytes, real, one.peak_bytes)


def test_accum_errors_are_one_line():
    kw = {"batch": 2, "seq": 16, "optimizers": ["adamw"], "precisions": ["fp32"], "process": False}
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="accum"):
            plan(tiny_gpt2(), accum=bad, **kw)
    with pytest.raises(ValueError, match="gradient release"):
        plan(tiny_gpt2(), accum=2, grad_release=[True], **kw)
    rows = plan(tiny_gpt2(), accum=2, checkpointing=[False], **kw)  # both asked: release rows left out
    assert rows and not any(r.grad_release for r in rows)


# ---- CUDA: the margin model ------------------------------------------------------------------------
def test_cuda_segment_margin_from_block_sizes():
    assert process.cuda_segment_margin([]) == 0
    assert process.cuda_segment_margin([512]) == 2 * MiB - 512  # one 2 MiB small segment
    assert process.cuda_segment_margin([MiB, MiB]) == 0  # two 1 MiB blocks fill one small segment
    assert process.cuda_segment_margin([3 * MiB]) == 17 * MiB  # a 20 MiB segment
    assert process.cuda_segment_margin([11 * MiB]) == 1 * MiB  # rounded up to 2 MiB
    assert process.cuda_segment_margin([12 * MiB, 512]) == 2 * MiB - 512


def test_cublas_workspace(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert process.cublas_workspace_bytes((9, 0)) == 32 * MiB
    assert process.cublas_workspace_bytes((8, 0)) == 4096 * 1024 * 2 + 16 * 1024 * 8
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    assert process.cublas_workspace_bytes((9, 0)) == 16 * 1024 * 8


def test_cuda_rows_add_context_workspace_and_margin(monkeypatch, tmp_path):
    pytest.importorskip("triton")
    monkeypatch.setenv("LEANOPT_CACHE", str(tmp_path))
    (row,) = plan(tiny_gpt2(), batch=2, seq=16, optimizers=["adamw"], precisions=["fp32"], checkpointing=[False],
                  grad_release=[False], device="cuda")  # fmt: skip
    assert set(row.one_time) == {"cuda_context", "cublas_workspace", "allocator_margin"}
    assert row.process_bytes == row.peak_bytes + sum(row.one_time.values())
    assert "not measured here" in row.process_source and math.isfinite(row.process_bytes)
