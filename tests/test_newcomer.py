"""What a newcomer meets first: a mistyped model name is answered with the nearest presets at
once, before any network; a value that starts with '-' reaches its own check; a mistake on the
command line is answered before torch is imported, and `import leanopt` imports neither torch
nor, once an optimizer is used, torch's compiler."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from leanopt.memory import presets

pytest.importorskip("transformers")


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    asked: list[str] = []

    def unreachable(timeout: float = presets.HUB_TIMEOUT_S) -> str:
        asked.append("hub")
        return "ConnectError (test)"

    monkeypatch.setattr(presets, "hub_unreachable", unreachable)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return asked


@pytest.mark.parametrize(
    ("typed", "meant"),
    [("distilbert", "distilbert-base-cased"), ("llama-7b", "llama-2-7b"), ("Roberta", "roberta-base"), ("tinylama", "tinyllama-1.1b")],
)
def test_a_name_near_a_preset_suggests_it_without_the_network(no_network: list[str], typed: str, meant: str) -> None:
    with pytest.raises(ValueError) as err:
        presets.resolve_model(typed)
    message = str(err.value)
    assert f"{typed!r} is not a preset: did you mean " in message and meant in message.split("?")[0], message
    assert "\n" not in message and "organisation/name" in message
    assert all(name in message for name in presets.PRESETS)  # the list
    assert no_network == []  # answered before any request


def test_names_far_from_every_preset_and_full_hub_ids_still_ask_the_hub(no_network: list[str]) -> None:
    assert presets.nearest_presets("zzzz-qqqq") == []
    for spec in ("zzzz-qqqq", "some-org/distilbert"):
        with pytest.raises(ValueError, match="cannot be reached"):
            presets.resolve_model(spec)
    assert no_network == ["hub", "hub"]


def test_every_preset_alias_still_resolves_to_itself() -> None:
    for alias, preset in presets._PRESET_INDEX.items():
        if "/" not in alias:
            assert presets.nearest_presets(alias)[0] == preset


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["plan", "gpt2", "--batch", "1", "--seq", "8", "--budget", "-1GiB"], "budget '-1GiB': expected a size"),
        (["plan", "gpt2", "--batch", "-1", "--seq", "8"], "--batch: must be a whole number >= 1, got -1"),
    ],
)
def test_a_value_starting_with_a_dash_reaches_its_own_check(capsys: pytest.CaptureFixture[str], argv: list[str], says: str) -> None:
    from leanopt.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0] and "expected one argument" not in err[0], err


def test_an_option_after_an_option_is_still_an_option(capsys: pytest.CaptureFixture[str]) -> None:
    from leanopt.cli import main

    assert main(["plan", "gpt2", "--batch", "--json"]) == 2
    assert "argument --batch: expected one argument" in capsys.readouterr().err


# Runs the command as `python -m leanopt ARGS` does, then says whether torch was imported.
_COMMAND = """
import json, runpy, sys
sys.argv = ["leanopt", *json.loads(sys.argv[1])]
try:
    runpy.run_module("leanopt", run_name="__main__", alter_sys=True)
except SystemExit as done:
    code = done.code
