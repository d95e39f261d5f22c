"""The planner against a real GPU step: ``plan(..., device="cuda")`` within ±5 % of
``torch.cuda.max_memory_allocated()`` (stage ``plan_check`` of scripts/gpu_check.sh).

    python3 -m leanopt.memory.plan_check [--dry-run] [--out DIR] [--tolerance PCT]

On a CUDA machine, for each configuration of :data:`CONFIGS` (the rows of docs/plan.md: fp32
AdamW, bf16-mixed AdamW8bit, fp32 Adafactor, fp32 AdamW with checkpointing) on a DistilBERT-cased
classifier (batch 8, seq 128) and GPT-2 (124M) as a causal LM (batch 4, seq 256), one process:

1. warm-up: two steps of a one-layer model of the same architecture and configuration (the
   Triton kernels compile, cuBLAS makes its workspace: one-time set-up, left in the baseline);
2. baseline: ``torch.cuda.memory_allocated()``;
3. the model is built on the GPU (random weights, train mode), two steps, then
   ``torch.cuda.reset_peak_memory_stats()``, the third step;
4. measured = ``torch.cuda.max_memory_allocated()`` − baseline; predicted = the ``peak_bytes`` of
   ``plan(model, batch=, seq=, device="cuda")`` for the same configuration.

Then the process (``process_bytes``): for the first configuration of each model, a fresh process builds
the model on the GPU and trains three steps, as a user's script does (no warm-up); measured =
``torch.cuda.max_memory_reserved()`` + the CUDA context (``mem_get_info``: in use less reserved,
which that process also caches for the plan, :func:`leanopt.memory.process.measure_cuda_context`);
predicted = the row's ``process_bytes`` (the step's peak, the context, cuBLAS's workspace and the
allocator's segment margin), held to the same tolerance. And ``leanopt.doctor`` on the GPU for
that configuration: its categories add up to its measured peak within 1 % (``doctor`` in the JSON).

It prints a markdown table (predicted, measured, error), writes ``plan_check.json`` to ``--out``
(default ``$GPU_CHECK_OUT``, else ``$OUT``, else the current folder), prints a one-line JSON
summary last, and exits 1 if any row is outside ±``--tolerance`` % (default 5) or failed.

``--dry-run`` (or ``GPU_CHECK_DRY_RUN=1``, as gpu_check.sh sets it): no GPU. The same pipeline at
tiny sizes on the CPU: the small DistilBERT of ``tests/test_plan.py`` (two layers, :data:`DRY_CASES`),
for :data:`DRY_CONFIGS`, the CPU plan against the CPU measurement of ``benchmarks/plan_vs_measured.py``
(a fresh process, resident high-water mark), held to the same tolerance; the CUDA plan of every
configuration of :data:`CONFIGS` is computed too (the code path, not checked against anything; a
failure is a row). tests/test_plan_check.py runs the same pipeline on both small models
(:data:`SMALL_CASES`), and tests/test_plan.py holds both to a real step. No figure of a dry run is
a GPU figure. The dry run runs ``leanopt.doctor`` on the CPU on the small DistilBERT (the
``doctor`` entry), not the process rows.

The step and the models are those of ``benchmarks/plan_vs_measured.py`` (imported from the
repository, which this check needs).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
BENCHMARK = ROOT / "benchmarks" / "plan_vs_measured.py"
TOLERANCE_PCT = 5.0
GPU_CASES = ("distilbert", "gpt2")  # benchmarks/plan_vs_measured.py CASES: full size
SMALL_CASES = ("tiny-distilbert", "tiny-gpt2")  # its SMALL cases: two layers
# The dry run measures one of them (a fresh process importing torch and transformers, ~17 s of CPU on 2 cores):
# the pipeline is the same for both (tests/test_plan_check.py runs it on both, in-process) and tests/test_plan.py
# already holds both models' plans to a real step of DRY_CONFIGS' configuration.
DRY_CASES = SMALL_CASES[:1]
# (optimizer, precision, checkpointing)
CONFIGS = (("adamw", "fp32", False), ("adamw8bit", "bf16-mixed", False), ("adafactor", "fp32", False), ("adamw", "fp32", True))
# The dry run measures one of them per model (AdamW8bit and Adafactor compile their CPU updates, a minute
# more on 2 cores); it still plans every configuration for CUDA, so that code runs.
DRY_CONFIGS = (CONFIGS[0],)
MiB = 2**20


def benchmark() -> Any:
    """benchmarks/plan_vs_measured.py, imported (its models, step and CPU measurement)."""
    if not BENCHMARK.exists():
        raise RuntimeError(f"{BENCHMARK} not found: plan_check runs from a leanopt checkout")
    spec = importlib.util.spec_from_file_location("plan_vs_measured", BENCHMARK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def predict_process(bench: Any, case: str, optimizer: str, precision: str, checkpointing: bool) -> int | None:
    """The CUDA row's ``process_bytes``."""
    from leanopt.memory.plan import plan

    _, _, _, batch, seq = bench.model_spec(case)
    (row,) = plan(bench.build_meta(case), batch=batch, seq=seq, optimizers=[optimizer], precisions=[precision],
                  checkpointing=[checkpointing], grad_release=[False], device="cuda")  # fmt: skip
    return row.process_bytes


