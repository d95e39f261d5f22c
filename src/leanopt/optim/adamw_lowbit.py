"""AdamW with 8-bit or 4-bit block-quantized moments: ``AdamW8bit`` and ``AdamW4bit``.

Each is AdamW's rule (:data:`leanopt.kernels.rules.ADAMW`) in safe mode on quantized storage
(:class:`leanopt.optim.lowbit.LowBit`): a registration, two code books and a block size.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from leanopt.optim.adamw import AdamW
from leanopt.optim.docs import document
from leanopt.optim.lowbit import LowBit
from leanopt.optim.registry import register


class LowBitAdamW(LowBit, AdamW):
    """AdamW whose moments are stored block-quantized; amsgrad is refused."""

    def validate_group(self, group: Mapping[str, Any], *, loaded: bool = False) -> None:
        cls = type(self).__name__
        if group.get("amsgrad", False) and loaded:
            raise ValueError(f"the state_dict was saved with amsgrad=True, which {cls} does not support (load it into leanopt.AdamW)")
        if group.get("amsgrad", False):
            raise ValueError(
                f"{cls} does not support amsgrad: a running maximum of quantized second moments would need a "
                "third quantized state and only ratchets up with rounding; use leanopt.AdamW"
            )
        super().validate_group(group, loaded=loaded)


_DOC = r"""AdamW (Loshchilov & Hutter) with {bits}-bit block-quantized moments.

    The update is ``leanopt.AdamW``'s, computed in fp32 for fp32/bf16/fp16 params (fp64 for
    fp64): each step dequantizes ``exp_avg`` and ``exp_avg_sq``, applies decoupled decay,
    ``m.lerp_(g, 1-b1)``, ``v = b2 v + (1-b2) g^2`` and
    ``p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)`` from those fp32 moments, then
    requantizes them (see :func:`leanopt.kernels.reference.rule_step_`).

    **Format.** Each moment is cut into blocks of ``block_size`` elements (flat order) with one
    fp32 scale (the block's absolute maximum) and one {bits}-bit code per element: ``exp_avg``
    on the signed code ``{m_code}``, ``exp_avg_sq`` on the unsigned, zero-free code
    ``{v_code}`` (:mod:`leanopt.quant.codebooks` explains the choice, with measurements against
    the dynamic-tree code of bitsandbytes/torchao). Code books are shared, not stored per state.

    **Memory.** ``2 * ({code_bytes} + 4/block_size)`` bytes per element plus a 4-byte ``step``:
    {bpp} B/param with the default ``block_size={block}`` (fp32 AdamW: 8). Params with fewer
    than ``min_quant_size`` elements (biases, norms), and every param of a group with
    ``"quantize": False``, keep fp32 ``exp_avg``/``exp_avg_sq`` -- e.g.
    ``{cls}([{{"params": body}}, {{"params": embeddings, "quantize": False}}])``. The choice is
    made from ``p.shape``, the global shape for a DTensor, so it never depends on sharding.
    ``leanopt.estimate`` predicts these bytes exactly from :meth:`state_layout`.

    **NaN/Inf.** A gradient element that is NaN or +-Inf, or so large that its square
    overflows in the compute dtype (``|g| >= 2^64 ~ 1.845e19`` for fp32/bf16/fp16 params,
    ``~1.34e154`` for fp64), is skipped for that step -- its param is left unchanged, without
    weight decay -- and both its moments are reset to 0. It is removed before block scales are
    computed, so its block neighbours' scale, codes and params are exactly what they would be
    were it absent from the block (the same as with a NaN gradient there). Params with fp32 states follow the same rule, on every backend.

    **Second-moment floor.** ``v`` is kept ``>= m^2 / K_t``, the largest ratio exact Adam
    moments can have, so a second moment that rounds towards 0 can never turn a zero gradient
    into an ``lr * m / eps`` step: every step is bounded as in fp32 AdamW. For states fp32
    AdamW can reach the floor is inactive.

    **Zero gradients.** Where an element's gradient is exactly 0 (rows of an embedding not in
    the batch, dead units) its decaying first moment is stored with a *decay rounding*: the
    nearest code where that is smaller than what it held, else a dithered choice between the
    two codes around it, so that it decays by ``beta1`` in expectation as in fp32 instead of
    sticking on a code (``leanopt.quant.formats.BlockFormat.code_indices``; docs/quantized.md).

    **amsgrad** is not supported (``amsgrad=True`` raises ``ValueError``): a running maximum of
    quantized second moments needs a third state and rounding only ratchets it up. Use
    ``leanopt.AdamW`` for amsgrad.

    **Checkpoints.** In ``state_dict()`` a quantized moment is a plain dict of tensors, ints
    and strings (``torch.load(weights_only=True)`` loads it). ``load_state_dict`` converts
    between precisions: a fp32 AdamW state (leanopt's or torch's) is quantized, an 8-bit one
    loads into AdamW4bit (and back), a different ``block_size`` is re-blocked, and
    ``leanopt.AdamW`` dequantizes this class's states. Storage options (``quantize``,
    ``block_size``, ``min_quant_size``) keep the values this optimizer was built with;
    :func:`leanopt.checkpoint.convert_state_dict` converts a saved file without a model.

    Args:
        params: parameters or param groups (a group may set ``quantize``, ``block_size`` and
            ``min_quant_size`` as well as the hyper-parameters).
        lr: learning rate (default 1e-3).
        betas: coefficients of the running averages (default (0.9, 0.999)).
        eps: added to the denominator (default 1e-8).
        weight_decay: decoupled weight decay (default 1e-2).
        amsgrad: must be False (see above).
        maximize: maximize the objective instead of minimizing it (default False).
        .. args:: foreach capturable block_size min_quant_size rounding backend state_dtype offload

    Example:
        >>> import torch, leanopt
        >>> model = torch.nn.Linear(256, 64)
        >>> opt = leanopt.{cls}(model.parameters(), lr=1e-3)
        >>> model(torch.randn(8, 256)).square().mean().backward()
        >>> opt.step()
        >>> type(opt.state[model.weight]["exp_avg"]).__name__, opt.state[model.bias]["exp_avg"].dtype
        ('QuantizedState', torch.float32)
