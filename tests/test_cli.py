"""The ``leanopt`` command: estimate (presets, configs, counts, the Hub offline) and inspect."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import leanopt
from leanopt.cli import main
from leanopt.memory.inspect import inspect_state_dict
from leanopt.memory.presets import PRESETS, parse_param_count, resolve_model
from leanopt.optim import REGISTRY
from leanopt.quant import QuantizedState
from registry import OPTIMIZERS

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
    assert "torch-adamw" in out and "adafactor" in out and "MB = MiB" in out


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


def test_estimate_training_modes(capsys: pytest.CaptureFixture[str]) -> None:
    """Pure bf16 with each rounding and gradient release, in --json and in the table of modes."""
    pytest.importorskip("transformers")
    code, out, _ = run(capsys, "estimate", "distilbert-base-cased", "--json", "--optimizers", "adamw,torch-adamw")
    assert code == 0
    adamw, torch_adamw = json.loads(out)["optimizers"]
    training, released = adamw["training"], adamw["training_grad_release"]
    assert training["bf16"]["total"] == training["bf16-stochastic"]["total"] == 4 * SEED_PARAMS + SEED_ADAMW_BYTES
    assert training["bf16-kahan"]["optimizer_state"] == SEED_ADAMW_BYTES + 2 * SEED_PARAMS  # + the compensation
    largest = 28996 * 768  # the word embeddings
    assert released["fp32"]["gradients"] == 4 * largest and released["bf16-kahan"]["gradients"] == 2 * largest
    assert released["fp32"]["total"] == training["fp32"]["total"] - 4 * SEED_PARAMS + 4 * largest
    assert torch_adamw["training"]["bf16-kahan"] is None and torch_adamw["training_grad_release"]["fp32"] is None
    code, out, _ = run(capsys, "estimate", "distilbert-base-cased", "--optimizers", "adamw,torch-adamw")
    # a row per optimizer, a column per mode; the modes with gradient release in a second table
    modes = out[out.index("training MB by mode"):out.index("training MB by mode, with grad release")]
    released = out[out.index("training MB by mode, with grad release"):]
    header = [c.strip() for c in next(l for l in modes.splitlines() if l.strip().startswith("optimizer ")).split("┃")]
    cell = lambda text, name, mode: [c.strip() for c in next(l for l in text.splitlines() if l.strip().startswith(name + " ")).split("│")][header.index(mode)]  # noqa: E731
    assert (cell(modes, "adamw", "bf16-kahan"), cell(modes, "torch-adamw", "bf16-kahan")) == ("878", "n/a")  # 753 + 2 B/param
    assert (cell(released, "adamw", "fp32"), cell(released, "torch-adamw", "fp32")) == ("838", "n/a")
    # a bare count has no largest param: no release table
    code, out, _ = run(capsys, "estimate", "7b", "--optimizers", "adamw")
    assert "bf16-kahan" in out and "with grad release" not in out and "no grad release table" in out


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
     ("65,783,042", SEED_PARAMS), ("350K", 350_000), ("gpt2", None), ("./model", None), ("org/7b", None)],
)
def test_parse_param_count(text: str, count: int | None) -> None:
    assert parse_param_count(text) == count


def test_hub_offline_fails_at_once(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import socket

    tried: list[object] = []  # the Hub is not tried: no host name is looked up, only local work

    def lookup(host: object, *args: object, **kwargs: object) -> None:
        tried.append(host)  # without HF_HUB_OFFLINE: ["huggingface.co", ...]
        raise OSError("no network in this test")

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    code, out, err = run(capsys, "estimate", "some-org/not-a-cached-model")
    assert tried == []
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
    assert data["layout"] == "torch.optim.AdamW" and data["optimizer"] is None  # torch declares no name
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


def _quantizable() -> torch.nn.Module:
    # 256 x 80: large enough for the low-bit optimizers to quantize it
    return torch.nn.Sequential(torch.nn.Linear(256, 80), torch.nn.ReLU(), torch.nn.Linear(80, 8))


def _undeclared(sd: dict) -> dict:
    """``sd`` as leanopt saved it before optimizers declared their names."""
    return {**sd, "param_groups": [{k: v for k, v in g.items() if k != "optimizer"} for g in sd["param_groups"]]}


@pytest.mark.parametrize("case", OPTIMIZERS, ids=str)
def test_inspect_reports_the_declared_optimizer(case, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, opt = _trained(lambda m: case.cls(case.param_groups(m), **{**case.kwargs, "backend": "reference"}), _quantizable())
    sd = opt.state_dict()
    report = inspect_state_dict(sd)
    formats = sorted({v.format.name for st in opt.state.values() for v in st.values() if isinstance(v, QuantizedState)})
    assert report.optimizer == case.name
    assert report.layout == f"leanopt {case.cls.__name__}" + (f" ({', '.join(formats)})" if formats else "")
    assert bool(formats) == (getattr(case.cls, "state_bits", None) is not None)
    assert report.bytes == leanopt.measure(opt).bytes
    assert report.param_elements == sum(p.numel() for p in model.parameters())
    torch.save(sd, tmp_path / "optimizer.pt")
    code, out, err = run(capsys, "inspect", str(tmp_path / "optimizer.pt"), "--json")
    assert code == 0 and json.loads(out)["optimizer"] == case.name, err
    code, out, err = run(capsys, "inspect", str(tmp_path))
    siblings = [n for n, cls in REGISTRY.items() if cls.family == case.cls.family]
    assert code == 0 and f"declared optimizer: {case.name}" in out, err
    assert (f"convert --to: {', '.join(siblings)}" in out) == (len(siblings) > 1)


@pytest.mark.parametrize(
    "factory,layout",
    [
        (lambda m: torch.optim.Adafactor(m.parameters()), "torch.optim.Adafactor"),
        (lambda m: torch.optim.Adam(m.parameters()), "torch.optim.Adam"),
        # leanopt's files from before optimizers declared their names:
        (lambda m: leanopt.AdamW(m.parameters()), "leanopt AdamW"),
        (lambda m: leanopt.Adafactor(m.parameters()), "leanopt Adafactor"),
        (lambda m: leanopt.AdamW8bit(m.parameters(), backend="reference"), "leanopt AdamW8bit ("),
        (lambda m: leanopt.AdamW4bit(m.parameters(), backend="reference"), "leanopt AdamW4bit ("),
    ],
)
def test_recognized_layouts_of_undeclared_files(factory, layout: str) -> None:
    model, opt = _trained(factory, _quantizable())
    report = inspect_state_dict(_undeclared(opt.state_dict()))
    assert report.layout == layout or (layout.endswith("(") and report.layout.startswith(layout))
    assert report.optimizer is None
    assert report.bytes == leanopt.measure(opt).bytes
    assert report.param_elements == sum(p.numel() for p in model.parameters())


def test_undeclared_lion_is_not_taken_for_adamw_and_unknown_names_are_reported() -> None:
    _, opt = _trained(lambda m: leanopt.Lion(m.parameters(), backend="reference"), _quantizable())
    sd = opt.state_dict()
    assert inspect_state_dict(_undeclared(sd)).layout == "leanopt Lion"  # one momentum, betas, no eps
    newer = {**sd, "param_groups": [{**g, "optimizer": "sophia"} for g in sd["param_groups"]]}
    report = inspect_state_dict(newer)
    assert report.optimizer == "sophia" and "'sophia' (declared; not in this version's registry)" in report.layout
    mixed = {**sd, "param_groups": [{**sd["param_groups"][0], "optimizer": "adamw"}]}
    mixed["param_groups"].append({"params": [], "optimizer": "lion"})
    report = inspect_state_dict(mixed)
    assert report.optimizer is None and report.layout.startswith("leanopt, inconsistent")


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


@pytest.mark.parametrize("cls_name,bits,state_bytes", [("AdEMAMix", "32-bit", 12), ("AdEMAMix8bit", "8-bit", 3)])
def test_inspect_bitsandbytes_ademamix(cls_name: str, bits: str, state_bytes: int) -> None:
    # bitsandbytes' AdEMAMix stacks its fast and slow EMAs in one [2, *shape] state1: counted as
    # the param's size, that halved B/param (6.0 for 12), and the layout read "Adam-family, 2 states".
    bnb = pytest.importorskip("bitsandbytes")
    # 20,480 weight elements: 8-bit states (the 80-element bias keeps fp32 ones, under 4096).
    model, opt = _trained(lambda m: getattr(bnb.optim, cls_name)(m.parameters()), torch.nn.Sequential(torch.nn.Linear(256, 80)))
    n = sum(p.numel() for p in model.parameters())
    report = inspect_state_dict(opt.state_dict())
    assert report.layout == f"bitsandbytes {bits} (AdEMAMix, 3 states)", report.layout
    assert report.param_elements == n and report.bytes == leanopt.measure(opt).bytes
    # 3 states of `state_bytes` per element; 8-bit adds an fp32 absmax per 256 elements per state,
    # the two 256-entry code books bitsandbytes saves with each param, and the fp32 bias states.
    assert state_bytes <= report.bytes_per_param < 1.1 * state_bytes, report.bytes_per_param


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


# ---- a config that needs custom code: refused, its code never run ------------------------------
def test_config_with_custom_code_is_refused_without_reading_stdin(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    folder, marker = tmp_path / "model", tmp_path / "CODE_RAN"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "leanopt-test-custom", "architectures": ["CustomModel"], "hidden_size": 8,
        "auto_map": {"AutoConfig": "configuration_custom.CustomConfig", "AutoModel": "modeling_custom.CustomModel",
                     "AutoModelForCausalLM": "modeling_custom.CustomModel"},
    }))
    touch = f"import pathlib; pathlib.Path({str(marker)!r}).write_text('ran')\n"
    (folder / "configuration_custom.py").write_text(
        touch + "from transformers import PretrainedConfig\n"
        "class CustomConfig(PretrainedConfig):\n    model_type = 'leanopt-test-custom'\n"
    )
    (folder / "modeling_custom.py").write_text(touch)
    env = {**__import__("os").environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    # "y" on stdin is what transformers' trust_remote_code prompt waits for.
    proc = subprocess.run(
        [sys.executable, "-m", "leanopt", "estimate", str(folder), "--optimizers", "adamw"],
        input="y\n", capture_output=True, text=True, timeout=300, env=env,
    )
    assert not marker.exists(), "the folder's Python code ran"
    assert proc.returncode == 2 and proc.stdout == "", (proc.stdout, proc.stderr)
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("leanopt: error:") and "custom code" in err[0], proc.stderr
    assert str(folder) in err[0]


def test_auto_map_next_to_a_known_model_type_builds_the_builtin_class(tmp_path: Path, capsys) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=100, n_positions=16)
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.Custom"}  # no such file: never read
    (tmp_path / "config.json").write_text(json.dumps(raw))
    code, out, err = run(capsys, "estimate", str(tmp_path), "--json", "--optimizers", "adamw")
    assert code == 0, err
    with torch.device("meta"):
        expected = sum(p.numel() for p in transformers.GPT2LMHeadModel(config).parameters())
    assert json.loads(out)["params"] == expected


# ---- edges of the command line ------------------------------------------------------------------
@pytest.mark.parametrize(
    "text,count",
    [("1e12", 10**12), ("1.5e9", 1_500_000_000), ("2E3", 2000), ("1,234", 1234), ("1,234,567", 1_234_567),
     ("1_000_000", 10**6), ("0.5k", 500), ("1.1B", 1_100_000_000)],
)
def test_numbers_are_parameter_counts(text: str, count: int) -> None:
    assert parse_param_count(text) == count


@pytest.mark.parametrize(
    "text,words",
    [("0", ["must be > 0"]), ("0b", ["must be > 0"]), ("-5", ["must be > 0"]),
     ("1,2,3", ["1,2,3", "thousands"]), ("12,34", ["thousands"]), (",123", ["thousands"]),
     ("1.5", ["whole number"]), ("1e-3", ["whole number"]),
     ("3000000000000000000", ["too large"]), ("3e18", ["too large"]), ("1e400", ["too large"]),
     pytest.param("9" * 5000, ["too large"], id="5000-digits")],
)
def test_bad_counts_are_one_line_errors_and_never_hub_ids(
    text: str, words: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import leanopt.memory.presets as presets

    def no_hub(repo_id: str):
        raise AssertionError(f"{repo_id!r} was sent to the Hub")

    monkeypatch.setattr(presets, "_hub_config", no_hub)
    with pytest.raises(ValueError):
        parse_param_count(text)
    code, out, err = run(capsys, "estimate", text, "--optimizers", "adamw")
    assert_one_line_error(code, out, err, *words)
    assert "internal error" not in err


def test_the_largest_count_and_an_empty_name(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "estimate", "1e18", "--json", "--optimizers", "adamw,adamw8bit,adamw4bit")
    assert code == 0, err
    data = json.loads(out)
    assert data["params"] == 10**18 and data["optimizers"][0]["state_bytes"] == 8 * 10**18 + 4
    for name in ("", "   "):
        code, out, err = run(capsys, "estimate", name)
        assert_one_line_error(code, out, err, "empty")
        assert "no config.json there" not in err


def test_inspect_json_is_valid_json_with_non_finite_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, opt = _trained(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
    sd = opt.state_dict()
    sd["param_groups"][0].update(lr=float("nan"), eps=float("inf"), weight_decay=float("-inf"))
    torch.save(sd, tmp_path / "optimizer.pt")
    code, out, err = run(capsys, "inspect", str(tmp_path / "optimizer.pt"), "--json")
    assert code == 0, err

    def strict(constant: str):
        raise AssertionError(f"{constant} is not JSON")

    options = json.loads(out, parse_constant=strict)["groups"][0]["options"]
    assert (options["lr"], options["eps"], options["weight_decay"]) == ("nan", "inf", "-inf")
    code, out, _ = run(capsys, "inspect", str(tmp_path / "optimizer.pt"))  # the table shows them too
    assert code == 0 and "lr=nan" in out


@pytest.mark.parametrize(
    "argv,words",
    [(["--lr", "nan"], ["--lr", "nan"]), (["--lr", "inf"], ["--lr"]), (["--lr=-1e-3"], ["--lr"]),
     (["--lr", "0"], ["--lr"]), (["--out", "{file}/sub"], ["--out", "not a folder"]),
     (["--out", "{file}"], ["--out", "not a folder"])],
)
def test_compare_arguments_are_checked_before_training(
    argv: list[str], words: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import leanopt.compare.runner as runner

    def no_training(*args, **kwargs):
        raise AssertionError("training started")

    monkeypatch.setattr(runner, "compare", no_training)
    file = tmp_path / "a-file"
    file.write_text("x")
    argv = [a.replace("{file}", str(file)) for a in argv]
    code, out, err = run(capsys, "compare", "--quick", "--optimizers", "adamw", *argv)
    assert code == 2, (out, err)
    line = err.strip().splitlines()
    assert len(line) == 1 and line[0].startswith("leanopt compare: error:"), err
    for word in words:
        assert word in line[0], err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--version")
    assert code == 0 and out.strip() == f"leanopt {leanopt.__version__}" == "leanopt 0.1.0", err


def test_top_level_help_lists_every_subcommand_on_one_line(monkeypatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run(capsys, "--help")
    assert code == 0
    lines = out.splitlines()
    for name in ("estimate", "inspect", "convert", "compare"):
        row = next((line for line in lines if line.strip().startswith(name + " ")), None)
        assert row is not None and len(row.split(None, 1)) == 2, f"{name} has no description:\n{out}"
        following = lines[lines.index(row) + 1]
        assert not following.startswith(" " * 10), f"{name}'s description wraps:\n{out}"
    assert "--version" in out


# ---- hostile configs: bounded before building, one line for every bad value ------------------------
TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 100}


def _config(tmp_path: Path, name: str = "config.json", **values) -> Path:
    """TINY_LLAMA with ``values``; another ``model_type`` is written as given (a Llama field such
    as num_hidden_layers would be an alias of one of its own)."""
    path = tmp_path / name
    path.write_text(json.dumps(values if "model_type" in values else {**TINY_LLAMA, **values}))
    return path


@pytest.mark.parametrize(
    "values,field",
    [({"num_hidden_layers": 10**9}, "num_hidden_layers"), ({"num_hidden_layers": 10_001}, "num_hidden_layers"),
     ({"model_type": "switch_transformers", "architectures": ["SwitchTransformersForConditionalGeneration"],
       "num_layers": 2, "num_decoder_layers": 2, "d_model": 64, "d_ff": 128, "num_heads": 4, "d_kv": 16,
       "num_experts": 10**6, "num_sparse_encoder_layers": 2, "num_sparse_decoder_layers": 2}, "num_experts"),
     # 600 layers of 256 experts, each expert its own modules: 780,615 modules, counted from the
     # one- and two-layer probes and refused before the build (which would take minutes).
     ({"model_type": "switch_transformers", "architectures": ["SwitchTransformersForConditionalGeneration"],
       "num_layers": 300, "num_decoder_layers": 300, "d_model": 64, "d_ff": 128, "num_heads": 4, "d_kv": 16,
       "num_experts": 256, "num_sparse_encoder_layers": 300, "num_sparse_decoder_layers": 300}, "modules")],
    ids=["1e9-layers", "10001-layers", "1e6-experts", "780k-modules"],
)
def test_a_hostile_config_is_refused_at_once(
    values: dict, field: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 250-byte config asking for 10^9 layers (or a million experts) used to build a Python
    module per layer until the memory ran out; it is refused before anything is built."""
    pytest.importorskip("transformers")
    import signal

    config = _config(tmp_path, **values)
    assert config.stat().st_size < 512
    commands = [["estimate", str(config), "--optimizers", "adamw"]]
    if values.get("num_hidden_layers") == 10**9:  # plan reads the model the same way
        commands.append(["plan", str(config), "--batch", "1", "--seq", "8"])

    def hung(signum, frame):
        raise AssertionError("still building after 60 s")

    previous = signal.signal(signal.SIGALRM, hung)
    try:
        for command in commands:
            signal.alarm(60)  # a hang fails the test instead of the suite (the CLI turns it into one line)
            code, out, err = run(capsys, *command)
            signal.alarm(0)
            assert_one_line_error(code, out, err, field, str(config))
            assert "internal error" not in err, err
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_too_many_parameters_are_refused_before_building(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """200 layers of width 65,536: 14 T parameters, more than the 10 T bound, counted from one
    layer (the layers are alike) and refused naming the config's sizes, before the 200 are built."""
    pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama

    config = _config(tmp_path, num_hidden_layers=200, hidden_size=65536, intermediate_size=262144,
                     num_attention_heads=512, vocab_size=32000)
    layers = []
    real = modeling_llama.LlamaDecoderLayer.__init__
    monkeypatch.setattr(modeling_llama.LlamaDecoderLayer, "__init__",
                        lambda self, *args, **kwargs: layers.append(1) or real(self, *args, **kwargs))
    code, out, err = run(capsys, "estimate", str(config), "--optimizers", "adamw")
    assert_one_line_error(code, out, err, "num_hidden_layers=200", "hidden_size=65536", "parameters", str(config))
    assert "internal error" not in err
    assert len(layers) < 10, len(layers)  # the one- and two-layer probes, not the 200


def test_a_cached_hub_config_is_read_without_the_network(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """A Hub id whose config.json is in huggingface_hub's cache is estimated from it, and no host
    name is looked up on the way (without HF_HUB_OFFLINE)."""
    pytest.importorskip("transformers")
    import socket

    from huggingface_hub import constants

    snapshot = tmp_path / "models--some-org--tiny-gpt" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0123abcd")
    (snapshot / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2,
                                                      "vocab_size": 1000, "n_positions": 128}))  # fmt: skip
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    tried: list[object] = []

    def lookup(host: object, *args: object, **kwargs: object) -> None:
        tried.append(host)
        raise OSError("no network in this test")

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    code, out, err = run(capsys, "estimate", "some-org/tiny-gpt", "--json")
    assert code == 0 and tried == [], (err, tried)
    # GPT-2's embeddings (1000 + 128 positions) x 64, two blocks of 12 x 64^2 + 13 x 64, the final norm
    assert json.loads(out)["params"] == 1128 * 64 + 2 * (12 * 64 * 64 + 13 * 64) + 2 * 64


