"""One-shot GPU check of leanopt: run by ``bash scripts/gpu_check.sh``.

    bash scripts/gpu_check.sh [--wheels DIR] [--dry-run] [--out DIR] [--only STAGE,...]

Stages, each in its own process with its own time budget (a failing or overrunning stage is
recorded and the next one still runs; the exit status is 1 if any stage failed):

``env``             installs the missing peers from wheels in DIR (pip --no-index), prints versions
                    and the GPU;
``tests``           the suite's CUDA cases, ``pytest tests -m cuda`` (tests/test_cuda.py);
``timing_float32``  ``optimizer.step()`` of every leanopt optimizer beside torch fused/foreach
``timing_bfloat16`` AdamW, optimi, transformers/torch Adafactor, bitsandbytes and torchao on
                    TinyLlama-1.1B shapes: ms/step (median of interleaved rounds), first step,
                    B/param (leanopt.measure), GB/s against the measured device copy bandwidth;
``accuracy``        distance from fp32 torch AdamW, one 1024x1024 tensor, 20 steps, lr 1e-3, on
                    the scenarios of benchmarks/accuracy_vs_peers.py (the sparse-gradient hazard
                    included) and a NaN-isolation case, leanopt beside the peers;
``plan_check``      ``python3 -m leanopt.memory.plan_check``, only if that module exists;
``host_step``       the CPU step at 1 and N threads (what an offloaded step stands on);
``offload``         ``offload="cpu"`` on the GPU: bit identity against the CPU
                    reference, step time with and without offload, host bytes;
``twins``           every registered rule's Triton twin, its Inductor-compiled graphs and the
                    reference against each other (benchmarks/backend_parity.py).
``muon``            leanopt.Muon/Muon8bit beside torch.optim.Muon on TinyLlama-1.1B's matrices,
                    the Newton-Schulz share, offload (momentum on the host, NS on the GPU).

Results go to ``$OUT`` (default ``./gpu_check_out``): results.json, results.md (with the GPU
targets, pass/fail), gpu_check.log (everything printed) and cuda_tests.xml (the
tests' JUnit report), rewritten after every stage. ``--dry-run`` runs the same stages on the
CPU at toy sizes, Triton under its interpreter. docs/gpu_check.md has the details.

This script is the driver: stages, budgets, the targets and the report. What a stage measures is
the code of benchmarks/ (step_time.py's shapes, candidates and timed rounds; accuracy_vs_peers.py's
scenarios, contenders and distances; offload_step.py, first_step.py) and of tests/ (``-m cuda``),
imported or run as they are, so a figure here is the figure the benchmark gives.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = 1

# ---- configuration ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    name: str
    budget_s: float  # on the GPU
    dry_budget_s: float  # with --dry-run, on the CPU
    what: str


STAGES = [
    Stage("env", 35, 20, "install missing peers from wheels, versions, GPU"),
    Stage("tests", 95, 50, "pytest tests -m cuda"),
    Stage("timing_float32", 85, 30, "optimizer.step, TinyLlama-1.1B shapes, fp32 params"),
    Stage("timing_bfloat16", 80, 30, "optimizer.step, TinyLlama-1.1B shapes, bf16 params"),
    Stage("accuracy", 40, 30, "distance from fp32 AdamW, sparse-gradient hazard, NaN isolation"),
    # The planner's check: 8 rows (two models x four configurations), each a plan and a
    # measured step; dry, 1 row (the small DistilBERT) measured in a CPU process. On top, two fresh GPU processes
    # (process_bytes against max_memory_reserved + the context) and leanopt.doctor (+30 s).
    Stage("plan_check", 90, 150, "python3 -m leanopt.memory.plan_check, if present"),
    # The host (CPU) step at one thread and at every core, the first step with a fresh
    # kernel cache, and the path without a compiler -- what an offloaded optimizer's step stands on.
    Stage("host_step", 90, 30, "benchmarks/step_time.py on the CPU at 1 and N threads; benchmarks/first_step.py"),
    # offload="cpu" on the GPU -- pinned buffers, side streams, events -- bit for bit
    # against the CPU reference, and the training step with and without offload.
    Stage("offload", 60, 30, "benchmarks/offload_step.py: offload='cpu' vs on-device, TinyLlama-1.1B shapes, bf16"),
    # Every registered rule's Triton twin, its graphs compiled by Inductor for the GPU (what a rule
    # without a twin runs there) and the reference, held against each other; dry: fp32 params,
    # the graphs traced by dynamo and run eagerly (an Inductor compile per rule is 20-60 s on 2 cores).
    Stage("twins", 150, 60, "benchmarks/backend_parity.py: Triton twins, compiled graphs and the reference"),
    # Muon: leanopt.Muon/Muon8bit beside torch.optim.Muon on TinyLlama-1.1B's matrices, the
    # Newton-Schulz share of the step, and offload="cpu" (momentum on the host, NS on the GPU).
    Stage("muon", 25, 30, "benchmarks/muon_step.py: Muon vs torch.optim.Muon, TinyLlama-1.1B shapes, NS share, offload"),
]
# Whole run: the first five stages (env to accuracy) are held to <= 6 minutes on the GPU (<= 3 minutes
# dry), start to finish (335 s, 160 s dry); plan_check comes on top.
PLAN_CHECK_EXTRA_S = 90.0 - 10.0  # plan_check's budget over the 10 s (10 s dry) it had in those totals
DRY_PLAN_CHECK_EXTRA_S = 150.0 - 10.0
# + host_step + offload (575 s: one 600 s device call) + twins (150 s) + muon (25 s): `--only twins,muon` as a second call
TOTAL_BUDGET_S = 345.0 + PLAN_CHECK_EXTRA_S + 90.0 + 60.0 + 150.0 + 25.0
DRY_TOTAL_BUDGET_S = 170.0 + DRY_PLAN_CHECK_EXTRA_S + 30.0 + 30.0 + 60.0 + 30.0
GRACE_S = 5.0  # after a stage's budget, before it is killed (it stops itself at the budget)
# Multiplies every budget (a loaded CI machine running the dry run); 1 on the GPU.
BUDGET_SCALE = float(os.environ.get("GPU_CHECK_BUDGET_SCALE") or 1.0)

# Wheels: distribution name (as in the wheel's file name) -> module it provides.
PEER_WHEELS = {"bitsandbytes": "bitsandbytes", "torchao": "torchao", "torch_optimi": "optimi", "triton": "triton"}
VERSIONS = ["torch", "triton", "bitsandbytes", "torchao", "torch-optimi", "transformers", "accelerate", "numpy", "pytest"]

# The GPU targets: step-time ratios to the peers, measured in the same run, and the first step.
TARGETS = [
    ("adamw_vs_fused", "leanopt AdamW <= 1.0x torch fused AdamW", 1.0, "<="),
    ("adamw8bit_vs_fused", "leanopt AdamW8bit <= 0.6x torch fused AdamW (fp32 params)", 0.6, "<="),
    ("adamw8bit_vs_bnb", "leanopt AdamW8bit >= 7x faster than bitsandbytes AdamW8bit", 7.0, ">="),
    ("adamw4bit_vs_fused", "leanopt AdamW4bit <= 0.55x torch fused AdamW", 0.55, "<="),
    ("adafactor_vs_hf", "leanopt Adafactor <= 0.25x transformers Adafactor", 0.25, "<="),
    ("first_step", "first step (compile included) <= 2 s, every leanopt optimizer", 2.0, "<="),
]

# In a dry run, one case of each test function of tests/test_cuda.py runs on the CPU
# (LEANOPT_CUDA_TESTS_ON_CPU=1) after the real `pytest -m cuda` (all skipped there), so that the
# CUDA tests' own code is run: the first case of each function in the order that run collected
# them. With GPU_CHECK_CPU_CASES=all, every case (~45 s on 2 cores).
CPU_CASES_MODULE = "tests/test_cuda.py"


T0 = float(os.environ.get("GPU_CHECK_T0") or time.time())


def elapsed() -> float:
    return time.time() - T0


def log(msg: str) -> None:
    print(msg, flush=True)


def first_line(err: BaseException) -> str:
    """An error in one line; a Triton compile error by its cause and the source line."""
    if type(err).__name__ == "CompilationError":
        return "Triton CompilationError: " + _root_cause(err)
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def clean(value: Any) -> Any:
    """JSON-safe: NaN/inf -> None, tuples -> lists, numbers rounded sensibly."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(clean(data), indent=2, sort_keys=False))
    os.replace(tmp, path)


