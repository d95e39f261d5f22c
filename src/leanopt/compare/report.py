"""The comparison's outputs: ``results.json``, ``report.md`` and the terminal table."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from leanopt import tables
from leanopt.compare import stats
from leanopt.compare.progress import duration, lr_text
from leanopt.compare.protocol import MODES
from leanopt.compare.runner import REFERENCES, Comparison, _finite
from leanopt.writing import write_text_atomically

MiB = 1024**2
FORMAT = "leanopt-compare/2"

TOO_SHORT_RULE = (
    f"Too short to decide: AdamW's accuracy closes under {100 * stats.NEAR_CHANCE:.0f}% of the gap between always answering "
    "the most common validation label and 100%, or its training loss (the mean over seeds) still fell by more than "
    f"{100 * stats.STILL_FALLING:.0f}% over the last third of the steps (a least-squares line, its slope below zero at "
    f"p < {stats.ALPHA:g}); the verdicts are then given but no optimizer is recommended by its loss"
)

MEASURES = {
    "lr": "the pick: the grid point with the lowest validation loss on the first seed (lr_grid, grid_val_loss); "
    "'relative' is Adafactor's own relative step size (no external schedule)",
    "val_loss_mean": "validation loss after training, mean ± sample std over the seeds at the picked lr "
    "(val_losses: each seed's; the first seed's run is the grid's)",
    "final_loss_mean": "mean training loss over the last 10 steps, mean over the seeds",
    "verdict": stats.VERDICT_RULE,
    "state_bytes": "bytes of optimizer state after the last step, leanopt.measure(optimizer) "
    "(each storage once; quantized and nested states followed)",
    "step_ms_median": "median wall time of optimizer.step() (step hooks; CUDA synchronized) over every timed step "
    "of every run of the optimizer (grid and seeds), leaving out each run's first steps; step_ms_q1/q3: the "
    "quartiles, step_ms_min/max: the extremes",
    "first_step_ms": "the first optimizer.step() of the process's first measured run (lazy state creation)",
    "setup_s": "seconds of the warm-up, once per optimizer before any measured run: a throwaway model's forward, "
    "backward and step (imports, first-use set-up, the optimizer compiling its update)",
    "train_step_ms_median": "median wall time of a whole training step: forward, backward, step, schedule, zero_grad",
    "mode": "the training mode: the precision (fp32; bf16-mixed: fp32 weights under bf16 autocast; bf16: pure bf16 "
    "weights and gradients with the optimizer's rounding) and whether gradients are released (stepped inside "
    "backward; step_ms is then not measured, train_step_ms is)",
    "peak_rss_bytes": "CPU: the process's peak anonymous resident set over the same steps, above the same baseline "
    "(what the operating system sees, allocator included; it moves by several percent between identical runs, "
    "which the tensor peak does not)",
    "kept_bytes_per_param": "(param_bytes + grad_bytes + state_bytes) / params: weights, the gradients alive between "
    "the first backward and its step (grad_bytes; 0 under gradient release) and the optimizer state",
}


def _order(row: dict[str, Any]) -> tuple[int, int]:
    if row["status"] == "ok":
        return (0, row["rank"]) if "rank" in row else (1, 0)
    return ({"diverged": 2, "failed": 3, "skipped": 4}.get(row["status"], 5), 0)


def ordered(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ranked rows first (best mean validation loss first), then diverged, failed and skipped ones."""
    return sorted(rows, key=_order)


def reference_state(rows: list[dict[str, Any]], name: str | None = None) -> tuple[str, int] | None:
    """The reference's name and state bytes: ``name`` (the verdict's reference), else the first
    of :data:`REFERENCES` that ran."""
    for candidate in ([name] if name else []) + list(REFERENCES):
        for r in rows:
            if r["optimizer"] == candidate and r["status"] == "ok" and r.get("state_bytes"):
                return candidate, r["state_bytes"]
    return None


