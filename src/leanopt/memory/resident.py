"""The process's resident set, as Linux reports it (``/proc/self/status``): the one reader the
planner's probes, ``leanopt doctor`` and ``leanopt compare``'s meter share. Elsewhere every
reading is None and the peak cannot be reset."""

from __future__ import annotations


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
