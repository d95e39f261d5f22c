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
ValueError: cannot convert the lion8bit state_dict to adamw: Lion8bit runs the lion rule, AdamW the adamw rule (a state of one rule cannot continue another; convert within a family: lion, lion8bit, lion4bit)
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from leanopt.catalog import TORCH_ADAMW, TORCH_MUON
from leanopt.optim.base import LeanOptimizer
from leanopt.optim.identity import IDENTITY_KEY, declared_optimizer, recognize_states, tensor_subclass
from leanopt.optim.lowbit import STORAGE_OPTIONS, LowBit
from leanopt.optim.peer_states import a_, check_state_dict, from_peer, step_count
from leanopt.optim.registry import REGISTRY, optimizer_class
from leanopt.optim.sharding import is_dtensor
from leanopt.optim.validation import check_block_size, check_min_quant_size
from leanopt.quant import QuantizedState, format_by_name
from leanopt.quant.bf16 import check_state_dtype, state_dtype_name

__all__ = ["IDENTITY_KEY", "TORCH_ADAMW", "TORCH_MUON", "TORCH_TARGETS", "Conversion", "check_loads", "convert_checkpoint", "convert_state_dict", "declared_optimizer",
           "family_members", "from_peer", "state_dict_layout"]  # fmt: skip

