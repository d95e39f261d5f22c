"""leanopt.Muon's step beside torch.optim.Muon on the same shapes, in one interleaved run.

    python benchmarks/muon_step.py [--shapes small|tinyllama|toy] [--layers N] [--device cpu|cuda]
                                   [--rounds 5] [--threads N] [--backend auto|triton] [--dynamo-only]
                                   [--json PATH]

Each round steps torch.optim.Muon (its single-tensor loop, the only one it has), leanopt.Muon
(``backend="auto"``) and leanopt.Muon8bit once each, on their own copies of the same fp32 params
and gradients, in an order that alternates between rounds; the figure is the median over rounds
of each one's time, and leanopt's ratio to torch's (<= 1.0 is the goal). The Newton-Schulz
share is the time of orthogonalizing every matrix alone (kernels.newton_schulz) over leanopt's
step. ``--shapes tinyllama``: TinyLlama-1.1B's matrices (hidden 2048, 256-wide k/v, MLP 5632;
22 layers by default), the GPU's workload; ``small``: the same ratios at 1/8 of the width (2
layers), what a CPU here can time; ``toy``: 1/32 of the width, one layer, and the offload check on
matrices of 1/8 its size (scripts/gpu_check.py's dry run: the code runs, no figure is meant; on a
CPU without bf16 matrix units ``small``'s orthogonalizations alone took ~60 s). ``--backend``: leanopt's (default ``auto``; scripts/gpu_check.py's
dry run takes ``triton``, interpreted: the kernels the GPU runs).
``--dynamo-only``: every ``torch.compile`` traced by dynamo and run eagerly, no Inductor code (the dry
run: Muon8bit's quantized momentum would otherwise be compiled for the CPU, ~15 s of CPU on 2 cores,
code that a GPU does not run).
``--ns-host``: also the time of one orthogonalization of each distinct TinyLlama shape on the host
(the figure behind docs/muon.md's offload decision).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

import leanopt
from leanopt.kernels import newton_schulz


def layer_shapes(hidden: int, kv: int, mlp: int) -> list[tuple[int, int]]:
    """One Llama layer's matrices (nn.Linear weights: [out, in]): q, k, v, o, gate, up, down."""
    return [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (mlp, hidden), (mlp, hidden), (hidden, mlp)]


SHAPES = {"tinyllama": (2048, 256, 5632, 22), "small": (256, 32, 704, 2), "toy": (64, 8, 176, 1)}
# The offload check's matrices (a TinyLlama layer's at 1/4 of the width); the toy set's at 1/32.
OFFLOAD_SHAPES = {"toy": [(64, 64), (16, 64), (176, 64)]}
DEFAULT_OFFLOAD_SHAPES = [(512, 512), (128, 512), (1408, 512)]


