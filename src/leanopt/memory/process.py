"""What a training process needs besides its step's tensors (issue 24): ``process_bytes``.

``plan``'s ``peak_bytes`` is the peak of one steady-state step's tensors. A user's process needs
more, and sees more (its resident set, or on a GPU what the driver hands out):

* **CPU**: the one-time costs of the first steps -- the model's modules imported while it is
  built, the thread pools started and the library pages touched by the first forward, backward
  and optimizer step (oneDNN, MKL, the native kernel loaded). They are measured, not modelled:
  once per (torch, transformers and leanopt versions, Python, machine, thread count, model
  class, precision -- the dtype set -- and optimizer) a fresh subprocess (:func:`probe`) imports
  torch, transformers and leanopt, reads its resident set, builds a small model of the same
  class (:func:`small_config`: two layers, 128 wide), trains three steps with that optimizer and
  reads the resident-set high-water mark; the one-time cost is that growth less what ``plan``
  predicts for the same small step. The probe runs with ``MALLOC_MMAP_THRESHOLD_=65536`` (every
  block of 64 KiB or more mapped on its own and returned when freed), so what glibc's default
  allocator keeps of its heap is not in it: that is modelled for the row itself
  (:func:`glibc_heap_margin`, the part ``glibc_heap``; ``process_bytes_pinned`` is the figure
  without it, for a process that called :func:`leanopt.pin_allocator`). It is cached as JSON under ``$LEANOPT_CACHE/process/`` (default
  ``~/.cache/leanopt/process/``; a probe takes ~10 s of 2 cores). An entry there that is damaged
  or implausible (:func:`read_cache_entry`) is a miss: measured again, one line on stderr says so.
* **CUDA**: the CUDA context (measured once per device name and torch version by
  :func:`measure_cuda_context` where a GPU is present, and cached; otherwise
  :data:`ASSUMED_CUDA_CONTEXT`, said so in the source), cuBLAS's workspace
  (:func:`cublas_workspace_bytes`) and a fragmentation margin of the caching allocator modelled
  from the block sizes live at the peak (:func:`cuda_segment_margin`).

The check: benchmarks/process_peak.py and tests/test_plan_process.py (CPU), the ``plan_check``
stage of scripts/gpu_check.sh (CUDA, ``max_memory_reserved`` plus the context).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from leanopt.memory.resident import GLIBC_MMAP_THRESHOLD_MAX, GLIBC_MMAP_THRESHOLD_START, status_kib

__all__ = ["OneTimeCost", "allocation_sequence", "cache_dir", "cpu_one_time", "cuda_one_time", "cuda_segment_margin", "glibc_heap_margin",
           "glibc_resident_peak", "memory_limit", "one_time_cost", "planned_peak", "read_cache_entry", "small_config"]

PROBE_VERSION = 2
MALLOC_MMAP_THRESHOLD = 65536  # the probe's (and the check's) glibc setting: every block of 64 KiB+ its own mmap
PROBE_TIMEOUT_S = 600.0
PROBE_BATCH, PROBE_SEQ = 4, 64
MiB = 2**20

# The CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp): requests of at most kSmallSize
# (1 MiB) come out of 2 MiB segments (kSmallBuffer), larger ones under kMinLargeAlloc (10 MiB) out
# of 20 MiB segments (kLargeBuffer), and the rest get segments rounded up to 2 MiB (kRoundLarge).
SMALL_SIZE, SMALL_BUFFER = 1 * MiB, 2 * MiB
MIN_LARGE_ALLOC, LARGE_BUFFER, ROUND_LARGE = 10 * MiB, 20 * MiB, 2 * MiB
# Used only where no GPU has measured it (planning on a CPU-only machine): the context of a
# CUDA 12 process with lazy module loading after its first kernels. An assumption, not a
# measurement of this machine: rows say so, and gpu_check's plan_check stage measures it.
ASSUMED_CUDA_CONTEXT = 512 * MiB

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OneTimeCost:
    """Bytes a process needs over its step's tensor peak, what they are made of, and whence."""

    bytes: int | None  # None: not known (the probe failed); ``source`` says why
    source: str
    parts: dict[str, int] = field(default_factory=dict)


