r"""Memory of training a model with an optimizer: weights, gradients, master weights, state.

For :math:`N` trainable parameter elements (frozen parameters and buffers are not counted)
and :math:`S_{dt}` the state :func:`leanopt.estimate` predicts for parameters of dtype ``dt``:

=============  ==========  ==========  ================  ==================
precision      weights     gradients   master weights    optimizer state
=============  ==========  ==========  ================  ==================
``fp32``       4N          4N          0                 S_fp32
``bf16-mixed`` 2N (bf16)   4N (fp32)   4N (fp32)         S_fp32
``bf16``       2N          2N          0                 S_bf16 (+ 2N: ``rounding="kahan"``)
=============  ==========  ==========  ================  ==================

With ``grad_release=True`` the gradients term is the largest param's gradient (4 or 2 bytes
times its elements) instead of 4N or 2N.

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
``torch.optim.AdamW``: bf16 state). leanopt's optimizers take ``rounding=`` for it
(:mod:`leanopt.optim.rounding`): ``"nearest"`` (default) and ``"stochastic"`` keep nothing more;
``"kahan"`` keeps a compensation buffer of the param's dtype, 2 B/param in bf16 (``kahan_comp``,
part of the state layout, so it is in the optimizer state). Pass it as for the optimizer:
``training_memory(model, "adamw", precision="bf16", rounding="kahan")``. Only what persists
between steps is counted: a stochastic or Kahan step also computes on fp32 copies of a param and
its gradient, a transient that :func:`leanopt.memory.plan.plan` counts: in chunks of at most
:data:`leanopt.optim.rounding.ROUNDING_CHUNK` elements for an elementwise rule (AdamW on the CPU:
60 B per element of a chunk with stochastic rounding, 10 with Kahan's), of the whole param for a
factored one (Adafactor: 8 B per element of the largest param, its rounding back in chunks).

``grad_release=True`` is training under :func:`leanopt.release_gradients`: each param is stepped
inside ``backward`` and its gradient freed at once, so the gradients term is the largest
trainable param's gradient (what is live when its hook runs) instead of all of them; gradients
autograd holds for a moment before they reach ``.grad`` (a layer's bias while its weight's hook
runs) are temporaries, left out as the optimizer's are. Nothing of them persists after the step.

``offload=True`` is ``offload="cpu"`` (:mod:`leanopt.optim.offload`): the optimizer state and the
host copies of the params -- fp32, the master weights of bf16 params -- are in host memory
(:attr:`TrainingMemory.host_bytes`, with the host gradient buffers: one per param with
``grad_release``, the bound while gradients accumulate; else the two largest buffers in flight,
a param of an elementwise rule going in chunks of at most 2**22 elements:
:meth:`leanopt.optim.offload.Offload.host_bytes`, whose count this is), and
the device keeps weights and gradients only (``optimizer_state`` and ``master_weights`` are 0).
It takes ``precision="fp32"`` or ``"bf16"`` (bf16 params with an fp32 master on the host);
``"bf16-mixed"``'s fp32 master weights are the model's own params, on the device.

Not counted: activations (they depend on batch size, sequence length and checkpointing),
temporary buffers of the optimizer step, the CUDA context and allocator fragmentation.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from leanopt.memory.estimate import MiB, StateEstimate, estimate, resolve_optimizer, unique_params

__all__ = ["PRECISIONS", "TRAINING_MODES", "TrainingMemory", "supports_training_modes", "training_memory"]

# precision -> (bytes per weight, per gradient, per master weight, dtype the optimizer steps)
PRECISIONS: dict[str, tuple[int, int, int, torch.dtype]] = {
    "fp32": (4, 4, 0, torch.float32),
    "bf16-mixed": (2, 4, 4, torch.float32),
    "bf16": (2, 2, 0, torch.bfloat16),
}

# (precision, rounding): every mode the tables show. rounding is the optimizer's ``rounding=`` for
# pure bf16 (leanopt's optimizers); None where it does not apply.
TRAINING_MODES: tuple[tuple[str, str | None], ...] = (
    ("fp32", None),
    ("bf16-mixed", None),
    ("bf16", "nearest"),
    ("bf16", "stochastic"),
    ("bf16", "kahan"),
)


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
    rounding: str | None = None  # pure bf16 with a leanopt optimizer: its rounding=
    grad_release: bool = False  # gradients: the largest param's (see leanopt.memory.training)
    offload: bool = False  # offload="cpu": state and host copies in host memory
    host_copies: int = 0  # offloaded: the host copy of each param (fp32 master for bf16)
    host_gradients: int = 0  # offloaded: host gradient buffers (their bound)

    @property
    def compensation(self) -> int:
        """Bytes of Kahan compensation (``kahan_comp``), included in :attr:`optimizer_state`."""
        return self.state.by_key.get("kahan_comp", 0)

    @property
    def mode(self) -> str:
        """``"bf16 kahan"``, ``"fp32 + grad release"``...: precision, rounding and release in words."""
        text = f"{self.precision} {self.rounding}" if self.rounding else self.precision
        return text + (" + grad release" if self.grad_release else "") + (" + offload" if self.offload else "")

    @property
    def optimizer_state(self) -> int:
        """Bytes of optimizer state on the params' device (0 when offloaded: see :attr:`host_bytes`)."""
        return 0 if self.offload else self.state.bytes

    @property
    def host_bytes(self) -> int:
        """Offloaded: host copies, optimizer state and host gradient buffers; else 0."""
        return self.host_copies + self.state.bytes + self.host_gradients if self.offload else 0

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
        out = {
            "weights": self.weights,
            "gradients": self.gradients,
            "master_weights": self.master_weights,
            "optimizer_state": self.optimizer_state,
            "total": self.total,
        }
        if self.offload:
            out["host_bytes"] = self.host_bytes
        return out

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {v / MiB:,.0f}" for k, v in self.as_dict().items() if k != "total" and v)
        return (
            f"{self.optimizer} ({self.mode}): {self.total:,} bytes ({self.megabytes:,.0f} MB) "
            f"for {self.params:,} params, {self.bytes_per_param:.2f} B/param [MB: {parts}]"
            + (f"; host {self.host_bytes:,} bytes ({self.host_bytes / MiB:,.0f} MB)" if self.offload else "")
        )