# ---- driver -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "stage":
        return stage_main(argv[1:])
    if argv and argv[0] == "compile-sm90":
        print(json.dumps(compile_for_hopper()))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheels", metavar="DIR", help="folder of .whl files to install what is missing from (pip --no-index)")
    ap.add_argument("--dry-run", action="store_true", help="same stages on the CPU at toy sizes (Triton interpreted)")
    ap.add_argument("--out", metavar="DIR", help="results folder (default: $OUT, else ./gpu_check_out)")
    ap.add_argument("--only", metavar="STAGES", help="comma-separated stages to run (default: all)")
    args = ap.parse_args(argv)
    out = Path(args.out or os.environ.get("OUT") or "gpu_check_out").resolve()
    out.mkdir(parents=True, exist_ok=True)
    wanted = [s.name for s in STAGES]
    if args.only:
        asked = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = [s for s in asked if s not in wanted]
        if unknown:
            ap.error(f"unknown stage(s) {', '.join(unknown)}; stages: {', '.join(wanted)}")
        wanted = asked
    return Driver(out, dry=args.dry_run, wheels=args.wheels, wanted=wanted).run()


class Driver:
    def __init__(self, out: Path, *, dry: bool, wheels: str | None, wanted: list[str]) -> None:
        self.out, self.dry, self.wanted = out, dry, wanted
        self.wheels = str(Path(wheels).resolve()) if wheels else None
        self.work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
        self.site = self.work / "site"
        self.site.mkdir()
        self.logfile = open(out / "gpu_check.log", "w", buffering=1)
        self.results: dict[str, Any] = {
            "schema": SCHEMA,
            "dry_run": dry,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "command": "bash scripts/gpu_check.sh " + " ".join(sys.argv[1:]),
            "total_budget_s": (DRY_TOTAL_BUDGET_S if dry else TOTAL_BUDGET_S) * BUDGET_SCALE,
            "wall_s": None,
            "ok": None,
            "failed_stages": [],
            "stages": {},
            "targets": [],
        }

    def say(self, msg: str) -> None:
        line = f"[{elapsed():6.1f}s] {msg}"
        print(line, flush=True)
        self.logfile.write(line + "\n")

    def env(self, stage: Stage) -> dict[str, str]:
        env = dict(os.environ)
        paths = [str(ROOT / "src"), str(self.site)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        env.update(
            PYTHONPATH=os.pathsep.join(paths),
            PYTHONUNBUFFERED="1",
            GPU_CHECK_T0=str(T0),
            GPU_CHECK_SITE=str(self.site),
            GPU_CHECK_WORK=str(self.work),
            GPU_CHECK_OUT=str(self.out),
            TOKENIZERS_PARALLELISM="false",
            MPLBACKEND="Agg",
        )
        # The kernels: compiled for the GPU, interpreted on the CPU (dry run).
        env["TRITON_INTERPRET"] = "1" if self.dry else "0"
        if self.dry:
            env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run is the CPU run, on a GPU machine too
        if stage.name.startswith("timing"):
            # A cold compile cache, so "first step" includes compilation (Triton and Inductor).
            env["TRITON_CACHE_DIR"] = str(self.work / f"triton_{stage.name}")
            env["TORCHINDUCTOR_CACHE_DIR"] = str(self.work / f"inductor_{stage.name}")
        elif not self.dry:
            env["TRITON_CACHE_DIR"] = str(self.work / "triton")
            env["TORCHINDUCTOR_CACHE_DIR"] = str(self.work / "inductor")
        # Dry, the other stages compile into the caller's caches (Inductor's and Triton's own
        # defaults, or what TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR name), as any leanopt
        # program there does: the CPU graphs the suite compiled are not compiled again.
        return env

    def run(self) -> int:
        self.say(f"gpu_check: {'DRY RUN (CPU, toy sizes)' if self.dry else 'GPU'}; out {self.out}; work {self.work}")
        total = self.results["total_budget_s"]
        stages = [s for s in STAGES if s.name in self.wanted]
        nominal = {s.name: (s.dry_budget_s if self.dry else s.budget_s) * BUDGET_SCALE for s in stages}
        start = elapsed()
        cuda_missing = False
        for k, stage in enumerate(stages):
            later = sum(nominal[s.name] for s in stages[k + 1 :])
            # Time a stage leaves unused flows to the next ones; later stages keep their own.
            budget = max(0.5 * nominal[stage.name], total - (elapsed() - start) - later)
            if cuda_missing and stage.name != "plan_check":
                self.record(stage, {"status": "skipped", "reason": "no CUDA device (use --dry-run on a CPU machine)"}, 0.0, 0.0)
                continue
            record = self.run_stage(stage, budget)
            if stage.name == "env" and not self.dry and not record.get("cuda_available"):
                cuda_missing = True
        self.results["wall_s"] = round(elapsed(), 1)
        failed = [n for n, r in self.results["stages"].items() if r["status"] not in ("ok", "skipped")]
        self.results["failed_stages"] = failed
        self.results["ok"] = not failed
        self.finish()
        print()
        print((self.out / "results.md").read_text(), flush=True)
        self.say(f"done in {elapsed():.1f} s: {'all stages ok' if not failed else 'FAILED: ' + ', '.join(failed)}")
        self.logfile.close()
        shutil.rmtree(self.work, ignore_errors=True)
        return 0 if not failed else 1

    def run_stage(self, stage: Stage, budget: float) -> dict[str, Any]:
        part = self.work / f"{stage.name}.json"
        deadline = time.time() + budget
        cmd = [sys.executable, str(Path(__file__).resolve()), "stage", stage.name, "--part", str(part), "--deadline", f"{deadline:.3f}"]
        if self.dry:
            cmd.append("--dry-run")
        if stage.name == "env" and self.wheels:
            cmd += ["--wheels", self.wheels]
        self.say(f"== {stage.name}: {stage.what} (budget {budget:.0f} s)")
        t = time.time()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env(stage), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", start_new_session=True)  # fmt: skip
        tail: list[str] = []

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.rstrip("\n")
                tail.append(line)
                del tail[:-60]
                self.say(f"{stage.name} | {line}")

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=budget + GRACE_S)
        except subprocess.TimeoutExpired:
            timed_out = True
            self.say(f"{stage.name}: over its budget of {budget:.0f} s, stopping it")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        reader.join(timeout=5)
        seconds = time.time() - t
        data: dict[str, Any] = {}
        if part.exists():
            try:
                data = json.loads(part.read_text())
            except json.JSONDecodeError as err:
                data = {"error": f"unreadable stage output: {err}"}
        if timed_out:
            data["status"] = "timeout"
        elif proc.returncode != 0:
            data["status"] = "failed"
            data.setdefault("error", f"exit status {proc.returncode}")
        else:
            data.setdefault("status", "ok")
        data["rc"] = proc.returncode
        if data["status"] not in ("ok", "skipped"):
            data["log_tail"] = tail[-25:]
        return self.record(stage, data, seconds, budget)

    def record(self, stage: Stage, data: dict[str, Any], seconds: float, budget: float) -> dict[str, Any]:
        data["seconds"] = round(seconds, 1)
        data["budget_s"] = round(budget, 1)
        self.results["stages"][stage.name] = data
        self.say(f"== {stage.name}: {data['status']} in {seconds:.1f} s" + (f" ({data.get('error') or data.get('reason')})" if data["status"] != "ok" else ""))
        self.finish()
        return data

    def finish(self) -> None:
        self.results["targets"] = evaluate_targets(self.results["stages"])
        if self.results["wall_s"] is None:
            self.results["wall_s_so_far"] = round(elapsed(), 1)
        else:
            self.results.pop("wall_s_so_far", None)
        write_json(self.out / "results.json", self.results)
        (self.out / "results.md").write_text(markdown(self.results))


# ---- targets and markdown -----------------------------------------------------------------------


def _rows(stages: dict[str, Any], name: str) -> dict[str, dict[str, Any]]:
    return {r["optimizer"]: r for r in stages.get(name, {}).get("results", [])}


# target -> (numerator, denominator) of its ratio of medians
_RATIOS = {
    "adamw_vs_fused": ("leanopt-adamw", "torch-adamw-fused"),
    "adamw8bit_vs_fused": ("leanopt-adamw8bit", "torch-adamw-fused"),
    "adamw8bit_vs_bnb": ("bnb-adamw8bit", "leanopt-adamw8bit"),  # "x times faster"
    "adamw4bit_vs_fused": ("leanopt-adamw4bit", "torch-adamw-fused"),
    "adafactor_vs_hf": ("leanopt-adafactor", "hf-adafactor"),
}


