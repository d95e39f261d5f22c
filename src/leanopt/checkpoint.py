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

**The peers' files** -- bitsandbytes' (``AdamW8bit``, ``Lion8bit``, ``AdEMAMix8bit`` and their
32-bit and paged forms, a Trainer ``optimizer.pt`` of ``optim="adamw_bnb_8bit"``) and torchao's
(``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8``) -- are read in their own format (:func:`from_peer`):
each state is dequantized with the code book and block scales the file holds (the exact values
the peer would compute with), then converted like a leanopt state of the family they run, as
the member their bits say (``adamw8bit`` for bitsandbytes' 8-bit AdamW). bitsandbytes'
one-state files do not say which rule saved them (Lion8bit and SGD8bit with momentum save the
same keys and options): ``rule="lion"`` says it.

**Leaving leanopt**: ``to="torch-adamw"`` writes what ``torch.optim.AdamW(...).state_dict()``
holds, from any AdamW-family state (fp32, 8-bit, 4-bit, bf16 rounding; leanopt's or a peer's):
:func:`convert_checkpoint` lists what that leaves out (a Kahan compensation, the rounding).

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
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from leanopt.optim.base import LeanOptimizer
from leanopt.optim.identity import BNB_KEY, IDENTITY_KEY, TORCHAO_STATES, Recognized, declared_optimizer, recognize_states, tensor_subclass
from leanopt.optim.lowbit import STORAGE_OPTIONS, LowBit, check_block_size, check_min_quant_size
from leanopt.optim.registry import REGISTRY, optimizer_class
from leanopt.optim.sharding import is_dtensor
from leanopt.quant import QuantizedState, format_by_name
from leanopt.quant.bf16 import check_state_dtype, state_dtype_name

__all__ = ["IDENTITY_KEY", "TORCH_ADAMW", "Conversion", "convert_checkpoint", "convert_state_dict", "declared_optimizer",
           "family_members", "from_peer", "state_dict_layout"]  # fmt: skip

# The target name of torch.optim.AdamW (as `leanopt estimate` names torch's optimizers).
TORCH_ADAMW = "torch-adamw"

def family_members(name: str) -> list[str]:
    """The registry names (in registration order) of the optimizers that run the same rule as
    ``name``, itself included."""
    family = optimizer_class(name).family
    return [n for n, cls in REGISTRY.items() if cls.family == family]


def state_dict_layout(state_dict: Mapping[str, Any], *, rule: str | None = None) -> str:
    """The registry name of the optimizer whose ``state_dict`` this is.

    The name its param groups declare (checked to be registered, and each param's state to hold
    that optimizer's state keys and no other rule's); for a file without one, the member of the
    family its states show (:func:`leanopt.optim.identity.recognize_states`) that their bits
    say: ``"adamw"`` (fp32 moments: torch's AdamW/Adam, or an older leanopt AdamW),
    ``"adamw8bit"`` or ``"adamw4bit"`` (by the quantized entries' bits, or the groups'
    ``state_bits`` when every param kept fp32 states), ``"adafactor"`` (transformers'
    Adafactor), the Lion and AdEMAMix members likewise; a peer's file as the member it converts
    as (:func:`from_peer`: bitsandbytes' 8-bit AdamW is ``"adamw8bit"``; ``rule`` names the rule
    of a bitsandbytes one-state file). ``ValueError`` for anything else (an unknown name, states
    that are not the declared optimizer's, undeclared states it does not recognize, a malformed
    dict).
    """
    _check_shape_of_sd(state_dict)
    declared = declared_optimizer(state_dict)
    if declared is None:
        seen = recognize_states(state_dict)
        if seen.peer is not None:
            return state_dict_layout(from_peer(state_dict, rule=rule))
        return _recognized_member(state_dict)
    if declared not in REGISTRY:
        raise ValueError(
            f"the state_dict declares optimizer {declared!r}, which this leanopt does not know "
            f"(known: {', '.join(REGISTRY)})"
        )
    _check_states(state_dict, declared)
    return declared


@dataclass
class Conversion:
    """What :func:`convert_checkpoint` made of a state_dict.

    ``state_dict``: the converted one; ``source``: the registry name the input was converted as
    (:func:`state_dict_layout`); ``read_as``: what the input was (``"bitsandbytes 8-bit
    (Adam-family, 2 states)"``, or ``source`` for leanopt's and torch's files); ``target``: the
    optimizer it is for (a registry name or ``"torch-adamw"``); ``notes``: what the target has
    no place for and was left out, one sentence each.
    """

    state_dict: dict[str, Any]
    source: str
    read_as: str
    target: str
    notes: list[str] = field(default_factory=list)


def convert_state_dict(
    state_dict: Mapping[str, Any],
    to: str,
    *,
    block_size: int | None = None,
    min_quant_size: int = 4096,
    rule: str | None = None,
    state_dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """A copy of ``state_dict`` with its states in the layout of optimizer ``to``
    (:func:`convert_checkpoint`'s ``state_dict``)."""
    return convert_checkpoint(state_dict, to, block_size=block_size, min_quant_size=min_quant_size, rule=rule,
                              state_dtype=state_dtype).state_dict  # fmt: skip


def convert_checkpoint(
    state_dict: Mapping[str, Any],
    to: str,
    *,
    block_size: int | None = None,
    min_quant_size: int = 4096,
    rule: str | None = None,
    state_dtype: torch.dtype = torch.float32,
) -> Conversion:
    """``state_dict`` with its states in the layout of optimizer ``to``, and what that left out.

    ``to`` is any name of :data:`leanopt.optim.REGISTRY` in the family of the optimizer that
    saved ``state_dict`` (:func:`state_dict_layout`), or ``"torch-adamw"`` (:data:`TORCH_ADAMW`)
    for an AdamW-family state; another family is a ``ValueError`` naming both. A peer's
    state_dict (bitsandbytes', torchao's) is first read as its family's
    (:func:`from_peer`; ``rule``: see there; for any other file, ``rule`` must be the family its
    states run). For a low-bit target a param's states are quantized on the class's code for
    each state key when it has at least ``min_quant_size`` elements and its group does not say
    ``"quantize": False``, in blocks of ``block_size`` (default: the class's); for a dense
    target they are dequantized to fp32. Entries already in the target format are kept as they
    are; the input is not modified. Hyper-parameters (lr, betas, ...) and ``step`` are kept;
    each group declares ``to`` and gets the target's storage options. Each group is checked as
    the target's ``load_state_dict`` checks it (e.g. a state saved with amsgrad cannot become
    low-bit AdamW: ``ValueError``).

    ``state_dtype`` (``torch.float32`` or ``torch.bfloat16``, :mod:`leanopt.quant.bf16`): the
    dtype of the target's dense states, which each group declares; bf16 states (a
    ``state_dtype=torch.bfloat16`` optimizer's) are upcast exactly to fp32, and fp32 or
    dequantized ones are rounded to the nearest bf16 (a one-time conversion; the optimizer
    rounds its own writes stochastically). fp64 and complex states are kept as they are.

    ``"torch-adamw"`` writes what ``torch.optim.AdamW(...).state_dict()`` holds: ``step`` a fp32
    scalar tensor, ``exp_avg``/``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad) fp32 for
    quantized states (torch's ``load_state_dict`` casts them to each param's dtype), torch's
    group options (``foreach``, ``fused``, ``decoupled_weight_decay``, ...) in place of
    leanopt's (``optimizer``, ``rounding``, the storage options); a Kahan compensation
    (``kahan_comp``) and a rounding other than nearest are left out, and ``notes`` says so.
    """
    to_torch = isinstance(to, str) and to.lower() == TORCH_ADAMW
    target_cls = optimizer_class("adamw" if to_torch else to)
    _check_shape_of_sd(state_dict)
    read_as = None
    if declared_optimizer(state_dict) is None:
        seen = recognize_states(state_dict)
        if seen.peer is not None:
            read_as = seen.layout
            state_dict = from_peer(state_dict, rule=rule)
    source = state_dict_layout(state_dict)  # validates the structure
    if rule is not None and read_as is None and REGISTRY[source].family != rule:
        raise ValueError(f"rule={rule!r}, but the state_dict is a {source} state (the {REGISTRY[source].family} rule)")
    if to_torch and REGISTRY[source].family != target_cls.family:
        raise ValueError(
            f"cannot convert a {source} state_dict to {TORCH_ADAMW}: {REGISTRY[source].__name__} runs the "
            f"{REGISTRY[source].family} rule, torch.optim.AdamW the adamw rule (a state of one rule cannot continue another)"
        )
    stored = check_state_dtype(state_dtype)
    if stored != torch.float32 and (to_torch or "state_dtype" not in inspect.signature(target_cls).parameters):
        whose = (f"{TORCH_ADAMW} keeps its states in each param's dtype (torch.optim.AdamW has no state_dtype)" if to_torch
                 else f"{target_cls.__name__} has no state_dtype option (its states are not the elementwise moments)")
        raise ValueError(f"state_dtype={state_dtype_name(stored)} cannot be written for {to}: {whose}")
    converted = _convert(state_dict, source, target_cls, block_size, min_quant_size, stored)
    notes: list[str] = []
    if to_torch:
        converted = _as_torch_adamw(converted, state_dict, notes)
    return Conversion(converted, source, read_as or source, TORCH_ADAMW if to_torch else target_cls.name, notes)


def _convert(state_dict: Mapping[str, Any], source: str, target_cls: type[LeanOptimizer], block_size: int | None,
             min_quant_size: int, state_dtype: torch.dtype = torch.float32) -> dict[str, Any]:  # fmt: skip
    """convert_checkpoint's work on a leanopt-layout ``state_dict`` of optimizer ``source``."""
    to = target_cls.name
    source_cls = REGISTRY[source]
    if source_cls.family != target_cls.family:
        raise ValueError(
            f"cannot convert a {source} state_dict to {to}: {source_cls.__name__} runs the {source_cls.family} rule, "
            f"{target_cls.__name__} the {target_cls.family} rule (a state of one rule cannot continue another; "
            f"convert within a family: {', '.join(family_members(source))})"
        )
    # The target's class as a LowBit one when it is (None otherwise): its storage constants.
    low_bit_cls = target_cls if issubclass(target_cls, LowBit) else None
    low_bit = low_bit_cls is not None
    if low_bit_cls is not None:
        block_size = low_bit_cls.default_block_size if block_size is None else block_size
        check_block_size(block_size)
        check_min_quant_size(min_quant_size)
    # ignore: a class is hashable, but mypy does not see type[X] as Hashable for functools.cache (python/mypy#11470)
    target, origin = _blank(target_cls), _blank(source_cls)  # type: ignore[arg-type]

    groups_out = []
    group_of: dict[Any, tuple[dict[str, Any], list[str], list[str]]] = {}
    for gi, group in enumerate(state_dict["param_groups"]):
        g = {k: v for k, v in group.items() if k not in STORAGE_OPTIONS}
        if low_bit_cls is not None:
            g.update(quantize=group.get("quantize", True), block_size=block_size, min_quant_size=min_quant_size,
                     state_bits=low_bit_cls.state_bits)  # fmt: skip
        if "state_dtype" in target.defaults:
            g["state_dtype"] = state_dtype_name(state_dtype)
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
                new[key] = _stored(_to_dense(value, where), state_dtype)
            elif key in target_keys or _as_quantized(value, where) is not None:
                new[key] = _stored(_to_dense(value, where), state_dtype)
        state_out[pid] = new
    return {**state_dict, "state": state_out, "param_groups": groups_out}


# ---- the peers' formats -------------------------------------------------------------------------
# Group options bitsandbytes saves for every optimizer of a kind, which the rule converted to has
# no use for: AdEMAMix's alpha and schedules in an Adam group, the eps Lion saves as 0.0.
_BNB_BOOKKEEPING = {"adamw": ("alpha", "t_alpha", "t_beta3"), "lion": ("eps",), "ademamix": ()}
# bitsandbytes' block size: fixed in its 8-bit optimizers (init_state's blocksize = 256).
_BNB_BLOCK = 256
_BNB_NESTED = {"state1", "state2", "qmap1", "qmap2", "absmax1", "absmax2"}


def from_peer(state_dict: Mapping[str, Any], *, rule: str | None = None) -> dict[str, Any]:
    """A bitsandbytes or torchao ``state_dict`` in leanopt's layout for the rule it runs.

    Each param's states become the rule's state keys (bitsandbytes' ``state1``/``state2`` ->
    ``exp_avg``/``exp_avg_sq``; AdEMAMix's stacked ``state1`` -> ``exp_avg_fast`` and
    ``exp_avg_slow``; torchao's keys are already Adam's) as fp32 tensors: quantized states are
    dequantized with the code book (``qmap``) and per-block scales (``absmax``, ``scale``) the
    file holds, block by block as the peer decodes them (bitsandbytes: blocks of 256 in flat
    order; torchao: ``codes.numel() // scale.numel()``, its 4-bit codes two to a byte, the first
    in the high nibble), so the values are exactly the peer's; fp32 states (small params) are
    kept. ``step`` becomes a fp32 tensor. Each group declares the member of the family the
    states' bits say (8-bit: ``adamw8bit``, ``lion8bit``, ``ademamix8bit``; torchao 4-bit:
    ``adamw4bit``; 32-bit: the fp32 member), keeps its hyper-parameters (a tensor ``lr``, as
    torchao keeps it, becomes a number) and drops bitsandbytes' options that rule has none of.

    bitsandbytes' one-state files do not say their rule: ``rule="lion"`` reads one as Lion's
    (refused where its ``eps`` is not 0.0, which Lion saves: RMSprop's or Adagrad's). A state
    that is no rule leanopt runs (LAMB's norm clipping), malformed, or not finite, is a
    ``ValueError`` naming the entry.
    """
    _check_shape_of_sd(state_dict)
    seen = recognize_states(state_dict)
    family = _peer_family(seen, state_dict, rule)
    bits = 32 if seen.bits in (None, 32) else seen.bits
    if seen.peer == "torchao" and seen.bits is None:
        raise ValueError(f"the states are {seen.layout}: torchao states of several widths, or of a class leanopt does not "
                         f"read (it reads {', '.join(n.rsplit('.', 1)[-1] for n in TORCHAO_STATES)})")  # fmt: skip
    members = [n for n, cls in REGISTRY.items() if cls.family == family and getattr(cls, "state_bits", 32) == bits]
    if not members:
        members = [n for n, cls in REGISTRY.items() if cls.family == family and not issubclass(cls, LowBit)]
    groups = []
    for group in state_dict["param_groups"]:
        g = {k: v for k, v in group.items() if not (seen.peer == "bitsandbytes" and k in _BNB_BOOKKEEPING[family])}
        if isinstance(g.get("lr"), torch.Tensor) and g["lr"].numel() == 1:
            g["lr"] = g["lr"].item()  # torchao keeps lr as a tensor for its compiled step only
        g[IDENTITY_KEY] = members[0]
        groups.append(g)
    state: dict[Any, Any] = {}
    for pid, st in state_dict["state"].items():
        if not isinstance(st, Mapping):
            raise ValueError(f"state of param {pid!r} is not a dict")
        read = _from_bnb if seen.peer == "bitsandbytes" else _from_torchao
        state[pid] = read(st, family, f"param {pid!r}")
    return {**state_dict, "state": state, "param_groups": groups}


def _states(state_dict: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [st for st in state_dict["state"].values() if isinstance(st, Mapping)]


def _peer_family(seen: Recognized, state_dict: Mapping[str, Any], rule: str | None) -> str:
    """The rule a peer's states run: what they show, or (bitsandbytes' one-state files) ``rule``."""
    if seen.peer is None:
        raise ValueError(f"not a bitsandbytes or torchao state_dict ({seen.layout})")
    if rule is not None and rule not in {cls.family for cls in REGISTRY.values()}:
        raise ValueError(f"unknown rule {rule!r} (leanopt runs: {', '.join(sorted({c.family for c in REGISTRY.values()}))})")
    nested = [st.get(BNB_KEY) for st in _states(state_dict)]
    one_state = seen.peer == "bitsandbytes" and not any(isinstance(n, Mapping) and "state2" in n for n in nested)
    if seen.family is None and one_state and rule == "lion":
        eps = [g.get("eps") for g in state_dict["param_groups"]]
        if any(e != 0.0 for e in eps):
            raise ValueError(f"rule='lion', but the state_dict's groups have eps {eps}: bitsandbytes' Lion saves "
                             "eps 0.0, so these are RMSprop's or Adagrad's states (a rule leanopt does not run)")  # fmt: skip
        return "lion"
    if seen.family is None:
        hint = (" (bitsandbytes' one-state optimizers save the same keys: if Lion8bit or Lion saved it, say so with "
                "rule='lion', `leanopt convert --rule lion`)") if one_state else ""  # fmt: skip
        raise ValueError(f"the states are {seen.layout}: not a rule leanopt runs{hint}")
    if rule is not None and rule != seen.family:
        raise ValueError(f"rule={rule!r}, but the states are {seen.layout} (the {seen.family} rule)")
    return seen.family


def _from_bnb(st: Mapping[str, Any], family: str, where: str) -> dict[str, Any]:
    """One param's bitsandbytes state in the rule's keys (see from_peer)."""
    extra = [k for k in st if k not in ("step", BNB_KEY)]
    nested = st.get(BNB_KEY)
    if extra or not isinstance(nested, Mapping):
        raise ValueError(f"state of {where} holds {sorted(map(str, st))}, not a bitsandbytes state (step, {BNB_KEY})")
    unknown = sorted(str(k) for k in nested if k not in _BNB_NESTED)
    if unknown:
        raise ValueError(f"state of {where} holds {unknown}: not bitsandbytes' block-wise states (absmax, qmap), "
                         "which leanopt reads")  # fmt: skip
    out: dict[str, Any] = {"step": _step(st.get("step"), f"'step' of {where}")}
    if family == "ademamix":
        out["exp_avg_fast"], out["exp_avg_slow"] = _bnb_dense(nested, 1, where, stacked=True).unbind(0)
        out["exp_avg_sq"] = _bnb_dense(nested, 2, where)
    else:
        out["exp_avg"] = _bnb_dense(nested, 1, where)
        if family == "adamw":
            out["exp_avg_sq"] = _bnb_dense(nested, 2, where)
    return out


def _bnb_dense(nested: Mapping[str, Any], n: int, where: str, stacked: bool = False) -> torch.Tensor:
    """bitsandbytes' ``state<n>`` as fp32: ``qmap<n>[code] * absmax<n>[block]`` (blocks of 256 in
    flat order; AdEMAMix's two stacked EMAs each on its own row of blocks), or as saved if fp32."""
    key = f"state{n}"
    name = f"{key!r} of {where}"
    state = nested.get(key)
    if not isinstance(state, torch.Tensor) or is_dtensor(state):
        raise ValueError(f"{name} is {type(state).__name__}, expected a tensor")
    if stacked and (state.dim() < 1 or state.shape[0] != 2):
        raise ValueError(f"{name} has shape {list(state.shape)}, expected AdEMAMix's two stacked EMAs [2, ...]")
    if state.is_floating_point():
        dense = state.to(torch.float32, copy=True)  # the result's own: an optimizer that loads it steps it in place
    elif state.dtype == torch.uint8:
        rows = state.reshape(2 if stacked else 1, -1)
        blocks = math.ceil(rows.shape[1] / _BNB_BLOCK)
        book = _code_book(nested.get(f"qmap{n}"), 256, f"'qmap{n}' of {where}")
        scales = _scales(nested.get(f"absmax{n}"), (2, blocks) if stacked else (blocks,), f"'absmax{n}' of {where}")
        dense = _scaled_blocks(book[rows.long()], scales.reshape(rows.shape[0], blocks), _BNB_BLOCK).view(state.shape)
    else:
        raise ValueError(f"{name} is {state.dtype}, expected uint8 codes or fp32 values")
    _check_finite(dense, name)
    return dense


def _from_torchao(st: Mapping[str, Any], family: str, where: str) -> dict[str, Any]:
    """One param's torchao state: its subclass states dequantized, the rest as saved."""
    out: dict[str, Any] = {}
    for key, value in st.items():
        name = f"{key!r} of {where}"
        if key == "step":
            out[key] = _step(value, name)
        elif is_dtensor(value):
            raise ValueError(f"{name} is a DTensor (a sharded torchao state): gather it into a full state_dict first")
        elif tensor_subclass(value) is not None:
            out[key] = _torchao_dense(value, name)
        elif isinstance(value, torch.Tensor):
            out[key] = value.clone()  # a small param's state, in the param's dtype (torchao quantizes >= 4096)
        else:
            raise ValueError(f"{name} is a {type(value).__name__}, expected a tensor")
    return out


def _torchao_dense(value: torch.Tensor, name: str) -> torch.Tensor:
    """A torchao ``OptimState8bit``/``OptimState4bit``/``OptimStateFp8`` (torchao's own, or read
    without it) as fp32: ``qmap[code] * scale[block]`` (fp8: ``code * scale``), blocks of
    ``codes.numel() // scale.numel()`` elements in flat order."""
    cls = tensor_subclass(value)
    if cls is None:
        raise ValueError(f"{name} is a {type(value).__name__}, not a torchao optimizer state")
    fields = value.__dict__
    codes, shape = fields.get("codes"), tuple(value.shape)
    numel = math.prod(shape)
    kind = cls.rsplit(".", 1)[-1]
    want = torch.float8_e4m3fn if kind == "OptimStateFp8" else torch.uint8
    if not isinstance(codes, torch.Tensor) or codes.dtype != want:
        raise ValueError(f"{name}: a {kind} whose codes are {getattr(codes, 'dtype', type(codes).__name__)}, not {want}")
    packed = kind == "OptimState4bit"
    if codes.numel() != ((numel + 1) // 2 if packed else numel):
        raise ValueError(f"{name}: a {kind} of shape {list(shape)} with {codes.numel()} codes")
    scale = fields.get("scale")
    count = scale.numel() if isinstance(scale, torch.Tensor) else 0
    if count == 0 or numel % count:
        raise ValueError(f"{name}: a {kind} of {numel} elements with {count} block scales (not whole blocks)")
    scales = _scales(scale, (count,), f"{name} (scale)")
    if kind == "OptimStateFp8":
        values = codes.reshape(1, -1).float()
    else:
        flat = codes.reshape(-1)
        if packed:  # two codes a byte, the first in the high nibble
            flat = torch.stack([flat >> 4, flat & 0x0F], dim=-1).reshape(-1)[:numel]
        book = _code_book(fields.get("qmap"), 16 if packed else 256, f"{name} (qmap)")
        values = book[flat.long()].reshape(1, -1)
    dense = _scaled_blocks(values, scales.reshape(1, count), numel // count).view(shape)
    _check_finite(dense, name)
    return dense


def _code_book(qmap: Any, size: int, name: str) -> torch.Tensor:
    """A peer's code book from the file: ``size`` finite values in [-1, 1]."""
    if not isinstance(qmap, torch.Tensor) or not qmap.is_floating_point() or qmap.numel() != size:
        shown = f"{qmap.dtype} x {qmap.numel()}" if isinstance(qmap, torch.Tensor) else type(qmap).__name__
        raise ValueError(f"{name} is {shown}, expected a code book of {size} floats")
    book = qmap.reshape(-1).float()
    if not bool(torch.isfinite(book).all()) or float(book.abs().max()) > 1.0:
        raise ValueError(f"{name}: a code book must hold finite values in [-1, 1]")
    return book


def _scales(scale: Any, shape: tuple[int, ...], name: str) -> torch.Tensor:
    if not isinstance(scale, torch.Tensor) or not scale.is_floating_point() or scale.numel() != math.prod(shape):
        shown = f"{scale.dtype} x {scale.numel()}" if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise ValueError(f"{name} is {shown}, expected {math.prod(shape)} floating-point block scales")
    if scale.dim() > 1 and tuple(scale.shape) != shape:
        raise ValueError(f"{name} has shape {list(scale.shape)}, expected {list(shape)}")
    _check_finite(scale, name)
    return scale.float()


def _scaled_blocks(values: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """``values`` (rows of flat elements) times the scale of each one's block of ``block``."""
    rows, n = values.shape
    blocks = scales.shape[1]
    padded = torch.nn.functional.pad(values, (0, blocks * block - n)).view(rows, blocks, block)
    return (padded * scales.unsqueeze(-1)).reshape(rows, -1)[:, :n].contiguous()


def _check_finite(t: torch.Tensor, name: str) -> None:
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} holds non-finite values")


def _step(value: Any, name: str) -> torch.Tensor:
    """A saved step count (bitsandbytes keeps an int) as the fp32 scalar tensor leanopt and torch keep."""
    number = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
    try:
        step = float(number) if isinstance(number, (int, float)) and not isinstance(number, bool) else math.nan
    except OverflowError:  # an int of hundreds of digits
        step = math.nan
    if not (math.isfinite(step) and step >= 0 and step == int(step)):
        raise ValueError(f"{name} is {value!r}, expected a step count (a whole number >= 0)")
    return torch.tensor(step)


# ---- leaving leanopt: torch.optim.AdamW -----------------------------------------------------------
@functools.cache
def _torch_adamw_defaults() -> dict[str, Any]:
    """The options ``torch.optim.AdamW`` saves in every param group (its defaults, in its order)."""
    return dict(torch.optim.AdamW([torch.nn.Parameter(torch.empty(0, device="meta"))]).defaults)


def _as_torch_adamw(converted: dict[str, Any], source: Mapping[str, Any], notes: list[str]) -> dict[str, Any]:
    """An fp32 leanopt AdamW state_dict (converted) as ``torch.optim.AdamW(...).state_dict()`` holds it."""
    torch_options = _torch_adamw_defaults()
    leanopt_only = {IDENTITY_KEY, "rounding", *STORAGE_OPTIONS}
    groups = []
    for group in converted["param_groups"]:
        g = {k: group.get(k, default) for k, default in torch_options.items()}
        g.update({k: v for k, v in group.items() if k not in torch_options and k not in leanopt_only})
        groups.append(g)
    roundings = sorted({str(g.get("rounding")) for g in source["param_groups"]} - {"None", "nearest"})
    if roundings:
        notes.append(f"rounding={'/'.join(roundings)} left out: torch's AdamW writes bf16/fp16 params with round-to-nearest")
    state: dict[Any, Any] = {}
    compensated = 0
    for pid, st in converted["state"].items():
        if not isinstance(st, Mapping) or "step" not in st:  # not a param's state: kept as it is
            state[pid] = st
            continue
        compensated += "kahan_comp" in st
        # Tensors of their own: torch's load_state_dict keeps the tensors it is given, and steps them in place.
        state[pid] = {"step": _step(st["step"], f"'step' of param {pid!r}"),
                      **{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items() if k not in ("step", "kahan_comp")}}  # fmt: skip
    if compensated:
        notes.append(f"kahan_comp of {compensated} param{'s' if compensated != 1 else ''} left out: torch's AdamW keeps "
                     "no compensation (each param goes on from its bf16/fp16 value, less than half a unit in the last place "
                     "from the compensated one)")  # fmt: skip
    return {**converted, "state": state, "param_groups": groups}


# ---- helpers -----------------------------------------------------------------------------------
@functools.cache
def _blank(cls: type[LeanOptimizer]) -> Any:
    """An instance of ``cls`` on one empty meta param: its defaults, checks and layout methods."""
    # A registered class's own constructor takes params alone (its defaults are its keywords'),
    # unlike LeanOptimizer.__init__(params, defaults) that mypy would check the call against.
    make: Callable[..., LeanOptimizer] = cls
    return make([torch.nn.Parameter(torch.empty(0, device="meta"))])


def _state_keys(opt: Any, group: Mapping[str, Any]) -> list[str]:
    """The rule's state keys (besides ``step``) for ``group``; [] for a non-elementwise optimizer."""
    state_keys = getattr(opt, "state_keys", None)
    return list(state_keys({**opt.defaults, **group})) if state_keys is not None else []


def _check_states(state_dict: Mapping[str, Any], name: str) -> None:
    """Each param group of a ``name`` state_dict holds options ``name`` runs with, and each
    param's state is a dict holding ``name``'s state keys and no key of another rule's state."""
    # ignore: a class is hashable, but mypy does not see type[X] as Hashable for functools.cache (python/mypy#11470)
    opt = _blank(REGISTRY[name])  # type: ignore[arg-type]

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
        keys_of.update({pid: (*_rule_keys(opt, g), g) for pid in g["params"]})
    for pid, st in state_dict["state"].items():
        if not isinstance(st, Mapping):
            raise ValueError(f"state of param {pid!r} is not a dict")
        required, allowed, group = keys_of.get(pid, ((), None, None))
        # Keys the optimizer fills on load from what is there (torch's SGD saves no step) are not missing.
        missing = [k for k in required if k not in st and not _fills_on_load(opt, group, k, st)]
        extra = [] if allowed is None else [k for k in st if k not in allowed]
        if missing:
            raise refuse(f"state of param {pid!r} has keys {sorted(map(str, st))}, not a {name} state (missing {', '.join(map(repr, missing))})")
        if extra:
            verb = "is" if len(extra) == 1 else "are"
            raise refuse(f"state of param {pid!r} has keys {sorted(map(str, st))}, not a {name} state ({', '.join(map(repr, extra))} {verb} another rule's)")


def _fills_on_load(opt: Any, group: Mapping[str, Any] | None, key: str, saved: Mapping[str, Any]) -> bool:
    """Whether ``opt``'s ``load_state_dict`` makes state ``key`` from ``saved`` (its ``_missing_state``)."""
    if group is None:
        return False
    specs = {spec.key: spec for spec in opt.state_layout((4,), torch.float32, {**opt.defaults, **group})}
    return key in specs and opt._missing_state(specs[key], torch.empty(4), saved) is not None


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


def _stored(dense: torch.Tensor, state_dtype: torch.dtype) -> torch.Tensor:
    """A dense state in the target's ``state_dtype``: bf16 <-> fp32; other dtypes (fp64, complex) as they are."""
    if dense.dtype in (torch.float32, torch.bfloat16) and dense.dtype != state_dtype:
        return dense.to(state_dtype)
    return dense


def _to_quantized(value: Any, fmt: Any, where: str) -> dict[str, Any]:
    q = _as_quantized(value, where)
    if q is not None and q.format == fmt:
        return q.to_state_dict()
    dense = _to_dense(value, where)
    return fmt.from_dense(dense.float()).to_state_dict()
