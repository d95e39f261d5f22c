"""What a training process needs besides its step's tensors: ``process_bytes``.

``plan``'s ``peak_bytes`` is the peak of one steady-state step's tensors. A user's process needs
more, and sees more (its resident set, or on a GPU what the driver hands out):

* **CPU**: the one-time costs of the first steps -- the model's modules imported while it is
  built, the thread pools started and the library pages touched by the first forward, backward
  and optimizer step (oneDNN, MKL, the native kernel loaded). They are measured, not modelled:
  once per (torch, transformers and leanopt versions, Python, machine, thread count, model
  class, precision -- the dtype set -- and optimizer) the probe (:mod:`leanopt.memory.probe`)
  measures, as a fresh process that has imported torch, transformers and leanopt sees it, the
  resident-set growth while a small model of the same class (two layers, 128 wide) is built and
  trained three steps with that optimizer; the one-time cost is that growth less what ``plan``
  predicts for the same small step. Every setup of a plan that is not cached is measured by one
  probe process (:func:`cpu_one_times`). The probe runs with ``MALLOC_MMAP_THRESHOLD_=65536``
  (every block of 64 KiB or more mapped on its own and returned when freed), so what glibc's
  default allocator keeps of its heap is not in it: that is modelled for the row itself
  (:func:`glibc_heap_margin`, the part ``glibc_heap``; ``process_bytes_pinned`` is the figure
  without it, for a process that called :func:`leanopt.pin_allocator`). It is cached as JSON
  under ``$LEANOPT_CACHE/process/`` (default ``~/.cache/leanopt/process/``). An entry there that
  is damaged or implausible (:func:`read_cache_entry`) is a miss: measured again, one line on
  stderr says so. The measuring is said on the ``leanopt.memory.process`` logger (INFO: what is
  measured, each setup as it is done; ``leanopt plan`` shows it on stderr).
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
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from leanopt.memory.resident import GLIBC_MMAP_THRESHOLD_MAX, GLIBC_MMAP_THRESHOLD_START

__all__ = ["OneTimeCost", "allocation_sequence", "cache_dir", "cpu_one_time", "OneTimeCosts", "cpu_one_times", "cuda_one_time", "cuda_segment_margin",
           "glibc_heap_margin", "glibc_resident_peak", "memory_limit", "one_time_cost", "read_cache_entry"]

PROBE_VERSION = 2  # what a cached one-time cost was measured by (leanopt.memory.probe); part of its key
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


Setting = tuple[str, str, "str | None"]  # (precision, optimizer, rounding): what a one-time cost is measured for


def cpu_one_time(module: torch.nn.Module, precision: str, optimizer: str = "adamw", rounding: str | None = None, *,
                 measure: bool = True) -> OneTimeCost:  # fmt: skip
    """The one-time costs of a first step of ``module``'s class at ``precision`` with ``optimizer``
    (a registry name; ``rounding``: its ``rounding=`` for pure bf16), from the cache or
    (``measure``) a probe now; ``bytes`` None where neither can answer, ``source`` says why."""
    return cpu_one_times(module, [(precision, optimizer, rounding)], measure=measure)[precision, optimizer, rounding]


def cpu_one_times(module: torch.nn.Module, settings: Sequence[Setting], *, measure: bool = True) -> dict[Setting, OneTimeCost]:
    """:func:`cpu_one_time` of each (precision, optimizer, rounding) in ``settings``: the cached
    ones read, the others (``measure``) measured by one probe process."""
    return OneTimeCosts(module, settings, measure=measure).result()


class OneTimeCosts:
    """The CPU's one-time costs of ``settings`` for ``module``'s class: the cached ones read at once,
    the others (``measure``) measured by one probe process (:func:`leanopt.memory.probe.measure`)
    that runs while the caller goes on (``plan`` traces meanwhile); :meth:`result` waits for it and
    caches what it measured. What is measured is said on this module's logger (INFO), each
    setting as it is done, from :meth:`result` on (said before, it would stand in front of the
    one-line error of a plan that fails meanwhile)."""

    def __init__(self, module: torch.nn.Module, settings: Sequence[Setting], *, measure: bool = True) -> None:
        from leanopt.memory import probe

        self.known: dict[Setting, OneTimeCost] = {}
        self._todo: list[tuple[Setting, dict[str, Any]]] = []
        self._measured: list[dict[str, Any] | str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._held: list[tuple[Any, ...]] | None = []  # what is said, held until result()
        self._lock = threading.Lock()
        try:
            specs = {s: probe.probe_spec(module, *s) for s in dict.fromkeys(settings)}
        except ValueError as err:
            self.known = {s: OneTimeCost(None, f"not measured: {err}") for s in settings}
            return
        for setting, spec in specs.items():
            key = _key(spec)
            path = _cache_file(key)
            cached = read_cache_entry(path, lambda entry: _one_time_problem(entry, key), "measured again" if measure else "not used")
            if cached is not None:
                self.known[setting] = OneTimeCost(cached["bytes"], f"measured {cached['when']}, cached in {path}", dict(cached["parts"]))
            elif not measure:
                self.known[setting] = OneTimeCost(None, f"not measured yet for {key['model']} {' '.join(filter(None, setting))} (no {path})")
            else:
                self._todo.append((setting, spec))
        if self._todo:
            self._say("leanopt: measuring the one-time costs of a first step (imports, thread pools, kernels) of %d setup%s of %s "
                      "in one probe process, on a small model of the same class; once: cached in %s", len(self._todo),
                      "s" if len(self._todo) > 1 else "", type(module).__name__, cache_dir() / "process")  # fmt: skip
            self._t0 = time.perf_counter()
            self._thread = threading.Thread(target=self._measure, name="leanopt-probe", daemon=True)
            self._thread.start()

    @classmethod
    def of(cls, known: dict[Setting, OneTimeCost]) -> OneTimeCosts:
        """Costs already known: nothing to measure."""
        out = cls.__new__(cls)
        out.known, out._todo, out._measured, out._stop, out._thread = dict(known), [], [], threading.Event(), None
        out._held, out._lock = None, threading.Lock()
        return out

    def _say(self, *args: Any) -> None:
        with self._lock:
            if self._held is not None:
                self._held.append(args)
                return
        log.info(*args)

    def _measure(self) -> None:
        from leanopt.memory import probe

        done = [0]

        def report(index: int, result: dict[str, Any] | str) -> None:
            done[0] += 1
            said = f"{result['seconds']:.0f} s" if isinstance(result, dict) else f"failed: {result}"
            if not self._stop.is_set():
                self._say("leanopt:   %d/%d %s (%s)", done[0], len(self._todo), " ".join(filter(None, self._todo[index][0])), said)

        self._measured = probe.measure([spec for _, spec in self._todo], report, stop=self._stop)

    def cancel(self) -> None:
        """Stop the probe (the caller failed): nothing more is measured or cached."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread, self._todo = None, []

    def result(self) -> dict[Setting, OneTimeCost]:
        """Every setting's cost, once the probe (if any) is done; what it measured is cached."""
        if self._thread is None:
            return dict(self.known)
        from leanopt.memory import probe

        with self._lock:
            held, self._held = self._held or [], None
        for args in held:
            log.info(*args)
        self._thread.join()
        self._thread = None
        ok = [i for i, m in enumerate(self._measured) if isinstance(m, dict)]
        planned = dict(zip(ok, probe.planned_peaks([self._todo[i][1] for i in ok])))
        when = time.strftime("%Y-%m-%d %H:%M")
        for i, ((setting, spec), m) in enumerate(zip(self._todo, self._measured)):
            if not isinstance(m, dict):
                self.known[setting] = OneTimeCost(None, f"not measured: the probe failed ({m})")
                continue
            build = max(0, m["built"] - m["param_bytes"])
            one_time = max(0, m["peak"] - planned[i])
            parts = {"model_build": min(build, one_time), "first_steps": one_time - min(build, one_time)}
            key = _key(spec)
            entry = {"key": key, "when": when, "bytes": one_time, "parts": parts, "probe_peak": m["peak"],
                     "probe_planned": planned[i], "probe_seconds": m["seconds"], "spec": spec}  # fmt: skip
            self.known[setting] = OneTimeCost(one_time, f"measured now, {_write_entry(_cache_file(key), entry)}", parts)
        self._say("leanopt: measured in %.0f s", time.perf_counter() - self._t0)
        self._todo = []
        return dict(self.known)