def evaluate_targets(stages: dict[str, Any]) -> list[dict[str, Any]]:
    """Each GPU target for the fp32 and the bf16 run: measured, pass/fail (None: not measured)."""
    out = []
    for key, text, limit, op in TARGETS:
        for dtype in ("float32", "bfloat16"):
            rows = _rows(stages, f"timing_{dtype}")
            measured, detail = None, ""
            if key in _RATIOS:
                num, den = (rows.get(n, {}).get("ms_per_step") for n in _RATIOS[key])
                if num and den:
                    measured, detail = num / den, f"{num:.2f} / {den:.2f} ms"
            else:  # first step, cold, of the slowest leanopt optimizer
                lean = {n: r for n, r in rows.items() if n.startswith("leanopt-") and r.get("first_step_s") is not None}
                if lean:
                    worst = max(lean, key=lambda n: lean[n]["first_step_s"])
                    warm = [r["first_step_warm_s"] for r in lean.values() if "first_step_warm_s" in r]
                    measured = lean[worst]["first_step_s"]
                    detail = f"cold, slowest: {worst}" + (f"; warm at most {max(warm):.2f} s" if warm else "")
            passed = None if measured is None else (measured <= limit if op == "<=" else measured >= limit)
            out.append({"target": key, "text": text, "param_dtype": dtype, "limit": limit, "op": op,
                        "measured": None if measured is None else round(measured, 3), "detail": detail, "pass": passed})  # fmt: skip
    return out


