"""leanopt.doctor: real steps measured and attributed; categories add up; plan beside each (CPU).

CUDA is covered by scripts/gpu_check.sh (stage plan_check, ``doctor`` rows)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
import transformers

import leanopt
from leanopt import cli
from leanopt.memory.doctor import CATEGORIES, TENSOR_CATEGORIES, doctor, render
from leanopt.memory.estimate import estimate
from leanopt.memory.plan_model import over_model
from registry import OPTIMIZERS

MiB = 2**20
LINUX = Path("/proc/self/clear_refs").exists()

TINY_DISTILBERT = {"vocab_size": 2000, "dim": 64, "n_layers": 2, "n_heads": 4, "hidden_dim": 256,
                   "max_position_embeddings": 64, "num_labels": 3}  # fmt: skip


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANOPT_CACHE", str(tmp_path / "cache"))


def _setup(seed: int = 0, optimizer: str = "adamw", batch: int = 8, seq: int = 32):
    torch.manual_seed(seed)
    model = transformers.DistilBertForSequenceClassification(transformers.DistilBertConfig(**TINY_DISTILBERT))
    cls = leanopt.memory.resolve_optimizer(optimizer)
    opt = cls(over_model(cls, model))  # Muon: its groups of the model
    ids = torch.randint(0, 2000, (batch, seq))
    return model, opt, {"input_ids": ids, "labels": torch.randint(0, 3, (batch,))}


def test_categories_add_up_and_match_the_known_terms():
    model, opt, batch = _setup()
    d = doctor(model, opt, batch, plan=False)
    m = d.measured
    assert set(m) == set(CATEGORIES)
    assert sum(m[c] for c in TENSOR_CATEGORIES) == d.tensor_peak_bytes
    if LINUX:  # with the runtime overhead: the process's measured peak (within 1 %)
        assert abs(sum(m.values()) - d.process_peak_bytes) <= 0.01 * d.process_peak_bytes
    weights = sum(p.untyped_storage().nbytes() for p in model.parameters()) + sum(b.untyped_storage().nbytes() for b in model.buffers())
    assert m["weights"] == weights
    assert m["optimizer_state"] == estimate(model, "adamw").bytes  # AdamW's state, to the byte
    assert m["activations"] > 0 and m["master_weights"] == 0
    assert d.peak_phase in ("forward", "backward", "step", "zero_grad")


def test_the_tensor_peak_is_the_profilers_independent_sum():
    """The attribution replays the same events the meter sums: its peak is meter.TensorPeak's
    growth plus the tensors live at the start (a separate profiled step, same allocations)."""
    from leanopt.compare.meter import TensorPeak

    model, opt, batch = _setup()
    d = doctor(model, opt, batch, plan=False)
    start = sum(p.untyped_storage().nbytes() for p in model.parameters())
    start += sum(t.untyped_storage().nbytes() for st in opt.state.values() for t in st.values())
    start += sum(t.untyped_storage().nbytes() for t in batch.values())
    meter = TensorPeak()
    assert meter.start()
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    del loss
    growth = meter.stop()
    assert growth is not None
    assert abs((start + growth) - d.tensor_peak_bytes) <= 0.01 * d.tensor_peak_bytes


# What the doctor attributes, and the plan it is held to, follow the code path of a state and its
# step (tests/registry.py's families) and the width of a quantized code (its kernel's temporaries:
# 8 and 12 B per element for 8- and 4-bit states): one optimizer per family and code width. Every
# optimizer's state is held to its estimate to the byte by tests/test_generic.py; the plan traces
# each optimizer's own step code (tests/test_plan.py holds such traces to real steps).
DOCTORED: dict[tuple, str] = {}
for _case in OPTIMIZERS:
    if not _case.external and _case.planned:
        DOCTORED.setdefault((_case.family, getattr(_case.cls, "state_bits", None)), _case.name)


@pytest.fixture
def tensor_plan(monkeypatch):
    """The doctor's plan without its process bytes: the tests that use it compare tensor categories,
    and the process bytes (a probe subprocess per optimizer and precision, ~7 s of CPU each) are held
    to a fresh process by tests/test_plan_process.py and put beside the doctor's runtime overhead by
    test_cli_doctor_prints_the_table_and_json."""
    from leanopt.memory import plan as plan_module

    monkeypatch.setattr(plan_module, "plan", functools.partial(plan_module.plan, process=False))


@pytest.mark.parametrize("optimizer", list(DOCTORED.values()))
def test_measured_categories_are_the_plans(optimizer, tensor_plan):
    model, opt, batch = _setup(optimizer=optimizer)
    d = doctor(model, opt, batch)
    assert d.planned is not None, d.plan_note
    for c in ("weights", "gradients", "optimizer_state"):
        assert abs(d.measured[c] - d.planned[c]) <= 0.01 * d.tensor_peak_bytes + 4096, (c, d.measured, d.planned)
    # the step's tensor peak against the plan's, fresh random inputs, within 5 % and the optimizers'
    # module-level caches (code books, lookup tables, Adafactor's row-block workspace: ~1 MiB here),
    # which the plan counts in its step and the measured step finds made by the first one
    assert abs(d.tensor_peak_bytes - d.plan_row["peak_bytes"]) <= 0.05 * d.tensor_peak_bytes + 1.5 * MiB
    text = "\n".join(d.explanations)
    assert "of this step's peak" in text


def test_explanations_name_small_params_of_a_quantized_optimizer():
    model, opt, batch = _setup(optimizer="adamw8bit")
    d = doctor(model, opt, batch, plan=False)
    small = [p for p in model.parameters() if p.numel() < 4096]
    n = sum(p.numel() for p in small)
    assert any(f"these {n:,} params (in {len(small)} tensors) are under min_quant_size" in x for x in d.explanations)


def test_activations_dominate_and_say_so():
    model, opt, batch = _setup(batch=64, seq=64)
    d = doctor(model, opt, batch, plan=False)
    assert max(TENSOR_CATEGORIES, key=d.measured.get) == "activations"
    assert any(x.startswith("activations are") and "checkpointing" in x for x in d.explanations)
    lines = render(d)
    assert lines[0].startswith("| category") and len(lines) == 2 + len(CATEGORIES) + 2


def test_a_python_model_with_a_custom_loss():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    opt = leanopt.AdamW(model.parameters())
    x, y = torch.randn(512, 256), torch.randint(0, 10, (512,))
    d = doctor(model, opt, (x, y), loss_fn=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))
    assert d.planned is None and d.plan_note.startswith("no plan")
    params = sum(p.numel() for p in model.parameters())
    assert d.measured["weights"] == 4 * params and d.measured["optimizer_state"] == 8 * params + 4 * 4
    # backward's peak: the ReLU's output [512, 1024] fp32 is the one activation saved (ReLU's backward
    # and the second Linear's need it; the first Linear's input is the batch, a temporary)
    assert d.peak_phase == "backward" and d.measured["activations"] == 512 * 1024 * 4
    assert d.measured["temporaries"] >= x.numel() * 4


def test_errors_are_one_line():
    model, opt, batch = _setup()
    for kwargs, match in [({"steps": 1}, "steps"), ({"autocast": torch.float32}, "autocast")]:
        with pytest.raises(ValueError, match=match):
            doctor(model, opt, batch, **kwargs)
    with pytest.raises(ValueError, match="loss"):
        doctor(model, opt, {"input_ids": batch["input_ids"]}, plan=False)  # no labels: no loss


def test_cli_doctor_prints_the_table_and_json(tmp_path, capsys):
    config = transformers.DistilBertConfig(**TINY_DISTILBERT, architectures=["DistilBertForSequenceClassification"])
    config.to_json_file(tmp_path / "config.json")
    # the plan beside it probes its one-time cost once (a subprocess) for this class, optimizer and precision
    assert cli.main(["doctor", str(tmp_path), "--batch", "4", "--seq", "32", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert set(d["measured"]) == set(CATEGORIES) and d["planned"] is not None
    if LINUX:
        assert abs(sum(d["measured"].values()) - d["process_peak_bytes"]) <= 0.01 * d["process_peak_bytes"]
    assert cli.main(["doctor", str(tmp_path), "--batch", "4", "--seq", "32", "--optimizer", "adafactor"]) == 0
    out = capsys.readouterr().out
    assert "| runtime overhead |" in out and "- the step's tensors peaked at" in out and "plan: adafactor" in out
    assert cli.main(["doctor", str(tmp_path), "--batch", "0", "--seq", "32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "batch" in err[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_offloaded_host_copies_are_master_weights(dtype, tensor_plan):
    """With offload="cpu" on the CPU the optimizer keeps a host copy of each param (an fp32 master
    of a bf16 param: leanopt.optim.offload.master_dtype), in the memory measured: master weights,
    4 B/param, not runtime overhead; the plan beside it says the same."""
    from leanopt.optim.offload import master_dtype

    torch.manual_seed(0)
    model = transformers.DistilBertForSequenceClassification(transformers.DistilBertConfig(**TINY_DISTILBERT)).to(dtype)
    batch = {"input_ids": torch.randint(0, 2000, (8, 32)), "labels": torch.randint(0, 3, (8,))}
    params = list(model.parameters())
    masters = sum(p.numel() * torch.empty((), dtype=master_dtype(p.dtype)).element_size() for p in params)
    assert masters == 4 * sum(p.numel() for p in params)
    d = doctor(model, leanopt.AdamW(params, offload="cpu"), batch, plan=dtype == torch.bfloat16)
    assert d.measured["master_weights"] == masters
    assert d.measured["optimizer_state"] == estimate(params, "adamw").bytes
    assert sum(d.measured[c] for c in TENSOR_CATEGORIES) == d.tensor_peak_bytes
    if dtype == torch.bfloat16:
        assert d.planned is not None and d.plan_row["offload"], d.plan_note
        assert d.planned["master_weights"] == masters and d.planned["optimizer_state"] == d.measured["optimizer_state"]
        # the same model and optimizer without offload: no master weights, the tensor peak 4 B/param lower
        torch.manual_seed(0)
        model = transformers.DistilBertForSequenceClassification(transformers.DistilBertConfig(**TINY_DISTILBERT)).to(dtype)
        usual = doctor(model, leanopt.AdamW(model.parameters()), batch, plan=False)
        assert usual.measured["master_weights"] == 0
        assert usual.tensor_peak_bytes + masters <= d.tensor_peak_bytes
