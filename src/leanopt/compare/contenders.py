"""The optimizers a comparison can run: leanopt's and the peers', by name, resolved lazily.

Every contender of one family gets the same hyper-parameters except the learning rate, which
is tuned per optimizer on a grid centred on its usual default (:meth:`Contender.lr_centre`):
the AdamW family torch's defaults (betas (0.9, 0.999), eps 1e-8) and the task's
``weight_decay``; the Adafactor family a fixed step size (``relative_step=False``,
``scale_parameter=False``, no ``beta1``) under the shared warm-up + cosine schedule, plus one
grid point with its own relative step (:data:`RELATIVE`: ``relative_step=True``,
``scale_parameter=True``, no external schedule). Any other name in
``leanopt.memory.OPTIMIZER_NAMES`` runs with only ``lr`` and ``weight_decay`` set.

Training modes: bf16 weights with Kahan summation or stochastic rounding are not in the library
yet; gradient release (``leanopt.release_gradients``) is, but is not a contender yet (it wraps
the training loop rather than the optimizer's kwargs, so the runner has to call it). Each will be
a contender here (a name, a family, how to switch it on).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Union

import torch

from leanopt.memory import OPTIMIZER_NAMES, resolve_optimizer


# A grid point: a learning rate, or RELATIVE for Adafactor's own relative step size.
RELATIVE = "relative"
LR = Union[float, str]

# The lr each family is usually run with, relative to AdamW's 1e-3 (torch's default): a task
# states the AdamW-family centre and every family's grid is centred on it times this factor.
ADAMW_DEFAULT_LR = 1e-3


@dataclass(frozen=True)
class Contender:
    name: str
    # Which hyper-parameters it is given: "adamw", "adafactor", or "plain" (lr and weight decay).
    family: str
    origin: str  # "leanopt" or the peer's package
    # "module:attribute" for peers outside leanopt's registry; None: leanopt.memory.OPTIMIZER_NAMES.
    target: str | None = None
    # Why it is left out of a --quick run on the CPU unless named (None: it is not).
    slow_on_cpu: str | None = None
    # Its usual default lr (torch's AdamW 1e-3; HF's recommended fixed-lr Adafactor 1e-3;
    # torch.optim.Adafactor 1e-2, whose lr caps the relative step).
    default_lr: float = ADAMW_DEFAULT_LR
    # Seconds its warm-up spends compiling the update on the CPU (2 cores, measured here, between
    # a warm and a cold compile cache): the prior of the time-left estimate for a set-up not yet
    # seen (a compile takes 10-1000x any other optimizer's set-up).
    cpu_compile_s: float = 0.0

    def lr_centre(self, task_lr: float) -> float:
        """The centre of this optimizer's lr grid when AdamW's is ``task_lr``."""
        return task_lr * self.default_lr / ADAMW_DEFAULT_LR

    def lr_grid(self, task_lr: float, multipliers: Iterable[float], *, relative: bool = True) -> list[LR]:
        """The lrs tried: the centre times each multiplier, then RELATIVE for the Adafactor family."""
        centre = self.lr_centre(task_lr)
        grid: list[LR] = [float(f"{centre * m:.6g}") for m in multipliers]
        if relative and self.family == "adafactor":
            grid.append(RELATIVE)
        return grid

    def scheduled(self, lr: LR) -> bool:
        """Whether the task's warm-up + cosine schedule drives this lr (not a relative step)."""
        return lr != RELATIVE

    def load(self) -> type:
        """The optimizer class (imports the peer). Raises ``ValueError`` when unavailable."""
        if self.target is None:
            return resolve_optimizer(self.name)
        module, attr = self.target.split(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"{self.target.replace(':', '.')} is not available here ({err})") from None

    def unavailable(self) -> str | None:
        """Why this contender cannot run here, found without importing heavy peers; None if it may."""
        if self.origin == "leanopt":
            try:
                resolve_optimizer(self.name)
            except ValueError as err:
                return str(err)
            return None
        module = (self.target or OPTIMIZER_NAMES.get(self.name, "")).split(":")[0]
        top = module.split(".")[0]
        if top and importlib.util.find_spec(top) is None:
            return f"{top} is not installed"
        return None

    def kwargs(self, *, lr: LR, weight_decay: float, device: torch.device) -> dict[str, Any]:
        if self.family == "adafactor" and lr == RELATIVE:
            return {
                "lr": None,
                "relative_step": True,
                "scale_parameter": True,
                "warmup_init": False,
                "weight_decay": weight_decay,
            }
        if lr == RELATIVE:
            raise ValueError(f"{self.name} has no relative step size")
        if self.family == "adafactor":
            return {
                "lr": lr,
                "relative_step": False,
                "scale_parameter": False,
                "warmup_init": False,
                "weight_decay": weight_decay,
            }
        if self.family == "plain":
            return {"lr": lr, "weight_decay": weight_decay}
        kwargs: dict[str, Any] = {"lr": lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": weight_decay}
        if self.name == "torch-adamw" and device.type in _fused_devices():
            kwargs["fused"] = True
        return kwargs

    def build(self, params: Iterable[Any], *, lr: LR, weight_decay: float, device: torch.device) -> torch.optim.Optimizer:
        return self.load()(params, **self.kwargs(lr=lr, weight_decay=weight_decay, device=device))


def _fused_devices() -> list[str]:
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return list(_get_fused_kernels_supported_devices())
    except ImportError:  # older torch: fused AdamW is CUDA-only
        return ["cuda"]


_TORCHAO_COMPILE = (
    "left out of --quick on the CPU: torchao compiles its step for every parameter shape with "
    "torch.compile, which took 20 s (warm compile cache) to 2 minutes (cold) here before the first step; "
    "name it in --optimizers to run it"
)

_QUICK_SIZE = (
    "left out of --quick on the CPU to keep it under 4 minutes (a third Adafactor; the full run has it); "
    "name it in --optimizers to run it"
)

CONTENDERS: dict[str, Contender] = {
    c.name: c
    for c in [
        Contender("adamw", "adamw", "leanopt"),
        Contender("adafactor", "adafactor", "leanopt"),
        Contender("adamw8bit", "adamw", "leanopt", cpu_compile_s=10.0),
        Contender("adamw4bit", "adamw", "leanopt", cpu_compile_s=10.0),
        Contender("torch-adamw", "adamw", "torch"),
        Contender("torch-adafactor", "plain", "torch", slow_on_cpu=_QUICK_SIZE, default_lr=1e-2),
        Contender("hf-adafactor", "adafactor", "transformers"),
        Contender("bnb-adamw8bit", "adamw", "bitsandbytes", "bitsandbytes.optim:AdamW8bit"),
        Contender("torchao-adamw8bit", "adamw", "torchao", "torchao.optim:AdamW8bit", _TORCHAO_COMPILE,
                  cpu_compile_s=60.0),
        Contender("torchao-adamw4bit", "adamw", "torchao", "torchao.optim:AdamW4bit", _TORCHAO_COMPILE,
                  cpu_compile_s=60.0),
    ]
}

DEFAULT_CONTENDERS: tuple[str, ...] = tuple(CONTENDERS)


def contender(name: str) -> Contender:
    """A name from :data:`CONTENDERS`, or any other name in ``leanopt.memory.OPTIMIZER_NAMES``."""
    key = name.strip().lower()
    if key in CONTENDERS:
        return CONTENDERS[key]
    if key in OPTIMIZER_NAMES:
        module = OPTIMIZER_NAMES[key].split(":")[0]
        origin = "leanopt" if module == "leanopt" else module.split(".")[0]
        return Contender(key, "plain", origin)
    known = ", ".join(sorted(set(CONTENDERS) | set(OPTIMIZER_NAMES)))
    raise ValueError(f"unknown optimizer {name!r}; known: {known}")


def decay_groups(named_params: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float) -> list[dict[str, Any]]:
    """Matrices decay, vectors (biases, norms) don't: the two groups the HF Trainer makes too."""
    decay, no_decay = [], []
    for _, p in named_params:
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
