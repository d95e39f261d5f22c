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

Columns are max and mean ``|p - p_fp32|`` and state bytes per param.

A second table, **sparse**, runs longer on gradients that are zero most of the
time, over several seeds (:class:`SparseGradients`): one 256x1024 weight of a layer whose
1024 input features are each active on 2 % of the steps (independently); an active feature's
column gets ``0.01 * (mu + 3 * eps)`` -- ``mu`` a fixed per-element direction, ``eps`` fresh
noise -- and every other gradient element is exactly 0; 300 steps. Each element's gradient is
a rare burst against zeros, and in flat order a 128- or 256-element block holds a couple of
fresh bursts next to many decaying momenta. ``sparse+spikes`` draws the same way with 1 % of
the active elements 30x larger, so that a burst sets its block's scale. Columns: mean
``|p - p_fp32|``, the number of elements further than 0.01 (10 lr) from fp32, and the max.

A third table, ``--training``, trains a small real model with each optimizer: the MLP of
``tests/test_quantized.py`` (64-128-128-10 on scikit-learn's digits, 300 steps of 64 images,
lr 1e-3, default weight decay, the last 397 images held out), per seed, and prints each
optimizer's held-out loss, final training loss (mean of the last 10 steps) and held-out
accuracy relative to fp32 ``torch.optim.AdamW`` on the same seed.

A fourth, ``--state-dtypes``, compares how leanopt AdamW stores its moments -- fp32, bf16
with stochastic rounding (``state_dtype=torch.bfloat16``) and 8-bit (``AdamW8bit``) -- on the
three 20-step scenarios over several seeds (``--state-seeds``), as mean +- standard deviation
over the seeds of each run's max and mean distance from fp32 torch AdamW.

Run: ``python benchmarks/accuracy_vs_peers.py [--size 1024] [--eager-peers] [--backend B]
[--only NAMES] [--sparse-seeds 0,1,2] [--sparse-only | --no-sparse] [--training
[--training-seeds 0,1,2,3,4]]``. Peers that are not installed are
listed as absent. torchao compiles one kernel per parameter (tens of seconds on CPU);
``--eager-peers`` runs its maths eagerly instead (same numbers, no compile).

The test suite imports the scenario definitions from here, so the tests and this table
measure the same thing.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator
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


class SparseGradients:
    """The gradients of the ``sparse`` scenarios: re-iterable, the same sequence every time
    (generated step by step from ``seed``, so 300 steps of a 256x1024 tensor never sit in
    memory at once). ``p0`` is the initial param.

    Element ``(i, j)`` of step ``t`` is ``0.01 * (mu[i, j] + noise * eps_t[i, j])`` (times
    ``spike_factor`` with probability ``spike_prob``) if input feature ``j`` is active at
    ``t`` (probability ``density``, independently per feature and step), else exactly 0.
    """

    def __init__(
        self,
        rows: int = 256,
        cols: int = 1024,
        steps: int = 300,  # SPARSE_STEPS
        seed: int = 0,
        *,
        density: float = 0.02,
        noise: float = 3.0,
        spike_prob: float = 0.0,
        spike_factor: float = 1.0,
    ) -> None:
        self.rows, self.cols, self.steps, self.seed = rows, cols, steps, seed
        self.density, self.noise, self.spike_prob, self.spike_factor = density, noise, spike_prob, spike_factor
        self.p0 = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed + 7919)
        shape = (self.rows, self.cols)
        mu = torch.randn(shape, generator=g)
        for _ in range(self.steps):
            active = torch.rand(1, self.cols, generator=g) < self.density
            grad = (mu + self.noise * torch.randn(shape, generator=g)) * 0.01
            if self.spike_prob > 0:
                grad = torch.where(torch.rand(shape, generator=g) < self.spike_prob, grad * self.spike_factor, grad)
            yield grad * active


SPARSE_STEPS = 300
SPARSE_FAR = 0.01  # "far": more than 10 lr from fp32 AdamW
SPARSE_SEEDS = (0, 1, 2)


def sparse_variants(seed: int, steps: int = SPARSE_STEPS) -> dict[str, SparseGradients]:
    """The two sparse scenarios of the second table, for one seed."""
    return {
        "sparse": SparseGradients(steps=steps, seed=seed),
        "sparse+spikes": SparseGradients(steps=steps, seed=seed, spike_prob=0.01, spike_factor=30.0),
    }


def sparse_distance(a: torch.Tensor, b: torch.Tensor, far: float = SPARSE_FAR) -> tuple[float, int, float]:
    """(mean, number of elements further than ``far``, max) of ``|a - b|``."""
    d = (a.double() - b.double()).abs()
    return d.mean().item(), int((d > far).sum().item()), d.max().item()