def _fmt(value: Any, spec: str = ".3g") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def _num(value: Any) -> str:
    """A rate or share: whole numbers from 100 up, three significant digits below."""
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def markdown(res: dict[str, Any]) -> str:
    st = res["stages"]
    env = st.get("env", {})
    lines = []
    where = env.get("gpu", {}).get("name") or env.get("cpu") or "?"
    title = "DRY RUN (CPU, toy sizes, Triton interpreted: no figure here is a GPU figure)" if res["dry_run"] else where
    lines.append(f"# leanopt GPU check: {title}")
    lines.append("")
    wall = res.get("wall_s") or res.get("wall_s_so_far")
    status = "running" if res["ok"] is None else ("all stages ok" if res["ok"] else "FAILED: " + ", ".join(res["failed_stages"]))
    lines.append(f"{res['started']} · {status} · wall {_fmt(wall, '.0f')} s of {res['total_budget_s']:.0f} s budget · `{res['command']}`")
    lines.append("")
    lines.append("| stage | status | seconds | budget s | note |")
    lines.append("| --- | --- | ---: | ---: | --- |")
    for s in STAGES:
        r = st.get(s.name)
        if r is None:
            continue
        note = r.get("error") or r.get("reason") or r.get("summary") or ""
        lines.append(f"| {s.name} | {r.get('status', '?')} | {_fmt(r.get('seconds'), '.1f')} | {_fmt(r.get('budget_s'), '.0f')} | {str(note)[:160]} |")
    if env:
        lines.append("")
        gpu = env.get("gpu") or {}
        if gpu:
            lines.append(f"GPU: {gpu.get('name')} · {gpu.get('memory_gib')} GiB · {gpu.get('sm_count')} SMs · capability {gpu.get('capability')} · nvidia-smi: {gpu.get('nvidia_smi') or '-'}")
        vers = env.get("versions", {})
        lines.append("Versions: " + ", ".join(f"{k} {v}" for k, v in vers.items()))
        if env.get("installed"):
            lines.append("Installed from wheels: " + ", ".join(env["installed"]))
    tests = st.get("tests", {})
    if tests.get("junit") or tests.get("compile_sm90"):
        lines.append("")
        lines.append("## CUDA tests (`pytest tests -m cuda`)")
        lines.append("")
        for label, j in tests.get("junit", {}).items():
            if "error" in j:
                lines.append(f"- {label}: {j['error']} (exit status {j.get('rc')})")
                continue
            lines.append(f"- {label}: {j.get('passed')} passed, {j.get('failed')} failed, {j.get('errors')} errors, {j.get('skipped')} skipped in {_fmt(j.get('seconds'), '.1f')} s")
            if j.get("collection_errors"):
                lines.append(f"  - test modules that do not import here: {', '.join(j['collection_errors'])}")
            for f in j.get("failures", [])[:15]:
                lines.append(f"  - FAILED `{f['test']}`: {f['message'][:300]}")
            for why, count in list(j.get("skip_reasons", {}).items())[:5]:
                lines.append(f"  - skipped {count}: {why[:160]}")
    if tests.get("compile_sm90"):
        comp = tests["compile_sm90"]
        bad = {k: v for k, v in comp.items() if v != "ok"}
        lines.append(f"- Triton kernels compiled for sm_90 without a GPU (dry run only): {len(comp) - len(bad)} of {len(comp)} ok")
        for k, v in bad.items():
            lines.append(f"  - `{k}`: {v[:300]}")
    for dtype in ("float32", "bfloat16"):
        t = st.get(f"timing_{dtype}", {})
        if not t.get("results") and not t.get("skipped"):
            continue
        lines.append("")
        lines.append(f"## optimizer.step, {t.get('params', 0):,} {dtype} params in {t.get('tensors')} tensors ({t.get('shapes_from')})")
        lines.append("")
        lines.append(f"Device copy bandwidth {_num(t.get('copy_bandwidth_GBps'))} GB/s (read + write). Median of {t.get('rounds')} interleaved rounds after {t.get('warmup')} warm-up. First step: cold compile caches; warm: a second instance in the same process. Params and gradients shared by all optimizers.")
        lines.append("")
        lines.append("| optimizer | backend | ms/step | x torch fused | first step s (cold / warm) | state B/param | GB/s | % of copy | floor ms |")
        lines.append("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in t.get("results", []):
            lines.append(
                f"| {r['optimizer']} | {r.get('backend') or ''} | {_fmt(r.get('ms_per_step'), '.2f')} | {_fmt(r.get('ratio_to_torch_fused'), '.2f')} | "
                f"{_fmt(r.get('first_step_s'), '.2f')}{' / ' + _fmt(r['first_step_warm_s'], '.2f') if 'first_step_warm_s' in r else ''} | {_fmt(r.get('state_bytes_per_param'), '.3f')} | {_num(r.get('achieved_GBps'))} | "
                f"{_num(r.get('pct_of_copy_bandwidth'))} | {_num(r.get('floor_ms'))} |"
            )
        for name, why in t.get("skipped", {}).items():
            lines.append(f"| {name} | skipped: {why[:140]} | | | | | | | |")
    targets = res.get("targets", [])
    if targets:
        lines.append("")
        lines.append("## GPU targets (ratios from the same run)" + (" -- dry run: not meaningful" if res["dry_run"] else ""))
        lines.append("")
        lines.append("| target | params | measured | detail | pass |")
        lines.append("| --- | --- | ---: | --- | --- |")
        for tg in targets:
            mark = "-" if tg["pass"] is None else ("PASS" if tg["pass"] else "FAIL")
            lines.append(f"| {tg['text']} | {tg['param_dtype']} | {_fmt(tg['measured'], '.3g')} | {tg['detail']} | {mark} |")
    acc = st.get("accuracy", {})
    if acc.get("rows"):
        scen = acc.get("scenarios", [])
        lines.append("")
        lines.append(f"## Accuracy: max / mean |p - p_fp32| after {acc.get('steps')} steps, one {acc.get('size')}x{acc.get('size')} fp32 tensor, lr {acc.get('lr')}, vs torch AdamW fp32 on {acc.get('device')}")
        lines.append("")
        lines.append("| optimizer | " + " | ".join(scen) + " | far (>0.01) in hazard | NaN spread | B/param |")
        lines.append("| --- | " + " | ".join("---:" for _ in scen) + " | ---: | ---: | ---: |")
        for r in acc["rows"]:
            cells = []
            for s in scen:
                d = r.get("scenarios", {}).get(s)
                cells.append("-" if not d else (d["error"][:40] if "error" in d else f"{_fmt(d['max'], '.2e')} / {_fmt(d['mean'], '.2e')}"))
            far = (r.get("scenarios", {}).get("hazard") or {}).get("far")
            lines.append(f"| {r['name']} | " + " | ".join(cells) + f" | {_fmt(far)} | {_fmt(r.get('nan_spread'))} | {_fmt(r.get('bytes_per_param'), '.3f')} |")
        for name, why in acc.get("absent", {}).items():
            lines.append(f"| {name} | absent: {why[:120]} |" + " |" * (len(scen) + 2))
        lines.append("")
        lines.append(f"Scenarios from {acc.get('scenario_source')}. NaN spread: non-finite params after a step with one NaN gradient element.")
    plan = st.get("plan_check", {})
    if plan:
        lines.append("")
        lines.append(f"## Plan check: {plan.get('status')} {('- ' + plan.get('reason')) if plan.get('reason') else ''}")
        if plan.get("output_tail"):
            lines.append("")
            lines.append("```")
            lines.extend(plan["output_tail"][-15:])
            lines.append("```")
    twins = st.get("twins", {})
    if twins.get("rows"):
        lines.append("")
        lines.append(f"## Twins: max |a - b| / max |reference| after {twins.get('steps')} steps on {twins.get('device')}"
                     + (" (compiled graphs traced by dynamo, run eagerly)" if twins.get("dynamo_only") else ""))  # fmt: skip
        lines.append("")
        pairs = ("compiled~reference", "twin~reference", "twin~compiled")
        lines.append("| case | params | Triton twin | " + " | ".join(pairs) + " | within tolerance |")
        lines.append("| --- | --- | --- | " + " | ".join("---:" for _ in pairs) + " | --- |")
        for r in twins["rows"]:
            cells = [_fmt((r.get("pairs", {}).get(k) or {}).get("max"), ".2e") for k in pairs]
            verdict = "yes" if r.get("ok") else "NO: " + (r.get("error") or "; ".join(p for v in r.get("pairs", {}).values() for p in v.get("problems", []))[:160])
            lines.append(f"| {r['case']} | {r['dtype']} | {'yes' if r.get('twin') else 'none'} | " + " | ".join(cells) + f" | {verdict} |")
        if twins.get("not_run"):
            lines.append("")
            lines.append(f"Not run (stage budget): {', '.join(twins['not_run'])}")
        lines.append("")
        lines.append(f"Cases and tolerances: {twins.get('source')} (tests/test_rules.py's, doubled for twin~compiled).")
    failures = [(n, r) for n, r in st.items() if r.get("status") not in ("ok", "skipped") and r.get("log_tail")]
    for name, r in failures:
        lines.append("")
        lines.append(f"## {name}: {r['status']} -- last lines")
        lines.append("")
        lines.append("```")
        lines.extend(line[:300] for line in r["log_tail"][-20:])
        lines.append("```")
    return "\n".join(lines) + "\n"


# ---- stages -------------------------------------------------------------------------------------


class Part:
    """A stage's output, written after every update so that a killed stage leaves what it had."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {}

    def update(self, **kw: Any) -> None:
        self.data.update(kw)
        write_json(self.path, self.data)


def stage_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check.py stage")
    ap.add_argument("name", choices=[s.name for s in STAGES])
    ap.add_argument("--part", required=True)
    ap.add_argument("--deadline", type=float, default=None)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--wheels")
    args = ap.parse_args(argv)
    part = Part(Path(args.part))
    deadline = args.deadline or time.time() + 600
    fn = {
        "env": stage_env,
        "tests": stage_tests,
        "timing_float32": lambda a, p, d: stage_timing(a, p, d, "float32"),
        "timing_bfloat16": lambda a, p, d: stage_timing(a, p, d, "bfloat16"),
        "accuracy": stage_accuracy,
        "plan_check": stage_plan_check,
        "host_step": stage_host_step,
        "offload": stage_offload,
        "twins": stage_twins,
        "muon": stage_muon,
    }[args.name]
    try:
        return fn(args, part, deadline) or 0
    except Exception as err:  # noqa: BLE001 - recorded for the driver, then a failing exit
        traceback.print_exc()
        part.update(status="failed", error=first_line(err))
        return 1


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def stage_env(args: argparse.Namespace, part: Part, deadline: float) -> int:
    site = os.environ.get("GPU_CHECK_SITE", "")
    installed: list[str] = []
    missing = [dist for dist in PEER_WHEELS if _dist_version(dist) is None]
    part.update(missing_before_install=missing)
    if args.wheels:
        wheel_dir = Path(args.wheels)
        wheels = sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []
        if not wheels:
            log(f"no .whl files in {wheel_dir}")
        take = []
        for w in wheels:
            dist = w.name.split("-")[0]
            if _dist_version(dist) is None:  # only what is missing: two versions stop pip
                take.append(w)
            else:
                log(f"skip {w.name}: {dist} {_dist_version(dist)} is installed")
        if take:
            cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                   "--no-cache-dir", "--upgrade", "--target", site, *map(str, take)]  # fmt: skip
            log("pip install --no-index --target " + site + " " + " ".join(w.name for w in take))
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=max(10.0, deadline - time.time() - 10))
            if r.returncode != 0:
                part.update(pip_error=(r.stdout + r.stderr)[-2000:])
                log((r.stdout + r.stderr)[-2000:])
                raise RuntimeError(f"pip install from {wheel_dir} failed")
            installed = [w.name for w in take]
            importlib.invalidate_caches()
    elif missing:
        log(f"missing (no --wheels given): {', '.join(missing)}")
    part.update(installed=installed)

    versions: dict[str, str] = {"python": platform.python_version()}
    for name in VERSIONS:
        versions[name] = _dist_version(name) or "absent"
    import torch

    versions["torch"] = torch.__version__
    versions["cuda (torch)"] = str(torch.version.cuda)
    import leanopt

    versions["leanopt"] = getattr(leanopt, "__version__", "?")
    with contextlib.suppress(Exception):
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=5)
        if rev.returncode == 0:
            versions["leanopt"] += f" ({rev.stdout.strip()})"
    log("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    cuda = torch.cuda.is_available()
    part.update(versions=versions, cuda_available=cuda, cpu=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    if cuda:
        props = torch.cuda.get_device_properties(0)
        gpu = {
            "name": torch.cuda.get_device_name(0),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
            "sm_count": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "count": torch.cuda.device_count(),
        }
        if shutil.which("nvidia-smi"):
            q = "name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw,utilization.gpu"
            r = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            gpu["nvidia_smi"] = r.stdout.strip() or r.stderr.strip()[:200]
            log("nvidia-smi: " + gpu["nvidia_smi"])
        log(f"GPU: {gpu}")
        part.update(gpu=gpu)
    elif not args.dry_run:
        part.update(status="failed", error="no CUDA device visible to torch (use --dry-run on a CPU machine)")
        log("no CUDA device visible to torch")
        return 1
    # Which peers import here: the timing and accuracy stages report the same reasons.
    peers = {}
    for module in ("bitsandbytes", "torchao.optim", "optimi", "transformers.optimization"):
        try:
            with _quiet():
                importlib.import_module(module)
            peers[module] = "ok"
        except Exception as err:  # noqa: BLE001
            peers[module] = first_line(err)
    log("peers: " + ", ".join(f"{k}: {v}" for k, v in peers.items()))
    part.update(peers=peers, summary=f"{versions['torch']}, " + ("GPU " + part.data['gpu']['name'] if cuda else "CPU only"))
    return 0


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Peers print import-time warnings on stderr; keep the log readable."""
    import io

    buf = io.StringIO()
    with contextlib.redirect_stderr(buf):
        yield


def _junit(path: Path) -> dict[str, Any]:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    out: dict[str, Any] = {"tests": 0, "failed": 0, "errors": 0, "skipped": 0, "seconds": 0.0, "failures": [], "skip_reasons": {},
                           "collection_errors": [], "cases": {}}  # fmt: skip
    for s in suites:
        out["tests"] += int(s.get("tests", 0))
        out["failed"] += int(s.get("failures", 0))
        out["errors"] += int(s.get("errors", 0))
        out["skipped"] += int(s.get("skipped", 0))
        out["seconds"] += float(s.get("time", 0.0))
        for case in s.iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            out["cases"][name] = next((tag for tag in ("failure", "error", "skipped") if case.find(tag) is not None), "passed")
            for tag in ("failure", "error"):
                el = case.find(tag)
                if el is not None:
                    message = (el.get("message") or el.text or "")[:600]
                    if tag == "error" and "collection failure" in message:
                        out["collection_errors"].append(name)  # a module that does not import here
                    else:
                        out["failures"].append({"test": name, "message": message})
            sk = case.find("skipped")
            if sk is not None:
                why = sk.get("message") or ""
                out["skip_reasons"][why] = out["skip_reasons"].get(why, 0) + 1
    out["passed"] = out["tests"] - out["failed"] - out["errors"] - out["skipped"]
    out["errors"] -= len(out["collection_errors"])
    out["passed"] = max(0, out["passed"])
    return out


def _cases_ok(summary: dict[str, Any]) -> bool:
    """The CUDA cases ran to the end and none failed (a test module that does not even import
    on this machine is reported, not counted: it holds no CUDA case)."""
    return "error" not in summary and summary["failed"] == 0 and summary["errors"] == 0 and summary["rc"] in (0, 1) and (
        summary["rc"] == 0 or bool(summary["collection_errors"])
    )


def _pytest(label: str, extra: list[str], env: dict[str, str], xml: Path, timeout: float) -> tuple[int, dict[str, Any]]:
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-p", "no:cacheprovider", "--continue-on-collection-errors",
           "-rfEs", "--tb=short", "-q", f"--junitxml={xml}", *extra]  # fmt: skip
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd.append("--timeout=120")  # one hung case must not take the whole stage
    log(f"{label}: {' '.join(cmd[1:])}")
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout)
        rc = r.returncode
    except subprocess.TimeoutExpired:
        rc = -1
        log(f"{label}: stopped at its time budget")
    summary = _junit(xml) if xml.exists() else {"error": "no JUnit report (pytest did not finish)"}
    summary["rc"] = rc
    return rc, summary


