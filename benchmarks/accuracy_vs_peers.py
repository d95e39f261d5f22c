"""Low-bit AdamW accuracy, side by side with the peers: distance from fp32 torch AdamW.

Three scenarios on one 1024x1024 fp32 tensor, 20 steps, lr 1e-3, weight decay 0, each
optimizer fed the same gradients:

* ``randn``: fresh ``randn * 0.01`` gradients every step (FACTS: bnb 8-bit 8.3e-4 / 6.7e-5,
  torchao 4-bit 1.1e-2 / 9.1e-4).
* ``heavy``: ``randn * 0.01 * s`` with a fixed per-element scale ``s = exp(1.5 * randn)``:
  busy and quiet features side by side in a block, as in a real layer.
* ``hazard``: per-element gradients ``±10^U(-6, 0)`` (six decades inside every block), then
  from step 2 on a zero gradient for a random half of the elements -- the pattern that turns
  a second moment rounded to 0 into an ``lr * m / eps`` step (FACTS: 330 for bitsandbytes and
  torchao 8-bit on a GPU, 0.016 for bitsandbytes on CPU).

Columns are max and mean ``|p - p_fp32|`` and state bytes per param. Run:
``python benchmarks/accuracy_vs_peers.py [--size 1024] [--eager-peers]``. Peers that are not
installed are listed as absent. torchao compiles one kernel per parameter (tens of seconds on
CPU); ``--eager-peers`` runs its maths eagerly instead (same numbers, no compile).

The test suite imports the scenario definitions from here, so the tests and this table
measure the same thing.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

import leanopt

SIZE = 1024
STEPS = 20
LR = 1e-3

Factory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


# ---- scenarios ----------------------------------------------------------------------------------
def randn_scenario(size: int = SIZE, steps: int = STEPS, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    p0 = torch.randn(size, size, generator=g)
    return p0, [torch.randn(size, size, generator=g) * 0.01 for _ in range(steps)]


def heavy_scenario(size: int = SIZE, steps: int = STEPS, seed: int = 5) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    p0 = torch.randn(size, size, generator=g)
    scale = torch.exp(1.5 * torch.randn(size, size, generator=g))
    return p0, [torch.randn(size, size, generator=g) * 0.01 * scale for _ in range(steps)]


def hazard_scenario(size: int = SIZE, steps: int = STEPS, seed: int = 1) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Also returns the mask of elements that keep their gradient after step 1."""
    g = torch.Generator().manual_seed(seed)
    p0 = torch.randn(size, size, generator=g)
    magnitude = 10.0 ** (-6.0 * torch.rand(size, size, generator=g))
    sign = torch.where(torch.rand(size, size, generator=g) < 0.5, -1.0, 1.0)
    base = magnitude * sign
    on = torch.rand(size, size, generator=g) < 0.5
    return p0, [base if t == 0 else base * on for t in range(steps)], on


def run(factory: Factory, p0: torch.Tensor, grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.optim.Optimizer]:
    """Final param after feeding ``grads`` to ``factory([param])``, and the optimizer."""
    p = torch.nn.Parameter(p0.clone())
    opt = factory([p])
    for grad in grads:
        p.grad = grad.clone()
        opt.step()
    return p.detach(), opt


def fp32_reference(p0: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    return run(lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.0, foreach=False), p0, grads)[0]


