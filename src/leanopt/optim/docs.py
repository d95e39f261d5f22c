"""Docstring fragments every optimizer shares, written once (torch's ``_maximize_doc`` pattern).

A class docstring names the shared keywords it takes on one line, ``.. args:: rounding backend``,
in its ``Args:`` section; :func:`document` replaces that line with their entries, so that every
optimizer documents ``rounding``, ``backend``, ``state_dtype``, ``offload`` and the storage
keywords the same way.
"""

from __future__ import annotations

import re
import textwrap
from typing import TypeVar

__all__ = ["ARGS", "document"]

ARGS = {
    "rounding": "rounding: how the fp32 update is written into a bf16/fp16 param: ``\"nearest\"`` (default), "
    "``\"stochastic\"`` or ``\"kahan\"`` (a compensation buffer, 2 B/param for bf16); fp32/fp64 params ignore it. "
    "See :mod:`leanopt.optim.rounding`.",
    "foreach": "foreach, fused: torch's implementation choice, accepted so that torch's calls run: ``fused=True``/"
    "``foreach=True`` is leanopt's fast path (what ``\"auto\"`` picks anyway), ``foreach=False`` the "
    "``\"reference\"`` backend; see :func:`leanopt.optim.base.backend_for_torch_flags`.",
    "capturable": "capturable, differentiable: accepted as False; True is a ``ValueError`` (not supported).",
    "differentiable": "differentiable: accepted as False; True is a ``ValueError`` (not supported).",
    "backend": "backend: ``\"auto\"`` (Triton on CUDA, the fast CPU path on CPU; a rule without a Triton twin runs "
    "compiled on CUDA), ``\"reference\"`` (plain tensor maths, the oracle every fast path is tested against), "
    "``\"cpu\"``, ``\"triton\"`` or ``\"compiled\"`` (the rule compiled by Inductor, any device). How to compute, "
    "not what: not saved.",
    "state_dtype": "state_dtype: how dense states are stored: ``torch.float32`` (default) or ``torch.bfloat16`` (half "
    "the bytes, written with stochastic rounding; see :mod:`leanopt.quant.bf16`). Saved in each param group.",
    "offload": "offload: ``None`` (default: states with the params) or ``\"cpu\"``: the states (low-bit ones stay "
    "low-bit) and an fp32 master of each bf16/fp16 param in host memory, stepped there (:mod:`leanopt.optim.offload`). "
    "Where to compute, not what: not saved.",
    "block_size": "block_size: elements per fp32 scale of a quantized state (default 256 for 8-bit states, 128 for "
    "4-bit ones: the peers' choice). A group may set its own.",
    "min_quant_size": "min_quant_size: params with fewer elements keep dense states (default 4096). A group may set "
    "its own, and ``\"quantize\": False``.",
}

_LINE = re.compile(r"^(?P<indent>[ \t]*)\.\. args:: (?P<names>.+)$", re.MULTILINE)

_Class = TypeVar("_Class", bound=type)


def _entries(match: re.Match[str]) -> str:
    indent = match["indent"]
    return "\n".join(textwrap.fill(ARGS[name], width=100, initial_indent=indent, subsequent_indent=indent + "    ")
                     for name in match["names"].split())  # fmt: skip


def document(cls: _Class) -> _Class:
    """Class decorator: the ``.. args::`` line of ``cls``'s docstring replaced by the entries
    of the keywords it names (``KeyError`` for a name without one)."""
    if cls.__doc__:
        cls.__doc__ = _LINE.sub(_entries, cls.__doc__)
    return cls
