"""The probe behind a CPU plan's ``process_bytes``: a small model's first steps, measured as a fresh process sees them.

What is measured (for :func:`leanopt.memory.process.cpu_one_time`): in a process that has
imported torch, transformers and leanopt and run nothing else, the resident-set growth while a
small model of the class planned (:func:`small_config`) is built and trained three steps with
the optimizer, at its highest (``VmHWM``), with ``MALLOC_MMAP_THRESHOLD_=65536`` (every block of
64 KiB or more mapped on its own and returned when freed, so what glibc's default heap would keep
of the small model is not in it).

How (:func:`measure`): **one** subprocess for every setup a plan needs. It imports once, then per
model forks a *builder* that builds the model, which forks one *worker* per setup (precision,
optimizer, rounding) that trains it. The imports, the build and the modules the build imports are
paid once instead of once per setup. A forked process starts as its parent was, with one
difference that matters here: its page tables hold none of the parent's file-backed pages (the
kernel maps each again at its next touch and counts it then), so the library code the parent had
run would count as growth. Each fork therefore first touches every page of a mapped file that its
parent had resident (``/proc/self/pagemap``), then resets the high-water mark. Held against one
fresh process per setup (DistilBERT's small model: fp32 AdamW, bf16-mixed AdamW4bit, pure bf16
AdamW8bit stochastic; 2026-12-03): within 0.2 MiB of 128-150 MiB; without the touch, 21 MiB more.
Where ``pagemap`` cannot be read or the high-water mark cannot be reset (``/proc/self/clear_refs``),
each setup runs in a fresh subprocess of its own, as one probe.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from leanopt.memory.resident import reset_peak, status_kib

__all__ = ["PROBE_BATCH", "PROBE_SEQ", "build", "measure", "planned_peaks", "probe_spec", "small_config"]

MALLOC_MMAP_THRESHOLD = 65536  # the probe's (and the check's) glibc setting: every block of 64 KiB+ its own mmap
PROBE_TIMEOUT_S = 600.0  # the longest a setup may take before the probe is stopped
PROBE_BATCH, PROBE_SEQ = 4, 64
PAGE = 4096


# ---- the small model of the same class -----------------------------------------------------------
_LAYERS = ("n_layers", "n_layer", "num_hidden_layers", "num_layers", "encoder_layers", "decoder_layers")
_WIDTH = ("dim", "n_embd", "hidden_size", "d_model")
_HEADS = ("n_heads", "n_head", "num_attention_heads", "encoder_attention_heads", "decoder_attention_heads")
_INNER = ("hidden_dim", "intermediate_size", "n_inner", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff")


def small_config(config: Any) -> dict[str, Any]:
    """The config values of a small model of the same architecture: two layers, 128 wide, four
    heads (two key/value heads where the model groups them), 512 inner, a 4,000-token vocabulary."""
    values = config.to_dict()
    grouped = isinstance(values.get("num_key_value_heads"), int) and values["num_key_value_heads"] < values.get("num_attention_heads", 0)
    for key in _LAYERS:
        if isinstance(values.get(key), int):
            values[key] = min(values[key], 2)
    for key in _WIDTH:
        if isinstance(values.get(key), int):
            values[key] = 128
    for key in _HEADS:
        if isinstance(values.get(key), int):
            values[key] = 4
    if isinstance(values.get("num_key_value_heads"), int):
        values["num_key_value_heads"] = 2 if grouped else 4
    if isinstance(values.get("head_dim"), int):
        values["head_dim"] = 32
    for key in _INNER:
        if isinstance(values.get(key), int):
            values[key] = 512
    if isinstance(values.get("vocab_size"), int):
        values["vocab_size"] = 4000
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        if isinstance(values.get(key), int) and values[key] >= 4000:
            values[key] = 0
    return values


def probe_spec(module: torch.nn.Module, precision: str, optimizer: str, rounding: str | None) -> dict[str, Any]:
    """What a probe of ``module``'s class runs (JSON): the small model, the precision, the optimizer."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise ValueError(f"{type(module).__name__} has no transformers config to build a small one from")
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    seq = PROBE_SEQ if not isinstance(positions, int) else min(PROBE_SEQ, positions)
    cls = type(module)
    return {"model": [cls.__module__, cls.__qualname__], "config": [type(config).__module__, type(config).__qualname__],
            "values": small_config(config), "precision": precision, "optimizer": optimizer, "rounding": rounding,
            "batch": PROBE_BATCH, "seq": seq}  # fmt: skip