def cache_dir() -> Path:
    """``$LEANOPT_CACHE`` if set, else ``~/.cache/leanopt``."""
    root = os.environ.get("LEANOPT_CACHE", "").strip()
    return Path(root).expanduser() if root else Path.home() / ".cache" / "leanopt"


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


def _probe_spec(module: torch.nn.Module, precision: str, optimizer: str, rounding: str | None) -> dict[str, Any]:
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise ValueError(f"{type(module).__name__} has no transformers config to build a small one from")
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    seq = PROBE_SEQ if not isinstance(positions, int) else min(PROBE_SEQ, positions)
    cls = type(module)
    return {"model": [cls.__module__, cls.__qualname__], "config": [type(config).__module__, type(config).__qualname__],
            "values": small_config(config), "precision": precision, "optimizer": optimizer, "rounding": rounding,
            "batch": PROBE_BATCH, "seq": seq}  # fmt: skip


def _key(spec: dict[str, Any]) -> dict[str, Any]:
    import transformers

    import leanopt

    return {"probe": PROBE_VERSION, "device": "cpu", "torch": torch.__version__, "transformers": transformers.__version__,
            "leanopt": leanopt.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "threads": torch.get_num_threads(), "precision": spec["precision"], "model": ".".join(spec["model"]),
            "optimizer": spec["optimizer"], "rounding": spec["rounding"]}  # fmt: skip


