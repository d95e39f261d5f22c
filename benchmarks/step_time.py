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
import functools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import leanopt

# Llama shapes by config: TinyLlama-1.1B's config.json (TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T),
# the same widths scaled to ~8M params for a CPU, and a toy set for a dry run (scripts/gpu_check.py).
TINYLLAMA = dict(layers=22, hidden=2048, intermediate=5632, heads=32, kv_heads=4, vocab=32000)
TINYLLAMA_PARAMS = 1_100_048_384
TINYLLAMA_CPU = dict(layers=6, hidden=256, intermediate=704, heads=32, kv_heads=4, vocab=8000)
TOY = dict(layers=1, hidden=32, intermediate=88, heads=4, kv_heads=2, vocab=256)


def llama_shapes(cfg: dict[str, int]) -> list[tuple[int, ...]]:
    """Parameter shapes of a Llama model of config ``cfg`` (untied embeddings), in the model's order."""
    hidden, inter, vocab = cfg["hidden"], cfg["intermediate"], cfg["vocab"]
    kv = cfg["kv_heads"] * (hidden // cfg["heads"])
    shapes: list[tuple[int, ...]] = [(vocab, hidden)]  # embed_tokens
    for _ in range(cfg["layers"]):
        shapes += [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden)]  # q, k, v, o
        shapes += [(inter, hidden), (inter, hidden), (hidden, inter)]  # gate, up, down
        shapes += [(hidden,), (hidden,)]  # input / post-attention RMSNorm
    shapes += [(hidden,), (vocab, hidden)]  # final norm, lm_head
    return shapes


def tinyllama_shapes(scale: str) -> list[tuple[int, ...]]:
    """TinyLlama-1.1B's parameter shapes; ``scale="cpu"`` shrinks widths to ~8M params."""
    return llama_shapes(TINYLLAMA if scale == "full" else TINYLLAMA_CPU)


def pin_allocator() -> str:
    """glibc: serve allocations below 32 MiB from the heap and never trim it (see the module
    docstring; :func:`leanopt.memory.resident.set_malloc`). Returns what was done, for the report."""
    from leanopt.memory.resident import GLIBC_MMAP_THRESHOLD_MAX, allocator, set_malloc

    if allocator() == "other":
        return "default (no glibc mallopt here)"
    if not set_malloc(mmap_threshold=GLIBC_MMAP_THRESHOLD_MAX, trim_threshold=2**31 - 1):
        return "default (mallopt refused)"
    return "pinned (glibc: mmap threshold 32 MiB, no trimming)"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """GB/s of a device-to-device copy (read + write counted): the floor a step is held to."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t)
    del src, dst
    return 2 * (nbytes // 4) * 4 / statistics.median(times[2:]) / 1e9


Factory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def candidates(backend: str | None = None) -> dict[str, Factory]:
    """Name -> factory, every optimizer this benchmark knows: torch's, every registered leanopt
    optimizer at its defaults (on ``backend`` if given), the peers'. Factories may raise
    ImportError (peer missing) or fail at the first step."""
    out: dict[str, Factory] = {
        "torch-adamw-fused": lambda ps: torch.optim.AdamW(ps, fused=True),
        "torch-adamw-foreach": lambda ps: torch.optim.AdamW(ps, foreach=True),
        # leanopt.SGD's peer at its defaults (no momentum: no state), torch's fastest path for it.
        "torch-sgd-foreach": lambda ps: torch.optim.SGD(ps, foreach=True),
    }

    # Every registered leanopt optimizer (leanopt.optim.REGISTRY), at its defaults.
    for name, cls in leanopt.optim.REGISTRY.items():
        make = cls if backend is None else functools.partial(cls, backend=backend)
        # Muon orthogonalizes matrices and steps the rest by its aux rule: its groups of the list
        # (matrices and vectors, split by dims), as leanopt.muon_groups makes them.
        out[f"leanopt-{name}"] = (lambda ps, make=make: make(leanopt.muon_groups(ps))) if cls.family == "muon" else make
        if issubclass(cls, leanopt.ElementwiseOptimizer) and not issubclass(cls, leanopt.LowBit):
            # Its dense states stored in bf16 (stochastic rounding), half their bytes.
            out[f"leanopt-{name}-bf16-states"] = functools.partial(make, state_dtype=torch.bfloat16)

    def hf_adafactor(ps: list[torch.Tensor]) -> torch.optim.Optimizer:
        from transformers.optimization import Adafactor

        return Adafactor(ps)

    def optimi_adamw(ps: list[torch.Tensor]) -> torch.optim.Optimizer:
        import optimi  # type: ignore[import-not-found]  # an optional peer

        return optimi.AdamW(ps, lr=1e-3, weight_decay=1e-2)

    def bnb(name: str, **kw: Any) -> Factory:
        def make(ps: list[torch.Tensor]) -> torch.optim.Optimizer:
            import bitsandbytes as bnb

            return getattr(bnb.optim, name)(ps, **kw)

        return make

    def torchao(name: str) -> Factory:
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
    out["optimi-adamw"] = optimi_adamw
    out["torchao-adamw8bit"] = torchao("AdamW8bit")
    out["torchao-adamw4bit"] = torchao("AdamW4bit")
    return out


def first_step(opt: torch.optim.Optimizer, device: torch.device) -> float:
    """Seconds of ``opt``'s first step (its kernels compiled, its state made)."""
    sync(device)
    t = time.perf_counter()
    opt.step()
    sync(device)
    return time.perf_counter() - t