def command_line(comparison: Comparison, out: str, *, lr_given: bool = False, threads: int | None = None,
                 names_given: bool = True, seeds_given: bool = False, grid_given: bool = False, jobs: int = 1,
                 prog: str = "leanopt compare") -> str:
    """The command that reruns this comparison (``--optimizers`` left out when it was the default)."""
    plan = comparison.plan
    parts = [prog, "--task", plan.task]
    if names_given:
        parts += ["--optimizers", ",".join(comparison.optimizers)]
    parts += ["--steps", str(plan.steps), "--device", plan.device, "--seed", str(plan.seeds[0]), "--out", out]
    if seeds_given:
        parts += ["--seeds", str(len(plan.seeds))]
    if grid_given:
        parts += ["--lr-grid", ",".join(f"{m:.4g}" for m in plan.lr_multipliers)]
    if threads:
        parts += ["--threads", str(threads)]
    if jobs != 1:
        parts += ["--jobs", str(jobs)]
    if lr_given:
        parts += ["--lr", repr(plan.lr)]
    if plan.precision != "fp32":
        parts += ["--precision", plan.precision]
    if plan.quick:
        parts.append("--quick")
    return " ".join(parts)


def to_json(comparison: Comparison, command: str, plots: list[str], plot_note: str | None) -> dict[str, Any]:
    plan = comparison.plan
    return _finite({
        "format": FORMAT,
        "task": {"name": plan.task, "description": comparison.description, "sizes": plan.sizes},
        "settings": plan.to_dict(),
        "command": command,
        "environment": comparison.environment,
        "measured": dict(MEASURES, peak_bytes=comparison.memory_method),
        "verdict_rule": stats.VERDICT_RULE,
        "reference": comparison.reference,
        "too_short": comparison.too_short,
        "jobs": comparison.jobs,
        "wall_s": comparison.wall_s,
        "plots": plots,
        "plot_note": plot_note,
        "results": comparison.rows,
        "recommendation": recommendation({"results": comparison.rows, "reference": comparison.reference,
                                          "too_short": comparison.too_short}),
        "memory_notes": memory_notes({"results": comparison.rows, "reference": comparison.reference}),
    })


def write_json(data: dict[str, Any], path: Path) -> None:
    """``results.json``, atomically: the old file or the whole new one (a :class:`WriteError`
    naming the cause when it cannot be written)."""
    write_text_atomically(path, json.dumps(_finite(data), indent=1) + "\n")


# ---- formatting --------------------------------------------------------------------------------
def _mib(x: Any) -> str:
    return "" if x is None else f"{x / MiB:.2f}"


