"""Time to an answer: what importing leanopt and a mistaken command cost, each in a fresh process.

    python benchmarks/startup.py                         # this tree, 7 rounds
    python benchmarks/startup.py --before /tmp/old/src   # and another tree's src, interleaved
    python benchmarks/startup.py --rounds 11 --json out.json

Each round runs every command once, in turn (so a change in the machine's load falls on all of
them alike): ``import torch``; ``import leanopt``; ``import leanopt; leanopt.AdamW`` (what a
training script pays before its first step); an optimizer built, zero_grad-ed, saved and loaded
(nothing stepped); ``leanopt estimate 125m`` (an answer that builds each optimizer it lists, on
meta tensors); ``leanopt inspect missing.pt`` and ``leanopt estimate distilbert-base-cassed`` (a
mistake: the answer is one line). It prints the medians and
ranges, the difference of the medians from ``import torch``, and the 1-minute load average before
and after (the machine's load changes every time here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

COMMANDS = {
    "import torch": ["-c", "import torch"],
    "import leanopt": ["-c", "import leanopt"],
    "import leanopt; leanopt.AdamW": ["-c", "import leanopt; leanopt.AdamW"],
    "build and save an AdamW8bit": ["-c", "import torch, leanopt; o = leanopt.AdamW8bit([torch.nn.Parameter(torch.zeros(8))]); "
                                          "o.zero_grad(); o.load_state_dict(o.state_dict())"],  # fmt: skip
    "leanopt estimate 125m --optimizers adamw": ["-m", "leanopt", "estimate", "125m", "--optimizers", "adamw"],
    "leanopt inspect missing.pt": ["-m", "leanopt", "inspect", "missing.pt"],
    "leanopt estimate distilbert-base-cassed": ["-m", "leanopt", "estimate", "distilbert-base-cassed"],
}


def run(args: list[str], src: str, cwd: str) -> float:
    env = dict(os.environ, PYTHONPATH=src, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--before", help="another tree's src folder, timed in the same rounds")
    parser.add_argument("--json", help="write the times here")
    args = parser.parse_args()
    trees = {"after": os.path.abspath(here)} | ({"before": os.path.abspath(args.before)} if args.before else {})
    times: dict[str, dict[str, list[float]]] = {t: {c: [] for c in COMMANDS} for t in trees}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as cwd:
        for _ in range(args.rounds):
            for command, argv in COMMANDS.items():
                for tree, src in trees.items():
                    times[tree][command].append(run(argv, src, cwd))
    load_after = os.getloadavg()[0]
    print(f"{args.rounds} rounds; 1-minute load average {load_before:.1f} before, {load_after:.1f} after; "
          f"{os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for tree in trees:
        torch_median = statistics.median(times[tree]["import torch"])
        print(f"{tree} ({trees[tree]}):")
        for command, values in times[tree].items():
            median = statistics.median(values)
            extra = "" if command == "import torch" else f"  ({median - torch_median:+.2f} s against import torch)"
            print(f"  {command:<42} median {median:5.2f} s  range {min(values):.2f}-{max(values):.2f}{extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": args.rounds, "load": [load_before, load_after], "trees": trees, "times": times}, f, indent=1)


if __name__ == "__main__":
    main()
