"""The README runs: its python blocks execute (and print what their comments say), and its
``leanopt`` examples print what the README shows."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from leanopt.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"
FIRST_COMMANDS = [
    "bash scripts/install.sh && leanopt estimate distilbert-base-cased",
    "bash scripts/install.sh --test && python3 -m pytest -q -n 2 --dist loadfile --durations=25",
]


def fenced(lang: str) -> list[str]:
    text = README.read_text()
    return [m.group(2) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M) if m.group(1) == lang]


def expected_prints(code: str) -> list[str]:
    """Comment lines right after a ``print(`` line (or after such comments): the output shown."""
    out, after_print = [], False
    for line in code.splitlines():
        stripped = line.strip()
        if stripped.startswith("# ") and after_print:
            out.append(stripped[2:])
        else:
            after_print = "print(" in stripped
    return out


def console_examples() -> list[tuple[str, list[str]]]:
    examples: list[tuple[str, list[str]]] = []
    for block in fenced("console"):
        for line in block.splitlines():
            if line.startswith("$ "):
                examples.append((line[2:], []))
            elif examples:
                examples[-1][1].append(line.rstrip())
    return examples


def cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"[│┃]", line)]


def test_readme_starts_with_the_two_commands() -> None:
    first_block = re.search(r"^```(\w*)\n(.*?)^```", README.read_text(), re.S | re.M)
    assert first_block is not None
    assert first_block.group(2).strip().splitlines() == FIRST_COMMANDS
    before = README.read_text()[: first_block.start()].strip().splitlines()
    assert all(line.startswith("#") for line in before)  # only the title comes first


def test_ci_runs_the_readme_test_command() -> None:
    ci = (README.parent / ".ci" / "run").read_text()
    assert FIRST_COMMANDS[1] in ci


def test_readme_examples(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)  # the examples write optimizer.pt
    monkeypatch.setenv("COLUMNS", "100")  # the width README's outputs are shown at (scripts/refresh_docs_outputs.py)
    namespace: dict = {"__name__": "__readme__"}
    blocks = fenced("python")
    assert blocks
    for i, code in enumerate(blocks):
        exec(compile(code, f"README.md python block {i + 1}", "exec"), namespace)
        printed = capsys.readouterr().out.splitlines()
        for line in expected_prints(code):
            assert line in printed, f"block {i + 1}: README says {line!r}, printed:\n" + "\n".join(printed)

    examples = console_examples()
    assert any(cmd.startswith("leanopt estimate distilbert-base-cased") for cmd, _ in examples)
    for command, expected in examples:
        argv = shlex.split(command)
        assert argv[0] == "leanopt"
        code = main(argv[1:])
        out, err = capsys.readouterr()
        assert code == 0, f"{command}: {err}"
        # the whole output, as shown (tests/test_docs_outputs.py runs the same blocks as commands)
        assert [line.rstrip() for line in out.splitlines()] == expected, f"{command} prints:\n{out}"

    seed = next(out for cmd, out in examples if cmd == "leanopt estimate distilbert-base-cased")
    assert "65,783,042 trainable parameters in 104 tensors" in seed
    assert any(line.strip().startswith("adamw ") and cells(line)[2] == "502" for line in seed)


def _main_install_requirements() -> tuple[list[str], list[str]]:
    """(base dependencies, the extras' requirements) that `bash scripts/install.sh` installs."""
    import tomllib

    project = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]
    script = (README.parent / "scripts" / "install.sh").read_text()
    default = re.search(r'^extras="\[([\w,]+)\]"', script, re.M)
    assert default is not None, "install.sh no longer names its default extras"
    extras = project["optional-dependencies"]
    return project["dependencies"], [r for name in default.group(1).split(",") for r in extras[name]]


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_main_install_runs_every_readme_example() -> None:
    base, extra = _main_install_requirements()
    assert _names(base) == {"torch", "rich"}  # the runtime stays small
    installed = _names(base) | _names(extra) | {"leanopt"}
    assert "ninja" in installed  # torch.utils.cpp_extension builds the native CPU kernel with it
    text = README.read_text()
    imported = {m.group(1).lower() for m in re.finditer(r"^\s*(?:from|import)\s+(\w+)", "\n".join(fenced("python")), re.M)}
    assert imported - installed == set(), f"README imports {imported - installed}, which the main install lacks"
    # The README sends Trainer users to Trainer(optimizers=...); transformers' Trainer needs accelerate.
    if "Trainer(" in text:
        assert {"transformers", "accelerate"} <= installed, installed


def test_readme_documents_compute_optimizer_size_next_to_measure() -> None:
    blocks = fenced("python")
    assert any("leanopt.compute_optimizer_size(" in b and "leanopt.measure(" in b for b in blocks), (
        "README: compute_optimizer_size needs a runnable example next to measure"
    )