def process_worker(case: str, optimizer: str, precision: str, checkpointing: bool) -> dict[str, int]:
    """In a fresh process: the model on the GPU, three steps, no warm-up; the allocator's reserved
    peak and the context (cached for the plan)."""
    import torch

    from leanopt.memory.process import measure_cuda_context

    bench = benchmark()
    torch.manual_seed(0)
    _, _, _, batch, seq = bench.model_spec(case)
    with torch.device("cuda"):
        model = bench.build(case)
    opt = bench.prepare(model, optimizer, precision, checkpointing)
    step = bench.step_fn(model, opt, precision, batch, seq, device="cuda")
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    reserved = torch.cuda.max_memory_reserved()
    return {"reserved_peak": reserved, "context": measure_cuda_context(), "allocated_peak": torch.cuda.max_memory_allocated()}


def measure_process(case: str, config: tuple[str, str, bool], timeout: float = 300) -> dict[str, int]:
    import subprocess

    optimizer, precision, ckpt = config
    out = subprocess.run([sys.executable, "-m", "leanopt.memory.plan_check", "--process-worker", case, optimizer, precision,
                          "1" if ckpt else "0"], capture_output=True, text=True, timeout=timeout, check=False)  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def doctor_check(bench: Any, case: str, config: tuple[str, str, bool], device: str) -> dict[str, Any]:
    """``leanopt.doctor`` on ``case`` at ``device``: its categories against its measured peak."""
    import torch

    from leanopt.memory.doctor import doctor

    optimizer, precision, ckpt = config
    _, _, _, batch, seq = bench.model_spec(case)
    torch.manual_seed(0)
    with torch.device(device):
        model = bench.build(case)
    opt = bench.prepare(model, optimizer, precision, ckpt)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)
    labels = torch.randint(0, 2, (batch,), device=device) if type(model).__name__.endswith("ForSequenceClassification") else ids
    d = doctor(model, opt, {"input_ids": ids, "labels": labels}, autocast=torch.bfloat16 if precision == "bf16-mixed" else None)
    total = sum(d.measured.values())
    peak = d.process_peak_bytes or d.tensor_peak_bytes
    err = 100.0 * (total - peak) / peak
    return {"case": case, "device": device, "measured": d.measured, "process_peak_bytes": d.process_peak_bytes,
            "tensor_peak_bytes": d.tensor_peak_bytes, "sum_error_pct": round(err, 3), "ok": abs(err) <= 1.0,
            "explanations": d.explanations}  # fmt: skip


def predict(bench: Any, case: str, optimizer: str, precision: str, checkpointing: bool, device: str) -> int:
    from leanopt.memory.plan import plan

    _, _, _, batch, seq = bench.model_spec(case)
    (row,) = plan(bench.build_meta(case), batch=batch, seq=seq, optimizers=[optimizer], precisions=[precision],
                  checkpointing=[checkpointing], grad_release=[False], device=device, process=False)  # fmt: skip
    return row.peak_bytes


# ---- the GPU step --------------------------------------------------------------------------------
def measure_cuda(bench: Any, case: str, optimizer: str, precision: str, checkpointing: bool) -> int:
    """The peak of the third step over the memory allocated before the model was built (bytes)."""
    import torch

    torch.manual_seed(0)
    _, _, _, batch, seq = bench.model_spec(case)
    with torch.device("cuda"):
        tiny = bench.build(case, tiny=True)
    opt = bench.prepare(tiny, optimizer, precision, checkpointing)
    warm = bench.step_fn(tiny, opt, precision, batch, seq, device="cuda")
    warm()
    warm()
    del tiny, opt, warm
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with torch.device("cuda"):
        model = bench.build(case)
    opt = bench.prepare(model, optimizer, precision, checkpointing)
    step = bench.step_fn(model, opt, precision, batch, seq, device="cuda")
    step()
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del model, opt, step
    gc.collect()
    torch.cuda.empty_cache()
    return peak


