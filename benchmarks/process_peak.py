"""The whole process's peak, measured as a user sees it, against ``leanopt plan``'s ``process_bytes``.

    python benchmarks/process_peak.py                # the six DistilBERT / GPT-2 rows of docs/plan.md (minutes)
    python benchmarks/process_peak.py --cases small  # the tiny models tests/test_plan_process.py uses
    python benchmarks/process_peak.py --json

The independent definition, nothing of leanopt's memory code in it: a fresh Python
process imports torch, transformers and leanopt, reads its resident set (``VmRSS``: anonymous
and file-backed pages), builds the model (random weights, train mode), trains three steps
(the step of ``benchmarks/plan_vs_measured.py``: forward, backward, ``optimizer.step()``,
``zero_grad(set_to_none=True)``) and reads the resident-set high-water mark (``VmHWM``).
Measured = ``VmHWM`` - the resident set before the model. No warm-up, the machine's thread
count, once with ``MALLOC_MMAP_THRESHOLD_=65536`` (every block of 64 KiB or more mapped on its
own and returned when freed: what ``leanopt.pin_allocator()`` sets) and once with glibc's
defaults (no ``MALLOC_*`` variable: its dynamic threshold keeps freed heap blocks), each in its
own fresh process.

Predicted, from ``leanopt.memory.plan.plan`` in this process: ``process_bytes_pinned`` (the step
peak plus the one-time costs of a first step, :mod:`leanopt.memory.process`) against the first,
``process_bytes`` (that plus ``one_time["glibc_heap"]``, the heap glibc's defaults keep) against
the second.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# (case of plan_vs_measured, optimizer, precision, checkpointing): the issue's six rows
ROWS = [("distilbert", "adamw", "fp32", False), ("distilbert", "adamw8bit", "bf16-mixed", False),
        ("distilbert", "adafactor", "fp32", False), ("distilbert", "adamw", "fp32", True),
        ("gpt2", "adamw", "fp32", False), ("gpt2", "adamw8bit", "bf16-mixed", False)]  # fmt: skip
SMALL_ROWS = [("tiny-distilbert", "adamw", "fp32", False), ("tiny-distilbert", "adafactor", "fp32", False),
              ("tiny-gpt2", "adamw", "fp32", False), ("narrow-gpt2-2seq", "adamw8bit", "bf16-mixed", False)]  # fmt: skip

# Run as `python -c`: the user's script. Only /proc is read; the step is the benchmark's.
WORKER = textwrap.dedent("""
    import json, sys, importlib.util
    import torch, transformers, leanopt
    spec = importlib.util.spec_from_file_location("plan_vs_measured", sys.argv[1])
    bench = importlib.util.module_from_spec(spec); spec.loader.exec_module(bench)
    case, optimizer, precision, ckpt = sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5] == "1"
    def kib(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    torch.manual_seed(0)
    _, _, _, batch, seq = bench.model_spec(case)
    before = kib("VmRSS")
    model = bench.build(case)
    opt = bench.prepare(model, optimizer, precision, ckpt)
    step = bench.step_fn(model, opt, precision, batch, seq)
    for _ in range(3):
        step()
    print(json.dumps({"before": before * 1024, "peak": (kib("VmHWM") - before) * 1024}))
""")


def bench() -> Any:
    spec = importlib.util.spec_from_file_location("plan_vs_measured", ROOT / "benchmarks" / "plan_vs_measured.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(case: str, optimizer: str, precision: str, checkpointing: bool, timeout: float = 1800, *,
            default_malloc: bool = False) -> int:  # fmt: skip
    """The resident-set peak over the set before the model, of a fresh process (bytes)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env["PYTHONWARNINGS"] = "ignore"
    if not default_malloc:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    cmd = [sys.executable, "-c", WORKER, str(ROOT / "benchmarks" / "plan_vs_measured.py"), case, optimizer, precision,
           "1" if checkpointing else "0"]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"worker {case} {optimizer} {precision} failed:\n{out.stderr[-2000:]}")
    return int(json.loads(out.stdout.strip().splitlines()[-1])["peak"])


def predict(case: str, optimizer: str, precision: str, checkpointing: bool) -> Any:
    """The plan's row (``peak_bytes`` and ``process_bytes``)."""
    from leanopt.memory.plan import plan

    b = bench()
    _, _, _, batch, seq = b.model_spec(case)
    (row,) = plan(b.build_meta(case), batch=batch, seq=seq, optimizers=[optimizer], precisions=[precision],
                  checkpointing=[checkpointing], grad_release=[False], allocator="glibc")  # fmt: skip
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="full", help="full (the six rows) or small")
    parser.add_argument("--repeat", type=int, default=1, help="measure each row this many times (fresh processes, each allocator)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    if not args.json:
        print("| model | optimizer | precision | ckpt | step peak | pinned: process_bytes_pinned | measured | error "
              "| glibc defaults: process_bytes | measured | error |", flush=True)  # fmt: skip
    for case, optimizer, precision, ckpt in (ROWS if args.cases == "full" else SMALL_ROWS):
        t0 = time.perf_counter()
        row = predict(case, optimizer, precision, ckpt)
        out: dict[str, Any] = {"case": case, "optimizer": optimizer, "precision": precision, "checkpointing": ckpt,
                               "peak_mib": round(row.peak_bytes / 2**20, 1), "glibc_heap_mib": round(row.one_time.get("glibc_heap", 0) / 2**20, 1)}  # fmt: skip
        cells = []
        for label, predicted, default in (("pinned", row.process_bytes_pinned, False), ("default", row.process_bytes, True)):
            measured = [measure(case, optimizer, precision, ckpt, default_malloc=default) for _ in range(args.repeat)]
            m = sorted(measured)[len(measured) // 2]
            out[label] = {"process_mib": round(predicted / 2**20, 1), "measured_mib": [round(x / 2**20, 1) for x in measured],
                          "error_pct": round(100 * (predicted - m) / m, 1)}  # fmt: skip
            cells.append(f"{predicted / 2**20:,.0f} | {', '.join(f'{x / 2**20:,.0f}' for x in measured)} | {100 * (predicted - m) / m:+.1f} %")
        out["seconds"] = round(time.perf_counter() - t0)
        rows.append(out)
        if not args.json:
            print(f"| {case} | {optimizer} | {precision} | {'on' if ckpt else 'off'} | {out['peak_mib']:,.0f} | {' | '.join(cells)} |", flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
