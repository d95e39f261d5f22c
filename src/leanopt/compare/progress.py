"""What a running comparison shows: one line per finished run, or bars; the time left; the load.

- :class:`RemainingTime` estimates the time left from the runs finished so far (no constants:
  before the first run it says nothing).
- :class:`LoadMonitor` samples the 1-minute load average while the comparison runs, so the
  report can say when other work shared the cores (timings are then inflated).
- :class:`RunLines` writes one line per optimizer set up and per finished run, with the time left,
  on stderr (stdout not a terminal: a log, CI; stdout keeps the table and what to use);
  :class:`RunBars` draws rich bars (a terminal). Both take the same events.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from leanopt.compare import stats


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, s = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {s:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def lr_text(lr: Any) -> str:
    return f"{lr:.3g}" if isinstance(lr, (int, float)) else str(lr)


class RemainingTime:
    """Time left, from what the finished runs took.

    Per optimizer: the process's set-up (start to the ``setup`` event: imports, data, warm-up,
    compilation), then its runs. A run not yet measured for an optimizer is costed at the mean
    of that optimizer's finished runs, else at the mean of every finished run; a set-up not yet
    seen at the mean of the set-ups seen, or at its ``compile_s`` prior when that is longer (a
    compiling optimizer's set-up is 10-100x anyone else's). With ``jobs`` processes at once the
    work left is shared among them, but never finishes before the longest single optimizer's part.
    """

    def __init__(self, planned: dict[str, int], jobs: int = 1, clock: Callable[[], float] = time.perf_counter,
                 compile_s: dict[str, float] | None = None) -> None:
        self.planned = dict(planned)  # optimizer -> runs it will make
        self.compile_s = dict(compile_s or {})
        self.jobs = max(1, jobs)
        self.clock = clock
        self.started: dict[str, float] = {}
        self.setup_s: dict[str, float] = {}
        self.mark: dict[str, float] = {}  # when the optimizer's current run began
        self.fraction: dict[str, float] = {}  # of the current run
        self.run_s: dict[str, list[float]] = {}
        self.ended: set[str] = set()

    def start(self, name: str) -> None:
        self.started[name] = self.mark[name] = self.clock()

    def setup(self, name: str, runs: int | None = None) -> None:
        now = self.clock()
        self.setup_s[name] = now - self.started.get(name, now)
        self.mark[name] = now
        if runs is not None:
            self.planned[name] = runs

    def step(self, name: str, fraction: float) -> None:
        self.fraction[name] = fraction

    def more(self, name: str, runs: int = 1) -> None:
        """``name``'s protocol grew (its lr grid was widened)."""
        self.planned[name] = self.planned.get(name, 0) + runs

    def run(self, name: str) -> float:
        """A run of ``name`` finished; returns how long it took."""
        now = self.clock()
        took = now - self.mark.get(name, now)
        self.run_s.setdefault(name, []).append(took)
        self.mark[name] = now
        self.fraction[name] = 0.0
        return took

    def end(self, name: str) -> None:
        self.ended.add(name)

    def estimate(self) -> float | None:
        """Seconds left, or None before any run finished."""
        every = [t for ts in self.run_s.values() for t in ts]
        if not every:
            return None
        mean_run = statistics.fmean(every)
        mean_setup = statistics.fmean(self.setup_s.values()) if self.setup_s else 0.0
        parts = []
        for name, runs in self.planned.items():
            if name in self.ended:
                continue
            per_run = statistics.fmean(self.run_s[name]) if self.run_s.get(name) else mean_run
            done = len(self.run_s.get(name, []))
            left = max(runs - done, 0) * per_run
            setup = max(mean_setup, self.compile_s.get(name, 0.0))
            if name not in self.started:
                left += setup
            elif name not in self.setup_s:
                left += max(setup - (self.clock() - self.started[name]), 0.0)
            elif done < runs:
                left -= min(self.fraction.get(name, 0.0), 1.0) * per_run
            parts.append(max(left, 0.0))
        if not parts:
            return 0.0
        return max(sum(parts) / self.jobs, max(parts))


