"""A small real filesystem to fill: a tmpfs mounted for one test (root, and mount permitted),
else the test is skipped with the reason. Full-disk tests need the real failure: torch's zip
writer, matplotlib and json each report it their own way."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def mounted(folder: Path, size: str = "64k") -> Iterator[Path]:
    """``folder`` (created) as a tmpfs of ``size`` bytes until the block ends."""
    folder.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("no mount command here")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (unprivileged?): {proc.stderr.strip() or proc.returncode}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=False)


def fill(folder: Path) -> None:
    """Write into ``folder`` until its filesystem has no byte left."""
    with open(folder / "filler", "wb", buffering=0) as f:  # unbuffered: nothing left to flush at close
        for chunk in (65536, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * chunk)