def _cache_file(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "process" / f"cpu-{digest}.json"


# ---- what the cache may hold ------------------------------------------------------------------------
# A cache file is data another process (or a person) wrote: an entry that is damaged or implausible
# (not JSON, another type, a missing field, a figure that is not a whole number of bytes between 0
# and this machine's memory, another probe version) is a miss, said in one line, never trusted and
# never fatal.
def memory_limit() -> int:
    """The most bytes a cached figure can be: this machine's physical memory (1 TiB where unknown)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):
        return 2**40


def _bytes_problem(value: Any, what: str, limit: int) -> str | None:
    if not isinstance(value, int) or isinstance(value, bool):
        return f"{what} is {type(value).__name__} {str(value)[:40]}, not a whole number of bytes"
    if not 0 <= value <= limit:
        return f"{what} {value:,} is outside 0..{limit:,} bytes"
    return None


def read_cache_entry(path: Path, problem: Callable[[Any], str | None], then: str) -> Any:
    """The JSON entry in ``path``, or None: no such file, or one that the JSON parser or
    ``problem(entry)`` (a reason, or None) refuses, which is said in one line on stderr (the
    ``leanopt.memory.process`` logger), ending with ``then``: what happens instead."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:
        reason: str | None = f"unreadable ({type(err).__name__})"
    else:
        try:
            entry = json.loads(text)
        except ValueError:
            reason = "not JSON"
        else:
            reason = problem(entry)
            if reason is None:
                return entry
    log.warning("leanopt: ignoring the process cache entry %s (%s): %s", path, reason, then)
    return None


def _one_time_problem(entry: Any, key: dict[str, Any]) -> str | None:
    """Why a cached one-time cost cannot be trusted, or None."""
    if not isinstance(entry, dict):
        return f"a JSON {type(entry).__name__}, not an object"
    if entry.get("key") != json.loads(json.dumps(key)):
        return "written for another probe version or setup"
    limit = memory_limit()
    problem = _bytes_problem(entry.get("bytes"), '"bytes"', limit)
    if problem is not None:
        return problem
    parts = entry.get("parts")
    if not isinstance(parts, dict):
        return '"parts" is not an object'
    for name, value in parts.items():
        problem = _bytes_problem(value, f'"parts" {name!r}', limit)
        if problem is not None:
            return problem
    if sum(parts.values()) != entry["bytes"]:
        return '"parts" do not add up to "bytes"'
    if not isinstance(entry.get("when"), str):
        return '"when" is not a date'
    return None


def cpu_one_time(module: torch.nn.Module, precision: str, optimizer: str = "adamw", rounding: str | None = None, *,
                 measure: bool = True) -> OneTimeCost:  # fmt: skip
    """The one-time costs of a first step of ``module``'s class at ``precision`` with ``optimizer``
    (a registry name; ``rounding``: its ``rounding=`` for pure bf16), from the cache or
    (``measure``) a probe now; ``bytes`` None where neither can answer, ``source`` says why."""
    try:
        spec = _probe_spec(module, precision, optimizer, rounding)
    except ValueError as err:
        return OneTimeCost(None, f"not measured: {err}")
    key = _key(spec)
    path = _cache_file(key)
    cached = read_cache_entry(path, lambda entry: _one_time_problem(entry, key), "measured again" if measure else "not used")
    if cached is not None:
        return OneTimeCost(cached["bytes"], f"measured {cached['when']}, cached in {path}", dict(cached["parts"]))
    if not measure:
        return OneTimeCost(None, f"not measured yet for {key['model']} {precision} {optimizer} (no {path})")
    try:
        result = probe(spec)
    except (RuntimeError, subprocess.TimeoutExpired, ValueError) as err:
        return OneTimeCost(None, f"not measured: the probe failed ({str(err).strip().splitlines()[-1][:200]})")
    entry = {"key": key, "when": time.strftime("%Y-%m-%d %H:%M"), **result}
    try:
        from leanopt.writing import write_text_atomically

        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(path, json.dumps(entry, indent=1) + "\n")
        where = f"cached in {path}"
    except OSError as err:
        where = f"not cached ({type(err).__name__})"
    return OneTimeCost(result["bytes"], f"measured now, {where}", result["parts"])


def one_time_cost(module: torch.nn.Module, precision: str, optimizer: str, rounding: str | None, *, device: str = "cpu",
                  sizes: list[int] | None = None, gpus: int = 1, heap: dict[str, Any] | str | None = "pinned") -> OneTimeCost:  # fmt: skip
    """What a plan row's process needs besides its step's tensors: on the CPU the one-time costs
    of a first step (:func:`cpu_one_time`, cached on disk after their first measurement); on CUDA
    the context, cuBLAS's workspace and the segment margin of ``sizes`` (the blocks live at the
    step's peak). ``heap``: ``"pinned"``, no heap margin (for a process that calls
    :func:`leanopt.pin_allocator`, which the source says); the row's batch, seq, checkpointing,
    grad_release and accum, for the margin glibc's default heap keeps (:func:`glibc_heap_margin`);
    None: not modelled for this row (offload), which the source says."""
    from leanopt.memory.resident import allocator

    if gpus > 1:
        return OneTimeCost(None, "not measured for FSDP2 ranks (--gpus > 1): the budget is compared with the step's peak")
    if device == "cuda":
        return cuda_one_time(sizes or [])
    cost = cpu_one_time(module, precision, optimizer, rounding)
    if cost.bytes is None:
        return cost
    if heap == "pinned":
        return OneTimeCost(cost.bytes, f"{cost.source}; for a process that calls leanopt.pin_allocator() (glibc's "
                           "defaults keep more: allocator='glibc', --allocator glibc)", dict(cost.parts))  # fmt: skip
    if not isinstance(heap, dict):
        return OneTimeCost(cost.bytes, f"{cost.source}; glibc's heap margin not modelled for offloaded rows (the figure "
                           "is for leanopt.pin_allocator())", dict(cost.parts))  # fmt: skip
    if allocator() == "other":
        return OneTimeCost(cost.bytes, f"{cost.source}; not glibc here: no heap margin modelled", dict(cost.parts))
    try:
        margin = glibc_heap_margin(module, precision=precision, optimizer=optimizer, rounding=rounding, **heap)
    except Exception as err:  # the row keeps its pinned figure, and the source says why
        from leanopt.memory.plan_model import one_line

        return OneTimeCost(cost.bytes, f"{cost.source}; glibc's heap margin not modelled ({one_line(err)}): the figure "
                           "is for leanopt.pin_allocator()", dict(cost.parts))  # fmt: skip
    parts = {**cost.parts, "glibc_heap": margin}
    return OneTimeCost(cost.bytes + margin, f"{cost.source}; glibc's default heap modelled (+{margin / 2**20:.0f} MiB; "
                       "process_bytes_pinned: with leanopt.pin_allocator())", parts)  # fmt: skip


def probe(spec: dict[str, Any]) -> dict[str, Any]:
    """Run the small step in a fresh process and subtract ``plan``'s peak of it: the one-time cost."""
    # A fixed mmap threshold: freed blocks go back to the system, so what is measured is the
    # one-time costs, not what glibc's default allocator would keep of this small model's heap.
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(PYTHONWARNINGS="ignore", MALLOC_MMAP_THRESHOLD_=str(MALLOC_MMAP_THRESHOLD))
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "leanopt.memory.process", "--probe", json.dumps(spec)], env=env,
                         capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False)  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip()[-400:] or f"exit {out.returncode}")
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    planned = planned_peak(spec)
    total = measured["peak"]
    build = max(0, measured["built"] - measured["param_bytes"])
    one_time = max(0, total - planned)
    return {"bytes": one_time, "parts": {"model_build": min(build, one_time), "first_steps": one_time - min(build, one_time)},
            "probe_peak": total, "probe_planned": planned, "probe_seconds": round(time.perf_counter() - t0, 1),
            "spec": spec}  # fmt: skip