def eta_check(log: list[tuple[float, float]], wall_s: float, min_left: float = 0.1) -> dict[str, Any] | None:
    """How the estimates held: each ``(elapsed, estimated left)`` against the time really left.

    Estimates made in the last ``min_left`` share of the run are left out (seconds against
    seconds say nothing). Returns the lowest and highest ratio estimate / actual.
    """
    ratios = [est / (wall_s - at) for at, est in log if wall_s - at > min_left * wall_s and est is not None]
    if not ratios:
        return None
    return {"estimates": len(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "within_2x": all(0.5 <= r <= 2.0 for r in ratios)}


class LoadMonitor:
    """Samples ``os.getloadavg()`` every ``interval`` seconds on a daemon thread."""

    def __init__(self, interval: float = 5.0) -> None:
        self.interval = interval
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def read() -> float | None:
        try:
            return os.getloadavg()[0]
        except (OSError, AttributeError):
            return None

    def __enter__(self) -> LoadMonitor:
        self.sample()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        self.sample()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        value = self.read()
        if value is not None:
            self.samples.append(value)


def load_summary(samples: list[float], cores: int, own_threads: int) -> dict[str, Any]:
    """The load during the run and whether it was loaded: mean 1-minute load average > cores.

    More runnable threads than cores means threads waited for a core, and the step times then
    include that wait. ``own_threads`` is what this comparison itself keeps busy.
    """
    if not samples:
        return {"samples": 0, "loaded": None, "warning": None}
    mean, peak = statistics.fmean(samples), max(samples)
    loaded = mean > cores
    warning = None
    if loaded:
        warning = (f"the machine was loaded: the 1-minute load average was {mean:.1f} on average "
                   f"(max {peak:.1f}) on {cores} cores, of which this comparison kept about {own_threads} busy; "
                   "step times include waiting for a core and are inflated")
    return {"samples": len(samples), "mean": mean, "max": peak, "min": min(samples), "cores": cores,
            "own_threads": own_threads, "loaded": loaded, "warning": warning}


def threads_for(cores: int, load: float | None, jobs: int = 1) -> int:
    """torch threads for each of ``jobs`` processes: the cores that other work leaves free.

    ``load`` is the 1-minute load average before the comparison starts (None: unknown, every
    core counted free). More threads than free cores is what slowed ``--quick`` 30-60x on a
    loaded machine: each thread of a parallel region waits for the slowest, and a descheduled
    one stalls the rest, so an oversubscribed process runs slower than with a single thread.
    """
    share = max(1, cores // max(1, jobs))
    if load is None:
        return share
    return max(1, min(share, round((cores - load) / max(1, jobs))))


def threads_note(threads: int | None, jobs: int, chosen_by: str, cores: int, load: float | None) -> str:
    """``1 torch thread in each of 1 process, sized to the free cores (2 cores, load 1.3 at the start)``."""
    if threads is None:
        return f"torch's default threads in each of {jobs} process{'es' if jobs != 1 else ''}"
    text = f"{threads} torch thread{'s' if threads != 1 else ''} in each of {jobs} process{'es' if jobs != 1 else ''}"
    if chosen_by == "the free cores":
        where = f"{cores} cores" + ("" if load is None else f", 1-minute load average {load:.1f} at the start")
        return f"{text}, sized to the free cores ({where}; --threads sets it)"
    return f"{text}, as {chosen_by} set"


def run_line(name: str, row: dict[str, Any], done: int, total: int, elapsed: float, left: float | None) -> str:
    """``[ 3/30] adamw       lr 0.001 seed 0: val 2.953 (grid) ...``: one finished run."""
    width = len(str(total))
    val = row.get("val_loss")
    val_text = f"{val:.3f}" if stats.finite(val) and not row.get("diverged") else "diverged"
    step = row.get("step_ms_median")
    step_text = ("step in backward" if row.get("release")  # released: step() is a no-op
                 else f"step {step:.2f} ms" if stats.finite(step) else "step ?")
    return (f"[{done:>{width}}/{total}] {name:<17} lr {lr_text(row.get('lr')):<8} seed {row.get('seed')} "
            f"({row.get('phase', '')}): val {val_text}  {step_text}  run {duration(row.get('wall_s'))}  "
            f"elapsed {duration(elapsed)}, about {duration(left)} left")


class RunLines:
    """One line per optimizer set up, per finished run, the pick, and failures, on stderr: for logs
    (stdout not a terminal)."""

    def __init__(self, total: int, estimate: RemainingTime, stream: TextIO | None = None) -> None:
        self.total = total
        self.estimate = estimate
        self.stream = stream or sys.stderr
        self.done = 0
        self.start = time.perf_counter()
        self.log: list[tuple[float, float]] = []
        self.said: set[str] = set()  # optimizers whose failure was printed while it ran

    def __enter__(self) -> RunLines:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def write(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def begin(self, name: str) -> None:
        self.estimate.start(name)

    def event(self, name: str, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "setup":
            self.estimate.setup(name, event.get("runs"))
            left = self.estimate.estimate()
            runs = event.get("runs")
            self.write(f"{'':>{2 * len(str(self.total)) + 3}} {name}: set up in {duration(event.get('setup_s'))} "
                       f"(imports, data, warm-up){'' if runs is None else f'; {runs} runs to train'}"
                       + (f"; elapsed {duration(time.perf_counter() - self.start)}, about {duration(left)} left"
                          if left is not None else ""))
        elif kind == "step":
            self.estimate.step(name, event["step"] / max(event.get("total") or 1, 1))
        elif kind == "run":
            self.estimate.run(name)
            self.done += 1
            elapsed = time.perf_counter() - self.start
            left = self.estimate.estimate()
            if left is not None:
                self.log.append((elapsed, left))
            self.write(run_line(name, event["row"], self.done, self.total, elapsed, left))
        elif kind == "widen":
            self.estimate.more(name)
            self.total += 1
            self.write(f"{'':>{2 * len(str(self.total)) + 3}} {name}: lr {lr_text(event.get('edge'))} is the edge of "
                       f"its grid: trying {lr_text(event.get('lr'))} too")
        elif kind == "picked":
            lr = event.get("lr")
            self.write(f"{'':>{2 * len(str(self.total)) + 3}} {name}: picked lr {lr_text(lr)}"
                       if lr is not None else f"{name}: every lr of the grid diverged")

    def row(self, row: dict[str, Any]) -> None:
        """An optimizer's row is done. A failure is said as it happens; a skipped optimizer (known
        before any run) is left to the list after the table, which names every one once."""
        self.estimate.end(row["optimizer"])
        if row["status"] not in ("ok", "skipped"):
            self.write(f"{row['optimizer']}: {row['status']} — {row.get('reason')}")
            self.said.add(row["optimizer"])


class RunBars(RunLines):
    """rich bars on a terminal: all runs (with the time left), and each running optimizer's run."""

    def __init__(self, total: int, estimate: RemainingTime, console: Any) -> None:
        super().__init__(total, estimate)
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = console
        self.progress = Progress(
            TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[note]}"), TimeElapsedColumn(), console=console,
        )
        self.overall = self.progress.add_task("all runs", total=total, note="")
        self.bars: dict[str, Any] = {}

    def __enter__(self) -> RunBars:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def write(self, text: str) -> None:
        self.progress.console.print(text, markup=False, highlight=False)

    def begin(self, name: str) -> None:
        super().begin(name)
        self.bars[name] = self.progress.add_task(f"{name} (set-up)", total=None, note="")

    def event(self, name: str, event: dict[str, Any]) -> None:
        kind = event.get("event")
        bar = self.bars.get(name)
        if kind == "step" and bar is not None:
            self.estimate.step(name, event["step"] / max(event.get("total") or 1, 1))
            loss = event.get("loss")
            self.progress.update(bar, completed=event["step"], total=event.get("total"),
                                 note="loss nan" if loss is None else f"loss {loss:.3f}")
            return
        if kind == "run":
            self.estimate.run(name)
            self.done += 1
            elapsed = time.perf_counter() - self.start
            left = self.estimate.estimate()
            if left is not None:
                self.log.append((elapsed, left))
            self.progress.update(self.overall, completed=self.done, note=f"about {duration(left)} left")
            self.write(run_line(name, event["row"], self.done, self.total, elapsed, left))
            if bar is not None:
                self.progress.update(bar, completed=0)
            return
        if kind == "step":
            return
        super().event(name, event)
        if kind == "widen":
            self.progress.update(self.overall, total=self.total)
        if kind == "setup" and bar is not None:
            self.progress.update(bar, description=f"{name}", completed=0)

    def row(self, row: dict[str, Any]) -> None:
        super().row(row)
        bar = self.bars.pop(row["optimizer"], None)
        if bar is not None:
            self.progress.remove_task(bar)
