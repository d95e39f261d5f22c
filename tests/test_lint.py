"""The linters' settings (pyproject.toml [tool.ruff], [tool.mypy]) hold on the tree: `ruff check .`
on everything, and `mypy src` clean on every file."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_ERROR = re.compile(r"^(?P<path>[^:\s]+\.py):\d+(?::\d+)?: error: ", re.MULTILINE)


def test_ruff_check_passes_on_the_tree() -> None:
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.importorskip("ruff")  # the test extras install it; without them, say so
        ruff_cmd = [sys.executable, "-m", "ruff"]
    else:
        ruff_cmd = [ruff]
    out = subprocess.run([*ruff_cmd, "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-1000:]


# mypy's own incremental cache, where `mypy src` by hand keeps it: a module whose source and
# dependencies did not change since the last run is read from it, its errors included (mypy
# caches them with the module), so every run still reports every error in src. From an empty
# cache the run takes ~20 s on 2 cores (2026-12-04; ~42 s while mypy followed the installed
# transformers, ~2,300 modules: pyproject's [tool.mypy] no longer follows the optional peers), most
# of it in torch's own modules; with the cache, a few.
MYPY_CACHE = ROOT / ".mypy_cache"


def mypy_errors(cache_dir: Path = MYPY_CACHE) -> tuple[Counter[str], str]:
    """``mypy src`` as the project runs it (pyproject's [tool.mypy]), with its cache in
    ``cache_dir``: the count of errors per file (paths relative to the repository), and its output."""
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache_dir), "--no-color-output", "--no-error-summary", "src"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    # 0: no errors; 1: errors reported; anything else (2: a crash, bad config) is no result at all.
    assert out.returncode in (0, 1), f"mypy exited {out.returncode}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
    counts = Counter(m["path"].replace("\\", "/") for m in _ERROR.finditer(out.stdout))
    assert (out.returncode == 1) == bool(counts), f"mypy exited {out.returncode}, errors parsed: {dict(counts)}\n{out.stdout[-3000:]}"
    return counts, out.stdout


@pytest.mark.slow  # ~20 s from an empty cache (mypy checks src/ and torch's modules), a few s from a kept one
def test_mypy_reports_no_errors_in_src() -> None:
    pytest.importorskip("mypy", reason="mypy is not installed (the test extra installs it: pip install -e .[test])")
    counts, output = mypy_errors()
    lines = "\n".join(line for line in output.splitlines() if _ERROR.match(line))
    assert not counts, f"mypy errors in src, {dict(counts)}:\n{lines[-6000:]}"


def test_mypy_reports_the_errors_of_modules_it_reads_from_its_cache(tmp_path: Path) -> None:
    """What the kept cache relies on: a second run over unchanged files, from the first run's
    cache, reports the same errors (mypy caches a module's errors with it)."""
    pytest.importorskip("mypy", reason="mypy is not installed (the test extra installs it: pip install -e .[test])")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "bad.py").write_text('count: int = "three"\n')
    (tmp_path / "pkg" / "good.py").write_text("from pkg.bad import count\n\ntotal: int = count + 1\n")
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), "--no-color-output",
                              "--no-error-summary", "pkg"], cwd=tmp_path, capture_output=True, text=True, timeout=300)  # fmt: skip
        runs.append((out.returncode, [line for line in out.stdout.splitlines() if _ERROR.match(line)]))
    assert runs[0][0] == 1 and len(runs[0][1]) == 1 and runs[0][1][0].startswith("pkg/bad.py:1:"), runs
    assert runs[1] == runs[0], runs


def test_mypy_error_lines_are_parsed() -> None:
    """The pattern the mypy test counts by: mypy's `path:line: error:` lines (with or without a
    column), not its notes or summary."""
    text = (
        "src/leanopt/a.py:12: error: Item \"None\" of \"X | None\" has no attribute \"y\"  [union-attr]\n"
        "src/leanopt/a.py:12: note: see https://mypy.readthedocs.io\n"
        "src/leanopt/b/c.py:3:7: error: Name \"z\" is not defined  [name-defined]\n"
        "Found 2 errors in 2 files (checked 75 source files)\n"
    )
    assert Counter(m["path"] for m in _ERROR.finditer(text)) == {"src/leanopt/a.py": 1, "src/leanopt/b/c.py": 1}