def planned_peak(spec: dict[str, Any]) -> int:
    """What ``plan`` predicts for the probe's small step (no checkpointing, no release): the
    part of the probe's growth that is not one-time."""
    from leanopt.memory.plan_model import task_of
    from leanopt.memory.plan_step import Traces, combine

    model = _build(spec, meta=True)
    traces = Traces(model, type(model).__name__, task_of(model), batch=spec["batch"], seq=spec["seq"])
    step, _ = traces.step(spec["optimizer"], spec["rounding"], spec["precision"], release=False)
    return combine(traces.forward_backward(spec["precision"], False), step).bytes


def _build(spec: dict[str, Any], *, meta: bool = False) -> torch.nn.Module:
    import importlib

    mod, name = spec["model"]
    cmod, cname = spec["config"]
    config = getattr(importlib.import_module(cmod), cname).from_dict(spec["values"])
    cls = getattr(importlib.import_module(mod), name)
    if meta:
        with torch.device("meta"):
            return cls(config)
    return cls(config)


def _status_kib(field: str) -> int:
    """The probe runs on Linux only: a missing field is an error there."""
    value = status_kib(field)
    if value is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return value


def _probe_main(spec: dict[str, Any]) -> None:
    """In the fresh process: the small model's three steps, as a user's script runs them."""
    import transformers  # noqa: F401 - imported before the baseline, as a user's script does

    import leanopt  # noqa: F401
    from leanopt.memory.estimate import resolve_optimizer

    torch.manual_seed(0)
    before = _status_kib("VmRSS")
    model = _build(spec)
    built = _status_kib("VmRSS") - before
    param_bytes = sum(t.untyped_storage().nbytes() for t in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values())
    precision = spec["precision"]
    if precision == "bf16":
        model.to(torch.bfloat16)
    model.train()
    rounding = spec["rounding"]
    opt = resolve_optimizer(spec["optimizer"])(model.parameters(), **({"rounding": rounding} if rounding not in (None, "nearest") else {}))
    config: Any = model.config
    vocab = int(config.vocab_size)
    ids = torch.randint(0, vocab, (spec["batch"], spec["seq"]))
    classify = type(model).__name__.endswith("ForSequenceClassification")
    labels = torch.randint(0, int(getattr(config, "num_labels", 2) or 2), (spec["batch"],)) if classify else ids
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = _status_kib("VmHWM") - before
    print(json.dumps({"peak": peak * 1024, "built": built * 1024, "param_bytes": param_bytes}))


