"""The comparison's outputs: ``results.json``, ``report.md`` and the terminal table."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from leanopt.compare.runner import Comparison, _finite

MiB = 1024**2
FORMAT = "leanopt-compare/1"
REFERENCES = ("adamw", "torch-adamw")  # "state vs AdamW" is relative to the first of these that ran

MEASURES = {
    "state_bytes": "bytes of optimizer state after the last step, leanopt.measure(optimizer) "
    "(each storage once; quantized and nested states followed)",
    "step_ms": "mean wall time of optimizer.step() (step hooks; CUDA synchronized), "
    "leaving out the first steps (lazy state, allocator); first_step_ms is the first",
    "setup_s": "seconds of the warm-up before the measured run: a throwaway model's forward, backward and "
    "step with the same optimizer (imports, first-use set-up, the optimizer compiling its update)",
    "train_step_ms": "mean wall time of a whole training step: forward, backward, step, schedule, zero_grad",
    "final_loss": "mean training loss over the last 10 steps",
    "val_loss": "loss on the held-out data after training (and accuracy where the task has labels)",
    "initial_loss": "the first step's loss, before any update: equal for every optimizer "
    "(same initial weights, same first batch)",
}


def _order(row: dict[str, Any]) -> tuple[int, int]:
    if row["status"] == "ok":
        return (0, row["rank"]) if "rank" in row else (1, 0)
    return ({"failed": 2, "skipped": 3}.get(row["status"], 4), 0)


def ordered(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ranked rows first (best validation loss first), then diverged, failed and skipped ones."""
    return sorted(rows, key=_order)


def reference_state(rows: list[dict[str, Any]]) -> tuple[str, int] | None:
    for name in REFERENCES:
        for r in rows:
            if r["optimizer"] == name and r["status"] == "ok" and r.get("state_bytes"):
                return name, r["state_bytes"]
    return None


def command_line(comparison: Comparison, out: str, *, lr_given: bool = False, threads: int | None = None,
                 names_given: bool = True, prog: str = "leanopt compare") -> str:
    """The command that reruns this comparison (``--optimizers`` left out when it was the default)."""
    plan = comparison.plan
    parts = [prog, "--task", plan.task]
    if names_given:
        parts += ["--optimizers", ",".join(comparison.optimizers)]
    parts += ["--steps", str(plan.steps), "--device", plan.device, "--seed", str(plan.seed), "--out", out]
    if threads:
        parts += ["--threads", str(threads)]
    if lr_given:
        parts += ["--lr", repr(plan.lr)]
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
        "wall_s": comparison.wall_s,
        "plots": plots,
        "plot_note": plot_note,
        "results": comparison.rows,
    })


def write_json(data: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")


# ---- formatting --------------------------------------------------------------------------------
def _mib(x: Any) -> str:
    return "" if x is None else f"{x / MiB:.2f}"


def _num(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "nan" if isinstance(x, float) else ""
    return f"{x:.{digits}f}"


def _ms(x: Any) -> str:
    return "" if x is None else (f"{x:.2f}" if x < 10 else f"{x:.1f}")


COLUMNS = ["rank", "optimizer", "state MiB", "B/param", "vs AdamW", "peak MiB", "step ms", "train step ms",
           "final loss", "val loss", "accuracy"]


def table_rows(data: dict[str, Any]) -> list[list[str]]:
    rows = data["results"]
    ref = reference_state(rows)
    out = []
    for r in ordered(rows):
        if r["status"] != "ok":
            continue
        ratio = f"{r['state_bytes'] / ref[1]:.3f}" if ref and r.get("state_bytes") is not None else ""
        out.append([
            str(r.get("rank", "-")),
            r["optimizer"],
            _mib(r.get("state_bytes")),
            _num(r.get("state_bytes_per_param"), 2),
            ratio,
            _mib(r.get("peak_bytes")),
            _ms(r.get("step_ms")),
            _ms(r.get("train_step_ms")),
            _num(r.get("final_loss")),
            _num(r.get("val_loss")),
            "" if r.get("accuracy") is None else f"{100 * r['accuracy']:.1f}%",
        ])
    return out


def not_run(data: dict[str, Any]) -> list[str]:
    return [f"{r['optimizer']} ({r['status']}): {r['reason']}" for r in ordered(data["results"])
            if r["status"] != "ok" or r.get("diverged")]


def print_table(data: dict[str, Any], console: Console) -> None:
    settings = data["settings"]
    table = Table(title=f"leanopt compare: {settings['task']} ({settings['steps']} steps, {settings['device']}, "
                        f"seed {settings['seed']})")
    numeric = set(COLUMNS) - {"optimizer"}
    for col in COLUMNS:
        table.add_column(col, justify="right" if col in numeric else "left")
    for row in table_rows(data):
        table.add_row(*row)
    console.print(table)
    for line in not_run(data):
        console.print(f"[yellow]not ranked[/yellow] {line}")


def markdown(data: dict[str, Any]) -> str:
    s, env, task = data["settings"], data["environment"], data["task"]
    ok = [r for r in data["results"] if r["status"] == "ok"]
    params = ok[0]["params"] if ok else None
    ref = reference_state(data["results"])
    lines = [
        f"# leanopt compare: `{task['name']}`",
        "",
        f"{task['description']}.",
        f"{'' if params is None else f'{params:,} parameters, '}{s['steps']} steps of batch {s['batch_size']}, "
        f"peak lr {s['lr']:g} (linear warm-up over {s['warmup_steps']} step{'s' if s['warmup_steps'] != 1 else ''}, "
        f"then cosine to 0), weight decay {s['weight_decay']:g} (none on biases and norms); "
        "the same initial weights and batches for every optimizer.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join("---" if c == "optimizer" else "---:" for c in COLUMNS) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(data)]
    lines.append("")
    if ref:
        lines.append(f"\"vs AdamW\" is state bytes relative to `{ref[0]}`. Rank: by validation loss.")
        lines.append("")
    skipped = not_run(data)
    if skipped:
        lines += ["Not ranked:", ""] + [f"- {line}" for line in skipped] + [""]
    if data["plots"]:
        lines += [f"![{Path(p).stem.replace('_', ' ')}]({p})" for p in data["plots"]] + [""]
    elif data.get("plot_note"):
        lines += [f"No plots: {data['plot_note']}.", ""]
    lines += ["## What is measured", ""]
    lines += [f"- `{k}`: {v}" for k, v in data["measured"].items()]
    lines += ["", "## Environment", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in env.items() if v is not None]
    lines += [f"| seed | {s['seed']} |", f"| wall time | {data['wall_s']:.0f} s |", "",
              "## Reproduce", "", "```", data["command"],
              "# or: " + data["command"].replace("leanopt compare", "python -m leanopt.compare", 1), "```", ""]
    return "\n".join(lines)