# ---- the rows --------------------------------------------------------------------------------------
def _row(case: str, config: tuple[str, str, bool], predicted: int | None, measured: int | None, error: str | None,
         tolerance: float, cuda_plan: int | None = None) -> dict[str, Any]:  # fmt: skip
    optimizer, precision, ckpt = config
    err_pct = None
    if predicted is not None and measured:
        err_pct = 100.0 * (predicted - measured) / measured
    ok = error is None and err_pct is not None and math.isfinite(err_pct) and abs(err_pct) <= tolerance
    row = {"case": case, "optimizer": optimizer, "precision": precision, "checkpointing": ckpt,
           "predicted_bytes": predicted, "measured_bytes": measured,
           "error_pct": None if err_pct is None else round(err_pct, 2), "ok": ok, "error": error}  # fmt: skip
    if cuda_plan is not None:
        row["cuda_plan_bytes"] = cuda_plan
    return row


def run_gpu(bench: Any, tolerance: float) -> list[dict[str, Any]]:
    rows = []
    for case in GPU_CASES:
        for config in CONFIGS:
            predicted = measured = None
            error = None
            try:
                what = "plan(device='cuda')"
                predicted = predict(bench, case, *config, device="cuda")
                what = "the measured GPU step"
                measured = measure_cuda(bench, case, *config)
            except Exception as err:  # noqa: BLE001 - recorded on the row, the next row still runs
                error = f"{what}: {one_line(err)}"
            row = _row(case, config, predicted, measured, error, tolerance)
            if config == CONFIGS[0]:  # the process: reserved + context against process_bytes
                try:
                    got = measure_process(case, config)
                    real = got["reserved_peak"] + got["context"]
                    want = predict_process(bench, case, *config)
                    pct = None if want is None else 100.0 * (want - real) / real
                    row.update(process_predicted_bytes=want, process_measured_bytes=real, context_bytes=got["context"],
                               process_error_pct=None if pct is None else round(pct, 2))  # fmt: skip
                    row["ok"] = row["ok"] and pct is not None and abs(pct) <= tolerance
                except Exception as err:  # noqa: BLE001 - on the row
                    row.update(ok=False, error=f"the process measurement: {one_line(err)}")
            rows.append(row)
            _progress(rows[-1])
    return rows


def run_dry(bench: Any, tolerance: float) -> list[dict[str, Any]]:
    """CPU plan vs CPU measurement on the small models (:data:`DRY_CASES`); each model measured in its
    own fresh process (all at once, while the plans are traced here)."""
    measured: dict[str, list[int] | str] = {}

    def measure(case: str) -> None:
        try:
            measured[case] = bench.measure(case, list(DRY_CONFIGS))
        except Exception as err:  # noqa: BLE001 - reported on the rows
            measured[case] = f"the CPU measurement: {one_line(err)}"

    threads = [threading.Thread(target=measure, args=(case,), daemon=True) for case in DRY_CASES]
    for t in threads:
        t.start()
    plans: dict[tuple[str, tuple[str, str, bool]], tuple[int | None, int | None, str | None]] = {}
    for case in DRY_CASES:
        for config in CONFIGS:
            try:
                cuda = predict(bench, case, *config, device="cuda")
                cpu = predict(bench, case, *config, device="cpu") if config in DRY_CONFIGS else None
                plans[case, config] = (cpu, cuda, None)
            except Exception as err:  # noqa: BLE001
                plans[case, config] = (None, None, f"plan: {one_line(err)}")
    for t in threads:
        t.join()
    rows = []
    for case in DRY_CASES:
        got = measured.get(case, "the CPU measurement: no result")
        for k, config in enumerate(DRY_CONFIGS):
            planned_cpu, planned_cuda, error = plans[case, config]
            real = got[k] if isinstance(got, list) else None
            if error is None and isinstance(got, str):
                error = got
            rows.append(_row(case, config, planned_cpu, real, error, tolerance, cuda_plan=planned_cuda))
            _progress(rows[-1])
        for config in CONFIGS:  # planned for CUDA only: a row only if that failed
            if config not in DRY_CONFIGS and plans[case, config][2] is not None:
                rows.append(_row(case, config, None, None, plans[case, config][2], tolerance))
                _progress(rows[-1])
    return rows


def _progress(row: dict[str, Any]) -> None:
    state = "ok" if row["ok"] else f"FAILED ({row['error']})" if row["error"] else "OUTSIDE TOLERANCE"
    print(f"plan_check: {row['case']} {row['optimizer']} {row['precision']} ckpt={'on' if row['checkpointing'] else 'off'}: "
          f"{state}", file=sys.stderr, flush=True)  # fmt: skip


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MiB:,.1f}"


