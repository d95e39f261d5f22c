"""The linter's settings (pyproject.toml [tool.ruff]) hold on the whole tree: `ruff check .`."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_passes_on_the_tree() -> None:
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.importorskip("ruff")  # the test extras install it; without them, say so
        ruff_cmd = [sys.executable, "-m", "ruff"]
    else:
        ruff_cmd = [ruff]
    out = subprocess.run([*ruff_cmd, "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-1000:]
