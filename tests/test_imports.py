"""What ``import leanopt`` costs and what its public names are (the habits of a maintained
library): the planner is imported on first use, not with the optimizers; the
optimizer names follow the registry; every optimizer's ``lr`` is hinted ``float | Tensor``."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import typing

import pytest
import torch

import leanopt
from leanopt.optim.registry import REGISTRY
from external_optimizer import RMSprop
from registry import OPTIMIZERS

# The planner (a FakeTensorMode tracer and its CUDA emulation), the doctor built on it, and
# transformers (the model presets of `leanopt estimate` / `plan`).
PLANNER = ("leanopt.memory.plan", "leanopt.memory.plan_trace", "leanopt.memory.plan_check", "leanopt.memory.plan_fsdp",
           "leanopt.memory.doctor", "leanopt.memory.presets", "leanopt.memory.cuda_emulation", "transformers")  # fmt: skip

PROBE = """
import json, sys
import leanopt
before = sorted(m for m in {planner} if m in sys.modules)
plan, doctor = leanopt.plan, leanopt.doctor
print(json.dumps(dict(before=before, after=sorted(m for m in {planner} if m in sys.modules),
                      plan=plan.__module__ + "." + plan.__name__, doctor=doctor.__module__ + "." + doctor.__name__,
                      listed=all(n in dir(leanopt) for n in leanopt.__all__))))
"""


def test_import_leanopt_leaves_the_planner_and_transformers_unimported() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE.format(planner=repr(PLANNER))], capture_output=True, text=True,
                         timeout=300, check=True)  # fmt: skip
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["before"] == [], f"`import leanopt` imported {got['before']}"
    # The public names still resolve, to the planner's own functions, which import it then.
    assert (got["plan"], got["doctor"]) == ("leanopt.memory.plan.plan", "leanopt.memory.doctor.doctor")
    assert {"leanopt.memory.plan", "leanopt.memory.doctor"} <= set(got["after"])
    assert got["listed"], "dir(leanopt) misses a name of leanopt.__all__"


def test_every_public_name_resolves_and_unknown_ones_raise() -> None:
    for name in leanopt.__all__:
        assert getattr(leanopt, name) is not None, name
    from leanopt.memory.plan import plan

    assert leanopt.plan is plan
    with pytest.raises(AttributeError, match="no_such_name"):
        getattr(leanopt, "no_such_name")


def test_optimizer_names_list_an_optimizer_registered_after_import() -> None:
    probe = type("Probe", (RMSprop,), {"name": "probe-rmsprop"})
    assert "probe-rmsprop" not in leanopt.OPTIMIZER_NAMES
    leanopt.register(probe)
    try:
        assert leanopt.OPTIMIZER_NAMES["probe-rmsprop"] == "leanopt:Probe"
        assert "probe-rmsprop" in leanopt.memory.OPTIMIZER_NAMES and "probe-rmsprop" in list(leanopt.OPTIMIZER_NAMES)
        assert len(leanopt.OPTIMIZER_NAMES) == len(list(leanopt.OPTIMIZER_NAMES))
        assert leanopt.memory.resolve_optimizer("Probe-RMSprop") is probe
    finally:
        REGISTRY.pop("probe-rmsprop")
    assert "probe-rmsprop" not in leanopt.OPTIMIZER_NAMES
    # The peers come after leanopt's own, in registration order.
    names = list(leanopt.OPTIMIZER_NAMES)
    assert names[: len(REGISTRY)] == list(REGISTRY) and "torch-adamw" in names[len(REGISTRY):]


def test_every_optimizer_hints_lr_as_float_or_tensor() -> None:
    for case in OPTIMIZERS:
        hint = inspect.signature(case.cls).parameters[case.lr_key].annotation
        resolved = eval(hint, {"torch": torch}) if isinstance(hint, str) else hint
        assert {float, torch.Tensor} <= set(typing.get_args(resolved)), f"{case.name}: lr is hinted {hint!r}"


# Building and saving an optimizer in a fresh process (a CLI command, the planner's probe, a
# worker): torch guards add_param_group, zero_grad, state_dict and load_state_dict against
# dynamo's tracing, and the guard's first call imports dynamo (~1.1 s of CPU); leanopt calls the
# function under the guard until dynamo is imported (optim.base._unguarded).
BUILD_AND_SAVE = """
import json, sys, torch, leanopt
for name, cls in leanopt.optim.REGISTRY.items():
    ps = [torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(4))]
    opt = cls(leanopt.muon_groups(ps)) if cls.family == "muon" else cls(ps)
    opt.zero_grad()
    opt.load_state_dict(opt.state_dict())
print(json.dumps(sorted(m for m in sys.modules if m == "torch._dynamo" or m.startswith("torch._dynamo."))))
"""


def test_building_and_saving_an_optimizer_leaves_dynamo_unimported() -> None:
    out = subprocess.run([sys.executable, "-c", BUILD_AND_SAVE], capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
    # Once dynamo is imported (here, in the suite's process), torch's guarded methods run.
    import torch._dynamo  # noqa: F401

    from leanopt.optim.base import _unguarded

    opt = leanopt.AdamW([torch.nn.Parameter(torch.zeros(2))])
    for name in ("add_param_group", "zero_grad", "state_dict", "load_state_dict"):
        bound = getattr(torch.optim.Optimizer, name).__get__(opt)
        assert _unguarded(bound) is bound, name