def supports_training_modes(optimizer: str | type) -> bool:
    """Whether ``optimizer`` takes ``rounding=`` and :func:`leanopt.release_gradients` (leanopt's optimizers)."""
    from leanopt.optim.base import LeanOptimizer

    return issubclass(resolve_optimizer(optimizer), LeanOptimizer)


def training_memory(
    model_or_params: Any,
    optimizer: str | type = "adamw",
    *,
    precision: str = "fp32",
    grad_release: bool = False,
    offload: bool = False,
    **optimizer_kwargs: Any,
) -> TrainingMemory:
    """Weights, gradients, master weights and optimizer state for training ``model_or_params``.

    ``model_or_params`` is anything :func:`leanopt.estimate` takes (a model, on the ``meta``
    device or not; tensors; param groups); only trainable parameters count. ``optimizer`` and
    ``optimizer_kwargs`` are as for :func:`leanopt.estimate` (``rounding="kahan"`` adds its
    compensation to the state of bf16 params). ``grad_release``: under
    :func:`leanopt.release_gradients`, the gradients term is the largest param's gradient. The
    formulas, per precision, and what is left out (activations, transients) are in
    :mod:`leanopt.memory.training`.

    >>> import torch, leanopt
    >>> with torch.device("meta"):
    ...     model = torch.nn.Linear(1024, 1024)
    >>> m = leanopt.training_memory(model, "adamw")
    >>> m.weights, m.gradients, m.optimizer_state, m.total   # 4 + 4 + 8 B/param, 4-byte steps
    (4198400, 4198400, 8396808, 16793608)
    >>> leanopt.training_memory(model, "adamw", precision="bf16-mixed").total   # + 2 B/param
    18892808
    >>> leanopt.training_memory(model, "adamw", precision="bf16", rounding="kahan").compensation   # 2 B/param
    2099200
    >>> leanopt.training_memory(model, "adamw", grad_release=True).gradients   # the weight's gradient only
    4194304
    >>> m = leanopt.training_memory(model, "adamw8bit", precision="bf16", offload=True)
    >>> m.total, m.host_bytes   # device: bf16 weights and gradients; host: fp32 master, states, 2 gradients
    (4198400, 8435720)
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; known: {', '.join(PRECISIONS)}")
    if not isinstance(grad_release, bool):
        raise ValueError(f"grad_release must be True or False, got {grad_release!r}")  # noqa: TRY004
    lean = supports_training_modes(optimizer)
    name = optimizer if isinstance(optimizer, str) else optimizer.__name__
    if "rounding" in optimizer_kwargs and not lean:
        raise ValueError(f"{name} has no rounding= option (leanopt's optimizers have it); its bf16 steps round to nearest")
    if grad_release and not lean:
        raise ValueError(f"grad_release: leanopt.release_gradients needs a leanopt optimizer, not {name}")
    if not isinstance(offload, bool):
        raise ValueError(f"offload must be True or False, got {offload!r}")  # noqa: TRY004
    if offload and not lean:
        raise ValueError(f"offload: offload='cpu' is an option of leanopt's optimizers, not of {name}")
    if offload and precision == "bf16-mixed":
        raise ValueError("offload with precision='bf16-mixed': its fp32 master weights are the model's params, on the "
                         "device; use precision='bf16' (bf16 params, fp32 masters on the host) or 'fp32'")  # fmt: skip
    weight_b, grad_b, master_b, dtype = PRECISIONS[precision]
    from leanopt.optim.base import LeanOptimizer

    cls = resolve_optimizer(optimizer)
    if isinstance(model_or_params, torch.nn.Module) and issubclass(cls, LeanOptimizer):
        model_or_params = cls.groups_for_model(model_or_params)  # Muon: its param groups of the model
    # Duplicates go first: the dtype-converted copies would no longer be the same tensor.
    params = _with_dtype(unique_params(model_or_params), dtype)
    state = estimate(params, optimizer, **optimizer_kwargs)
    n = state.params
    gradients = grad_b * n
    if grad_release:
        gradients = grad_b * max((p.numel() for p in _param_tensors(params)), default=0)
    rounding = None
    if precision == "bf16" and lean:
        rounding = optimizer_kwargs.get("rounding", "nearest")
    host_copies = host_gradients = 0
    if offload:
        if rounding not in (None, "nearest"):
            raise ValueError(f"offload with rounding={rounding!r}: the fp32 master on the host leaves nothing for it")
        host_copies = 4 * n  # fp32 host copies: the params' own, or bf16 params' masters
        # The engine's own count, on the meta params (nothing allocated, no host memory checked).
        offloaded = resolve_optimizer(optimizer)(params, **optimizer_kwargs, offload="cpu")
        host_gradients = offloaded.placement.host_bytes(released=grad_release) - host_copies - state.bytes
    return TrainingMemory(
        optimizer=state.optimizer,
        precision=precision,
        params=n,
        weights=weight_b * n,
        gradients=gradients,
        master_weights=master_b * n,
        state=state,
        rounding=rounding,
        grad_release=grad_release,
        offload=offload,
        host_copies=host_copies,
        host_gradients=host_gradients,
    )


def _param_tensors(params: list[Any]) -> Iterator[torch.Tensor]:
    for item in params:
        if isinstance(item, Mapping):
            yield from item["params"]
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
            yield item[1]
        elif isinstance(item, torch.Tensor):
            yield item


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
