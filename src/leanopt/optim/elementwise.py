"""Optimizers whose update is an elementwise rule (:mod:`leanopt.kernels.rules`).

:class:`ElementwiseOptimizer` is everything such an optimizer shares: its state layout comes
from the rule's state kinds, and a step hands each param group's params, gradients, states and
step counts to :func:`leanopt.kernels.step`, which picks a backend per param. A subclass gives
its rule, its defaults and the checks of its hyper-parameters (:meth:`validate_group`); its
quantized sibling adds :class:`leanopt.optim.lowbit.LowBit` (see ``AdamW8bit``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch

from leanopt import kernels
from leanopt.kernels.rules import Rule
from leanopt.optim.base import LeanOptimizer
from leanopt.optim.layout import StateSpec
from leanopt.optim.param_step import ParamStep
from leanopt.optim.sharding import local, shard_offset
from leanopt.quant.bf16 import check_state_dtype, state_dtype_name


def state_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """fp64 params keep fp64 state, complex params complex state (of their real view's
    precision, at least fp32); every other float dtype keeps fp32 state."""
    if param_dtype.is_complex:
        return torch.complex128 if param_dtype == torch.complex128 else torch.complex64
    return torch.float64 if param_dtype == torch.float64 else torch.float32


def real_view(t: Any) -> Any:
    """A complex tensor as the real tensor of its (real, imaginary) pairs; others as they are."""
    return torch.view_as_real(t) if isinstance(t, torch.Tensor) and t.is_complex() else t


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def kernel_view(t: Any) -> Any:
    """What the kernels update for ``t``: this rank's shard of a DTensor, the real view of a
    complex tensor, any other tensor (or a quantized state) as it is."""
    if type(t) in _PLAIN:  # the common case, without the DTensor test
        return torch.view_as_real(t) if t.is_complex() else t
    return real_view(local(t))


class ElementwiseOptimizer(LeanOptimizer):
    """An optimizer that runs ``rule`` on each element (the shared implementation)."""

    rule: ClassVar[Rule]
    chunkable = True
    # Safe mode (the low-bit optimizers): second-moment floors and skipped non-finite elements.
    safe: ClassVar[bool] = False

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], *, backend: str = "auto",
                 state_dtype: torch.dtype | str = torch.float32, offload: str | None = None) -> None:  # fmt: skip
        # How dense states are stored (fp32, or bf16 with stochastic rounding: leanopt.quant.bf16).
        # Unlike backend and offload it is saved: each param group holds its name ("bfloat16").
        self._state_dtype = check_state_dtype(state_dtype)
        super().__init__(params, defaults, backend=backend, offload=offload)

    def _complete_defaults(self, defaults: dict[str, Any]) -> dict[str, Any]:
        return {**super()._complete_defaults(defaults), "state_dtype": state_dtype_name(self._state_dtype)}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if isinstance(param_group, Mapping) and "state_dtype" in param_group:
            param_group["state_dtype"] = state_dtype_name(param_group["state_dtype"])
        super().add_param_group(param_group)

    def _kept_on_load(self, group: Mapping[str, Any]) -> dict[str, Any]:
        # Storage, not a hyper-parameter: a loaded state is converted to this optimizer's
        # state_dtype (an fp32 checkpoint loads into bf16 states and back).
        return {**super()._kept_on_load(group), "state_dtype": state_dtype_name(group.get("state_dtype", "float32"))}

    def dense_state_dtype(self, dtype: torch.dtype, group: Mapping[str, Any]) -> torch.dtype:
        """The dtype of the dense states of a ``dtype`` param in ``group``: :func:`state_dtype`,
        or bf16 where the group's ``state_dtype`` says so (complex params keep complex states:
        there is no bf16 complex dtype)."""
        stored = check_state_dtype(group.get("state_dtype", torch.float32))
        if stored == torch.bfloat16 and not dtype.is_complex:
            return torch.bfloat16
        return state_dtype(dtype)

    def state_keys(self, group: Mapping[str, Any]) -> list[str]:
        """The rule's state keys (besides ``step``) for params of ``group``."""
        return [kind.key for kind in self.rule.states(self.rule.hyperparameters(group))]

    def keeps_step(self, dtype: torch.dtype, group: Mapping[str, Any]) -> bool:
        """Whether params of ``dtype`` in ``group`` keep a ``step`` count (the rule's schedule,
        the decay rounding's dither and stochastic rounding read it): yes, unless a subclass
        keeps none where its reference keeps none (SGD without momentum)."""
        return True

    def step_layout(self, dtype: torch.dtype, group: Mapping[str, Any]) -> list[StateSpec]:
        """The ``step`` entry of a param's layout, or none (:meth:`keeps_step`)."""
        return [StateSpec("step", (), torch.float32, host=True)] if self.keeps_step(dtype, group) else []

    def state_layout(self, shape: tuple[int, ...], dtype: torch.dtype, group: Mapping[str, Any]) -> list[StateSpec]:
        sd = self.dense_state_dtype(dtype, group)
        return self.step_layout(dtype, group) + [StateSpec(key, tuple(shape), sd) for key in self.state_keys(group)]

    def update(self, gi: int, group: Mapping[str, Any], items: list[ParamStep], key: str) -> None:
        keys = self.state_keys(group)
        hp = self.rule.hyperparameters(group)
        by_device: dict[torch.device, list[ParamStep]] = {}
        for item in items:
            by_device.setdefault(item.param.device, []).append(item)
        for on_device in by_device.values():
            # Elementwise: a DTensor (FSDP2) param updates its own shard; a complex one its real view.
            kernels.step(
                self.backend, self.rule, self._tables, key,
                [kernel_view(it.param) for it in on_device],
                [kernel_view(it.grad) for it in on_device],
                [[kernel_view(it.state[k]) for k in keys] for it in on_device],
                [it.step for it in on_device], hp, safe=self.safe,
                offsets=[it.offset if type(it.param) in _PLAIN else it.offset + shard_offset(it.param) for it in on_device],
            )  # fmt: skip
