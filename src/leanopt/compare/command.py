"""``leanopt compare``: argument parsing, progress display, and writing the report."""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from leanopt import tables
from leanopt.arguments import Parser, UsageError
from leanopt.compare.progress import LoadMonitor, RemainingTime, RunBars, RunLines, eta_check, load_summary, threads_for, threads_note
from leanopt.compare.protocol import DEFAULT_TASK, LR_MULTIPLIERS, MODES, PRECISIONS, SEEDS, check_names

# The arguments are checked before torch and the tasks are imported (seconds): _run imports them.
PROG = "leanopt compare"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog=PROG,
        description="Train the same model on the same data with each optimizer, its learning rate tuned "
        "on a small grid and the best repeated over seeds; report state memory, peak memory, step time, "
        "validation loss (mean ± std) and a verdict against AdamW (results.json, report.md, PNGs).",
    )
    parser.add_argument("--task", default=DEFAULT_TASK,
                        help="%(leanopt.compare.tasks:BUILTIN_TASKS|, )s, or hf:<model>:<dataset> (needs the network) "
                        f"(default {DEFAULT_TASK})")
    parser.add_argument("--optimizers", default=None,
                        help="comma-separated names; unavailable ones are skipped with the reason "
                        "(default: %(leanopt.compare.contenders:DEFAULT_CONTENDERS)s; with --quick on the CPU only leanopt's AdamW and Adafactor "
                        "families and the peers but the torchao ones (their compile time) and torch-adafactor run, "
                        "unless named). A name may add "
                        f"training modes after '+': {', '.join(MODES)}; e.g. adamw+bf16-kahan, adamw8bit+release")
    parser.add_argument("--precision", default="fp32", choices=PRECISIONS,
                        help="what optimizers named without a precision mode train in: fp32, or bf16-mixed "
                        "(fp32 weights under bf16 autocast: the baseline for the pure-bf16 modes) "
                        "(default: %(default)s)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the task's)")
    parser.add_argument("--device", default=None,
                        help="cpu or cuda (default: cuda when available); on CUDA the task sizes scale up")
    parser.add_argument("--out", default="out/compare",
                        help="output directory: runs.jsonl as each run ends, then results.json, report.md, the plots; "
                        "an earlier comparison's files of these names there are replaced, others left alone "
                        "(default: %(default)s)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs that --out's runs.jsonl holds from an interrupted or failed comparison "
                        "with the same settings, and train only the others")
    parser.add_argument("--quick", action="store_true",
                        help=f"small sizes, a {len(LR_MULTIPLIERS[True])}-point lr grid (the MiniLM tasks on the CPU: each "
                        f"optimizer at its usual lr) and {SEEDS[True]} seeds, the default optimizers less the slow ones on the "
                        "CPU (there: leanopt's AdamW and Adafactor families and the peers, less the torchao pair and "
                        "torch-adafactor; for the MiniLM tasks adamw, adamw8bit, adamw4bit, adafactor). Measured on 2 CPU "
                        "cores at load 11-14 (2026-12-03): the default task 12 min 26 s, 4 min 6 s of CPU time; --task "
                        "minilm 11 min 7 s, 3 min 20 s of CPU time. Idle, a run takes about its CPU time (minilm's "
                        "earlier 16-run --quick: 6 min 16 s of CPU time at that load, 6 min 19 s idle on 2026-12-02).")
    parser.add_argument("--seed", type=int, default=0,
                        help="the first seed (initial weights and data order); the lr is tuned on it (default: 0)")
    parser.add_argument("--seeds", type=int, default=None,
                        help=f"seeds at each optimizer's best lr (default {SEEDS[False]}, {SEEDS[True]} with --quick)")
    parser.add_argument("--lr-grid", default=None, metavar="M1,M2,...",
                        help="multipliers of each optimizer's usual lr to try (default "
                        f"{_multipliers(LR_MULTIPLIERS[False])}; {_multipliers(LR_MULTIPLIERS[True])} with --quick, 1 for the MiniLM "
                        "tasks on the CPU)")
    parser.add_argument("--lr", type=float, default=None,
                        help="one peak learning rate for all, no tuning (default: tune each optimizer's)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="optimizers trained at once, one process each (default 1: the steadiest timings)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads in each optimizer's process (default on the CPU: the cores the "
                        "load average leaves free at the start, shared among --jobs, at least 1)")
    parser.add_argument("--no-isolate", dest="isolate", action="store_false",
                        help="run every optimizer in this process (faster start; CPU peaks then depend on order)")
    return parser