def _write_entry(path: Path, entry: dict[str, Any]) -> str:
    try:
        from leanopt.writing import write_text_atomically

        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(path, json.dumps(entry, indent=1) + "\n")
    except OSError as err:
        return f"not cached ({type(err).__name__})"
    return f"cached in {path}"


def one_time_cost(module: torch.nn.Module, precision: str, optimizer: str, rounding: str | None, *, device: str = "cpu",
                  sizes: list[int] | None = None, gpus: int = 1, heap: dict[str, Any] | str | None = "pinned",
                  measured: dict[Setting, OneTimeCost] | None = None) -> OneTimeCost:  # fmt: skip
    """What a plan row's process needs besides its step's tensors: on the CPU the one-time costs
    of a first step (:func:`cpu_one_time`, cached on disk after their first measurement); on CUDA
    the context, cuBLAS's workspace and the segment margin of ``sizes`` (the blocks live at the
    step's peak). ``heap``: ``"pinned"``, no heap margin (for a process that calls
    :func:`leanopt.pin_allocator`, which the source says); the row's batch, seq, checkpointing,
    grad_release and accum, for the margin glibc's default heap keeps (:func:`glibc_heap_margin`);
    None: not modelled for this row (offload), which the source says. ``measured``: the CPU's
    one-time costs already read or measured for the plan (:func:`cpu_one_times`), by setting."""
    from leanopt.memory.resident import allocator

    if gpus > 1:
        return OneTimeCost(None, "not measured for FSDP2 ranks (--gpus > 1): the budget is compared with the step's peak")
    if device == "cuda":
        return cuda_one_time(sizes or [])
    setting = (precision, optimizer, rounding)
    cost = measured[setting] if measured is not None and setting in measured else cpu_one_time(module, *setting)
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
    from leanopt.memory.plan_trace import LiveStorage, built_over, traced_batch, traced_forward_backward, traced_kernels, track_module

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
    # The optimizer's groups of the model (Muon's), as the planned step builds it.
    options = [o for _, _, o in plan_model.param_keys(module, optimizer, plan_model.PARAM_DTYPE[precision])]
    mixed = precision == "bf16-mixed"
    with plan_model.checkpointing(model, checkpointing):
        model.train()
        with traced_kernels("cpu"), fake_mode, tracker:
            track_module(tracker, model)
            opt = cls(built_over(params, options))
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
