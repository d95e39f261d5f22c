"""Every leanopt optimizer, declared once; every generic, contract, backend-parity, memory,
integration and checkpoint test iterates this list, and no test file keys on an optimizer's
name or family: what differs between optimizers is declared here.

Add an entry when you add an optimizer (``test_registry_lists_every_registered_optimizer``
fails until you do). ``kwargs`` are what the generic tests construct it
with (they must make a loss go down on a small regression in 30 steps); ``invalid`` lists
hyper-parameter sets that must raise ``ValueError``; ``reference`` the published
implementation it is held to; ``bytes_per_param`` the bound on its state; ``from_training_args``
what ``optimizer_cls_and_kwargs`` fills from ``TrainingArguments`` besides ``lr``, ``state_kwargs``
what tests add to the class's defaults to get a state.

:data:`EXTERNAL` holds optimizers defined outside leanopt with its public API
(tests/external_optimizer.py): the generic suite (:data:`GENERIC`) runs them too, each
registered only while its own tests run (:func:`registered`).

Families. Each case names its ``family``: the code path its state and its step take, which is
what a mechanism that does not depend on the update rule (hooks, strided layouts, tensor
learning rates, check-before-change, ``torch.compile``, schedulers) can differ by, and one case
per family ``represents`` it: tests of such a mechanism iterate :func:`representatives` of a
list, and a rule's own behaviour (its parity with the reference and its peer, its hyper-
parameters, its state, save and load, its integrations) stays checked for every case. The
families (not the rule families of ``cls.family``, which group optimizers that share a rule):

- ``"fused-adamw"``: AdamW, two dense states, stepped on the CPU by torch's fused AdamW kernel;
- ``"dense"``: the other rules with dense fp32 states (Lion, one state, represents them;
  AdEMAMix, SGD), stepped on the CPU by the native C++ loop or a compiled graph;
- ``"quantized"``: block-quantized 8- and 4-bit states (AdamW8bit represents them);
- ``"factored"``: Adafactor, row and column factors and its own kernels;
- ``"muon"``: Muon and its 8-/4-bit momentum: matrices orthogonalized whole (Newton-Schulz), the
  rest stepped by an AdamW-family rule in the same optimizer, built over ``param_groups`` (Muon
  represents them);
- ``"external"``: rules defined outside leanopt with its public API, registered while their
  tests run, without a Triton or C++ twin (RMSprop represents them);
- ``"bf16-states"``: the storage variants, dense states stored in bf16 with stochastic
  rounding (:data:`BF16_STATES`; AdamW's represents them).

``tests/test_rules.py::test_every_family_has_one_representative`` keeps one per family.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

import leanopt
from leanopt.optim.registry import REGISTRY
from external_optimizer import RMSprop, RMSprop8bit


@dataclass(frozen=True)
class Reference:
    """A published implementation of the same rule (optimi's ``OptTest``): ``path`` is its
    class (``"torch.optim.SGD"``), built with the case's kwargs merged with each of
    ``variants`` and with ``extra`` (options only the reference takes, e.g. ``optim_bits=32``);
    after ``steps`` steps on fresh random inputs every param is within ``rtol`` of the
    reference's largest |value| (tests/test_rules.py::test_matches_its_reference)."""

    path: str
    variants: tuple[dict[str, Any], ...] = ({},)
    extra: dict[str, Any] = field(default_factory=dict)
    rtol: float = 1e-6
    steps: int = 20
    # The shape of the param stepped (Muon's rule is defined on matrices only).
    shape: tuple[int, ...] = (4099,)


@dataclass(frozen=True)
class OptimizerCase:
    name: str
    cls: type
    kwargs: dict[str, Any]
    invalid: list[dict[str, Any]] = field(default_factory=list)
    # Keyword for the learning rate (None: the optimizer has no plain lr to set to 1e-30).
    lr_key: str | None = "lr"
    # Complex params: True if stepped as torch does (on the real view), False if the
    # constructor (and add_param_group, estimate) must raise a ValueError naming the param.
    supports_complex: bool = False
    # Backends the generic suite runs (triton runs under TRITON_INTERPRET=1 when installed).
    backends: tuple[str, ...] = ("reference", "cpu", "triton")
    # Constructor defaults that differ on purpose from a class in ``cls.references`` (the classes
    # whose positional order and defaults it keeps): {reference path: {parameter: why}}.
    reference_differences: dict[str, dict[str, str]] = field(default_factory=dict)
    # The published implementation of its rule (None: a quantized sibling, held to its peer's
    # drift instead, tests/test_rules.py).
    reference: Reference | None = None
    # State bytes per param of a 1024 x 1024 weight built with ``kwargs``, its step left out.
    bytes_per_param: float = 0.0
    # Drift from its fp32 rule against bitsandbytes' 8-bit optimizer's from its own
    # (benchmarks/lowbit_vs_bnb.py): mean distance at most these multiples of the peer's per
    # workload, and the largest at most ``"max"`` times (None: not held). None: no such peer.
    peer_drift: dict[str, float | None] | None = None
    # What optimizer_cls_and_kwargs(name, args) fills besides lr, from TrainingArguments ``args``.
    from_training_args: Callable[[Any], dict[str, Any]] = field(default=lambda args: {})
    # What tests add to the class's own defaults where they need a state to save, resume or
    # skip elements in (SGD: a momentum; without one it keeps none).
    state_kwargs: dict[str, Any] = field(default_factory=dict)
    # tests/test_rounding.py: bf16 params at lr 1e-4, distance from the fp32 run after 100 steps
    # with stochastic / Kahan rounding, at most these fractions of nearest rounding's.
    rounding_drift: dict[str, float] = field(default_factory=lambda: {"stochastic": 0.6, "kahan": 0.25})
    # Defined outside leanopt (tests/external_optimizer.py): registered only while its tests run.
    external: bool = False
    # The code path its state and step take (module docstring); ``represents``: the case that
    # runs its family's rule-independent mechanism tests.
    family: str = ""
    represents: bool = False
    # What it is built over, from a model or a list of params or param groups (Muon refuses a
    # param of < 2 dims in a Muon group: leanopt.muon_groups puts biases and norms in an aux group).
    param_groups: Callable[[Any], Any] = field(default=lambda model: _params(model))
    # Runs on FSDP2 (DTensor) params (tests/test_distributed.py, the DCP conversions).
    sharded: bool = True
    # leanopt.plan and leanopt.doctor model its step (tests/test_doctor.py).
    planned: bool = True

    def __str__(self) -> str:  # pytest ids
        return self.name


def _params(model: Any) -> Any:
    return model.parameters() if isinstance(model, torch.nn.Module) else model


ADAM_INVALID = [
    {"lr": -1e-3},
    {"eps": -1e-8},
    {"weight_decay": -0.1},
    {"betas": (1.0, 0.999)},
    {"betas": (0.9, 1.0)},
    {"betas": (-0.1, 0.999)},
    {"lr": float("nan")},
    {"rounding": "up"},
]

# Each set is invalid on its own and merged over the registry kwargs below (relative_step=False, lr set).
ADAFACTOR_INVALID = [
    {"lr": 1e-3, "relative_step": True},
    {"warmup_init": True, "relative_step": False, "lr": 1e-3},
    {"relative_step": False, "lr": None},
    {"lr": -1e-3, "relative_step": False},
    {"lr": float("nan"), "relative_step": False},
    {"eps": (-1e-30, 1e-3)},
    {"eps": (1e-30, -1e-3)},
    {"eps": 1e-3},
    {"eps": (1e-30,)},
    {"clip_threshold": -1.0},
    {"clip_threshold": 0.0},
    {"decay_rate": 0.5},
    {"beta1": 1.0},
    {"beta1": -0.1},
    {"weight_decay": -0.1},
    {"rounding": "truncate"},
]

# Quantized AdamW: amsgrad is refused, storage options are validated.
LOWBIT_INVALID = ADAM_INVALID + [{"amsgrad": True}] + [
    {"block_size": 0},
    {"block_size": 1.5},
    {"block_size": 2**20},  # past leanopt.quant.formats.MAX_BLOCK_SIZE
    {"min_quant_size": -1},
]

LION_INVALID = [
    {"lr": -1e-4},
    {"weight_decay": -0.1},
    {"betas": (1.0, 0.99)},
    {"betas": (0.9, 1.0)},
    {"betas": (0.9, 0.99, 0.999)},
    {"lr": float("nan")},
    {"rounding": "up"},
]

ADEMAMIX_INVALID = [
    {"lr": -1e-3},
    {"eps": -1e-8},
    {"weight_decay": -0.1},
    {"alpha": -1.0},
    {"betas": (0.9, 0.999)},
    {"betas": (0.9, 0.999, 1.0)},
    {"betas": (0.9, 1.0, 0.9999)},
    {"t_alpha": 0},
    {"t_beta3": 2.5},
    {"lr": float("nan")},
    {"rounding": "up"},
]

STORAGE_INVALID = [
    {"block_size": 0},
    {"block_size": 1.5},
    {"block_size": 2**20},  # past leanopt.quant.formats.MAX_BLOCK_SIZE
    {"min_quant_size": -1},
]

SGD_INVALID = [
    {"lr": -1e-3},
    {"lr": float("nan")},
    {"momentum": -0.9},
    {"weight_decay": -0.1},
    {"dampening": float("nan")},
    {"nesterov": True, "momentum": 0.0},
    {"nesterov": True, "dampening": 0.1},
    {"nesterov": 1},
    {"maximize": "yes"},
    {"rounding": "up"},
]

MUON_INVALID = [
    {"lr": -1e-3},
    {"lr": float("nan")},
    {"momentum": -0.9},
    {"weight_decay": -0.1},
    {"ns_steps": 100},
    {"ns_coefficients": (3.4445, -4.775)},
    {"eps": 0.0},
    {"adjust_lr_fn": "spectral"},
    {"nesterov": 1},
    {"aux": "lion"},
    {"rounding": "up"},
]

RMSPROP_INVALID = [{"lr": -1e-3}, {"alpha": 1.0}, {"eps": -1.0}, {"weight_decay": float("nan")}, {"maximize": 1}]


def _adam_args(args: Any) -> dict[str, Any]:
    return {"betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon}


# Trainer fills each rule's options as it fills its own optim names: Lion has no eps,
# AdEMAMix's third beta is its own default (Trainer has two), Adafactor steps by lr.
LION_ARGS = lambda args: {"betas": (args.adam_beta1, args.adam_beta2)}  # noqa: E731
ADEMAMIX_ARGS = lambda args: {"betas": (args.adam_beta1, args.adam_beta2, 0.9999), "eps": args.adam_epsilon}  # noqa: E731
ADAFACTOR_ARGS = lambda args: {"relative_step": False, "scale_parameter": False}  # noqa: E731

# Every flag combination torch.optim.SGD accepts (nesterov needs a momentum and no dampening).
SGD_VARIANTS = tuple(
    dict(momentum=m, dampening=d, nesterov=n, weight_decay=wd, maximize=mx)
    for m in (0.0, 0.9) for d in (0.0, 0.3) for n in (False, True) for wd in (0.0, 0.01) for mx in (False, True)
    if not (n and (m == 0 or d != 0))
)  # fmt: skip

# An 8-bit optimizer's drift: within 5 % of bitsandbytes' 8-bit mean distance or better, its
# largest within 1.5x.
EIGHT_BIT_DRIFT = {"dense": 1.05, "sparse": 1.05, "max": 1.5}

# SGD's steps at lr 1e-4 are lr * |buffer| ~ 1e-5, a fiftieth of a bf16 ulp, where AdamW's are
# ~lr: stochastic rounding moves the params as far as fp32 does (2.13 vs 2.07) but its noise,
# and the bf16 gradients themselves (Kahan's distance is ~1.3 at lr 1e-4, 1e-3 and 1e-2 alike),
# dominate the distance. Measured: stochastic 0.89x, Kahan 0.57x nearest's distance.
SGD_ROUNDING_DRIFT = {"stochastic": 0.95, "kahan": 0.65}

OPTIMIZERS: list[OptimizerCase] = [
    OptimizerCase("adamw", leanopt.AdamW, {"lr": 1e-2}, ADAM_INVALID, supports_complex=True,
                  reference=Reference("torch.optim.AdamW", ({}, {"amsgrad": True, "maximize": True})),
                  bytes_per_param=8.0, from_training_args=_adam_args, family="fused-adamw", represents=True),  # fmt: skip
    # The generic model's first weight (8192 elements) is quantized, the rest keep fp32 states.
    OptimizerCase("adamw8bit", leanopt.AdamW8bit, {"lr": 1e-2}, LOWBIT_INVALID, bytes_per_param=2.04,
                  from_training_args=_adam_args, family="quantized", represents=True),  # fmt: skip
    OptimizerCase("adamw4bit", leanopt.AdamW4bit, {"lr": 1e-2}, LOWBIT_INVALID, bytes_per_param=1.07,
                  from_training_args=_adam_args, family="quantized"),  # fmt: skip
    OptimizerCase(
        "adafactor",
        leanopt.Adafactor,
        # beta1 so the generic suite also saves, copies and measures the full-size exp_avg.
        {"lr": 1e-2, "beta1": 0.9, "relative_step": False, "scale_parameter": False},
        ADAFACTOR_INVALID,
        lr_key="lr",
        reference=Reference("transformers.optimization.Adafactor", rtol=1e-5),
        # exp_avg (4 B/param) and the row/column factors: 4 (1024 + 1024) / 1024^2.
        bytes_per_param=4.01,
        from_training_args=ADAFACTOR_ARGS,
        family="factored",
        represents=True,
    ),
    OptimizerCase("lion", leanopt.Lion, {"lr": 1e-3}, LION_INVALID, bytes_per_param=4.0, from_training_args=LION_ARGS,
                  reference=Reference("bitsandbytes.optim.Lion", ({}, {"weight_decay": 0.1}), {"optim_bits": 32}),
                  family="dense", represents=True),  # fmt: skip
    OptimizerCase("lion8bit", leanopt.Lion8bit, {"lr": 1e-3}, LION_INVALID + STORAGE_INVALID, bytes_per_param=1.02,
                  from_training_args=LION_ARGS, peer_drift=EIGHT_BIT_DRIFT, family="quantized"),  # fmt: skip
    # Lion4bit has no 4-bit peer and is held to bitsandbytes' Lion8bit: its 15-level momentum
    # drifts 12x as far on dense gradients and 4x on sparse ones (measured), so the bound only
    # guards that figure against regressions.
    OptimizerCase("lion4bit", leanopt.Lion4bit, {"lr": 1e-3}, LION_INVALID + STORAGE_INVALID, bytes_per_param=0.54,
                  from_training_args=LION_ARGS, peer_drift={"dense": 13.0, "sparse": 4.5, "max": None}, family="quantized"),  # fmt: skip
    OptimizerCase("ademamix", leanopt.AdEMAMix, {"lr": 1e-2}, ADEMAMIX_INVALID, bytes_per_param=12.0,
                  from_training_args=ADEMAMIX_ARGS,
                  reference=Reference("bitsandbytes.optim.AdEMAMix", ({"t_alpha": 10, "t_beta3": 10},),
                                      {"optim_bits": 32}), family="dense"),  # fmt: skip
    OptimizerCase("ademamix8bit", leanopt.AdEMAMix8bit, {"lr": 1e-2, "t_alpha": 10, "t_beta3": 10},
                  ADEMAMIX_INVALID + STORAGE_INVALID, bytes_per_param=3.05, from_training_args=ADEMAMIX_ARGS,
                  peer_drift=EIGHT_BIT_DRIFT, family="quantized"),  # fmt: skip
    # Trainer passes lr only: SGD's default momentum 0 would keep no state to save and resume.
    OptimizerCase("sgd", leanopt.SGD, {"lr": 1e-2, "momentum": 0.9}, SGD_INVALID, supports_complex=True,
                  state_kwargs={"momentum": 0.9}, rounding_drift=SGD_ROUNDING_DRIFT,
                  reference=Reference("torch.optim.SGD", SGD_VARIANTS), bytes_per_param=4.0, family="dense"),  # fmt: skip
    OptimizerCase("sgd8bit", leanopt.SGD8bit, {"lr": 1e-2, "momentum": 0.9}, SGD_INVALID + STORAGE_INVALID,
                  bytes_per_param=1.02, peer_drift=EIGHT_BIT_DRIFT, state_kwargs={"momentum": 0.9},
                  rounding_drift=SGD_ROUNDING_DRIFT, family="quantized",
                  reference_differences={"bitsandbytes.optim.SGD8bit": {
                      "lr": "bitsandbytes' SGD8bit has no default lr; leanopt keeps torch.optim.SGD's 1e-3"}}),  # fmt: skip
]

# Muon over a whole model: its matrices orthogonalized, the rest (biases here) in an AdamW group.
# Held to torch.optim.Muon itself on a matrix (bit-identical: rtol 0), as tests/test_muon.py
# holds it over 100 steps on every shape class. Trainer's one learning rate: match_rms_adamw
# scales Muon's update to AdamW's RMS, so the same lr serves both rules.
# Muon's updates are orthogonalized: every element moves by about lr / sqrt(cols) each step, none
# by nothing, so nearest rounding loses (or keeps) whole steps alike and stochastic rounding's
# per-step noise is a larger share of the distance than for AdamW's. Measured (2026-12-03):
# stochastic 0.70x / 0.72x / 0.65x and Kahan 0.21x / 0.24x / 0.23x nearest's distance (Muon,
# Muon8bit, Muon4bit).
MUON_ROUNDING_DRIFT = {"stochastic": 0.8, "kahan": 0.3}
MUON_ARGS = lambda args: {"weight_decay": args.weight_decay, "adjust_lr_fn": "match_rms_adamw",  # noqa: E731
                          "aux_betas": (args.adam_beta1, args.adam_beta2), "aux_eps": args.adam_epsilon}
OPTIMIZERS += [
    OptimizerCase("muon", leanopt.Muon, {"lr": 0.02}, MUON_INVALID, param_groups=leanopt.muon_groups, bytes_per_param=4.0, rounding_drift=MUON_ROUNDING_DRIFT,
                  family="muon", represents=True,
                  reference=Reference("torch.optim.Muon", ({}, {"nesterov": False, "adjust_lr_fn": "match_rms_adamw"}), rtol=0.0,
                                      shape=(96, 40)),
                  from_training_args=MUON_ARGS),  # fmt: skip
    OptimizerCase("muon8bit", leanopt.Muon8bit, {"lr": 0.02}, MUON_INVALID + STORAGE_INVALID, param_groups=leanopt.muon_groups,
                  bytes_per_param=1.02, from_training_args=MUON_ARGS, rounding_drift=MUON_ROUNDING_DRIFT,
                  family="muon"),  # fmt: skip
    OptimizerCase("muon4bit", leanopt.Muon4bit, {"lr": 0.02}, MUON_INVALID + STORAGE_INVALID, param_groups=leanopt.muon_groups,
                  bytes_per_param=0.54, from_training_args=MUON_ARGS, rounding_drift=MUON_ROUNDING_DRIFT,
                  family="muon"),  # fmt: skip
]

# RMSprop against torch's: with weight decay and maximize, an element whose -g and wd * p nearly
# cancel keeps only a few significant bits of its effective gradient, and its first steps are
# +-10 lr whatever their size (v = 0.01 g^2): the two implementations' last-bit differences there
# grow to ~1e-5 of the largest param. 3,001 seeds of test_rules.test_matches_its_reference on the
# CPU backend (2026-12-05): median 6.6e-8, 99th percentile 3.1e-7, the largest 9.3e-6; 4 were over
# 1e-6, the seed of a failed suite run among them. 3e-5 holds the tail with a margin of 3.
RMSPROP_RTOL = 3e-5

EXTERNAL: list[OptimizerCase] = [
    OptimizerCase("rmsprop", RMSprop, {"lr": 1e-3}, RMSPROP_INVALID, backends=("reference", "cpu"), external=True,
                  reference=Reference("torch.optim.RMSprop", ({}, {"weight_decay": 0.01, "maximize": True}), rtol=RMSPROP_RTOL),
                  bytes_per_param=4.0, family="external", represents=True),  # fmt: skip
    OptimizerCase("rmsprop8bit", RMSprop8bit, {"lr": 1e-3}, RMSPROP_INVALID + STORAGE_INVALID,
                  backends=("reference", "cpu"), external=True, bytes_per_param=1.02, family="external"),  # fmt: skip
]


def _bf16_states(case: OptimizerCase) -> OptimizerCase:
    """``case`` with ``state_dtype=torch.bfloat16``: half its dense state's bytes, stochastically
    rounded (leanopt.quant.bf16). Its published reference keeps fp32 states: the bf16 rule is
    held to leanopt's own reference backend instead (tests/test_bf16_states.py)."""
    return dataclasses.replace(case, name=f"{case.name}-bf16-states", kwargs={**case.kwargs, "state_dtype": torch.bfloat16},
                               reference=None, bytes_per_param=case.bytes_per_param / 2, supports_complex=False,
                               family="bf16-states", represents=case.represents and case.family == "fused-adamw")  # fmt: skip


# Storage variants: every elementwise optimizer with dense states, its states stored in bf16
# (the low-bit classes keep their block-quantized storage; Adafactor has no state_dtype).
BF16_STATES: list[OptimizerCase] = [
    _bf16_states(c) for c in OPTIMIZERS + EXTERNAL
    if issubclass(c.cls, leanopt.ElementwiseOptimizer) and not issubclass(c.cls, leanopt.LowBit)
]

# What the generic suite runs: the library's optimizers, the ones defined outside it, and the
# storage variants of one optimizer per number of states (1, 2, 3: a bf16 graph is compiled per
# rule, 30-90 s each on 2 cores; the rounding is the same code for every rule, and
# tests/test_bf16_states.py holds every BF16_STATES case to the reference on every backend).
def _state_count(case: OptimizerCase) -> int:
    """How many states ``case`` keeps per param under its own kwargs."""
    opt = case.cls([torch.nn.Parameter(torch.zeros(1))], **case.kwargs)
    return len(opt.state_keys(opt.param_groups[0]))


_BY_STATE_COUNT = {_state_count(c): c for c in reversed(BF16_STATES) if not c.external}
GENERIC: list[OptimizerCase] = OPTIMIZERS + EXTERNAL + [c for c in BF16_STATES if c in _BY_STATE_COUNT.values()]


@contextlib.contextmanager
def registered(case: OptimizerCase) -> Iterator[None]:
    """``case``'s class (an external one: with its family) in leanopt's registry for the block,
    as its author's ``leanopt.register`` would put it; the library's own are always there."""
    if not case.external:
        yield
        return
    family = [c for c in EXTERNAL if c.cls.family == case.cls.family]
    added = [c.cls for c in family if c.name not in REGISTRY]
    for cls in added:
        leanopt.register(cls)
    try:
        yield
    finally:
        for cls in added:
            REGISTRY.pop(cls.name, None)


# ---- what the contract and integration suites run ----------------------------------------------
# Every registered optimizer: the library's and those defined outside it (registered while their
# tests run, tests/conftest.py), each under its own name, which Trainer, Accelerate and Lightning
# are given. GENERIC's storage variants are no optimizer of their own and have no such name.
REGISTERED: list[OptimizerCase] = OPTIMIZERS + EXTERNAL


def representatives(cases: list[OptimizerCase]) -> list[OptimizerCase]:
    """The cases of ``cases`` that represent their family (module docstring): what a test of a
    mechanism that does not depend on the update rule iterates."""
    return [c for c in cases if c.represents]
