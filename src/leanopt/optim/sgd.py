"""SGD with momentum, and SGD with an 8-bit block-quantized momentum (the rule:
:data:`leanopt.kernels.rules.SGD`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch

from leanopt.kernels import rules
from leanopt.optim.base import backend_for_torch_flags
from leanopt.optim.docs import document
from leanopt.optim.elementwise import ElementwiseOptimizer
from leanopt.optim.layout import StateSpec
from leanopt.optim.lowbit import LowBit
from leanopt.optim.registry import register
from leanopt.optim.rounding import LOW_PRECISION
from leanopt.optim.validation import check_flag, check_nonnegative, number


@register
@document
class SGD(ElementwiseOptimizer):
    r"""Stochastic gradient descent with momentum: ``torch.optim.SGD``'s rule, defaults and state.

    .. math::
        \begin{aligned}
        &d_t \leftarrow g_t + \lambda\theta_{t-1} \\
        &b_t \leftarrow \mu b_{t-1} + (1-\tau) d_t \quad (b_1 = d_1), \qquad
          d_t \leftarrow d_t + \mu b_t \text{ (nesterov) or } b_t \\
        &\theta_t \leftarrow \theta_{t-1} - \gamma d_t
        \end{aligned}

    With ``momentum=0`` (the default, as torch's) nothing is kept per param: no state, as
    ``torch.optim.SGD`` keeps none. With a momentum the state is ``momentum_buffer`` (fp32 for
    fp32/bf16/fp16 params, fp64 for fp64, complex for complex params) and leanopt's ``step``
    (which the first step's ``b_1 = d_1`` reads): 4 B/param. Weight decay is torch's coupled L2
    term. A ``torch.optim.SGD`` state_dict loads (its buffers continue; the step count it lacks
    starts at 1).

    Args:
        params: parameters or param groups.
        lr: learning rate (default 1e-3).
        momentum: momentum factor (default 0).
        dampening: dampening of the momentum (default 0).
        weight_decay: L2 penalty added to the gradient (default 0).
        nesterov: Nesterov momentum (needs a momentum and zero dampening; default False).
        maximize: maximize the objective instead of minimizing it (default False).
        .. args:: rounding foreach differentiable backend state_dtype offload

    Example:
        >>> import torch, leanopt
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = leanopt.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> opt.step()
        >>> sorted(opt.state[model.weight])
        ['momentum_buffer', 'step']
        >>> len(leanopt.SGD(model.parameters(), lr=0.1).state)  # no momentum: no state
        0
    """

    name = "sgd"
    family = "sgd"
    references: ClassVar[tuple[str, ...]] = ("torch.optim.SGD",)
    rule = rules.SGD
    # As torch.optim.SGD: the rule is linear in the param, gradient and buffer with real
    # scalars, so the real view of a complex param steps as torch steps the complex one.
    supports_complex = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        rounding: str = "nearest",
        backend: str = "auto",
        state_dtype: torch.dtype | str = torch.float32,
        offload: str | None = None,
    ) -> None:
        backend = backend_for_torch_flags(type(self).__name__, backend, foreach=foreach, fused=fused,
                                          differentiable=differentiable)  # fmt: skip
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        maximize=maximize, rounding=rounding)  # fmt: skip
        super().__init__(params, defaults, backend=backend, state_dtype=state_dtype, offload=offload)

    def validate_group(self, group: Mapping[str, Any], *, loaded: bool = False) -> None:
        check_nonnegative("lr", group["lr"])
        check_nonnegative("momentum", group["momentum"])
        check_nonnegative("weight_decay", group["weight_decay"])
        if isinstance(group["dampening"], torch.Tensor) or not math.isfinite(number("dampening", group["dampening"])):
            raise ValueError(f"Invalid dampening: {group['dampening']!r} (must be a finite number)")
        check_flag("nesterov", group["nesterov"])
        check_flag("maximize", group["maximize"])
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("Invalid nesterov: Nesterov momentum requires a momentum and zero dampening")

    def keeps_step(self, dtype: torch.dtype, group: Mapping[str, Any]) -> bool:
        # Without a momentum the rule reads no step; stochastic rounding of a bf16/fp16 param
        # still needs one (a new rounding each step).
        return group["momentum"] != 0 or (group.get("rounding") == "stochastic" and dtype in LOW_PRECISION)

    def _missing_state(self, spec: StateSpec, p: torch.Tensor, saved: Mapping[str, Any]) -> Any:
        # torch.optim.SGD saves its buffer and no step: a buffer means at least one step was taken.
        if spec.key == "step" and "momentum_buffer" in saved:
            return torch.tensor(1.0)
        return None


@register
@document
class SGD8bit(LowBit, SGD):
    """SGD with an 8-bit block-quantized momentum.

    ``leanopt.SGD``'s rule on a ``momentum_buffer`` stored as 8-bit codes (``pow3-s8``, signed)
    with one fp32 scale per ``block_size`` elements (default 256): 1.016 B/param with ``step``
    (fp32 SGD: 4). Each step dequantizes the buffer, runs the rule in fp32 and requantizes, in
    safe mode: a gradient element that is NaN/Inf or whose square overflows is skipped (param
    kept, buffer reset to 0) without touching its block neighbours; where the gradient is
    exactly 0 the decaying buffer is stored with AdamW8bit's decay rounding (in expectation
    the fp32 decay, instead of sticking on its code). Without a momentum nothing is stored.
    Params with fewer than ``min_quant_size`` elements (default 4096), and groups with
    ``"quantize": False``, keep an fp32 buffer. Checkpoints convert between SGD and SGD8bit on
    load.

    Args:
        params, lr, momentum, dampening, weight_decay, nesterov, maximize: as :class:`leanopt.SGD`.
        .. args:: foreach differentiable block_size min_quant_size rounding backend state_dtype offload
    """

    name = "sgd8bit"
    references = SGD.references + ("bitsandbytes.optim.SGD8bit",)
    state_bits = 8
    momentum_buffer_code = "pow3-s8"
    default_block_size = 256

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        block_size: int = 256,
        min_quant_size: int = 4096,
        rounding: str = "nearest",
        backend: str = "auto",
        state_dtype: torch.dtype | str = torch.float32,
        offload: str | None = None,
    ) -> None:
        self._set_storage(block_size, min_quant_size)
        super(LowBit, self).__init__(params, lr, momentum, dampening, weight_decay, nesterov, maximize=maximize, foreach=foreach,
                                     differentiable=differentiable, fused=fused, rounding=rounding, backend=backend,
                                     state_dtype=state_dtype, offload=offload)  # fmt: skip
