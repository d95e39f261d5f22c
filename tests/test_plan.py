"""leanopt.memory.plan: the traced peak of a training step, its rows, budget and recommendation."""

from __future__ import annotations

import importlib.util
import json
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
    parse_bytes,
    plan,
    recommend,
)
from leanopt.memory.plan_step import trace_step
from leanopt.memory.plan_trace import KINDS
from leanopt.optim import rounding as rounding_module

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


@pytest.fixture(autouse=True)
def _no_process_probe(monkeypatch):
    """These tests are about the step's peak: no one-time-cost probe (a subprocess each) runs, and
    process_bytes is None, so budgets are compared with peak_bytes. tests/test_plan_process.py
    runs the probe and checks process_bytes."""
    from leanopt.memory import process

    unmeasured, costs = process.OneTimeCost(None, "not measured in tests/test_plan.py"), process.OneTimeCosts
    monkeypatch.setattr(process, "OneTimeCosts", lambda module, settings, **k: costs.of(dict.fromkeys(settings, unmeasured)))


@pytest.fixture(scope="module")
def gpt2_rows() -> list[PlanRow]:
    return plan(tiny_gpt2(), batch=4, seq=32, optimizers=["adamw", "adamw8bit", "adafactor"], process=False)


OPTIMIZER_ORDER = ["adamw", "adamw8bit", "adafactor"]


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
    # fp32, bf16-mixed, bf16 x (kahan, stochastic): 4 modes x 3 optimizers x release x checkpointing
    assert PLAN_PRECISIONS == ("fp32", "bf16-mixed", "bf16")
    assert len(gpt2_rows) == 4 * 3 * 2 * 2
    order = [(r.precision, r.rounding, r.optimizer, r.grad_release, r.checkpointing) for r in gpt2_rows]
    rounding_rank = {None: -1, "kahan": 0, "stochastic": 1}
    assert order == sorted(order, key=lambda k: (PLAN_PRECISIONS.index(k[0]), rounding_rank[k[1]], OPTIMIZER_ORDER.index(k[2]), k[3], k[4]))
    assert len(set(order)) == len(order)
    first = gpt2_rows[0]
    assert (first.precision, first.optimizer, first.checkpointing, first.grad_release) == ("fp32", "adamw", False, False)
    for r in gpt2_rows:
        assert r.fits is None and r.gpus == 1
        assert (r.rounding is None) == (r.precision != "bf16")
        assert set(r.breakdown) == set(KINDS)
        assert sum(r.breakdown.values()) == r.peak_bytes


def test_json_keys(gpt2_rows):
    d = json.loads(json.dumps(gpt2_rows[0].as_dict()))
    assert set(d) == {"optimizer", "precision", "rounding", "checkpointing", "grad_release", "gpus", "accum", "peak_bytes",
                      "process_bytes", "process_bytes_pinned", "fits", "compared", "breakdown", "one_time", "process_source", "offload",
                      "host_bytes", "peak_in", "floor_bytes"}  # fmt: skip
    assert d["fits"] is None and isinstance(d["breakdown"], dict) and d["rounding"] is None
    assert d["process_bytes"] is None and d["compared"] is None and d["accum"] == 1
    assert d["offload"] is False and d["host_bytes"] is None


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


def test_pure_bf16_terms(gpt2_rows):
    model = tiny_gpt2()
    n = sum(p.numel() for p in model.parameters())
    with torch.device("meta"):
        bf16 = [torch.empty(tuple(p.shape), dtype=torch.bfloat16) for p in model.parameters()]
    rows = {(r.optimizer, r.rounding): r for r in gpt2_rows if r.precision == "bf16" and not r.checkpointing and not r.grad_release}
    for (optimizer, rounding), r in rows.items():
        assert r.breakdown["weights"] == 2 * n  # bf16 weights, no master copy
        # the state of bf16 params with that rounding: Kahan adds a bf16 compensation per element
        assert r.breakdown["optimizer_state"] == estimate(bf16, optimizer, rounding=rounding).bytes
    assert rows["adamw", "kahan"].breakdown["optimizer_state"] == rows["adamw", "stochastic"].breakdown["optimizer_state"] + 2 * n


