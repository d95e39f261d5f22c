"""AdamW with torch's update rule and state keys, fp32 state for low-precision params (the rule:
:data:`leanopt.kernels.rules.ADAMW`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch

from leanopt.kernels import rules
from leanopt.optim.base import backend_for_torch_flags
from leanopt.optim.docs import document
from leanopt.optim.elementwise import ElementwiseOptimizer
from leanopt.optim.layout import StateSpec
from leanopt.optim.registry import register
from leanopt.optim.validation import check_betas, check_flag, check_nonnegative


@register
@document
class AdamW(ElementwiseOptimizer):
    r"""AdamW (Loshchilov & Hutter), exactly ``torch.optim.AdamW``'s rule and state keys.

    .. math::
        \begin{aligned}
        &\theta_t \leftarrow \theta_{t-1}(1 - \gamma\lambda) \\
        &m_t \leftarrow \beta_1 m_{t-1} + (1-\beta_1) g_t, \qquad
         v_t \leftarrow \beta_2 v_{t-1} + (1-\beta_2) g_t^2 \\
        &\hat v_t \leftarrow \max(\hat v_{t-1}, v_t) \text{ if amsgrad else } v_t \\
        &\theta_t \leftarrow \theta_t - \frac{\gamma}{1-\beta_1^t}\,
          \frac{m_t}{\sqrt{\hat v_t}/\sqrt{1-\beta_2^t} + \epsilon}
        \end{aligned}

    State per parameter: ``step`` (fp32 scalar on the CPU), ``exp_avg``, ``exp_avg_sq`` and,
    with ``amsgrad``, ``max_exp_avg_sq``. For fp32/fp64 params the states have the param's dtype
    and results equal torch's to rounding. For bf16/fp16 params the states are fp32 and the
    update is computed in fp32 (torch would keep bf16 states); they stay fp32 through
    ``state_dict``/``load_state_dict``. Complex params are updated on their real view, as
    torch does (complex states of the param's shape). ``lr`` may be a one-element tensor.

    Args:
        params: parameters or param groups.
        lr: learning rate (default 1e-3).
        betas: coefficients of the running averages (default (0.9, 0.999)).
        eps: added to the denominator (default 1e-8).
        weight_decay: decoupled weight decay (default 1e-2).
        amsgrad: use the maximum of past second moments (default False).
        maximize: maximize the objective instead of minimizing it (default False).
        .. args:: rounding foreach capturable backend state_dtype offload

    Example:
        >>> import torch, leanopt
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = leanopt.AdamW(model.parameters(), lr=1e-3)
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> opt.step()
        >>> sorted(opt.state[model.weight])
        ['exp_avg', 'exp_avg_sq', 'step']
    """

    name = "adamw"
    family = "adamw"
    references: ClassVar[tuple[str, ...]] = ("torch.optim.AdamW",)
    rule = rules.ADAMW
    # As torch.optim.AdamW: a complex param and its states are updated as real (re, im) pairs.
    supports_complex = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        rounding: str = "nearest",
        backend: str = "auto",
        state_dtype: torch.dtype | str = torch.float32,
        offload: str | None = None,
    ) -> None:
        validate_adam_hparams(lr, betas, eps, weight_decay)
        backend = backend_for_torch_flags(type(self).__name__, backend, foreach=foreach, fused=fused,
                                          capturable=capturable, differentiable=differentiable)  # fmt: skip
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize, rounding=rounding
        )
        super().__init__(params, defaults, backend=backend, state_dtype=state_dtype, offload=offload)

    def validate_group(self, group: Mapping[str, Any], *, loaded: bool = False) -> None:
        validate_adam_hparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        check_flag("amsgrad", group["amsgrad"])
        check_flag("maximize", group["maximize"])

    def _missing_state(self, spec: StateSpec, p: torch.Tensor, saved: Mapping[str, Any]) -> Any:
        # A state saved without amsgrad continues under amsgrad from its current second moment.
        if spec.key == "max_exp_avg_sq" and "exp_avg_sq" in saved:
            return None if not isinstance(saved["exp_avg_sq"], torch.Tensor) else saved["exp_avg_sq"].to(
                device=p.device, dtype=spec.dtype, copy=True
            )
        return None


def validate_adam_hparams(lr: float | torch.Tensor, betas: Any, eps: float, weight_decay: float) -> None:
    check_nonnegative("lr", lr)
    check_nonnegative("eps", eps)
    check_nonnegative("weight_decay", weight_decay)
    check_betas(betas)
