"""What one training run measures: peak memory, step times, the loss curve.

Peak memory is the growth of the training process's memory over a baseline taken after the
data is loaded and before the model is built, so it holds parameters, gradients, optimizer
state, activations and every temporary (the optimizer's own included), as the process saw them:

- CUDA: ``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()``, minus what
  was allocated at the baseline (the caching allocator's reserve is not counted).
- CPU (Linux): the peak of the process's *anonymous* resident memory. The kernel's
  resident-set high-water mark (``VmHWM``) is reset to the current RSS at the baseline
  (``/proc/self/clear_refs``); after training, the file-backed part of the RSS (``RssFile`` +
  ``RssShmem``: shared-library code paged in on first use, which is not training memory) is
  subtracted from it, and the anonymous RSS at the baseline (``RssAnon``) too. For the
  first ``CPU_MEMORY_STEPS`` training steps glibc's ``malloc`` serves every block of 64 KiB
  and more with its own ``mmap`` (a fixed threshold), so a freed tensor leaves the resident
  set at once and the peak tracks live memory rather than the allocator's free lists; the peak
  is read then (the state exists from the first step on, and every later step repeats the same
  allocations). The remaining steps, the timed ones, run with the allocator reusing freed
  blocks as a long-running process does (unmapping and faulting in every activation made
  steps up to 1.6x slower). Each optimizer runs in a fresh process (see ``runner``) after a
  warm-up forward, backward and step *of that optimizer* on a throwaway model
  (``Workload.warm_up``), so one-time set-up (thread pools, kernel caches, the modules
  ``torch.optim`` imports, an optimizer compiling its update) is in the baseline, and its
  time is reported apart as ``setup_s``.
- CPU elsewhere: ``ru_maxrss``, which cannot be reset (the method says so).

The resident-set peak is what the operating system sees, allocator and all, and it moves
between identical runs whose losses are bit-identical (the same 10-step bytes-gpt run here:
AdamW 29.4-31.4 MiB over five processes, bitsandbytes' AdamW8bit 28.4-32.2; ±11 % was
reported on a loaded machine). So on the CPU the peak of the *tensor* bytes alive is measured
too, over the same steps (:class:`TensorPeak`: every allocation and free the torch profiler
reports, summed in order): it counts the same things (weights, gradients, state, activations,
temporaries; peers' tensors included) without the allocator, and it repeats (AdamW 25.46 MiB
in every run, within 512 bytes). The report's peak is that one; the resident-set peak is
reported beside it.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from leanopt.memory.resident import (
    GLIBC_MMAP_THRESHOLD_MAX,
    PINNED_MMAP_THRESHOLD,
    malloc_trim,
    pin_allocator,
    reset_peak,
    set_malloc,
    status_kib,
)

MMAP_THRESHOLD = PINNED_MMAP_THRESHOLD
# glibc's own ceiling for its dynamic threshold (and twice it for trimming): the steady state
# a long-running process reaches, where freed blocks are reused instead of faulted in again.
REUSE_MMAP_THRESHOLD = GLIBC_MMAP_THRESHOLD_MAX
# CPU peaks are read after this many steps: the state exists from the first step, and every
# later step repeats the same allocations.
CPU_MEMORY_STEPS = 3


def use_mmap_for_large_blocks() -> bool:
    """Fix glibc's mmap threshold at 64 KiB (also turns off its dynamic growth): the memory steps'
    setting (:func:`leanopt.memory.resident.pin_allocator`). False where not glibc."""
    return pin_allocator(MMAP_THRESHOLD)


def reuse_freed_blocks() -> bool:
    """Back to fast allocation (blocks reused, not unmapped): for the timed steps."""
    return set_malloc(mmap_threshold=REUSE_MMAP_THRESHOLD, trim_threshold=2 * REUSE_MMAP_THRESHOLD)


@contextlib.contextmanager
def _no_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null: the profiler's native library writes a line to it on every
    start and stop, which is not the user's business."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class TensorPeak:
    """The peak growth of the CPU tensor bytes alive between :meth:`start` and :meth:`stop`,
    from the allocations and frees the torch profiler records (``profile_memory``)."""

    def __init__(self) -> None:
        self._profiler: Any = None

    def start(self) -> bool:
        """False where the profiler cannot run here (then :meth:`stop` returns None)."""
        try:
            from torch.profiler import ProfilerActivity, profile

            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            with _no_stderr():
                self._profiler.start()
        except Exception:  # an older torch, a profiler already running: no tensor peak
            self._profiler = None
            return False
        return True

    def stop(self) -> int | None:
        if self._profiler is None:
            return None
        profiler, self._profiler = self._profiler, None
        try:
            with _no_stderr():
                profiler.stop()
            from torch._C._autograd import DeviceType

            events = [e for e in profiler.profiler.kineto_results.events()
                      if e.name() == "[memory]" and e.device_type() == DeviceType.CPU]
        except Exception:
            return None
        live = peak = 0
        for event in sorted(events, key=lambda e: e.start_ns()):
            live += event.nbytes()
            peak = max(peak, live)
        return peak


class PeakMemory:
    """Peak memory growth of this process between :meth:`reset` and :meth:`peak`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.baseline = 0
        self.method = ""

    def reset(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
            self.method = "torch.cuda.max_memory_allocated() growth over the baseline"
            return
        malloc_trim()
        if reset_peak() and status_kib("RssAnon") is not None:
            self.baseline = (status_kib("RssAnon") or 0) * 1024
            self.method = (
                f"peak anonymous RSS growth over the first {CPU_MEMORY_STEPS} steps (VmHWM after a clear_refs "
                "reset, less file-backed RSS; fresh process, warmed up, 64 KiB mmap threshold)"
            )
        else:
            self.baseline = self._ru_maxrss()
            self.method = "ru_maxrss growth (not resettable here: a peak before the baseline hides later ones)"

    @staticmethod
    def _ru_maxrss() -> int:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024

    def peak(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        if "VmHWM" not in self.method:
            return max(self._ru_maxrss() - self.baseline, 0)
        hwm = status_kib("VmHWM") or 0
        shared = (status_kib("RssFile") or 0) + (status_kib("RssShmem") or 0)
        return max((hwm - shared) * 1024 - self.baseline, 0)


class Recorder:
    """Collects one run's per-step losses and timings and reports progress.

    ``watch(optimizer)`` times ``optimizer.step`` through the step hooks every
    ``torch.optim.Optimizer`` calls, so the same clock serves a plain loop, the HF Trainer and
    every peer. ``begin_step``/``end_step`` bracket a whole training step (forward, backward,
    step, schedule, zero_grad).
    """

    def __init__(self, device: torch.device, total_steps: int, emit: Callable[[dict[str, Any]], None]) -> None:
        self.device = device
        self.total_steps = total_steps
        self.emit = emit
        self.memory = PeakMemory(device)
        self.losses: list[float] = []
        self.optimizer_ms: list[float] = []
        self.train_ms: list[float] = []
        self._t_opt = 0.0
        self._t_step = 0.0
        self.peak_bytes: int | None = None
        self.tensor_peak = TensorPeak() if device.type == "cpu" else None
        self.peak_tensor_bytes: int | None = None
        # Bytes of the gradients alive between the first backward and its step (the workload
        # sets it; 0 under gradient release, which frees each gradient inside backward).
        self.grad_bytes: int | None = None
        # On the CPU the peak is read early, then the allocator switches to reusing blocks.
        self.memory_steps = CPU_MEMORY_STEPS if device.type == "cpu" else None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        def pre(opt: Any, args: Any, kwargs: Any) -> None:
            self._sync()
            self._t_opt = time.perf_counter()

        def post(opt: Any, args: Any, kwargs: Any) -> None:
            self._sync()
            self.optimizer_ms.append((time.perf_counter() - self._t_opt) * 1e3)

        optimizer.register_step_pre_hook(pre)
        optimizer.register_step_post_hook(post)

    def begin_step(self) -> None:
        self._sync()
        self._t_step = time.perf_counter()

    def end_step(self, loss: float) -> None:
        self._sync()
        self.train_ms.append((time.perf_counter() - self._t_step) * 1e3)
        self.losses.append(loss)
        if len(self.losses) == self.memory_steps:
            self._read_peaks()
            reuse_freed_blocks()
        self.emit({"event": "step", "step": len(self.losses), "total": self.total_steps, "loss": loss})

    @property
    def method(self) -> str:
        """How ``peak_bytes`` was measured (``peak_rss_bytes``: :attr:`PeakMemory.method`)."""
        if self.peak_tensor_bytes is None:
            return self.memory.method
        return (f"peak growth of the CPU tensor bytes alive over the first {CPU_MEMORY_STEPS} steps (every allocation "
                "and free the torch profiler records, summed in order; fresh process, warmed up); peak_rss_bytes: "
                + self.memory.method)

    def start_memory(self) -> None:
        """The baseline: from here on, memory is the run's (call before the model is built)."""
        self.memory.reset()
        if self.tensor_peak is not None:
            self.tensor_peak.start()

    def close(self) -> None:
        """Stop what measures memory, if a run ended before it was read (an exception)."""
        if self.tensor_peak is not None:
            self.tensor_peak.stop()

    def _read_peaks(self) -> None:
        self.peak_bytes = self.memory.peak()
        if self.tensor_peak is not None:
            self.peak_tensor_bytes = self.tensor_peak.stop()

    def end_training(self) -> None:
        if self.peak_bytes is None:
            self._read_peaks()
            if self.memory_steps is not None:  # a run shorter than the memory steps
                reuse_freed_blocks()

    def summary(self) -> dict[str, Any]:
        """Timings (mean after the warm-up steps, which include compilation), losses, peak."""
        skip = max(1, min(10, len(self.train_ms) // 10))

        def mean_after_warmup(xs: list[float]) -> float | None:
            tail = xs[skip:] or xs
            return statistics.fmean(tail) if tail else None

        def median_after_warmup(xs: list[float]) -> float | None:
            tail = xs[skip:] or xs
            return statistics.median(tail) if tail else None

        last = self.losses[-10:]
        finite = all(math.isfinite(x) for x in self.losses)
        return {
            # the peak the report shows: the tensor bytes on the CPU (they repeat), the CUDA
            # allocator's there; the resident-set peak beside it
            "peak_bytes": self.peak_tensor_bytes if self.peak_tensor_bytes is not None else self.peak_bytes,
            "peak_rss_bytes": self.peak_bytes if self.device.type == "cpu" else None,
            "grad_bytes": self.grad_bytes,
            "step_ms": mean_after_warmup(self.optimizer_ms),
            "step_ms_median": median_after_warmup(self.optimizer_ms),
            "train_step_ms": mean_after_warmup(self.train_ms),
            "first_step_ms": self.optimizer_ms[0] if self.optimizer_ms else None,
            # Every timed step, for medians and spreads pooled over a protocol's runs.
            "step_ms_timed": self.optimizer_ms[skip:] or self.optimizer_ms,
            "train_step_ms_timed": self.train_ms[skip:] or self.train_ms,
            "timed_after_step": skip,
            "initial_loss": self.losses[0] if self.losses else None,
            "final_loss": statistics.fmean(last) if last else None,
            "diverged": not finite,
            "loss_curve": self.losses,
        }