# Variants of leanopt.kernels.triton_elementwise's kernels, every rule (Adafactor's kernels:
# tests/test_backends_adafactor.py::test_triton_kernels_compile_for_cuda).
_DENSE = dict(CHUNK=2048, S_BF16=False)
_Q8 = dict(BITS=8, BS=256, NB=8, LOG2_0=8, ZERO_0=127, LAST_0=254, DECAYS_0=True, LOG2_1=8, ZERO_1=0, LAST_1=255,
           DECAYS_1=False, LOG2_2=8, ZERO_2=0, LAST_2=255, DECAYS_2=False)  # fmt: skip
_Q4 = dict(BITS=4, BS=128, NB=16, LOG2_0=4, ZERO_0=7, LAST_0=14, DECAYS_0=True, LOG2_1=4, ZERO_1=0, LAST_1=15,
           DECAYS_1=False, LOG2_2=4, ZERO_2=0, LAST_2=15, DECAYS_2=False)  # fmt: skip
def _rule(name: str) -> int:
    """A rule's id as the kernels take it (leanopt.kernels.rules.rule_id)."""
    from leanopt.kernels.rules import RULES, rule_id

    return rule_id(RULES[name])


HOPPER_VARIANTS = [
    ("triton_elementwise", "_dense_kernel", dict(K=8, P_DTYPE="float32", RULE=_rule("adamw"), N_STATES=3, FLAGS=1, SAFE=False, MAXIMIZE=True, **_DENSE)),
    ("triton_elementwise", "_dense_kernel", dict(K=8, P_DTYPE="bfloat16", RULE=_rule("adamw"), N_STATES=2, FLAGS=0, SAFE=True, MAXIMIZE=False, **_DENSE)),
    ("triton_elementwise", "_dense_kernel", dict(K=6, P_DTYPE="float16", RULE=_rule("lion"), N_STATES=1, FLAGS=0, SAFE=False, MAXIMIZE=False, **_DENSE)),
    ("triton_elementwise", "_dense_kernel", dict(K=14, P_DTYPE="bfloat16", RULE=_rule("ademamix"), N_STATES=3, FLAGS=0, SAFE=True, MAXIMIZE=False, **_DENSE)),
    ("triton_elementwise", "_dense_kernel", dict(K=5, P_DTYPE="float32", RULE=_rule("sgd"), N_STATES=1, FLAGS=1, SAFE=False, MAXIMIZE=False, **_DENSE)),
    ("triton_elementwise", "_dense_kernel", dict(K=5, P_DTYPE="bfloat16", RULE=_rule("sgd"), N_STATES=0, FLAGS=0, SAFE=True, MAXIMIZE=True, **_DENSE)),
    ("triton_elementwise", "_dense_kernel", dict(K=8, P_DTYPE="float32", RULE=_rule("adamw"), N_STATES=2, FLAGS=0, SAFE=False, MAXIMIZE=False, CHUNK=2048, S_BF16=True)),
    ("triton_elementwise", "_quantized_kernel", dict(K=8, P_DTYPE="bfloat16", RULE=_rule("adamw"), N_STATES=2, FLAGS=0, MAXIMIZE=False, **_Q8)),
    ("triton_elementwise", "_quantized_kernel", dict(K=8, P_DTYPE="float16", RULE=_rule("adamw"), N_STATES=2, FLAGS=0, MAXIMIZE=True, **_Q4)),
    ("triton_elementwise", "_quantized_kernel", dict(K=6, P_DTYPE="float32", RULE=_rule("lion"), N_STATES=1, FLAGS=0, MAXIMIZE=False, **_Q4)),
    ("triton_elementwise", "_quantized_kernel", dict(K=14, P_DTYPE="bfloat16", RULE=_rule("ademamix"), N_STATES=3, FLAGS=0, MAXIMIZE=False, **_Q8)),
    ("triton_elementwise", "_quantized_kernel", dict(K=5, P_DTYPE="float32", RULE=_rule("sgd"), N_STATES=1, FLAGS=1, MAXIMIZE=False, **_Q8)),
]  # fmt: skip


def compile_for_hopper() -> dict[str, str]:
    """Compile kernels for sm_90 (H100/H200) without a GPU: Triton's interpreter accepts code
    that the CUDA compiler refuses. Run in a process without TRITON_INTERPRET. Returns
    {variant: "ok" | error}."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_for_hopper needs a process without TRITON_INTERPRET=1")
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def kind(arg: str) -> str:
        if arg.endswith("_ptrs") or arg in ("chunk_start", "numels", "meta", "part_off", "dither_keys"):
            return "*i64"
        if arg in ("chunk_tensor", "tile_tensor", "fin_tensor"):
            return "*i32"
        if arg.endswith(("_table", "_values", "_thresholds")) or arg.startswith(("values", "thresholds")) or arg == "scalars":
            return "*fp32"
        if arg.endswith("_base"):
            return "i32"
        return "fp32"

    out = {}
    for module, name, consts in HOPPER_VARIANTS:
        fn = getattr(importlib.import_module(f"leanopt.kernels.{module}"), name)
        consts = {k: getattr(tl, v) if isinstance(v, str) else v for k, v in consts.items()}
        label = f"{module}.{name}[" + ",".join(f"{k}={v}" for k, v in consts.items() if k in ("P_DTYPE", "BITS", "SAFE", "RULE", "S_BF16")) + "]"
        names = fn.arg_names
        src = ASTSource(fn, {a: ("constexpr" if a in consts else kind(a)) for a in names},
                        constexprs={(names.index(a),): consts[a] for a in names if a in consts})  # fmt: skip
        try:
            triton.compile(src, target=GPUTarget("cuda", 90, 32))
            out[label] = "ok"
        except Exception as err:  # noqa: BLE001
            out[label] = _root_cause(err)
    return out


def _root_cause(err: BaseException) -> str:
    """The innermost error of a chain; for a Triton CompilationError, its cause, the kernel
    function and the source line it points at."""
    chain = [err]
    while chain[-1].__cause__ is not None and len(chain) < 20:
        chain.append(chain[-1].__cause__)
    root = chain[-1]
    lines = str(root).strip().splitlines()
    caret = next((i for i, line in enumerate(lines) if line.strip() == "^"), None)
    if caret is None or caret == 0:
        return f"{type(root).__name__}: {' '.join(str(root).split())[:400]}"
    cause = " ".join(lines[caret + 1 :]).strip() or type(root).__name__
    func = next((line.strip() for line in lines[1:caret] if line.strip().startswith("def ")), "")
    at = lines[0].strip().rstrip(":")
    return f"{cause[:300]} {at} of `{func[:100]}`: `{lines[caret - 1].strip()[:160]}`"


def _hopper_compile_check(deadline: float) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        return {"skipped": "triton has no NVIDIA backend here"}
    try:
        r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "compile-sm90"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=max(5.0, deadline - time.time()))  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"skipped": "stage budget"}
    if r.returncode != 0:
        return {"error": (r.stderr or r.stdout)[-600:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def one_case_per_function(summary: dict[str, Any], module: str = CPU_CASES_MODULE) -> list[str]:
    """Node ids of the first case of each test function of ``module`` among the cases of a JUnit
    summary (``_junit``; classname ``tests.test_cuda``, name ``test_x[params]``), in their order."""
    dotted = module.removesuffix(".py").replace("/", ".")
    picked: dict[str, str] = {}
    for case in summary.get("cases", {}):
        classname, _, name = case.partition("::")
        if classname == dotted:
            picked.setdefault(name.split("[")[0], f"{module}::{name}")
    return list(picked.values())


def cuda_test_files() -> list[str]:
    """The test modules that hold CUDA cases (``pytest.mark.cuda``), relative to the root."""
    tests = sorted((ROOT / "tests").glob("test_*.py"))
    return [p.relative_to(ROOT).as_posix() for p in tests if "mark.cuda" in p.read_text(errors="replace")]


def stage_tests(args: argparse.Namespace, part: Part, deadline: float) -> int:
    out = Path(os.environ.get("GPU_CHECK_OUT", "."))
    work = Path(os.environ.get("GPU_CHECK_WORK", tempfile.gettempdir()))
    env = dict(os.environ)
    env.pop("LEANOPT_CUDA_TESTS_ON_CPU", None)
    junit: dict[str, Any] = {}
    # The suite's CUDA cases as they run on a GPU machine (all skipped without CUDA). Dry: only
    # the modules that hold them (collecting the whole suite to skip it costs ~40 s on 2 cores).
    paths = cuda_test_files() if args.dry_run else ["tests"]
    label = f"pytest {' '.join(paths)} -m cuda"
    _, junit[label] = _pytest("cuda cases", paths, env | {"TRITON_INTERPRET": "0"}, out / "cuda_tests.xml",
                              deadline - time.time() - (25 if args.dry_run else 3))  # fmt: skip
    part.update(junit=junit)
    ok = _cases_ok(junit[label])
    if args.dry_run:
        # ... and one case of each test function of tests/test_cuda.py on the CPU (the plain run above lists
        # them all; every case: GPU_CHECK_CPU_CASES=all), Triton interpreted.
        env_cpu = env | {"LEANOPT_CUDA_TESTS_ON_CPU": "1", "TRITON_INTERPRET": "1"}
        picked = [] if os.environ.get("GPU_CHECK_CPU_CASES") == "all" else one_case_per_function(junit[label])
        cpu_label = "on the CPU (LEANOPT_CUDA_TESTS_ON_CPU=1), " + ("one case of each test function" if picked else "every case")
        _, junit[cpu_label] = _pytest("cuda cases on the CPU", picked or [CPU_CASES_MODULE], env_cpu, work / "cuda_tests_cpu.xml",
                                      deadline - time.time() - 2)  # fmt: skip
        ok = ok and _cases_ok(junit[cpu_label])
        part.update(junit=junit)
        # Informational: on the GPU the kernels are compiled for real by the tests above.
        hopper = _hopper_compile_check(deadline - 1)
        bad = {k: v for k, v in hopper.items() if v != "ok"}
        log(f"kernels compiled for sm_90 without a GPU: {len(hopper) - len(bad)} of {len(hopper)} ok" + "".join(f"\n  {k}: {v}" for k, v in bad.items()))
        part.update(compile_sm90=hopper)
    counts = [f"{label}: {j.get('passed', '?')} passed, {j.get('failed', '?')} failed, {j.get('skipped', '?')} skipped" for label, j in junit.items()]
    part.update(summary="; ".join(counts))
    if not ok:
        part.update(status="failed", error="; ".join(counts))
        return 1
    part.update(status="ok")
    return 0


# ---- timing: benchmarks/step_time.py's pieces, on TinyLlama-1.1B shapes -------------------------


def benchmark(name: str) -> Any:
    """A module of benchmarks/ (``step_time``, ``accuracy_vs_peers``): the stages run the
    benchmarks' own code, so a figure here is the figure the benchmark gives."""
    path = str(ROOT / "benchmarks")
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module(name)


