"""ns/element of one quantized CPU step: the native C++ kernel (kernels.cpu_native) against the
compiled Inductor path (kernels.cpu_elementwise.quantized) and torch's fused fp32 AdamW. Where
the kernel has its AVX-512 loops, a "native portable" row times its portable loops too (what a
CPU without AVX-512 runs, as compiled for this one).

    python benchmarks/cpu_native_speed.py                      # 16000x256, 1 and 2 threads
    python benchmarks/cpu_native_speed.py --zeros 0.3          # 30 % exact-zero gradients
    python benchmarks/cpu_native_speed.py --rule lion --rounds 15

One param, each contender on its own copy; after warm-up, rounds are interleaved (one step of
each contender per round, in a rotating order) and the median per contender is reported, so a
noisy shared machine slows all alike. The first call of each is timed on its own (compile or
build; the native extension's build is a cold build only on a fresh torch_extensions cache).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from leanopt.kernels import cpu_elementwise, cpu_native
from leanopt.kernels.rules import RULES
from leanopt.quant import BlockFormat

CODES = {
    ("adamw", 8): ("pow3-s8", "pow6-u8"),
    ("adamw", 4): ("pow2-s4", "pow3-u4"),
    ("lion", 8): ("pow3-s8",),
    ("lion", 4): ("pow2-s4",),
    ("ademamix", 8): ("pow3-s8", "pow3-s8", "pow6-u8"),
    ("ademamix", 4): ("pow2-s4", "pow2-s4", "pow3-u4"),
}
GROUPS = {
    "adamw": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, amsgrad=False, maximize=False),
    "lion": dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1, maximize=False),
    "ademamix": dict(lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, eps=1e-8, weight_decay=0.01, t_alpha=None,
                     t_beta3=None, maximize=False),  # fmt: skip
}


def contenders(rule_name: str, shape: tuple[int, ...], zeros: float) -> dict:
    rule = RULES[rule_name]
    hp = rule.hyperparameters(GROUPS[rule_name])
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(shape, generator=gen)
    g = torch.randn(shape, generator=gen) * 1e-3
    if zeros:
        g[torch.rand(shape, generator=gen) < zeros] = 0.0
    out = {}
    # torch's fused fp32 AdamW: the yardstick (whatever the rule).
    p, m, v = p0.clone(), torch.zeros(shape), torch.zeros(shape)
    step_t = torch.tensor(0.0)

    def fused(p=p, m=m, v=v, step_t=step_t) -> None:
        step_t += 1
        torch._fused_adamw_([p], [g], [m], [v], [], [step_t], lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01,
                            eps=1e-8, amsgrad=False, maximize=False)  # fmt: skip

    out["torch fused AdamW fp32"] = fused
    for bits in (8, 4):
        bs = 256 if bits == 8 else 128
        labels = ["compiled", "native"] + (["native portable"] if cpu_native.vectorized() else [])
        for label in labels:
            impl = cpu_elementwise.quantized if label == "compiled" else cpu_native.quantized
            if label.startswith("native") and not cpu_native.available():
                continue
            p = p0.clone()
            states = [BlockFormat(code, bs).zeros(shape, "cpu") for code in CODES[(rule_name, bits)]]
            count = [0]

            def run(p=p, states=states, count=count, impl=impl, label=label) -> None:
                count[0] += 1
                # cpu_elementwise.quantized sends the params the native kernel takes there: off for the compiled row
                off = {"compiled": cpu_native.disabled, "native portable": cpu_native.portable}.get(label)
                with off() if off else contextlib.nullcontext():
                    impl(rule, [p], [g], [states], [count[0]], hp)

            out[f"{rule_name} {bits}-bit {label}"] = run
    return out


def measure(fns: dict, rounds: int, warmup: int) -> tuple[dict, dict]:
    first = {}
    for name, fn in fns.items():
        start = time.perf_counter()
        fn()
        first[name] = time.perf_counter() - start
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}, first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rule", default="adamw", choices=sorted(CODES and GROUPS))
    ap.add_argument("--rows", type=int, default=16000)
    ap.add_argument("--cols", type=int, default=256)
    ap.add_argument("--zeros", type=float, default=0.0, help="share of exact-zero gradient elements")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()

    start = time.perf_counter()
    ok = cpu_native.available()
    print(f"native extension: {'available' if ok else 'UNAVAILABLE: ' + str(cpu_native.build_error())}, "
          f"first load {time.perf_counter() - start:.1f} s, AVX-512 loops: {cpu_native.vectorized()}")  # fmt: skip
    shape = (args.rows, args.cols)
    n = args.rows * args.cols
    print(f"param {args.rows}x{args.cols} ({n / 1e6:.2f}M), rule {args.rule}, zero gradients {args.zeros:.0%}, "
          f"torch {torch.__version__}")  # fmt: skip
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        fns = contenders(args.rule, shape, args.zeros)
        med, first = measure(fns, args.rounds, args.warmup)
        base = med["torch fused AdamW fp32"]
        print(f"\n{threads} thread(s): median of {args.rounds} interleaved rounds")
        print(f"  {'contender':<28} {'ns/elem':>8} {'x fused':>8} {'first call s':>13}")
        for name in fns:
            print(f"  {name:<28} {med[name] / n * 1e9:8.3f} {med[name] / base:8.2f} {first[name]:13.2f}")


if __name__ == "__main__":
    main()
