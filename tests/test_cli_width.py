"""Every table the commands print fits the terminal: at 80 columns and at 120, no line is longer
than the width, no cell is cut (no ``…``), and every optimizer's name appears whole; at 200
columns each table is printed whole, as before (leanopt.tables)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from rich.table import Table

from leanopt import tables
from leanopt.cli import main
from leanopt.compare.report import print_table as print_compare_table
from registry import OPTIMIZERS

NAMES = [case.name for case in OPTIMIZERS]
REPORTS = sorted(Path(__file__).parent.parent.glob("docs/report*/results.json"))
WIDTHS = (80, 120)


def check(out: str, width: int, names: list[str]) -> None:
    lines = out.splitlines()
    too_long = [line for line in lines if len(line) > width]
    assert not too_long, f"{len(too_long)} lines over {width} columns, e.g. {too_long[0]!r}"
    assert "…" not in out, next(line for line in lines if "…" in line)
    for name in names:
        assert re.search(rf"(?<![\w+-]){re.escape(name)}(?![\w+-])", out), f"{name} is not whole in:\n{out}"


def cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, width: int, *argv: str) -> str:
    monkeypatch.setenv("COLUMNS", str(width))
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


@pytest.mark.parametrize("width", WIDTHS)
def test_estimate(width: int, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    out = cli(capsys, monkeypatch, width, "estimate", "distilbert-base-cased", "--optimizers", ",".join([*NAMES, "torch-adamw"]))
    check(out, width, [*NAMES, "torch-adamw"])
    assert "training MB by mode, with grad release" in out and "bf16-stochastic" in out
    # a row per optimizer in each table (three or more), its figures on the name's line
    lines = out.splitlines()
    tables_printed = sum(line.lstrip().startswith("optimizer ") for line in lines)
    assert tables_printed >= 3 and sum(line.lstrip().startswith("adamw8bit ") for line in lines) == tables_printed


@pytest.mark.parametrize("width", WIDTHS)
def test_estimate_bare_count(width: int, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    out = cli(capsys, monkeypatch, width, "estimate", "7b")
    check(out, width, [*NAMES, "torch-adamw"])


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("tiny-gpt2")
    transformers.GPT2Config(vocab_size=2000, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=0,
                            eos_token_id=0).to_json_file(folder / "config.json")  # fmt: skip
    return folder


# The plan's rows do not depend on the console's width: made once (every optimizer traced, ~5 s on
# 2 cores) and rendered at each width.
_PLANNED: dict[str, object] = {}


@pytest.mark.parametrize("width", WIDTHS)
def test_plan(width: int, tiny_config: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import leanopt.memory.plan as plan_module

    real = plan_module.plan

    def planned_once(*args: object, **kwargs: object) -> object:
        if "rows" not in _PLANNED:
            _PLANNED["rows"] = real(*args, **kwargs)
        return _PLANNED["rows"]

    monkeypatch.setattr(plan_module, "plan", planned_once)
    # bf16 stochastic is the widest precision label; the budget adds the verdict column
    out = cli(capsys, monkeypatch, width, "plan", str(tiny_config), "--batch", "2", "--seq", "16", "--optimizers",
              ",".join(NAMES), "--precisions", "bf16", "--roundings", "stochastic", "--grad-release", "off",
              "--budget", "20MiB", "--no-process")  # fmt: skip
    check(out, width, NAMES)
    assert "bf16 stochastic" in out and "✔" in out and "recommended:" in out


@pytest.fixture(scope="module")
def saved_states(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("states")
    files = {}
    for case in OPTIMIZERS:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Linear(64, 4))
        opt = case.cls(case.param_groups(model), **case.kwargs)
        model(torch.randn(8, 128)).square().mean().backward()
        opt.step()
        files[case.name] = folder / f"{case.name}.pt"
        torch.save(opt.state_dict(), files[case.name])
    return files


@pytest.mark.parametrize("width", WIDTHS)
def test_inspect(width: int, saved_states: dict[str, Path], capsys: pytest.CaptureFixture[str],
                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    for name, path in saved_states.items():
        out = cli(capsys, monkeypatch, width, "inspect", str(path))
        check(out, width, [name])
        assert "state key" in out and "options" in out


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("report", REPORTS, ids=lambda p: p.parent.name)
def test_compare_table(width: int, report: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The table of a real comparison (the docs' results.json), through compare's console."""
    data = json.loads(report.read_text())
    monkeypatch.setenv("COLUMNS", str(width))
    console = tables.console(highlight=False, pipe_width=150, record=True)
    print_compare_table(data, console)
    out = console.export_text()
    check(out, width, [r["optimizer"] for r in data["results"] if r["status"] == "ok"])


