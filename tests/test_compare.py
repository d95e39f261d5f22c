"""``leanopt compare`` on a tiny configuration: the report's files and numbers hold together.

One comparison (the default task's --quick model, 6 steps, leanopt's optimizers, each in its
own process as the command runs them) feeds most tests; the 8-bit and 4-bit checks run
where those optimizers are importable and are skipped, by name, where they are not.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from leanopt.compare import compare, get_task, main
from leanopt.compare.contenders import Contender, contender
from leanopt.compare.report import markdown, table_rows
from leanopt.compare.tasks import warmup_cosine
from leanopt.memory import available_optimizers

LEANOPT = ("adamw", "adafactor", "adamw8bit", "adamw4bit")
STEPS = 6
REQUIRED = ("optimizer", "state_bytes", "peak_bytes", "step_ms", "train_step_ms", "final_loss", "val_loss",
            "initial_loss", "loss_curve")


def needs(name: str) -> None:
    if name not in available_optimizers():
        pytest.skip(f"leanopt optimizer {name!r} is not importable yet")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("compare")
    argv = ["--task", "bytes-gpt", "--quick", "--steps", str(STEPS), "--device", "cpu", "--threads", "1",
            "--optimizers", ",".join(LEANOPT), "--out", str(out)]
    # leanopt's low-bit CPU update runs eagerly here: compiling it (tested with the kernels)
    # would double this fixture's time and change none of the numbers checked below.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LEANOPT_NO_COMPILE", "1")
        assert main(argv) == 0
    return out, json.loads((out / "results.json").read_text())


def rows(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["optimizer"]: r for r in data["results"]}


def test_files_written(report: tuple[Path, dict[str, Any]]) -> None:
    out, data = report
    assert (out / "report.md").is_file()
    pytest.importorskip("matplotlib")
    assert sorted(data["plots"]) == ["loss_curves.png", "memory_vs_loss.png"]
    for name in data["plots"]:
        png = out / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size < 200_000


def test_one_row_per_optimizer(report: tuple[Path, dict[str, Any]]) -> None:
    _, data = report
    by_name = rows(data)
    assert list(by_name) == list(LEANOPT)
    available = set(available_optimizers())
    for name, row in by_name.items():
        if name in available:
            assert row["status"] == "ok", row.get("reason")
            for key in REQUIRED:
                assert row[key] is not None, (name, key)
        else:
            assert row["status"] == "skipped" and "not available" in row["reason"]


def test_losses_finite_and_same_data(report: tuple[Path, dict[str, Any]]) -> None:
    _, data = report
    ok = [r for r in data["results"] if r["status"] == "ok"]
    assert len(ok) >= 2
    for r in ok:
        assert len(r["loss_curve"]) == STEPS
        assert all(math.isfinite(x) for x in r["loss_curve"]), r["optimizer"]
        assert math.isfinite(r["final_loss"]) and math.isfinite(r["val_loss"])
        assert r["peak_bytes"] > 0 and r["step_ms"] > 0
    # The same initial weights and first batch in every process: the first loss is bit-identical.
    assert len({r["initial_loss"] for r in ok}) == 1
    assert 5.0 < ok[0]["initial_loss"] < 6.0  # ~ln(256): an untrained byte model


def test_adafactor_state_under_10_percent(report: tuple[Path, dict[str, Any]]) -> None:
    by_name = rows(report[1])
    assert by_name["adafactor"]["state_bytes"] < 0.10 * by_name["adamw"]["state_bytes"]
    assert by_name["adamw"]["state_bytes_per_param"] == pytest.approx(8.0, abs=0.01)


def test_8bit_state_under_30_percent(report: tuple[Path, dict[str, Any]]) -> None:
    needs("adamw8bit")
    by_name = rows(report[1])
    assert by_name["adamw8bit"]["state_bytes"] < 0.30 * by_name["adamw"]["state_bytes"]


def test_4bit_state_under_8bit(report: tuple[Path, dict[str, Any]]) -> None:
    needs("adamw4bit")
    needs("adamw8bit")
    by_name = rows(report[1])
    assert by_name["adamw4bit"]["state_bytes"] < by_name["adamw8bit"]["state_bytes"]


def test_estimate_matches_measurement(report: tuple[Path, dict[str, Any]]) -> None:
    for r in report[1]["results"]:
        if r["status"] == "ok" and r.get("estimated_state_bytes") is not None:
            assert r["estimated_state_bytes"] == r["state_bytes"], r["optimizer"]


def test_report_states_environment_and_command(report: tuple[Path, dict[str, Any]]) -> None:
    out, data = report
    env = data["environment"]
    for key in ("device", "torch", "leanopt", "cpu_count"):
        assert env[key] is not None
    assert data["settings"]["seed"] == 0
    text = (out / "report.md").read_text()
    assert data["command"] in text
    assert data["command"].startswith("leanopt compare --task bytes-gpt")
    assert "--quick" in data["command"] and f"--steps {STEPS}" in data["command"]
    assert len(table_rows(data)) == sum(r["status"] == "ok" for r in data["results"])
    assert markdown(data) == text


# ---- the other tasks and paths, in this process ------------------------------------------------
def test_digits_reports_accuracy() -> None:
    plan = get_task("digits").plan(device="cpu", quick=True, seed=1, steps=5, lr=None)
    result = compare(plan, ["adamw", "adafactor"], isolate=False)
    for row in result.rows:
        assert row["status"] == "ok", row.get("reason")
        assert 0.0 <= row["accuracy"] <= 1.0
        assert len(row["loss_curve"]) == 5
    assert result.rows[0]["initial_loss"] == result.rows[1]["initial_loss"]


@pytest.mark.slow
def test_distilbert_trainer_path() -> None:
    pytest.importorskip("transformers")
    plan = get_task("distilbert-trainer").plan(device="cpu", quick=True, seed=0, steps=3, lr=None)
    result = compare(plan, ["adamw", "hf-adafactor"], isolate=False)
    for row in result.rows:
        assert row["status"] == "ok", row.get("reason")
        assert len(row["loss_curve"]) == 3 and row["accuracy"] is not None
    assert result.rows[0]["initial_loss"] == result.rows[1]["initial_loss"]


def test_skips_are_rows_with_reasons() -> None:
    plan = get_task("digits").plan(device="cpu", quick=True, seed=0, steps=2, lr=None)
    result = compare(plan, ["adamw"], isolate=False, skip={"adamw": "left out on purpose"})
    assert result.rows == [{"optimizer": "adamw", "status": "skipped", "reason": "left out on purpose"}]
    missing = Contender("nowhere-adamw", "adamw", "nowhere_pkg", "nowhere_pkg.optim:AdamW")
    assert missing.unavailable() == "nowhere_pkg is not installed"


def test_adafactor_contenders_follow_the_schedule() -> None:
    import torch

    for name in ("adafactor", "hf-adafactor"):
        kwargs = contender(name).kwargs(lr=1e-3, weight_decay=0.01, device=torch.device("cpu"))
        assert kwargs["relative_step"] is False and kwargs["scale_parameter"] is False and kwargs["lr"] == 1e-3
    factor = warmup_cosine(100, 10)
    assert factor(0) == pytest.approx(0.1) and factor(9) == pytest.approx(1.0) and factor(99) < 0.01


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--optimizers", "adamw,sgd-deluxe"], "unknown optimizer 'sgd-deluxe'"),
        (["--task", "nope"], "unknown task 'nope'"),
        (["--steps", "many"], "invalid int value"),
        # Offline, without `datasets`, or online with no such repository: one line each way.
        (["--task", "hf:some-model:some-dataset"], "--task hf:some-model:some-dataset"),
    ],
)
def test_errors_are_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("leanopt compare: error: ") and message in err
    assert "\n" not in err
