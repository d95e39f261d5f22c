"""The ``leanopt`` command: estimate (presets, configs, counts, the Hub offline) and inspect."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import leanopt
from leanopt.cli import main
from leanopt.memory.inspect import inspect_state_dict
from leanopt.memory.presets import PRESETS, parse_param_count, resolve_model

SEED_PARAMS = 65_783_042
SEED_ADAMW_BYTES = 526_264_752


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, out: str, err: str, *words: str) -> None:
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("leanopt: error: "), err
    for word in words:
        assert word in err, err


# ---- estimate -------------------------------------------------------------------------------
def test_estimate_seed_preset_table(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    code, out, err = run(capsys, "estimate", "distilbert-base-cased")
    assert code == 0, err
    assert "65,783,042 trainable parameters in 104 tensors" in out
    adamw = next(line for line in out.splitlines() if line.strip().startswith("adamw "))
    # state 502 MB, 8 B/param; training fp32 16 B/param, bf16-mixed 18 B/param
    assert [c.strip() for c in adamw.split("│")][2:] == ["502", "8.00", "1,004", "1,129"]
    assert "torch-adamw" in out and "adafactor" in out and "MB (MiB)" in out


def test_estimate_json(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    code, out, _ = run(capsys, "estimate", "distilbert/distilbert-base-cased", "--json", "--optimizers", "adamw,hf-adafactor")
    assert code == 0
    data = json.loads(out)
    assert (data["params"], data["tensors"], data["exact_shapes"]) == (SEED_PARAMS, 104, True)
    adamw, adafactor = data["optimizers"]
    assert adamw["name"] == "adamw" and adamw["state_bytes"] == SEED_ADAMW_BYTES
    assert adamw["by_key"]["exp_avg"] == 4 * SEED_PARAMS
    fp32 = adamw["training"]["fp32"]
    assert fp32 == {
        "weights": 4 * SEED_PARAMS,
        "gradients": 4 * SEED_PARAMS,
        "master_weights": 0,
        "optimizer_state": SEED_ADAMW_BYTES,
        "total": 8 * SEED_PARAMS + SEED_ADAMW_BYTES,
    }
    assert adamw["training"]["bf16-mixed"]["total"] == 10 * SEED_PARAMS + SEED_ADAMW_BYTES
    assert adafactor["class"] == "transformers.optimization.Adafactor"
    assert adafactor["state_bytes"] < SEED_PARAMS // 50  # factored: ~0.01 B/param


def test_estimate_config_folder_and_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128)
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        expected = sum(p.numel() for p in transformers.GPT2LMHeadModel(config).parameters())
    for target in (tmp_path, tmp_path / "config.json"):
        code, out, err = run(capsys, "estimate", str(target), "--json", "--optimizers", "adamw")
        assert code == 0, err
        data = json.loads(out)
        assert data["params"] == expected and "GPT2LMHeadModel" in data["description"]


def test_estimate_bare_count(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "estimate", "7b")
    assert code == 0, err
    assert "7,000,000,000 trainable parameters" in out
    adamw = next(line for line in out.splitlines() if line.strip().startswith("adamw "))
    assert f"{(8 * 7e9 + 4) / 1024**2:,.0f}" in adamw  # 53,406 MB
    adafactor = next(line for line in out.splitlines() if line.strip().startswith("adafactor "))
    assert "n/a" in adafactor
    code, out, _ = run(capsys, "estimate", "65,783,042", "--json", "--optimizers", "adamw,adafactor")
    data = json.loads(out)
    assert data["tensors"] is None and data["exact_shapes"] is False
    assert data["optimizers"][0]["state_bytes"] == 8 * SEED_PARAMS + 4
    assert data["optimizers"][1]["state_bytes"] is None and data["optimizers"][1]["training"] is None


@pytest.mark.parametrize(
    "text,count",
    [("7b", 7 * 10**9), ("125m", 125 * 10**6), ("1.1B", 1_100_000_000), ("65783042", SEED_PARAMS),
     ("65,783,042", SEED_PARAMS), ("350K", 350_000), ("gpt2", None), ("1.5", None), ("0", None)],
)
def test_parse_param_count(text: str, count: int | None) -> None:
    assert parse_param_count(text) == count


def test_hub_offline_fails_at_once(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    code, out, err = run(capsys, "estimate", "some-org/not-a-cached-model")
    assert time.monotonic() - start < 10  # the Hub is not tried: only local work
    assert_one_line_error(code, out, err, "offline", "some-org/not-a-cached-model")


def test_without_transformers_presets_fail_and_counts_work(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    assert_one_line_error(*run(capsys, "estimate", "gpt2"), "needs transformers")
    code, out, _ = run(capsys, "estimate", "125m", "--optimizers", "adamw")
    assert code == 0 and "125,000,000" in out


@pytest.mark.parametrize(
    "argv,words",
    [
        (["estimate", "gpt2", "--optimizers", "nosuch"], ["unknown optimizer 'nosuch'"]),
        (["estimate"], ["model"]),
        (["frobnicate"], ["invalid choice"]),
        (["estimate", "./missing/config.json"], ["no such file"]),
    ],
)
def test_errors_are_one_line(argv: list[str], words: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert_one_line_error(*run(capsys, *argv), *words)


def test_presets_have_their_published_sizes() -> None:
    pytest.importorskip("transformers")
    for name, preset in PRESETS.items():
        source = resolve_model(name)
        assert source.param_count == preset.params, name
        assert resolve_model(preset.hub_id).param_count == preset.params
    seed = resolve_model("distilbert-base-cased")
    assert (seed.param_count, seed.tensors) == (SEED_PARAMS, 104)


def test_python_dash_m() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "leanopt", "estimate", "125m", "--json", "--optimizers", "adamw"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["params"] == 125_000_000


# ---- inspect ----------------------------------------------------------------------------------
def _trained(opt_factory, model: torch.nn.Module | None = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = model or torch.nn.Sequential(torch.nn.Linear(64, 80), torch.nn.ReLU(), torch.nn.Linear(80, 8))
    opt = opt_factory(model)
    model(torch.randn(4, model[0].in_features)).square().mean().backward()
    opt.step()
    return model, opt


def _trainer_groups(model: torch.nn.Module) -> list[dict]:
    """Two groups, decay and no-decay, as transformers' Trainer builds them."""
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.01},
        {"params": [p for n, p in named if not n.endswith("weight")], "weight_decay": 0.0},
    ]