def test_roundings_and_optimizers_without_them():
    rows = plan(tiny_gpt2(), batch=2, seq=16, optimizers=["adamw", "torch-adamw"], precisions=["bf16"],
                roundings=["nearest", "kahan"], checkpointing=[False])  # fmt: skip
    got = [(r.optimizer, r.rounding, r.grad_release) for r in rows]
    # torch's AdamW has no rounding= (nearest only) and no gradient release
    assert got == [("adamw", "kahan", False), ("adamw", "kahan", True), ("adamw", "nearest", False),
                   ("adamw", "nearest", True), ("torch-adamw", "nearest", False)]  # fmt: skip
    _one_line_error(lambda: plan(tiny_gpt2(), batch=1, seq=8, optimizers=["torch-adamw"], precisions=["bf16"]), "no configuration")


def test_the_stochastic_step_counts_its_fp32_copies():
    """Pure bf16 with stochastic rounding steps each param, in chunks of at most ROUNDING_CHUNK
    elements, through fp32 copies of the chunk and its gradient and the rounding's own temporaries
    (its dither's int64 positions among them): 60 B per element of the chunk being stepped,
    measured on real steps (docs/plan.md); Kahan's 10. Here every param is one chunk."""
    model = tiny_gpt2()
    largest = max(p.numel() for p in model.parameters())
    assert largest <= rounding_module.ROUNDING_CHUNK
    start = sum(4 * p.numel() for p in model.parameters())  # bf16 weights + bf16 gradients
    for mode, per_element in (("stochastic", 60), ("kahan", 10)):
        step = trace_step(model, "adamw", torch.bfloat16, rounding=mode)
        assert step.peak.bytes - start - step.kept["optimizer_state"] == per_element * largest


# ---- shortcuts of the step trace, held to the plain trace ---------------------------------------
@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit", "adafactor"])
@pytest.mark.parametrize("dtype, rounding", [(torch.float32, None), (torch.bfloat16, "nearest"), (torch.bfloat16, "kahan"),
                                             (torch.bfloat16, "stochastic")])  # fmt: skip
def test_the_fast_step_trace_equals_two_traced_steps(optimizer, dtype, rounding):
    """plan() makes the state from the layout instead of tracing a first step, and puts a rounded
    step together from one param of each shape; the plain trace runs two whole steps."""
    model = tiny_distilbert()
    fast = trace_step(model, optimizer, dtype, rounding=rounding)
    plain = trace_step(model, optimizer, dtype, rounding=rounding, fast=False)
    assert (fast.peak.bytes, fast.peak.breakdown, fast.kept) == (plain.peak.bytes, plain.peak.breakdown, plain.kept)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adafactor_traced_on_its_first_and_last_row_blocks_equals_the_full_walk(monkeypatch, dtype):
    from leanopt.kernels import cpu_adafactor
    from leanopt.memory import plan_trace

    # 2000 x 64 embeddings: 33 blocks of 62 rows (the last of 16); 256 x 64 layers: 5 blocks
    monkeypatch.setattr(cpu_adafactor, "ADAFACTOR_BLOCK", 4000)
    model = tiny_distilbert()
    trimmed = trace_step(model, "adafactor", dtype)
    monkeypatch.setattr(plan_trace, "TRIM_REPEATED_BLOCKS", False)
    full = trace_step(model, "adafactor", dtype)
    assert (trimmed.peak.bytes, trimmed.peak.breakdown, trimmed.kept) == (full.peak.bytes, full.peak.breakdown, full.kept)


@pytest.mark.parametrize("optimizer", ["adamw", "adafactor"])
@pytest.mark.parametrize("rounding", ["kahan", "stochastic"])
def test_a_rounded_step_traced_on_its_first_and_last_chunks_equals_the_full_walk(monkeypatch, optimizer, rounding):
    from leanopt.memory import plan_trace

    # Chunks of 3000 elements: the 2000 x 64 embedding in 43 (the last of 2000), a 256 x 64 layer
    # in 6 (the last of 1384). AdamW steps each chunk through its fp32 copies; Adafactor steps a
    # param whole and writes it back in those pieces. A last chunk smaller than the others: a
    # chunk's copies are still held while the next makes its own, so a middle chunk peaks higher
    # than the first and the last; a walk of the first and last only was 8,000 and 12,000 bytes low
    # here (with chunks of 1000 the embedding's are all alike, which hid it): the second is walked.
    monkeypatch.setattr(rounding_module, "ROUNDING_CHUNK", 3000)
    model = tiny_distilbert()
    trimmed = trace_step(model, optimizer, torch.bfloat16, rounding=rounding)
    monkeypatch.setattr(plan_trace, "TRIM_REPEATED_BLOCKS", False)
    full = trace_step(model, optimizer, torch.bfloat16, rounding=rounding)
    assert (trimmed.peak.bytes, trimmed.peak.breakdown, trimmed.kept) == (full.peak.bytes, full.peak.breakdown, full.kept)


