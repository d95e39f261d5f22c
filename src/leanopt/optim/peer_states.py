"""The peers' optimizer states -- bitsandbytes' and torchao's files -- read in leanopt's layout.

:func:`from_peer` turns a bitsandbytes (``AdamW8bit``, ``Lion8bit``, ``AdEMAMix8bit``, their
32-bit and paged forms) or torchao (``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8``) ``state_dict``
into the state of the leanopt optimizer of the same rule, with the exact values the peer
computes with. Two callers: ``leanopt convert`` (:mod:`leanopt.checkpoint`, which adds the
file's checks and writes the result) and ``load_state_dict`` of every leanopt optimizer
(:func:`as_leanopt_state`), so that a peer's ``optimizer.pt`` of the same family loads as it is
(a Trainer run of ``optim="adamw_bnb_8bit"`` resumed with ``leanopt.AdamW8bit``).

Nothing here imports an optimizer: the optimizers' base imports this module.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from leanopt.optim.identity import BNB_KEY, IDENTITY_KEY, TORCHAO_STATES, Recognized, recognize_states, tensor_subclass
from leanopt.optim.registry import REGISTRY
from leanopt.optim.sharding import is_dtensor

__all__ = ["a_", "as_leanopt_state", "check_state_dict", "from_peer", "step_count"]

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
    check_state_dict(state_dict)
    seen = recognize_states(state_dict)
    family = _peer_family(seen, state_dict, rule)
    bits = 32 if seen.bits in (None, 32) else seen.bits
    if seen.peer == "torchao" and seen.bits is None:
        raise ValueError(f"the states are {seen.layout}: torchao states of several widths, or of a class leanopt does not "
                         f"read (it reads {', '.join(n.rsplit('.', 1)[-1] for n in TORCHAO_STATES)})")  # fmt: skip
    members = [n for n, cls in REGISTRY.items() if cls.family == family and getattr(cls, "state_bits", 32) == bits]
    if not members:
        members = [n for n, cls in REGISTRY.items() if cls.family == family and getattr(cls, "state_bits", None) is None]
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


def as_leanopt_state(state_dict: Any, cls: Any) -> Any:
    """``state_dict`` as ``cls.load_state_dict`` reads it (``cls``: a leanopt optimizer class):
    a peer's file of ``cls``'s family -- bitsandbytes' AdamW8bit, Lion8bit, AdEMAMix8bit and
    their 32-bit forms, torchao's AdamW8bit/AdamW4bit/AdamWFp8 -- in leanopt's layout
    (:func:`from_peer`); anything else (leanopt's files, torch's, another family's) as it is,
    for ``load_state_dict``'s own checks to take or refuse.

    A bitsandbytes one-state file does not say whether Lion or SGD momentum saved it, so it
    is not taken for Lion's on load: the ``ValueError`` names the ``leanopt convert`` command
    that says so (``--rule lion``). A malformed peer file is a ``ValueError`` naming the entry.
    """
    if not isinstance(state_dict, Mapping):
        return state_dict
    try:
        check_state_dict(state_dict)
        if any(isinstance(g, Mapping) and IDENTITY_KEY in g for g in state_dict["param_groups"]):
            return state_dict  # a leanopt file declares its optimizer
        seen = recognize_states(state_dict)
    except (ValueError, TypeError, KeyError):
        return state_dict  # load_state_dict says what is wrong with it
    if seen.peer is None or seen.family not in (None, cls.family):
        return state_dict
    where = f"{cls.__name__}.load_state_dict"
    if seen.family is None:
        try:  # what `leanopt convert --rule lion` would take: bitsandbytes' one state, eps 0.0
            lion = cls.family == "lion" and _peer_family(seen, state_dict, "lion") == "lion"
        except ValueError:
            lion = False
        if lion:
            raise ValueError(
                f"{where}: the state_dict is {seen.layout}, which does not say whether Lion or SGD momentum saved it; "
                f"if Lion8bit or Lion did, convert the file saying so: `leanopt convert FILE NEW_FILE --to {cls.name} "
                "--rule lion`, then load NEW_FILE"
            )
        return state_dict  # not a rule leanopt runs: load_state_dict names what the states are
    try:
        return from_peer(state_dict)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


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
    _check_bnb_pair(nested, family, where)
    out: dict[str, Any] = {"step": step_count(st.get("step"), f"'step' of {where}")}
    if family == "ademamix":
        out["exp_avg_fast"], out["exp_avg_slow"] = _bnb_dense(nested, 1, where, stacked=True).unbind(0)
        out["exp_avg_sq"] = _bnb_dense(nested, 2, where)
    else:
        out["exp_avg"] = _bnb_dense(nested, 1, where)
        if family == "adamw":
            out["exp_avg_sq"] = _bnb_dense(nested, 2, where)
    return out


def _check_bnb_pair(nested: Mapping[str, Any], family: str, where: str) -> None:
    """A two-state rule's ``state1`` and ``state2`` are of one param: its shape (AdEMAMix's
    ``state1`` stacks two EMAs of it: ``[2, *shape]``), and both 8-bit codes or both floats."""
    one, two = nested.get("state1"), nested.get("state2")
    if family == "lion" or not isinstance(one, torch.Tensor) or not isinstance(two, torch.Tensor):
        return  # a missing state is named where it is read
    want = (2, *two.shape) if family == "ademamix" else tuple(two.shape)
    if tuple(one.shape) != want:
        stacked = " (AdEMAMix's state1 stacks two EMAs of state2's shape)" if family == "ademamix" else ""
        raise ValueError(f"'state1' of {where} has shape {list(one.shape)} and 'state2' {list(two.shape)}: not the states "
                         f"of one param{stacked}")  # fmt: skip
    if (one.dtype == torch.uint8) != (two.dtype == torch.uint8):
        raise ValueError(f"'state1' of {where} is {one.dtype} and 'state2' {two.dtype}: bitsandbytes keeps both "
                         "states of a param in one width (8-bit codes or floats)")  # fmt: skip


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
        stray = [k for k in (f"absmax{n}", f"qmap{n}") if k in nested]
        if stray:
            raise ValueError(f"{stray[0]!r} of {where}: {key} holds {state.dtype} values, which bitsandbytes saves "
                             "without block scales or a code book (those come with 8-bit codes)")  # fmt: skip
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
    shapes = {str(k): list(v.shape) for k, v in st.items() if k != "step" and isinstance(v, torch.Tensor)}
    if len({tuple(s) for s in shapes.values()}) > 1:
        raise ValueError(f"the states of {where} have shapes {shapes}: not the states of one param")
    out: dict[str, Any] = {}
    for key, value in st.items():
        name = f"{key!r} of {where}"
        if key == "step":
            out[key] = step_count(value, name)
        elif is_dtensor(value):
            raise ValueError(f"{name} is a DTensor (a sharded torchao state): gather it into a full state_dict first")
        elif tensor_subclass(value) is not None:
            out[key] = _torchao_dense(value, name)
        elif isinstance(value, torch.Tensor):
            out[key] = value.clone()  # a small param's state, in the param's dtype (torchao quantizes >= 4096)
        else:
            raise ValueError(f"{name} is {a_(type(value).__name__)}, expected a tensor")
    return out


def _torchao_dense(value: torch.Tensor, name: str) -> torch.Tensor:
    """A torchao ``OptimState8bit``/``OptimState4bit``/``OptimStateFp8`` (torchao's own, or read
    without it) as fp32: ``qmap[code] * scale[block]`` (fp8: ``code * scale``), blocks of
    ``codes.numel() // scale.numel()`` elements in flat order."""
    cls = tensor_subclass(value)
    if cls is None:
        raise ValueError(f"{name} is {a_(type(value).__name__)}, not a torchao optimizer state")
    fields = value.__dict__
    codes, shape = fields.get("codes"), tuple(value.shape)
    numel = math.prod(shape)
    kind = cls.rsplit(".", 1)[-1]
    want = torch.float8_e4m3fn if kind == "OptimStateFp8" else torch.uint8
    if not isinstance(codes, torch.Tensor) or codes.dtype != want:
        raise ValueError(f"{name}: {a_(kind)} whose codes are {getattr(codes, 'dtype', type(codes).__name__)}, not {want}")
    packed = kind == "OptimState4bit"
    if codes.numel() != ((numel + 1) // 2 if packed else numel):
        raise ValueError(f"{name}: {a_(kind)} of shape {list(shape)} with {codes.numel()} codes")
    scale = fields.get("scale")
    count = scale.numel() if isinstance(scale, torch.Tensor) else 0
    if count == 0 or numel % count:
        raise ValueError(f"{name}: {a_(kind)} of {numel} elements with {count} block scales (not whole blocks)")
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


def step_count(value: Any, name: str) -> torch.Tensor:
    """A saved step count (bitsandbytes keeps an int) as the fp32 scalar tensor leanopt and torch keep."""
    number = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
    try:
        step = float(number) if isinstance(number, (int, float)) and not isinstance(number, bool) else math.nan
    except OverflowError:  # an int of hundreds of digits
        step = math.nan
    if not (math.isfinite(step) and step >= 0 and step == int(step)):
        raise ValueError(f"{name} is {value!r}, expected a step count (a whole number >= 0)")
    return torch.tensor(step)


def check_state_dict(state_dict: Any) -> None:
    """``ValueError`` unless ``state_dict`` has the form of an optimizer's: ``state`` a dict,
    ``param_groups`` dicts with a ``params`` list of param ids (anything a dict key can be)."""
    if (
        not isinstance(state_dict, Mapping)
        or not isinstance(state_dict.get("state"), Mapping)
        or not isinstance(state_dict.get("param_groups"), (list, tuple))
        or not all(isinstance(g, Mapping) and isinstance(g.get("params"), (list, tuple)) for g in state_dict["param_groups"])
    ):
        raise ValueError("expected an optimizer state_dict (a dict with 'state' and 'param_groups')")
    for gi, group in enumerate(state_dict["param_groups"]):
        for pid in group["params"]:
            try:
                hash(pid)
            except TypeError:
                raise ValueError(f"param group {gi} lists {a_(type(pid).__name__)} as a param id (a param id is a number or a name)") from None


def a_(word: str) -> str:
    """``word`` after its indefinite article, for messages that name a type: ``"an int"``, ``"a str"``."""
    return f"{'an' if word[:1].lower() in 'aeiou' else 'a'} {word}"