def shapes_of(name: str, layers: int | None) -> list[tuple[int, int]]:
    hidden, kv, mlp, default_layers = SHAPES[name]
    return layer_shapes(hidden, kv, mlp) * (layers or default_layers)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], None], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def run(shapes: list[tuple[int, int]], device: torch.device, rounds: int, warmup: int = 1, backend: str = "auto") -> dict:
    gen = torch.Generator(device=device).manual_seed(0)  # drawn where they live: 1 B params on a GPU
    base = [torch.randn(s, generator=gen, device=device).mul_(0.02) for s in shapes]
    grads = [torch.randn(s, generator=gen, device=device).mul_(1e-3) for s in shapes]
    makers: dict[str, Callable[[list], torch.optim.Optimizer]] = {
        "torch.optim.Muon": lambda ps: torch.optim.Muon(ps, lr=0.02),
        "leanopt.Muon": lambda ps: leanopt.Muon(ps, lr=0.02, backend=backend),
        "leanopt.Muon8bit": lambda ps: leanopt.Muon8bit(ps, lr=0.02, backend=backend),
    }
    opts = {}
    for name, make in makers.items():
        params = [torch.nn.Parameter(b.clone()) for b in base]
        for p, g in zip(params, grads):
            p.grad = g
        opts[name] = make(params)
    times: dict[str, list[float]] = {name: [] for name in opts}
    names = list(opts)
    for r in range(warmup + rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            dt = timed(opts[name].step, device)
            if r >= warmup:
                times[name].append(dt)
    ns_times = []
    for _ in range(rounds):
        ns_times.append(timed(lambda: [newton_schulz.orthogonalize(g, newton_schulz.COEFFICIENTS, 5, 1e-7) for g in grads], device))
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    ref = ms["torch.optim.Muon"]
    return {
        "ms_per_step": {k: round(v, 2) for k, v in ms.items()},
        "ratio_to_torch": {k: round(v / ref, 3) for k, v in ms.items()},
        "ns_ms": round(statistics.median(ns_times) * 1e3, 2),
        "ns_share_of_leanopt_step": round(statistics.median(ns_times) * 1e3 / ms["leanopt.Muon"], 3),
        "ns_flops_per_step": sum(newton_schulz.flops(s, 5) for s in shapes),
        "params": sum(a * b for a, b in shapes),
        "state_bytes_per_param": {k: round(leanopt.measure(o).bytes / sum(a * b for a, b in shapes), 4) for k, o in opts.items()
                                  if k.startswith("leanopt")},  # fmt: skip
    }


def offload_check(device: torch.device, steps: int = 3, shapes: list[tuple[int, int]] | None = None) -> dict:
    """Muon with ``offload="cpu"`` against Muon on the device: the momentum runs on the host (the
    CPU path) and the orthogonalization on the device, so the params after ``steps`` steps differ
    from the on-device ones only where the host's and the device's momentum arithmetic do."""
    gen = torch.Generator().manual_seed(1)
    shapes = shapes or DEFAULT_OFFLOAD_SHAPES
    base = [torch.randn(s, generator=gen).mul_(0.02) for s in shapes]
    grads = [[torch.randn(s, generator=gen).mul_(1e-3) for s in shapes] for _ in range(steps)]
    runs = {}
    for offload in (None, "cpu"):
        params = [torch.nn.Parameter(b.to(device)) for b in base]
        opt = leanopt.Muon(params, lr=0.02, offload=offload)
        for g in grads:
            for p, gp in zip(params, g):
                p.grad = gp.to(device)
            opt.step()
        runs[offload] = [p.detach().cpu() for p in params]
    diff = max((a - b).abs().max().item() for a, b in zip(runs[None], runs["cpu"]))
    return {"steps": steps, "bit_identical": diff == 0.0, "max_abs_diff": diff}


def ns_host(shapes: list[tuple[int, int]]) -> dict:
    """One orthogonalization of each distinct shape on the host: seconds and GFLOP/s."""
    out = {}
    for shape in dict.fromkeys(shapes):
        g = torch.randn(shape)
        dt = timed(lambda: newton_schulz.orthogonalize(g, newton_schulz.COEFFICIENTS, 5, 1e-7), torch.device("cpu"))
        out["x".join(map(str, shape))] = {"s": round(dt, 3), "gflops": round(newton_schulz.flops(shape, 5) / dt / 1e9, 1)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="small")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--backend", default="auto", help="leanopt's backend (default auto; triton: interpreted on the CPU)")
    ap.add_argument("--dynamo-only", action="store_true", help="torch.compile traced by dynamo, run eagerly (no Inductor)")
    ap.add_argument("--ns-host", action="store_true", help="time one orthogonalization of each TinyLlama shape on the host")
    ap.add_argument("--offload-check", action="store_true",
                    help="offload='cpu' (momentum on the host, NS on the device) against the on-device step")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.dynamo_only:
        from backend_parity import dynamo_only  # this folder, where the script runs from

        dynamo_only()
    device = torch.device(args.device)
    shapes = shapes_of(args.shapes, args.layers)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()} {os.cpu_count()} cores" + (f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""),
        "load_before": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "shapes": args.shapes,
        "layers": args.layers or SHAPES[args.shapes][3],
        "device": str(device),
        **run(shapes, device, args.rounds, args.warmup, args.backend),
    }
    if args.ns_host:
        result["ns_host"] = ns_host(shapes_of("tinyllama", 1))
        # A whole TinyLlama step on the host: each matrix's time, 22 layers.
        result["ns_host_step_s"] = round(sum(result["ns_host"]["x".join(map(str, s))]["s"] for s in shapes_of("tinyllama", None)), 1)
    if args.offload_check:
        result["offload"] = offload_check(device, shapes=OFFLOAD_SHAPES.get(args.shapes))
    result["load_after"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
