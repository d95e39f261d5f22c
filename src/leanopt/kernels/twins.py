"""What each compiled twin of a rule takes: the one place a backend's limits are declared.

A rule (:class:`leanopt.kernels.rules.Rule`) is written once as tensor maths; the Triton
helpers (:mod:`leanopt.kernels.triton_rules`) and the C++ kernel (``cpu_native.cpp``) hold
hand-written twins of some rules, which read the scalars by position, the flags as bits, and
a fixed number of states. Each twin is declared here, by the rule it copies: the scalar names
it reads at each position, the flags it reads, and the numbers of states it takes.
:func:`takes` answers whether a twin runs a rule under given hyper-parameters -- only a shipped
rule (:func:`leanopt.kernels.rules.rule_id`) whose description matches the twin's, with a
number of states the twin takes -- and :func:`leanopt.kernels.select` routes everything else
to a backend that runs the rule's own ``elementwise``: a rule defined outside leanopt, a
number of states a twin has no loop for, a rule whose scalars were renamed or
reordered without its twin (``tests/test_rules.py`` fails on that too). No import of Triton
here: the decision is made before any kernel module is imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from leanopt.kernels.rules import Rule, rule_id


@dataclass(frozen=True)
class Twin:
    """A compiled copy of rule ``rule``: reads ``scalars`` at positions 0, 1, ... of its scalar
    row, ``flags`` (as ``FLAGS`` bits: bit k is ``flags[k]``), and takes these numbers of states."""

    rule: str
    scalars: tuple[str, ...]
    flags: tuple[str, ...]
    states: tuple[int, ...]


# The positions each twin's code reads, written out as the code reads them (not copied from the
# rule): a rule whose scalars are renamed, reordered or added to no longer matches its twin and
# runs elsewhere until the twin is updated, instead of the twin reading the wrong numbers.
_ADAMW = ("decay", "lerp_weight", "beta2", "one_minus_beta2", "eps", "step_size", "bc2_sqrt", "floor")
_LION = ("decay", "beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "lr")
_ADEMAMIX = ("decay", "beta1", "one_minus_beta1", "beta3", "one_minus_beta3", "beta2", "one_minus_beta2", "bc1", "alpha",
             "bc2_sqrt", "eps", "lr", "floor_fast", "floor_slow")  # fmt: skip
_SGD = ("weight_decay", "momentum", "buffer_decay", "buffer_weight", "lr")
_MUON_MOMENTUM = ("lerp_weight", "momentum")

# The Triton helpers (triton_rules.rule_update): up to three states, zero states too.
TRITON: dict[str, Twin] = {
    "adamw": Twin("adamw", _ADAMW, ("amsgrad",), (2, 3)),
    "lion": Twin("lion", _LION, (), (1,)),
    "ademamix": Twin("ademamix", _ADEMAMIX, (), (3,)),
    "sgd": Twin("sgd", _SGD, ("nesterov",), (0, 1)),
}
# The C++ kernel (cpu_native.cpp's R<...> structs): one to three states, and SGD without a
# momentum (no state: its dense loop only). Muon's momentum has a twin here and none in Triton:
# on CUDA it runs as a compiled graph.
NATIVE: dict[str, Twin] = {
    "adamw": Twin("adamw", _ADAMW, ("amsgrad",), (2, 3)),
    "lion": Twin("lion", _LION, (), (1,)),
    "ademamix": Twin("ademamix", _ADEMAMIX, (), (3,)),
    "sgd": Twin("sgd", _SGD, ("nesterov",), (0, 1)),
    "muon_momentum": Twin("muon_momentum", _MUON_MOMENTUM, ("nesterov",), (1,)),
}


def takes(twins: Mapping[str, Twin], rule: Any, hp: Mapping[str, Any], n_states: int | None = None) -> bool:
    """Whether a twin in ``twins`` runs ``rule`` under ``hp`` with ``n_states`` states (default:
    the rule's own number under ``hp``)."""
    if not isinstance(rule, Rule) or rule_id(rule) is None:
        return False
    twin = twins.get(rule.name)
    if twin is None or twin.scalars != rule.scalars or twin.flags != rule.flags:
        return False
    n = len(rule.states(hp)) if n_states is None else n_states
    return n in twin.states


def flag_bits(rule: Rule, hp: Mapping[str, Any]) -> int:
    """The rule's flags under ``hp`` as the twins read them: bit k is ``rule.flags[k]``."""
    bits = 0
    for k, name in enumerate(rule.flags):
        if hp[name]:
            bits |= 1 << k
    return bits
