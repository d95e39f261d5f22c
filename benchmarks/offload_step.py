"""A training step with ``offload="cpu"`` beside the same step on the device.

    python benchmarks/offload_step.py                      # CPU: TinyLlama shapes scaled to ~8M params
    python benchmarks/offload_step.py --device cuda        # GPU: TinyLlama-1.1B shapes, bf16 params
    python benchmarks/offload_step.py --size toy --rounds 2 --json out.json   # gpu_check's dry run

A model with TinyLlama's parameter shapes (attention replaced by plain projections: every weight is
used forward and backward) trains on random tokens, one optimizer per mode, interleaved rounds
(median and quartiles over rounds):

* ``device``: the optimizer without offload (states on the params' device);
* ``offload``: ``offload="cpu"``, gradients kept on the device and copied at ``step()``;
* ``offload+release``: with :func:`leanopt.release_gradients`: gradients go to the host during
  backward and, from the second step on, each param is stepped there while backward goes on;
* ``torchao``: torchao's ``CPUOffloadOptimizer`` over torch's AdamW, when torchao is installed
  and the device is CUDA.

Reported per mode: ms per training step (forward, backward, step), ms in ``step()`` alone, the
device's peak memory (CUDA: ``max_memory_allocated``), the host memory the optimizer holds
(``Offload.host_bytes``: host copies, states and, released, gradient buffers), and
for ``offload+release`` the share of the host step hidden behind backward:
``(fwd_bwd[device] + step[offload] - iteration[offload+release]) / step[offload]``.

**Bit identity**: the offloaded optimizer's params after ``--check-steps`` steps are compared to
a CPU copy stepped by the same optimizer *without* offload from the same gradients (the host
kernels are the CPU kernels: the bits must agree), and, for scale, the on-device optimizer's
params from the same gradients (max abs difference: other kernels, not bit-identical on CUDA).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
import leanopt  # noqa: E402

SIZES = {  # hidden, intermediate, layers, vocab, kv (TinyLlama-1.1B: "full")
    "full": (2048, 5632, 22, 32000, 256),
    "cpu": (256, 704, 6, 8000, 32),
    "toy": (32, 88, 1, 256, 8),
}


class Block(torch.nn.Module):
    def __init__(self, hidden: int, inter: int, kv: int) -> None:
        super().__init__()
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.q, self.k, self.v, self.o = lin(hidden, hidden), lin(hidden, kv), lin(hidden, kv), lin(hidden, hidden)
        self.gate, self.up, self.down = lin(hidden, inter), lin(hidden, inter), lin(inter, hidden)
        self.norm1 = torch.nn.Parameter(torch.ones(hidden))
        self.norm2 = torch.nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.norm1
        x = x + self.o(self.q(h)) + torch.nn.functional.linear(self.k(h) * self.v(h), self.k.weight.t())
        h = x * self.norm2
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


class Model(torch.nn.Module):
    def __init__(self, size: str) -> None:
        super().__init__()
        hidden, inter, layers, vocab, kv = SIZES[size]
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(Block(hidden, inter, kv) for _ in range(layers))
        self.norm = torch.nn.Parameter(torch.ones(hidden))
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        self.vocab = vocab

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x * self.norm).float()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make(args: argparse.Namespace, mode: str, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    torch.manual_seed(0)
    with torch.device(device):  # initialized where it trains: 1.1B params initialize in seconds there
        model = Model(args.size).to(dtype)
    if mode == "torchao":
        from torchao.optim import CPUOffloadOptimizer

        opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=args.lr, fused=True)
        handle = None
    else:
        cls = leanopt.optim.registry.optimizer_class(args.optimizer)
        opt = cls(model.parameters(), lr=args.lr, offload=None if mode == "device" else "cpu")
        handle = leanopt.release_gradients(model, opt) if mode == "offload+release" else None
    return dict(mode=mode, model=model, opt=opt, handle=handle, iteration=[], step=[], fwd_bwd=[])


def one_step(run: dict[str, Any], tokens: torch.Tensor, device: torch.device) -> None:
    sync(device)
    t0 = time.perf_counter()
    run["model"](tokens).backward()
    sync(device)
    t1 = time.perf_counter()
    run["opt"].step()
    run["opt"].zero_grad()
    sync(device)
    t2 = time.perf_counter()
    run["fwd_bwd"].append((t1 - t0) * 1e3)
    run["step"].append((t2 - t1) * 1e3)
    run["iteration"].append((t2 - t0) * 1e3)


def quartiles(xs: list[float]) -> dict[str, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) >= 2 else [xs[0]] * 3
    return {"median": round(q[1], 3), "q1": round(q[0], 3), "q3": round(q[2], 3)}


def bit_identity(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Offloaded params vs a CPU copy stepped without offload, and vs the on-device optimizer, from the same gradients."""
    cls = leanopt.optim.registry.optimizer_class(args.optimizer)
    torch.manual_seed(0)
    with torch.device(device):
        model = Model(args.check_size).to(dtype)
    params = list(model.parameters())
    host = [torch.nn.Parameter(p.detach().cpu().float() if dtype != torch.float32 else p.detach().cpu().clone()) for p in params]
    dev = [torch.nn.Parameter(p.detach().clone()) for p in params]
    off = cls(params, lr=args.lr, offload="cpu")
    ref = cls(host, lr=args.lr)
    on_device = cls(dev, lr=args.lr)
    gen = torch.Generator().manual_seed(1)
    for _ in range(args.check_steps):
        tokens = torch.randint(0, model.vocab, (args.batch, args.seq), generator=gen).to(device)
        model(tokens).backward()
        for h, d, p in zip(host, dev, params):
            h.grad = p.grad.detach().cpu().to(h.dtype)
            d.grad = p.grad.detach().clone()
        off.step()
        ref.step()
        on_device.step()
        for o in (off, ref, on_device):
            o.zero_grad()
    sync(device)
    same = all(torch.equal(p.detach().cpu(), h.detach().to(dtype)) for p, h in zip(params, host))
    diff = max(float((p.detach().float() - d.detach().float()).abs().max()) for p, d in zip(params, dev))
    return {"size": args.check_size, "steps": args.check_steps, "bit_identical_to_cpu_reference": same, "max_abs_diff_vs_on_device": diff}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", choices=sorted(SIZES), default=None, help="default: full on cuda, cpu on cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: bfloat16 on cuda")
    ap.add_argument("--optimizer", default="adamw8bit")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--check-steps", type=int, default=3)
    ap.add_argument("--check-size", choices=sorted(SIZES), default=None, help="model of the bit-identity check (default: --size)")
    ap.add_argument("--modes", default="device,offload,offload+release,torchao")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    args.size = args.size or ("full" if cuda else "cpu")
    args.check_size = args.check_size or args.size
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    args.batch = args.batch or (4 if cuda else 4)
    args.seq = args.seq or (512 if cuda else 64)
    modes = [m for m in args.modes.split(",") if m != "torchao" or cuda]
    out: dict[str, Any] = {"device": str(device), "size": args.size, "dtype": str(dtype).removeprefix("torch."),
                           "optimizer": args.optimizer, "batch": args.batch, "seq": args.seq, "rounds": args.rounds,
                           "threads": torch.get_num_threads(), "modes": {}, "skipped": {}}  # fmt: skip
    out["check"] = bit_identity(args, device, dtype)
    print(json.dumps(out["check"]))
    runs = []
    for mode in modes:
        try:
            runs.append(make(args, mode, device, dtype))
        except Exception as err:  # noqa: BLE001 - a peer that is missing or fails is listed
            out["skipped"][mode] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    gen = torch.Generator().manual_seed(2)
    vocab = runs[0]["model"].vocab if runs else 2
    for r in range(args.warmup + args.rounds):
        tokens = torch.randint(0, vocab, (args.batch, args.seq), generator=gen).to(device)
        order = runs[r % len(runs):] + runs[: r % len(runs)]
        for run in order:
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            one_step(run, tokens, device)
            if cuda:
                run["peak"] = max(run.get("peak", 0), torch.cuda.max_memory_allocated(device))
            if r < args.warmup:
                for key in ("iteration", "step", "fwd_bwd"):
                    run[key].clear()
    n_params = sum(p.numel() for p in runs[0]["model"].parameters()) if runs else 0
    out["params"] = n_params
    for run in runs:
        row = {k: quartiles(run[k]) for k in ("iteration", "step", "fwd_bwd")}
        if run["mode"].startswith("offload"):
            row["host_bytes"] = run["opt"].placement.host_bytes()
            row["host_bytes_per_param"] = round(row["host_bytes"] / n_params, 3)
        if cuda:
            row["device_peak_bytes"] = run.get("peak", 0)
        out["modes"][run["mode"]] = row
    m = out["modes"]
    if {"device", "offload", "offload+release"} <= m.keys():
        host_step = m["offload"]["step"]["median"]
        hidden = (m["device"]["fwd_bwd"]["median"] + host_step - m["offload+release"]["iteration"]["median"]) / host_step
        out["hidden_share"] = round(max(0.0, min(1.0, hidden)), 3)
        out["offload_overhead"] = round(m["offload"]["iteration"]["median"] / m["device"]["iteration"]["median"], 3)
        out["released_overhead"] = round(m["offload+release"]["iteration"]["median"] / m["device"]["iteration"]["median"], 3)
    for name, row in m.items():
        print(f"{name:16s} iteration {row['iteration']['median']:9.2f} ms (q1 {row['iteration']['q1']:.2f}, q3 "
              f"{row['iteration']['q3']:.2f})  step() {row['step']['median']:9.2f} ms  fwd+bwd {row['fwd_bwd']['median']:9.2f} ms")  # fmt: skip
    print(json.dumps({k: out.get(k) for k in ("params", "hidden_share", "offload_overhead", "released_overhead", "skipped")}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if out["check"]["bit_identical_to_cpu_reference"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
