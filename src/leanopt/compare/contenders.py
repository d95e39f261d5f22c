"""The optimizers a comparison can run: leanopt's and the peers', by name, resolved lazily.

Every contender of one family gets the same hyper-parameters: the AdamW family torch's
defaults (betas (0.9, 0.999), eps 1e-8) with the task's ``lr`` and ``weight_decay``; the
Adafactor family the task's ``lr`` as a fixed step size (``relative_step=False``,
``scale_parameter=False``, no ``beta1``), so that the shared warm-up + cosine schedule drives
it exactly as it drives AdamW (with a relative step the schedule would be ignored). Any other
name in ``leanopt.memory.OPTIMIZER_NAMES`` runs with only ``lr`` and ``weight_decay`` set.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from leanopt.memory import OPTIMIZER_NAMES, resolve_optimizer


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

    def kwargs(self, *, lr: float, weight_decay: float, device: torch.device) -> dict[str, Any]:
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

    def build(self, params: Iterable[Any], *, lr: float, weight_decay: float, device: torch.device) -> torch.optim.Optimizer:
        return self.load()(params, **self.kwargs(lr=lr, weight_decay=weight_decay, device=device))


def _fused_devices() -> list[str]:
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return list(_get_fused_kernels_supported_devices())
    except ImportError:  # older torch: fused AdamW is CUDA-only
        return ["cuda"]


_TORCHAO_COMPILE = (
    "left out of --quick on the CPU: torchao compiles its step for every parameter shape with "
    "torch.compile, which took about 2 minutes here before the first step; name it in --optimizers to run it"
)

CONTENDERS: dict[str, Contender] = {
    c.name: c
    for c in [
        Contender("adamw", "adamw", "leanopt"),
        Contender("adafactor", "adafactor", "leanopt"),
        Contender("adamw8bit", "adamw", "leanopt"),
        Contender("adamw4bit", "adamw", "leanopt"),
        Contender("torch-adamw", "adamw", "torch"),
        Contender("hf-adafactor", "adafactor", "transformers"),
        Contender("bnb-adamw8bit", "adamw", "bitsandbytes", "bitsandbytes.optim:AdamW8bit"),
        Contender("torchao-adamw8bit", "adamw", "torchao", "torchao.optim:AdamW8bit", _TORCHAO_COMPILE),
        Contender("torchao-adamw4bit", "adamw", "torchao", "torchao.optim:AdamW4bit", _TORCHAO_COMPILE),
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
