"""leanopt.memory.plan: the traced peak of a training step, its rows, budget and recommendation."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
import transformers

from leanopt import cli
from leanopt.memory.estimate import estimate
from leanopt.memory.plan import (
    PLAN_PRECISIONS,
    PlanRow,
    _trace_step,
    parse_bytes,
    plan,
    recommend,
)
from leanopt.memory.plan_trace import KINDS

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20

TINY_GPT2 = {"vocab_size": 2000, "n_positions": 64, "n_embd": 64, "n_layer": 2, "n_head": 4}
TINY_DISTILBERT = {"vocab_size": 2000, "dim": 64, "n_layers": 2, "n_heads": 4, "hidden_dim": 256,
                   "max_position_embeddings": 64, "num_labels": 3}  # fmt: skip


def tiny_gpt2() -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(**TINY_GPT2))


def tiny_distilbert() -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.DistilBertForSequenceClassification(transformers.DistilBertConfig(**TINY_DISTILBERT))


@pytest.fixture(scope="module")
def gpt2_rows() -> list[PlanRow]:
    return plan(tiny_gpt2(), batch=4, seq=32, optimizers=["adamw", "adamw8bit", "adafactor"])


# ---- budgets ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, expected",
    [("24GiB", 24 * 2**30), ("24GB", 24 * 10**9), ("500MiB", 500 * 2**20), ("1000", 1000), ("1.5 gib", 3 * 2**29),
     (4096, 4096), ("7kb", 7000)],
)  # fmt: skip
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "24 parsecs", "-1GB", "0", "GiB", "1e9", 0, -5])
def test_parse_bytes_errors_are_one_line(text):
    with pytest.raises(ValueError) as err:
        parse_bytes(text)
    assert "\n" not in str(err.value)


# ---- rows -------------------------------------------------------------------------------------
def test_rows_cover_every_configuration_ranked_by_precision_kept(gpt2_rows):
    assert len(gpt2_rows) == 3 * len(PLAN_PRECISIONS) * 2
    order = [(r.precision, r.optimizer, r.checkpointing) for r in gpt2_rows]
    assert order == sorted(order, key=lambda k: (PLAN_PRECISIONS.index(k[0]), ["adamw", "adamw8bit", "adafactor"].index(k[1]), k[2]))
    assert gpt2_rows[0].precision == "fp32" and gpt2_rows[0].optimizer == "adamw" and not gpt2_rows[0].checkpointing
    for r in gpt2_rows:
        assert r.fits is None and r.grad_release is False and r.gpus == 1
        assert set(r.breakdown) == set(KINDS)
        assert sum(r.breakdown.values()) == r.peak_bytes


def test_json_keys(gpt2_rows):
    d = json.loads(json.dumps(gpt2_rows[0].as_dict()))
    assert set(d) == {"optimizer", "precision", "checkpointing", "grad_release", "gpus", "peak_bytes", "fits", "breakdown"}
    assert d["fits"] is None and isinstance(d["breakdown"], dict)


def test_terms_are_what_they_should_be(gpt2_rows):
    model = tiny_gpt2()
    n = sum(p.numel() for p in model.parameters())  # tied lm_head counted once
    rows = {(r.optimizer, r.precision, r.checkpointing): r for r in gpt2_rows}
    fp32 = rows["adamw", "fp32", False]
    assert fp32.breakdown["weights"] == 4 * n + 0  # no buffers in GPT-2's params
    assert fp32.breakdown["optimizer_state"] == estimate(model, "adamw").bytes
    assert rows["adamw8bit", "fp32", False].breakdown["optimizer_state"] == estimate(model, "adamw8bit").bytes
    # bf16-mixed keeps fp32 weights and adds autocast's bf16 copies of the matmul weights
    assert rows["adamw", "bf16-mixed", False].breakdown["weights"] > 4 * n


def test_the_quantized_update_counts_its_temporaries():
    from leanopt.memory.plan_trace import QUANTIZED_TEMP_BYTES

    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**TINY_GPT2))
    step = _trace_step(model, "adamw8bit", torch.float32)
    largest = max(p.numel() for p in model.parameters())
    start = sum(8 * p.numel() for p in model.parameters())  # fp32 weights + gradients
    assert step.peak.bytes >= start + step.kept["optimizer_state"] + QUANTIZED_TEMP_BYTES[8] * (largest // 256 * 256)


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit", "adamw4bit", "adafactor", "torch-adamw"])
def test_steady_state_holds_exactly_the_estimated_state(optimizer):
    model = tiny_distilbert()
    traced = _trace_step(model, optimizer, torch.float32)
    assert traced.kept["optimizer_state"] == estimate(model, optimizer).bytes
    assert traced.kept["gradients"] == 0  # zero_grad(set_to_none=True)


def test_checkpointing_lowers_the_activation_peak():
    model = transformers.GPT2Config(**{**TINY_GPT2, "n_layer": 4})
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(model)
    off, on = plan(model, batch=8, seq=64, optimizers=["adafactor"], precisions=["fp32"])
    assert not off.checkpointing and on.checkpointing
    assert on.peak_bytes < off.peak_bytes
    assert on.breakdown["activations"] < off.breakdown["activations"] / 2


def test_budget_and_recommendation(gpt2_rows):
    peaks = sorted({r.peak_bytes for r in gpt2_rows})
    budget = peaks[len(peaks) // 2]
    rows = plan(tiny_gpt2(), batch=4, seq=32, budget=budget, optimizers=["adamw", "adamw8bit", "adafactor"])
    assert [r.peak_bytes for r in rows] == [r.peak_bytes for r in gpt2_rows]  # deterministic
    assert all(r.fits == (r.peak_bytes <= budget) for r in rows)
    best = recommend(rows)
    assert best is not None and best.fits
    assert best is next(r for r in rows if r.fits)  # the most precise that fits
    assert recommend(plan(tiny_gpt2(), batch=4, seq=32, budget=1, optimizers=["adafactor"], precisions=["fp32"])) is None
    assert recommend(gpt2_rows) is None  # no budget


def test_the_module_is_given_back_unchanged():
    model = tiny_gpt2()
    before = {n: p for n, p in model.named_parameters()}
    model.eval()
    plan(model, batch=2, seq=16, optimizers=["adamw"], precisions=["fp32"])
    assert {n: p for n, p in model.named_parameters()} == before
    assert all(p.device.type == "meta" for p in model.parameters())
    assert not model.training and not model.is_gradient_checkpointing


def test_kernel_caches_stay_real():
    from torch._subclasses.fake_tensor import FakeTensor

    from leanopt import AdamW8bit
    from leanopt.kernels import cpu
    from leanopt.quant import codebooks

    plan(tiny_gpt2(), batch=2, seq=16, optimizers=["adamw8bit", "adafactor"], precisions=["fp32"], checkpointing=[False])
    cached = [*codebooks._CACHE.values(), *cpu._ENCODE_TABLES.values(), *cpu._workspaces.__dict__.get("pool", {}).values()]
    tensors = [t for c in cached for t in ([c] if isinstance(c, torch.Tensor) else vars(c).values() if hasattr(c, "__dict__")
               else c if isinstance(c, tuple) else []) if isinstance(t, torch.Tensor)]  # fmt: skip
    assert not any(isinstance(t, FakeTensor) for t in tensors)
    model = torch.nn.Linear(128, 64)  # 8192 elements: a quantized state
    opt = AdamW8bit(model.parameters(), backend="reference")
    model(torch.randn(4, 128)).square().sum().backward()
    opt.step()
    assert torch.isfinite(model.weight).all()


# ---- errors -----------------------------------------------------------------------------------
def _one_line_error(fn, match: str) -> None:
    with pytest.raises(ValueError, match=match) as err:
        fn()
    assert "\n" not in str(err.value)


def test_errors_are_one_line(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "no-such-architecture", "hidden_size": 8}))
    _one_line_error(lambda: plan(str(config), batch=1, seq=8), "not a transformers config|cannot build")
    _one_line_error(lambda: plan("7b", batch=1, seq=8), "bare parameter count")
    _one_line_error(lambda: plan(torch.nn.Linear(4, 4), batch=1, seq=8), "no head with a loss")
    _one_line_error(lambda: plan(tiny_gpt2(), batch=0, seq=8), "batch")
    _one_line_error(lambda: plan(tiny_gpt2(), batch=1, seq=8, gpus=65), "FSDP2 over 65 ranks.*64 rows")
    _one_line_error(lambda: plan(tiny_gpt2(), batch=1, seq=8, gpus=0), "gpus")
    _one_line_error(lambda: plan(tiny_gpt2(), batch=1, seq=8, device="cuda"), "CPU")
    _one_line_error(lambda: plan(tiny_gpt2(), batch=1, seq=8, optimizers=["sgd9000"]), "unknown optimizer")
    _one_line_error(lambda: plan(tiny_gpt2(), batch=1, seq=8, precisions=["fp8"]), "unknown precision")
    _one_line_error(lambda: plan(tiny_gpt2(), batch=1, seq=8, precisions=["bf16"]), "pure bf16 is not planned")
    _one_line_error(lambda: plan(tiny_gpt2(), batch=1, seq=8, budget="lots"), "budget")
    # longer than the model's positions: an input it cannot take
    _one_line_error(lambda: plan(tiny_distilbert(), batch=1, seq=128), "cannot trace.*positions")
    _one_line_error(lambda: plan(tiny_gpt2(), batch=1, seq=65), "cannot trace.*positions")


def test_a_forward_that_fails_is_one_line_naming_what_failed():
    model = tiny_gpt2()
    model.transformer.h[0].attn.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom\nsecond line"))
    _one_line_error(lambda: plan(model, batch=1, seq=8, optimizers=["adamw"], precisions=["fp32"]),
                    "cannot trace a training step of GPT2LMHeadModel.*RuntimeError: boom")


# ---- FSDP2 over several ranks ---------------------------------------------------------------
def test_fsdp_rows_shard_weights_gradients_and_state():
    one = {(r.optimizer, r.checkpointing): r for r in plan(tiny_gpt2(), batch=4, seq=32, precisions=["fp32"], optimizers=["adamw", "adafactor"])}
    two = plan(tiny_gpt2(), batch=4, seq=32, gpus=2, precisions=["fp32"], optimizers=["adamw", "adafactor"])
    assert len(two) == len(one) == 4
    for r in two:
        ref = one[r.optimizer, r.checkpointing]
        assert r.gpus == 2 and sum(r.breakdown.values()) == r.peak_bytes
        # every tensor is cut in two on dim 0 (64- and 2000-row tensors: no padding)
        assert r.breakdown["weights"] == ref.breakdown["weights"] // 2
        if r.optimizer == "adamw":  # moments cut in two; the step counts (scalars) are on every rank
            assert 0 <= r.breakdown["optimizer_state"] - ref.breakdown["optimizer_state"] // 2 <= 0.001 * ref.breakdown["optimizer_state"]
    assert torch.distributed.is_available() and not torch.distributed.is_initialized()  # the fake group is gone


def test_fsdp_leaves_the_model_unchanged():
    model = tiny_gpt2()
    before = {n: (type(p), p.device, tuple(p.shape)) for n, p in model.named_parameters()}
    plan(model, batch=2, seq=16, gpus=2, precisions=["fp32"], optimizers=["adamw"], checkpointing=[False])
    assert {n: (type(p), p.device, tuple(p.shape)) for n, p in model.named_parameters()} == before
    assert type(model) is transformers.GPT2LMHeadModel
    assert model.lm_head.weight is model.transformer.wte.weight


# ---- command line -----------------------------------------------------------------------------
def _run_cli(argv: list[str], capsys) -> str:
    assert cli.main(argv) == 0
    return capsys.readouterr().out


def test_cli_table_and_json(tmp_path, capsys):
    transformers.GPT2Config(**TINY_GPT2).to_json_file(tmp_path / "config.json")
    base = ["plan", str(tmp_path), "--batch", "2", "--seq", "16", "--optimizers", "adamw,adafactor", "--precisions", "fp32,bf16-mixed"]
    rows = json.loads(_run_cli([*base, "--json"], capsys))
    assert len(rows) == 8 and all(r["fits"] is None for r in rows)
    budget = sorted(r["peak_bytes"] for r in rows)[3]
    out = _run_cli([*base, "--budget", str(budget)], capsys)
    assert "✔" in out and "✘" in out and "recommended:" in out
    best = next(r for r in json.loads(_run_cli([*base, "--budget", str(budget), "--json"], capsys)) if r["fits"])
    assert f"recommended: {best['optimizer']}, {best['precision']}" in out
    assert cli.main([*base, "--budget", "24 parsecs"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "budget" in err[0]


# ---- against a real step ----------------------------------------------------------------------
def _bench():
    spec = importlib.util.spec_from_file_location("plan_vs_measured", ROOT / "benchmarks" / "plan_vs_measured.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Small models: fixed costs (allocator pages, thread stacks) weigh more than on the full-size
# models of docs/plan.md (within 2 % there); measured here within 0.2 %.
SMALL_TOLERANCE = 0.05


def _check_against_real_steps(case: str, configs: list[tuple[str, str, bool]]) -> None:
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to read the resident high-water mark")
    bench = _bench()
    measured = bench.measure(case, configs)
    for (optimizer, precision, ckpt), real in zip(configs, measured):
        predicted = bench.predict(case, optimizer, precision, ckpt)
        assert abs(predicted - real) <= SMALL_TOLERANCE * real, (case, optimizer, precision, ckpt, predicted, real)


# Compiling nothing: a few seconds each.
@pytest.mark.parametrize("case", ["tiny-distilbert", "tiny-gpt2"])
def test_prediction_matches_a_real_step(case):
    _check_against_real_steps(case, [("adamw", "fp32", False), ("adafactor", "fp32", False), ("adamw", "fp32", True)])


# The quantized updates compile on the CPU first (tens of seconds on 2 cores).
@pytest.mark.slow
@pytest.mark.parametrize("case", ["tiny-distilbert", "tiny-gpt2"])
def test_prediction_matches_a_real_step_quantized(case):
    _check_against_real_steps(case, [("adamw8bit", "bf16-mixed", False), ("adamw4bit", "bf16-mixed", True)])


# FSDP2 over 2 gloo ranks (torchrun), each rank's peak against rank 0's plan. One launch per model
# (three processes importing torch on 2 cores, a warm-up per configuration): ~25 s each here.
# Measured within 0.3 % (AdamW, Adafactor) here; held to 5 % as the one-process check is.
@pytest.mark.slow
@pytest.mark.parametrize("case", ["tiny-distilbert", "tiny-gpt2"])
def test_fsdp_prediction_matches_real_steps_on_each_rank(case):
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to read the resident high-water mark")
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available in this build")
    bench = _bench()
    configs = [("adamw", "fp32", False), ("adafactor", "fp32", False)]
    measured = bench.measure_dist(case, configs, 2, timeout=600)
    for (optimizer, precision, ckpt), per_rank in zip(configs, measured):
        predicted = bench.predict(case, optimizer, precision, ckpt, gpus=2)
        assert len(per_rank) == 2
        for rank, real in enumerate(per_rank):
            assert abs(predicted - real) <= SMALL_TOLERANCE * real, (case, rank, optimizer, predicted, real)


@pytest.mark.slow
def test_a_7b_model_plans_within_a_minute():
    import resource

    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                      num_attention_heads=32, max_position_embeddings=4096)  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    rows = plan(model, batch=1, seq=2048, budget="80GiB")
    assert time.perf_counter() - t0 <= 60
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 1024**2  # KiB: under 1 GiB grown
    assert rows[0].peak_bytes > 16 * 6.7e9  # weights + gradients + AdamW state, fp32
