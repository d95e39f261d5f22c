"""Gradient release: each parameter is stepped inside ``backward``, as soon as its gradient is ready.

With :func:`release_gradients` a parameter's update runs from its post-accumulate-grad hook and
its gradient is freed at once, so at most the gradients of the layers backward is working on are
alive, instead of all of them: the gradient term of training memory nearly disappears. The maths
is the optimizer's own, per parameter (every leanopt rule updates each parameter from its own
gradient and state), so results are bit-identical to the usual ``backward(); step()`` loop.

What cannot work is refused rather than trained wrongly:

* **Gradient accumulation** over several backward passes: the first backward already stepped.
  A param whose gradient arrives a second time before ``optimizer.step()``/``zero_grad()`` is
  called raises ``RuntimeError`` (once the loop has called either; a loop that calls neither
  takes one step per backward, which is what release means).
* **Global gradient-norm clipping** (``clip_grad_norm_``, Trainer's default
  ``max_grad_norm=1.0``): the norm needs every gradient at once, and they are freed as they
  come; after backward there is nothing to clip. Set ``max_grad_norm=0`` (Trainer) or drop the
  clip; this module cannot see a plain ``clip_grad_norm_`` call, which would return 0.
* **DDP and FSDP2**: both reduce gradients across ranks after the hooks run (DDP's reducer) or
  assign them outside autograd's accumulation (FSDP2's reduce-scatter), so a released step
  would use the local, unreduced gradient or never run. Both raise ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from leanopt.optim.base import LeanOptimizer
from leanopt.optim.sharding import is_dtensor

__all__ = ["GradientRelease", "release_gradients"]


class GradientRelease:
    """The hooks of :func:`release_gradients`; ``remove()`` (or leaving a ``with`` block)
    restores the ordinary loop."""

    def __init__(self, optimizer: LeanOptimizer) -> None:
        self.optimizer = optimizer
        self._handles: list[Any] = []
        self._seen: set[int] = set()  # ids of params stepped since the loop last called step/zero_grad
        self._loop_calls_step = False
        for gi, group in enumerate(optimizer.param_groups):
            for index, p in enumerate(group["params"]):
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._hook(gi, index)))
        optimizer._gradient_release = self

    def _hook(self, gi: int, index: int):
        def released(p: torch.Tensor) -> None:
            if id(p) in self._seen and self._loop_calls_step:
                raise RuntimeError(
                    f"leanopt.release_gradients: param {index} of group {gi} got a second gradient before "
                    "optimizer.step(): gradient accumulation cannot work when each backward steps and frees "
                    "the gradients (remove the release, or step once per backward)"
                )
            self._seen.add(id(p))
            self.optimizer._step_param(p, gi, index)
            p.grad = None

        return released

    def _optimizer_stepped(self) -> None:
        """``optimizer.step()`` or ``zero_grad()`` was called: one training step is over."""
        self._loop_calls_step = True
        self._seen.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if getattr(self.optimizer, "_gradient_release", None) is self:
            self.optimizer._gradient_release = None

    def __enter__(self) -> GradientRelease:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def release_gradients(model: torch.nn.Module | Iterable[torch.Tensor], optimizer: torch.optim.Optimizer) -> GradientRelease:
    """Step each param of ``optimizer`` inside ``backward`` and free its gradient at once.

    ``optimizer.step()`` and ``optimizer.zero_grad()`` become no-ops while released, so existing
    loops, LR schedulers, Trainer and Accelerate keep working (schedulers change ``lr`` between
    steps as before). Returns a handle: ``handle.remove()`` ends the release.

    >>> import torch, leanopt
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = leanopt.AdamW(model.parameters(), lr=1e-2)
    >>> handle = leanopt.release_gradients(model, opt)
    >>> model(torch.randn(8, 4)).square().mean().backward()   # the step happens here
    >>> model.weight.grad is None, int(opt.state[model.weight]["step"])
    (True, 1)
    >>> handle.remove()

    Raises ``ValueError`` for an optimizer that is not leanopt's, one already released, a model
    wrapped in DDP, or DTensor (FSDP2) params; see the module for gradient accumulation and
    clipping.
    """
    if not isinstance(optimizer, LeanOptimizer):
        raise ValueError(
            f"release_gradients needs a leanopt optimizer (it steps one param at a time), got {type(optimizer).__name__}"
        )
    if getattr(optimizer, "_gradient_release", None) is not None:
        raise ValueError("this optimizer's gradients are already released: remove() the first handle before releasing again")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise ValueError(
            "release_gradients does not work under DDP: its reducer all-reduces gradients after the hooks that "
            "would step them; train without release, or shard with FSDP2 and no release"
        )
    for group in optimizer.param_groups:
        for p in group["params"]:
            if is_dtensor(p):
                raise ValueError(
                    "release_gradients does not work with FSDP2 (DTensor params): their gradients are reduce-scattered "
                    "outside autograd's accumulation, where no hook sees them"
                )
    return GradientRelease(optimizer)