# ---- gradient release ---------------------------------------------------------------------------
def _released_direct(model, optimizer, precision, rounding, ckpt, batch, seq) -> int:
    """The released step traced as it runs: ``leanopt.release_gradients`` on the fake params, the
    optimizer stepping inside backward (its state made by a first, plain step)."""
    import leanopt
    from leanopt.memory import plan_model as P
    from leanopt.memory.plan_trace import (
        LiveStorage,
        built_over,
        state_tensors,
        traced_batch,
        traced_forward_backward,
        traced_kernels,
        track_module,
    )

    fake_mode, tracker = P.fake_mode(), LiveStorage()
    options = [o for _, _, o in P.param_keys(model, optimizer, P.PARAM_DTYPE[precision])]  # Muon: its groups of the model
    model, params = P.fake_copy(model, fake_mode, P.PARAM_DTYPE[precision])
    with P.checkpointing(model, ckpt):
        model.train()
        with traced_kernels(), fake_mode, tracker:
            track_module(tracker, model)
            opt = P.optimizer_factory(optimizer, rounding)(built_over(params, options))
            for p in params:
                p.grad = torch.empty_like(p)
            opt.step()
            opt.zero_grad(set_to_none=True)
            for st in opt.state.values():
                for t in state_tensors(st):
                    tracker.track(t, "optimizer_state")
            input_ids, labels = traced_batch(tracker, P.task_of(model), P.vocab_size(model), P.num_labels(model), batch, seq)
            tracker.reset_peak()
            with leanopt.release_gradients(params, opt):
                loss = traced_forward_backward(tracker, model, input_ids, labels, params, precision == "bf16-mixed", "model")
                opt.step()
                opt.zero_grad(set_to_none=True)
            del loss
            peak = tracker.peak().bytes
    model.eval()
    return peak


@pytest.mark.parametrize(
    "optimizer, precision, rounding, ckpt",
    [("adamw", "fp32", None, True), ("adamw8bit", "bf16-mixed", None, True), ("adafactor", "fp32", None, False),
     ("adamw", "bf16", "kahan", True), ("adamw", "bf16", "stochastic", True)],
)  # fmt: skip
def test_released_rows_equal_a_trace_of_the_released_step(optimizer, precision, rounding, ckpt):
    """plan() composes the released step from one forward/backward trace and per-shape steps;
    a trace of the step as it runs, the optimizer inside backward, gives the same peak."""
    model = tiny_distilbert()
    usual, released = plan(model, batch=4, seq=32, optimizers=[optimizer], precisions=[precision], checkpointing=[ckpt],
                           roundings=[rounding] if rounding else None, grad_release=[False, True])  # fmt: skip
    assert released.grad_release and not usual.grad_release
    assert released.peak_bytes == _released_direct(model, optimizer, precision, rounding, ckpt, 4, 32)
    assert sum(released.breakdown.values()) == released.peak_bytes
    # This model peaks in backward (or in the step): release takes the gradients off the peak but
    # the one of the param being stepped.
    assert released.peak_bytes < usual.peak_bytes
    largest = max(p.numel() for p in model.parameters()) * (2 if precision == "bf16" else 4)
    assert released.breakdown["gradients"] <= largest