def interleaved_rounds(
    steps: dict[str, Callable[[], None]], device: torch.device, rounds: int, warmup: int = 0, *,
    deadline: float | None = None, dropped: Callable[[str, Exception], None] | None = None,
    after_round: Callable[[int, dict[str, list[float]]], None] | None = None,
) -> dict[str, list[float]]:  # fmt: skip
    """The seconds of each of ``steps``' steps over ``rounds`` rounds after ``warmup``: one step
    of each per round, in an order that rotates by one every round, so that a noisy machine
    slows every contender alike.

    ``deadline`` (``time.time()``): no round starts that would end past it. ``dropped``: a step
    that raises is dropped from the rounds and reported to it (it may raise to stop them);
    without it, the error propagates. ``after_round(done, times)`` is called after each round."""
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}

    def one(name: str) -> float | None:
        try:
            sync(device)
            t = time.perf_counter()
            steps[name]()
            sync(device)
            return time.perf_counter() - t
        except Exception as err:
            if dropped is None:
                raise
            names.remove(name)
            del times[name]
            dropped(name, err)
            return None

    for _ in range(warmup):
        for name in list(names):
            one(name)
    round_s = 0.0
    for done in range(rounds):
        if not names or (deadline is not None and done and time.time() + round_s + 2 > deadline):
            break
        t = time.time()
        for name in names[done % len(names) :] + names[: done % len(names)]:
            took = one(name)
            if took is not None:
                times[name].append(took)
        round_s = time.time() - t
        if after_round is not None:
            after_round(done + 1, times)
    return times


def step_row(name: str, times: list[float], first_s: float, state_bytes: int | None, *, numel: int, param_bytes: int,
             bandwidth: float, ref_ms: float | None) -> dict[str, Any]:  # fmt: skip
    """One optimizer's row: ms/step (median), against torch fused AdamW's ``ref_ms``, first step;
    with its state bytes, the bytes a step moves at least (params read and written, gradients
    read, state read and written), the time that takes at ``bandwidth`` and the rate achieved."""
    ms = statistics.median(times) * 1e3 if times else None
    row: dict[str, Any] = {"optimizer": name, "ms_per_step": None if ms is None else round(ms, 3),
                           "ms_min": round(min(times) * 1e3, 3) if times else None,
                           "ratio_to_torch_fused": round(ms / ref_ms, 3) if ms and ref_ms else None,
                           "first_step_s": round(first_s, 3), "timed_steps": len(times)}  # fmt: skip
    if state_bytes is not None:
        moved = numel * 3 * param_bytes + 2 * state_bytes
        row["state_bytes_per_param"] = round(state_bytes / numel, 4)
        row["floor_ms"] = _sig(moved / (bandwidth * 1e9) * 1e3)
        if ms:
            row["achieved_GBps"] = _sig(moved / (ms / 1e3) / 1e9)
            row["pct_of_copy_bandwidth"] = _sig(100 * moved / (ms / 1e3) / 1e9 / bandwidth)
    return row


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


# Other sets of shapes: "wide16" is 16 tensors of 512 x 1000 (8,192,000 params), the set the
# issue that found Adafactor 2x slower than before measured; its row stays here.
# "toy" is scripts/gpu_check.py's dry-run set (28,000 params).
SETS = {"wide16": [(512, 1000)] * 16, "toy": llama_shapes(TOY)}


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

    factories = candidates()
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
            first = first_step(opt, device)
        except Exception as err:  # a peer missing or failing here: report, don't abort
            skipped[name] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:160]
            continue
        runs[name] = {"opt": opt, "first_s": first, "state_bytes": leanopt.measure(opt).bytes}
        print(f"  ready {name:28s} first step {first:7.2f} s", file=sys.stderr)

    times = interleaved_rounds({name: r["opt"].step for name, r in runs.items()}, device, args.rounds, args.warmup)
    param_bytes = torch.empty((), dtype=dtype).element_size()
    bandwidth = copy_bandwidth(device, min(numel * 4, 1 << 30))
    ref = times.get("torch-adamw-fused")
    ref_ms = statistics.median(ref) * 1e3 if ref else None
    rows = [step_row(name, times[name], r["first_s"], r["state_bytes"], numel=numel, param_bytes=param_bytes,
                     bandwidth=bandwidth, ref_ms=ref_ms) for name, r in runs.items()]  # fmt: skip
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
    w = max([22] + [len(r["optimizer"]) for r in report["results"]])
    head = f"{'optimizer':{w}s} {'ms/step':>9s} {'x fused':>8s} {'first s':>8s} {'B/param':>8s} {'GB/s':>7s} {'floor ms':>9s}"
    print(head)
    print("-" * len(head))
    for r in report["results"]:
        ratio = f"{r['ratio_to_torch_fused']:.2f}" if r["ratio_to_torch_fused"] is not None else "-"
        print(
            f"{r['optimizer']:{w}s} {r['ms_per_step']:9.2f} {ratio:>8s} {r['first_step_s']:8.2f} "
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