print(json.dumps({"code": code, "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))[:3]}))
"""


def _command(argv: list[str], cwd: Path) -> tuple[dict, str]:
    out = subprocess.run([sys.executable, "-c", _COMMAND, json.dumps(argv)], capture_output=True, text=True, cwd=cwd,
                         timeout=300, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["inspect", "missing.pt"], "missing.pt: no such file"),
        (["inspect", "empty"], "empty: a folder without optimizer.pt"),
        (["convert", "missing.pt", "out.pt", "--to", "adamw8bit"], "missing.pt: no such file"),
        (["convert", "{file}", "no/such/folder/out.pt", "--to", "adamw8bit"], "no such folder"),
        (["convert", "{file}", "{file}", "--to", "adamw8bit"], "exists (use --force to overwrite)"),
        (["convert", "{file}", "out.pt", "--to", "adamw9bit"], "invalid choice: 'adamw9bit'"),
        (["estimate", "distilbert-base-cassed"], "did you mean distilbert-base-cased"),
        (["estimate", "./no-such-config.json"], "no such file or folder"),
        (["estimate", "empty"], "empty: no config.json there"),
        (["estimate", "1,2,3"], "not a parameter count"),
        (["estimate", "gpt2", "--optimizers", "adamw,adamx"], "unknown optimizer 'adamx'"),
        (["estimate"], "the following arguments are required: model"),
        (["plan", "gpt2", "--batch", "0", "--seq", "8"], "--batch: must be a whole number >= 1, got 0"),
        (["plan", "7b", "--batch", "1", "--seq", "8"], "a bare parameter count"),
        (["plan", "gpt2", "--seq", "8"], "required: --batch"),
        (["doctor", "gpt2", "--batch", "1", "--seq", "8", "--optimizer", "adam"], "unknown optimizer 'adam'"),
        (["doctor", "gpt2", "--batch", "1", "--seq", "8", "--rounding", "up"], "invalid choice: 'up'"),
        (["compare", "--lr", "-1"], "the learning rate must be a finite number > 0"),
        (["compare", "--steps", "0"], "--steps 0: must be at least 1"),
        (["compare", "--task", "minlm"], "unknown task 'minlm'"),
        (["compare", "--optimizers", "adamw,adamx"], "unknown optimizer 'adamx'"),
        (["compare", "--optimizers", "adamw+bf16-kahn"], "unknown training mode 'bf16-kahn' in 'adamw+bf16-kahn'"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_a_mistake_is_answered_before_torch_is_imported(tmp_path: Path, argv: list[str], says: str) -> None:
    file = tmp_path / "optimizer.pt"
    file.write_bytes(b"not read: the mistake is elsewhere")
    (tmp_path / "empty").mkdir()
    got, err = _command([a.replace("{file}", str(file)) for a in argv], tmp_path)
    lines = err.strip().splitlines()
    assert got["code"] == 2 and len(lines) == 1 and says in lines[0], (got, err)
    assert got["torch"] == [], f"{argv}: torch was imported before the mistake was answered: {got['torch']}"


def test_help_names_the_planners_defaults_and_the_version_needs_no_torch(tmp_path: Path) -> None:
    from leanopt.memory.plan import DEFAULT_OPTIMIZERS

    got, _ = _command(["--version"], tmp_path)
    assert got == {"code": 0, "torch": []}
    out = subprocess.run([sys.executable, "-m", "leanopt", "plan", "--help"], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "COLUMNS": "400"})  # fmt: skip
    assert f"(default: {','.join(DEFAULT_OPTIMIZERS)})" in out.stdout, out.stdout


_IMPORTS = """
import json, sys
import leanopt
bare = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))[:3]
leanopt.AdamW, leanopt.estimate
print(json.dumps({"bare": bare, "dynamo": "torch._dynamo" in sys.modules, "inductor": "torch._inductor" in sys.modules}))
"""


def test_import_leanopt_imports_no_torch_and_its_optimizers_no_compiler() -> None:
    out = subprocess.run([sys.executable, "-c", _IMPORTS], capture_output=True, text=True, timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"bare": [], "dynamo": False, "inductor": False}, got


def test_the_names_checked_before_torch_are_the_registry() -> None:
    from leanopt.catalog import BUILTIN_OPTIMIZERS, ROUNDINGS
    from leanopt.memory.plan import ROUNDINGS as PLAN_ROUNDINGS
    from leanopt.optim.registry import REGISTRY

    # The catalog line of each optimizer (its name, family and class) is what its module registers;
    # leanopt exports the classes the catalog names, each the registered class.
    builtin = {name: (cls.family, cls.__name__) for name, cls in REGISTRY.items() if cls.__module__.startswith("leanopt.optim.")}
    assert list(BUILTIN_OPTIMIZERS.items()) == list(builtin.items())
    import leanopt

    assert all(getattr(leanopt, cls.__name__) is cls and cls.__name__ in leanopt.__all__ for cls in REGISTRY.values()
               if cls.__module__.startswith("leanopt.optim."))  # fmt: skip
    assert sorted(ROUNDINGS) == sorted(PLAN_ROUNDINGS)
    from leanopt.catalog import PEER_NAMES
    from leanopt.compare.contenders import CONTENDERS
    from leanopt.compare.protocol import PEER_CONTENDERS, TASK_NAMES
    from leanopt.compare.tasks import BUILTIN_TASKS, TASK_ALIASES

    assert TASK_NAMES == (*BUILTIN_TASKS, *TASK_ALIASES)
    assert set(PEER_CONTENDERS) == {n for n, c in CONTENDERS.items() if c.origin != "leanopt"} - set(PEER_NAMES)


def test_adafactor_with_an_lr_names_the_fix() -> None:
    """transformers' message said what is wrong, not what to write instead."""
    import torch

    import leanopt

    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"Cannot combine manual `lr` and `relative_step=True` options: pass relative_step=False"):
        leanopt.Adafactor([p], lr=1e-3)
    leanopt.Adafactor([p], lr=1e-3, relative_step=False)  # the fix it names


def test_measure_prints_a_unit_that_shows_the_size() -> None:
    """`measure` printed "42,064 bytes (0 MB)"."""
    import torch

    import leanopt

    model = torch.nn.Linear(64, 80)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    text = str(leanopt.measure(optimizer))
    assert text.startswith("41,608 bytes (40.6 KiB), 10,402 elements [step: 8 B, exp_avg: 20.3 KiB"), text
    assert str(leanopt.estimate(model, "adamw")).startswith("adamw: 41,608 bytes (40.6 KiB) for 5,200 params")
    big = leanopt.estimate([torch.empty(2**22, device="meta")], "adamw")
    assert "(32 MB)" in str(big)  # MB = MiB from 1 MiB on, as the lesson writes 502 MB


def test_estimate_says_what_a_stateless_default_assumes(capsys: pytest.CaptureFixture[str]) -> None:
    """`sgd8bit` showed 0.00 B/param in `estimate` (momentum=0, unsaid) and 1.02 in the README."""
    import json

    import leanopt
    from leanopt.cli import main

    assert main(["estimate", "125m", "--optimizers", "sgd8bit,adamw", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["optimizers"]}
    assert rows["sgd8bit"]["state_bytes"] == 0 and rows["adamw"]["with_momentum"] is None
    import torch

    expected = leanopt.estimate([torch.empty(125_000_000, device="meta")], "sgd8bit", momentum=0.9)
    assert rows["sgd8bit"]["with_momentum"] == {"momentum": 0.9, "state_bytes": expected.bytes,
                                                "bytes_per_param": round(expected.bytes_per_param, 6)}
    assert main(["estimate", "125m", "--optimizers", "sgd8bit,adamw"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert " sgd8bit (m=0) │" in out and "(m=0): momentum=0, SGD's default as torch's, keeps no state; with momentum=0.9: sgd8bit 1.02 B/param" in out
