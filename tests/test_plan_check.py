"""plan(..., device="cuda") and its GPU check, leanopt.memory.plan_check.

No GPU here: the CUDA modelling is checked on the CPU against hand-computed values (allocator
blocks, what fused attention saves, CUDA autocast's fp32 ops, the in-place Triton update), and
the check's dry run (the same pipeline on the CPU at tiny sizes) is run.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
import transformers
from torch._subclasses import FakeTensorMode

from leanopt.memory import plan_check
from leanopt.memory.cuda_emulation import cuda_block_bytes, cuda_forward, sdpa_cuda_kernel
from leanopt.memory.plan import plan
from leanopt.memory.plan_step import trace_step
from leanopt.memory.plan_trace import LiveStorage

ROOT = Path(__file__).resolve().parents[1]
TINY_GPT2 = {"vocab_size": 2000, "n_positions": 64, "n_embd": 64, "n_layer": 2, "n_head": 4}


def tiny_gpt2() -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(**TINY_GPT2))


# ---- the CUDA modelling, on the CPU -----------------------------------------------------------
@pytest.mark.parametrize("nbytes, counted", [(0, 0), (1, 512), (511, 512), (512, 512), (513, 1024), (4000, 4096), (2**20, 2**20)])
def test_allocator_blocks_are_rounded_to_512(nbytes, counted):
    assert cuda_block_bytes(nbytes) == counted


def _qkv(dtype, heads=4, seq=100, dim=64):
    return [torch.empty(2, heads, seq, dim, dtype=dtype) for _ in range(3)]


def test_the_kernel_torch_picks_on_a_gpu():
    bf16, fp32 = _qkv(torch.bfloat16), _qkv(torch.float32)
    assert sdpa_cuda_kernel(*bf16) == "flash"
    assert sdpa_cuda_kernel(*fp32) == "efficient"  # flash takes 16-bit only
    assert sdpa_cuda_kernel(*bf16, attn_mask=torch.empty(2, 1, 100, 100)) == "efficient"  # flash takes no mask
    assert sdpa_cuda_kernel(*_qkv(torch.bfloat16, dim=512)) == "efficient"  # flash: head dim <= 256
    assert sdpa_cuda_kernel(*_qkv(torch.float32, dim=66)) == "math"  # not 16-byte aligned
    q, _, _ = bf16
    kv = torch.empty(2, 2, 100, 64, dtype=torch.bfloat16)
    assert sdpa_cuda_kernel(q, kv, kv, enable_gqa=True) == "flash"
    assert sdpa_cuda_kernel(q, kv, kv) == "math"


def _saved_by_attention(dtype, device: str) -> int:
    """Bytes live after one attention forward (dropout, causal), over its inputs."""
    tracker = LiveStorage(device)
    with FakeTensorMode(), tracker, (cuda_forward(tracker) if device == "cuda" else contextlib.nullcontext()):
        q, k, v = (torch.empty(2, 4, 100, 64, dtype=dtype, requires_grad=True) for _ in range(3))
        for t in (q, k, v):
            tracker.track(t)
        before = tracker.current
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        saved = tracker.current - before
        del out
    return saved


def test_fused_attention_saves_no_seq_by_seq_matrix():
    # [2, 4, 100, 64] q/k/v. Memory-efficient (fp32): the output, and a logsumexp of
    # [2, 4, 128] fp32 (seq padded to 32); its philox seed and offset are host tensors.
    out32 = 2 * 4 * 100 * 64 * 4
    assert _saved_by_attention(torch.float32, "cuda") == cuda_block_bytes(out32) + cuda_block_bytes(2 * 4 * 128 * 4) == 208_896
    # Flash (bf16): the output, a logsumexp of [2, 4, 100] fp32, and its rng state ([2] and [] uint64).
    out16 = 2 * 4 * 100 * 64 * 2
    expected = cuda_block_bytes(out16) + cuda_block_bytes(2 * 4 * 100 * 4) + cuda_block_bytes(16) + cuda_block_bytes(8)
    assert _saved_by_attention(torch.bfloat16, "cuda") == expected == 102_400 + 3_584 + 1_024
    # The CPU step (math path with dropout) keeps seq x seq matrices: 2 x 4 x 100 x 100 each.
    assert _saved_by_attention(torch.float32, "cpu") > 2 * 4 * 100 * 100 * 4


def test_cuda_autocast_runs_pow_and_softmax_in_fp32():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.pow(x, 3.0).dtype == torch.bfloat16  # CPU autocast leaves it in bf16
        with cuda_forward(None):
            assert torch.pow(x, 3.0).dtype == torch.float32
            assert (x**3).dtype == torch.float32
            assert x.softmax(-1).dtype == torch.float32
            assert torch.nn.functional.layer_norm(x, (8,)).dtype == torch.float32
            assert torch.tanh(x).dtype == torch.bfloat16  # not in CUDA's fp32 list
    with cuda_forward(None):
        assert torch.pow(x, 3.0).dtype == torch.bfloat16  # autocast off: nothing changes
    assert "pow" not in vars(torch.Tensor)  # the patches are gone
    assert torch.pow(x, 3.0).dtype == torch.bfloat16


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit", "adafactor"])
def test_the_triton_update_allocates_nothing_of_the_params_size(optimizer):
    model = tiny_gpt2()
    cpu = trace_step(model, optimizer, torch.float32)
    cuda = trace_step(model, optimizer, torch.float32, device="cuda")
    weights = cuda.peak.breakdown["weights"]
    assert cuda.peak.breakdown["gradients"] == weights  # fp32 gradients, 512-byte blocks as the weights
    # Only small tables and Adafactor's scratch of row/column partial sums: not a param-sized temporary.
    assert cuda.peak.breakdown["other"] < 0.15 * weights, cuda.peak.breakdown
    if optimizer == "adamw8bit":  # the CPU's compiled quantized update holds 8 B per element of the param
        largest = max(p.numel() for p in model.parameters())
        assert cpu.peak.breakdown["other"] > 8 * largest > cuda.peak.breakdown["other"]


ROWS = {"batch": 4, "seq": 32, "optimizers": ["adamw", "adamw8bit", "adafactor"], "grad_release": [False]}


@pytest.fixture(scope="module")
def device_rows():
    """The same rows planned for the CPU and for one GPU (the CPU's without process_bytes: the
    one-time costs are not what is compared here)."""
    return {device: plan(tiny_gpt2(), device=device, process=device == "cuda", **ROWS) for device in ("cpu", "cuda")}


def test_cuda_rows_and_their_differences_from_the_cpu(device_rows):
    cpu = {(r.optimizer, r.precision, r.rounding, r.checkpointing): r for r in device_rows["cpu"]}
    cuda = device_rows["cuda"]
    assert len(cuda) == len(cpu)
    for r in cuda:
        assert sum(r.breakdown.values()) == r.peak_bytes > 0
        ref = cpu[r.optimizer, r.precision, r.rounding, r.checkpointing]
        assert r.breakdown["weights"] >= ref.breakdown["weights"]  # 512-byte blocks
        if not r.checkpointing and r.precision == "fp32":
            # no seq x seq attention matrices saved on the GPU
            assert r.breakdown["activations"] < ref.breakdown["activations"]
    # a device given as torch.device("cuda", 1) plans the same GPU step (its first row)
    (first,) = plan(tiny_gpt2(), device=torch.device("cuda", 1), **{**ROWS, "optimizers": ["adamw"], "precisions": ["fp32"],
                                                                    "checkpointing": [False]})  # fmt: skip
    assert (first.optimizer, first.precision, first.checkpointing) == (cuda[0].optimizer, cuda[0].precision, cuda[0].checkpointing)
    assert first.peak_bytes == cuda[0].peak_bytes


def test_cli_plans_the_gpu_with_device_cuda(tmp_path, capsys, device_rows):
    from leanopt import cli

    transformers.GPT2Config(**TINY_GPT2).to_json_file(tmp_path / "config.json")
    base = ["plan", str(tmp_path), "--batch", "4", "--seq", "32", "--optimizers", "adamw,adamw8bit", "--precisions", "fp32",
            "--grad-release", "off", "--no-process", "--json"]  # fmt: skip
    rows = {}
    for device in ("cpu", "cuda"):
        assert cli.main([*base, "--device", device]) == 0
        rows[device] = json.loads(capsys.readouterr().out)
        python = [r for r in device_rows[device] if r.optimizer in ("adamw", "adamw8bit") and r.precision == "fp32"]
        assert [r["peak_bytes"] for r in rows[device]] == [r.peak_bytes for r in python]
    # the flag reaches the planner: fp32 without checkpointing saves no attention matrices on the GPU
    assert rows["cuda"][0]["breakdown"]["activations"] < rows["cpu"][0]["breakdown"]["activations"]
    assert cli.main([*base[:-1], "--device", "cuda"]) == 0
    assert "torch.cuda.max_memory_allocated" in capsys.readouterr().out
    assert cli.main([*base, "--device", "tpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device" in err[0]


# ---- the check itself -------------------------------------------------------------------------
def test_the_check_pipeline_table_and_json(tmp_path, monkeypatch, capsys):
    """The dry run's pipeline in this process, the CPU measurement stood in for (1 % above the
    plan): plans, rows, table, JSON and exit status (the real measurement: the slow test), on both
    small models (the dry run of scripts/gpu_check.sh measures the first only)."""
    monkeypatch.setattr(plan_check, "DRY_CASES", plan_check.SMALL_CASES)
    bench = plan_check.benchmark()
    # The three runs below plan the same steps as this: each plan is made once.
    monkeypatch.setattr(plan_check, "predict", functools.cache(plan_check.predict))
    # Planned here, before: the stand-in runs in the check's measuring threads, beside its plans.
    planned = {(case, c): plan_check.predict(bench, case, *c, device="cpu") for case in plan_check.DRY_CASES for c in plan_check.CONFIGS}
    monkeypatch.setattr(bench, "measure", lambda case, configs: [int(planned[case, c] * 1.01) for c in configs])
    monkeypatch.setattr(plan_check, "benchmark", lambda: bench)
    assert plan_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    _check_output(out, tmp_path, expect_error=-0.99)
    doctor = json.loads((tmp_path / "plan_check.json").read_text())["doctor"]
    assert doctor["ok"] and doctor["device"] == "cpu"
    monkeypatch.setattr(plan_check, "doctor_check", lambda *args: doctor)  # the first run's real one, for the two below
    # Outside the tolerance: exit 1, the row marked
    monkeypatch.setattr(bench, "measure", lambda case, configs: [int(planned[case, c] * 1.2) for c in configs])
    assert plan_check.main(["--dry-run", "--out", str(tmp_path)]) == 1
    assert "✘" in capsys.readouterr().out
    # A failing measurement: one line naming it, on the rows
    monkeypatch.setattr(bench, "measure", lambda case, configs: (_ for _ in ()).throw(RuntimeError("worker died\nmore")))
    assert plan_check.main(["--dry-run", "--out", str(tmp_path)]) == 1
    rows = json.loads((tmp_path / "plan_check.json").read_text())["rows"]
    assert all(r["error"] == "the CPU measurement: RuntimeError: worker died" for r in rows)


def test_no_gpu_without_dry_run_is_one_line(capsys, monkeypatch):
    monkeypatch.delenv("GPU_CHECK_DRY_RUN", raising=False)
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert plan_check.main([]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA device" in err[0]


def _check_output(out: str, folder: Path, expect_error: float | None = None) -> None:
    lines = out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["ok"] is True and summary["dry_run"] is True
    assert "DRY RUN" in out
    table = [line for line in lines if line.startswith("| tiny-")]
    rows = len(plan_check.DRY_CASES) * len(plan_check.DRY_CONFIGS)
    assert len(table) == rows
    result = json.loads((folder / "plan_check.json").read_text())
    assert result["ok"] is True and result["dry_run"] is True and len(result["rows"]) == rows
    seen = set()
    for r in result["rows"]:
        seen.add((r["case"], r["optimizer"], r["precision"], r["checkpointing"]))
        assert r["ok"] and r["error"] is None and math.isfinite(r["error_pct"]) and abs(r["error_pct"]) <= 5
        assert r["predicted_bytes"] > 0 and r["measured_bytes"] > 0 and r["cuda_plan_bytes"] > 0
        if expect_error is not None:
            assert r["error_pct"] == pytest.approx(expect_error, abs=0.01)
    assert seen == {(c, *config) for c in plan_check.DRY_CASES for config in plan_check.DRY_CONFIGS}


# The dry run itself, through gpu_check.sh: tests/test_gpu_check.py::test_dry_run_plan_check.


def test_the_gpu_rows_without_a_gpu(tmp_path, monkeypatch, capsys):
    """The GPU branch's rows, table and JSON, its measurement stood in for (the real one needs CUDA)."""
    monkeypatch.delenv("GPU_CHECK_DRY_RUN", raising=False)
    monkeypatch.setattr(plan_check, "GPU_CASES", ("tiny-gpt2",))
    monkeypatch.setattr(plan_check, "gpu", lambda: "stand-in")
    real = {}

    def measured(bench, case, optimizer, precision, ckpt):
        if optimizer == "adafactor":
            raise RuntimeError("Triton CompilationError: boom\nline 2")
        real[optimizer, precision, ckpt] = int(plan_check.predict(bench, case, optimizer, precision, ckpt, device="cuda") * 0.98)
        return real[optimizer, precision, ckpt]

    def measured_process(case, config):  # a fresh GPU process: its reserved peak and context
        want = plan_check.predict_process(plan_check.benchmark(), case, *config)
        return {"reserved_peak": int(want * 0.98) - 300 * 2**20, "context": 300 * 2**20, "allocated_peak": 0}

    monkeypatch.setattr(plan_check, "measure_cuda", measured)
    monkeypatch.setattr(plan_check, "measure_process", measured_process)
    monkeypatch.setattr(plan_check, "doctor_check", lambda bench, case, config, device: {"ok": True, "sum_error_pct": 0.0})
    monkeypatch.setenv("LEANOPT_CACHE", str(tmp_path / "cache"))
    assert plan_check.main(["--out", str(tmp_path)]) == 1  # the adafactor row failed
    out = capsys.readouterr().out
    assert "GPU: plan(device='cuda')" in out and "DRY RUN" not in out
    result = json.loads((tmp_path / "plan_check.json").read_text())
    assert result["dry_run"] is False and result["device"] == "stand-in" and len(result["rows"]) == 4
    for r in result["rows"]:
        if r["optimizer"] == "adafactor":
            assert not r["ok"] and r["error"] == "the measured GPU step: RuntimeError: Triton CompilationError: boom"
        else:
            assert r["ok"] and r["error_pct"] == pytest.approx(100 * (1 / 0.98 - 1), abs=0.01), r
    first = result["rows"][0]  # the process: process_bytes against reserved + context
    assert first["process_error_pct"] == pytest.approx(100 * (1 / 0.98 - 1), abs=0.01) and first["context_bytes"] == 300 * 2**20
    assert result["doctor"]["ok"] is True
