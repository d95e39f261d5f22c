"""Whose optimizer state a ``state_dict`` is: the name it declares, or what its states show.

leanopt's optimizers declare their registry name in every param group under ``"optimizer"``
(:data:`IDENTITY_KEY`, read by :func:`declared_optimizer`). A file that declares none (torch's,
transformers', bitsandbytes', torchao's, leanopt's own from before names were declared) is
recognised from its state keys and group options (:func:`recognize_states`): the one
recogniser that ``load_state_dict`` (a state loads only into its own family),
:mod:`leanopt.checkpoint` (convert) and ``leanopt inspect`` share. For the peers' own formats
(bitsandbytes' nested dict, torchao's tensor subclasses) it also says whose format the states
are in and their bits (:attr:`Recognized.peer`, :attr:`Recognized.bits`): what convert reads
them with.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from leanopt.quant import QuantizedState

BNB_KEY = "__bnb_optimizer_quant_state__"
# torchao's optimizer-state tensor subclasses, by the class path a checkpoint names, and their bits.
TORCHAO_STATES = {
    "torchao.optim.subclass_8bit.OptimState8bit": 8,
    "torchao.optim.subclass_4bit.OptimState4bit": 4,
    "torchao.optim.subclass_fp8.OptimStateFp8": 8,
}
NO_STATE_YET = " (no state yet: saved before the first step)"
# State keys of the rules with more than Lion's one momentum (exp_avg).
_NOT_LION_KEYS = {"exp_avg_sq", "max_exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col", "RMS", "exp_avg_fast", "exp_avg_slow",
                  "momentum_buffer"}  # fmt: skip
# Options torch's own optimizers put in every param group (leanopt's don't).
_TORCH_GROUP_FLAGS = {"foreach", "fused", "capturable", "differentiable"}


# The param-group key under which leanopt's optimizers declare their registry name.
IDENTITY_KEY = "optimizer"


def declared_optimizer(state_dict: Mapping[str, Any]) -> str | None:
    """The registry name the param groups of ``state_dict`` declare under ``"optimizer"``, or
    None when none does (a peer's file, or leanopt's from before names were declared).

    The name is returned as saved, registered here or not. ``ValueError`` when groups declare
    different names or a name is not a string.
    """
    groups = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
    names = []
    for g in groups if isinstance(groups, (list, tuple)) else ():
        if isinstance(g, Mapping) and IDENTITY_KEY in g:
            name = g[IDENTITY_KEY]
            if not isinstance(name, str):
                raise ValueError(f"param group declares optimizer {name!r}, not a name")
            if name not in names:
                names.append(name)
    if len(names) > 1:
        raise ValueError(f"param groups declare different optimizers: {', '.join(names)}")
    return names[0] if names else None


@dataclass(frozen=True)
class Recognized:
    """What the states and group options of a ``state_dict`` show, whatever it declares.

    ``layout`` names it as :func:`leanopt.memory.inspect.recognize_layout` does for a file that declares no optimizer;
    ``family`` is the rule its states run, by the name leanopt's optimizers give it
    (``cls.family``: ``"adamw"``, ``"lion"``, ``"ademamix"``, ``"adafactor"``), or None where
    leanopt runs no such rule (torch's Adafactor, SGD) or the states do not tell (bitsandbytes'
    one-state optimizers: Lion, momentum, RMSprop). A state_dict that declares no optimizer loads
    only into an optimizer of this family, and converts only within it.

    ``peer`` is ``"bitsandbytes"`` or ``"torchao"`` for states in that library's own format
    (what :mod:`leanopt.checkpoint` reads them with), None otherwise; ``bits`` is then the width
    of their quantized states (8 or 4; 32 for bitsandbytes' fp32 ones): the member of the family
    they convert as.
    """

    layout: str
    family: str | None = None
    peer: str | None = None
    bits: int | None = None


def recognize_states(state_dict: Mapping[str, Any]) -> Recognized:
    """What the states and group options of ``state_dict`` (a dict with ``state`` and
    ``param_groups``) show, its declared name ignored. Any content gets an answer: one that
    matches no known layout is ``unrecognized (state keys: ...)``, family None."""
    states = [s for s in state_dict["state"].values() if isinstance(s, Mapping)]
    groups = [g for g in state_dict["param_groups"] if isinstance(g, Mapping)]
    empty = "" if states else NO_STATE_YET
    return _recognized(groups, states, quantized_formats(states), empty)


def quantized_formats(states: list[Mapping[str, Any]]) -> list[str]:
    """The formats of the leanopt quantized entries among ``states``."""
    return sorted(
        {str(v["format"]) for s in states for v in s.values() if isinstance(v, Mapping) and QuantizedState.is_state_dict(v)}
    )


def _recognized(groups: list[Mapping[str, Any]], states: list[Mapping[str, Any]], formats: list[str], empty: str) -> Recognized:
    keys = {str(k) for s in states for k in s}
    options = {str(k) for g in groups for k in g}
    betas = {len(g["betas"]) for g in groups if isinstance(g.get("betas"), (tuple, list))}
    # A state saved before the first step shows only its options: Adam's are a pair of betas and eps.
    adam_options = betas == {2} and "eps" in options
    quantized = f" ({', '.join(formats)})" if formats else ""

    if BNB_KEY in keys:
        nested = [s[BNB_KEY] for s in states if isinstance(s.get(BNB_KEY), Mapping)]
        eight = any(isinstance(n.get("state1"), torch.Tensor) and n["state1"].dtype == torch.uint8 for n in nested)
        label, peer = ("8-bit", 8) if eight else ("32-bit", 32)
        if betas == {3} or any(stacked_emas(n) for n in nested):
            return Recognized(f"bitsandbytes {label} (AdEMAMix, 3 states)", "ademamix", "bitsandbytes", peer)
        if any("unorm_vec" in n for n in nested):
            # An update-norm clip (LAMB, or max_unorm > 0) is part of the rule: not AdamW's.
            return Recognized(f"bitsandbytes {label} (2 states, update-norm clipping: LAMB or max_unorm)", None, "bitsandbytes", peer)
        if any("state2" in n for n in nested):
            return Recognized(f"bitsandbytes {label} (Adam-family, 2 states)", "adamw", "bitsandbytes", peer)
        # Lion, SGD momentum, RMSprop and Adagrad all save one state1 and the same options;
        # only eps tells two of them apart (Lion and momentum save 0.0).
        eps = {float(g["eps"]) for g in groups if isinstance(g.get("eps"), (int, float))}
        if eps == {0.0}:
            which = "Lion or SGD momentum"
        elif eps and 0.0 not in eps:
            which = "RMSprop or Adagrad"
        else:
            which = "Lion, SGD momentum, RMSprop or Adagrad"
        return Recognized(f"bitsandbytes {label} (1 state: {which})", None, "bitsandbytes", peer)
    subclasses = sorted({name for s in states for v in s.values() if (name := tensor_subclass(v)) is not None})
    if any(name.startswith("torchao.") for name in subclasses):
        names = ", ".join(n.rsplit(".", 1)[-1] for n in subclasses)
        adam = "exp_avg_sq" in keys
        widths = {TORCHAO_STATES.get(n) for n in subclasses}  # None: a class convert does not read
        return Recognized(f"torchao low-bit {'AdamW' if adam else 'optimizer'} ({names})", "adamw" if adam else None,
                          "torchao", widths.pop() if len(widths) == 1 else None)  # fmt: skip
    bits = sorted({g["state_bits"] for g in groups if isinstance(g.get("state_bits"), int)})
    # Muon: torch.optim.Muon's groups hold its Newton-Schulz options, KellerJordan's
    # MuonWithAuxAdam's say use_muon (and its aux groups hold AdamW's states beside them).
    # (Without those options, a momentum buffer beside Adam's moments is Muon's whole-model state.)
    if options & {"ns_coefficients", "ns_steps", "use_muon"} or ("momentum_buffer" in keys and "exp_avg_sq" in keys):
        if "optimizer" in options or "rounding" in options:
            where = "leanopt " + ("/".join(f"Muon{b}bit" for b in bits if any(g.get("use_muon", True) and g.get("state_bits") == b
                                                                           for g in groups)) or "Muon")  # fmt: skip
        elif "ns_steps" in options:
            where = "torch.optim.Muon"
        elif "use_muon" in options:
            where = "MuonWithAuxAdam (KellerJordan)"
        else:
            where = "Muon with an AdamW aux group"
        return Recognized(f"{where}{quantized}" + empty, "muon")
    if {"exp_avg_fast", "exp_avg_slow"} <= keys or (not states and betas == {3} and "alpha" in options):
        if not states and not bits:
            return Recognized("AdEMAMix (bitsandbytes or leanopt)" + empty, "ademamix")
        name = "/".join(f"AdEMAMix{b}bit" for b in bits) or "AdEMAMix"
        return Recognized(f"leanopt {name}{quantized}" + empty, "ademamix")
    # Lion's one momentum (leanopt's, timm's, lion-pytorch's): betas but no eps, no second moment.
    lion_options = betas == {2} and "eps" not in options
    if lion_options and ("exp_avg" in keys and not keys & _NOT_LION_KEYS if states else "weight_decay" in options):
        name = "/".join(f"Lion{b}bit" for b in bits) or "Lion"
        leanopt = "leanopt " if bits or "rounding" in options else ""
        return Recognized(f"{leanopt}{name}{quantized}" + empty, "lion")
    # SGD's one state (torch's and leanopt's momentum_buffer); without momentum none at all, so
    # its options tell it: momentum, dampening and nesterov.
    if "momentum_buffer" in keys or (not keys - {"step"} and {"momentum", "dampening", "nesterov"} <= options):
        stateless = all(not g.get("momentum") for g in groups)
        name = "/".join(f"SGD{b}bit" for b in bits) or "SGD"
        where = f"leanopt {name}" if bits or "rounding" in options else "torch.optim.SGD or leanopt SGD"
        return Recognized(f"{where}{quantized}" + ("" if stateless else empty), "sgd")
    adam_keys = "exp_avg_sq" in keys and not keys & {"exp_avg_sq_row", "RMS"}
    if bits and (adam_keys if states else adam_options):
        return Recognized(f"leanopt {'/'.join(f'AdamW{b}bit' for b in bits)}{quantized}" + empty, "adamw")
    if formats:
        adam = "exp_avg" in keys and "exp_avg_sq" in keys
        return Recognized(f"leanopt quantized {'AdamW ' if adam else ''}({', '.join(formats)})", "adamw" if adam else None)
    if "betas" in options and (adam_keys if states else adam_options):
        if "decoupled_weight_decay" in options:
            decoupled = any(g.get("decoupled_weight_decay") for g in groups)
            return Recognized(f"torch.optim.{'AdamW' if decoupled else 'Adam'}" + empty, "adamw")
        if options & _TORCH_GROUP_FLAGS:
            return Recognized("torch.optim.AdamW or Adam" + empty, "adamw")
        return Recognized(("leanopt AdamW" if states else "Adam-family") + empty, "adamw")
    if "RMS" in keys or (options >= {"scale_parameter", "relative_step"} and states and _int_steps(states)):
        return Recognized("Adafactor (transformers)" + empty, "adafactor")
    if options >= {"scale_parameter", "relative_step", "clip_threshold"}:
        return Recognized(("leanopt Adafactor" if states else "Adafactor (transformers or leanopt)") + empty, "adafactor")
    if keys & {"row_var", "col_var", "variance"} or "beta2_decay" in options:
        return Recognized("torch.optim.Adafactor" + empty)
    return Recognized(f"unrecognized (state keys: {', '.join(sorted(keys)) or 'none'})")


def tensor_subclass(value: Any) -> str | None:
    """The class path of a tensor-subclass state (``"torchao.optim.subclass_8bit.OptimState8bit"``),
    or None for anything else. A torchao state read without torchao
    (:mod:`leanopt.checkpoint_files`) answers with the torchao class it stands in for."""
    if not isinstance(value, torch.Tensor) or type(value) in (torch.Tensor, torch.nn.Parameter):
        return None
    return getattr(type(value), "torchao_class", None) or f"{type(value).__module__}.{type(value).__name__}"


def stacked_emas(nested: Mapping[str, Any]) -> bool:
    """bitsandbytes' AdEMAMix keeps its fast and slow EMAs stacked in one ``[2, *shape]`` state1."""
    one, two = nested.get("state1"), nested.get("state2")
    return (
        isinstance(one, torch.Tensor) and isinstance(two, torch.Tensor)
        and one.dim() == two.dim() + 1 and one.shape[0] == 2 and one.shape[1:] == two.shape
    )  # fmt: skip


def _int_steps(states: list[Mapping[str, Any]]) -> bool:
    return any(isinstance(s.get("step"), int) for s in states)