"""


@register
class AdamW8bit(LowBitAdamW):
    name = "adamw8bit"
    references = AdamW.references + ("bitsandbytes.optim.AdamW8bit", "torchao.optim.AdamW8bit")
    state_bits = 8
    exp_avg_code = "pow3-s8"
    exp_avg_sq_code = "pow6-u8"
    default_block_size = 256

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
        block_size: int = 256,
        min_quant_size: int = 4096,
        rounding: str = "nearest",
        backend: str = "auto",
        state_dtype: torch.dtype | str = torch.float32,
        offload: str | None = None,
    ) -> None:
        self._set_storage(block_size, min_quant_size)
        super(LowBit, self).__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, foreach=foreach,
                                     capturable=capturable, differentiable=differentiable, fused=fused, rounding=rounding,
                                     backend=backend, state_dtype=state_dtype, offload=offload)  # fmt: skip


@register
class AdamW4bit(LowBitAdamW):
    name = "adamw4bit"
    references = AdamW.references + ("torchao.optim.AdamW4bit",)
    state_bits = 4
    exp_avg_code = "pow2-s4"
    exp_avg_sq_code = "pow3-u4"
    default_block_size = 128

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
        block_size: int = 128,
        min_quant_size: int = 4096,
        rounding: str = "nearest",
        backend: str = "auto",
        state_dtype: torch.dtype | str = torch.float32,
        offload: str | None = None,
    ) -> None:
        self._set_storage(block_size, min_quant_size)
        super(LowBit, self).__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, foreach=foreach,
                                     capturable=capturable, differentiable=differentiable, fused=fused, rounding=rounding,
                                     backend=backend, state_dtype=state_dtype, offload=offload)  # fmt: skip


AdamW8bit.__doc__ = _DOC.format(
    bits=8, m_code="pow3-s8", v_code="pow6-u8", code_bytes="1", bpp="2.031", block=256, cls="AdamW8bit"
)
AdamW4bit.__doc__ = _DOC.format(
    bits=4, m_code="pow2-s4", v_code="pow3-u4", code_bytes="0.5", bpp="1.063", block=128, cls="AdamW4bit"
)
document(AdamW8bit)
document(AdamW4bit)
