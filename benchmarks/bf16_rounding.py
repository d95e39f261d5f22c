"""Pure bf16 training without master weights, by rounding mode, against bf16-mixed (fp32 weights).

    python benchmarks/bf16_rounding.py [--steps 300] [--seeds 0,1,2] [--optimizer adamw] [--lr 1e-3]

The byte-level GPT of ``leanopt compare`` (CPU size: 470,528 params), trained with the same
batches, warm-up + cosine schedule and weight decay as the comparison, in four ways:

* ``bf16-mixed``: fp32 weights, gradients and optimizer (master weights), forward under
  ``torch.autocast(bfloat16)``;
* ``bf16 nearest`` / ``bf16 stochastic`` / ``bf16 kahan``: bf16 weights and gradients, no fp32
  copy; the optimizer's ``rounding=`` writes the fp32 update into the bf16 weights.

Prints final validation loss (mean ± std over seeds) and the measured bytes per parameter of
weights + gradients + optimizer state (each storage once, after a step, before zero_grad).

The same comparison through ``leanopt compare`` (contenders ``optimizer+mode``; its peak-memory
meter, verdicts and report; docs/compare.md, "Training modes"):

    leanopt compare --task bytes-gpt --precision bf16-mixed --steps 300 --lr 1e-3 --seeds 3 \\
        --optimizers adamw,adamw+bf16-kahan,adamw+bf16-stochastic,adamw+bf16-nearest \\
        --device cpu --threads 1 --out out/bf16

Its losses differ from this script's by a few thousandths: ``compare`` decays matrices only
(this script decays every param). Both compute the loss in fp32 from the logits
(``ByteGPT.loss``); the figures in docs/memory.md were made before that, with a bf16 loss for the
pure-bf16 modes.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch

import leanopt
from leanopt.compare.contenders import contender
from leanopt.compare.tasks import get_task, warmup_cosine

MODES = ("bf16-mixed", "bf16 nearest", "bf16 stochastic", "bf16 kahan")


def run(mode: str, optimizer: str, lr: float, steps: int, seed: int) -> tuple[float, float]:
    task = get_task("bytes-gpt")
    plan = task.plan(device="cpu", quick=False, seed=seed, steps=steps, lr=lr)
    work = task.prepare(plan)
    torch.manual_seed(seed)
    model = work.build_model()
    pure = mode != "bf16-mixed"
    if pure:
        model = model.to(torch.bfloat16)
    cls = contender(optimizer).load()
    kwargs = {"lr": lr, "weight_decay": plan.weight_decay}
    if pure:
        kwargs["rounding"] = mode.split()[1]
    opt = cls(model.parameters(), **kwargs)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(steps, plan.warmup_steps))
    per_param = math.nan
    for step in range(steps):
        x, y = work.batch(step)
        with torch.autocast("cpu", torch.bfloat16, enabled=not pure):
            loss = model.loss(x, y)
        loss.float().backward()
        opt.step()
        if step == 1:
            grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
            weights = sum(p.numel() * p.element_size() for p in model.parameters())
            n = sum(p.numel() for p in model.parameters())
            per_param = (weights + grads + leanopt.measure(opt).bytes) / n
        opt.zero_grad(set_to_none=True)
        schedule.step()
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=not pure):
        val = work.evaluate(model)["val_loss"]
    return val, per_param


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    torch.set_num_threads(1)
    print(f"bytes-gpt, {args.optimizer} lr {args.lr}, {args.steps} steps, seeds {seeds}", flush=True)
    rows = {}
    for mode in MODES:
        t = time.perf_counter()
        results = [run(mode, args.optimizer, args.lr, args.steps, s) for s in seeds]
        vals = [v for v, _ in results]
        rows[mode] = (statistics.mean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0, results[0][1])
        print(f"  {mode:16s} val loss {rows[mode][0]:.4f} ± {rows[mode][1]:.4f}   "
              f"{rows[mode][2]:.2f} B/param (weights + grads + state)   {time.perf_counter() - t:.0f} s", flush=True)  # fmt: skip
    base = rows["bf16-mixed"][0]
    print("| mode | val loss (mean ± std) | vs bf16-mixed | B/param (weights + grads + state) |")
    print("|---|---:|---:|---:|")
    for mode, (mean, std, bpp) in rows.items():
        print(f"| {mode} | {mean:.4f} ± {std:.4f} | {100 * (mean / base - 1):+.2f} % | {bpp:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
