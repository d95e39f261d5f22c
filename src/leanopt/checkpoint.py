"""Which optimizer saved a state_dict, and conversion of a saved state to another member of its family.

Works on the ``optimizer.state_dict()`` alone (e.g. a Trainer's ``optimizer.pt`` opened with
``torch.load(weights_only=True)``), without the model: shapes come from the state tensors and
the quantized entries' own ``shape``. ``load_state_dict`` of leanopt's optimizers performs the
same conversions when a model is at hand; this module is for files.

**Identity is declared.** Every param group of a leanopt optimizer's ``state_dict`` holds
``"optimizer": <registry name>`` (:data:`leanopt.optim.REGISTRY`), and that name is what
:func:`state_dict_layout` returns, once each param's state is checked to hold that optimizer's
state keys and no other rule's. Only a file without it -- torch's ``AdamW``/``Adam``,
transformers' ``Adafactor``, a leanopt file saved before names were declared -- is recognized
from its state keys and group options (:func:`leanopt.optim.identity.recognize_states`, the
recognizer ``leanopt inspect`` uses), as the family they show and the member its quantized
entries' bits say (``adamw``, ``adamw8bit``, ``adamw4bit``; ``lion``...; ``adafactor``); states
of a rule leanopt does not run (torch's SGD or Adafactor) are refused. ``load_state_dict`` of
leanopt's optimizers reads a state_dict by the same rule.

**Conversion stays within a family** (the rule an optimizer runs: ``cls.family``): between
``adamw``, ``adamw8bit`` and ``adamw4bit``; ``lion``, ``lion8bit`` and ``lion4bit``;
``ademamix`` and ``ademamix8bit``. Each of the rule's states is quantized on the target
class's ``<state key>_code`` and block size, re-blocked, or dequantized to fp32. A state of
one rule cannot continue another (``lion8bit`` -> ``adamw`` is a ``ValueError`` naming both).

>>> import torch, leanopt
>>> from leanopt.checkpoint import convert_state_dict, state_dict_layout
>>> w = torch.nn.Parameter(torch.randn(128, 64))
>>> opt = leanopt.Lion8bit([w])
>>> w.grad = torch.randn_like(w); opt.step()
>>> state_dict_layout(opt.state_dict())
'lion8bit'
>>> sd4 = convert_state_dict(opt.state_dict(), to="lion4bit")
>>> state_dict_layout(sd4), sd4["state"][0]["exp_avg"]["format"]
('lion4bit', 'pow2-s4/b128')
>>> convert_state_dict(opt.state_dict(), to="adamw")
Traceback (most recent call last):
...
ValueError: cannot convert a lion8bit state_dict to adamw: Lion8bit runs the lion rule, AdamW the adamw rule (a state of one rule cannot continue another; convert within a family: lion, lion8bit, lion4bit)
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from leanopt.optim.identity import IDENTITY_KEY, declared_optimizer, recognize_states
from leanopt.optim.lowbit import STORAGE_OPTIONS, LowBit, check_block_size, check_min_quant_size
from leanopt.optim.registry import REGISTRY, optimizer_class
from leanopt.quant import QuantizedState, format_by_name

__all__ = ["IDENTITY_KEY", "convert_state_dict", "declared_optimizer", "family_members", "state_dict_layout"]

def family_members(name: str) -> list[str]:
    """The registry names (in registration order) of the optimizers that run the same rule as
    ``name``, itself included."""
    family = optimizer_class(name).family
    return [n for n, cls in REGISTRY.items() if cls.family == family]


def state_dict_layout(state_dict: Mapping[str, Any]) -> str:
    """The registry name of the optimizer whose ``state_dict`` this is.

    The name its param groups declare (checked to be registered, and each param's state to hold
    that optimizer's state keys and no other rule's); for a file without one, the member of the
    family its states show (:func:`leanopt.optim.identity.recognize_states`) that their bits
    say: ``"adamw"`` (fp32 moments: torch's AdamW/Adam, or an older leanopt AdamW),
    ``"adamw8bit"`` or ``"adamw4bit"`` (by the quantized entries' bits, or the groups'
    ``state_bits`` when every param kept fp32 states), ``"adafactor"`` (transformers'
    Adafactor), the Lion and AdEMAMix members likewise. ``ValueError`` for anything else (an unknown name, states that are not the
    declared optimizer's, undeclared states it does not recognize, a malformed dict).
    """
    _check_shape_of_sd(state_dict)
    declared = declared_optimizer(state_dict)
    if declared is None:
        return _recognized_member(state_dict)
    if declared not in REGISTRY:
        raise ValueError(
            f"the state_dict declares optimizer {declared!r}, which this leanopt does not know "
            f"(known: {', '.join(REGISTRY)})"
        )
    _check_states(state_dict, declared)
    return declared


def convert_state_dict(
    state_dict: Mapping[str, Any],
    to: str,
    *,
    block_size: int | None = None,
    min_quant_size: int = 4096,
) -> dict[str, Any]:
    """A copy of ``state_dict`` with its states in the layout of optimizer ``to``.

    ``to`` is any name of :data:`leanopt.optim.REGISTRY` in the family of the optimizer that
    saved ``state_dict`` (:func:`state_dict_layout`); another family is a ``ValueError`` naming
    both. For a low-bit target a param's states are quantized on the class's code for each
    state key when it has at least ``min_quant_size`` elements and its group does not say
    ``"quantize": False``, in blocks of ``block_size`` (default: the class's); for a dense
    target they are dequantized to fp32. Entries already in the target format are kept as they
    are; the input is not modified. Hyper-parameters (lr, betas, ...) and ``step`` are kept;
    each group declares ``to`` and gets the target's storage options. Each group is checked as
    the target's ``load_state_dict`` checks it (e.g. a state saved with amsgrad cannot become
    low-bit AdamW: ``ValueError``).
    """
    target_cls = optimizer_class(to)
    to = target_cls.name
    source = state_dict_layout(state_dict)  # validates the structure
    source_cls = REGISTRY[source]
    if source_cls.family != target_cls.family:
        raise ValueError(
            f"cannot convert a {source} state_dict to {to}: {source_cls.__name__} runs the {source_cls.family} rule, "
            f"{target_cls.__name__} the {target_cls.family} rule (a state of one rule cannot continue another; "
            f"convert within a family: {', '.join(family_members(source))})"
        )
    low_bit = issubclass(target_cls, LowBit)
    if low_bit:
        block_size = target_cls.default_block_size if block_size is None else block_size
        check_block_size(block_size)
        check_min_quant_size(min_quant_size)
    target, origin = _blank(target_cls), _blank(source_cls)

    groups_out = []
    group_of: dict[Any, tuple[dict[str, Any], list[str], list[str]]] = {}
    for gi, group in enumerate(state_dict["param_groups"]):
        g = {k: v for k, v in group.items() if k not in STORAGE_OPTIONS}
        if low_bit:
            g.update(quantize=group.get("quantize", True), block_size=block_size, min_quant_size=min_quant_size,
                     state_bits=target_cls.state_bits)  # fmt: skip
        g[IDENTITY_KEY] = to
        filled = {**target.defaults, **g}
        try:
            target.validate_group(filled, loaded=True)
        except ValueError as err:
            raise ValueError(f"cannot convert the {source} state_dict to {to}: param group {gi}: {err}") from None
        source_keys = _state_keys(origin, group)
        target_keys = _state_keys(target, filled)
        lost = [k for k in source_keys if k not in target_keys]
        if lost:
            raise ValueError(f"cannot convert the {source} state_dict to {to}: param group {gi} keeps {lost}, which {to} has no place for")
        groups_out.append(g)
        for pid in group["params"]:
            group_of[pid] = (filled, source_keys, target_keys)

    state_out: dict[Any, Any] = {}
    for pid, st in state_dict["state"].items():
        if pid not in group_of:  # not a param's state (e.g. a hook's own entry): kept as it is
            state_out[pid] = st
            continue
        filled, _, target_keys = group_of[pid]
        new = dict(st)
        for key, value in st.items():
            where = f"{key!r} of param {pid!r}"
            if key in target_keys and low_bit:
                shape = _shape_of(value, where)
                if target.quantizes(shape, filled):
                    new[key] = _to_quantized(value, target.state_format(key, filled), where)
                    continue
                new[key] = _to_dense(value, where)
            elif key in target_keys or _as_quantized(value, where) is not None:
                new[key] = _to_dense(value, where)
        state_out[pid] = new
    return {**state_dict, "state": state_out, "param_groups": groups_out}


# ---- helpers -----------------------------------------------------------------------------------
@functools.cache
def _blank(cls: type) -> Any:
    """An instance of ``cls`` on one empty meta param: its defaults, checks and layout methods."""
    return cls([torch.nn.Parameter(torch.empty(0, device="meta"))])


def _state_keys(opt: Any, group: Mapping[str, Any]) -> list[str]:
    """The rule's state keys (besides ``step``) for ``group``; [] for a non-elementwise optimizer."""
    state_keys = getattr(opt, "state_keys", None)
    return list(state_keys({**opt.defaults, **group})) if state_keys is not None else []


def _check_states(state_dict: Mapping[str, Any], name: str) -> None:
    """Each param group of a ``name`` state_dict holds options ``name`` runs with, and each
    param's state is a dict holding ``name``'s state keys and no key of another rule's state."""
    opt = _blank(REGISTRY[name])

    def refuse(problem: str) -> ValueError:
        seen = recognize_states(state_dict)
        other = "" if seen.family in (None, opt.family) else f"; its states are {seen.layout}'s (the {seen.family} rule)"
        return ValueError(problem + other)

    keys_of = {}
    for gi, g in enumerate(state_dict["param_groups"]):
        try:
            opt.validate_group({**opt.defaults, **g}, loaded=True)
        except ValueError as err:
            raise refuse(f"param group {gi} does not hold {name} options ({err})") from None
        keys_of.update({pid: _rule_keys(opt, g) for pid in g["params"]})
    for pid, st in state_dict["state"].items():
        if not isinstance(st, Mapping):
            raise ValueError(f"state of param {pid!r} is not a dict")
        required, allowed = keys_of.get(pid, ((), None))
        missing = [k for k in required if k not in st]
        extra = [] if allowed is None else [k for k in st if k not in allowed]
        if missing:
            raise refuse(f"state of param {pid!r} has keys {sorted(map(str, st))}, not a {name} state (missing {', '.join(map(repr, missing))})")
        if extra:
            verb = "is" if len(extra) == 1 else "are"
            raise refuse(f"state of param {pid!r} has keys {sorted(map(str, st))}, not a {name} state ({', '.join(map(repr, extra))} {verb} another rule's)")


def _rule_keys(opt: Any, group: Mapping[str, Any]) -> tuple[list[str], set[str]]:
    """The state keys every param of ``group`` holds, and all those one may hold: the layouts of
    a vector and of a matrix (Adafactor factors matrices), the rounding's compensation, and the
    peers' bookkeeping the optimizer drops on load."""
    group = {**opt.defaults, **group}
    layouts = [[spec.key for spec in opt.state_layout(shape, torch.float32, group)] for shape in ((4,), (4, 4))]
    required = [k for k in layouts[0] if k in layouts[1]]
    return required, {*layouts[0], *layouts[1], "kahan_comp", *opt.ignored_state_keys}


def _recognized_member(state_dict: Mapping[str, Any]) -> str:
    """The optimizer an undeclared state_dict's states show (see state_dict_layout)."""
    seen = recognize_states(state_dict)
    if seen.family is None:
        raise ValueError(
            f"the param groups declare no 'optimizer' and the states are {seen.layout}: not a state leanopt "
            "recognizes (only leanopt's own files say which optimizer saved them; a peer's is read from its "
            "state keys: torch's AdamW/Adam, transformers' Adafactor)"
        )
    bits: set[int] = set()
    for pid, st in state_dict["state"].items():
        if not isinstance(st, Mapping):
            raise ValueError(f"state of param {pid!r} is not a dict")
        for key, value in st.items():
            if isinstance(value, Mapping) and QuantizedState.is_state_dict(value):
                try:
                    bits.add(format_by_name(value["format"]).bits)
                except ValueError as err:
                    raise ValueError(f"{key!r} of param {pid!r}: corrupt quantized state ({err})") from None
            elif isinstance(value, QuantizedState):
                bits.add(value.format.bits)
    if not bits:
        bits = {g["state_bits"] for g in state_dict["param_groups"] if "state_bits" in g}
    if len(bits) > 1:
        raise ValueError(f"state_dict mixes {sorted(bits)}-bit states")
    b = next(iter(bits), None)
    members = [n for n, cls in REGISTRY.items() if cls.family == seen.family and getattr(cls, "state_bits", None) == b]
    if not members:
        raise ValueError(f"unsupported state bits {b} for the {seen.family} rule ({seen.layout})")
    _check_states(state_dict, members[0])
    return members[0]


def _check_shape_of_sd(state_dict: Any) -> None:
    if (
        not isinstance(state_dict, Mapping)
        or not isinstance(state_dict.get("state"), Mapping)
        or not isinstance(state_dict.get("param_groups"), (list, tuple))
        or not all(isinstance(g, Mapping) and isinstance(g.get("params"), (list, tuple)) for g in state_dict["param_groups"])
    ):
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


def _to_quantized(value: Any, fmt: Any, where: str) -> dict[str, Any]:
    q = _as_quantized(value, where)
    if q is not None and q.format == fmt:
        return q.to_state_dict()
    dense = _to_dense(value, where)
    return fmt.from_dense(dense.float()).to_state_dict()