def test_inspect_torch_adamw_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, opt = _trained(lambda m: torch.optim.AdamW(_trainer_groups(m)))
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    n = sum(p.numel() for p in model.parameters())

    code, out, err = run(capsys, "inspect", str(tmp_path / "optimizer.pt"), "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["layout"] == "torch.optim.AdamW"
    assert data["bytes"] == leanopt.measure(opt).bytes == 8 * n + 4 * 4
    assert (data["params"], data["params_with_state"], data["param_elements"]) == (4, 4, n)
    assert data["by_key"]["exp_avg"] == {"bytes": 4 * n, "elements": n, "dtypes": ["float32"]}
    assert [g["params"] for g in data["groups"]] == [2, 2]
    assert [g["options"]["weight_decay"] for g in data["groups"]] == [0.01, 0.0]

    code, out, _ = run(capsys, "inspect", str(tmp_path))  # a checkpoint folder
    assert code == 0 and "torch.optim.AdamW" in out and "exp_avg_sq" in out and "2 groups" in out


def test_inspect_transformers_adafactor(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    transformers = pytest.importorskip("transformers")
    model, opt = _trained(lambda m: transformers.optimization.Adafactor(m.parameters()))
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    code, out, err = run(capsys, "inspect", str(tmp_path / "optimizer.pt"), "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["layout"] == "Adafactor (transformers)"
    assert set(data["by_key"]) == {"exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq", "RMS"}
    assert data["bytes"] == leanopt.measure(opt).bytes
    assert data["param_elements"] == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "factory,layout",
    [
        (lambda m: leanopt.AdamW(m.parameters()), "leanopt AdamW"),
        (lambda m: leanopt.Adafactor(m.parameters()), "leanopt Adafactor"),
        (lambda m: torch.optim.Adafactor(m.parameters()), "torch.optim.Adafactor"),
        (lambda m: torch.optim.Adam(m.parameters()), "torch.optim.Adam"),
        (lambda m: leanopt.AdamW8bit(m.parameters(), backend="reference"), "leanopt AdamW8bit ("),
        (lambda m: leanopt.AdamW4bit(m.parameters(), backend="reference"), "leanopt AdamW4bit ("),
    ],
)
def test_recognized_layouts(factory, layout: str) -> None:
    # 256 x 80: large enough for the low-bit optimizers to quantize it
    model, opt = _trained(factory, torch.nn.Sequential(torch.nn.Linear(256, 80), torch.nn.ReLU(), torch.nn.Linear(80, 8)))
    report = inspect_state_dict(opt.state_dict())
    assert report.layout == layout or (layout.endswith("(") and report.layout.startswith(layout))
    assert report.bytes == leanopt.measure(opt).bytes
    assert report.param_elements == sum(p.numel() for p in model.parameters())


def test_saved_before_first_step() -> None:
    opt = torch.optim.AdamW(torch.nn.Linear(3, 3).parameters())
    report = inspect_state_dict(opt.state_dict())
    assert report.layout.startswith("torch.optim.AdamW (no state yet")
    assert report.bytes == 0 and report.param_elements is None


def test_leanopt_quantized_entries() -> None:
    # The checkpoint form of a QuantizedState: codes, absmax, format name, logical shape.
    q = {"codes": torch.zeros(1000, dtype=torch.uint8), "absmax": torch.zeros(4), "format": "q8-test", "shape": [1000]}
    sd = {
        "state": {0: {"step": torch.tensor(1.0), "exp_avg": q, "exp_avg_sq": {**q, "codes": q["codes"].clone()}}},
        "param_groups": [{"params": [0], "lr": 1e-3, "betas": (0.9, 0.999)}],
    }
    report = inspect_state_dict(sd)
    assert report.layout == "leanopt quantized AdamW (q8-test)"
    assert report.by_key["exp_avg"] == 1016 and report.param_elements == 1000
    assert report.dtypes_by_key["exp_avg"] == ["quantized:q8-test"]


def test_inspect_bitsandbytes(tmp_path: Path) -> None:
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 80), torch.nn.Linear(80, 8))
    _, opt = _trained(lambda m: bnb.optim.AdamW8bit(m.parameters()), model)
    report = inspect_state_dict(opt.state_dict())
    assert report.layout.startswith("bitsandbytes 8-bit")
    assert {"state1", "state2", "absmax1", "absmax2"} <= set(report.by_key)
    assert report.bytes == leanopt.measure(opt).bytes


