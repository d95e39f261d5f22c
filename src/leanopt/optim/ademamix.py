"""AdEMAMix, and AdEMAMix with 8-bit block-quantized states (the rule:
:data:`leanopt.kernels.rules.ADEMAMIX`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch

from leanopt.kernels import rules
from leanopt.optim.docs import document
from leanopt.optim.elementwise import ElementwiseOptimizer
from leanopt.optim.lowbit import LowBit
from leanopt.optim.registry import register
from leanopt.optim.validation import check_beta, check_flag, check_nonnegative


def _check_steps(name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"Invalid {name}: {value!r} (must be None or an int >= 1)")


@register
@document
class AdEMAMix(ElementwiseOptimizer):
    r"""AdEMAMix (Pagliardini, Ablin & Grangier 2024, "The AdEMAMix Optimizer: Better, Faster, Older").

    .. math::
        \begin{aligned}
        &m^{(1)}_t \leftarrow \beta_1 m^{(1)}_{t-1} + (1-\beta_1) g_t, \quad
         m^{(2)}_t \leftarrow \beta_3 m^{(2)}_{t-1} + (1-\beta_3) g_t, \quad
         \nu_t \leftarrow \beta_2 \nu_{t-1} + (1-\beta_2) g_t^2 \\
        &\theta_t \leftarrow \theta_{t-1}(1 - \gamma\lambda) - \gamma\,
          \frac{m^{(1)}_t / (1-\beta_1^t) + \alpha\, m^{(2)}_t}{\sqrt{\nu_t / (1-\beta_2^t)} + \epsilon}
        \end{aligned}

    Adam's two moments plus a slow EMA of the gradient (``beta3`` ~ 0.9999) mixed in with
    weight ``alpha``. With ``t_alpha``/``t_beta3`` the paper's warm-up schedulers raise
    ``alpha`` linearly and ``beta3`` (the slow EMA's half-life linearly) over that many steps.
    States: ``exp_avg_fast``, ``exp_avg_slow``, ``exp_avg_sq`` (fp32; fp64 for fp64 params) and
    ``step``: 12 B/param. The same rule, positional order and defaults as
    ``bitsandbytes.optim.AdEMAMix`` (``lr, betas, alpha, t_alpha, t_beta3, eps, weight_decay``).

    Args:
        params: parameters or param groups.
        lr: learning rate (default 1e-3).
        betas: (beta1, beta2, beta3) (default (0.9, 0.999, 0.9999)).
        alpha: weight of the slow EMA (default 5.0).
        t_alpha, t_beta3: warm-up steps of the alpha and beta3 schedulers (default None: constant).
        eps: added to the denominator (default 1e-8).
        weight_decay: decoupled weight decay (default 1e-2).
        maximize: maximize the objective instead of minimizing it (default False).
        .. args:: rounding backend state_dtype offload

    Example:
        >>> import torch, leanopt
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = leanopt.AdEMAMix(model.parameters(), lr=1e-3)
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> opt.step()
        >>> sorted(opt.state[model.weight])
        ['exp_avg_fast', 'exp_avg_slow', 'exp_avg_sq', 'step']
    """

    name = "ademamix"
    family = "ademamix"
    references: ClassVar[tuple[str, ...]] = ("bitsandbytes.optim.AdEMAMix",)
    rule = rules.ADEMAMIX

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
        alpha: float = 5.0,
        t_alpha: int | None = None,
        t_beta3: int | None = None,
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        maximize: bool = False,
        rounding: str = "nearest",
        backend: str = "auto",
        state_dtype: torch.dtype | str = torch.float32,
        offload: str | None = None,
    ) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), alpha=alpha, eps=eps, weight_decay=weight_decay, t_alpha=t_alpha,
                        t_beta3=t_beta3, maximize=maximize, rounding=rounding)  # fmt: skip
        super().__init__(params, defaults, backend=backend, state_dtype=state_dtype, offload=offload)

    def validate_group(self, group: Mapping[str, Any], *, loaded: bool = False) -> None:
        check_nonnegative("lr", group["lr"])
        check_nonnegative("eps", group["eps"])
        check_nonnegative("weight_decay", group["weight_decay"])
        check_nonnegative("alpha", group["alpha"])
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 3:
            raise ValueError(f"betas must be a triple (beta1, beta2, beta3), got {betas!r}")
        for i, b in enumerate(betas):
            check_beta(f"beta{i + 1} (betas[{i}])", b)
        _check_steps("t_alpha", group["t_alpha"])
        _check_steps("t_beta3", group["t_beta3"])
        if group["t_beta3"] is not None and not 0.0 < betas[0] <= betas[2]:
            raise ValueError(f"t_beta3 needs 0 < beta1 <= beta3 (its schedule runs from beta1 to beta3), got betas {betas!r}")
        check_flag("maximize", group["maximize"])


@register
@document
class AdEMAMix8bit(LowBit, AdEMAMix):
    """AdEMAMix with 8-bit block-quantized states.

    ``leanopt.AdEMAMix``'s rule on three states stored as 8-bit codes with one fp32 scale per
    ``block_size`` elements (default 256): ``exp_avg_fast`` and ``exp_avg_slow`` on the signed
    ``pow3-s8`` code, ``exp_avg_sq`` on the unsigned, zero-free ``pow6-u8``: 3.05 B/param with
    ``step`` (fp32 AdEMAMix: 12). Each step dequantizes, runs the rule in fp32 and requantizes,
    in safe mode: ``exp_avg_sq`` is kept at least ``m^2 / K_t`` for both EMAs (the largest ratio
    exact moments reach, with beta3 on its schedule), so a second moment rounded toward 0 can
    never turn a small gradient into an ``lr * m / eps`` step; non-finite gradient elements are
    skipped (param kept, states reset) without touching their block neighbours; where the
    gradient is exactly 0 the fast EMA is stored with AdamW8bit's decay rounding (in expectation
    the fp32 decay; the slow one, decaying by 0.01 % per step, rounds to nearest). Params with fewer than ``min_quant_size`` elements (default 4096)
    keep fp32 states.

    Args:
        params, lr, betas, alpha, t_alpha, t_beta3, eps, weight_decay, maximize: as
            :class:`leanopt.AdEMAMix`.
        .. args:: block_size min_quant_size rounding backend state_dtype offload
    """

    name = "ademamix8bit"
    references = AdEMAMix.references + ("bitsandbytes.optim.AdEMAMix8bit",)
    state_bits = 8
    exp_avg_fast_code = "pow3-s8"
    exp_avg_slow_code = "pow3-s8"
    exp_avg_sq_code = "pow6-u8"
    default_block_size = 256

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
        alpha: float = 5.0,
        t_alpha: int | None = None,
        t_beta3: int | None = None,
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        maximize: bool = False,
        block_size: int = 256,
        min_quant_size: int = 4096,
        rounding: str = "nearest",
        backend: str = "auto",
        state_dtype: torch.dtype | str = torch.float32,
        offload: str | None = None,
    ) -> None:
        self._set_storage(block_size, min_quant_size)
        super(LowBit, self).__init__(params, lr, betas, alpha, t_alpha, t_beta3, eps, weight_decay, maximize=maximize,
                                     rounding=rounding, backend=backend, state_dtype=state_dtype, offload=offload)  # fmt: skip
