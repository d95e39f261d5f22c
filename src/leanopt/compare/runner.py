"""Run one task with each optimizer: tune its lr on a grid, repeat the best over seeds.

Each optimizer trains in a fresh Python process (``python -m leanopt.compare.worker``) that
runs that optimizer's whole protocol (:func:`run_protocol`): load the data, one warm-up (where
an optimizer compiles its update), then a run at every lr of its grid on the first seed, the
pick (lowest validation loss), and the remaining seeds at the pick. Its peak memory is then its
own (nothing left behind by another optimizer's pages, compile caches or allocator state; it is
read in the process's first run), and a peer that crashes on this device (a segfault in a
native kernel) costs one row, not the comparison. The child reports progress and each run as
JSON lines; the parent folds the runs into one row per optimizer (:func:`summarize`) and gives
each its verdict against AdamW. ``jobs`` processes run at once (1: the steadiest timings);
``isolate=False`` runs them in this process instead (faster to start; the CPU peaks then depend
on the order).
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from importlib import metadata
from typing import Any, TypeGuard

import torch

import leanopt
from leanopt.compare import stats
from leanopt.compare.contenders import LR, RELATIVE, Contender, contender
from leanopt.compare.meter import PeakMemory, Recorder, use_mmap_for_large_blocks
from leanopt.compare.tasks import Plan, Workload, get_task
from leanopt.memory import OPTIMIZER_NAMES

EVENT_PREFIX = "@@leanopt-compare "
Emit = Callable[[dict[str, Any]], None]
# An optimizer-tagged event handler: (optimizer, event).
OnEvent = Callable[[str, dict[str, Any]], None]
REFERENCES = ("adamw", "torch-adamw")  # the verdict is against the first of these that ran


@dataclass
class Comparison:
    plan: Plan
    description: str
    optimizers: list[str]
    rows: list[dict[str, Any]] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)
    memory_method: str = ""
    wall_s: float = 0.0
    reference: str | None = None
    jobs: int = 1
    too_short: str | None = None  # why the losses cannot rank the optimizers (None: they can)


def runs_planned(plan: Plan, entry: Contender) -> int:
    """How many training runs one optimizer's protocol makes: its grid, then the other seeds."""
    return len(lr_grid(plan, entry)) + max(0, len(plan.seeds) - 1)


def lr_grid(plan: Plan, entry: Contender) -> list[LR]:
    if plan.fixed_lr:
        return [float(plan.lr)]
    return entry.lr_grid(float(plan.lr), plan.lr_multipliers, relative=plan.relative_step)


def _key(phase: str, lr: LR, seed: int) -> tuple[str, str, int]:
    return phase, json.dumps(lr), seed  # a float after a JSON round trip is the same float


def _by_key(done: Sequence[dict[str, Any]]) -> dict[tuple[str, str, int], dict[str, Any]]:
    return {_key(r.get("phase", "grid"), r["lr"], r["seed"]): r for r in done}


# Grid points added, one at a time, beyond an edge the pick keeps landing on.
MAX_WIDEN = 2


def widened_lr(grid: Sequence[LR], losses: Sequence[float | None], planned: int) -> float | None:
    """The lr to try next when the pick is at the edge of the grid, else None.

    ``grid`` and ``losses`` are the points trained so far (the planned ``planned`` first, then
    any added), in training order. One more point lies a grid step (the ratio of the two
    outermost lrs on that side) beyond the edge, up to :data:`MAX_WIDEN` of them: a pick at
    the edge says the best lr may lie outside, and one step further tells.
    """
    best = stats.pick(list(zip(grid, losses)))
    if best is None or len(grid) - planned >= MAX_WIDEN or not stats.at_edge(grid, grid[best]):
        return None
    numeric = sorted(float(x) for x in grid if stats.finite(x))
    lr = float(grid[best])
    step = numeric[-1] / numeric[-2] if lr == numeric[-1] else numeric[0] / numeric[1]
    return float(f"{lr * step:.6g}")