def build(spec: dict[str, Any], *, meta: bool = False) -> torch.nn.Module:
    """The small model of ``spec`` (random weights, or on the meta device)."""
    import importlib

    mod, name = spec["model"]
    cmod, cname = spec["config"]
    config = getattr(importlib.import_module(cmod), cname).from_dict(spec["values"])
    cls = getattr(importlib.import_module(mod), name)
    if meta:
        with torch.device("meta"):
            return cls(config)
    return cls(config)


def planned_peaks(specs: list[dict[str, Any]]) -> list[int]:
    """What ``plan`` predicts for each probe's small step (no checkpointing, no release): the part
    of its growth that is not one-time. One set of traces per small model (the forward/backward
    once per precision, the step once per optimizer and rounding)."""
    from leanopt.memory.plan_model import task_of
    from leanopt.memory.plan_step import Traces, combine

    traces: dict[str, Traces] = {}
    out = []
    for spec in specs:
        model_key = json.dumps([spec["model"], spec["config"], spec["values"], spec["batch"], spec["seq"]], sort_keys=True)
        if model_key not in traces:
            model = build(spec, meta=True)
            traces[model_key] = Traces(model, type(model).__name__, task_of(model), batch=spec["batch"], seq=spec["seq"])
        t = traces[model_key]
        step, _ = t.step(spec["optimizer"], spec["rounding"], spec["precision"], release=False)
        out.append(combine(t.forward_backward(spec["precision"], False), step).bytes)
    return out


# ---- the parent's side -----------------------------------------------------------------------------
def _env() -> dict[str, str]:
    # A fixed mmap threshold: freed blocks go back to the system, so what is measured is the
    # one-time costs, not what glibc's default allocator would keep of this small model's heap.
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(PYTHONWARNINGS="ignore", MALLOC_MMAP_THRESHOLD_=str(MALLOC_MMAP_THRESHOLD))
    return env


