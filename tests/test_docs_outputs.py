"""The outputs README.md and docs/*.md show are what the commands print now: each marked block
(scripts/refresh_docs_outputs.py says how to mark one and regenerates them) is run and compared,
but those marked slow (more than ~10 s: each says why), which are listed as skipped."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

import leanopt

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("refresh_docs_outputs", ROOT / "scripts" / "refresh_docs_outputs.py")
refresh_docs_outputs = importlib.util.module_from_spec(_spec)
sys.modules["refresh_docs_outputs"] = refresh_docs_outputs  # its dataclass resolves its module
_spec.loader.exec_module(refresh_docs_outputs)  # type: ignore[union-attr]

BLOCKS = [shown for path in refresh_docs_outputs.documents() for shown in refresh_docs_outputs.marked(path)]


@pytest.mark.parametrize("shown", BLOCKS, ids=lambda s: f"{s.where} {s.command}")
def test_shown_output_is_printed_now(shown) -> None:
    if shown.slow:
        pytest.skip(f"marked slow: {shown.slow} (python scripts/refresh_docs_outputs.py runs it)")
    pytest.importorskip("transformers")  # the presets build their models with it
    assert refresh_docs_outputs.run(shown) == shown.shown, (
        f"{shown.where}: `{shown.command}` prints something else now: python scripts/refresh_docs_outputs.py"
    )


def test_readme_outputs_are_all_marked() -> None:
    """Every block of the README, and of the pages its examples moved to, that shows a leanopt
    command's output is checked (or marked slow)."""
    pages = [ROOT / "README.md", ROOT / "docs" / "memory.md", ROOT / "docs" / "optimizers.md"]
    shown = [m for page in pages for m in re.finditer(r"^```console\n\$ leanopt ", page.read_text(), re.M)]
    marked = [s for page in pages for s in refresh_docs_outputs.marked(page)]
    assert len(shown) == len(marked) >= 3
    assert any(not s.slow for s in marked)
    assert {s.command for s in marked} >= {"leanopt estimate distilbert-base-cased", "leanopt inspect optimizer.pt"}


def test_refresh_rewrites_a_drifted_block(tmp_path: Path) -> None:
    """A block that no longer matches is found (--check's test) and rewritten with the output."""
    doc = tmp_path / "doc.md"
    # The command runs three times (a fresh process each): the quickest one that prints (the
    # blocks of docs/ are each run by test_shown_output_is_printed_now).
    command = "leanopt --version"
    doc.write_text(f"Text.\n\n<!-- output: {command} -->\n```console\n$ {command}\n 12 rows, once\n```\n\nMore text.\n")
    (stale,) = refresh_docs_outputs.marked(doc)
    now = refresh_docs_outputs.run(stale)
    assert now != stale.shown and f"leanopt {leanopt.__version__}" in now
    assert refresh_docs_outputs.refresh(doc) == [f"{doc}:5"]
    (fresh,) = refresh_docs_outputs.marked(doc)
    assert fresh.shown == now and doc.read_text().endswith("```\n\nMore text.\n")
    assert refresh_docs_outputs.refresh(doc) == []  # nothing left to change


def test_marker_errors_name_the_line(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- output: leanopt --version -->\n```console\n$ leanopt --help\n```\n")
    with pytest.raises(ValueError, match=r"doc.md:1: the block after the marker must start with '\$ leanopt --version'"):
        refresh_docs_outputs.marked(doc)
    doc.write_text("<!-- output (fast): leanopt --version -->\n```console\n$ leanopt --version\n```\n")
    with pytest.raises(ValueError, match="unknown marker option 'fast'"):
        refresh_docs_outputs.marked(doc)
