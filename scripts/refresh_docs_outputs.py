"""Regenerate the outputs of leanopt commands that README.md and docs/*.md show, by running them.

A shown output is a ``console`` block right after a marker that names its command::

    <!-- output: leanopt estimate 7b --optimizers adamw -->
    ```console
    $ leanopt estimate 7b --optimizers adamw
    (what the command prints, stdout and stderr, at COLUMNS=100)
    ```

Options go in parentheses before the colon, separated by ``;``:

- ``slow: WHY`` -- the command takes more than ~10 s (WHY says how long and why):
  tests/test_docs_outputs.py skips it and lists it; this script refreshes it all the same;
- ``after python`` -- the command runs in a folder where the document's python blocks above the
  marker ran first (for the files they write, e.g. README's ``optimizer.pt``).

Only commands whose output does not depend on the machine may be marked: timings and measured
process sizes (``leanopt plan`` without ``--no-process``) do not belong in a checked block.

    python scripts/refresh_docs_outputs.py            # rewrite every marked block
    python scripts/refresh_docs_outputs.py --check    # exit 1 and name the blocks that differ
    python scripts/refresh_docs_outputs.py --fast     # leave the slow blocks as they are
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WIDTH = 100  # the terminal the shown outputs are printed for
MARKER = re.compile(
    r"^<!-- output(?: \((?P<options>.*?)\))?: (?P<command>.+?) -->\n```console\n(?P<body>.*?)^```\n", re.M | re.S
)
PYTHON = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


@dataclass(frozen=True)
class Shown:
    """One marked block: where it is, its command, its options and what it shows now."""

    path: Path
    start: int  # offsets of the block's body in the file's text
    end: int
    command: str
    slow: str | None  # why it is too slow for the test, or None
    after_python: bool
    shown: str  # the body: "$ command\n" + the output

    @property
    def where(self) -> str:
        line = self.path.read_text()[: self.start].count("\n") + 1
        name = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{name}:{line}"


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def marked(path: Path) -> list[Shown]:
    """The marked blocks of ``path``; a marker whose block does not start with ``$ command`` is a
    ValueError naming it."""
    text = path.read_text()
    found = []
    for m in MARKER.finditer(text):
        options = [o.strip() for o in (m.group("options") or "").split(";") if o.strip()]
        slow = next((o.split(":", 1)[1].strip() for o in options if o.startswith("slow:")), None)
        unknown = [o for o in options if not o.startswith("slow:") and o != "after python"]
        command = m.group("command").strip()
        line = text[: m.start()].count("\n") + 1
        if unknown:
            raise ValueError(f"{path.name}:{line}: unknown marker option {unknown[0]!r} (slow: WHY; after python)")
        if not command.startswith("leanopt ") or not m.group("body").startswith(f"$ {command}\n"):
            raise ValueError(f"{path.name}:{line}: the block after the marker must start with '$ {command}'")
        found.append(Shown(path, m.start("body"), m.end("body"), command, slow, "after python" in options, m.group("body")))
    return found


def run(shown: Shown) -> str:
    """The block's body as the command prints it now: ``$ command``, then its output (stdout and
    stderr, as a terminal shows them), lines without trailing spaces."""
    with tempfile.TemporaryDirectory() as folder:
        if shown.after_python:
            text = shown.path.read_text()[: shown.start]
            Path(folder, "blocks.py").write_text("\n".join(m.group(1) for m in PYTHON.finditer(text)))
            subprocess.run([sys.executable, "blocks.py"], cwd=folder, check=True, capture_output=True)
        env = {**os.environ, "COLUMNS": str(WIDTH), "LINES": "50", "NO_COLOR": "1", "TERM": "dumb"}
        argv = [sys.executable, "-m", "leanopt", *shlex.split(shown.command)[1:]]
        done = subprocess.run(argv, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = [line.rstrip() for line in done.stdout.splitlines()]
    return "\n".join([f"$ {shown.command}", *lines]) + "\n"


def refresh(path: Path, *, fast: bool = False) -> list[str]:
    """Rewrite ``path``'s marked blocks with what their commands print; the blocks that changed."""
    text = path.read_text()
    changed = []
    for shown in reversed(marked(path)):  # from the end: earlier offsets stay valid
        if fast and shown.slow:
            continue
        body = run(shown)
        if body != shown.shown:
            changed.append(shown.where)
            text = text[: shown.start] + body + text[shown.end :]
    if changed:
        path.write_text(text)
    return changed[::-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block differs")
    parser.add_argument("--fast", action="store_true", help="skip the blocks marked slow")
    args = parser.parse_args(argv)
    differs = []
    for path in documents():
        if args.check:
            differs += [s.where for s in marked(path) if not (args.fast and s.slow) and run(s) != s.shown]
        else:
            for where in refresh(path, fast=args.fast):
                print(f"refreshed {where}")
    for where in differs:
        print(f"differs: {where}")
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