def distance(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    d = (a.double() - b.double()).abs()
    return d.max().item(), d.mean().item()


# ---- contenders ---------------------------------------------------------------------------------
class AdamW8bitDynamicTree(leanopt.AdamW8bit):
    """leanopt's 8-bit AdamW on the dynamic-tree codes of bitsandbytes/torchao (with its zero
    in the second-moment code): isolates the code book from the rest of the design."""

    exp_avg_code = "dyn-s8"
    exp_avg_sq_code = "dyn-u8"


def leanopt_factories() -> dict[str, Factory]:
    return {
        "leanopt AdamW8bit": lambda ps: leanopt.AdamW8bit(ps, lr=LR, weight_decay=0.0),
        "leanopt AdamW4bit": lambda ps: leanopt.AdamW4bit(ps, lr=LR, weight_decay=0.0),
        "leanopt 8-bit, dynamic-tree codes": lambda ps: AdamW8bitDynamicTree(ps, lr=LR, weight_decay=0.0),
    }


def bnb_factory() -> Factory | None:
    try:
        import bitsandbytes as bnb
    except Exception:  # noqa: BLE001 - any import failure means "absent"
        return None
    return lambda ps: bnb.optim.AdamW8bit(ps, lr=LR, weight_decay=0.0)


def torchao_factories() -> dict[str, Factory]:
    try:
        from torchao.optim import AdamW4bit, AdamW8bit, AdamWFp8
    except Exception:  # noqa: BLE001
        return {}
    return {
        "torchao AdamW8bit": lambda ps: AdamW8bit(ps, lr=LR, weight_decay=0.0),
        "torchao AdamW4bit": lambda ps: AdamW4bit(ps, lr=LR, weight_decay=0.0),
        "torchao AdamWFp8": lambda ps: AdamWFp8(ps, lr=LR, weight_decay=0.0),
    }


@contextlib.contextmanager
def eager_torch_compile() -> Iterator[None]:
    """Make ``torch.compile(fn, ...)`` return ``fn``: torchao's update runs eagerly, same maths."""
    original = torch.compile

    def passthrough(fn=None, **kwargs):  # noqa: ANN001
        return fn if fn is not None else (lambda f: f)

    torch.compile = passthrough  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compile = original  # type: ignore[assignment]


def state_bytes_per_param(opt: torch.optim.Optimizer, numel: int) -> float:
    return leanopt.measure(opt).bytes / numel


# ---- table --------------------------------------------------------------------------------------
@dataclass
class Row:
    name: str
    randn: tuple[float, float]
    heavy: tuple[float, float]
    hazard: tuple[float, float]
    bytes_per_param: float
    seconds: float


def measure_contender(name: str, factory: Factory, scenarios: dict, refs: dict) -> Row:
    t0 = time.perf_counter()
    out = {}
    bpp = math.nan
    for key, (p0, grads) in scenarios.items():
        final, opt = run(factory, p0, grads)
        out[key] = distance(final, refs[key])
        if not math.isfinite(bpp):
            try:
                bpp = state_bytes_per_param(opt, p0.numel())
            except Exception:  # noqa: BLE001 - a peer's state we cannot measure
                bpp = math.nan
    return Row(name, out["randn"], out["heavy"], out["hazard"], bpp, time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=SIZE)
    ap.add_argument("--eager-peers", action="store_true", help="run torchao without torch.compile")
    ap.add_argument("--skip-torchao", action="store_true")
    args = ap.parse_args(argv)

    p0, grads = randn_scenario(args.size)
    hp0, hgrads, _ = hazard_scenario(args.size)
    vp0, vgrads = heavy_scenario(args.size)
    scenarios = {"randn": (p0, grads), "heavy": (vp0, vgrads), "hazard": (hp0, hgrads)}
    refs = {k: fp32_reference(*v) for k, v in scenarios.items()}

    contenders: dict[str, Factory | None] = dict(leanopt_factories())
    contenders["bitsandbytes AdamW8bit"] = bnb_factory()
    if not args.skip_torchao:
        ao = torchao_factories()
        contenders.update(ao or {"torchao": None})

    rows, absent = [], []
    for name, factory in contenders.items():
        if factory is None:
            absent.append(name)
            continue
        ctx = eager_torch_compile() if (args.eager_peers and name.startswith("torchao")) else contextlib.nullcontext()
        with ctx:
            try:
                rows.append(measure_contender(name, factory, scenarios, refs))
            except Exception as err:  # noqa: BLE001 - report a peer that fails here, keep going
                absent.append(f"{name} (failed: {type(err).__name__}: {err})")

    print(f"Distance from fp32 torch.optim.AdamW after {STEPS} steps, one {args.size}x{args.size} tensor, lr {LR}")
    head = f"{'optimizer':36s} {'randn max':>10s} {'mean':>9s} {'heavy max':>10s} {'mean':>9s} {'hazard max':>11s} {'mean':>9s} {'B/param':>8s} {'s':>6s}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r.name:36s} {r.randn[0]:10.2e} {r.randn[1]:9.2e} {r.heavy[0]:10.2e} {r.heavy[1]:9.2e} "
            f"{r.hazard[0]:11.2e} {r.hazard[1]:9.2e} {r.bytes_per_param:8.4f} {r.seconds:6.1f}"
        )
    for name in absent:
        print(f"{name}: not available here")
    print(f"(hazard: an element that does not move at all ends {STEPS} lr = {STEPS * LR:.3f} from fp32 at most)")


if __name__ == "__main__":
    main()
