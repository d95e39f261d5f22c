"""What the parsers of ``leanopt`` and ``leanopt compare`` share, importing no torch: a usage error
is one line, and a help text may name values of modules that do import torch, read only when the
help is printed (``%(leanopt.memory.plan:DEFAULT_OPTIMIZERS)s``), so that a mistake in the
arguments is answered before torch is imported.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any, NoReturn

__all__ = ["Parser", "UsageError", "whole_number"]


class UsageError(Exception):
    """A one-line error for the user."""


class _HelpValues(dict):  # type: ignore[type-arg]
    """A help string's ``%(name)s`` values: the action's own, and ``module:attribute`` (a sequence
    joined by ``,``, or by what follows a ``|``: ``%(leanopt.compare.tasks:BUILTIN_TASKS|, )s``)."""

    def __missing__(self, key: str) -> str:
        name, sep, joiner = key.partition("|")
        module, colon, attribute = name.partition(":")
        if not colon:
            raise KeyError(key)
        value = getattr(importlib.import_module(module), attribute)
        if isinstance(value, (list, tuple, dict)):
            return (joiner if sep else ",").join(map(str, value))
        return str(value)


class _HelpFormatter(argparse.HelpFormatter):
    def _expand_help(self, action: argparse.Action) -> str:
        params = {k: v for k, v in dict(vars(action), prog=self._prog).items() if v is not argparse.SUPPRESS}
        for name, value in params.items():
            if hasattr(value, "__name__"):
                params[name] = value.__name__
        if params.get("choices") is not None:
            params["choices"] = ", ".join(str(c) for c in params["choices"])
        return (self._get_help_string(action) or "") % _HelpValues(params)


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors raise :class:`UsageError` (one line, naming ``--help``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def whole_number(text: str) -> int:
    """An argument type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {value}")
    return value