@pytest.mark.parametrize("width", (80, 120, 130))
@pytest.mark.parametrize("report", REPORTS, ids=lambda p: p.parent.name)
def test_compare_rows_take_two_lines_at_most(width: int, report: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row of the compare table is one line, or two where a cell of words wraps: stacked tables
    rather than a row over five lines (what 130 columns gave)."""
    data = json.loads(report.read_text())
    monkeypatch.setenv("COLUMNS", str(width))
    console = tables.console(highlight=False, pipe_width=150, record=True)
    print_compare_table(data, console)
    rows = []  # lines per row: a row starts where the first cell (the rank) is not blank
    for line in console.export_text().splitlines():
        if "│" not in line:
            continue
        if line.split("│")[0].strip():
            rows.append(1)
        elif rows:
            rows[-1] += 1
    assert rows and max(rows) <= 2, f"a row over {max(rows)} lines at {width} columns"


def test_whole_where_it_fits(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """At 200 columns the tables are as wide as their cells: one header per table, no stacking."""
    pytest.importorskip("transformers")
    out = cli(capsys, monkeypatch, 200, "estimate", "distilbert-base-cased")
    assert "(continued)" not in out
    assert sum(line.lstrip().startswith("optimizer ") for line in out.splitlines()) >= 3
    assert sum(line.lstrip().startswith("adamw8bit ") for line in out.splitlines()) == sum(
        line.lstrip().startswith("optimizer ") for line in out.splitlines())  # fmt: skip


def test_stacking_keeps_every_cell() -> None:
    """A table too wide is printed as tables led by the key column, each within the width; the
    cells are all there, in order; a folding column wraps at its spaces, never inside a word."""
    table = tables.new_table("wide")
    table.add_column("name")
    for i in range(9):
        table.add_column(f"column {i}", justify="right")
    table.add_column("notes", overflow="fold")
    rows = [[f"row{r}", *(f"{r}.{i}" for i in range(9)), "several short words here"] for r in range(3)]
    for row in rows:
        table.add_row(*row)
    console = tables.console(width=50, record=True)
    tables.print_table(console, table)
    out = console.export_text()
    check(out, 50, ["row0", "row1", "row2"])
    assert out.count("wide (continued)") >= 2 and out.count("name ") == out.count("wide")
    for row in rows:
        lines = [line for line in out.splitlines() if line.lstrip().startswith(row[0] + " ")]
        cells = [c.strip() for line in lines for c in line.split("│")[1:]]
        assert [c for c in cells if c][: len(row) - 2] == row[1:-1]  # the figures, in order
    assert "several" in out and "words" in out  # whole words, wrapped or not
    whole = tables.console(width=300, record=True)
    tables.print_table(whole, table)
    assert "(continued)" not in whole.export_text()


def test_console_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """$COLUMNS sets a pipe's width; without it a pipe is PIPE_WIDTH (or the caller's) wide."""
    monkeypatch.setenv("COLUMNS", "80")
    assert tables.console().width == 80
    monkeypatch.delenv("COLUMNS")
    assert tables.console().width == tables.PIPE_WIDTH and tables.console(pipe_width=150).width == 150


def test_table_width_is_rich_width() -> None:
    """table_width, which the stacking relies on, is the width rich renders a new_table at."""
    table: Table = tables.new_table()
    for header in ("a", "bbbb", "cc"):
        table.add_column(header, no_wrap=True)
    table.add_row("xxxxxxx", "y", "zzz")
    console = tables.console(width=200, record=True)
    console.print(table)
    assert max(len(line) for line in console.export_text().splitlines()) == tables.table_width([7, 4, 3])
