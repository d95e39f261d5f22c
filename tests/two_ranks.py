"""Run a script of tests/dist_scripts on two gloo ranks (torchrun) and read what it wrote: the
launch the distributed test files share."""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import repo_modules

SCRIPTS = pathlib.Path(__file__).resolve().parent / "dist_scripts"
LAUNCH_TIMEOUT_S = 300


def launch(out: pathlib.Path, script: str, names: list[str]) -> dict[str, Any]:
    """``script`` on 2 ranks with ``out`` and ``names`` as its arguments; its results.json."""
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available in this build")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LEANOPT_DIST_TIMEOUT": "120"}
    try:
        repo_modules.benchmark("plan_vs_measured").torchrun(str(SCRIPTS / script), [str(out), *names], 2, env,
                                                            LAUNCH_TIMEOUT_S, script)  # fmt: skip
    except RuntimeError as err:
        pytest.fail(str(err))
    data = json.loads((out / "results.json").read_text())
    assert data["world_size"] == 2
    return data


def case(results: dict, name: str, mode: str) -> dict:
    """One optimizer's results in one mode, failing on the error a rank recorded there."""
    out = results[name][mode]
    assert "error" not in out, out["error"]
    return out


def results_fixture(script: str, names: list[str]) -> Any:
    """A module-scoped fixture: ``script``'s results, its folder removed afterwards."""

    @pytest.fixture(scope="module")
    def results(tmp_path_factory: Any) -> Iterator[dict]:
        import shutil

        out = tmp_path_factory.mktemp(pathlib.Path(script).stem)
        yield launch(out, script, names)
        shutil.rmtree(out, ignore_errors=True)

    return results
