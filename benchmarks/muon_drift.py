"""Muon8bit, Muon4bit and Muon with bf16 momentum against fp32 Muon: the distance quantized storage adds.

No peer ships a quantized Muon, so each is compared with leanopt's fp32 Muon (bit-identical to
torch.optim.Muon), started from the same params on the same gradients: after every step, the
mean and the largest |difference| of the params, and -- the figure to read -- the mean distance
over the mean distance fp32 Muon travelled from the start (``relative``); AdamW8bit, AdamW4bit
and SGD8bit against their own fp32 rules under the same measure give the scale. One 128 x 64 matrix
(8192 elements: quantized, 32 blocks of 256 / 64 of 128), lr 0.02, no weight decay, on the two
gradient workloads of benchmarks/lowbit_vs_bnb.py: "dense" (gaussian, 1e-2) and "sparse" (90 %
of elements zero each step, 0.2 % spikes of 10). Runs on the CPU.

    python benchmarks/muon_drift.py [--steps 300] [--seeds 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

import leanopt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lowbit_vs_bnb import workload  # noqa: E402  (the same gradients as the other low-bit comparisons)

SHAPE = (128, 64)
LR = 0.02
Make = Callable[[list], torch.optim.Optimizer]
MUON: Make = lambda ps: leanopt.Muon(ps, lr=LR, weight_decay=0.0)  # noqa: E731
ADAMW: Make = lambda ps: leanopt.AdamW(ps, lr=1e-3, weight_decay=0.0)  # noqa: E731
SGD: Make = lambda ps: leanopt.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
# name -> (the optimizer, its fp32 rule). The last three are the library's other low-bit
# optimizers under the same measure, for scale (their own lr; their own fp32 rule).
VARIANTS: dict[str, tuple[Make, Make]] = {
    "muon8bit": (lambda ps: leanopt.Muon8bit(ps, lr=LR, weight_decay=0.0), MUON),
    "muon4bit": (lambda ps: leanopt.Muon4bit(ps, lr=LR, weight_decay=0.0), MUON),
    "muon-bf16-momentum": (lambda ps: leanopt.Muon(ps, lr=LR, weight_decay=0.0, state_dtype=torch.bfloat16), MUON),
    "adamw8bit": (lambda ps: leanopt.AdamW8bit(ps, lr=1e-3, weight_decay=0.0), ADAMW),
    "adamw4bit": (lambda ps: leanopt.AdamW4bit(ps, lr=1e-3, weight_decay=0.0), ADAMW),
    "sgd8bit": (lambda ps: leanopt.SGD8bit(ps, lr=0.1, momentum=0.9), SGD),
}


def path(make: Callable[[list], torch.optim.Optimizer], p0: torch.Tensor, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    w = torch.nn.Parameter(p0.reshape(SHAPE).clone())
    opt = make([w])
    out = []
    for g in grads:
        w.grad = g.reshape(SHAPE).clone()
        opt.step()
        out.append(w.detach().clone())
    return out


def compare(variants: Iterable[str] = VARIANTS, seeds: Iterable[int] = range(5), steps: int = 300) -> list[dict]:
    rows = []
    for kind in ("dense", "sparse"):
        for seed in seeds:
            p0, grads = workload(kind, seed, steps)
            refs: dict[Make, list[torch.Tensor]] = {}
            for name in variants:
                make, fp32 = VARIANTS[name]
                if fp32 not in refs:
                    refs[fp32] = path(fp32, p0, grads)
                ref = refs[fp32]
                travel = statistics.fmean((x - p0.reshape(SHAPE)).abs().mean().item() for x in ref)
                got = path(make, p0, grads)
                mean = statistics.fmean((x - y).abs().mean().item() for x, y in zip(got, ref))
                rows.append(dict(optimizer=name, workload=kind, seed=seed, mean=mean, max=max((x - y).abs().max().item() for x, y in zip(got, ref)),
                                 travel=travel, relative=mean / travel, finite=bool(all(torch.isfinite(x).all() for x in got))))  # fmt: skip
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per optimizer and workload: the mean over seeds of ``relative``, its largest, and the largest ``max``."""
    out = []
    for name in dict.fromkeys(r["optimizer"] for r in rows):
        for kind in ("dense", "sparse"):
            sel = [r for r in rows if r["optimizer"] == name and r["workload"] == kind]
            out.append(dict(optimizer=name, workload=kind, seeds=len(sel), relative=statistics.fmean(r["relative"] for r in sel),
                            worst_relative=max(r["relative"] for r in sel), mean=statistics.fmean(r["mean"] for r in sel),
                            max=max(r["max"] for r in sel), travel=statistics.fmean(r["travel"] for r in sel)))  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = compare(seeds=range(args.seeds), steps=args.steps)
    table = summary(rows)
    print(f"{'optimizer':<20} {'workload':<7} {'relative':>9} {'worst':>7} {'mean |dp|':>10} {'max |dp|':>9} {'fp32 travel':>11}")
    for r in table:
        print(f"{r['optimizer']:<20} {r['workload']:<7} {r['relative']:>9.4f} {r['worst_relative']:>7.4f} {r['mean']:>10.3g} "
              f"{r['max']:>9.3g} {r['travel']:>11.3g}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "steps": args.steps, "seeds": args.seeds,
                                               "summary": table, "rows": rows}, indent=2) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
