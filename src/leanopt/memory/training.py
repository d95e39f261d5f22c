r"""Memory of training a model with an optimizer: weights, gradients, master weights, state.

For :math:`N` trainable parameter elements (frozen parameters and buffers are not counted)
and :math:`S_{dt}` the state :func:`leanopt.estimate` predicts for parameters of dtype ``dt``:

=============  ==========  ==========  ================  ==================
precision      weights     gradients   master weights    optimizer state
=============  ==========  ==========  ================  ==================
``fp32``       4N          4N          0                 S_fp32
``bf16-mixed`` 2N (bf16)   4N (fp32)   4N (fp32)         S_fp32
``bf16``       2N          2N          0                 S_bf16
=============  ==========  ==========  ================  ==================

``bf16-mixed`` is training with fp32 parameters that the optimizer updates (the master
weights), fp32 gradients and bf16 copies of the weights for compute. This is:

* ``torch.autocast(dtype=torch.bfloat16)`` — what ``Trainer(bf16=True)``, Accelerate's
  ``mixed_precision="bf16"`` and Lightning's ``"bf16-mixed"`` run. The fp32 parameters are the
  master weights, gradients are fp32, and autocast keeps a bf16 copy of each weight it casts
  (the inputs of matmuls: linear layers, attention projections, convolutions) from the forward
  pass until backward has used it. Embeddings and norms are not cast, so here the 2N of bf16
  weights is an upper bound (DistilBERT: 34% of its parameters are embeddings).
* bf16 model weights with an fp32 master copy and fp32 gradient buffers (Megatron-LM's
  ``main_grad``, DeepSpeed's bf16 optimizer): exact.

``bf16`` is pure bf16 training: parameters and gradients in bf16, no master copy, and the
state the optimizer keeps for bf16 parameters (leanopt's optimizers: fp32 state;
``torch.optim.AdamW``: bf16 state).

Not counted: activations (they depend on batch size, sequence length and checkpointing),
temporary buffers of the optimizer step, the CUDA context and allocator fragmentation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from leanopt.memory.estimate import MiB, StateEstimate, estimate, unique_params

__all__ = ["PRECISIONS", "TrainingMemory", "training_memory"]

# precision -> (bytes per weight, per gradient, per master weight, dtype the optimizer steps)
PRECISIONS: dict[str, tuple[int, int, int, torch.dtype]] = {
    "fp32": (4, 4, 0, torch.float32),
    "bf16-mixed": (2, 4, 4, torch.float32),
    "bf16": (2, 2, 0, torch.bfloat16),
}


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes of each part of training memory (see :mod:`leanopt.memory.training`)."""

    optimizer: str
    precision: str
    params: int
    weights: int
    gradients: int
    master_weights: int
    state: StateEstimate

    @property
    def optimizer_state(self) -> int:
        return self.state.bytes

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.master_weights + self.optimizer_state

    @property
    def megabytes(self) -> float:
        return self.total / MiB

    @property
    def bytes_per_param(self) -> float:
        return self.total / self.params if self.params else 0.0

    def as_dict(self) -> dict[str, int]:
        return {
            "weights": self.weights,
            "gradients": self.gradients,
            "master_weights": self.master_weights,
            "optimizer_state": self.optimizer_state,
            "total": self.total,
        }

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {v / MiB:,.0f}" for k, v in self.as_dict().items() if k != "total" and v)
        return (
            f"{self.optimizer} ({self.precision}): {self.total:,} bytes ({self.megabytes:,.0f} MB) "
            f"for {self.params:,} params, {self.bytes_per_param:.2f} B/param [MB: {parts}]"
        )


def training_memory(
    model_or_params: Any, optimizer: str | type = "adamw", *, precision: str = "fp32", **optimizer_kwargs: Any
) -> TrainingMemory:
    """Weights, gradients, master weights and optimizer state for training ``model_or_params``.

    ``model_or_params`` is anything :func:`leanopt.estimate` takes (a model, on the ``meta``
    device or not; tensors; param groups); only trainable parameters count. ``optimizer`` and
    ``optimizer_kwargs`` are as for :func:`leanopt.estimate`. The formulas, per precision, and
    what is left out (activations) are in :mod:`leanopt.memory.training`.

    >>> import torch, leanopt
    >>> with torch.device("meta"):
    ...     model = torch.nn.Linear(1024, 1024)
    >>> m = leanopt.training_memory(model, "adamw")
    >>> m.weights, m.gradients, m.optimizer_state, m.total   # 4 + 4 + 8 B/param, 4-byte steps
    (4198400, 4198400, 8396808, 16793608)
    >>> leanopt.training_memory(model, "adamw", precision="bf16-mixed").total   # + 2 B/param
    18892808
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; known: {', '.join(PRECISIONS)}")
    weight_b, grad_b, master_b, dtype = PRECISIONS[precision]
    # Duplicates go first: the dtype-converted copies would no longer be the same tensor.
    state = estimate(_with_dtype(unique_params(model_or_params), dtype), optimizer, **optimizer_kwargs)
    n = state.params
    return TrainingMemory(
        optimizer=state.optimizer,
        precision=precision,
        params=n,
        weights=weight_b * n,
        gradients=grad_b * n,
        master_weights=master_b * n,
        state=state,
    )


def _with_dtype(model_or_params: Any, dtype: torch.dtype) -> Any:
    """The same trainable parameters (and groups) as meta tensors whose float dtype is ``dtype``."""

    def convert(p: torch.Tensor) -> torch.Tensor:
        return torch.empty(
            tuple(p.shape), dtype=dtype if p.is_floating_point() else p.dtype, device="meta", requires_grad=True
        )

    if isinstance(model_or_params, torch.nn.Module):
        return [convert(p) for p in model_or_params.parameters() if p.requires_grad]
    if isinstance(model_or_params, torch.Tensor):
        return [convert(model_or_params)]
    out: list[Any] = []
    for item in model_or_params:
        if isinstance(item, Mapping):
            params = item["params"]
            params = [params] if isinstance(params, torch.Tensor) else params
            out.append({**item, "params": [convert(p) for p in params]})
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
            out.append((item[0], convert(item[1])))
        elif isinstance(item, torch.Tensor):
            out.append(convert(item))
        else:
            out.append(item)  # estimate() says what is wrong with it
    return out
