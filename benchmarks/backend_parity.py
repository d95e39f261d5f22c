"""Every registered elementwise rule's paths held against each other on one device: its Triton
twin (``backend="triton"``, where the rule has one taking its number of states), its graphs
compiled by Inductor (``backend="compiled"``: :mod:`leanopt.kernels.graphs`, what a rule without
a twin runs on a GPU) and the reference (``backend="reference"``, the definition).

    python benchmarks/backend_parity.py --device cuda                 # scripts/gpu_check.py's twins stage
    python benchmarks/backend_parity.py --device cpu --toy --dynamo-only   # its dry run: Triton interpreted

Cases: the elementwise optimizers of tests/registry.py (the library's, those defined outside it,
bf16 states), each with fp32 and bf16 params. Every backend takes the same params and the same
gradients (scales 1e-4..1 inside each block, 30 % exact zeros) for ``steps`` steps; the low-bit
optimizers take ``steps - 1`` reference steps and then one step of the backend, so that one code
flipped at a boundary is not followed by divergence (tests/test_rules.py does the same).

Figures, per pair of paths: the largest ``|a - b|`` over all params, divided by the reference's
largest ``|param|``; the share of elements within the tolerance; for quantized states the share
of codes equal. A pair passes within tests/test_rules.py's tolerances, doubled for the twin
against the compiled graphs (each is within them of the reference):

* fp32 params: ``|a - b| <= 2e-6 max|ref| + 1e-7`` on every element (quantized: 99 %);
* bf16 params: two ulps on 99 % of elements (quantized: one ulp);
* every param within ``lr / 10`` of the other path;
* dense fp32 states within ``2e-5 max|ref| + 1e-7``; bf16 states equal on 99 % of elements;
  quantized states' codes equal on 99 %, block scales within 1e-5 relative.

``--dynamo-only``: the compiled graphs traced by dynamo and run eagerly, no Inductor code (the
dry run on 2 CPU cores: an Inductor compile per rule takes 20-60 s there; Inductor's CPU code of
the same update functions is held to the reference by tests/test_cpu_paths.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(7,), (2049,), (33, 65), (1000, 300)]  # one list of four params per case: one graph
LOWBIT_SHAPES = [(300,), (2049,), (33, 65), (1000, 300)]  # all quantized (min_quant_size 100), partial last blocks
TOY_SHAPES = [(7,), (300,), (33, 65)]
TOY_LOWBIT_SHAPES = [(300,), (33, 65)]
STEPS = 6
DTYPES = (torch.float32, torch.bfloat16)
TOY_STEPS = 3


def cases(one_per_family: bool = False) -> list[Any]:
    """tests/registry.py's elementwise optimizer cases (the one list every parity test iterates);
    ``one_per_family``: only each family's representative (the dry run: the stage's own code is
    the same for every rule, and tests/test_rules.py holds every rule's twin and compiled graphs
    to the reference)."""
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import leanopt
    from registry import GENERIC, representatives

    elementwise = [c for c in GENERIC if issubclass(c.cls, leanopt.ElementwiseOptimizer)]
    return representatives(elementwise) if one_per_family else elementwise


def _ulp(x: torch.Tensor) -> torch.Tensor:
    mant = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[x.dtype]
    mag = x.detach().float().abs().clamp_min(torch.finfo(x.dtype).tiny)
    return torch.exp2(torch.floor(torch.log2(mag)) - mant)


def _inputs(shapes: list[tuple[int, ...]], dtype: torch.dtype, steps: int, seed: int):
    gen = torch.Generator().manual_seed(seed)

    def grad(shape: tuple[int, ...]) -> torch.Tensor:
        scale = 10.0 ** torch.randint(-4, 1, shape, generator=gen).float()
        keep = torch.rand(shape, generator=gen) > 0.3
        return (torch.randn(shape, generator=gen) * scale * keep).to(dtype)

    init = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    return init, [[grad(s) for s in shapes] for _ in range(steps)]


def _run(case: Any, backend: str, device: torch.device, init, grads, lowbit: bool):
    params = [p.to(device, copy=True).requires_grad_() for p in init]
    kwargs = {**case.kwargs, **({"min_quant_size": 100} if lowbit else {})}
    opt = case.cls(params, backend="reference" if lowbit else backend, **kwargs)
    for t, step in enumerate(grads):
        if lowbit and t == len(grads) - 1:
            opt.backend = backend
        for p, g in zip(params, step):
            p.grad = g.to(device, copy=True)
        opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return params, opt


def _pair(a, b, scale_from, lr: float, dtype: torch.dtype, lowbit: bool, slack: float) -> dict[str, Any]:
    """How far run ``a`` is from run ``b`` (params and states), against the tolerances."""
    from leanopt.quant import QuantizedState

    (pa, oa), (pb, ob), (pr, _) = a, b, scale_from
    worst, within, codes, problems = 0.0, 1.0, 1.0, []
    scale = max(float(r.detach().float().abs().max()) for r in pr if r.numel()) or 1.0
    for i, (x, y, r) in enumerate(zip(pa, pb, pr)):
        if not r.numel():
            continue
        diff = (x.detach().float() - y.detach().float()).abs().cpu()
        if dtype == torch.float32:
            close = diff <= slack * (2e-6 * r.detach().abs().max().cpu() + 1e-7)
        else:
            close = diff <= slack * (1 if lowbit else 2) * _ulp(r.detach().cpu()) * 1.001
        share = float(close.float().mean())
        worst, within = max(worst, float(diff.max()) / scale), min(within, share)
        if share < (0.99 if lowbit or dtype != torch.float32 else 1.0):
            problems.append(f"param {i}: {share:.4f} of elements within tolerance")
        if float(diff.max()) > lr / 10:
            problems.append(f"param {i}: a step off by {float(diff.max()):.3g} > lr/10")
        for key, want in ob.state[y].items():
            got = oa.state[x][key]
            if key == "step":
                continue
            if isinstance(want, QuantizedState):
                same = float((got.codes == want.codes).float().mean())
                codes = min(codes, same)
                if same < 0.99:
                    problems.append(f"param {i} {key}: codes equal on {same:.4f}")
                if not torch.allclose(got.absmax, want.absmax, rtol=1e-5 * slack, atol=0):
                    problems.append(f"param {i} {key}: block scales")
            elif want.dtype == torch.bfloat16:
                same = float((got == want).float().mean())
                if same < 0.99:
                    problems.append(f"param {i} {key}: bf16 state equal on {same:.4f}")
            else:
                gap = float((got.float() - want.float()).abs().max())
                if gap > slack * (2e-5 * float(want.float().abs().max()) + 1e-7):
                    problems.append(f"param {i} {key}: off by {gap:.3g}")
    return {"max": worst, "within": within, "codes_equal": codes, "ok": not problems, "problems": problems[:4]}


def compare(case: Any, device: torch.device, dtype: torch.dtype, *, steps: int = STEPS, toy: bool = False,
            seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """One case and param dtype: the paths side by side (a row of the report)."""
    from leanopt.kernels import twins

    lowbit = hasattr(case.cls, "state_bits")
    shapes = (TOY_LOWBIT_SHAPES if toy else LOWBIT_SHAPES) if lowbit else (TOY_SHAPES if toy else SHAPES)
    init, grads = _inputs(shapes, dtype, steps, seed)
    start = time.perf_counter()
    runs = {b: _run(case, b, device, init, grads, lowbit) for b in ("reference", "compiled", "triton")}
    opt = runs["reference"][1]
    group = opt.param_groups[0]
    hp = opt.rule.hyperparameters(group)
    twin = twins.takes(twins.TRITON, opt.rule, hp, len(opt.state_keys(group)))
    lr = float(case.kwargs["lr"])
    pairs = {"compiled~reference": _pair(runs["compiled"], runs["reference"], runs["reference"], lr, dtype, lowbit, 1.0)}
    if twin:
        pairs["twin~reference"] = _pair(runs["triton"], runs["reference"], runs["reference"], lr, dtype, lowbit, 1.0)
        pairs["twin~compiled"] = _pair(runs["triton"], runs["compiled"], runs["reference"], lr, dtype, lowbit, 2.0)
    else:  # backend="triton" runs the compiled graphs where there is no twin: the same bits
        same = all(torch.equal(x.detach(), y.detach()) for x, y in zip(runs["triton"][0], runs["compiled"][0]))
        pairs["triton-backend~compiled"] = {"max": 0.0 if same else None, "ok": same,
                                            "problems": [] if same else ["backend='triton' differs from the compiled graphs"]}  # fmt: skip
    return {"case": case.name, "dtype": str(dtype).removeprefix("torch."), "twin": twin, "steps": steps,
            "params": sum(math.prod(s) for s in shapes), "pairs": pairs,
            "ok": all(p["ok"] for p in pairs.values()), "seconds": round(time.perf_counter() - start, 2)}  # fmt: skip


def dynamo_only() -> None:
    """Every ``torch.compile`` from now on traced by dynamo and run by its eager backend."""
    torch.compile = functools.partial(torch.compile, backend="eager")  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--toy", action="store_true", help="toy shapes (the dry run)")
    ap.add_argument("--dynamo-only", action="store_true", help="compiled graphs traced by dynamo, run eagerly")
    ap.add_argument("--only", help="comma-separated case names")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="param dtypes (default: float32,bfloat16)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.dynamo_only:
        dynamo_only()
    device = torch.device(args.device)
    rows = []
    for dtype in [getattr(torch, name) for name in args.dtypes.split(",")]:
        for case in cases():
            if args.only and case.name not in args.only.split(","):
                continue
            row = compare(case, device, dtype, steps=args.steps, toy=args.toy)
            rows.append(row)
            if not args.json:
                cells = "  ".join(f"{k} {v['max']:.2e}" if v.get("max") is not None else f"{k} -" for k, v in row["pairs"].items())
                print(f"{row['case']:22s} {row['dtype']:9s} {'ok ' if row['ok'] else 'FAIL'} {cells}  ({row['seconds']} s)", flush=True)
    if args.json:
        print(json.dumps(rows))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