def test_a_llama_3_405b_config_builds_exactly_and_fast(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The largest real dense config passes the bounds: 126 layers of width 16,384 built on meta
    (0.3-0.5 s here; 1.6 TB of fp32 weights if anything were allocated), every parameter counted."""
    pytest.importorskip("transformers")
    config = _config(tmp_path, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                     num_attention_heads=128, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                     tie_word_embeddings=False)
    resolve_model(str(_config(tmp_path, "warm.json")))  # transformers' lazy imports, once
    source = resolve_model(str(config))
    assert (source.param_count, source.tensors) == (405_853_388_800, 1137)


@pytest.mark.parametrize(
    "values,argv,words",
    [({"num_attention_heads": 0}, [], ["num_attention_heads", "0"]),
     ({"num_key_value_heads": 0}, [], ["num_key_value_heads"]),
     ({"hidden_size": -64}, [], ["hidden_size", "-64"]),
     ({"hidden_size": 64.5}, [], ["hidden_size", "64.5"]),
     ({"hidden_size": True}, [], ["hidden_size"]),
     ({"vocab_size": "100"}, [], ["vocab_size"]),
     ({"rms_norm_eps": "small"}, [], ["rms_norm_eps"]),
     ({"text_config": {"num_hidden_layers": -1}}, [], ["text_config.num_hidden_layers"]),
     ({}, ["plan", "--batch", "1", "--seq", "8", "--budget", "9" * 400], ["--budget", "too large"])],
    ids=["heads-0", "kv-heads-0", "width-negative", "width-fraction", "width-bool", "vocab-string", "eps-string",
         "nested-layers-negative", "budget-400-digits"],
)
def test_bad_config_values_and_sizes_are_one_line(
    values: dict, argv: list[str], words: list[str], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Exit 2 and exactly one line on stderr, no traceback, no "internal error"; a config's bad
    value is named with its field and file."""
    pytest.importorskip("transformers")
    config = _config(tmp_path, **values)
    command = [argv[0], str(config), *argv[1:]] if argv else ["estimate", str(config), "--optimizers", "adamw"]
    code = main(command)
    out, err = capfd.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and out == "", (code, out[-500:])
    assert len(lines) == 1 and lines[0].startswith("leanopt: error: "), err[-3000:]
    assert "Traceback" not in err and "internal error" not in err, err
    for word in words:
        assert word in lines[0], lines[0]
    if values and not argv:
        assert str(config) in lines[0], lines[0]


def test_a_sequence_too_long_to_trace_is_one_line_without_torchs_log(tmp_path: Path) -> None:
    """Eager attention at seq 10^9: the seq x seq scores overflow a meta kernel, which torch's
    fake-tensor mode logs with its traceback (24 lines) before plan's one-line error. Run as a
    user runs it: torch's log handler writes to the process's stderr, which pytest cannot see."""
    pytest.importorskip("transformers")
    config = _config(tmp_path, attn_implementation="eager")
    proc = subprocess.run(
        [sys.executable, "-m", "leanopt", "plan", str(config), "--batch", "1", "--seq", "1000000000",
         "--optimizers", "adamw", "--precisions", "fp32", "--grad-release", "off"],
        capture_output=True, text=True, timeout=300,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout[-500:]
    assert len(lines) == 1 and lines[0].startswith("leanopt: error: ") and "seq 1000000000" in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr


def test_the_one_and_two_layer_probe_counts_every_preset_exactly() -> None:
    """What the bound on parameters reads before building: from one- and two-layer models, the
    count of the whole one, for every preset's architecture (T5's first layer differs: still exact)."""
    transformers = pytest.importorskip("transformers")
    import leanopt.memory.presets as presets

    for name, preset in PRESETS.items():
        config = getattr(transformers, preset.config_class)(**preset.config)
        cls = getattr(transformers, preset.model_class)
        params, modules = presets._probe(cls, config)
        model = presets._guarded_build(cls, config)
        assert (params, modules) == (preset.params, sum(1 for _ in model.modules())), name


@pytest.mark.slow  # 820 config classes built: ~6-11 s
def test_no_config_class_of_transformers_is_refused_by_the_value_checks() -> None:
    """The checks refuse only what no real model has: every config class of transformers, with
    its defaults (820 of them here; per-stage lists, head_dim 0, a whole 1200.0 included), passes."""
    pytest.importorskip("transformers")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    import leanopt.memory.presets as presets

    checked = 0
    for model_type in list(CONFIG_MAPPING.keys()):
        try:
            values = CONFIG_MAPPING[model_type]().to_dict()
        except Exception:  # a config class that needs arguments (or an extra) to exist at all
            continue
        presets._check_config_values(values, model_type)
        checked += 1
    assert checked > 500
