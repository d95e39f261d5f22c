"""Run one task with each optimizer and collect one result row per optimizer.

Each optimizer trains in a fresh Python process (``python -m leanopt.compare.worker``): its
peak memory is then its own (nothing left behind by the previous optimizer's pages, compile
caches or allocator state), and a peer that crashes on this device (a segfault in a native
kernel) costs one row, not the comparison. The child reports progress and its row as JSON lines.
``isolate=False`` runs them in this process instead (faster to start; the CPU peaks then
depend on the order).
"""

from __future__ import annotations

import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import torch

import leanopt
from leanopt.compare.contenders import Contender, contender
from leanopt.compare.meter import PeakMemory, Recorder, use_mmap_for_large_blocks
from leanopt.compare.tasks import Plan, get_task
from leanopt.memory import OPTIMIZER_NAMES

EVENT_PREFIX = "@@leanopt-compare "
Emit = Callable[[dict[str, Any]], None]


@dataclass
class Comparison:
    plan: Plan
    description: str
    optimizers: list[str]
    rows: list[dict[str, Any]] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)
    memory_method: str = ""
    wall_s: float = 0.0


# ---- one optimizer, in whatever process runs it --------------------------------------------------
def run_one(optimizer: str, plan: Plan, emit: Emit) -> dict[str, Any]:
    """Train ``plan``'s task with one optimizer and measure it; returns the result row."""
    entry = contender(optimizer)
    device = torch.device(plan.device)
    if plan.threads:
        torch.set_num_threads(plan.threads)
    if device.type == "cpu":
        use_mmap_for_large_blocks()
    workload = get_task(plan.task).prepare(plan)
    start = time.perf_counter()
    workload.warm_up(entry)
    setup_s = time.perf_counter() - start
    recorder = Recorder(device, plan.steps, emit)
    recorder.memory.reset()
    start = time.perf_counter()
    trained = workload.run(entry, plan, recorder)
    train_s = time.perf_counter() - start
    state = leanopt.measure(trained.optimizer)
    params = [p for p in trained.model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    kwargs = entry.kwargs(lr=plan.lr, weight_decay=plan.weight_decay, device=device)
    cls = type(trained.optimizer)
    row: dict[str, Any] = {
        "optimizer": entry.name,
        "status": "ok",
        "origin": entry.origin,
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "kwargs": {k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()},
        "params": n_params,
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "state_bytes": state.bytes,
        "state_bytes_per_param": state.bytes / n_params if n_params else None,
        "state_by_key": state.by_key,
        "estimated_state_bytes": _estimate(entry, trained.model, kwargs),
        "memory_method": recorder.memory.method,
        "setup_s": setup_s,
        "train_s": train_s,
    }
    row.update(recorder.summary())
    row.update({"val_loss": None, "accuracy": None})
    row.update(trained.metrics)
    return row


def _estimate(entry: Contender, model: torch.nn.Module, kwargs: dict[str, Any]) -> int | None:
    if entry.name not in OPTIMIZER_NAMES:
        return None
    try:
        return leanopt.estimate(model, entry.name, **kwargs).bytes
    except Exception:  # no layout known for this class: measured bytes stand alone
        return None


def worker_main() -> int:
    """Child entry: read ``{"optimizer", "plan"}`` as JSON on stdin, write events on stdout."""
    spec = json.loads(sys.stdin.read())
    # Events go to the original stdout; anything else printed (a peer's banner) goes to stderr.
    events = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def emit(event: dict[str, Any]) -> None:
        events.write(EVENT_PREFIX + json.dumps(_finite(event)) + "\n")

    try:
        row = run_one(spec["optimizer"], Plan(**spec["plan"]), emit)
    except Exception as err:
        traceback.print_exc()
        emit({"event": "error", "reason": _one_line(err)})
        return 1
    emit({"event": "result", "row": row})
    return 0


# ---- the comparison ----------------------------------------------------------------------------
def run_isolated(optimizer: str, plan: Plan, emit: Emit) -> dict[str, Any]:
    """Run :func:`run_one` in a fresh process; a crash becomes a ``failed`` row."""
    spec = json.dumps({"optimizer": optimizer, "plan": plan.to_dict()})
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    with tempfile.TemporaryFile(mode="w+") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "leanopt.compare.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
        )
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(spec)
        proc.stdin.close()
        row, reason = None, None
        for line in proc.stdout:
            if not line.startswith(EVENT_PREFIX):
                continue
            event = json.loads(line[len(EVENT_PREFIX) :])
            if event["event"] == "result":
                row = event["row"]
            elif event["event"] == "error":
                reason = event["reason"]
            else:
                emit(event)
        code = proc.wait()
        if row is not None:
            return row
        if reason is None:
            stderr.seek(0)
            tail = [ln.strip() for ln in stderr.read().splitlines() if ln.strip()]
            died = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            reason = f"the training process died ({died})" + (f": {tail[-1]}" if tail else "")
    return failed_row(optimizer, reason)


