"""Convert a saved AdamW-family optimizer state_dict between fp32, 8-bit and 4-bit states.

Works on the ``optimizer.state_dict()`` alone (e.g. a Trainer's ``optimizer.pt`` opened with
``torch.load(weights_only=True)``), without the model: shapes come from the state tensors and
the quantized entries' own ``shape``. ``load_state_dict`` of leanopt's optimizers performs the
same conversions when a model is at hand; this module is for files.

>>> import torch, leanopt
>>> from leanopt.checkpoint import convert_state_dict, state_dict_layout
>>> w = torch.nn.Parameter(torch.randn(128, 64))
>>> opt = torch.optim.AdamW([w])
>>> w.grad = torch.randn_like(w); opt.step()
>>> sd8 = convert_state_dict(opt.state_dict(), to="adamw8bit")
>>> state_dict_layout(opt.state_dict()), state_dict_layout(sd8)
('adamw', 'adamw8bit')
>>> sorted(sd8["state"][0]["exp_avg"])
['absmax', 'codes', 'format', 'shape']
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from leanopt.optim.adamw_lowbit import STORAGE_OPTIONS, AdamW4bit, AdamW8bit, LowBitAdamW
from leanopt.quant import MAX_BLOCK_SIZE, BlockFormat, QuantizedState, format_by_name

LAYOUTS = ("adamw", "adamw8bit", "adamw4bit")
_LOW_BIT: dict[str, type[LowBitAdamW]] = {"adamw8bit": AdamW8bit, "adamw4bit": AdamW4bit}
_MOMENTS = ("exp_avg", "exp_avg_sq")


def state_dict_layout(state_dict: Mapping[str, Any]) -> str:
    """Which optimizer's layout ``state_dict`` has: ``"adamw"`` (fp32 moments: leanopt's or
    torch's AdamW), ``"adamw8bit"`` or ``"adamw4bit"``.

    Quantized entries decide; a low-bit state_dict whose params all kept fp32 states is told
    by its param groups' ``state_bits``. Raises ``ValueError`` for anything else (another
    optimizer's state, a malformed dict).
    """
    _check_shape_of_sd(state_dict)
    bits: set[int] = set()
    for pid, st in state_dict["state"].items():
        if not isinstance(st, Mapping):
            raise ValueError(f"state of param {pid!r} is not a dict")
        if not any(k in st for k in _MOMENTS):
            raise ValueError(
                f"state of param {pid!r} has keys {sorted(st)}, not an AdamW-family state "
                "(expected 'exp_avg' and 'exp_avg_sq')"
            )
        for key in _MOMENTS:
            value = st.get(key)
            if isinstance(value, Mapping) and QuantizedState.is_state_dict(value):
                try:
                    bits.add(format_by_name(value["format"]).bits)
                except ValueError as err:
                    raise ValueError(f"{key!r} of param {pid!r}: corrupt quantized state ({err})") from None
            elif isinstance(value, QuantizedState):
                bits.add(value.format.bits)
    if not bits:
        bits = {g["state_bits"] for g in state_dict["param_groups"] if "state_bits" in g}
    if not bits:
        return "adamw"
    if len(bits) > 1:
        raise ValueError(f"state_dict mixes {sorted(bits)}-bit states")
    (b,) = bits
    if b not in (4, 8):
        raise ValueError(f"unsupported state bits {b}")
    return f"adamw{b}bit"


def convert_state_dict(
    state_dict: Mapping[str, Any],
    to: str,
    *,
    block_size: int | None = None,
    min_quant_size: int = 4096,
) -> dict[str, Any]:
    """A copy of ``state_dict`` with its moments in the layout of ``to``.

    ``to`` is ``"adamw"`` (fp32 moments, loadable by ``leanopt.AdamW`` and
    ``torch.optim.AdamW``), ``"adamw8bit"`` or ``"adamw4bit"``. For the low-bit layouts a
    param's moments are quantized when it has at least ``min_quant_size`` elements and its
    group does not say ``"quantize": False``; ``block_size`` defaults to the class's (256 for
    8-bit, 128 for 4-bit). Entries already in the target format are kept as they are; the
    input is not modified. A state saved with amsgrad cannot become low-bit (``ValueError``).
    Hyper-parameters (lr, betas, ...) and ``step`` are kept.
    """
    if to not in LAYOUTS:
        raise ValueError(f"to must be one of {LAYOUTS}, got {to!r}")
    source = state_dict_layout(state_dict)  # validates the structure
    target_cls = _LOW_BIT.get(to)
    if target_cls is not None:
        block_size = target_cls.default_block_size if block_size is None else block_size
        if not isinstance(block_size, int) or isinstance(block_size, bool) or not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"Invalid block_size: {block_size!r} (must be an int from 1 to {MAX_BLOCK_SIZE})")
        if not isinstance(min_quant_size, int) or isinstance(min_quant_size, bool) or min_quant_size < 0:
            raise ValueError(f"Invalid min_quant_size: {min_quant_size!r}")

    groups_out = []
    quantize_of: dict[Any, bool] = {}
    for group in state_dict["param_groups"]:
        g = {k: v for k, v in group.items() if k not in STORAGE_OPTIONS}
        if target_cls is not None:
            if group.get("amsgrad", False):
                raise ValueError(f"cannot convert an amsgrad state_dict ({source}) to {to}: low-bit AdamW has no amsgrad")
            flag = bool(group.get("quantize", True))
            g.update(quantize=flag, block_size=block_size, min_quant_size=min_quant_size, state_bits=target_cls.state_bits)
            for pid in group["params"]:
                quantize_of[pid] = flag
        groups_out.append(g)

    state_out: dict[Any, dict[str, Any]] = {}
    for pid, st in state_dict["state"].items():
        new = dict(st)
        if target_cls is not None and "max_exp_avg_sq" in st:
            raise ValueError(f"cannot convert param {pid!r}: it has 'max_exp_avg_sq' (amsgrad) and {to} has no amsgrad")
        for key in _MOMENTS:
            if key not in st:
                continue
            where = f"{key!r} of param {pid!r}"
            if target_cls is None:
                new[key] = _to_dense(st[key], where)
                continue
            shape = _shape_of(st[key], where)
            if quantize_of.get(pid, True) and math.prod(shape) >= min_quant_size:
                code = target_cls.exp_avg_code if key == "exp_avg" else target_cls.exp_avg_sq_code
                new[key] = _to_quantized(st[key], BlockFormat(code, block_size), where)
            else:
                new[key] = _to_dense(st[key], where)
        state_out[pid] = new
    return {**state_dict, "state": state_out, "param_groups": groups_out}


# ---- helpers -----------------------------------------------------------------------------------
def _check_shape_of_sd(state_dict: Any) -> None:
    if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("expected an optimizer state_dict (a dict with 'state' and 'param_groups')")


def _as_quantized(value: Any, where: str) -> QuantizedState | None:
    if isinstance(value, QuantizedState):
        return value
    if isinstance(value, Mapping) and QuantizedState.is_state_dict(value):
        try:
            return QuantizedState.from_state_dict(value)
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{where}: corrupt quantized state ({err})") from None
    return None


def _shape_of(value: Any, where: str) -> tuple[int, ...]:
    q = _as_quantized(value, where)
    if q is not None:
        return q.shape
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    raise ValueError(f"{where} is a {type(value).__name__}, expected a tensor or a quantized state")


def _to_dense(value: Any, where: str) -> torch.Tensor:
    q = _as_quantized(value, where)
    if q is not None:
        return q.dequantize()
    if isinstance(value, torch.Tensor):
        return value
    raise ValueError(f"{where} is a {type(value).__name__}, expected a tensor or a quantized state")


def _to_quantized(value: Any, fmt: BlockFormat, where: str) -> dict[str, Any]:
    q = _as_quantized(value, where)
    if q is not None and q.format == fmt:
        return q.to_state_dict()
    dense = _to_dense(value, where)
    return fmt.from_dense(dense.float()).to_state_dict()