# leanopt first, torch next, the peers that compile last (if a stage runs out of time, the last
# ones are the ones skipped); names of benchmarks/step_time.py's candidates.
TIMING_OPTIMIZERS = (
    "torch-adamw-fused", "leanopt-adamw", "leanopt-adamw8bit", "leanopt-adamw4bit", "leanopt-adafactor", "torch-adamw-foreach",
    "hf-adafactor", "torch-adafactor", "bnb-adamw8bit", "optimi-adamw", "torchao-adamw8bit", "torchao-adamw4bit",
)  # fmt: skip


def stage_timing(args: argparse.Namespace, part: Part, deadline: float, dtype_name: str) -> int:
    import torch

    import leanopt
    from leanopt import kernels

    st = benchmark("step_time")
    peer_context = benchmark("accuracy_vs_peers").peer_context  # torchao eager in a dry run (its compiles: minutes)
    dry = args.dry_run
    device = torch.device("cpu" if dry else "cuda")
    dtype = getattr(torch, dtype_name)
    cfg = st.TOY if dry else st.TINYLLAMA
    shapes = st.llama_shapes(cfg)
    numel = sum(math.prod(s) for s in shapes)
    if not dry and numel != st.TINYLLAMA_PARAMS:
        raise AssertionError(f"TinyLlama shapes give {numel:,} params, expected {st.TINYLLAMA_PARAMS:,}")
    rounds_max, warmup = (1, 0) if dry else (25, 2)
    factories = st.candidates("triton" if dry else "auto")
    part.update(device=str(device), param_dtype=dtype_name, params=numel, tensors=len(shapes),
                shapes_from=("toy Llama " if dry else "TinyLlama-1.1B ") + json.dumps(cfg), results=[], skipped={},
                warmup=warmup, rounds=0)  # fmt: skip
    budget = deadline - time.time()

    bw = st.copy_bandwidth(device, (16 << 20) if dry else (2 << 30))
    log(f"copy bandwidth {bw:.0f} GB/s")
    part.update(copy_bandwidth_GBps=round(bw, 1))

    # One set of params and gradients, shared: the optimizers only read gradients, and the
    # values params drift to under a few hundred small steps do not change a step's time.
    gen = torch.Generator(device=device).manual_seed(0)
    params = []
    for s in shapes:
        p = torch.empty(s, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen).requires_grad_()
        p.grad = torch.empty(s, dtype=dtype, device=device).normal_(0.0, 1e-3, generator=gen)
        params.append(p)
    st.sync(device)
    log(f"{numel:,} {dtype_name} params in {len(shapes)} tensors on {device}")

    runs: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    param_bytes = torch.empty((), dtype=dtype).element_size()
    for name in TIMING_OPTIMIZERS:
        left = deadline - time.time()
        if left < 0.3 * budget:  # keep time for the timed rounds
            skipped[name] = f"not run: {left:.0f} s of the stage budget left"
            part.update(skipped=skipped)
            continue
        try:
            with _quiet(), peer_context(name, dry):
                opt = factories[name](params)
                first = st.first_step(opt, device)
        except Exception as err:  # noqa: BLE001 - a peer missing or failing here: report, go on
            skipped[name] = ("not installed: " if isinstance(err, ImportError) else "failed: ") + first_line(err)
            log(f"skip {name}: {skipped[name]}")
            part.update(skipped=skipped)
            if device.type == "cuda" and not _cuda_healthy():
                log("the CUDA context is broken: stopping here")
                part.update(error=f"CUDA context broken after {name}: {skipped[name]}")
                break
            continue
        try:
            state_bytes = leanopt.measure(opt).bytes
        except Exception as err:  # noqa: BLE001
            state_bytes = None
            log(f"{name}: leanopt.measure failed: {first_line(err)}")
        lean = name.startswith("leanopt-")
        backend = kernels.resolve_backend(opt.backend, device) if lean else ("eager" if dry and name.startswith("torchao") else "")
        runs[name] = {"opt": opt, "first_s": first, "state_bytes": state_bytes, "backend": backend}
        bpp = "?" if state_bytes is None else f"{state_bytes / numel:.4f}"
        log(f"ready {name:20s} first step {first:7.2f} s, state {bpp} B/param")

    def stepper(name: str) -> Callable[[], None]:
        def step() -> None:
            with peer_context(name, dry):
                runs[name]["opt"].step()

        return step

    def dropped(name: str, err: Exception) -> None:
        """An optimizer that fails in the timed steps is dropped (reported), the others go on."""
        skipped[name] = "failed during the timed steps: " + first_line(err)
        log(f"drop {name}: {skipped[name]}")
        runs.pop(name)
        part.update(skipped=skipped)
        if device.type == "cuda" and not _cuda_healthy():
            raise RuntimeError(f"CUDA context broken after {name}: {skipped[name]}") from err

    timed: dict[str, list[float]] = {}

    def rows() -> list[dict[str, Any]]:
        ref = timed.get("torch-adamw-fused")
        ref_ms = statistics.median(ref) * 1e3 if ref else None
        out = []
        for name, r in runs.items():
            row = st.step_row(name, timed.get(name, []), r["first_s"], r["state_bytes"], numel=numel, param_bytes=param_bytes,
                              bandwidth=bw, ref_ms=ref_ms)  # fmt: skip
            row = {"optimizer": name, "backend": r["backend"], **row}
            if "first_warm_s" in r:
                row["first_step_warm_s"] = round(r["first_warm_s"], 3)
            out.append(row)
        return out

    def after_round(done: int, times: dict[str, list[float]]) -> None:
        timed.update(times)
        part.update(results=rows(), rounds=done)

    try:
        t = time.time()
        timed.update(st.interleaved_rounds({name: stepper(name) for name in runs}, device, rounds_max, warmup,
                                           deadline=deadline, dropped=dropped, after_round=after_round))  # fmt: skip
        log(f"{part.data['rounds']} rounds of {len(runs)} optimizers in {time.time() - t:.2f} s")
        # First step of a second instance: the kernels are compiled (and cached in this process).
        # Not in a dry run: a third interpreted step of each leanopt optimizer, timing nothing real.
        for name in [n for n in runs if n.startswith("leanopt-") and not dry]:
            if time.time() > deadline - 5:
                break
            try:
                runs[name]["first_warm_s"] = st.first_step(factories[name](params), device)
            except Exception as err:  # noqa: BLE001
                log(f"{name}: second instance failed: {first_line(err)}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
        part.update(results=rows())
    except Exception as err:  # noqa: BLE001 - keep the rounds done so far
        traceback.print_exc()
        part.update(results=rows(), error=f"during the timed rounds: {first_line(err)}", status="failed")
        return 1
    for r in rows():
        log(f"{r['optimizer']:20s} {_fmt(r['ms_per_step'], '.2f'):>9} ms  x fused {_fmt(r['ratio_to_torch_fused'], '.2f'):>6}  "
            f"first {r['first_step_s']:.2f} s  {_fmt(r.get('state_bytes_per_param'), '.3f')} B/param  {_fmt(r.get('achieved_GBps'), '.0f')} GB/s")  # fmt: skip
    part.update(summary=f"{len(runs)} timed, {len(skipped)} skipped, {part.data['rounds']} rounds")
    if "error" in part.data:
        part.update(status="failed")
        return 1
    part.update(status="ok")
    return 0


def _cuda_healthy() -> bool:
    import torch

    try:
        torch.cuda.synchronize()
        torch.zeros(1, device="cuda").add_(1).item()
        return True
    except Exception:  # noqa: BLE001
        return False


# ---- accuracy: benchmarks/accuracy_vs_peers.py's scenarios and contenders -----------------------


def _import_error(module: str) -> str | None:
    """Why ``module`` does not import here (None if it does)."""
    try:
        with _quiet():
            importlib.import_module(module)
    except Exception as err:  # noqa: BLE001
        return first_line(err)
    return None


def stage_accuracy(args: argparse.Namespace, part: Part, deadline: float) -> int:
    import torch

    import leanopt

    acc = benchmark("accuracy_vs_peers")
    dry = args.dry_run
    device = torch.device("cpu" if dry else "cuda")
    size, steps, lr = (64, 3, acc.LR) if dry else (acc.SIZE, acc.STEPS, acc.LR)
    backend = "triton" if dry else "auto"
    # Every ``*_scenario`` of the benchmark (randn, heavy, hazard, and any added later).
    scenarios = {attr.removesuffix("_scenario"): getattr(acc, attr) for attr in dir(acc) if attr.endswith("_scenario")}
    order = [s for s in ("randn", "heavy", "hazard") if s in scenarios] + sorted(s for s in scenarios if s not in ("randn", "heavy", "hazard"))
    part.update(device=str(device), size=size, steps=steps, lr=lr, scenarios=order, scenario_source="benchmarks/accuracy_vs_peers.py",
                rows=[], absent={})  # fmt: skip

    contenders: dict[str, Callable[[list], Any] | str] = {
        "leanopt AdamW (fp32 states)": lambda ps: leanopt.AdamW(ps, lr=lr, weight_decay=0.0, backend=backend),
        **acc.leanopt_factories(backend),
    }
    bnb = acc.bnb_factory()
    contenders["bitsandbytes AdamW8bit"] = bnb if bnb is not None else (_import_error("bitsandbytes") or "absent")
    contenders.update(acc.torchao_factories() or {"torchao": _import_error("torchao.optim") or "absent"})

    data = {}
    for s in order:
        out = scenarios[s](size=size, steps=steps)
        p0, grads = out[0], list(out[1])
        data[s] = (p0, grads, acc.fp32_reference(p0, grads, device=device))
    # NaN isolation: one NaN gradient element at the next-to-last step; count the params that
    # turn non-finite (1 where the element itself takes the NaN, as torch's AdamW does; 0 where
    # it is skipped; a block where it spreads).
    g = torch.Generator().manual_seed(3)
    nan_p0 = torch.randn(size, size, generator=g)
    nan_grads = [torch.randn(size, size, generator=g) * 0.01 for _ in range(max(3, steps // 4))]
    nan_grads[-2][0, 5] = float("nan")

    rows, absent = [], {}
    for name, factory in contenders.items():
        if isinstance(factory, str):
            absent[name] = factory
            part.update(absent=absent)
            continue
        if time.time() > deadline - 3:
            absent[name] = "not run: stage budget"
            continue
        row: dict[str, Any] = {"name": name, "scenarios": {}}
        t = time.time()
        for s in order:
            p0, grads, ref = data[s]
            try:
                with _quiet(), acc.peer_context(name, dry):
                    final, opt = acc.run(factory, p0, grads, device=device)
                mean, far, worst = acc.sparse_distance(final, ref)
                row["scenarios"][s] = {"max": worst, "mean": mean, "far": far}
                if "bytes_per_param" not in row:
                    with contextlib.suppress(Exception):
                        row["bytes_per_param"] = leanopt.measure(opt).bytes / p0.numel()
            except Exception as err:  # noqa: BLE001
                row["scenarios"][s] = {"error": first_line(err)}
        try:
            with _quiet(), acc.peer_context(name, dry):
                final, _ = acc.run(factory, nan_p0, nan_grads, device=device)
            row["nan_spread"] = int((~torch.isfinite(final)).sum().item())
        except Exception as err:  # noqa: BLE001
            row["nan_spread"] = None
            row["nan_error"] = first_line(err)
        row["seconds"] = round(time.time() - t, 2)
        rows.append(row)
        cells = "  ".join(f"{s} {v['max']:.2e}/{v['mean']:.2e}" if "max" in v else f"{s} {v['error'][:60]}" for s, v in row["scenarios"].items())
        log(f"{name:36s} {cells}  NaN spread {row['nan_spread']}  ({row['seconds']} s)")
        part.update(rows=rows, absent=absent)
    errors = [r["name"] for r in rows if r["name"].startswith("leanopt") and any("error" in v for v in r["scenarios"].values())]
    part.update(summary=f"{len(rows)} optimizers, {len(order)} scenarios from benchmarks/accuracy_vs_peers.py")
    if errors:
        part.update(status="failed", error="leanopt failed in: " + ", ".join(errors))
        return 1
    part.update(status="ok")
    return 0


# ---- plan check ---------------------------------------------------------------------------------

PLAN_CHECK_MODULE = "leanopt.memory.plan_check"


def stage_plan_check(args: argparse.Namespace, part: Part, deadline: float) -> int:
    """Optional: the memory planner's own GPU check, if a module ``leanopt.memory.plan_check``
    exists (another engineer's; run as ``python3 -m leanopt.memory.plan_check`` with
    GPU_CHECK_DRY_RUN and GPU_CHECK_OUT set; its output's last lines are recorded)."""
    # leanopt runs from src/ (PYTHONPATH): look on disk, without importing leanopt (and torch).
    where = ROOT / "src" / Path(*PLAN_CHECK_MODULE.split("."))
    if not (where.with_suffix(".py").exists() or (where / "__main__.py").exists()):
        part.update(status="skipped", reason=f"{PLAN_CHECK_MODULE} does not exist")
        log(f"{PLAN_CHECK_MODULE} does not exist: skipped")
        return 0
    env = dict(os.environ, GPU_CHECK_DRY_RUN="1" if args.dry_run else "0")
    try:
        r = subprocess.run([sys.executable, "-m", PLAN_CHECK_MODULE], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=max(1.0, deadline - time.time() - 1))  # fmt: skip
    except subprocess.TimeoutExpired:
        part.update(status="timeout", error="plan_check ran past the stage budget")
        return 1
    output = (r.stdout + r.stderr).strip().splitlines()
    print("\n".join(output[-40:]))
    result = None
    with contextlib.suppress(Exception):
        result = json.loads(r.stdout.strip().splitlines()[-1])
    part.update(output_tail=output[-40:], result=result, rc=r.returncode)
    if r.returncode != 0:
        part.update(status="failed", error=f"exit status {r.returncode}")
        return 1
    part.update(status="ok")
    return 0


HOST_STEP_OPTIMIZERS = "torch-adamw-fused,leanopt-adamw8bit,leanopt-adamw4bit,leanopt-lion8bit,leanopt-ademamix8bit,leanopt-adafactor,hf-adafactor"


def stage_host_step(args: argparse.Namespace, part: Part, deadline: float) -> int:
    """The CPU step as it scales with cores: ``benchmarks/step_time.py --device cpu`` at
    one thread and at every core of the machine (on a lent GPU machine, 16), and
    ``benchmarks/first_step.py`` (a fresh kernel cache, a warm one, no compiler). Dry: two
    optimizers on the toy shapes, two rounds, 1 and 2 threads, no first-step run."""
    cores = os.cpu_count() or 1
    counts = [1, 2] if args.dry_run else sorted({1, cores})
    only = "torch-adamw-fused,leanopt-adamw8bit" if args.dry_run else HOST_STEP_OPTIMIZERS
    # Dry: the toy shapes, one warm-up (the command and its report checked, not the CPU's speed).
    sizes = ["--set", "toy", "--rounds", "2", "--warmup", "1"] if args.dry_run else ["--rounds", "15"]
    runs: dict[str, Any] = {}
    for n in counts:
        out = Path(os.environ.get("GPU_CHECK_WORK", tempfile.gettempdir())) / f"host_step_{n}.json"
        cmd = [sys.executable, str(ROOT / "benchmarks" / "step_time.py"), "--device", "cpu", "--threads", str(n),
               *sizes, "--only", only, "--json", str(out)]  # fmt: skip
        subprocess.run(cmd, cwd=ROOT, check=True, timeout=max(1.0, deadline - time.time() - 1))
        runs[str(n)] = json.loads(out.read_text())
    scaling = {}
    if len(counts) == 2:
        one, many = ({r["optimizer"]: r["ms_per_step"] for r in runs[str(n)]["results"]} for n in counts)
        scaling = {name: round(one[name] / many[name], 2) for name in one if name in many}
    summary = f"speed-up 1 -> {counts[-1]} threads: " + ", ".join(f"{k.removeprefix('leanopt-')} {v}x" for k, v in scaling.items())
    part.update(threads=counts, runs=runs, speedup=scaling, summary=summary)
    if not args.dry_run:
        out = Path(os.environ.get("GPU_CHECK_WORK", tempfile.gettempdir())) / "first_step.json"
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "first_step.py"), "--json", str(out)], cwd=ROOT,
                       check=True, timeout=max(1.0, deadline - time.time() - 1))  # fmt: skip
        part.update(first_step=json.loads(out.read_text()))
    part.update(status="ok")
    return 0


def stage_offload(args: argparse.Namespace, part: Part, deadline: float) -> int:
    """``offload="cpu"`` on the device: ``benchmarks/offload_step.py``. The offloaded
    AdamW8bit's params after three steps must equal, bit for bit, a CPU copy stepped without
    offload from the same gradients (8M-param model; its distance from the on-device Triton step
    is recorded); then a training step of TinyLlama-1.1B shapes in bf16, on-device vs offloaded vs
    offloaded with release (and torchao's CPUOffloadOptimizer): ms/step, ms in step(), device
    peak, host bytes, and the share of the host step hidden behind backward. Dry: the toy model
    on the CPU, two rounds."""
    out = Path(os.environ.get("GPU_CHECK_WORK", tempfile.gettempdir())) / "offload.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "offload_step.py"), "--json", str(out)]
    if args.dry_run:
        cmd += ["--device", "cpu", "--size", "toy", "--rounds", "2", "--warmup", "1"]
    else:
        cmd += ["--device", "cuda", "--size", "full", "--check-size", "cpu", "--rounds", "4", "--warmup", "1"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(1.0, deadline - time.time() - 1))
    print((r.stdout + r.stderr)[-4000:])
    if not out.exists():
        part.update(status="failed", error=f"benchmarks/offload_step.py exited {r.returncode} without results")
        return 1
    result = json.loads(out.read_text())
    check = result["check"]
    summary = (f"bit-identical to the CPU reference: {check['bit_identical_to_cpu_reference']}; hidden share "
               f"{result.get('hidden_share')}; step x{result.get('offload_overhead')} (offload), "
               f"x{result.get('released_overhead')} (offload+release) of on-device")  # fmt: skip
    part.update(result=result, summary=summary)
    if r.returncode != 0 or not check["bit_identical_to_cpu_reference"]:
        part.update(status="failed", error="offloaded params differ from the CPU reference" if r.returncode == 1 else
                    f"exit status {r.returncode}")  # fmt: skip
        return 1
    part.update(status="ok")
    return 0


# ---- twins: the Triton kernels, the compiled graphs and the reference ---------------------------


def stage_twins(args: argparse.Namespace, part: Part, deadline: float) -> int:
    """benchmarks/backend_parity.py on the device: every registered elementwise rule (tests/registry.py)
    on its Triton twin, its compiled graphs and the reference, fp32 then bf16 params (dry: one
    rule per family, fp32, toy shapes, Triton interpreted, the graphs traced by dynamo and run
    eagerly; tests/test_rules.py holds every rule's twin and graphs to the reference)."""
    import torch

    parity = benchmark("backend_parity")
    dry = args.dry_run
    if dry:
        parity.dynamo_only()
    device = torch.device("cpu" if dry else "cuda")
    steps = parity.TOY_STEPS if dry else parity.STEPS
    dtypes = (torch.float32,) if dry else parity.DTYPES
    rows: list[dict[str, Any]] = []
    not_run: list[str] = []
    part.update(device=str(device), steps=steps, dynamo_only=dry, source="benchmarks/backend_parity.py", rows=rows, not_run=not_run)
    for dtype in dtypes:
        for case in parity.cases(one_per_family=dry):
            label = f"{case.name} {str(dtype).removeprefix('torch.')}"
            if time.time() > deadline - 5:
                not_run.append(label)
                continue
            try:
                row = parity.compare(case, device, dtype, steps=steps, toy=dry)
            except Exception as err:  # noqa: BLE001 - recorded as this case's failure; the next runs
                row = {"case": case.name, "dtype": str(dtype).removeprefix("torch."), "ok": False, "error": first_line(err), "pairs": {}}
            rows.append(row)
            cells = "  ".join(f"{k} {v['max']:.2e}" if v.get("max") is not None else f"{k} -" for k, v in row["pairs"].items())
            log(f"{label:32s} {'ok' if row['ok'] else 'FAIL ' + str(row.get('error', ''))}  {cells}")
            part.update(rows=rows, not_run=not_run)
    failed = [f"{r['case']} {r['dtype']}" for r in rows if not r["ok"]]
    part.update(summary=f"{len(rows) - len(failed)} of {len(rows)} cases within tolerance" + (f", {len(not_run)} not run (budget)" if not_run else ""))
    if failed or not_run:
        why = ([f"outside tolerance: {', '.join(failed)}"] if failed else []) + (
            [f"not run in the stage budget: {len(not_run)} (run --only twins alone)"] if not_run else [])  # fmt: skip
        part.update(status="failed", error="; ".join(why))
        return 1
    part.update(status="ok")
    return 0


def stage_muon(args: argparse.Namespace, part: Part, deadline: float) -> int:
    """Muon (``benchmarks/muon_step.py``): leanopt.Muon and Muon8bit beside torch.optim.Muon on
    TinyLlama-1.1B's 154 matrices (fp32), interleaved rounds: ms/step, the ratio to torch (goal
    <= 1.0), the Newton-Schulz share of the step; and ``offload="cpu"`` (momentum on the host,
    orthogonalization on the GPU) against the on-device step after three steps. Dry: 1/32-width
    shapes (``--shapes toy``), one layer, on the CPU, leanopt's Triton kernels interpreted (what the GPU runs), the
    compiled graphs traced by dynamo and run eagerly (as in the twins stage: no Inductor compile for
    the CPU); nine rounds (toy steps take ~30 ms: a median of three could be moved by one stall of a
    loaded machine)."""
    out = Path(os.environ.get("GPU_CHECK_WORK", tempfile.gettempdir())) / "muon.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "muon_step.py"), "--json", str(out), "--offload-check"]
    if args.dry_run:
        cmd += ["--device", "cpu", "--shapes", "toy", "--rounds", "9", "--backend", "triton", "--dynamo-only"]
    else:
        cmd += ["--device", "cuda", "--shapes", "tinyllama", "--rounds", "3"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(1.0, deadline - time.time() - 1))
    print((r.stdout + r.stderr)[-4000:])
    if r.returncode != 0 or not out.exists():
        part.update(status="failed", error=f"benchmarks/muon_step.py exited {r.returncode}")
        return 1
    result = json.loads(out.read_text())
    summary = (f"leanopt.Muon x{result['ratio_to_torch']['leanopt.Muon']} of torch.optim.Muon, Muon8bit "
               f"x{result['ratio_to_torch']['leanopt.Muon8bit']}; Newton-Schulz {result['ns_share_of_leanopt_step']:.0%} "
               f"of the step; offload max |diff| {result['offload']['max_abs_diff']:.3g}")  # fmt: skip
    part.update(result=result, summary=summary, status="ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
