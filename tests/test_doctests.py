"""The docstrings' ``>>>`` examples run as part of the suite, as
``python -m pytest --doctest-modules src/leanopt`` runs them: every module of src/leanopt whose
source holds one, found by reading the files, so a new example is run without being listed."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules_with_examples() -> list[str]:
    out = []
    for path in sorted((SRC / "leanopt").rglob("*.py")):
        if ">>>" in path.read_text():
            parts = path.relative_to(SRC).with_suffix("").parts
            out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


MODULES = _modules_with_examples()


def test_examples_are_found() -> None:
    assert "leanopt.optim.adamw" in MODULES and "leanopt.optim.sgd" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str) -> None:
    if name.startswith("leanopt.integrations.transformers"):
        pytest.importorskip("transformers")
    module = importlib.import_module(name)
    result = doctest.testmod(module, report=False)
    assert result.attempted > 0, f"{name}: no example found by doctest"
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed (run pytest --doctest-modules {name})"
