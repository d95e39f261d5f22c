"""Lion, and Lion with 8-bit or 4-bit block-quantized momentum (the rule:
:data:`leanopt.kernels.rules.LION`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch

from leanopt.kernels import rules
from leanopt.optim.docs import document
from leanopt.optim.elementwise import ElementwiseOptimizer
from leanopt.optim.lowbit import LowBit
from leanopt.optim.registry import register
from leanopt.optim.validation import check_betas, check_flag, check_nonnegative


@register
@document
class Lion(ElementwiseOptimizer):
    r"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms").

    .. math::
        \begin{aligned}
        &\theta_t \leftarrow \theta_{t-1}(1 - \gamma\lambda)
          - \gamma\,\mathrm{sign}(\beta_1 m_{t-1} + (1-\beta_1) g_t) \\
        &m_t \leftarrow \beta_2 m_{t-1} + (1-\beta_2) g_t
        \end{aligned}

    One state per parameter, ``exp_avg`` (fp32 for fp32/bf16/fp16 params, fp64 for fp64), plus
    ``step``. Every update has magnitude ``lr`` per element, so Lion wants a learning rate 3-10x
    smaller than AdamW's and a weight decay 3-10x larger (the paper's advice). The same rule as
    ``bitsandbytes.optim.Lion`` (decoupled weight decay).

    Args:
        params: parameters or param groups.
        lr: learning rate (default 1e-4).
        betas: (beta1, beta2): the interpolation of the update's sign and the momentum's decay
            (default (0.9, 0.99)).
        weight_decay: decoupled weight decay (default 0).
        maximize: maximize the objective instead of minimizing it (default False).
        .. args:: rounding backend state_dtype offload

    Example:
        >>> import torch, leanopt
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = leanopt.Lion(model.parameters(), lr=1e-4)
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> opt.step()
        >>> sorted(opt.state[model.weight])
        ['exp_avg', 'step']
    """

    name = "lion"
    family = "lion"
    references: ClassVar[tuple[str, ...]] = ("bitsandbytes.optim.Lion",)
    rule = rules.LION

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
        rounding: str = "nearest",
        backend: str = "auto",
        state_dtype: torch.dtype | str = torch.float32,
        offload: str | None = None,
    ) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, maximize=maximize, rounding=rounding)
        super().__init__(params, defaults, backend=backend, state_dtype=state_dtype, offload=offload)

    def validate_group(self, group: Mapping[str, Any], *, loaded: bool = False) -> None:
        check_nonnegative("lr", group["lr"])
        check_nonnegative("weight_decay", group["weight_decay"])
        check_betas(group["betas"])
        check_flag("maximize", group["maximize"])


_LOWBIT_DOC = r"""Lion with {bits}-bit block-quantized momentum.

    ``leanopt.Lion``'s rule on a momentum stored as {bits}-bit codes (``{code}``, signed) with
    one fp32 scale per ``block_size`` elements (default {block}): {bpp} B/param with ``step``
    (fp32 Lion: 4). Each step dequantizes the momentum, runs the rule in fp32 and requantizes;
    as in ``AdamW{bits}bit``, a gradient element that is NaN/Inf or whose square overflows is
    skipped (param kept, momentum reset to 0) without touching its block neighbours, and where
    the gradient is exactly 0 the decaying momentum rounds to the nearest code (Lion steps by
    ``sign(m)``, which a decaying fp32 momentum keeps). Params with fewer than
    ``min_quant_size`` elements (default 4096), and groups with ``"quantize": False``, keep an
    fp32 momentum. Checkpoints convert between Lion, Lion8bit and Lion4bit on load.

    Args:
        params, lr, betas, weight_decay, maximize: as :class:`leanopt.Lion`.
        .. args:: block_size min_quant_size rounding backend state_dtype offload
"""


@register
class Lion8bit(LowBit, Lion):
    name = "lion8bit"
    references = Lion.references + ("bitsandbytes.optim.Lion8bit",)
    state_bits = 8
    exp_avg_code = "pow3-s8"
    default_block_size = 256

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
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
        super(LowBit, self).__init__(params, lr, betas, weight_decay, maximize=maximize, rounding=rounding, backend=backend,
                                     state_dtype=state_dtype, offload=offload)  # fmt: skip


@register
class Lion4bit(LowBit, Lion):
    name = "lion4bit"
    state_bits = 4
    exp_avg_code = "pow2-s4"
    default_block_size = 128

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
        block_size: int = 128,
        min_quant_size: int = 4096,
        rounding: str = "nearest",
        backend: str = "auto",
        state_dtype: torch.dtype | str = torch.float32,
        offload: str | None = None,
    ) -> None:
        self._set_storage(block_size, min_quant_size)
        super(LowBit, self).__init__(params, lr, betas, weight_decay, maximize=maximize, rounding=rounding, backend=backend,
                                     state_dtype=state_dtype, offload=offload)  # fmt: skip


Lion8bit.__doc__ = _LOWBIT_DOC.format(bits=8, code="pow3-s8", block=256, bpp="1.016")
Lion4bit.__doc__ = _LOWBIT_DOC.format(bits=4, code="pow2-s4", block=128, bpp="0.531")
document(Lion8bit)
document(Lion4bit)
