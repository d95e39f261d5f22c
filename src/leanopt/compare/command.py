"""``leanopt compare``: argument parsing, progress display, and writing the report."""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from leanopt.compare.contenders import DEFAULT_CONTENDERS, contender
from leanopt.compare.plots import write_plots
from leanopt.compare.report import command_line, markdown, print_table, to_json, write_json
from leanopt.compare.runner import compare
from leanopt.compare.tasks import BUILTIN_TASKS, DEFAULT_TASK, TaskUnavailable, get_task

PROG = "leanopt compare"


class UsageError(Exception):
    """A one-line error for the user."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Train the same model on the same data with each optimizer; report state memory, "
        "peak memory, step time, loss curves and validation loss (results.json, report.md, PNGs).",
    )
    parser.add_argument("--task", default=DEFAULT_TASK,
                        help=f"{', '.join(BUILTIN_TASKS)}, or hf:<model>:<dataset> (needs the network) "
                        f"(default {DEFAULT_TASK})")
    parser.add_argument("--optimizers", default=None,
                        help="comma-separated names; unavailable ones are skipped with the reason "
                        f"(default: {','.join(DEFAULT_CONTENDERS)}; with --quick on the CPU the torchao ones "
                        "are left out unless named, for their compile time)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the task's)")
    parser.add_argument("--device", default=None,
                        help="cpu or cuda (default: cuda when available); on CUDA the task sizes scale up")
    parser.add_argument("--out", default="out/compare", help="output directory (default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes: the default task with every default optimizer in about 3 minutes "
                        "on 2 CPU cores")
    parser.add_argument("--seed", type=int, default=0, help="initial weights and data order (default: 0)")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate for all (default: the task's)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads in each run (default: torch's; 1 gives steadier timings "
                        "on a machine shared with other work)")
    parser.add_argument("--no-isolate", dest="isolate", action="store_false",
                        help="run every optimizer in this process (faster start; CPU peaks then depend on order)")
    return parser


def fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """``leanopt compare`` (and ``python -m leanopt.compare``); returns the exit status.

    Errors in the arguments or the task (an unknown name, no network for ``hf:``) exit with 2
    and one line on stderr; 1 when no optimizer finished; 0 otherwise.
    """
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # --help
        return int(exit_.code or 0)
    except UsageError as err:
        return fail(str(err))
    problem = _argument_problem(args)
    if problem:
        return fail(problem)
    try:
        return _run(args)
    except OSError as err:  # the output directory cannot be written
        return fail(str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)
    except KeyboardInterrupt:
        return 130


def _argument_problem(args: argparse.Namespace) -> str | None:
    """What the run would only trip over after training, found before it starts (None: nothing)."""
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        return f"--lr {args.lr}: the learning rate must be a finite number > 0"
    if args.steps is not None and args.steps < 1:
        return f"--steps {args.steps}: must be at least 1"
    target = os.path.abspath(args.out)
    folder = target
    while not os.path.exists(folder):  # the nearest existing ancestor: where mkdir would start
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        return f"--out {args.out}: " + ("not a folder" if folder == target else f"{folder} is not a folder")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        return f"--out {args.out}: cannot write in {folder}: {(err.strerror or str(err)).lower()}"
    return None


def _run(args: argparse.Namespace) -> int:
    names = [n.strip().lower() for n in (args.optimizers or ",".join(DEFAULT_CONTENDERS)).split(",") if n.strip()]
    if not names:
        return fail("--optimizers is empty")
    if args.threads is not None and args.threads < 1:
        return fail("--threads must be at least 1")
    try:
        for name in names:
            contender(name)
        task = get_task(args.task)
        task.check()
    except (ValueError, TaskUnavailable) as e:
        return fail(str(e))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        return fail(f"--device {device}: CUDA is not available here")
    if not (device == "cpu" or device.startswith("cuda")):
        return fail(f"--device {device}: expected cpu or cuda")
    try:
        plan = task.plan(device=device, quick=args.quick, seed=args.seed, steps=args.steps, lr=args.lr)
    except ValueError as e:
        return fail(str(e))
    plan.threads = args.threads
    skip = {}
    if args.optimizers is None and plan.quick and device == "cpu":
        skip = {n: c.slow_on_cpu for n in names if (c := contender(n)).slow_on_cpu}

    # Piped output keeps the whole table instead of squeezing it to 80 columns.
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 150)
    console.print(f"[bold]{PROG}[/bold]: {task.name} — {task.description}; {plan.steps} steps on {device}, "
                  f"seed {plan.seed}{' (quick)' if plan.quick else ''}")
    start = time.perf_counter()
    progress = Progress(
        TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(), console=console,
    )
    bars: dict[str, TaskID] = {}
    current: list[str] = []

    def on_start(name: str) -> None:
        current[:] = [name]
        bars[name] = progress.add_task(name, total=plan.steps, loss="…")

    def on_event(event: dict[str, Any]) -> None:
        if event.get("event") == "step" and current:
            loss = event.get("loss")
            progress.update(bars[current[0]], completed=event["step"],
                            loss="nan" if loss is None else f"{loss:.3f}")

    def on_row(row: dict[str, Any]) -> None:
        if row["status"] != "ok":
            progress.console.print(f"[yellow]{row['optimizer']}: {row['status']}[/yellow] — {row['reason']}",
                                   markup=True, highlight=False)

    with progress:
        result = compare(plan, names, isolate=args.isolate, skip=skip, on_start=on_start, on_event=on_event, on_row=on_row)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = command_line(result, args.out, lr_given=args.lr is not None, threads=args.threads,
                           names_given=args.optimizers is not None)
    data = to_json(result, command, [], None)
    plots, note = write_plots(data, out)
    data.update(plots=plots, plot_note=note)
    write_json(data, out / "results.json")
    (out / "report.md").write_text(markdown(data))
    print_table(data, console)
    if note:
        console.print(f"no plots: {note}")
    written = ", ".join(str(out / f) for f in ["results.json", "report.md", *plots])
    console.print(f"wrote {written} in {time.perf_counter() - start:.0f} s")
    return 0 if any(r["status"] == "ok" for r in result.rows) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