def measure(specs: list[dict[str, Any]], report: Callable[[int, dict[str, Any] | str], None] | None = None,
            timeout: float = PROBE_TIMEOUT_S, stop: threading.Event | None = None) -> list[dict[str, Any] | str]:  # fmt: skip
    """Each spec's measurement -- ``{"peak", "built", "param_bytes", "seconds"}``: the growth at its
    highest and after the build, the weights' bytes -- or why it failed (one line), in the order
    given, from one probe subprocess; ``report(index, result)`` as each arrives. A setup that takes
    more than ``timeout`` seconds, or ``stop`` set, stops the probe (the ones left are failures)."""
    results: list[dict[str, Any] | str | None] = [None] * len(specs)
    proc = subprocess.Popen([sys.executable, "-m", "leanopt.memory.probe", "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(), start_new_session=True)  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    stderr = proc.stderr
    errors: list[str] = []
    reader = threading.Thread(target=lambda: errors.extend(stderr.read().splitlines()), daemon=True)
    reader.start()
    proc.stdin.write(json.dumps(specs))
    proc.stdin.close()
    stop = stop or threading.Event()
    last = [time.monotonic()]
    why: list[str] = []

    def watch() -> None:  # ends the probe when stopped, or when no setup is done for `timeout` seconds
        while proc.poll() is None:
            if stop.wait(0.2) or time.monotonic() - last[0] > timeout:
                why.append("stopped" if stop.is_set() else f"no result in {timeout:.0f} s")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    fallback = False
    for line in proc.stdout:
        last[0] = time.monotonic()
        message = json.loads(line)
        if "fallback" in message:
            fallback = True
            continue
        index = message.pop("index")
        results[index] = message["error"] if "error" in message else message
        if report is not None:
            report(index, results[index])  # type: ignore[arg-type]
    proc.wait()
    watcher.join()
    reader.join(timeout=5)
    said = why[0] if why else (errors[-1][:200] if errors else f"exit {proc.returncode}")
    for i, spec in enumerate(specs):
        if results[i] is None:
            results[i] = _probe_alone(spec, timeout) if fallback and not stop.is_set() else f"the probe stopped ({said})"
            if report is not None:
                report(i, results[i])  # type: ignore[arg-type]
    return results  # type: ignore[return-value]


def _probe_alone(spec: dict[str, Any], timeout: float) -> dict[str, Any] | str:
    """One setup in a fresh subprocess of its own (where the probe cannot fork faithfully)."""
    t0 = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, "-m", "leanopt.memory.probe", "--one", json.dumps(spec)], env=_env(),
                             capture_output=True, text=True, timeout=timeout, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"no result in {timeout:.0f} s"
    if out.returncode != 0:
        return (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1][:200]
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "seconds": round(time.perf_counter() - t0, 1)}


# ---- the probe process -----------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    """The probe runs on Linux only: a missing field is an error there."""
    value = status_kib(field)
    if value is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return value