# ---- glibc's heap under its default settings -------------------------------------------------------
# A user who changes nothing runs with glibc's dynamic mmap threshold: it starts at 128 KiB and
# rises to the size of each mapped block freed (up to 32 MiB), so after the first frees almost
# every tensor comes from the heap. Freed heap chunks do not merge with their neighbours in
# practice (the small C++ objects allocated beside each storage -- TensorImpl, StorageImpl,
# autograd nodes -- sit between them in glibc's tcache and fast bins, which never coalesce), so a
# hole is reused only by a request that fits in it, and the heap's extent, resident once touched,
# grows past the live bytes. The model: the storages of the build and three steps, in the order
# a fake-tensor trace makes and frees them (:func:`allocation_sequence`), through a best-fit heap
# whose holes never coalesce, beside the mapped blocks (:func:`glibc_resident_peak`). Against
# fresh processes (docs/plan.md): the fp32 rows within -2.9 % and +2.4 % of the whole-process
# peak but tiny Adafactor's -9.3 %, checkpointed DistilBERT -5.1 %, full-size bf16-mixed
# AdamW8bit +11.8 % and +18.1 % (the sequence or the model misses something there).
GLIBC_ALIGNMENT = 64  # c10's CPU allocator: posix_memalign(64), one alignment's slack per chunk
GLIBC_MIN_CHUNK = 32
PAGE = 4096
HEAP_STEPS = 3  # the steps of the check's definition (the heap grows over the first ones)


def _chunk(nbytes: int) -> int:
    """The heap chunk of a ``posix_memalign(64, nbytes)``: the size word, 16-byte rounding, the slack."""
    return max(GLIBC_MIN_CHUNK, (nbytes + 8 + 15) & ~15) + GLIBC_ALIGNMENT