def markdown(rows: list[dict[str, Any]], dry: bool, tolerance: float) -> str:
    if dry:
        head = ("DRY RUN (no GPU): CPU plan vs CPU measurement (resident high-water mark) on two-layer models; "
                "no figure here is a GPU figure. The CUDA plan column is computed, not measured.")  # fmt: skip
        cols = "| model | optimizer | precision | ckpt | predicted MiB (CPU plan) | measured MiB (CPU) | error | CUDA plan MiB |"
        sep = "|---|---|---|---|---:|---:|---:|---:|"
    else:
        head = "GPU: plan(device='cuda') vs torch.cuda.max_memory_allocated() over the memory allocated before the model."
        cols = "| model | optimizer | precision | ckpt | predicted MiB | measured MiB | error |"
        sep = "|---|---|---|---|---:|---:|---:|"
    lines = [head, "", cols, sep]
    for r in rows:
        err = f"{r['error_pct']:+.2f} %" if r["error_pct"] is not None else "-"
        if r["error"]:
            err = f"failed: {r['error']}"
        elif not r["ok"]:
            err += " ✘"
        cells = [r["case"], r["optimizer"], r["precision"], "on" if r["checkpointing"] else "off",
                 _mib(r["predicted_bytes"]), _mib(r["measured_bytes"]), err]  # fmt: skip
        if dry:
            cells.append(_mib(r.get("cuda_plan_bytes")))
        lines.append("| " + " | ".join(cells) + " |")
    for r in rows:
        if "process_measured_bytes" in r:
            pct = r["process_error_pct"]
            lines.append(f"process ({r['case']} {r['optimizer']} {r['precision']}): process_bytes {_mib(r['process_predicted_bytes'])} MiB "
                         f"vs max_memory_reserved + context {_mib(r['process_measured_bytes'])} MiB (context "
                         f"{_mib(r['context_bytes'])}): {'-' if pct is None else f'{pct:+.2f} %'}")  # fmt: skip
    bad = [r for r in rows if not r["ok"]]
    lines += ["", f"{len(rows) - len(bad)} of {len(rows)} rows within ±{tolerance:g} %" + ("" if not bad else " -- FAILED")]
    return "\n".join(lines)


def gpu() -> str | None:
    """The GPU's name, None without one."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m leanopt.memory.plan_check", description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="no GPU: the same pipeline at tiny sizes on the CPU")
    ap.add_argument("--out", help="folder for plan_check.json (default $GPU_CHECK_OUT, $OUT, else .)")
    ap.add_argument("--tolerance", type=float, default=TOLERANCE_PCT, help="allowed |error| in percent (default 5)")
    ap.add_argument("--process-worker", nargs=4, metavar=("CASE", "OPTIMIZER", "PRECISION", "CKPT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.process_worker:
        case, optimizer, precision, ckpt = args.process_worker
        print(json.dumps(process_worker(case, optimizer, precision, ckpt == "1")), flush=True)
        return 0
    dry = args.dry_run or os.environ.get("GPU_CHECK_DRY_RUN") == "1"
    out = Path(args.out or os.environ.get("GPU_CHECK_OUT") or os.environ.get("OUT") or ".")
    t0 = time.time()
    try:
        bench = benchmark()
        device = "cpu (dry run)" if dry else gpu()
        if device is None:
            raise RuntimeError("no CUDA device visible to torch (use --dry-run on a machine without a GPU)")
        rows = run_dry(bench, args.tolerance) if dry else run_gpu(bench, args.tolerance)
        try:
            doc = doctor_check(bench, DRY_CASES[0] if dry else GPU_CASES[0], CONFIGS[0], "cpu" if dry else "cuda")
        except Exception as err:  # noqa: BLE001 - reported, fails the check
            doc = {"ok": False, "error": one_line(err)}
        print(f"plan_check: doctor on {'the CPU (dry run)' if dry else 'the GPU'}: "
              f"{'ok' if doc.get('ok') else 'FAILED'} {doc.get('sum_error_pct', doc.get('error'))}", file=sys.stderr, flush=True)
    except Exception as err:  # noqa: BLE001 - one line naming what failed
        print(f"plan_check failed: {one_line(err)}", file=sys.stderr)
        print(json.dumps({"ok": False, "dry_run": dry, "error": one_line(err)}))
        return 1
    ok = all(r["ok"] for r in rows) and bool(doc.get("ok"))
    result = {"ok": ok, "dry_run": dry, "device": device, "tolerance_pct": args.tolerance,
              "seconds": round(time.time() - t0, 1), "rows": rows, "doctor": doc}  # fmt: skip
    print(markdown(rows, dry, args.tolerance), flush=True)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan_check.json").write_text(json.dumps(result, indent=2) + "\n")
    except OSError as err:
        print(f"plan_check: could not write {out / 'plan_check.json'}: {one_line(err)}", file=sys.stderr)
        ok = False
    summary = {k: v for k, v in result.items() if k not in ("rows", "doctor")}
    summary["doctor_ok"] = bool(doc.get("ok"))
    summary["process_rows"] = [[r["case"], r.get("process_error_pct")] for r in rows if "process_measured_bytes" in r]
    summary["rows"] = [[r["case"], r["optimizer"], r["precision"], r["checkpointing"], r["error_pct"]] for r in rows]
    print(json.dumps(summary), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