def run(factory: Factory, p0: torch.Tensor, grads: Iterable[torch.Tensor], *,
        device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.optim.Optimizer]:  # fmt: skip
    """Final param after feeding ``grads`` to ``factory([param])`` on ``device``, and the optimizer."""
    p = torch.nn.Parameter(p0.to(device, copy=True))
    opt = factory([p])
    for grad in grads:
        p.grad = grad.to(device, copy=True)
        opt.step()
    return p.detach(), opt


def fp32_reference(p0: torch.Tensor, grads: Iterable[torch.Tensor], *, device: torch.device | str = "cpu") -> torch.Tensor:
    return run(lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.0, foreach=False), p0, grads, device=device)[0]


def distance(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    d = (a.double() - b.double()).abs()
    return d.max().item(), d.mean().item()


# ---- contenders ---------------------------------------------------------------------------------
class AdamW8bitDynamicTree(leanopt.AdamW8bit):
    """leanopt's 8-bit AdamW on the dynamic-tree codes of bitsandbytes/torchao (with its zero
    in the second-moment code): isolates the code book from the rest of the design."""

    exp_avg_code = "dyn-s8"
    exp_avg_sq_code = "dyn-u8"


def leanopt_factories(backend: str = "auto") -> dict[str, Factory]:
    return {
        "leanopt AdamW8bit": lambda ps: leanopt.AdamW8bit(ps, lr=LR, weight_decay=0.0, backend=backend),
        "leanopt AdamW4bit": lambda ps: leanopt.AdamW4bit(ps, lr=LR, weight_decay=0.0, backend=backend),
        "leanopt 8-bit, dynamic-tree codes": lambda ps: AdamW8bitDynamicTree(ps, lr=LR, weight_decay=0.0, backend=backend),
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
    ap.add_argument("--only", default="", help="comma-separated parts of optimizer names to run (default: all)")
    ap.add_argument("--backend", default="auto", help="leanopt's backend (default auto; 'reference' measures the rule itself)")
    ap.add_argument("--sparse-seeds", default=",".join(map(str, SPARSE_SEEDS)), help="seeds of the sparse table (default 0,1,2)")
    ap.add_argument("--sparse-steps", type=int, default=SPARSE_STEPS)
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--sparse-only", action="store_true", help="only the sparse table")
    only.add_argument("--no-sparse", action="store_true", help="only the 20-step table")
    only.add_argument("--training", action="store_true", help="only the digits training table")
    only.add_argument("--state-dtypes", action="store_true", help="only the fp32 / bf16 / 8-bit states table")
    ap.add_argument("--training-seeds", default="0,1,2,3,4")
    ap.add_argument("--state-seeds", default="0,1,2,3,4", help="seeds of the --state-dtypes table")
    args = ap.parse_args(argv)
    if args.state_dtypes:
        state_dtype_table(args.size, [int(s) for s in args.state_seeds.split(",") if s.strip()], args.backend)
        return

    contenders: dict[str, Factory | None] = dict(leanopt_factories(args.backend))
    contenders["bitsandbytes AdamW8bit"] = bnb_factory()
    if not args.skip_torchao:
        ao = torchao_factories()
        contenders.update(ao or {"torchao": None})
    if args.only:
        parts = [part.strip() for part in args.only.split(",") if part.strip()]
        contenders = {n: f for n, f in contenders.items() if any(part in n for part in parts)}

    if args.training:
        seeds = [int(s) for s in args.training_seeds.split(",") if s.strip()]
        training_table([n for n, f in contenders.items() if f is not None], seeds, args.eager_peers, args.backend)
        return
    if not args.sparse_only:
        dense_table(args, contenders)
    if not args.no_sparse:
        seeds = [int(s) for s in args.sparse_seeds.split(",") if s.strip()]
        sparse_table(contenders, seeds, args.sparse_steps, args.eager_peers)


def state_dtype_factories(backend: str = "auto") -> dict[str, Factory]:
    """leanopt AdamW with each storage of its moments (the --state-dtypes table)."""
    return {
        "leanopt AdamW (fp32 states)": lambda ps: leanopt.AdamW(ps, lr=LR, weight_decay=0.0, backend=backend),
        "leanopt AdamW (bf16 states)": lambda ps: leanopt.AdamW(ps, lr=LR, weight_decay=0.0, backend=backend,
                                                                state_dtype=torch.bfloat16),  # fmt: skip
        "leanopt AdamW8bit": lambda ps: leanopt.AdamW8bit(ps, lr=LR, weight_decay=0.0, backend=backend),
    }


def state_dtype_drift(size: int, seeds: list[int], backend: str = "auto") -> dict[str, dict[str, list[tuple[float, float]]]]:
    """``{optimizer: {scenario: [(max, mean) distance from fp32 torch AdamW, per seed]}}``."""
    out: dict[str, dict[str, list[tuple[float, float]]]] = {name: {} for name in state_dtype_factories()}
    for seed in seeds:
        scenarios = {"randn": randn_scenario(size, seed=seed), "heavy": heavy_scenario(size, seed=seed),
                     "hazard": hazard_scenario(size, seed=seed)[:2]}  # fmt: skip
        for scenario, (p0, grads) in scenarios.items():
            ref = fp32_reference(p0, grads)
            for name, factory in state_dtype_factories(backend).items():
                out[name].setdefault(scenario, []).append(distance(run(factory, p0, grads)[0], ref))
    return out


def state_dtype_table(size: int, seeds: list[int], backend: str = "auto") -> None:
    drift = state_dtype_drift(size, seeds, backend)
    print(f"Distance from fp32 torch.optim.AdamW after {STEPS} steps, one {size}x{size} tensor, lr {LR}, seeds {seeds}: "
          "mean +- std over seeds of each run's max and mean |p - p_fp32|")  # fmt: skip
    head = f"{'optimizer':30s}" + "".join(f" {s + ' max':>22s} {s + ' mean':>22s}" for s in ("randn", "heavy", "hazard"))
    print(head)
    print("-" * len(head))
    for name, by_scenario in drift.items():
        cells = []
        for scenario in ("randn", "heavy", "hazard"):
            for k in (0, 1):
                v = torch.tensor([row[k] for row in by_scenario[scenario]], dtype=torch.float64)
                std = v.std().item() if len(v) > 1 else 0.0
                cells.append(f"{v.mean().item():.2e} +- {std:.1e}")
        print(f"{name:30s}" + "".join(f" {c:>22s}" for c in cells))


def peer_context(name: str, eager: bool) -> contextlib.AbstractContextManager:
    """Where ``eager``, torchao's optimizers run their maths without ``torch.compile``."""
    return eager_torch_compile() if (eager and name.startswith("torchao")) else contextlib.nullcontext()


def dense_table(args: argparse.Namespace, contenders: dict[str, Factory | None]) -> None:
    p0, grads = randn_scenario(args.size)
    hp0, hgrads, _ = hazard_scenario(args.size)
    vp0, vgrads = heavy_scenario(args.size)
    scenarios = {"randn": (p0, grads), "heavy": (vp0, vgrads), "hazard": (hp0, hgrads)}
    refs = {k: fp32_reference(*v) for k, v in scenarios.items()}

    rows, absent = [], []
    for name, factory in contenders.items():
        if factory is None:
            absent.append(name)
            continue
        with peer_context(name, args.eager_peers):
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


def sparse_table(contenders: dict[str, Factory | None], seeds: list[int], steps: int, eager_peers: bool) -> None:
    """Per seed and scenario: mean distance, elements further than SPARSE_FAR, max distance."""
    names = [n for n, f in contenders.items() if f is not None]
    results: dict[tuple[str, str, int], tuple[float, int, float] | str] = {}
    kinds = list(sparse_variants(0, steps))
    for seed in seeds:
        for kind, grads in sparse_variants(seed, steps).items():
            ref = fp32_reference(grads.p0, grads)
            for name in names:
                with peer_context(name, eager_peers):
                    try:
                        results[(kind, name, seed)] = sparse_distance(run(contenders[name], grads.p0, grads)[0], ref)
                    except Exception as err:  # noqa: BLE001 - report a peer that fails here, keep going
                        results[(kind, name, seed)] = f"failed: {type(err).__name__}: {err}"
    shape = sparse_variants(0, steps)["sparse"]
    print()
    print(
        f"Sparse gradients: distance from fp32 torch.optim.AdamW after {steps} steps, one {shape.rows}x{shape.cols} "
        f"tensor, lr {LR}, seeds {','.join(map(str, seeds))}; far = further than {SPARSE_FAR}"
    )
    head = f"{'scenario':14s} {'optimizer':36s} {'seed':>4s} {'mean':>9s} {'far':>7s} {'max':>9s}"
    print(head)
    print("-" * len(head))
    for kind in kinds:
        for name in names:
            for seed in seeds:
                r = results[(kind, name, seed)]
                cells = r if isinstance(r, str) else f"{r[0]:9.2e} {r[1]:7d} {r[2]:9.2e}"
                print(f"{kind:14s} {name:36s} {seed:4d} {cells}")
        a, b = "leanopt AdamW4bit", "torchao AdamW4bit"
        pairs = [(results.get((kind, a, s)), results.get((kind, b, s))) for s in seeds]
        if all(isinstance(x, tuple) and isinstance(y, tuple) for x, y in pairs):
            ratios = "  ".join(f"seed {s}: mean {x[0] / y[0]:.2f}, far {x[1] / max(y[1], 1):.2f}, max {x[2] / y[2]:.2f}" for s, (x, y) in zip(seeds, pairs))
            print(f"{kind:14s} {'leanopt 4-bit / torchao 4-bit':36s} {ratios}")



# ---- a real training run ------------------------------------------------------------------------
def digits_run(factory: Callable, seed: int, steps: int = 300) -> tuple[float, float, float]:
    """The MLP of tests/test_quantized.py on scikit-learn's digits: (held-out loss, final
    training loss = mean of the last 10 steps, held-out accuracy). ``factory(params)`` makes
    the optimizer (lr, weight decay: its own)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16
    y = torch.tensor(y)
    x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]
    torch.manual_seed(seed)
    # 64*128 and 128*128 weights are quantized; the 1280-element head and biases keep fp32.
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
    )
    opt = factory(model.parameters())
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, len(x_train), (64,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        out = model(x_test)
        held_out = torch.nn.functional.cross_entropy(out, y_test).item()
        accuracy = (out.argmax(1) == y_test).float().mean().item()
    return held_out, sum(losses[-10:]) / 10, accuracy


def training_factories(backend: str = "auto") -> dict[str, Factory | None]:
    """The optimizers of the training table at lr 1e-3 with their default weight decay (0.01
    for every one here), as tests/test_quantized.py runs leanopt's."""
    out: dict[str, Factory | None] = {
        "leanopt AdamW8bit": lambda ps: leanopt.AdamW8bit(ps, lr=1e-3, backend=backend),
        "leanopt AdamW4bit": lambda ps: leanopt.AdamW4bit(ps, lr=1e-3, backend=backend),
        "leanopt 8-bit, dynamic-tree codes": lambda ps: AdamW8bitDynamicTree(ps, lr=1e-3, backend=backend),
        "bitsandbytes AdamW8bit": None,
    }
    try:
        import bitsandbytes as bnb

        out["bitsandbytes AdamW8bit"] = lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-3)
    except Exception:  # noqa: BLE001, S110 - absent: its row is left out
        pass
    try:
        from torchao.optim import AdamW4bit, AdamW8bit, AdamWFp8

        out.update({f"torchao {c.__name__}": (lambda ps, c=c: c(ps, lr=1e-3)) for c in (AdamW8bit, AdamW4bit, AdamWFp8)})
    except Exception:  # noqa: BLE001, S110
        pass
    return out


def training_table(names: list[str], seeds: list[int], eager_peers: bool, backend: str) -> None:
    """Per optimizer in ``names``: held-out loss and final training loss relative to fp32 AdamW
    on the same seed (%), held-out accuracy difference (points), each seed."""
    ref = {s: digits_run(lambda ps: torch.optim.AdamW(ps, lr=1e-3), s) for s in seeds}
    print(
        "Digits MLP (tests/test_quantized.py's), 300 steps, lr 1e-3, weight decay 0.01; relative to fp32 "
        f"torch.optim.AdamW on the same seed; seeds {','.join(map(str, seeds))}"
    )
    for i, what in enumerate(("held-out loss", "final training loss", "held-out accuracy")):
        print(f"fp32 AdamW {what}: " + " ".join(f"{ref[s][i]:.4f}" for s in seeds))
    head = f"{'optimizer':36s} {'held-out loss, %':>30s} {'final training loss, %':>30s} {'accuracy, points':>30s}"
    print(head)
    print("-" * len(head))
    for name, factory in training_factories(backend).items():
        if name not in names or factory is None:
            continue
        with peer_context(name, eager_peers):
            try:
                runs = {s: digits_run(factory, s) for s in seeds}
            except Exception as err:  # noqa: BLE001 - report a peer that fails here, keep going
                print(f"{name:36s} failed: {type(err).__name__}: {err}")
                continue
        held = " ".join(f"{100 * (runs[s][0] / ref[s][0] - 1):+6.2f}" for s in seeds)
        final = " ".join(f"{100 * (runs[s][1] / ref[s][1] - 1):+6.1f}" for s in seeds)
        acc = " ".join(f"{100 * (runs[s][2] - ref[s][2]):+6.2f}" for s in seeds)
        print(f"{name:36s} {held:>30s} {final:>30s} {acc:>30s}")


if __name__ == "__main__":
    main()