def glibc_resident_peak(events: list[tuple[Any, int]], threshold: int = GLIBC_MMAP_THRESHOLD_START) -> tuple[int, int]:
    """(resident peak, live peak) of ``events`` -- ``(key, bytes)`` for an allocation, ``(key, -1)``
    for its free, in order -- under glibc's dynamic mmap threshold (starting at ``threshold``):
    the heap's extent plus the mapped blocks at their highest, and the live bytes at theirs."""
    import bisect

    holes: list[tuple[int, int]] = []  # (size, address), best fit first
    heap: dict[int, int] = {}  # address -> chunk size, in use
    owner: dict[Any, tuple[bool, int, int]] = {}  # key -> (mapped, address or mapping size, bytes)
    top = mapped = live = peak = live_peak = 0
    for key, n in events:
        if n >= 0:
            if n == 0:
                continue
            live += n
            live_peak = max(live_peak, live)
            need = _chunk(n)
            i = bisect.bisect_left(holes, (need, -1))
            if i < len(holes):  # the smallest hole that fits, split
                size, at = holes.pop(i)
                if size - need >= GLIBC_MIN_CHUNK:
                    bisect.insort(holes, (size - need, at + need))
                else:
                    need = size
                heap[at] = need
                owner[key] = (False, at, n)
            elif need >= threshold:  # no room in the heap: its own mapping
                size = -(-(n + 16 + GLIBC_ALIGNMENT) // PAGE) * PAGE
                mapped += size
                owner[key] = (True, size, n)
            else:
                heap[top] = need
                owner[key] = (False, top, n)
                top += need
            peak = max(peak, top + mapped)
            continue
        entry = owner.pop(key, None)
        if entry is None:
            continue
        is_mapped, where, n = entry
        live -= n
        if is_mapped:
            mapped -= where
            if threshold < where <= GLIBC_MMAP_THRESHOLD_MAX:
                threshold = where  # glibc's dynamic threshold: the largest mapped block freed
            continue
        size = heap.pop(where)
        if where + size == top:
            top = where  # the chunk at the top goes back to the top (and, past the trim threshold, to the system)
        else:
            bisect.insort(holes, (size, where))
    return peak, live_peak


def allocation_sequence(module: torch.nn.Module, *, batch: int, seq: int, precision: str, optimizer: str,
                        rounding: str | None = None, checkpointing: bool = False, grad_release: bool = False,
                        accum: int = 1, steps: int = HEAP_STEPS) -> list[tuple[Any, int]]:  # fmt: skip
    """The storages a user's script allocates and frees, in order, traced on fake tensors: the
    model's weights as it is built, then ``steps`` steps of plan's loop (a new batch, forward and
    backward ``accum`` times, ``optimizer.step()`` -- the first makes the state --,
    ``zero_grad(set_to_none=True)``); ``(key, bytes)`` for an allocation, ``(key, -1)`` for a free."""
    from leanopt.memory import plan_model
    from leanopt.memory.plan_trace import LiveStorage, traced_batch, traced_forward_backward, traced_kernels, track_module

    class Sequence(LiveStorage):
        def __init__(self) -> None:
            super().__init__()
            self.events: list[tuple[Any, int]] = []

        def _allocated(self, key: Any, nbytes: int) -> None:
            self.events.append((key, nbytes))

        def _freed(self, key: Any) -> None:
            self.events.append((key, -1))

    fake_mode = plan_model.fake_mode()
    tracker = Sequence()
    task, vocab, labels_n = plan_model.task_of(module), plan_model.vocab_size(module), plan_model.num_labels(module)
    model, params = plan_model.fake_copy(module, fake_mode, plan_model.PARAM_DTYPE[precision])
    cls = plan_model.optimizer_factory(optimizer, rounding)
    mixed = precision == "bf16-mixed"
    with plan_model.checkpointing(model, checkpointing):
        model.train()
        with traced_kernels("cpu"), fake_mode, tracker:
            track_module(tracker, model)
            opt = cls(params)
            handle = None
            if grad_release:
                from leanopt.optim.release import release_gradients

                handle = release_gradients(model, opt)
            for _ in range(steps):
                for _ in range(accum):
                    input_ids, labels = traced_batch(tracker, task, vocab, labels_n, batch, seq)
                    loss = traced_forward_backward(tracker, model, input_ids, labels, params, mixed, type(model).__name__)
                    del loss, input_ids, labels
                tracker.phase = "step"
                if handle is None:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            if handle is not None:
                handle.remove()
            del opt
    return tracker.events


def glibc_heap_margin(module: torch.nn.Module, **row: Any) -> int:
    """What glibc's default allocator keeps resident over the live tensors at their peak, for
    the row ``row`` (:func:`allocation_sequence`'s keywords): the model's resident peak less its
    live peak, never below 0. Cached beside the probes (a trace of three steps takes seconds):
    keyed by the model's class and config, the row, and the torch, transformers and leanopt versions."""
    path = None
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        import transformers

        import leanopt

        cls = type(module)
        key = {"heap": PROBE_VERSION, "model": f"{cls.__module__}.{cls.__qualname__}", "config": config.to_dict(), "row": row,
               "torch": torch.__version__, "transformers": transformers.__version__, "leanopt": leanopt.__version__}  # fmt: skip
        text = json.dumps(key, sort_keys=True, default=str)
        path = cache_dir() / "process" / f"heap-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
        expected = json.loads(text)

        def problem(entry: Any) -> str | None:
            if not isinstance(entry, dict):
                return f"a JSON {type(entry).__name__}, not an object"
            if entry.get("key") != expected:
                return "written for another version or row"
            return _bytes_problem(entry.get("bytes"), '"bytes"', memory_limit())

        cached = read_cache_entry(path, problem, "traced again")
        if cached is not None:
            return int(cached["bytes"])
    peak, live = glibc_resident_peak(allocation_sequence(module, **row))
    margin = max(0, peak - live)
    if path is not None:
        try:
            from leanopt.writing import write_text_atomically

            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomically(path, json.dumps({"key": json.loads(text), "bytes": margin, "peak": peak, "live": live}) + "\n")
        except OSError:
            pass
    return margin


# ---- CUDA ------------------------------------------------------------------------------------------
def cublas_workspace_bytes(device_capability: tuple[int, int] | None = None) -> int:
    """cuBLAS's workspace, allocated through the caching allocator by the first matmul and kept:
    ``CUBLAS_WORKSPACE_CONFIG`` (":SIZE_KiB:COUNT" pairs) when set, else torch's default
    (aten/src/ATen/cuda/CublasHandlePool.cpp): ":4096:8" (32 MiB) on sm90 (H100/H200) and newer,
    ":4096:2:16:8" (8.125 MiB) before."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "").strip()
    if not config:
        config = ":4096:8" if device_capability is None or device_capability[0] >= 9 else ":4096:2:16:8"
    numbers = [int(x) for x in config.split(":") if x.strip().isdigit()]
    return sum(size * 1024 * count for size, count in zip(numbers[0::2], numbers[1::2]))


def cuda_segment_margin(sizes: list[int]) -> int:
    """Reserved minus allocated for the blocks ``sizes`` (bytes, as the allocator counts them) if
    they were packed into the fewest segments the caching allocator would make: a lower bound of
    its fragmentation, from the block sizes alone (the order of allocations is not modelled)."""
    small = sum(s for s in sizes if 0 < s <= SMALL_SIZE)
    mid = sum(s for s in sizes if SMALL_SIZE < s < MIN_LARGE_ALLOC)
    margin = math.ceil(small / SMALL_BUFFER) * SMALL_BUFFER - small
    margin += math.ceil(mid / LARGE_BUFFER) * LARGE_BUFFER - mid
    margin += sum(-(-s // ROUND_LARGE) * ROUND_LARGE - s for s in sizes if s >= MIN_LARGE_ALLOC)
    return margin


def _cuda_context_file() -> Path:
    return cache_dir() / "process" / "cuda-context.json"


def _context_table_problem(table: Any) -> str | None:
    """Why ``cuda-context.json`` cannot be trusted, or None: an object of device entries, each an
    object with a whole number of bytes no more than 1 TiB (more than any GPU holds)."""
    if not isinstance(table, dict):
        return f"a JSON {type(table).__name__}, not an object"
    for key, entry in table.items():
        if not isinstance(entry, dict):
            return f"entry {key!r} is not an object"
        problem = _bytes_problem(entry.get("bytes"), f"entry {key!r}'s \"bytes\"", 2**40)
        if problem is not None:
            return problem
        if not isinstance(entry.get("when", ""), str):
            return f"entry {key!r}'s \"when\" is not a date"
    return None


def _context_table(then: str) -> dict[str, Any]:
    table = read_cache_entry(_cuda_context_file(), _context_table_problem, then)
    return table if table is not None else {}


def cuda_context(name: str | None = None) -> tuple[int, str]:
    """(bytes, source) of the CUDA context: measured on ``name`` (a device name) and cached, or
    :data:`ASSUMED_CUDA_CONTEXT`."""
    table = _context_table(f"the CUDA context is assumed ({ASSUMED_CUDA_CONTEXT // MiB} MiB)")
    key = f"{name}|torch {torch.__version__}" if name else None
    if key is None and len(table) == 1:
        key = next(iter(table))
    if key is not None and key in table:
        return table[key]["bytes"], f"CUDA context measured on {key.split('|')[0]} {table[key].get('when', '')}".strip()
    return ASSUMED_CUDA_CONTEXT, f"CUDA context not measured here: assumed {ASSUMED_CUDA_CONTEXT // MiB} MiB"


def measure_cuda_context() -> int:
    """The context of this process's current GPU: what the driver reports in use less what torch's
    allocator has reserved, after a first kernel (the GPU should be this process's alone); cached
    for :func:`cuda_context`."""
    torch.zeros(1, device="cuda").add_(1)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    context = int(total - free - torch.cuda.memory_reserved())
    name = torch.cuda.get_device_name()
    path = _cuda_context_file()
    table = _context_table("replaced by this measurement")
    table[f"{name}|torch {torch.__version__}"] = {"bytes": context, "when": time.strftime("%Y-%m-%d %H:%M")}
    try:
        from leanopt.writing import write_text_atomically

        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(path, json.dumps(table, indent=1) + "\n")
    except OSError:
        pass
    return context


def cuda_one_time(sizes: list[int], device_name: str | None = None, capability: tuple[int, int] | None = None) -> OneTimeCost:
    """What a GPU process needs over ``max_memory_allocated``'s step peak: the context, cuBLAS's
    workspace and the segment margin of the blocks live at the peak (``sizes``); the device is
    this machine's GPU where there is one."""
    if device_name is None and torch.cuda.is_available():
        device_name, capability = torch.cuda.get_device_name(), torch.cuda.get_device_capability()
    context, source = cuda_context(device_name)
    parts = {"cuda_context": context, "cublas_workspace": cublas_workspace_bytes(capability),
             "allocator_margin": cuda_segment_margin(sizes)}  # fmt: skip
    return OneTimeCost(sum(parts.values()), f"{source}; cuBLAS workspace and allocator segments modelled", parts)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--probe":
        _probe_main(json.loads(sys.argv[2]))
    else:
        print("usage: python -m leanopt.memory.process --probe SPEC_JSON", file=sys.stderr)
        raise SystemExit(2)