def test_the_quantized_update_counts_its_temporaries():
    from leanopt.memory.plan_trace import QUANTIZED_TEMP_BYTES

    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**TINY_GPT2))
    step = trace_step(model, "adamw8bit", torch.float32)
    largest = max(p.numel() for p in model.parameters())
    start = sum(8 * p.numel() for p in model.parameters())  # fp32 weights + gradients
    assert step.peak.bytes >= start + step.kept["optimizer_state"] + QUANTIZED_TEMP_BYTES[8] * (largest // 256 * 256)


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit", "adamw4bit", "adafactor", "torch-adamw"])
def test_steady_state_holds_exactly_the_estimated_state(optimizer):
    model = tiny_distilbert()
    traced = trace_step(model, optimizer, torch.float32)
    assert traced.kept["optimizer_state"] == estimate(model, optimizer).bytes
    assert traced.kept["gradients"] == 0  # zero_grad(set_to_none=True)


def test_checkpointing_lowers_the_activation_peak():
    model = transformers.GPT2Config(**{**TINY_GPT2, "n_layer": 4})
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(model)
    off, on = plan(model, batch=8, seq=64, optimizers=["adafactor"], precisions=["fp32"], grad_release=[False])
    assert not off.checkpointing and on.checkpointing
    assert on.peak_bytes < off.peak_bytes
    assert on.breakdown["activations"] < off.breakdown["activations"] / 2


def test_budget_and_recommendation(gpt2_rows):
    # The fixture's fp32 and pure-bf16 Kahan rows planned again, with a budget between their peaks
    same = [r for r in gpt2_rows if r.precision == "fp32" or r.rounding == "kahan"]
    peaks = sorted({r.peak_bytes for r in same})
    budget = peaks[len(peaks) // 2]
    rows = plan(tiny_gpt2(), batch=4, seq=32, budget=budget, optimizers=["adamw", "adamw8bit", "adafactor"], precisions=["fp32", "bf16"],
                roundings=["kahan"])  # fmt: skip
    assert [r.peak_bytes for r in rows] == [r.peak_bytes for r in same]  # deterministic
    assert all(r.fits == (r.peak_bytes <= budget) and r.compared == "peak_bytes" for r in rows)  # process_bytes unknown
    best = recommend(rows)
    assert best is not None and best.fits
    assert best is next(r for r in rows if r.fits)  # the most precise that fits
    assert recommend(plan(tiny_gpt2(), batch=4, seq=32, budget=1, optimizers=["adafactor"], precisions=["fp32"])) is None
    assert recommend(gpt2_rows) is None  # no budget


# ---- where the peak is, what no batch lowers, and what to say when nothing fits ----------------------
def test_rows_say_where_they_peak(gpt2_rows):
    """Pure bf16 with Kahan or stochastic rounding peaks in optimizer.step() (each param stepped
    through fp32 copies, after backward freed the activations): no activations in its breakdown,
    and checkpointing leaves that peak as it is. Without release and rounding, this model peaks in
    forward/backward, activations in it."""
    rows = {(r.optimizer, r.precision, r.rounding, r.grad_release, r.checkpointing): r for r in gpt2_rows}
    for (optimizer, precision, rounding, release, ckpt), r in rows.items():
        assert r.peak_in in ("forward/backward", "optimizer step", "backward")
        assert (r.peak_in == "backward") == release
        if r.peak_in == "optimizer step":
            assert r.breakdown["activations"] == 0
            if not ckpt:
                assert rows[optimizer, precision, rounding, release, True].peak_bytes == r.peak_bytes
    stochastic = rows["adamw", "bf16", "stochastic", False, False]
    assert stochastic.peak_in == "optimizer step" and stochastic.breakdown["other"] > stochastic.breakdown["weights"]
    fp32 = rows["adamw", "fp32", None, False, False]
    assert fp32.peak_in == "forward/backward" and fp32.breakdown["activations"] > 0


def test_the_floor_is_what_every_batch_needs(gpt2_rows):
    """floor_bytes does not depend on the batch or the sequence, and no row at batch 1, seq 1 is
    under it; a pure-bf16 row's floor holds at least its bf16 weights and gradients."""
    small = {(r.optimizer, r.precision, r.rounding, r.grad_release, r.checkpointing): r
             for r in plan(tiny_gpt2(), batch=1, seq=1, optimizers=["adamw", "adamw8bit", "adafactor"], process=False)}  # fmt: skip
    n = sum(p.numel() for p in tiny_gpt2().parameters())
    for r in gpt2_rows:
        same = small[r.optimizer, r.precision, r.rounding, r.grad_release, r.checkpointing]
        assert r.floor_bytes == same.floor_bytes <= same.peak_bytes <= r.peak_bytes
        assert r.floor_bytes >= (2 if r.precision == "bf16" else 4) * n * (1 if r.grad_release else 2)


def test_nothing_fits_says_whether_any_batch_would(gpt2_rows):
    from leanopt.memory.plan import nothing_fits

    floor = min(r.floor_bytes for r in gpt2_rows)
    smallest = min(gpt2_rows, key=lambda r: r.floor_bytes)
    below = nothing_fits(gpt2_rows, floor - 1, batch=4, seq=32)
    assert "at any batch or seq" in below and "lower --batch" not in below
    assert f"({smallest.optimizer}, {smallest.precision}" in below and "a smaller model" in below and "--gpus N" in below
    assert "--offload" not in below  # on the CPU the host is the device: offloading saves nothing
    assert "--offload" in nothing_fits(gpt2_rows, floor - 1, batch=4, seq=32, device="cuda")
    between = nothing_fits(gpt2_rows, floor, batch=4, seq=32)  # under every peak, at the smallest floor
    assert "at batch 4, seq 32: lower --batch or --seq" in between and "at any batch" not in between


def test_cli_says_that_no_batch_fits_below_the_weights(tmp_path, capsys):
    """A budget under a model's bf16 weights: no batch fits, and plan says what would."""
    transformers.GPT2Config(**TINY_GPT2).to_json_file(tmp_path / "config.json")
    n = sum(p.numel() for p in tiny_gpt2().parameters())
    out = _run_cli(["plan", str(tmp_path), "--batch", "2", "--seq", "16", "--optimizers", "adamw,adafactor", "--precisions", "bf16",
                    "--roundings", "stochastic", "--no-process", "--budget", str(2 * n - 1)], capsys)  # fmt: skip
    text = " ".join(out.split())
    assert "nothing fits in" in text and "at any batch or seq" in text and "a smaller model" in text, text
    assert "lower --batch or --seq" not in text
    assert "rows peak in optimizer.step()" in text and "checkpointing does not lower such a peak" in text


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
    from leanopt.kernels import cpu, cpu_elementwise
    from leanopt.quant import codebooks

    plan(tiny_gpt2(), batch=2, seq=16, optimizers=["adamw8bit", "adafactor"], precisions=["fp32"], checkpointing=[False])
    cached = [*codebooks._CACHE.values(), *cpu_elementwise._ENCODE_TABLES.values(), *cpu._workspaces.__dict__.get("pool", {}).values()]
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
    _one_line_error(lambda: plan(tiny_gpt2(), batch=1, seq=8, device="tpu"), "'cpu' and 'cuda'")
    _one_line_error(lambda: plan(tiny_gpt2(), batch=1, seq=8, device="cuda", gpus=2), "gpus > 1 is not planned")
    _one_line_error(lambda: plan(tiny_gpt2(), batch=1, seq=8, optimizers=["sgd9000"]), "unknown optimizer")
    _one_line_error(lambda: plan(tiny_gpt2(), batch=1, seq=8, precisions=["fp8"]), "unknown precision")
    _one_line_error(lambda: plan(tiny_gpt2(), batch=1, seq=8, roundings=["up"]), "unknown rounding")
    _one_line_error(lambda: plan(tiny_gpt2(), batch=1, seq=8, gpus=2, precisions=["bf16"]), "pure bf16 is not planned under FSDP2")
    _one_line_error(lambda: plan(tiny_gpt2(), batch=1, seq=8, gpus=2, grad_release=[True]), "release is not planned under FSDP2")
    _one_line_error(lambda: plan(tiny_gpt2(), batch=1, seq=8, optimizers=["torch-adamw"], grad_release=[True]), "needs a leanopt optimizer")
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
def test_fsdp_rows_shard_weights_gradients_and_state(gpt2_rows):
    one = {(r.optimizer, r.checkpointing): r for r in gpt2_rows
           if r.precision == "fp32" and r.optimizer in ("adamw", "adafactor") and not r.grad_release}  # fmt: skip
    # FSDP2 rows: no pure bf16 and no release (both refuse DTensor params), whatever the defaults
    two = plan(tiny_gpt2(), batch=4, seq=32, gpus=2, precisions=["fp32", "bf16"], optimizers=["adamw", "adafactor"])
    assert len(two) == len(one) == 4
    for r in two:
        ref = one[r.optimizer, r.checkpointing]
        assert r.gpus == 2 and not r.grad_release and r.precision == "fp32" and sum(r.breakdown.values()) == r.peak_bytes
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
    base = ["plan", str(tmp_path), "--batch", "2", "--seq", "16", "--optimizers", "adamw,adafactor", "--precisions", "fp32,bf16",
            "--roundings", "kahan"]  # fmt: skip
    rows = json.loads(_run_cli([*base, "--json"], capsys))
    assert len(rows) == 16 and all(r["fits"] is None for r in rows)
    assert {(r["precision"], r["rounding"]) for r in rows} == {("fp32", None), ("bf16", "kahan")}
    assert {r["grad_release"] for r in rows} == {False, True}
    assert len(json.loads(_run_cli([*base, "--grad-release", "off", "--json"], capsys))) == 8
    budget = sorted(r["peak_bytes"] for r in rows)[7]
    out = _run_cli([*base, "--budget", str(budget)], capsys)
    assert "✔" in out and "✘" in out and "recommended:" in out and "bf16 kahan" in out
    best = next(r for r in rows if r["peak_bytes"] <= budget)  # process_bytes unknown here: the step's peak is compared
    mode = f"{best['precision']} {best['rounding']}" if best["rounding"] else best["precision"]
    assert f"recommended: {best['optimizer']}, {mode}" in out
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
# models of docs/plan.md (within 2 % there). The configurations below, measured in one process on
# 2026-12-04: within 0.8 % but for the quantized bf16-mixed rows (+1.2 % AdamW8bit, +1.8 %
# AdamW4bit: the code books and lookup tables a first step makes, which the plan counts in its step
# and the measured step finds made, ~2 MiB; docs/plan.md).
SMALL_TOLERANCE = 0.05
# The quantized bf16-mixed rows sit above by construction: the plan's steady step holds the code
# books and lookup tables (~2 MiB) a first step makes, and the measured step (the second) finds
# them made before its baseline. On the Intel AVX-512 machine of 2026-12-05 AdamW4bit's row
# measured +2.4 % and +3.2 % alone and +5.2 % once in the suite (36.13 MB against 38.00 planned);
# AdamW8bit's +1.4 % and +1.5 %. Held to 8 %.
QUANTIZED_TOLERANCE = 0.08


# Every configuration held to a real step here, by model: all measured in one fresh process
# (bench.measure_cases: a warm-up on a smaller model of the class, then the measured model, for
# each configuration in turn), so that a process's start and imports are paid once.
# Both models' plain steps; each pure-bf16, released and quantized configuration on the DistilBERT
# at 4 sequences of 128 (-4seq): bf16 matmuls are 40-100x slower than fp32 ones on a CPU without
# bf16 instructions, and GPT-2's Conv1D layout is the slowest (a 256x256 by 256x768 product 66 ms
# in bf16, 16 ms with the weight column-major as nn.Linear keeps it). AdamW4bit's ~2 MiB of code
# books and tables, which the plan counts in its step and the measured step finds made, are
# 7 % of the tiny GPT-2's peak at 2 sequences; here +1.8 % (2026-12-04). The pure-bf16 stochastic
# and released Adafactor rows ran on the GPT-2 at 2 sequences until 2026-12-04 (+0.45 %, +1.06 %;
# 14 s each); here +0.24 % and +1.95 %, 8-10 s each.
REAL_STEPS = {
    "tiny-distilbert": {
        "plain": [("adamw", "fp32", False), ("adafactor", "fp32", False), ("adamw", "fp32", True)],
        "bf16-and-released": [("adamw", "fp32", False, None, True)],
    },
    "tiny-distilbert-4seq": {
        "bf16-and-released": [("adamw", "bf16", False, "kahan"), ("adamw", "bf16", False, "stochastic"),
                              ("adafactor", "bf16", True, "kahan", True)],
        "quantized": [("adamw8bit", "bf16-mixed", False), ("adamw4bit", "bf16-mixed", True)],
    },
    "tiny-gpt2": {
        "plain": [("adamw", "fp32", False), ("adafactor", "fp32", False), ("adamw", "fp32", True)],
    },
}


def _cases_with(group: str) -> list[str]:
    return [case for case, groups in REAL_STEPS.items() if group in groups]


def measure_real_steps(runs: dict[str, list[tuple]]) -> dict[str, list[int]]:
    """Each model's configurations -> their measured peaks, all in one fresh process
    (bench.measure_cases); skipped where /proc cannot give the resident high-water mark.

    One warm-up step and the second step measured, not the benchmark's two and third: the same
    state, the same code paths, a third less time (most of it bf16 matmuls). On REAL_STEPS'
    twelve configurations, measured both ways in one sitting (2026-12-05): within 0.2 % of each
    other, AdamW4bit bf16-mixed 0.7 % under (37.17 against 37.43 MB); a repeat of the benchmark's
    way differs by up to 0.3 %."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to read the resident high-water mark")
    return dict(zip(runs, _bench().measure_cases(list(runs.items()), warmup_steps=1, measured_step=2), strict=True))


@pytest.fixture(scope="module")
def real_steps() -> dict[str, dict[tuple, int]]:
    """Each model's configurations (``REAL_STEPS``) -> their measured peaks."""
    runs = {case: [config for group in groups.values() for config in group] for case, groups in REAL_STEPS.items()}
    return {case: dict(zip(runs[case], peaks, strict=True)) for case, peaks in measure_real_steps(runs).items()}


def _check_predictions(case: str, configs: list[tuple], real: list[int], tolerance: float = SMALL_TOLERANCE) -> None:
    for config, measured, predicted in zip(configs, real, _bench().predict_all(case, configs), strict=True):
        assert abs(predicted - measured) <= tolerance * measured, (case, config, predicted, measured)


def _check_group(real_steps, case: str, group: str) -> None:
    configs = REAL_STEPS[case][group]
    tolerance = QUANTIZED_TOLERANCE if group == "quantized" else SMALL_TOLERANCE
    _check_predictions(case, configs, [real_steps[case][config] for config in configs], tolerance)


@pytest.mark.parametrize("case", _cases_with("plain"))
def test_prediction_matches_a_real_step(real_steps, case):
    _check_group(real_steps, case, "plain")


# Pure bf16 (Kahan, stochastic rounding) and gradient release: measured within 2 % here (the
# composition itself is held to a direct trace, to the byte, above).
@pytest.mark.parametrize("case", _cases_with("bf16-and-released"))
def test_bf16_and_released_predictions_match_a_real_step(real_steps, case):
    _check_group(real_steps, case, "bf16-and-released")


@pytest.mark.parametrize("case", _cases_with("quantized"))
def test_prediction_matches_a_real_step_quantized(real_steps, case):
    _check_group(real_steps, case, "quantized")


# FSDP2 over 2 gloo ranks (torchrun), each rank's peak against rank 0's plan. One launch (three
# processes importing torch on 2 cores, a warm-up per configuration): ~25 s here, on the tiny
# GPT-2, whose tied embedding FSDP2 shards once (the one-process checks above take both models).
# Measured within 0.3 % (AdamW, Adafactor) on both; held to 5 % as the one-process check is.
@pytest.mark.slow
@pytest.mark.parametrize("case", ["tiny-gpt2"])
def test_fsdp_prediction_matches_real_steps_on_each_rank(case):
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to read the resident high-water mark")
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available in this build")
    bench = _bench()
    configs = [("adamw", "fp32", False), ("adafactor", "fp32", False)]
    measured = bench.measure_dist(case, configs, 2, timeout=600)
    for (optimizer, precision, ckpt), per_rank, predicted in zip(configs, measured, bench.predict_all(case, configs, gpus=2)):
        assert len(per_rank) == 2
        for rank, real in enumerate(per_rank):
            assert abs(predicted - real) <= SMALL_TOLERANCE * real, (case, rank, optimizer, predicted, real)


@pytest.mark.slow
def test_a_7b_wide_model_plans_without_allocating_it():
    import resource

    # Llama-2-7B's widths with 4 of its 32 layers: 1.07e9 params, 4.3 GB of fp32 weights alone, so
    # a plan that allocated any of them would grow the process by gigabytes. The whole 7B plan's
    # time is a benchmark's figure (docs/plan.md: 23 s of CPU on the idle build machine); its 32
    # layers are identical, and 4 of them take every path of the trace that 32 take.
    layers = 4
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers,
                                      num_attention_heads=32, max_position_embeddings=4096)  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    n = sum(p.numel() for p in model.parameters())
    assert n == 2 * 32000 * 4096 + layers * (4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096) + 4096
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # The traces only (no probe process: tests/test_plan_probe.py).
    rows = plan(model, batch=1, seq=2048, budget="80GiB", process=False)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 1024**2  # KiB: under 1 GiB grown
    assert len(rows) == 4 * 4 * 2 * 2  # 4 optimizers x (fp32, bf16-mixed, bf16 kahan, bf16 stochastic) x ckpt x release
    assert rows[0].peak_bytes > 16 * n  # weights + gradients + AdamW state, fp32
