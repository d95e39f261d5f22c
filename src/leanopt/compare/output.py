"""What ``leanopt compare --out DIR`` keeps in DIR, and in which order it writes it.

- ``runs.jsonl``, from the start: the settings on its first line, then one line per finished
  run (and per optimizer's set-up), each flushed to the disk as it ends. An interrupted or
  failed comparison keeps what it measured; ``--resume`` reads it back and trains only the runs
  it lacks (:func:`read_runs`).
- at the end, ``results.json`` first (every number; written atomically, so a disk that fills
  later loses none of them), then the plots, ``results.json`` again with their names, and
  ``report.md``.

DIR is leanopt's to own only as far as these names go (:data:`OWNED`): a new comparison
removes an earlier one's files of these names before it starts (``--resume`` keeps
``runs.jsonl``), so no earlier plot is left beside a report that has none; any other file in
DIR is left alone.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import leanopt
from leanopt.compare.plots import PLOTS, write_plots
from leanopt.compare.report import markdown, write_json
from leanopt.writing import naming_failures, write_text_atomically

RUNS = "runs.jsonl"
RESULTS = "results.json"
REPORT = "report.md"
RUNS_FORMAT = "leanopt-compare-runs/1"
OWNED = (RESULTS, REPORT, RUNS, *PLOTS)


def claim(out: Path, *, resume: bool) -> None:
    """Make ``out`` (and its parents) and remove an earlier comparison's files from it: those
    of :data:`OWNED` (``runs.jsonl`` kept when resuming) and their temporaries."""
    out.mkdir(parents=True, exist_ok=True)
    keep = {RUNS} if resume else set()
    for path in out.iterdir():
        # write_atomically's temporaries: ".results.json.<random>.tmp" (a killed run leaves one)
        name = path.name[1:].rsplit(".", 2)[0] if path.name.startswith(".") and path.name.endswith(".tmp") else path.name
        if name in OWNED and name not in keep and (path.is_file() or path.is_symlink()):
            with naming_failures(path):
                path.unlink()


def settings(plan_dict: dict[str, Any]) -> dict[str, Any]:
    """What runs must share to be resumed together: the plan and leanopt's version, as JSON."""
    return json.loads(json.dumps({"plan": plan_dict, "leanopt": leanopt.__version__}))


class RunLog:
    """``out/runs.jsonl``: appended as each run ends, each line flushed and synced."""

    def __init__(self, out: Path, run_settings: dict[str, Any], *, resume: bool) -> None:
        self.path = out / RUNS
        self.runs = 0
        fresh = not (resume and self.path.exists())
        with naming_failures(self.path):
            if not fresh:
                # the line being written when a comparison stopped would run into the next one
                with open(self.path, "rb+") as f:
                    f.truncate(f.read().rfind(b"\n") + 1)
            self._file = open(self.path, "w" if fresh else "a", encoding="utf-8")
        if fresh:
            self._write({"format": RUNS_FORMAT, "settings": run_settings})

    def _write(self, line: dict[str, Any]) -> None:
        with naming_failures(self.path):
            self._file.write(json.dumps(line) + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())

    def record(self, optimizer: str, event: dict[str, Any]) -> None:
        """Keep a ``run`` (its row) or ``setup`` event of ``optimizer``; others are progress only."""
        if event["event"] in ("run", "setup"):
            self._write({"optimizer": optimizer, **event})
            self.runs += event["event"] == "run"

    def close(self) -> None:
        self._file.close()


def logged_plan(out: Path) -> dict[str, Any] | None:
    """The plan on the first line of ``out/runs.jsonl`` (None: no such file, or not a runs log;
    :func:`read_runs` then says what is wrong)."""
    try:
        with open(out / RUNS, encoding="utf-8") as f:
            first = json.loads(f.readline())
    except (OSError, ValueError):
        return None
    plan = first.get("settings", {}).get("plan") if isinstance(first, dict) and isinstance(first.get("settings"), dict) else None
    return plan if isinstance(plan, dict) else None


def read_runs(out: Path, run_settings: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The runs ``out/runs.jsonl`` holds, by optimizer: ``{"setup": event | None, "runs": [row, ...]}``
    ({} when there is no such file). ``ValueError`` when they were made with other settings (a
    resumed comparison would mix them) or a line is not one of a runs log."""
    path = out / RUNS
    if not path.exists():
        return {}
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        lines.pop()  # the line being written when the comparison stopped
    parsed = []
    for number, line in enumerate(lines, start=1):
        try:
            parsed.append(json.loads(line))
        except ValueError:
            raise ValueError(f"--resume: {path} line {number} is not JSON: not a runs log of leanopt compare") from None
    if not parsed or not isinstance(parsed[0], dict) or parsed[0].get("format") != RUNS_FORMAT:
        raise ValueError(f"--resume: {path} is not a runs log of leanopt compare (format {RUNS_FORMAT})")
    if parsed[0].get("settings") != run_settings:
        differ = _difference(parsed[0].get("settings"), run_settings)
        raise ValueError(f"--resume: {path} holds runs made with other settings ({differ}); "
                         "rerun without --resume to replace them, or give another --out")
    found: dict[str, dict[str, Any]] = {}
    for number, line in enumerate(parsed[1:], start=2):
        if not isinstance(line, dict) or not isinstance(line.get("optimizer"), str):
            raise ValueError(f"--resume: {path} line {number} is not a run of leanopt compare")
        entry = found.setdefault(line["optimizer"], {"setup": None, "runs": []})
        row = line.get("row")
        if line.get("event") == "run":
            if not (isinstance(row, dict) and "lr" in row and isinstance(row.get("seed"), int)):
                raise ValueError(f"--resume: {path} line {number} is not a run of leanopt compare (no lr and seed)")
            entry["runs"].append(row)
        elif line.get("event") == "setup":
            entry["setup"] = {k: v for k, v in line.items() if k != "optimizer"}
    return found


def _difference(there: Any, here: dict[str, Any]) -> str:
    """``"steps: 2 there, 3 here"``: the first setting that differs."""
    if not isinstance(there, dict):
        return "no settings there"
    flat_there = {**(there.get("plan") or {}), "leanopt": there.get("leanopt")}
    flat_here = {**here["plan"], "leanopt": here["leanopt"]}
    for key, value in flat_here.items():
        if flat_there.get(key) != value:
            return f"{key}: {json.dumps(flat_there.get(key))[:60]} there, {json.dumps(value)[:60]} here"
    return "other keys"


def write_results(data: dict[str, Any], out: Path) -> tuple[list[str], str | None]:
    """results.json (atomically, before anything else), the plots, results.json again with
    their names, report.md; returns the plots' names and why there are none."""
    write_json({**data, "plots": [], "plot_note": "not drawn yet"}, out / RESULTS)
    plots, note = write_plots(data, out)
    data.update(plots=plots, plot_note=note)
    write_json(data, out / RESULTS)
    write_text_atomically(out / REPORT, markdown(data))
    return plots, note
