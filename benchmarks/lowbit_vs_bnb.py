"""Lion8bit, Lion4bit, AdEMAMix8bit and SGD8bit against bitsandbytes' 8-bit Lion, AdEMAMix and SGD, side by side.

Each optimizer is compared with its *own* fp32 rule (leanopt's quantized optimizers with
leanopt's fp32 one, bitsandbytes' 8-bit with its 32-bit one), started from the same params on
the same gradients: the mean and largest |difference| of the params after every step. Two
gradient workloads on 8192 elements: "dense" (gaussian, 1e-2) and "sparse" (90 % of elements
zero on each step, 0.2 % spikes of 10). Runs on the CPU (bitsandbytes' CPU backend).

    python benchmarks/lowbit_vs_bnb.py [--steps 300] [--seeds 5]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable

import torch

import leanopt

# leanopt's quantized optimizer -> (its fp32 sibling, bitsandbytes' 8-bit and 32-bit classes, their
# common hyper-parameters)
PEERS = {"lion8bit": ("lion", "Lion8bit", "Lion", dict(lr=1e-4, weight_decay=0.0)),
         "lion4bit": ("lion", "Lion8bit", "Lion", dict(lr=1e-4, weight_decay=0.0)),
         "ademamix8bit": ("ademamix", "AdEMAMix8bit", "AdEMAMix", dict(lr=1e-3, weight_decay=0.0)),
         "sgd8bit": ("sgd", "SGD8bit", "SGD", dict(lr=1e-1, momentum=0.9, weight_decay=0.0))}  # fmt: skip
N = 8192


def workload(kind: str, seed: int, steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(N, generator=gen) * 0.1
    grads = []
    for _ in range(steps):
        if kind == "dense":
            grads.append(torch.randn(N, generator=gen) * 1e-2)
            continue
        g = torch.randn(N, generator=gen) * 1e-2 * (torch.rand(N, generator=gen) < 0.1)
        spikes = torch.rand(N, generator=gen) < 0.002
        grads.append(torch.where(spikes, torch.randn(N, generator=gen) * 10, g))
    return p0, grads


def path(make: Callable[[list], torch.optim.Optimizer], p0: torch.Tensor, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    w = torch.nn.Parameter(p0.clone())
    opt = make([w])
    out = []
    for g in grads:
        w.grad = g.clone()
        opt.step()
        out.append(w.detach().clone())
    return out


def _distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, float]:
    return (torch.stack([(x - y).abs().mean() for x, y in zip(a, b)]).mean().item(),
            max((x - y).abs().max().item() for x, y in zip(a, b)))  # fmt: skip


def compare(ours: str, seeds: Iterable[int] = range(3), steps: int = 120) -> list[dict]:
    import bitsandbytes as bnb

    fp32, theirs, theirs32, kw = PEERS[ours]
    lr = kw["lr"]
    rows = []
    for kind in ("dense", "sparse"):
        for seed in seeds:
            p0, grads = workload(kind, seed, steps)
            ref = path(lambda ps: leanopt.optim.optimizer_class(fp32)(ps, backend="reference", **kw), p0, grads)
            q = path(lambda ps: leanopt.optim.optimizer_class(ours)(ps, backend="reference", min_quant_size=1, **kw), p0, grads)
            bnb_ref = path(lambda ps: getattr(bnb.optim, theirs32)(ps, optim_bits=32, **kw), p0, grads)
            bnb_q = path(lambda ps: getattr(bnb.optim, theirs)(ps, min_8bit_size=1, **kw), p0, grads)
            mean, worst = _distance(q, ref)
            bnb_mean, bnb_worst = _distance(bnb_q, bnb_ref)
            rows.append(dict(optimizer=ours, peer=f"bnb {theirs}", workload=kind, seed=seed, lr=lr, mean=mean, max=worst,
                             bnb_mean=bnb_mean, bnb_max=bnb_worst, finite=bool(all(torch.isfinite(x).all() for x in q))))  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args()
    print("| optimizer | workload | mean distance (leanopt / bnb 8-bit), median over seeds [min, max] | largest distance (leanopt / bnb) |")
    print("|---|---|---|---|")
    for ours in PEERS:
        rows = compare(ours, range(args.seeds), args.steps)
        for kind in ("dense", "sparse"):
            sel = [r for r in rows if r["workload"] == kind]
            ratio = sorted(r["mean"] / r["bnb_mean"] for r in sel)
            mean = sorted(r["mean"] for r in sel)
            bnb_mean = sorted(r["bnb_mean"] for r in sel)
            worst = max(r["max"] for r in sel)
            bnb_worst = max(r["bnb_max"] for r in sel)
            med = lambda xs: xs[len(xs) // 2]  # noqa: E731
            print(f"| {ours} vs {sel[0]['peer']} | {kind} | {med(mean):.3g} / {med(bnb_mean):.3g} "
                  f"(ratio {med(ratio):.2f} [{ratio[0]:.2f}, {ratio[-1]:.2f}]) | {worst:.3g} / {bnb_worst:.3g} |")  # fmt: skip


if __name__ == "__main__":
    main()
