"""A training iteration with gradient release beside the same iteration without it, on the CPU.

Each mode -- the usual loop, ``release_gradients`` on the device, ``offload="cpu"``, and offload
with release -- trains the same small GPT-2 (random init, random token ids) with the same
optimizer; the modes alternate round by round and the table gives each one's median and
quartiles of forward+backward+step, and of ``step()`` alone (under release on the device the
update runs inside backward, so compare whole iterations). One process for all modes: the
kernels are built and the graphs compiled by the warm-up rounds, which are not timed.

    python benchmarks/release_step.py                     # AdamW8bit, 12 rounds
    python benchmarks/release_step.py --optimizer adamw --rounds 20 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

MODES = ("usual", "release", "offload", "offload+release")


def build(mode: str, name: str, seed: int = 0):
    import transformers

    import leanopt
    from leanopt.optim.registry import optimizer_class

    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8000, n_positions=128)
    model = transformers.GPT2LMHeadModel(config)
    opt = optimizer_class(name)(model.parameters(), lr=1e-3, offload="cpu" if "offload" in mode else None)
    handle = leanopt.release_gradients(model, opt) if "release" in mode else None
    return model, opt, handle


def iteration(model, opt, x) -> tuple[float, float]:
    start = time.perf_counter()
    model(x, labels=x).loss.backward()
    before_step = time.perf_counter()
    opt.step()
    opt.zero_grad()
    end = time.perf_counter()
    return end - start, end - before_step


def quartiles(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median_ms": 1000 * statistics.median(values), "q1_ms": 1000 * q[0], "q3_ms": 1000 * q[2]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optimizer", default="adamw8bit")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    runs = {mode: build(mode, args.optimizer) for mode in MODES}
    x = torch.randint(0, 8000, (4, 64), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
    for r in range(args.warmup + args.rounds):
        for mode in MODES:
            model, opt, _ = runs[mode]
            took = iteration(model, opt, x)
            if r >= args.warmup:
                times[mode].append(took)
    load = os.getloadavg()[0]
    out = {"optimizer": args.optimizer, "rounds": args.rounds, "threads": torch.get_num_threads(), "load_1min": load,
           "date": time.strftime("%Y-%m-%d %H:%M"), "modes": {}}  # fmt: skip
    print(f"{args.optimizer}, GPT-2 4 x 256 (8000 tokens), batch 4 x 64, {args.rounds} rounds, "
          f"{torch.get_num_threads()} threads, load {load:.1f}")  # fmt: skip
    print(f"{'mode':<16} {'iteration ms (q1-q3)':>24} {'step() ms (q1-q3)':>22}")
    for mode in MODES:
        whole = quartiles([t for t, _ in times[mode]])
        step = quartiles([s for _, s in times[mode]])
        out["modes"][mode] = {"iteration": whole, "step": step}
        print(f"{mode:<16} {whole['median_ms']:>9.0f} ({whole['q1_ms']:.0f}-{whole['q3_ms']:.0f}){'':>4}"
              f"{step['median_ms']:>9.0f} ({step['q1_ms']:.0f}-{step['q3_ms']:.0f})")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