def _multipliers(values: list[float]) -> str:
    return ",".join(f"{v:.4g}" for v in values)


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
        check_names(args.task, args.optimizers)
    except ValueError as err:
        return fail(str(err))
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
    if args.seeds is not None and args.seeds < 1:
        return f"--seeds {args.seeds}: must be at least 1"
    if args.jobs < 1:
        return f"--jobs {args.jobs}: must be at least 1"
    if args.lr_grid is not None:
        if args.lr is not None:
            return "--lr-grid and --lr exclude each other (--lr fixes one lr for all)"
        try:
            values = [float(x) for x in args.lr_grid.split(",") if x.strip()]
        except ValueError:
            return f"--lr-grid {args.lr_grid}: expected comma-separated numbers, e.g. 0.5,1,2"
        if not values or not all(math.isfinite(v) and v > 0 for v in values):
            return f"--lr-grid {args.lr_grid}: expected finite numbers > 0"
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
    import torch

    from leanopt.compare.contenders import DEFAULT_CONTENDERS, contender
    from leanopt.compare.output import RunLog, claim, logged_plan, read_runs, settings, write_results
    from leanopt.compare.report import command_line, print_recommendation, print_table, to_json
    from leanopt.compare.runner import compare, runs_left
    from leanopt.compare.tasks import TaskUnavailable, get_task
    from leanopt.kernels.cpu import compile_disabled

    given = [n.strip().lower() for n in (args.optimizers or ",".join(DEFAULT_CONTENDERS)).split(",") if n.strip()]
    if not given:
        return fail("--optimizers is empty")
    if args.threads is not None and args.threads < 1:
        return fail("--threads must be at least 1")
    try:
        # Canonical names (modes in a fixed order), each once.
        names = list(dict.fromkeys(contender(name).name for name in given))
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
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    load_at_start = LoadMonitor.read()
    logged = logged_plan(Path(args.out)) if args.resume else None
    if args.threads is not None:
        plan.threads, threads_by = args.threads, "--threads"
    elif logged is not None and logged.get("threads"):
        # the runs on disk were trained with these; the thread count can move the last digits
        plan.threads, threads_by = int(logged["threads"]), "the resumed runs"
    elif device == "cpu":
        plan.threads, threads_by = threads_for(cores, load_at_start, args.jobs), "the free cores"
    else:
        threads_by = "torch's default"
    plan.precision = args.precision
    if args.seeds is not None:
        plan.seeds = [plan.seed + i for i in range(args.seeds)]
    if args.lr_grid is not None:
        plan.lr_multipliers = sorted({float(x) for x in args.lr_grid.split(",") if x.strip()})
    skip = {}
    if args.optimizers is None and plan.quick and device == "cpu":
        if task.quick_cpu_optimizers is not None:  # the task's own choice, for its own reason
            skip = {n: task.quick_cpu_reason for n in names if n not in task.quick_cpu_optimizers}
        else:
            skip = {n: c.slow_on_cpu for n in names if (c := contender(n)).slow_on_cpu}
    out = Path(args.out)
    run_settings = settings(plan.to_dict())
    try:
        resumed = read_runs(out, run_settings) if args.resume else {}
    except ValueError as e:
        return fail(str(e))
    claim(out, resume=args.resume)
    log = RunLog(out, run_settings, resume=args.resume)

    # Piped output keeps the whole table (150 columns) unless $COLUMNS says how wide to be.
    tty = sys.stdout.isatty()
    console = tables.console(highlight=False, pipe_width=150)
    thread_text = threads_note(plan.threads, args.jobs, threads_by, cores, load_at_start)
    runnable = [n for n in names if n not in skip and contender(n).unavailable() is None]
    planned = {n: runs_left(plan, contender(n), (resumed.get(n) or {}).get("runs") or []) for n in runnable}
    total = sum(planned.values())
    kept = sum(len(r["runs"]) for n, r in resumed.items() if n in runnable)
    grid_text = "lr fixed at " + f"{plan.lr:g}" if plan.fixed_lr else (
        f"lr grid x{_multipliers(plan.lr_multipliers)} of each optimizer's usual lr"
        + (" + Adafactor's relative step" if plan.relative_step else ""))
    precision = "" if plan.precision == "fp32" else f" ({plan.precision} unless a name says otherwise)"
    console.print(f"[bold]{PROG}[/bold]: {task.name} — {task.description}; {plan.steps} steps on {device}{precision}; "
                  f"{grid_text}; seeds {','.join(map(str, plan.seeds))}; {total} runs of {len(runnable)} optimizers"
                  f"{' (quick)' if plan.quick else ''}{f', {kept} more resumed from {log.path}' if kept else ''}"
                  f"{f'; {len(names) - len(runnable)} not run (listed at the end)' if len(names) > len(runnable) else ''}"
                  f"{'' if plan.threads is None else f'; {thread_text}'}")
    start = time.perf_counter()
    compiles = {n: contender(n).cpu_compile_s for n in runnable} if device == "cpu" else {}
    if compile_disabled():  # leanopt's own update runs eagerly
        compiles = {n: s for n, s in compiles.items() if contender(n).origin != "leanopt"}
    estimate = RemainingTime(planned, jobs=args.jobs, compile_s=compiles)
    display = RunBars(total, estimate, console) if tty else RunLines(total, estimate)
    threads = (plan.threads or torch.get_num_threads()) * min(args.jobs, max(1, len(runnable)))

    def on_event(name: str, event: dict) -> None:
        log.record(name, event)  # on disk before anything else sees it
        display.event(name, event)

    try:
        with LoadMonitor() as load, display:
            result = compare(plan, names, isolate=args.isolate, jobs=args.jobs, skip=skip, on_start=display.begin,
                             on_event=on_event, on_row=display.row, resumed=resumed)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; {log.runs} finished run(s) of this comparison are in {log.path} "
              "(the same command with --resume trains only the others)", file=sys.stderr)
        raise
    finally:
        log.close()

    command = command_line(result, args.out, lr_given=args.lr is not None, threads=args.threads,
                           names_given=args.optimizers is not None, seeds_given=args.seeds is not None,
                           grid_given=args.lr_grid is not None, jobs=args.jobs)
    data = to_json(result, command, [], None)
    data["load"] = load_summary(load.samples, cores, threads if device == "cpu" else 1)
    data["threads"] = {"per_process": plan.threads, "jobs": args.jobs, "chosen_by": threads_by, "cores": cores,
                       "load_at_start": load_at_start, "note": thread_text}
    data["eta"] = {"log": [[round(a, 2), round(b, 2)] for a, b in display.log],
                   "check": eta_check(display.log, result.wall_s)}
    data["resumed_runs"] = kept
    plots, note = write_results(data, out)
    print_table(data, console, display.said)
    if data["load"].get("warning"):
        console.print(f"[yellow]warning[/yellow]: {data['load']['warning']}")
    if note:
        console.print(f"no plots: {note}")
    print_recommendation(data, console)
    written = ", ".join(str(out / f) for f in ["runs.jsonl", "results.json", "report.md", *plots])
    console.print(f"wrote {written} in {time.perf_counter() - start:.0f} s")
    return 0 if any(r["status"] == "ok" for r in result.rows) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
