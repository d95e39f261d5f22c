"""Time ``optimizer.step()`` for leanopt and its peers side by side, in one process.

    python benchmarks/step_time.py                 # CPU: a scaled TinyLlama-shaped set (~8M params)
    python benchmarks/step_time.py --device cuda   # GPU: TinyLlama-1.1B shapes (1,100,048,384 params)
    python benchmarks/step_time.py --json out.json --only adamw,torch-adamw-fused
    python benchmarks/step_time.py --set wide16 --threads 1   # 16 x 512 x 1000, one thread

Every optimizer gets its own copy of the same parameters and gradients. After a first step
(timed on its own: it includes compilation) and warm-up, rounds are interleaved — one step of
each optimizer per round, in a rotating order — and the median over rounds is reported, so
that a noisy shared machine slows every optimizer alike. Columns:

* ms/step (median), ratio to torch's fused AdamW in the same run, first-step seconds;
* state B/param from ``leanopt.measure``;
* GB/s achieved against the bytes an update must move at least: params read and written,
  gradients read, state read and written (``numel * (2*param_bytes + grad_bytes) + 2*state``),
  next to the device's measured copy bandwidth.
Peers that are not installed, or fail on this device, are listed as skipped with the reason.

**The CPU allocator is pinned** (``--allocator pinned``, the default; glibc only): optimizers
that allocate full-size temporaries every step (transformers' and torch's Adafactor, torch's
foreach AdamW, the peers' 8-bit steps) ran at one of two speeds from one process to the next,
because glibc's malloc moves its mmap threshold and trims its heap depending on the order of
earlier frees: transformers' Adafactor on 16 x 512 x 1000 took 14-19 ms in some processes and
30-37 ms in others (130k against 365k minor page faults per 21 steps), which alone moved
leanopt's Adafactor ratio between 0.3 and 0.7. Pinned (``mallopt``: no mmap below 32 MiB, no
heap trimming) every contender reuses its memory as in a long training run: the peers at their
fastest, the same in every process. ``--allocator default`` leaves glibc's defaults.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import leanopt


def tinyllama_shapes(scale: str) -> list[tuple[int, ...]]:
    """TinyLlama-1.1B's parameter shapes; ``scale="cpu"`` shrinks widths to ~8M params."""
    if scale == "full":
        hidden, inter, layers, vocab, kv = 2048, 5632, 22, 32000, 256
    else:
        hidden, inter, layers, vocab, kv = 256, 704, 6, 8000, 32
    shapes: list[tuple[int, ...]] = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden)]
        shapes += [(inter, hidden), (inter, hidden), (hidden, inter), (hidden,), (hidden,)]
    shapes += [(hidden,), (vocab, hidden)]
    return shapes


def pin_allocator() -> str:
    """glibc: serve allocations below 32 MiB from the heap and never trim it (see the module
    docstring). Returns what was done, for the report."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "default (no glibc mallopt here)"
    m_trim_threshold, m_mmap_threshold = -1, -3
    if mallopt(m_mmap_threshold, 32 << 20) != 1 or mallopt(m_trim_threshold, 2**31 - 1) != 1:
        return "default (mallopt refused)"
    return "pinned (glibc: mmap threshold 32 MiB, no trimming)"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """GB/s of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        _sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t)
    return 2 * src.numel() * 4 / statistics.median(times[2:]) / 1e9


def candidates(device: torch.device) -> dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]]:
    """Name -> factory. Factories may raise ImportError (peer missing) or fail at first step."""
    out: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
        "torch-adamw-fused": lambda ps: torch.optim.AdamW(ps, fused=True),
        "torch-adamw-foreach": lambda ps: torch.optim.AdamW(ps, foreach=True),
    }

    # Every registered leanopt optimizer (leanopt.optim.REGISTRY), at its defaults.
    for name, cls in leanopt.optim.REGISTRY.items():
        out[f"leanopt-{name}"] = cls

    def hf_adafactor(ps: list[torch.Tensor]) -> torch.optim.Optimizer:
        from transformers.optimization import Adafactor

        return Adafactor(ps)

    def bnb(name: str, **kw: Any) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
        def make(ps: list[torch.Tensor]) -> torch.optim.Optimizer:
            import bitsandbytes as bnb

            return getattr(bnb.optim, name)(ps, **kw)

        return make

    def torchao(name: str) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
        def make(ps: list[torch.Tensor]) -> torch.optim.Optimizer:
            import torchao.optim

            return getattr(torchao.optim, name)(ps)

        return make

    out["hf-adafactor"] = hf_adafactor
    out["torch-adafactor"] = lambda ps: torch.optim.Adafactor(ps, foreach=True)
    out["bnb-adamw8bit"] = bnb("AdamW8bit")
    out["bnb-lion"] = bnb("Lion", optim_bits=32)
    out["bnb-lion8bit"] = bnb("Lion8bit")
    out["bnb-ademamix8bit"] = bnb("AdEMAMix8bit")
    out["torchao-adamw8bit"] = torchao("AdamW8bit")
    out["torchao-adamw4bit"] = torchao("AdamW4bit")
    return out


