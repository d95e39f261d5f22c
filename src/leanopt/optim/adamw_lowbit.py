"""AdamW with 8-bit or 4-bit block-quantized moments: ``AdamW8bit`` and ``AdamW4bit``.

Both classes are one implementation (:class:`LowBitAdamW`) that differs only in its two
formats and default block size; the maths is :func:`leanopt.kernels.reference.adamw_quantized_`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch

from leanopt.optim.sharding import is_dtensor, local
from leanopt import kernels
from leanopt.optim.adamw import adam_hyperparameters, state_dtype, validate_adam_hparams
from leanopt.optim.base import LeanOptimizer, check_flag
from leanopt.optim.layout import StateSpec
from leanopt.quant import BlockFormat
from leanopt.quant.formats import MAX_BLOCK_SIZE

# Options that say how states are stored rather than how the optimizer steps. On load they
# keep this optimizer's values (the loaded states are converted to them), so an 8-bit
# checkpoint loads into AdamW4bit as 4-bit and a fp32 AdamW checkpoint gains them.
STORAGE_OPTIONS = ("quantize", "block_size", "min_quant_size", "state_bits")


def _check_block_size(value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_BLOCK_SIZE:
        raise ValueError(f"Invalid block_size: {value!r} (must be an int in [1, {MAX_BLOCK_SIZE}])")


def _check_min_quant_size(value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"Invalid min_quant_size: {value!r} (must be an int >= 0)")


class LowBitAdamW(LeanOptimizer):
    r"""AdamW whose moments are stored block-quantized (the shared implementation).

    Subclasses set ``state_bits``, the two code books and ``default_block_size``.
    """

    state_bits: ClassVar[int]
    exp_avg_code: ClassVar[str]
    exp_avg_sq_code: ClassVar[str]
    default_block_size: ClassVar[int]

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        amsgrad: bool = False,
        maximize: bool = False,
        block_size: int | None = None,
        min_quant_size: int = 4096,
        rounding: str = "nearest",
        backend: str = "auto",
    ) -> None:
        validate_adam_hparams(lr, betas, eps, weight_decay)
        _check_amsgrad(type(self).__name__, amsgrad)
        block_size = self.default_block_size if block_size is None else block_size
        _check_block_size(block_size)
        _check_min_quant_size(min_quant_size)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=False,
            maximize=maximize,
            quantize=True,
            block_size=block_size,
            min_quant_size=min_quant_size,
            state_bits=self.state_bits,
            rounding=rounding,
        )
        super().__init__(params, defaults, backend=backend)

    def validate_group(self, group: Mapping[str, Any], *, loaded: bool = False) -> None:
        validate_adam_hparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        check_flag("maximize", group["maximize"])
        _check_amsgrad(type(self).__name__, group.get("amsgrad", False))
        _check_block_size(group["block_size"])
        _check_min_quant_size(group["min_quant_size"])
        check_flag("quantize", group["quantize"])
        if group.get("state_bits", self.state_bits) != self.state_bits:
            raise ValueError(f"{type(self).__name__} keeps {self.state_bits}-bit states; state_bits cannot be changed")

    # ---- layout ---------------------------------------------------------------------------
    def formats(self, group: Mapping[str, Any]) -> tuple[BlockFormat, BlockFormat]:
        """The (exp_avg, exp_avg_sq) formats of quantized params in ``group``."""
        bs = group["block_size"]
        return BlockFormat(self.exp_avg_code, bs), BlockFormat(self.exp_avg_sq_code, bs)

    def quantizes(self, shape: tuple[int, ...], group: Mapping[str, Any]) -> bool:
        """Whether a param of (global) ``shape`` in ``group`` gets quantized states."""
        return bool(group["quantize"]) and math.prod(shape) >= group["min_quant_size"]

    def state_layout(self, shape: tuple[int, ...], dtype: torch.dtype, group: Mapping[str, Any]) -> list[StateSpec]:
        shape = tuple(shape)
        specs = [StateSpec("step", (), torch.float32, host=True)]
        if self.quantizes(shape, group):
            fm, fv = self.formats(group)
            specs.append(StateSpec("exp_avg", shape, torch.float32, quant=fm))
            specs.append(StateSpec("exp_avg_sq", shape, torch.float32, quant=fv))
        else:
            sd = state_dtype(dtype)
            specs.append(StateSpec("exp_avg", shape, sd))
            specs.append(StateSpec("exp_avg_sq", shape, sd))
        return specs

    # ---- save / load ----------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
        if isinstance(groups, list) and len(groups) == len(self.param_groups):
            patched = []
            for saved, group in zip(groups, self.param_groups):
                if not isinstance(saved, Mapping):
                    patched.append(saved)
                    continue
                if saved.get("amsgrad", False):
                    raise ValueError(
                        f"{type(self).__name__}.load_state_dict: the state_dict was saved with amsgrad=True, "
                        "which quantized AdamW does not support (load it into leanopt.AdamW)"
                    )
                patched.append({**saved, **{k: group[k] for k in STORAGE_OPTIONS}, "amsgrad": False})
            state_dict = {**state_dict, "param_groups": patched}
        super().load_state_dict(state_dict)

    # ---- step -----------------------------------------------------------------------------
    def _step_group(self, gi: int, group: Mapping[str, Any], params: list[torch.Tensor], key: str) -> None:
        # A DTensor (FSDP2) param updates its own shard; its quantized states hold that shard
        # already, with scales shared across shard edges (leanopt.optim.sharding), which the
        # reference rule handles.
        buckets = self._by_backend(params, lambda p: "reference" if is_dtensor(p) else self._backend_for(p))
        for (backend, _), bucket in buckets.items():
            kernels.adamw_quantized(
                backend,
                self._tables,
                key,
                [local(p) for p in bucket],
                [local(p.grad) for p in bucket],
                [local(self.state[p]["exp_avg"]) for p in bucket],
                [local(self.state[p]["exp_avg_sq"]) for p in bucket],
                [self.state[p]["step"] for p in bucket],
                **adam_hyperparameters(group),
            )


def _check_amsgrad(cls: str, amsgrad: Any) -> None:
    if amsgrad:
        raise ValueError(
            f"{cls} does not support amsgrad: a running maximum of quantized second moments would "
            "need a third quantized state and only ratchets up with rounding; use leanopt.AdamW"
        )


_DOC = r"""AdamW (Loshchilov & Hutter) with {bits}-bit block-quantized moments.

    The update is ``leanopt.AdamW``'s, computed in fp32 for fp32/bf16/fp16 params (fp64 for
    fp64): each step dequantizes ``exp_avg`` and ``exp_avg_sq``, applies decoupled decay,
    ``m.lerp_(g, 1-b1)``, ``v = b2 v + (1-b2) g^2`` and
    ``p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)`` from those fp32 moments, then
    requantizes them (see :func:`leanopt.kernels.reference.adamw_quantized_`).

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
    the batch, dead units) its decaying first moment is stored rounded toward zero rather than
    to the nearest code, so its momentum dies out as in fp32 instead of sticking on a code.

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
        block_size: elements per fp32 scale (default {block}; the peers' choice, and the
            largest power of two keeping {bits}-bit states within {bpp} B/param).
        min_quant_size: params with fewer elements keep fp32 states (default 4096).
        rounding: how the fp32 update is written into a bf16/fp16 param: ``"nearest"``
            (default), ``"stochastic"`` or ``"kahan"`` (a compensation buffer, 2 B/param for
            bf16); fp32/fp64 params ignore it. See :mod:`leanopt.optim.rounding`.
        backend: ``"auto"`` (fused Triton kernel on CUDA, the compiled CPU path on CPU),
            ``"reference"`` (plain tensor maths, for debugging), ``"cpu"`` or ``"triton"``.

    Example:
        >>> import torch, leanopt
        >>> model = torch.nn.Linear(256, 64)
        >>> opt = leanopt.{cls}(model.parameters(), lr=1e-3)
        >>> model(torch.randn(8, 256)).square().mean().backward()
        >>> opt.step()
        >>> type(opt.state[model.weight]["exp_avg"]).__name__, opt.state[model.bias]["exp_avg"].dtype
        ('QuantizedState', torch.float32)
"""


class AdamW8bit(LowBitAdamW):
    state_bits = 8
    exp_avg_code = "pow3-s8"
    exp_avg_sq_code = "pow6-u8"
    default_block_size = 256


class AdamW4bit(LowBitAdamW):
    state_bits = 4
    exp_avg_code = "pow2-s4"
    exp_avg_sq_code = "pow3-u4"
    default_block_size = 128


AdamW8bit.__doc__ = _DOC.format(
    bits=8, m_code="pow3-s8", v_code="pow6-u8", code_bytes="1", bpp="2.031", block=256, cls="AdamW8bit"
)
AdamW4bit.__doc__ = _DOC.format(
    bits=4, m_code="pow2-s4", v_code="pow3-u4", code_bytes="0.5", bpp="1.063", block=128, cls="AdamW4bit"
)