def _loss(row: dict[str, Any]) -> float | None:
    return None if row.get("diverged") else row.get("val_loss")


def runs_left(plan: Plan, entry: Contender, done: Sequence[dict[str, Any]]) -> int:
    """How many runs of the protocol are still to train, given the rows of those ``done``
    (a resumed comparison's, read from its runs log); :func:`runs_planned` when none are.
    A grid still to be widened counts the one point known to come."""
    have = _by_key(done)
    grid = lr_grid(plan, entry)
    grid_rows = [have.get(_key("grid", lr, plan.seeds[0])) for lr in grid]
    seeds = len(plan.seeds) - 1
    trained = [r for r in grid_rows if r is not None]
    if len(trained) < len(grid_rows):
        return len(grid_rows) - len(trained) + seeds
    losses = [_loss(r) for r in trained]
    planned = len(grid)
    while (lr := widened_lr(grid, losses, planned)) is not None:
        row = have.get(_key("grid", lr, plan.seeds[0]))
        if row is None:
            return 1 + seeds
        grid, losses = [*grid, lr], [*losses, _loss(row)]
    best = stats.pick(list(zip(grid, losses)))
    if best is None:
        return 0
    return sum(_key("seed", grid[best], seed) not in have for seed in plan.seeds[1:])


# ---- one optimizer, in whatever process runs it --------------------------------------------------
def run_protocol(optimizer: str, plan: Plan, emit: Emit, done: Sequence[dict[str, Any]] = ()) -> None:
    """Tune ``optimizer``'s lr on its grid, then train the pick on every seed; emits events.

    Events: ``setup`` (once, after the warm-up), ``step`` (every training step), ``run`` (one
    per finished run, with its row), and ``picked`` after the grid. The runs of ``done`` (rows
    of an earlier, interrupted comparison with the same plan) are not trained again: their rows
    stand in the grid and the pick as they are, and only the others emit ``run`` events.
    """
    entry = contender(optimizer)
    if not runs_left(plan, entry, done):
        return
    if plan.threads:
        torch.set_num_threads(plan.threads)
    have = _by_key(done)
    workload = get_task(plan.task).prepare(plan)
    grid = lr_grid(plan, entry)
    centre = grid[len([x for x in grid if x != RELATIVE]) // 2]
    start = time.perf_counter()
    workload.warm_up(entry, centre)
    emit({"event": "setup", "setup_s": time.perf_counter() - start, "grid": grid, "runs": runs_planned(plan, entry)})
    trained = 0

    def row_of(phase: str, lr: LR, seed: int) -> dict[str, Any]:
        nonlocal trained
        row = have.get(_key(phase, lr, seed))
        if row is None:
            # fresh: this process's first run, whose peak memory is the one reported
            row = run_one(entry, workload, replace(plan, lr=lr, seed=seed), emit, fresh=not trained)
            row["phase"] = phase
            trained += 1
            emit({"event": "run", "row": row})
        return row

    first_seed, losses = plan.seeds[0], []
    for lr in grid:
        losses.append(_loss(row_of("grid", lr, first_seed)))
    planned = len(grid)
    while (wider := widened_lr(grid, losses, planned)) is not None:
        edge = stats.pick(list(zip(grid, losses)))  # not None: widened_lr widens only at a pick
        emit({"event": "widen", "lr": wider, "edge": None if edge is None else grid[edge]})
        grid.append(wider)
        losses.append(_loss(row_of("grid", wider, first_seed)))
    best = stats.pick(list(zip(grid, losses)))
    emit({"event": "picked", "lr": None if best is None else grid[best]})
    if best is None:
        return
    for seed in plan.seeds[1:]:
        row_of("seed", grid[best], seed)


def run_one(entry: Contender, workload: Workload, plan: Plan, emit: Emit, *, fresh: bool) -> dict[str, Any]:
    """Train once at ``plan.lr`` and ``plan.seed``; returns the run's row.

    ``fresh``: the process's first run, whose peak memory is the one reported (a later run's
    baseline follows what earlier runs left in the allocator).
    """
    device = torch.device(plan.device)
    if device.type == "cpu":
        use_mmap_for_large_blocks()
    recorder = Recorder(device, plan.steps, emit)
    recorder.start_memory()
    start = time.perf_counter()
    try:
        trained = workload.run(entry, plan, recorder)
    finally:
        recorder.close()  # a profiler left running would slow every later run of this process
    train_s = time.perf_counter() - start
    state = leanopt.measure(trained.optimizer)
    params = [p for p in trained.model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    kwargs = entry.kwargs(lr=plan.lr, weight_decay=plan.weight_decay, device=device)
    cls = type(trained.optimizer)
    mode = entry.mode(plan.precision)
    row: dict[str, Any] = {
        "lr": plan.lr,
        "seed": plan.seed,
        "fresh_process": fresh,
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "kwargs": {k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()},
        "mode": mode.label,
        "precision": mode.precision,
        "rounding": mode.rounding,
        "release": mode.release,
        "state_dtype": mode.state_dtype or "float32",
        "param_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in params}),
        "params": n_params,
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "state_bytes": state.bytes,
        "state_by_key": state.by_key,
        "estimated_state_bytes": _estimate(entry, trained.model, kwargs),
        "memory_method": recorder.method,
        "train_s": train_s,
        "val_loss": None,
        "accuracy": None,
        "f1": None,
    }
    row.update(recorder.summary())
    row.update(trained.metrics)
    row["wall_s"] = time.perf_counter() - start
    return row


def _estimate(entry: Contender, model: torch.nn.Module, kwargs: dict[str, Any]) -> int | None:
    if entry.optimizer not in OPTIMIZER_NAMES:
        return None
    try:
        return leanopt.estimate(model, entry.optimizer, **kwargs).bytes
    except Exception:  # no layout known for this class: measured bytes stand alone
        return None


def worker_main() -> int:
    """Child entry: read ``{"optimizer", "plan"}`` as JSON on stdin, write events on stdout."""
    spec = json.loads(sys.stdin.read())
    # Events go to the original stdout; anything else printed (a peer's banner) goes to stderr.
    events = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def emit(event: dict[str, Any]) -> None:
        events.write(EVENT_PREFIX + json.dumps(_finite(event)) + "\n")

    try:
        run_protocol(spec["optimizer"], Plan(**spec["plan"]), emit, spec.get("done", []))
    except Exception as err:
        traceback.print_exc()
        emit({"event": "error", "reason": _one_line(err)})
        return 1
    emit({"event": "done"})
    return 0


# ---- the comparison ----------------------------------------------------------------------------
def run_isolated(optimizer: str, plan: Plan, emit: Emit, done: Sequence[dict[str, Any]] = ()) -> str | None:
    """Run :func:`run_protocol` in a fresh process; returns why it failed (None: it finished)."""
    spec = json.dumps({"optimizer": optimizer, "plan": plan.to_dict(), "done": list(done)})
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    if plan.threads:  # OpenMP's pool is sized before torch.set_num_threads could shrink it
        env["OMP_NUM_THREADS"] = str(plan.threads)
    with tempfile.TemporaryFile(mode="w+") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "leanopt.compare.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
        )
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(spec)
        proc.stdin.close()
        finished, reason = False, None
        try:
            for line in proc.stdout:
                if not line.startswith(EVENT_PREFIX):
                    continue
                event = json.loads(line[len(EVENT_PREFIX) :])
                if event["event"] == "done":
                    finished = True
                elif event["event"] == "error":
                    reason = event["reason"]
                else:
                    emit(event)
        except BaseException:  # Ctrl-C, or the runs log cannot be written: the child stops too
            proc.kill()
            proc.wait()
            raise
        code = proc.wait()
        if finished:
            return None
        if reason is None:
            stderr.seek(0)
            tail = [ln.strip() for ln in stderr.read().splitlines() if ln.strip()]
            died = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            reason = f"the training process died ({died})" + (f": {tail[-1]}" if tail else "")
    return reason


def run_in_process(optimizer: str, plan: Plan, emit: Emit, done: Sequence[dict[str, Any]] = ()) -> str | None:
    try:
        run_protocol(optimizer, plan, lambda event: emit(_finite(event)), done)
    except Exception as err:
        return _one_line(err)
    return None


def skipped_row(optimizer: str, reason: str) -> dict[str, Any]:
    return {"optimizer": optimizer, "status": "skipped", "reason": reason}


def failed_row(optimizer: str, reason: str) -> dict[str, Any]:
    return {"optimizer": optimizer, "status": "failed", "reason": reason}


def compare(
    plan: Plan,
    optimizers: list[str],
    *,
    isolate: bool = True,
    jobs: int = 1,
    skip: dict[str, str] | None = None,
    on_start: Callable[[str], None] = lambda name: None,
    on_event: OnEvent = lambda name, event: None,
    on_row: Callable[[dict[str, Any]], None] = lambda row: None,
    resumed: dict[str, dict[str, Any]] | None = None,
) -> Comparison:
    """Run every optimizer's protocol; unavailable ones become ``skipped`` rows.

    ``skip`` maps names to a reason for leaving them out (they get a ``skipped`` row too).
    ``on_start(name)``, ``on_event(name, event)`` and ``on_row(row)`` are called from the
    calling thread, one at a time, also when ``jobs`` > 1. ``resumed`` maps names to what an
    earlier run of the same plan finished (``{"setup": event, "runs": [row, ...]}``, as
    :func:`leanopt.compare.output.read_runs` reads them): those runs are not trained again, and
    an optimizer with none left starts no process.
    """
    task = get_task(plan.task)
    result = Comparison(plan=plan, description=task.description, optimizers=list(optimizers), jobs=jobs)
    result.environment = environment(torch.device(plan.device), plan.threads)
    start = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {}
    setups: dict[str, dict[str, Any]] = {}
    rows: dict[str, dict[str, Any]] = {}
    todo: list[str] = []
    finished: list[str] = []
    for name in optimizers:
        reason = (skip or {}).get(name) or contender(name).unavailable()
        earlier = (resumed or {}).get(name)
        if reason is not None:
            rows[name] = skipped_row(name, reason)
            on_row(rows[name])
            continue
        if earlier:
            runs[name] = list(earlier.get("runs") or [])
            if earlier.get("setup"):
                setups[name] = earlier["setup"]
        (todo if runs_left(plan, contender(name), runs.get(name, [])) else finished).append(name)

    def handle(name: str, event: dict[str, Any]) -> None:
        if event["event"] == "run":
            runs.setdefault(name, []).append(event["row"])
        elif event["event"] == "setup":
            setups[name] = event
        on_event(name, event)

    def finish(name: str, reason: str | None) -> None:
        rows[name] = summarize(name, plan, setups.get(name), runs.get(name, []), reason)
        on_row(rows[name])

    for name in finished:  # every run on disk already
        finish(name, None)
    execute = run_isolated if isolate else run_in_process
    if jobs <= 1 or not isolate:
        for name in todo:
            on_start(name)
            finish(name, execute(name, plan, functools.partial(handle, name), list(runs.get(name, []))))
    else:
        inbox: queue.Queue[tuple[str, str, Any]] = queue.Queue()
        slots = threading.Semaphore(jobs)

        def work(name: str, done: list[dict[str, Any]]) -> None:
            with slots:
                inbox.put(("start", name, None))
                why = execute(name, plan, lambda event: inbox.put(("event", name, event)), done)
                inbox.put(("end", name, why))

        threads = [threading.Thread(target=work, args=(n, list(runs.get(n, []))), daemon=True) for n in todo]
        for t in threads:
            t.start()
        ended = 0
        while ended < len(todo):
            kind, name, payload = inbox.get()
            if kind == "start":
                on_start(name)
            elif kind == "event":
                handle(name, payload)
            else:
                ended += 1
                finish(name, payload)
    result.rows = [rows[name] for name in optimizers]
    result.wall_s = time.perf_counter() - start
    methods = {r["memory_method"] for r in result.rows if r.get("memory_method")}
    result.memory_method = "; ".join(sorted(methods)) or PeakMemory(torch.device(plan.device)).method
    result.reference = judge(result.rows)
    result.too_short = too_short(result.rows, result.reference)
    _rank(result.rows)
    return result


def summarize(name: str, plan: Plan, setup: dict[str, Any] | None, runs: list[dict[str, Any]],
              reason: str | None = None) -> dict[str, Any]:
    """One row per optimizer from its runs: the grid and the pick, mean ± std over the seeds at
    the pick, memory from the fresh process's run, timings pooled over every run."""
    entry = contender(name)
    if not runs:
        return failed_row(name, reason or "no run finished")
    grid_runs = [r for r in runs if r.get("phase", "grid") == "grid"]
    grid = [r["lr"] for r in grid_runs]
    points = [(r["lr"], _loss(r)) for r in grid_runs]
    best = stats.pick(points)  # in training order, as the protocol picked
    first = runs[0]
    # Shown by lr (a widened grid's added points were trained last), the relative step last.
    shown = sorted(range(len(grid)), key=lambda i: (not stats.finite(grid[i]), grid[i] if stats.finite(grid[i]) else 0))
    row: dict[str, Any] = {
        "optimizer": name,
        "status": "ok",
        "origin": entry.origin,
        "lr": None if best is None else grid[best],
        "lr_grid": [grid[i] for i in shown],
        "grid_val_loss": [points[i][1] for i in shown],
        "lr_at_grid_edge": best is not None and stats.at_edge(grid, grid[best]),
        "lr_widened": max(0, len(grid) - len(lr_grid(plan, entry))),
        "lr_fixed": plan.fixed_lr,
    }
    if reason is not None:
        row["status"], row["reason"] = "failed", reason
    if best is None:
        if row["status"] == "ok":
            row["status"], row["reason"] = "diverged", "the training loss became non-finite at every lr of the grid"
        at_pick = []
    else:
        at_pick = [r for r in runs if r["lr"] == grid[best] and (r.get("phase") == "seed" or r is grid_runs[best])]
    for key in ("class", "mode", "precision", "rounding", "release", "state_dtype", "param_dtypes", "params", "param_bytes",
                "grad_bytes", "state_bytes", "state_by_key", "estimated_state_bytes"):
        row[key] = first.get(key)
    row["kwargs"] = (at_pick[0] if at_pick else first).get("kwargs")
    row["memory_method"] = first.get("memory_method")
    row["state_bytes_per_param"] = row["state_bytes"] / row["params"] if row.get("params") else None
    # What persists through a step, per param: weights + the gradients alive before the step + state.
    parts = ("param_bytes", "grad_bytes", "state_bytes")
    kept = [v for v in (row.get(k) for k in parts) if isinstance(v, int)]
    row["kept_bytes_per_param"] = sum(kept) / row["params"] if row.get("params") and len(kept) == len(parts) else None
    row["peak_bytes"] = first.get("peak_bytes") if first.get("fresh_process", True) else None
    row["peak_rss_bytes"] = first.get("peak_rss_bytes") if first.get("fresh_process", True) else None
    # The peak of every run (the tensor peak repeats across them; the resident set does not).
    row["peak_bytes_runs"] = [r.get("peak_bytes") for r in runs]
    row["seeds"] = [r["seed"] for r in at_pick]
    # Per seed (a list) and its mean and std: val_losses, val_loss_mean, val_loss_std, ...
    for key, per_seed in (("val_loss", "val_losses"), ("final_loss", "final_losses"),
                          ("initial_loss", "initial_losses"), ("accuracy", "accuracy_by_seed"),
                          ("f1", "f1_by_seed")):
        values = [r.get(key) for r in at_pick]
        row[per_seed] = values
        row[f"{key}_mean"], row[f"{key}_std"] = stats.mean_std([v for v in values if v is not None])
    row["diverged"] = any(r.get("diverged") for r in at_pick)
    row["chance_accuracy"] = first.get("chance_accuracy")
    # Step times hardly depend on the lr: every run's timed steps are pooled.
    steps = [x for r in runs for x in r.get("step_ms_timed", [])]
    train_steps = [x for r in runs for x in r.get("train_step_ms_timed", [])]
    q1, med, q3 = stats.quartiles(steps)
    row.update(step_ms_median=med, step_ms_q1=q1, step_ms_q3=q3,
               step_ms_min=min(steps) if steps else None, step_ms_max=max(steps) if steps else None,
               step_ms_mean=stats.mean_std(steps)[0], timed_steps=len(steps))
    t1, tmed, t3 = stats.quartiles(train_steps)
    row.update(train_step_ms_median=tmed, train_step_ms_q1=t1, train_step_ms_q3=t3)
    row["first_step_ms"] = first.get("first_step_ms")
    row["setup_s"] = None if setup is None else setup.get("setup_s")
    row["runs"] = len(runs)
    row["train_s"] = sum(r.get("wall_s") or 0.0 for r in runs)
    curves = [r.get("loss_curve") or [] for r in at_pick]
    row["loss_curves"] = curves
    fit = stats.trend(curves)
    row["loss_trend"] = None if fit is None else {"steps": fit.steps, "drop": fit.drop, "relative": fit.relative, "p": fit.p,
                                                  "falling": fit.falling}  # fmt: skip
    row["runs_detail"] = [{k: r.get(k) for k in ("phase", "lr", "seed", "val_loss", "final_loss", "accuracy", "f1",
                                                 "diverged", "step_ms_median", "wall_s")} for r in runs]
    # Names kept from the single-run report: the means at the pick.
    row["val_loss"], row["final_loss"] = row["val_loss_mean"], row["final_loss_mean"]
    row["accuracy"], row["f1"] = row["accuracy_mean"], row["f1_mean"]
    return row


def reference(rows: list[dict[str, Any]]) -> str | None:
    """The row the verdicts are against: ``adamw``, else ``torch-adamw`` (each in the run's
    precision), else the first listed of them with master weights named with a precision mode
    (``adamw+bf16-mixed``, ``adamw+fp32``); None when none of them finished."""
    ok = [r for r in rows if r.get("status") == "ok" and stats.finite(r.get("val_loss_mean"))]
    names = [r["optimizer"] for r in ok]
    for name in REFERENCES:
        if name in names:
            return name
    for name in names:
        try:
            entry = contender(name)
        except ValueError:
            continue
        if entry.optimizer in REFERENCES and entry.precision in ("fp32", "bf16-mixed") and not entry.release and not entry.state_dtype:
            return name
    return None


_NO_VERDICT = {"delta": None, "delta_std": None, "p": None, "df": None, "ci": None, "test": None}


def judge(rows: list[dict[str, Any]]) -> str | None:
    """Set ``verdict`` (its words), ``verdict_kind``, ``delta``, ``delta_std``, ``p``, ``df``, ``ci``
    and ``test`` on every ranked row (``stats.verdict``: the paired test where both ran the same
    seeds); returns the reference's name."""
    by_name = {r["optimizer"]: r for r in rows}
    ref = reference(rows)
    for row in rows:
        if row["status"] != "ok":
            row.update(_NO_VERDICT, verdict=None, verdict_kind=None)
        elif ref is None:
            row.update(_NO_VERDICT, verdict="no AdamW reference ran", verdict_kind="none")
        elif row["optimizer"] == ref:
            row.update(_NO_VERDICT, verdict=stats.REFERENCE, verdict_kind=stats.REFERENCE, delta=0.0)
        else:
            row.update(stats.verdict(row["val_losses"], by_name[ref]["val_losses"], paired_seeds=_same_seeds(row, by_name[ref])))
        # Where the task scores an F1 (the Trainer tasks), the same rule on it, higher better.
        theirs, ours = (by_name[ref].get("f1_by_seed") if ref else None), row.get("f1_by_seed")
        if row["status"] == "ok" and ref is not None and _any_finite(ours) and _any_finite(theirs):
            f1 = ({"verdict": stats.REFERENCE, "verdict_kind": stats.REFERENCE, "delta": 0.0, "delta_std": None, "p": None}
                  if row["optimizer"] == ref else
                  stats.verdict(ours, theirs, higher_is_better=True, paired_seeds=_same_seeds(row, by_name[ref])))
            row.update(f1_verdict=f1["verdict"], f1_verdict_kind=f1["verdict_kind"], f1_delta=f1["delta"],
                       f1_delta_std=f1["delta_std"], f1_p=f1["p"])  # fmt: skip
    return ref


def _same_seeds(row: dict[str, Any], ref: dict[str, Any]) -> bool:
    """Whether the two rows' values come from the same seeds, in the same order (paired)."""
    return bool(row.get("seeds")) and row.get("seeds") == ref.get("seeds")


def too_short(rows: list[dict[str, Any]], ref: str | None) -> str | None:
    """Why this run cannot rank the optimizers by their loss (None: it can): the reference's accuracy
    is near chance (:func:`stats.near_chance`) or its training loss still falls (:class:`stats.Trend`)."""
    row = next((r for r in rows if r["optimizer"] == ref), None)
    if row is None:
        return None
    reasons = []
    if stats.near_chance(row.get("accuracy_mean"), row.get("chance_accuracy")):
        reasons.append(f"{ref}'s accuracy, {100 * row['accuracy_mean']:.1f}%, is near chance (always answering the most common "
                       f"label scores {100 * row['chance_accuracy']:.1f}%)")
    fit = row.get("loss_trend")
    if fit and fit["falling"]:
        reasons.append(f"{ref}'s training loss still fell by {100 * fit['relative']:.0f}% over the last {fit['steps']} steps "
                       f"({stats.p_text(fit['p'])})")
    return "; ".join(reasons) or None


def _any_finite(values: Any) -> TypeGuard[list[Any]]:
    """Whether ``values`` is a list holding a finite number (a score to compare)."""
    return isinstance(values, list) and any(stats.finite(v) for v in values)


def _rank(rows: list[dict[str, Any]]) -> None:
    scored = [r for r in rows if r["status"] == "ok" and _is_finite(r.get("val_loss_mean")) and not r.get("diverged")]
    for i, row in enumerate(sorted(scored, key=lambda r: r["val_loss_mean"]), start=1):
        row["rank"] = i


# ---- environment -------------------------------------------------------------------------------
def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment(device: torch.device, threads: int | None = None) -> dict[str, Any]:
    env: dict[str, Any] = {
        "device": str(device),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "leanopt": leanopt.__version__,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": threads or torch.get_num_threads(),
    }
    if device.type == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    for dist in ("transformers", "bitsandbytes", "torchao", "scikit-learn", "matplotlib"):
        env[dist] = _version(dist)
    return env


# ---- helpers -----------------------------------------------------------------------------------
def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}"[:300] if text else type(err).__name__


def _is_finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _finite(value: Any) -> Any:
    """JSON has no NaN/Infinity: non-finite floats become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