def run_in_process(optimizer: str, plan: Plan, emit: Emit) -> dict[str, Any]:
    try:
        return run_one(optimizer, plan, emit)
    except Exception as err:
        return failed_row(optimizer, _one_line(err))


def skipped_row(optimizer: str, reason: str) -> dict[str, Any]:
    return {"optimizer": optimizer, "status": "skipped", "reason": reason}


def failed_row(optimizer: str, reason: str) -> dict[str, Any]:
    return {"optimizer": optimizer, "status": "failed", "reason": reason}


def compare(
    plan: Plan,
    optimizers: list[str],
    *,
    isolate: bool = True,
    skip: dict[str, str] | None = None,
    on_start: Callable[[str], None] = lambda name: None,
    on_event: Emit = lambda event: None,
    on_row: Callable[[dict[str, Any]], None] = lambda row: None,
) -> Comparison:
    """Train ``plan`` with each optimizer in turn; unavailable ones become ``skipped`` rows.

    ``skip`` maps names to a reason for leaving them out (they get a ``skipped`` row too).
    """
    task = get_task(plan.task)
    result = Comparison(plan=plan, description=task.description, optimizers=list(optimizers))
    result.environment = environment(torch.device(plan.device), plan.threads)
    start = time.perf_counter()
    for name in optimizers:
        reason = (skip or {}).get(name) or contender(name).unavailable()
        if reason is not None:
            row = skipped_row(name, reason)
        else:
            on_start(name)
            row = (run_isolated if isolate else run_in_process)(name, plan, on_event)
            if row["status"] == "ok" and row.get("diverged"):
                row["reason"] = "the training loss became non-finite"
        result.rows.append(row)
        on_row(row)
    result.wall_s = time.perf_counter() - start
    methods = {r["memory_method"] for r in result.rows if r.get("memory_method")}
    result.memory_method = "; ".join(sorted(methods)) or PeakMemory(torch.device(plan.device)).method
    _rank(result.rows)
    return result


def _rank(rows: list[dict[str, Any]]) -> None:
    scored = [r for r in rows if r["status"] == "ok" and _is_finite(r.get("val_loss")) and not r.get("diverged")]
    for i, row in enumerate(sorted(scored, key=lambda r: r["val_loss"]), start=1):
        row["rank"] = i


# ---- environment -------------------------------------------------------------------------------
def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment(device: torch.device, threads: int | None = None) -> dict[str, Any]:
    env: dict[str, Any] = {
        "device": str(device),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "leanopt": leanopt.__version__,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": threads or torch.get_num_threads(),
    }
    if device.type == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    for dist in ("transformers", "bitsandbytes", "torchao", "scikit-learn", "matplotlib"):
        env[dist] = _version(dist)
    return env


# ---- helpers -----------------------------------------------------------------------------------
def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}"[:300] if text else type(err).__name__


def _is_finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _finite(value: Any) -> Any:
    """JSON has no NaN/Infinity: non-finite floats become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
