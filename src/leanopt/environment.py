"""Environment variables leanopt reads (all of them: docs/environment.md).

One parser for the boolean ones, so ``LEANOPT_NO_NATIVE=false`` means what config tools and CI
templates mean by it: a fast path that any value but ``""`` and ``"0"`` switched off made
AdamW8bit's CPU step 5-7x slower without a word.
"""

from __future__ import annotations

import os

TRUE = ("1", "true", "yes", "on")
FALSE = ("", "0", "false", "no", "off")


def flag(name: str) -> bool:
    """The boolean environment variable ``name``: 1/true/yes/on or 0/false/no/off, in any case
    and with surrounding blanks; unset is False. Anything else is a ``ValueError`` naming the
    variable and its value (a typo must not pick a side silently)."""
    return bool(setting(name))


def setting(name: str) -> bool | None:
    """The boolean environment variable ``name`` as :func:`flag` reads it, or None where it is
    unset or blank: for a switch whose default is neither side (``LEANOPT_CPU_SPREAD``: chosen by
    measurement unless fixed)."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return None
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise ValueError(
        f"environment variable {name}={raw!r} is not a boolean: use {', '.join(TRUE[:-1])} or {TRUE[-1]} to turn "
        f"it on, {', '.join(FALSE[1:-1])} or {FALSE[-1]} (or unset it) to turn it off"
    )
