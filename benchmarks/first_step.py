"""The host step's first moments, each in a fresh process: the first step never waits for a kernel build.

    python benchmarks/first_step.py            # all three, ~1 minute on 2 idle cores
    python benchmarks/first_step.py --json out.json
    python benchmarks/first_step.py --shape 2048x4096   # 8.4M params, the size of step_time.py's CPU set

* **fresh cache**: a new ``TORCH_EXTENSIONS_DIR``, so the native kernel must be built: the
  first steps' times, how many steps ran before the kernel was ready, and when it was.
* **warm cache**: the machine's cache: the first step loads the kernel.
* **no compiler**: ``CXX`` pointing nowhere (a slim container): the steady step of the path
  that runs then (every rule eager), next to the native kernel's in the warm process.

Each process trains one fp32 param (4096 x 4096 unless ``--shape`` says) with AdamW8bit (a
third of the gradient exactly 0, as after a ReLU) for 8 steps and reports each step's seconds; the median of steps 3-8 is
the steady step. Every process ends with the same bits (the paths agree exactly).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from typing import Any

WORKER = textwrap.dedent("""
    import json, time, torch, leanopt
    from leanopt.kernels import cpu_native
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(*SHAPE, generator=gen) * 0.02)
    opt = leanopt.AdamW8bit([p], lr=1e-3)
    times, ready = [], []
    start = time.perf_counter()
    for step in range(8):
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
        p.grad[:, ::3] = 0
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
        ready.append(cpu_native.ready())
    cpu_native.available()  # wait for a build under way, to time it
    print(json.dumps({"times": times, "ready": ready, "kernel_after_s": time.perf_counter() - start,
                      "build_s": cpu_native.build_seconds(), "error": cpu_native.build_error(),
                      "bits": p.detach().view(torch.int32).sum().item()}))
""")


def measure(env: dict[str, str], shape: tuple[int, ...] = (4096, 4096)) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", f"SHAPE = {shape!r}\n{WORKER}"], capture_output=True, text=True, env={**os.environ, **env},
                          timeout=1200, check=False)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"worker failed: {proc.stderr.strip()[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["steady_ms"] = 1e3 * statistics.median(out["times"][2:])
    out["stderr"] = [ln for ln in proc.stderr.splitlines() if ln.startswith("leanopt:")]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--shape", default="4096x4096", help="the param's shape, e.g. 2048x4096 (default 4096x4096)")
    args = parser.parse_args(argv)
    try:
        shape = tuple(int(n) for n in args.shape.lower().split("x"))
    except ValueError:
        parser.error(f"--shape {args.shape!r}: expected sizes joined by x, e.g. 2048x4096")
    if not shape or min(shape) < 1:
        parser.error(f"--shape {args.shape!r}: every size must be >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        fresh = measure({"TORCH_EXTENSIONS_DIR": os.path.join(tmp, "fresh")}, shape)
        warm = measure({}, shape)
        bare = measure({"CXX": os.path.join(tmp, "no-such-c++"), "TORCH_EXTENSIONS_DIR": os.path.join(tmp, "none")}, shape)
    report = {"shape": list(shape), "fresh_cache": fresh, "warm_cache": warm, "no_compiler": bare,
              "no_compiler_over_native": bare["steady_ms"] / warm["steady_ms"],
              "same_bits": fresh["bits"] == warm["bits"] == bare["bits"]}  # fmt: skip
    before = sum(1 for r in fresh["ready"] if not r)
    print(f"fresh cache: first step {fresh['times'][0]:.2f} s, steps before the kernel was ready {before} of 8 "
          f"(max {max(fresh['times']):.2f} s), kernel ready after {fresh['kernel_after_s']:.1f} s")
    print(f"warm cache:  first step {warm['times'][0]:.2f} s, steady {warm['steady_ms']:.1f} ms")
    print(f"no compiler: steady {bare['steady_ms']:.1f} ms = {report['no_compiler_over_native']:.1f}x the native "
          f"kernel; said: {' | '.join(bare['stderr']) or '(nothing)'}")
    print(f"same bits on all three: {report['same_bits']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["same_bits"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
