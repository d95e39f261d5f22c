"""How long a first ``leanopt plan`` takes on a fresh cache, and a second one on the filled cache.

    python benchmarks/plan_first_run.py                                   # distilbert-base-cased, batch 8, seq 128, 1GiB
    python benchmarks/plan_first_run.py --src /tmp/before/src --src src  # two checkouts, alternated
    python benchmarks/plan_first_run.py --runs 2 --json

Each run is ``python -m leanopt plan MODEL --batch B --seq S --budget BUDGET`` in a fresh process
with ``$LEANOPT_CACHE`` an empty folder (the first run: the one-time costs of a first step are
measured), then again on the folder it filled (the second run), its stderr a pseudo-terminal as a
user's is. Reported per run: wall seconds, the CPU seconds of the whole process tree (user +
system, children included), the seconds to the first line on stderr, and the lines it printed
there. The native CPU kernel is built once before the first run (``leanopt build-kernels``), so
what is timed is the plan, not a compiler. Several ``--src`` folders are run alternately, so
that a shared machine's load falls on each alike; state the load (``uptime``) beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(src: Path, argv: list[str], cache: Path) -> dict[str, Any]:
    """One ``leanopt plan`` with stderr a pseudo-terminal: wall, CPU, first stderr line, stderr."""
    env = {**os.environ, "PYTHONPATH": str(src), "LEANOPT_CACHE": str(cache)}
    leader, follower = os.openpty()
    cpu0, t0 = _children_cpu(), time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "leanopt", "plan", *argv], stdout=subprocess.DEVNULL, stderr=follower,
                            stdin=subprocess.DEVNULL, env=env)  # fmt: skip
    os.close(follower)
    said, first = b"", None
    while True:
        if select.select([leader], [], [], 1.0)[0]:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal closed: the process ended
                break
            if not chunk:
                break
            said += chunk
            if first is None and b"\n" in said:
                first = time.perf_counter() - t0
        elif proc.poll() is not None:
            break
    proc.wait()
    wall = time.perf_counter() - t0
    os.close(leader)
    lines = said.decode(errors="replace").replace("\r", "").splitlines()
    return {"exit": proc.returncode, "wall_s": round(wall, 1), "cpu_s": round(_children_cpu() - cpu0, 1),
            "first_line_s": None if first is None else round(first, 2), "stderr": lines}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="distilbert-base-cased")
    parser.add_argument("--batch", default="8")
    parser.add_argument("--seq", default="128")
    parser.add_argument("--budget", default="1GiB")
    parser.add_argument("--src", action="append", type=Path, help="a checkout's src folder (default: this one's); several alternate")
    parser.add_argument("--runs", type=int, default=1, help="first + second runs per --src (alternated)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    sources = args.src or [ROOT / "src"]
    plan_argv = [args.model, "--batch", args.batch, "--seq", args.seq, "--budget", args.budget]
    for src in sources:  # the native kernel built (and cached) before anything is timed
        subprocess.run([sys.executable, "-m", "leanopt", "build-kernels"], env={**os.environ, "PYTHONPATH": str(src)},
                       capture_output=True, check=False)  # fmt: skip
    results = []
    for i in range(args.runs):
        for src in sources:
            with tempfile.TemporaryDirectory(prefix="leanopt-first-run-") as cache:
                first = run(src, plan_argv, Path(cache))
                second = run(src, plan_argv, Path(cache))
            load = os.getloadavg()[0]
            results.append({"src": str(src), "run": i, "load": round(load, 2), "first": first, "second": second})
            if not args.json:
                print(f"{src} run {i} (load {load:.1f}): first {first['wall_s']} s wall, {first['cpu_s']} s CPU, first stderr line "
                      f"after {first['first_line_s']} s; second {second['wall_s']} s wall, {second['cpu_s']} s CPU", flush=True)  # fmt: skip
                for line in first["stderr"][:3] + (["..."] if len(first["stderr"]) > 4 else []) + first["stderr"][-1:]:
                    print(f"    {line}")
    if args.json:
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
