"""The README and the pages its examples moved to run: their python blocks execute (and print
what their comments say), their ``leanopt`` examples print what they show, and the figures
they state are the library's."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from leanopt.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"
DOCS = README.parent / "docs"
# Pages whose python blocks run, each top to bottom in a namespace of its own, as a reader would.
RUNNABLE = [README, DOCS / "optimizers.md", DOCS / "memory.md"]
FIRST_COMMANDS = [
    "bash scripts/install.sh && leanopt estimate distilbert-base-cased",
    "bash scripts/install.sh --test && python3 -m pytest -q -n 2 --dist loadfile --durations=25",
]


def fenced(lang: str, page: Path = README) -> list[str]:
    text = page.read_text()
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


def console_examples(page: Path) -> list[tuple[str, list[str]]]:
    examples: list[tuple[str, list[str]]] = []
    for block in fenced("console", page):
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


@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: p.name)
def test_readme_examples(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)  # the examples write optimizer.pt
    monkeypatch.setenv("COLUMNS", "100")  # the width the outputs are shown at (scripts/refresh_docs_outputs.py)
    namespace: dict = {"__name__": "__readme__"}
    blocks = fenced("python", page)
    assert blocks
    for i, code in enumerate(blocks):
        exec(compile(code, f"{page.name} python block {i + 1}", "exec"), namespace)
        printed = capsys.readouterr().out.splitlines()
        for line in expected_prints(code):
            assert line in printed, f"{page.name} block {i + 1} says {line!r}, printed:\n" + "\n".join(printed)

    for command, expected in console_examples(page):
        argv = shlex.split(command)
        assert argv[0] == "leanopt"
        code = main(argv[1:])
        out, err = capsys.readouterr()
        assert code == 0, f"{command}: {err}"
        # the whole output, as shown (tests/test_docs_outputs.py runs the same blocks as commands)
        assert [line.rstrip() for line in out.splitlines()] == expected, f"{command} prints:\n{out}"


def test_the_seed_figures_are_shown() -> None:
    examples = [e for page in RUNNABLE for e in console_examples(page)]
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
    text = "\n".join(page.read_text() for page in RUNNABLE)
    code = "\n".join(block for page in RUNNABLE for block in fenced("python", page))
    imported = {m.group(1).lower() for m in re.finditer(r"^\s*(?:from|import)\s+(\w+)", code, re.M)}
    assert imported - installed == set(), f"README imports {imported - installed}, which the main install lacks"
    # The README sends Trainer users to Trainer(optimizers=...); transformers' Trainer needs accelerate.
    if "Trainer(" in text:
        assert {"transformers", "accelerate"} <= installed, installed


def test_readme_documents_compute_optimizer_size_next_to_measure() -> None:
    blocks = fenced("python", DOCS / "memory.md")
    assert any("leanopt.compute_optimizer_size(" in b and "leanopt.measure(" in b for b in blocks), (
        "docs/memory.md: compute_optimizer_size needs a runnable example next to measure"
    )


def test_the_first_screen_answers_the_question_in_three_calls() -> None:
    """What a newcomer reads first: what leanopt is, then estimate, the swap and compare, before
    any other section; the rest is in docs/."""
    text = README.read_text()
    sections = re.findall(r"^## (.+)$", text, re.M)
    assert sections[0] == "AdamW, Adafactor or 8-bit Adam?", sections
    first = text[text.index("## AdamW, Adafactor or 8-bit Adam?"):text.index("\n## ", text.index("## AdamW, Adafactor"))]
    order = [first.index(call) for call in ("leanopt.estimate(", "leanopt.AdamW8bit(", "leanopt compare --task minilm --quick")]
    assert order == sorted(order), order
    assert len(text.splitlines()) < 160, "the README is a first screen and links, not the manual"


def _shown_per_param(page: Path) -> dict[str, list[str]]:
    """docs/optimizers.md's table: registry name -> the B/param figures its row states."""
    rows = {}
    for line in page.read_text().splitlines():
        cells_ = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells_) == 4 and cells_[0].startswith("`") and re.match(r"^[\d.]", cells_[2]):
            names = re.findall(r"`([a-z0-9]+)`", cells_[0])
            figures = re.findall(r"\d+\.\d+", cells_[2])
            for i, name in enumerate(names):
                rows[name] = figures[i:i + 1] if len(names) > 1 else figures
    return rows


def test_the_state_figures_shown_are_estimates() -> None:
    """One figure per optimizer, the one `leanopt estimate distilbert-base-cased` prints (Adafactor's
    was ~0.01 in one place and ~0.02 in another; SGD8bit's 1.02 in the table and 0.00 in estimate,
    without saying it assumed no momentum)."""
    pytest.importorskip("transformers")
    import torch

    import leanopt
    from leanopt.cli import WITH_MOMENTUM, _per_param
    from leanopt.optim.registry import REGISTRY

    with torch.device("meta"):
        from transformers import DistilBertConfig, DistilBertForSequenceClassification

        distilbert = DistilBertForSequenceClassification(DistilBertConfig(vocab_size=28996))
    shown = _shown_per_param(DOCS / "optimizers.md")
    builtin = [n for n, c in REGISTRY.items() if c.__module__.startswith("leanopt.optim.")]
    assert sorted(shown) == sorted(builtin), shown
    for name, figures in shown.items():
        expected = [_per_param(leanopt.estimate(distilbert, name).bytes_per_param)]
        if len(figures) == 2:  # the default keeps no state; the second figure is with a momentum
            expected.append(_per_param(leanopt.estimate(distilbert, name, momentum=WITH_MOMENTUM).bytes_per_param))
        assert figures == expected, (name, figures, expected)
    adafactor = _per_param(leanopt.estimate(distilbert, "adafactor").bytes_per_param)
    for page in (README, DOCS / "optimizers.md"):
        for said in re.findall(r"Adafactor[^.]*?(~?\d+\.\d+) B/param", page.read_text()):
            assert said == adafactor, (page.name, said)