def resident_file_pages() -> list[int]:
    """The address of every page of a readable file mapping that is resident in this process
    (``/proc/self/maps`` and ``/proc/self/pagemap``, bit 63: present); OSError where unreadable."""
    pages: list[int] = []
    with open("/proc/self/maps") as maps, open("/proc/self/pagemap", "rb") as pagemap:
        for line in maps:
            fields = line.split()
            if len(fields) < 6 or not fields[5].startswith("/") or "r" not in fields[1]:
                continue
            start, stop = (int(x, 16) for x in fields[0].split("-"))
            pagemap.seek(start // PAGE * 8)
            entries = array.array("Q", pagemap.read((stop - start) // PAGE * 8))
            pages.extend(start + i * PAGE for i, entry in enumerate(entries) if entry >> 63)
    return pages


def _touch(pages: list[int]) -> None:
    for address in pages:
        ctypes.string_at(address, 1)


def _run_forked(work: Callable[[Callable[[dict[str, Any]], None]], None], on_message: Callable[[dict[str, Any]], None]) -> int:
    """``work(emit)`` in a forked child; each ``emit(message)`` reaches ``on_message`` here as it is
    sent. Returns the child's exit status (0, or 1 after an exception, reported as ``{"error"}``)."""
    sys.stdout.flush()
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read_end)
        status = 0
        with os.fdopen(write_end, "w") as out:

            def emit(message: dict[str, Any]) -> None:
                out.write(json.dumps(message) + "\n")
                out.flush()

            try:
                work(emit)
            except BaseException as err:  # noqa: BLE001 - said to the parent, then the child ends
                text = str(err).strip()
                emit({"error": f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"[:200]})
                status = 1
        os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end) as messages:
        for line in messages:
            on_message(json.loads(line))
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _train(model: torch.nn.Module, spec: dict[str, Any]) -> None:
    """The small model's three steps of ``spec``, as a user's script runs them."""
    from leanopt.memory.estimate import resolve_optimizer
    from leanopt.memory.plan_model import over_model

    precision = spec["precision"]
    if precision == "bf16":
        model.to(torch.bfloat16)
    model.train()
    rounding = spec["rounding"]
    cls = resolve_optimizer(spec["optimizer"])
    opt = cls(over_model(cls, model), **({"rounding": rounding} if rounding not in (None, "nearest") else {}))
    config: Any = model.config
    ids = torch.randint(0, int(config.vocab_size), (spec["batch"], spec["seq"]))
    classify = type(model).__name__.endswith("ForSequenceClassification")
    labels = torch.randint(0, int(getattr(config, "num_labels", 2) or 2), (spec["batch"],)) if classify else ids
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(t.untyped_storage().nbytes() for t in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values())


def _builder(specs: list[dict[str, Any]], indices: list[int], pages: list[int], emit: Callable[[dict[str, Any]], None]) -> None:
    """In the builder: the model of ``specs[indices[0]]`` built, then each setup trained in a worker."""
    _touch(pages)
    reset_peak()
    torch.manual_seed(0)
    before = _status_kib("VmRSS")
    model = build(specs[indices[0]])
    built = _status_kib("VmRSS") - before
    build_peak = _status_kib("VmHWM") - before
    param_bytes = _param_bytes(model)
    mine = resident_file_pages()
    for index in indices:
        t0 = time.perf_counter()
        got: dict[str, Any] = {}

        def worker(send: Callable[[dict[str, Any]], None], spec: dict[str, Any] = specs[index]) -> None:
            _touch(mine)
            reset_peak()
            start = _status_kib("VmRSS")
            _train(model, spec)
            send({"growth": _status_kib("VmHWM") - start})

        status = _run_forked(worker, got.update)
        if "growth" not in got:
            emit({"index": index, "error": got.get("error", f"the worker ended with status {status}")})
            continue
        emit({"index": index, "peak": max(build_peak, built + got["growth"]) * 1024, "built": built * 1024,
              "param_bytes": param_bytes, "seconds": round(time.perf_counter() - t0, 1)})  # fmt: skip


def _serve(specs: list[dict[str, Any]]) -> None:
    """The probe process: imports as a user's script does, then each model's builder and workers."""
    import transformers  # noqa: F401 - imported before the baseline, as a user's script does

    import leanopt  # noqa: F401

    def say(message: dict[str, Any]) -> None:
        print(json.dumps(message), flush=True)

    try:
        pages = resident_file_pages()
    except OSError as err:
        say({"fallback": f"/proc/self/pagemap: {type(err).__name__}"})
        return
    if not reset_peak():  # a fork could not start its high-water mark from where it is
        say({"fallback": "/proc/self/clear_refs cannot be written"})
        return
    models: dict[str, list[int]] = {}
    for i, spec in enumerate(specs):
        models.setdefault(json.dumps([spec["model"], spec["config"], spec["values"]], sort_keys=True), []).append(i)
    for indices in models.values():
        done: set[int] = set()

        def forward(message: dict[str, Any]) -> None:
            if "index" in message:
                done.add(message["index"])
            say(message)

        status = _run_forked(lambda emit: _builder(specs, indices, pages, emit), forward)
        for i in indices:
            if i not in done:
                say({"index": i, "error": f"the model's builder ended with status {status}"})


def _probe_one(spec: dict[str, Any]) -> None:
    """One setup in this fresh process: the model built and trained, the growth printed."""
    import transformers  # noqa: F401 - imported before the baseline, as a user's script does

    import leanopt  # noqa: F401

    torch.manual_seed(0)
    before = _status_kib("VmRSS")
    model = build(spec)
    built = _status_kib("VmRSS") - before
    _train(model, spec)
    print(json.dumps({"peak": (_status_kib("VmHWM") - before) * 1024, "built": built * 1024, "param_bytes": _param_bytes(model)}))


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        _serve(json.loads(sys.stdin.read()))
    elif len(sys.argv) == 3 and sys.argv[1] == "--one":
        _probe_one(json.loads(sys.argv[2]))
    else:
        print("usage: python -m leanopt.memory.probe --serve < SPECS_JSON | --one SPEC_JSON", file=sys.stderr)
        raise SystemExit(2)