def _num(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "nan" if isinstance(x, float) else ""
    return f"{x:.{digits}f}"


def _ms(x: Any) -> str:
    return "" if x is None else (f"{x:.2f}" if x < 10 else f"{x:.1f}")


def _pm(mean: Any, std: Any, digits: int = 3) -> str:
    if mean is None:
        return ""
    return _num(mean, digits) + ("" if std is None else f" ± {_num(std, digits)}")


# "process peak MiB" (what the operating system gives the process: the allocator's free lists,
# caches and native workspaces included) beside "tensor peak MiB" (the live tensors alone): a
# saving in the second is one the user's machine sees only as far as the first shows it.
COLUMNS = ["rank", "optimizer", "mode", "lr (pick)", "val loss (mean ± std)", "verdict vs AdamW", "val loss vs ref",
           "95% CI of the gap", "final loss", "state MiB", "B/param", "vs AdamW", "weights+grads+state B/param",
           "process peak MiB", "tensor peak MiB", "step ms median [IQR]", "first step ms", "set-up s", "accuracy",
           "F1 (macro)", "F1 vs AdamW"]
TERMINAL_COLUMNS = {"rank", "optimizer", "mode", "lr (pick)", "val loss (mean ± std)", "verdict vs AdamW",
                    "val loss vs ref", "state MiB", "vs AdamW", "weights+grads+state B/param", "process peak MiB",
                    "tensor peak MiB", "step ms median [IQR]", "accuracy", "F1 (macro)", "F1 vs AdamW"}
TEXT_COLUMNS = {"optimizer", "mode", "verdict vs AdamW", "lr (pick)", "F1 vs AdamW"}
# Cells of several words ("2.354 ± 0.005", "cannot decide (p = 0.059)"), which may wrap at their
# spaces in a narrow terminal (onto two lines at most: leanopt.tables); the others (names, single
# figures) are never broken.
WRAPPED_COLUMNS = {"mode", "lr (pick)", "val loss (mean ± std)", "verdict vs AdamW", "95% CI of the gap",
                   "step ms median [IQR]", "accuracy", "F1 (macro)", "F1 vs AdamW"}


def _cells(r: dict[str, Any], ref: tuple[str, int] | None, digits: int = 3,
           ref_loss: float | None = None, seeds: int | None = None) -> dict[str, str]:
    ratio = f"{r['state_bytes'] / ref[1]:.3f}" if ref and r.get("state_bytes") is not None else ""
    pick = lr_text(r.get("lr")) + (" (edge)" if r.get("lr_at_grid_edge") else "")
    if r.get("release"):
        step = "in backward"  # released: the update runs inside backward, step() is a no-op
    else:
        step = _ms(r.get("step_ms_median"))
        if r.get("step_ms_q1") is not None:
            step += f" [{_ms(r['step_ms_q1'])}–{_ms(r['step_ms_q3'])}]"
    acc, acc_std = r.get("accuracy_mean"), r.get("accuracy_std")
    return {
        "rank": str(r.get("rank", "-")),
        "optimizer": r["optimizer"],
        "mode": r.get("mode") or "",
        "lr (pick)": pick,
        # the seed count where it is not the plan's (a seed that failed)
        "val loss (mean ± std)": _pm(r.get("val_loss_mean"), r.get("val_loss_std"), digits)
        + ("" if len(r.get("seeds") or []) == seeds else f" (n={len(r.get('seeds') or [])})"),
        "verdict vs AdamW": r.get("verdict") or "",
        "95% CI of the gap": "" if not r.get("ci") else f"{r['ci'][0]:+.{digits}f} to {r['ci'][1]:+.{digits}f}",
        "val loss vs ref": (f"{100 * r['delta'] / ref_loss:+.2f} %" if stats.finite(r.get("delta")) and ref_loss
                            and r.get("verdict") != stats.REFERENCE else ""),
        "final loss": _pm(r.get("final_loss_mean"), r.get("final_loss_std")),
        "state MiB": _mib(r.get("state_bytes")),
        "B/param": _num(r.get("state_bytes_per_param"), 2),
        "vs AdamW": ratio,
        "weights+grads+state B/param": _num(r.get("kept_bytes_per_param"), 2),
        "process peak MiB": _mib(r.get("peak_rss_bytes")),
        "tensor peak MiB": _mib(r.get("peak_bytes")),
        "step ms median [IQR]": step,
        "first step ms": _ms(r.get("first_step_ms")),
        "set-up s": _num(r.get("setup_s"), 1),
        "accuracy": "" if acc is None else f"{100 * acc:.1f}" + ("" if acc_std is None else f" ± {100 * acc_std:.1f}") + "%",
        "F1 (macro)": _pm(r.get("f1_mean"), r.get("f1_std")),
        "F1 vs AdamW": r.get("f1_verdict") or "",
    }


def _has_modes(data: dict[str, Any]) -> bool:
    ok = [r for r in data["results"] if r["status"] == "ok"]
    return any(r.get("precision", "fp32") != "fp32" or r.get("release") for r in ok)


def columns(data: dict[str, Any]) -> list[str]:
    """The report's columns: ``mode`` only when some row trains in a mode other than fp32,
    ``accuracy`` only when the task has labels."""
    ok = [r for r in data["results"] if r["status"] == "ok"]
    has_acc = any(r.get("accuracy_mean") is not None for r in ok)
    has_kept = any(r.get("kept_bytes_per_param") is not None for r in ok)
    drop = {"mode", "val loss vs ref"} if not _has_modes(data) else set()
    if not has_acc:
        drop.add("accuracy")
    if not any(r.get("f1_mean") is not None for r in ok):
        drop |= {"F1 (macro)", "F1 vs AdamW"}
    if not has_kept:
        drop.add("weights+grads+state B/param")
    if not any(r.get("peak_rss_bytes") is not None for r in ok):
        drop.add("process peak MiB")
    if not any(r.get("ci") for r in ok):
        drop.add("95% CI of the gap")
    return [c for c in COLUMNS if c not in drop]


def table_rows(data: dict[str, Any], *, markdown: bool = False) -> list[list[str]]:
    ref = reference_state(data["results"], data.get("reference"))
    cols = columns(data)
    # Modes differ by a few thousandths of a nat: four decimals there.
    digits = 4 if _has_modes(data) else 3
    by_name = {r["optimizer"]: r for r in data["results"]}
    ref_loss = by_name.get(data.get("reference") or "", {}).get("val_loss_mean")
    seeds = len(data["settings"].get("seeds") or [])
    return [[cells[c] for c in cols] for cells in (_cells(r, ref, digits, ref_loss, seeds) for r in ordered(data["results"])
                                                    if r["status"] == "ok")]


def not_run(data: dict[str, Any], leave_out: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """One line per reason: the optimizers not ranked for it (``leave_out``: those already said)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for r in ordered(data["results"]):
        if (r["status"] != "ok" or r.get("diverged")) and r["optimizer"] not in leave_out:
            key = (r["status"], r.get("reason") or "diverged at its pick")
            groups.setdefault(key, []).append(r["optimizer"])
    return [f"{', '.join(names)} ({status}): {reason}" for (status, reason), names in groups.items()]


def print_table(data: dict[str, Any], console: Console, said: set[str] | frozenset[str] = frozenset()) -> None:
    """The table, then each optimizer not ranked, once (``said``: those whose failure the
    progress display printed already); :func:`print_recommendation` ends the output."""
    settings = data["settings"]
    table = tables.new_table(f"leanopt compare: {settings['task']} ({settings['steps']} steps, {settings['device']}, "
                             f"seeds {','.join(map(str, settings['seeds']))}; val loss over "
                             f"{len(settings['seeds'])} seeds)")
    cols = columns(data)
    shown = TERMINAL_COLUMNS if _has_modes(data) else TERMINAL_COLUMNS - {"weights+grads+state B/param"}
    keep = [i for i, c in enumerate(cols) if c in shown]  # report.md has them all
    numeric = set(cols) - TEXT_COLUMNS
    for i in keep:
        table.add_column(cols[i], justify="right" if cols[i] in numeric else "left",
                         overflow="fold" if cols[i] in WRAPPED_COLUMNS else "ellipsis")  # fmt: skip
    for row in table_rows(data):
        table.add_row(*(row[i] for i in keep))
    # A narrow terminal gets stacked tables, each led by the rank, the optimizer and its mode.
    tables.print_table(console, table, keys=sum(cols[i] in ("rank", "optimizer", "mode") for i in keep))
    for line in not_run(data, said):
        console.print(f"[yellow]not ranked[/yellow] {escape(line)}")
    for line in data.get("memory_notes") or []:
        console.print(f"[yellow]memory[/yellow] {escape(line)}")


def print_recommendation(data: dict[str, Any], console: Console) -> None:
    if data.get("recommendation"):
        console.print(f"[bold]What to use[/bold]: {escape(data['recommendation'])}")


def kept_bytes(row: dict[str, Any]) -> int | None:
    """What persists through a step: weights + the gradients alive before it + the state (the
    state alone where the others are not known)."""
    parts = [row.get(k) for k in ("param_bytes", "grad_bytes", "state_bytes")]
    known = [p for p in parts if isinstance(p, int)]
    return sum(known) if len(known) == len(parts) else row.get("state_bytes")


def _saving(mine: Any, theirs: Any) -> str:
    if not (stats.finite(mine) and stats.finite(theirs)) or not theirs:
        return ""
    return f"{mine / MiB:.1f} MiB against {theirs / MiB:.1f} ({(mine - theirs) / MiB:+.1f} MiB, {100 * (mine - theirs) / theirs:+.0f} %)"


def _memory(row: dict[str, Any], ref: dict[str, Any]) -> str:
    """What ``row`` keeps against ``ref``: the state, and the peaks the process and its tensors
    reached (a process peak that is not lower is said so: that saving is not one the machine sees)."""
    text = f"optimizer state {_saving(row.get('state_bytes'), ref.get('state_bytes'))}"
    kept = _saving(kept_bytes(row), kept_bytes(ref))
    if kept and kept_bytes(row) != row.get("state_bytes"):
        text += f"; weights + gradients + state {kept}"
    process = _saving(row.get("peak_rss_bytes"), ref.get("peak_rss_bytes"))
    tensors = _saving(row.get("peak_bytes"), ref.get("peak_bytes"))
    if process:
        text += f"; process peak {process}"
        if row["peak_rss_bytes"] >= ref["peak_rss_bytes"]:
            text += " (no lower: the process does not see the saving, see the memory note)"
        if tensors:
            text += f", tensor peak {tensors}"
    elif tensors:
        text += f"; peak {tensors}"
    return text


def memory_notes(data: dict[str, Any]) -> list[str]:
    """Why an optimizer that keeps less state than the reference does not lower the process's peak
    by at least half of it (CPU rows, where the process peak is measured): what the process held
    beyond its live tensors, against the reference's."""
    ok = {r["optimizer"]: r for r in data["results"] if r["status"] == "ok"}
    ref = ok.get(data.get("reference") or "")
    if ref is None or not all(stats.finite(ref.get(k)) for k in ("state_bytes", "peak_rss_bytes", "peak_bytes")):
        return []
    notes = []
    for r in ok.values():
        if not all(stats.finite(r.get(k)) for k in ("state_bytes", "peak_rss_bytes", "peak_bytes")):
            continue
        saved = ref["state_bytes"] - r["state_bytes"]
        lower = ref["peak_rss_bytes"] - r["peak_rss_bytes"]
        if saved <= 0 or lower >= saved / 2:
            continue
        beyond, ref_beyond = r["peak_rss_bytes"] - r["peak_bytes"], ref["peak_rss_bytes"] - ref["peak_bytes"]
        notes.append(
            f"{r['optimizer']} keeps {saved / MiB:.1f} MiB less state than {ref['optimizer']}, but its process peak is "
            f"{r['peak_rss_bytes'] / MiB:.1f} MiB against {ref['peak_rss_bytes'] / MiB:.1f} ({-lower / MiB:+.1f} MiB), not lower "
            f"by half the saving: its tensor peak is {r['peak_bytes'] / MiB:.1f} MiB against {ref['peak_bytes'] / MiB:.1f} "
            f"({(r['peak_bytes'] - ref['peak_bytes']) / MiB:+.1f}), and the process held {beyond / MiB:.1f} MiB beyond its live "
            f"tensors against {ref_beyond / MiB:.1f} for {ref['optimizer']}: memory outside tensors (the allocator's retained "
            "blocks, compiled or native kernels and their workspaces, thread pools) that its first steps added")
    return notes


def recommendation(data: dict[str, Any]) -> str | None:
    """What to use: of the optimizers equal within the margin to the reference (or better) by the
    verdict on the validation loss and, where the task scores one, not worse on the F1, the one
    that keeps the least memory (weights + gradients + state; then the lower peak), and what it
    saves, the process's peak first. A run too short to rank by loss (``too_short``) says so and
    names the one that keeps the least memory, no more."""
    ok = {r["optimizer"]: r for r in data["results"] if r["status"] == "ok" and not r.get("diverged")}
    ref = ok.get(data.get("reference") or "")
    if ref is None:
        return None

    def lighter(r: dict[str, Any]) -> tuple[float, float, float]:
        return (kept_bytes(r) or math.inf, r.get("peak_rss_bytes") or r.get("peak_bytes") or math.inf, r["val_loss_mean"])

    if data.get("too_short"):
        least = min((r for r in ok.values() if kept_bytes(r) is not None), key=lighter, default=ref)
        text = (f"Too short to decide which trains as well as `{ref['optimizer']}`: {data['too_short']}; run the full "
                "protocol (without --quick) or more --steps.")
        if least is not ref:
            text += f" On memory alone, `{least['optimizer']}` keeps the least: {_memory(least, ref)}."
        return text

    def level(r: dict[str, Any]) -> bool:
        return r is ref or (r.get("verdict_kind") in ("equal", "better") and r.get("f1_verdict_kind") != "worse")

    candidates = [r for r in ok.values() if level(r) and kept_bytes(r) is not None]
    best = min(candidates, key=lighter)
    if best is ref:
        lighter_ones = [r for r in ok.values() if r is not ref and lighter(r) < lighter(ref)]
        untested = [r for r in lighter_ones if r.get("verdict_kind") == "untested"]
        undecided = [r for r in lighter_ones if r.get("verdict_kind") == "undecided"]
        if untested:
            why = "with one seed there is no test (use --seeds 2 or more)"
        elif undecided:
            names = ", ".join(f"`{r['optimizer']}`" for r in undecided)
            why = (f"the evidence cannot decide whether {names}, which keep less "
                   "memory, train as well (" + "; ".join(f"{r['optimizer']}: {r['verdict']}" for r in undecided)
                   + "); more --seeds or --steps would tell")
        else:
            why = f"no optimizer that keeps less memory is equal within {100 * stats.MARGIN:.0f}% or better here"
        return f"Use `{ref['optimizer']}`: {why}."
    text = (f"Use `{best['optimizer']}` (lr {lr_text(best.get('lr'))}): {best['verdict']} against `{ref['optimizer']}` "
            f"on validation loss ({best['val_loss_mean']:.3f} ± {best.get('val_loss_std') or 0:.3f} against "
            f"{ref['val_loss_mean']:.3f} ± {ref.get('val_loss_std') or 0:.3f})")
    if stats.finite(best.get("f1_mean")) and stats.finite(ref.get("f1_mean")):
        text += (f" and {best.get('f1_verdict')} on macro F1 ({best['f1_mean']:.3f} ± {best.get('f1_std') or 0:.3f} against "
                 f"{ref['f1_mean']:.3f} ± {ref.get('f1_std') or 0:.3f})")
    text += f", with the least memory of those: {_memory(best, ref)}."
    if best.get("lr_at_grid_edge"):
        text += " Its lr is at the edge of its grid, so it may do better still outside it."
    return text


def grid_rows(data: dict[str, Any]) -> list[str]:
    out = []
    for r in ordered(data["results"]):
        if r.get("lr_grid"):
            pairs = []
            for lr, loss in zip(r["lr_grid"], r.get("grid_val_loss") or []):
                text = f"{lr_text(lr)}: {_num(loss) if stats.finite(loss) else 'diverged'}"
                pairs.append(f"**{text}**" if lr == r.get("lr") else text)
            edge = " (edge)" if r.get("lr_at_grid_edge") else ""
            out.append(f"| {r['optimizer']} | {', '.join(pairs)} | {lr_text(r.get('lr'))}{edge} |")
    return out


def mode_note(data: dict[str, Any]) -> list[str]:
    """What the training modes in the table mean (nothing when every row is plain fp32)."""
    if not _has_modes(data):
        return []
    precision = data["settings"].get("precision", "fp32")
    used = [precision] if precision != "fp32" else []
    for r in data["results"]:
        for part in r["optimizer"].split("+")[1:]:
            if part in MODES and part not in used:
                used.append(part)
    intro = (f"Training modes: an optimizer named without a mode trains in `{precision}` (`--precision`); "
             "`name+mode` sets the mode. \"val loss vs ref\": the mean validation loss relative to the "
             "reference's. \"weights+grads+state B/param\": parameter bytes, the gradient bytes alive between the "
             "first backward and its step (none under release), and the optimizer state, per parameter; "
             "`tensor peak MiB` adds activations and temporaries (autocast's bf16 weight copies included).")
    lines = [intro, ""]
    lines += [f"- `{m}`: {MODES[m]}" for m in used]
    return lines + [""]


def timing_note(data: dict[str, Any]) -> list[str]:
    load = data.get("load") or {}
    lines = []
    if data.get("resumed_runs"):
        lines += [f"{data['resumed_runs']} run(s) were resumed from `runs.jsonl` (`--resume`): measured by the "
                  "interrupted comparison, under its load.", ""]
    if load.get("warning"):
        lines += [f"**Warning: {load['warning']}.**", ""]
    elif load.get("samples"):
        lines += [f"Load during the run: 1-minute load average {load['mean']:.1f} on average (max {load['max']:.1f}) "
                  f"on {load['cores']} cores; not over the core count.", ""]
    return lines


def eta_note(data: dict[str, Any]) -> list[str]:
    check = (data.get("eta") or {}).get("check")
    if not check:
        return []
    held = "held within 2x" if check["within_2x"] else "did not hold within 2x"
    return [f"Progress: the remaining-time estimate {held} ({check['estimates']} estimates, estimate/actual "
            f"{check['ratio_min']:.2f}–{check['ratio_max']:.2f}, leaving out the last 10% of the run).", ""]


def markdown(data: dict[str, Any]) -> str:
    s, env, task = data["settings"], data["environment"], data["task"]
    ok = [r for r in data["results"] if r["status"] == "ok"]
    params = ok[0]["params"] if ok else None
    ref = reference_state(data["results"], data.get("reference"))
    cols = columns(data)
    if s.get("fixed_lr"):
        protocol = f"one lr for all, {s['lr']:g} (not tuned: rankings at one shared lr mislead, see docs/compare.md)"
    elif len(s["lr_multipliers"]) == 1 and not s.get("relative_step"):
        protocol = f"each optimizer at {s['lr_multipliers'][0]:.3g} × its usual lr (a one-point grid: not tuned)"
    else:
        protocol = ("each optimizer's lr tuned on the grid " +
                    ", ".join(f"{m:.3g}" for m in s["lr_multipliers"]) + " × its usual lr"
                    + (" plus Adafactor's relative step" if s.get("relative_step") else "")
                    + f", picked by validation loss on seed {s['seeds'][0]}")
    lines = [
        f"# leanopt compare: `{task['name']}`",
        "",
        f"{task['description']}.",
        f"{'' if params is None else f'{params:,} parameters, '}{s['steps']} steps of batch {s['batch_size']} "
        f"(linear warm-up over {s['warmup_steps']} step{'s' if s['warmup_steps'] != 1 else ''}, then cosine to 0), "
        f"weight decay {s['weight_decay']:g} (none on biases and norms); {protocol}; then the pick repeated on "
        f"seeds {', '.join(map(str, s['seeds']))} (seed: initial weights and batch order, the same for every "
        "optimizer).",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "|".join("---" if c in TEXT_COLUMNS else "---:" for c in cols) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(data)]
    lines.append("")
    if data.get("recommendation"):
        lines += [f"**What to use.** {data['recommendation']}", ""]
    if data.get("memory_notes"):
        lines += ["**Memory.** " + " ".join(data["memory_notes"]) + ".", ""]
    if data.get("reference"):
        lines.append(f"Verdict: against `{data['reference']}`. {stats.VERDICT_RULE}."
                     + (" \"F1 vs AdamW\": the same rule on the macro F1, higher better." if "F1 vs AdamW" in cols else "")
                     + f" {TOO_SHORT_RULE}.")
        lines.append("")
    lines += mode_note(data)
    if ref:
        lines.append(f"\"vs AdamW\" is state bytes relative to `{ref[0]}`. Rank: by mean validation loss. "
                     "\"(edge)\": the pick is the grid's smallest or largest lr, so the best may lie outside it.")
        lines.append("")
    skipped = not_run(data)
    if skipped:
        lines += ["Not ranked:", ""] + [f"- {line}" for line in skipped] + [""]
    lines += ["## The lr grid", "", "Validation loss on the first seed at each lr tried, lr: loss (the pick in bold; "
              "`relative`: Adafactor's own relative step).", "", "| optimizer | lr: val loss | pick |", "|---|---|---|"]
    lines += grid_rows(data) + [""]
    if data["plots"]:
        lines += [f"![{Path(p).stem.replace('_', ' ')}]({p})" for p in data["plots"]] + [""]
    elif data.get("plot_note"):
        lines += [f"No plots: {data['plot_note']}.", ""]
    lines += ["## Timings", ""]
    lines += timing_note(data)
    threads = (data.get("threads") or {}).get("note") or (f"{env.get('torch_threads')} torch thread(s) in each of "
                                                          f"{data.get('jobs', 1)} process(es)")
    lines += ["Step times are medians over every timed step of all an optimizer's runs (grid and seeds); the "
              "bracket is the interquartile range. The first step and the set-up (warm-up, compilation) are "
              f"apart. Threads: {threads}.", ""]
    lines += eta_note(data)
    lines += ["## What is measured", ""]
    lines += [f"- `{k}`: {v}" for k, v in data["measured"].items()]
    lines += ["", "## Environment", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in env.items() if v is not None]
    lines += [f"| seeds | {', '.join(map(str, s['seeds']))} |", f"| wall time | {duration(data['wall_s'])} |", "",
              "## Reproduce", "", "```", data["command"],
              "# or: " + data["command"].replace("leanopt compare", "python -m leanopt.compare", 1), "```", ""]
    return "\n".join(lines)