# torch's optimizers a state converts to: target name -> (the leanopt member it is converted as
# first, torch's class path).
TORCH_TARGETS = {TORCH_ADAMW: ("adamw", "AdamW"), TORCH_MUON: ("muon", "Muon")}

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
    check_state_dict(state_dict)
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
    no place for and was left out, one sentence each; ``shapes``: each param's shape, as its
    states agree on it (by param id; a param without state has none), what
    :func:`check_loads` builds the target over.
    """

    state_dict: dict[str, Any]
    source: str
    read_as: str
    target: str
    notes: list[str] = field(default_factory=list)
    shapes: dict[Any, tuple[int, ...]] = field(default_factory=dict)


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
    torch_target = to.lower() if isinstance(to, str) and to.lower() in TORCH_TARGETS else None
    to_torch = torch_target is not None
    target_cls = optimizer_class(TORCH_TARGETS[torch_target][0] if torch_target else to)
    check_state_dict(state_dict)
    _check_backed(state_dict)  # before anything is dequantized or copied
    read_as = None
    if declared_optimizer(state_dict) is None:
        seen = recognize_states(state_dict)
        if seen.peer is not None:
            read_as = seen.layout
            state_dict = from_peer(state_dict, rule=rule)
    source = state_dict_layout(state_dict)  # validates the structure
    if rule is not None and read_as is None and REGISTRY[source].family != rule:
        raise ValueError(f"rule={rule!r}, but the state_dict holds {source} states (the {REGISTRY[source].family} rule)")
    if torch_target and REGISTRY[source].family != target_cls.family:
        raise ValueError(
            f"cannot convert the {source} state_dict to {torch_target}: {REGISTRY[source].__name__} runs the "
            f"{REGISTRY[source].family} rule, torch.optim.{TORCH_TARGETS[torch_target][1]} the {target_cls.family} rule "
            "(a state of one rule cannot continue another)"
        )
    stored = check_state_dtype(state_dtype)
    if stored != torch.float32 and (to_torch or "state_dtype" not in inspect.signature(target_cls).parameters):
        whose = (f"{torch_target} keeps its states in each param's dtype (torch's optimizer has no state_dtype)" if to_torch
                 else f"{target_cls.__name__} has no state_dtype option (its states are not the elementwise moments)")
        raise ValueError(f"state_dtype={state_dtype_name(stored)} cannot be written for {to}: {whose}")
    shapes = _param_shapes(state_dict, source)
    converted = _convert(state_dict, source, target_cls, block_size, min_quant_size, stored)
    notes: list[str] = []
    if torch_target == TORCH_ADAMW:
        converted = _as_torch_adamw(converted, state_dict, notes)
    elif torch_target == TORCH_MUON:
        converted = _as_torch_muon(converted, shapes, notes)
    target = torch_target or target_cls.name
    check_loads(converted, target, shapes)
    return Conversion(converted, source, read_as or source, target, notes, shapes)


def check_loads(state_dict: Mapping[str, Any], target: str, shapes: Mapping[Any, tuple[int, ...]]) -> None:
    """``ValueError`` unless ``state_dict`` loads into optimizer ``target`` (a registry name or
    ``"torch-adamw"``): ``target`` is built over a param of each shape in ``shapes`` (by param
    id, as :attr:`Conversion.shapes`; fp32, or the dtype of a param's ``kahan_comp``), in the
    groups the state_dict lists, with their options, and its own ``load_state_dict`` runs every
    check it runs on a real model. The params are on the meta device: nothing of their size is
    allocated. Params whose state holds no tensor data (none yet) are left out: there is
    nothing of theirs to load, and a file could list millions of them for a few bytes each."""
    states = state_dict["state"]
    loaded = {pid for pid, st in states.items() if any(t.numel() for _, t in _state_tensors(st, ""))}

    def param(pid: Any) -> torch.nn.Parameter:
        comp = states[pid].get("kahan_comp") if isinstance(states[pid], Mapping) else None
        dtype = comp.dtype if isinstance(comp, torch.Tensor) and comp.is_floating_point() else torch.float32
        return torch.nn.Parameter(torch.empty(shapes.get(pid, (1,)), dtype=dtype, device="meta"))

    groups = [{**g, "params": [pid for pid in g["params"] if pid in loaded]} for g in state_dict["param_groups"]]
    if not any(g["params"] for g in groups):
        return  # no state to load (torch refuses to build an optimizer over no param)
    listed = {pid for g in state_dict["param_groups"] for pid in g["params"]}
    kept = {pid: st for pid, st in states.items() if pid in loaded or pid not in listed}  # an unlisted id is refused on load
    cls: Callable[..., torch.optim.Optimizer] = (getattr(torch.optim, TORCH_TARGETS[target][1]) if target in TORCH_TARGETS
                                                 else optimizer_class(target))  # fmt: skip
    built = [{**{k: v for k, v in g.items() if k != IDENTITY_KEY}, "params": [param(pid) for pid in g["params"]]} for g in groups]
    try:
        cls(built).load_state_dict({**state_dict, "state": kept, "param_groups": groups})
    except ValueError as err:
        # Where the states are another rule's (a file relabeled by hand), say so: that is the cause.
        seen = recognize_states(state_dict)
        target_family = getattr(cls, "family", None)
        other = f"; its states are {seen.layout}'s (the {seen.family} rule)" if seen.family not in (None, target_family) else ""
        raise ValueError(f"the result would not load into {target}: {err}{other}") from None


def _convert(state_dict: Mapping[str, Any], source: str, target_cls: type[LeanOptimizer], block_size: int | None,
             min_quant_size: int, state_dtype: torch.dtype = torch.float32) -> dict[str, Any]:  # fmt: skip
    """convert_checkpoint's work on a leanopt-layout ``state_dict`` of optimizer ``source``."""
    to = target_cls.name
    source_cls = REGISTRY[source]
    if source_cls.family != target_cls.family:
        raise ValueError(
            f"cannot convert the {source} state_dict to {to}: {source_cls.__name__} runs the {source_cls.family} rule, "
            f"{target_cls.__name__} the {target_cls.family} rule (a state of one rule cannot continue another; "
            f"convert within a family: {', '.join(family_members(source))})"
        )
    check_min_quant_size(min_quant_size)
    # ignore: a class is hashable, but mypy does not see type[X] as Hashable for functools.cache (python/mypy#11470)
    target, origin = _blank(target_cls), _blank(source_cls)  # type: ignore[arg-type]

    groups_out = []
    group_of: dict[Any, tuple[dict[str, Any], Any, list[str]]] = {}
    for gi, group in enumerate(state_dict["param_groups"]):
        g = {k: v for k, v in group.items() if k not in STORAGE_OPTIONS}
        # Where the group's states are stored: the target itself, or (Muon) the group's rule runner.
        store = target.storage(_filled(target, g))
        if isinstance(store, LowBit):  # its storage constants
            blocks = type(store).default_block_size if block_size is None else block_size
            check_block_size(blocks)
            g.update(quantize=group.get("quantize", True), block_size=blocks, min_quant_size=min_quant_size,
                     state_bits=store.state_bits)  # fmt: skip
        if "state_dtype" in target.defaults:
            g["state_dtype"] = state_dtype_name(state_dtype)
        g[IDENTITY_KEY] = to
        filled = _filled(target, g)
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
            group_of[pid] = (filled, store, target_keys)

    state_out: dict[Any, Any] = {}
    for pid, st in state_dict["state"].items():
        if pid not in group_of:  # not a param's state (e.g. a hook's own entry): kept as it is
            state_out[pid] = st
            continue
        filled, store, target_keys = group_of[pid]
        new = dict(st)
        for key, value in st.items():
            where = f"{key!r} of param {pid!r}"
            if key in target_keys and isinstance(store, LowBit):
                shape = _shape_of(value, where)
                if store.quantizes(shape, filled):
                    new[key] = _to_quantized(value, store.state_format(key, filled), where)
                    continue
                new[key] = _stored(_to_dense(value, where), state_dtype)
            elif key in target_keys or _as_quantized(value, where) is not None:
                new[key] = _stored(_to_dense(value, where), state_dtype)
        state_out[pid] = new
    return {**state_dict, "state": state_out, "param_groups": groups_out}


# ---- what a file's entries must hold before anything is converted ------------------------------------
# Code books: one small table a peer may share between every param's state (bitsandbytes does),
# read only through a check of its exact size.
_CODE_BOOKS = frozenset({"qmap", "qmap1", "qmap2"})


def _check_backed(state_dict: Mapping[str, Any]) -> None:
    """Each state tensor of ``state_dict`` holds bytes of its own: none shares bytes with another
    entry or repeats its own (a stride of 0), so what conversion makes of the states is bounded
    by the bytes the file holds. A torch file may point many entries at one storage, or give a
    tensor of 10^12 elements a storage of one: each would pass every other check, and a file of
    kilobytes would be converted into gigabytes."""
    spans: dict[tuple[str, int], list[tuple[int, int, str]]] = {}
    for pid, st in state_dict["state"].items():
        for where, t in _state_tensors(st, f"param {pid!r}"):
            nbytes = t.numel() * t.element_size()
            if nbytes == 0 or t.device.type == "meta":
                continue
            start = int(t.storage_offset()) * t.element_size()
            end = start + (1 + sum((int(n) - 1) * stride for n, stride in zip(t.shape, t.stride()))) * t.element_size()
            if end - start < nbytes:
                raise ValueError(f"{where} has {t.numel():,} elements held in {end - start:,} bytes: a tensor whose "
                                 "elements share their bytes (a stride of 0), not a saved state")  # fmt: skip
            storage = t.untyped_storage()
            spans.setdefault((str(t.device), storage.data_ptr()), []).append((start, end, where))
    for ranges in spans.values():
        ranges.sort()
        for (_, end, first), (start, _, second) in zip(ranges, ranges[1:]):
            if start < end:
                raise ValueError(f"{second} and {first} share their bytes in the file: each state holds bytes of its own")


def _state_tensors(value: Any, where: str, key: str | None = None) -> list[tuple[str, torch.Tensor]]:
    """The tensors holding the data of one param's state (``value``), each with the entry it is
    (``"'absmax1' of param 0"``): nested dicts (bitsandbytes', leanopt's quantized entries) and
    tensor subclasses' fields (torchao's) opened, code books left out."""
    name = where if key is None else f"{key!r} of {where}"
    if key in _CODE_BOOKS or is_dtensor(value):
        return []
    if isinstance(value, QuantizedState):
        return [(name, t) for t in value.tensors()]
    if isinstance(value, torch.Tensor):
        if tensor_subclass(value) is None:
            return [(name, value)]
        return [(f"{name} ({field})", t) for field, t in value.__dict__.items()
                if field not in _CODE_BOOKS and isinstance(t, torch.Tensor)]  # fmt: skip
    if isinstance(value, Mapping):
        inner = where if key is None else (name if QuantizedState.is_state_dict(value) else where)
        return [found for k, v in value.items() for found in _state_tensors(v, inner, str(k))]
    return []


def _param_shapes(state_dict: Mapping[str, Any], name: str) -> dict[Any, tuple[int, ...]]:
    """The shape of each param of a ``name`` state_dict: the one every entry of its state is
    laid out for (``name``'s ``state_layout``); ``ValueError`` naming the entries when its
    states agree on none (an ``exp_avg`` of 4 x 300 beside an ``exp_avg_sq`` of 7 x 7)."""
    # ignore: a class is hashable, but mypy does not see type[X] as Hashable for functools.cache (python/mypy#11470)
    opt = _blank(REGISTRY[name])  # type: ignore[arg-type]
    group_of = {pid: g for g in state_dict["param_groups"] for pid in g["params"]}
    shapes: dict[Any, tuple[int, ...]] = {}
    for pid, st in state_dict["state"].items():
        if pid not in group_of or not isinstance(st, Mapping):
            continue
        seen: dict[str, tuple[int, ...]] = {}
        for k, v in st.items():
            if k == "step" or k in opt.ignored_state_keys or v is None:  # torch's SGD saves momentum_buffer None
                continue
            shape = _entry_shape(v)
            if shape is not None:
                seen[str(k)] = shape
            elif not (isinstance(v, Mapping) and QuantizedState.is_state_dict(v)):  # a bad quantized one is named where it is read
                raise ValueError(f"{k!r} of param {pid!r} is {a_(type(v).__name__)}, expected a tensor or a quantized state")
        # A param's shape is one entry's (a moment), or, for factored states (Adafactor's row and
        # column statistics of a matrix: shape[:-1] and shape[:-2] + shape[-1:]), two entries' joined.
        candidates = [*seen.values(), *(a + b[-1:] for a in seen.values() for b in seen.values() if a and len(a) == len(b))]
        group = _filled(opt, group_of[pid])
        for shape in dict.fromkeys(candidates):
            laid_out = {spec.key: spec.shape for spec in opt.state_layout(shape, torch.float32, group)}
            laid_out["kahan_comp"] = shape
            if all(laid_out.get(k) == held for k, held in seen.items()):
                shapes[pid] = shape
                break
        else:
            if seen:
                shown = ", ".join(f"{k!r} {list(held)}" for k, held in seen.items())
                raise ValueError(f"the states of param {pid!r} agree on no param shape ({shown}): not one param's {name} state")
    return shapes


def _entry_shape(value: Any) -> tuple[int, ...] | None:
    """The (logical) shape of a state entry: a tensor's, a quantized entry's declared one."""
    if isinstance(value, QuantizedState):
        return tuple(value.shape)
    if isinstance(value, Mapping) and QuantizedState.is_state_dict(value):
        shape = value["shape"]
        ints = isinstance(shape, (list, tuple)) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
        return tuple(shape) if ints and len(shape) <= 64 else None  # anything else is refused where the entry is read
    if isinstance(value, torch.Tensor) and (tensor_subclass(value) is None or is_dtensor(value)):
        return tuple(value.shape)  # a DTensor's: the whole state's
    return None


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
        state[pid] = {"step": step_count(st["step"], f"'step' of param {pid!r}"),
                      **{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items() if k not in ("step", "kahan_comp")}}  # fmt: skip
    if compensated:
        notes.append(f"kahan_comp of {compensated} param{'s' if compensated != 1 else ''} left out: torch's AdamW keeps "
                     "no compensation (each param goes on from its bf16/fp16 value, less than half a unit in the last place "
                     "from the compensated one)")  # fmt: skip
    return {**converted, "state": state, "param_groups": groups}


# ---- leaving leanopt: torch.optim.Muon ------------------------------------------------------------
@functools.cache
def _torch_muon_defaults() -> dict[str, Any]:
    """The options ``torch.optim.Muon`` saves in every param group (its defaults, in its order)."""
    return dict(torch.optim.Muon([torch.nn.Parameter(torch.empty(0, 0, device="meta"))]).defaults)


def _as_torch_muon(converted: dict[str, Any], shapes: Mapping[Any, tuple[int, ...]], notes: list[str]) -> dict[str, Any]:
    """An fp32 leanopt Muon state_dict (converted) as ``torch.optim.Muon(...).state_dict()`` holds
    it: torch's group options, ``momentum_buffer`` alone; refused where torch has no place for
    a group (an aux group, a param that is not a matrix)."""
    torch_options = _torch_muon_defaults()
    groups = []
    for gi, group in enumerate(converted["param_groups"]):
        if not group.get("use_muon", True):
            raise ValueError(f"cannot convert to {TORCH_MUON}: param group {gi} is an aux ({group.get('aux', 'adamw')}) group, "
                             "and torch.optim.Muon holds Muon groups only (keep the leanopt file, or convert a file "
                             "of Muon groups)")  # fmt: skip
        for pid in group["params"]:
            if pid in shapes and len(shapes[pid]) != 2:
                raise ValueError(f"cannot convert to {TORCH_MUON}: param {pid!r} of group {gi} has shape {shapes[pid]}; "
                                 "torch.optim.Muon takes 2-D params only")  # fmt: skip
        groups.append({"params": group["params"], **{k: group.get(k, default) for k, default in torch_options.items()}})
    stepped = 0
    state: dict[Any, Any] = {}
    for pid, st in converted["state"].items():
        if not isinstance(st, Mapping) or "momentum_buffer" not in st:  # not a param's state: kept as it is
            state[pid] = st
            continue
        stepped += "step" in st
        buf = st["momentum_buffer"]
        state[pid] = {"momentum_buffer": buf.clone() if isinstance(buf, torch.Tensor) else buf}
    if stepped:
        notes.append(f"step of {stepped} param{'s' if stepped != 1 else ''} left out: torch.optim.Muon keeps no step count")
    return {**converted, "state": state, "param_groups": groups}


# ---- helpers -----------------------------------------------------------------------------------
@functools.cache
def _blank(cls: type[LeanOptimizer]) -> Any:
    """An instance of ``cls`` on one empty meta param (a matrix: Muon takes no other): its
    defaults, checks and layout methods."""
    # A registered class's own constructor takes params alone (its defaults are its keywords'),
    # unlike LeanOptimizer.__init__(params, defaults) that mypy would check the call against.
    make: Callable[..., LeanOptimizer] = cls
    return make([torch.nn.Parameter(torch.empty(0, 0, device="meta"))])


def _state_keys(opt: Any, group: Mapping[str, Any]) -> list[str]:
    """The rule's state keys (besides ``step``) for ``group``; [] for a non-elementwise optimizer."""
    state_keys = getattr(opt, "state_keys", None)
    return list(state_keys(_filled(opt, group))) if state_keys is not None else []


def _filled(opt: Any, group: Mapping[str, Any]) -> dict[str, Any]:
    """``group`` with the options it does not set taken from ``opt``'s defaults for such a group."""
    return {**opt.group_defaults(group), **group}


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
            opt.validate_group(_filled(opt, g), loaded=True)
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
            raise refuse(f"state of param {pid!r} has keys {sorted(map(str, st))}, not {name}'s state (missing {', '.join(map(repr, missing))})")
        if extra:
            verb = "is" if len(extra) == 1 else "are"
            raise refuse(f"state of param {pid!r} has keys {sorted(map(str, st))}, not {name}'s state ({', '.join(map(repr, extra))} {verb} another rule's)")


def _fills_on_load(opt: Any, group: Mapping[str, Any] | None, key: str, saved: Mapping[str, Any]) -> bool:
    """Whether ``opt``'s ``load_state_dict`` makes state ``key`` from ``saved`` (its ``_missing_state``)."""
    if group is None:
        return False
    specs = {spec.key: spec for spec in opt.state_layout((4, 4), torch.float32, _filled(opt, group))}
    return key in specs and opt._missing_state(specs[key], torch.empty(4), saved) is not None


def _rule_keys(opt: Any, group: Mapping[str, Any]) -> tuple[list[str], set[str]]:
    """The state keys every param of ``group`` holds, and all those one may hold: the layouts of
    a vector and of a matrix (Adafactor factors matrices), the rounding's compensation, and the
    peers' bookkeeping the optimizer drops on load."""
    group = _filled(opt, group)
    # A matrix's layout too (Adafactor factors matrices); Muon's groups take matrices only.
    shapes = ((4, 4),) if group.get("use_muon") else ((4,), (4, 4))
    layouts = [[spec.key for spec in opt.state_layout(shape, torch.float32, group)] for shape in shapes]
    required = [k for k in layouts[0] if all(k in other for other in layouts[1:])]
    return required, {*(k for keys in layouts for k in keys), "kahan_comp", *opt.ignored_state_keys}


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
    raise ValueError(f"{where} is {a_(type(value).__name__)}, expected a tensor or a quantized state")


def _to_dense(value: Any, where: str) -> torch.Tensor:
    q = _as_quantized(value, where)
    if q is not None:
        return q.dequantize()
    if isinstance(value, torch.Tensor):
        return value
    raise ValueError(f"{where} is {a_(type(value).__name__)}, expected a tensor or a quantized state")


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