@pytest.mark.parametrize(
    "content,words",
    [
        (b"certainly not a checkpoint" * 10, ["not a torch checkpoint"]),
        (b"", ["not a torch checkpoint"]),
        (None, ["not an optimizer state_dict", "Tensor"]),
        ({"weights": 1}, ["not an optimizer state_dict", "weights"]),
    ],
)
def test_inspect_bad_files(tmp_path: Path, content, words: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "optimizer.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(torch.zeros(3) if content is None else content, path)
    assert_one_line_error(*run(capsys, "inspect", str(path)), *words)
    assert_one_line_error(*run(capsys, "inspect", str(tmp_path / "missing.pt")), "no such file")


def test_inspect_torchao_states(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torchao")
    from torchao.optim.subclass_8bit import OptimState8bit

    sd = {
        "state": {0: {"step": torch.tensor(1.0), "exp_avg": OptimState8bit.zeros((80, 256), signed=True),
                      "exp_avg_sq": OptimState8bit.zeros((80, 256), signed=False)}},
        "param_groups": [{"params": [0], "lr": torch.tensor(1e-3), "betas": (0.9, 0.999)}],
    }
    path = tmp_path / "optimizer.pt"
    torch.save(sd, path)
    code, out, err = run(capsys, "inspect", str(path), "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["layout"] == "torchao low-bit AdamW (OptimState8bit)" and data["complete"]
    per_state = 80 * 256 + 80 * 4 + 256 * 4  # codes, one fp32 scale per 256-block, the code book
    assert data["bytes"] == 2 * per_state + 4 and data["param_elements"] == 80 * 256

    # Where torchao cannot be imported its classes cannot be loaded: layout and total only.
    child = "import sys; sys.modules['torchao'] = None; from leanopt.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run([sys.executable, "-c", child, "inspect", str(path), "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["layout"] == "torchao tensor-subclass states (OptimState8bit)" and not data["complete"]
    assert data["bytes"] >= 2 * per_state + 4