# Other sets of shapes: "wide16" is 16 tensors of 512 x 1000 (8,192,000 params), the set the
# issue that found Adafactor 2x slower than before measured; its row stays here (issue 23).
SETS = {"wide16": [(512, 1000)] * 16}


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.set != "tinyllama":
        shapes = SETS[args.set]
    else:
        shapes = tinyllama_shapes("full" if device.type == "cuda" and not args.small else "cpu")
    dtype = getattr(torch, args.dtype)
    numel = sum(torch.Size(s).numel() for s in shapes)
    gen = torch.Generator(device="cpu").manual_seed(0)
    base = [torch.randn(s, generator=gen).mul_(0.02) for s in shapes]
    grads = [torch.randn(s, generator=gen).mul_(1e-3) for s in shapes]

    factories = candidates(device)
    if args.only:
        wanted = args.only.split(",")
        unknown = [w for w in wanted if w not in factories]
        if unknown:
            raise SystemExit(f"unknown optimizer(s): {', '.join(unknown)}; known: {', '.join(factories)}")
        factories = {k: factories[k] for k in wanted}

    runs: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    for name, make in factories.items():
        params = [b.to(device=device, dtype=dtype).requires_grad_() for b in base]
        for p, g in zip(params, grads):
            p.grad = g.to(device=device, dtype=dtype)
        try:
            opt = make(params)
            _sync(device)
            t = time.perf_counter()
            opt.step()
            _sync(device)
            first = time.perf_counter() - t
        except Exception as err:  # a peer missing or failing here: report, don't abort
            skipped[name] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:160]
            continue
        state_bytes = leanopt.measure(opt).bytes
        runs[name] = {"opt": opt, "first_s": first, "times": [], "state_bytes": state_bytes}
        print(f"  ready {name:22s} first step {first:7.2f} s", file=sys.stderr)

    names = list(runs)
    for _ in range(args.warmup):
        for name in names:
            runs[name]["opt"].step()
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            _sync(device)
            t = time.perf_counter()
            runs[name]["opt"].step()
            _sync(device)
            runs[name]["times"].append(time.perf_counter() - t)

    param_bytes = torch.empty((), dtype=dtype).element_size()
    bandwidth = copy_bandwidth(device, min(numel * 4, 1 << 30))
    ref = runs.get("torch-adamw-fused")
    ref_ms = statistics.median(ref["times"]) * 1e3 if ref else None
    rows = []
    for name in names:
        r = runs[name]
        ms = statistics.median(r["times"]) * 1e3
        moved = numel * (3 * param_bytes) + 2 * r["state_bytes"]
        rows.append(
            {
                "optimizer": name,
                "ms_per_step": round(ms, 3),
                "ratio_to_torch_fused": round(ms / ref_ms, 3) if ref_ms else None,
                "first_step_s": round(r["first_s"], 3),
                "state_bytes_per_param": round(r["state_bytes"] / numel, 4),
                "achieved_GBps": round(moved / (ms / 1e3) / 1e9, 1),
                "floor_ms": round(moved / (bandwidth * 1e9) * 1e3, 3),
            }
        )
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "leanopt": leanopt.__version__,
        "params": numel,
        "tensors": len(shapes),
        "param_dtype": args.dtype,
        "copy_bandwidth_GBps": round(bandwidth, 1),
        "rounds": args.rounds,
        "date": time.strftime("%Y-%m-%d"),
        "results": rows,
        "skipped": skipped,
    }


def print_table(report: dict[str, Any]) -> None:
    print(
        f"{report['device']}, torch {report['torch']}, {report['params']:,} {report['param_dtype']} params in "
        f"{report['tensors']} tensors, copy bandwidth {report['copy_bandwidth_GBps']} GB/s, "
        f"median of {report['rounds']} interleaved rounds, allocator {report.get('allocator', 'default')}"
    )
    head = f"{'optimizer':22s} {'ms/step':>9s} {'x fused':>8s} {'first s':>8s} {'B/param':>8s} {'GB/s':>7s} {'floor ms':>9s}"
    print(head)
    print("-" * len(head))
    for r in report["results"]:
        ratio = f"{r['ratio_to_torch_fused']:.2f}" if r["ratio_to_torch_fused"] is not None else "-"
        print(
            f"{r['optimizer']:22s} {r['ms_per_step']:9.2f} {ratio:>8s} {r['first_step_s']:8.2f} "
            f"{r['state_bytes_per_param']:8.3f} {r['achieved_GBps']:7.1f} {r['floor_ms']:9.2f}"
        )
    for name, why in report["skipped"].items():
        print(f"skipped {name}: {why}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--only", help="comma-separated subset of optimizer names")
    parser.add_argument("--small", action="store_true", help="the ~8M CPU set even on CUDA")
    parser.add_argument("--set", default="tinyllama", choices=["tinyllama", *SETS], help="the shapes (default: TinyLlama's)")
    parser.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's)")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    parser.add_argument("--allocator", default="pinned", choices=["pinned", "default"],
                        help="pin glibc's malloc so that no contender's speed depends on its state (default), or not")
    args = parser.parse_args(argv)
    allocator = pin_allocator() if args.allocator == "pinned" else "default"
    report = run(args)
    report["allocator"] = allocator
    print_table(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
