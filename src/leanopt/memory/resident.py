"""The process's resident set, as Linux reports it (``/proc/self/status``), and glibc's
``malloc`` settings that decide how much of it freed memory keeps: the one place the planner's
probes, ``leanopt doctor``, ``leanopt compare``'s meter and the benchmarks read and set them.
Elsewhere (not Linux, not glibc) every reading is None and every setting is refused (False).

Why the allocator matters (measured in docs/plan.md): with glibc's defaults the mmap threshold
starts at 128 KiB and rises to the size of each mapped block freed, up to 32 MiB, so after the
first step almost every activation comes from the heap, and freed heap blocks stay resident
between the live ones. :func:`pin_allocator` fixes the threshold at 64 KiB: every large block
is mapped on its own and returned when freed, and the resident set follows what is live.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

__all__ = ["allocator", "malloc_trim", "pin_allocator", "reset_peak", "set_malloc", "status_kib"]

# glibc's mallopt parameters (malloc.h) and the limits of its dynamic mmap threshold (malloc.c,
# 64-bit): DEFAULT_MMAP_THRESHOLD_MIN (the start) and DEFAULT_MMAP_THRESHOLD_MAX (the ceiling,
# also the most mallopt accepts: HEAP_MAX_SIZE / 2).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
GLIBC_MMAP_THRESHOLD_START = 128 * 1024
GLIBC_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024
PINNED_MMAP_THRESHOLD = 64 * 1024  # pin_allocator's: the setting process_bytes_pinned assumes

_fixed_threshold: int | None = None  # the mmap threshold this process last fixed through set_malloc


def status_kib(field: str) -> int | None:
    """A ``/proc/self/status`` field in KiB (``"VmRSS"``, ``"VmHWM"``, ``"RssAnon"``, ...), or None
    where there is no such file or field."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak() -> bool:
    """Reset the resident-set high-water mark (``VmHWM``) to the current resident set (writing 5
    to ``/proc/self/clear_refs``); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return status_kib("VmHWM") is not None


def _glibc() -> Any:
    """The C library if it is glibc (it has ``gnu_get_libc_version`` and ``mallopt``), else None."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def set_malloc(*, mmap_threshold: int | None = None, trim_threshold: int | None = None) -> bool:
    """``mallopt`` the given glibc settings (bytes); True if every one was taken. Setting the mmap
    threshold also turns off its dynamic growth for the rest of the process."""
    for name, value in (("mmap_threshold", mmap_threshold), ("trim_threshold", trim_threshold)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{name} must be a whole number of bytes >= 0, got {value!r}")
    if mmap_threshold is not None and mmap_threshold > GLIBC_MMAP_THRESHOLD_MAX:
        raise ValueError(f"mmap_threshold must be at most {GLIBC_MMAP_THRESHOLD_MAX} (glibc's ceiling), got {mmap_threshold}")
    libc = _glibc()
    if libc is None:
        return False
    global _fixed_threshold
    ok = True
    if mmap_threshold is not None:
        ok = libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1 and ok
        _fixed_threshold = mmap_threshold if ok else _fixed_threshold
    if trim_threshold is not None:
        ok = libc.mallopt(M_TRIM_THRESHOLD, min(trim_threshold, 2**31 - 1)) == 1 and ok
    return ok


def pin_allocator(mmap_threshold: int = PINNED_MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold (default 64 KiB, as ``MALLOC_MMAP_THRESHOLD_=65536``): every
    block of that size or more gets its own mapping and goes back to the system when freed, so the
    process's resident set follows its live tensors and ``leanopt plan``'s ``process_bytes_pinned``
    is what it needs. Call it first thing in a training script. The price: every large tensor is
    mapped and faulted in anew (steps up to 1.6x slower measured by ``leanopt compare``'s meter).
    Returns False where the C library is not glibc (nothing changed)."""
    if not isinstance(mmap_threshold, int) or isinstance(mmap_threshold, bool) or not 0 < mmap_threshold <= GLIBC_MMAP_THRESHOLD_MAX:
        raise ValueError(f"mmap_threshold must be a whole number of bytes in 1..{GLIBC_MMAP_THRESHOLD_MAX}, got {mmap_threshold!r}")
    return set_malloc(mmap_threshold=mmap_threshold)


def malloc_trim() -> bool:
    """Give free heap pages back to the system (glibc's ``malloc_trim(0)``); False elsewhere."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim(0)
    return True


def allocator() -> str:
    """This process's CPU allocator behaviour: ``"pinned"`` (the mmap threshold fixed at 64 KiB
    or less, by :func:`pin_allocator` or ``MALLOC_MMAP_THRESHOLD_``: ``process_bytes_pinned``
    applies), ``"glibc"`` (glibc's heap reused: its defaults, or a larger fixed threshold;
    ``process_bytes`` applies) or ``"other"`` (not glibc: its heap is not modelled)."""
    if _glibc() is None:
        return "other"
    threshold = _fixed_threshold
    if threshold is None:
        text = os.environ.get("MALLOC_MMAP_THRESHOLD_", "").strip()
        threshold = int(text) if text.isdigit() else None
    return "pinned" if threshold is not None and threshold <= PINNED_MMAP_THRESHOLD else "glibc"
