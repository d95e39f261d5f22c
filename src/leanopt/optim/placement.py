"""Where an optimizer's states live and its params are stepped: the one seam for it.

``LeanOptimizer`` delegates to its ``placement`` everything that depends on where a step runs:
``step()``, ``zero_grad()``, the device its states are created on, the checks of a param group,
waiting for steps in flight before ``state_dict``/``load_state_dict``, and -- through a
:class:`~leanopt.optim.release.GradientRelease` attached to it -- what happens to a gradient
released inside ``backward``. The optimizer keeps the rule's maths (``update``) and its
bookkeeping; the placement decides which params are stepped, when, and on which tensors.

:class:`OnDevice` (this module) steps the params where they are, from ``p.grad``: the usual loop.
:class:`~leanopt.optim.offload.Offloaded` keeps the states and a host copy of each param in host
memory and steps there.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any, ClassVar, Protocol

import torch

__all__ = ["OnDevice", "Pending", "Placement", "Release"]

# (group index, index in the group, param): a param with a gradient waiting to be stepped.
Pending = tuple[int, int, torch.Tensor]


class Release(Protocol):
    """What a placement asks of the gradient release attached to it
    (:class:`leanopt.optim.release.GradientRelease`): the loop's calls go through its cycle."""

    def step(self) -> None: ...

    def zero_grad(self, set_to_none: bool) -> None: ...

    def hook_params(self) -> None: ...


class Placement:
    """What every placement does (see the module); :class:`OnDevice` is the plain one."""

    # What ``optimizer.offload`` reports: None (states with the params) or "cpu".
    offload: ClassVar[str | None] = None

    def __init__(self, optimizer: Any) -> None:
        # A proxy: the optimizer owns its placement, and a worker thread of the placement must
        # not keep the optimizer alive.
        self.optimizer = optimizer if isinstance(optimizer, weakref.ProxyTypes) else weakref.proxy(optimizer)
        self.release: Release | None = None

    # ---- bookkeeping ---------------------------------------------------------------------
    def state_device(self, p: torch.Tensor) -> torch.device:
        """The device ``p``'s states are created on."""
        return p.device

    def matrix_device(self, t: torch.Tensor) -> torch.device:
        """Where a step's matrix products on ``t`` (a param or its host copy) run: the device of
        the params (Muon's orthogonalization), wherever the states are."""
        return t.device

    def check_group(self, group: Any, gi: int | None = None) -> None:
        """Refuse a param group this placement cannot step (``ValueError``)."""

    def group_added(self) -> None:
        """A param group was added: a release attached hooks its params too."""
        if self.release is not None:
            self.release.hook_params()

    def check_release_memory(self) -> None:
        """Refuse a release whose buffers would not fit (``RuntimeError``): none needed here."""

    def wait(self) -> None:
        """Wait for every step in flight (none here)."""

    def close(self) -> None:
        """Stop what runs in the background (nothing here)."""

    # ---- the loop --------------------------------------------------------------------------
    def step(self) -> None:
        """``optimizer.step()``: every param with a gradient is stepped (a release first checks
        its cycle and names what was already applied inside backward)."""
        if self.release is not None:
            self.release.step()
        else:
            self.step_pending()

    def zero_grad(self, set_to_none: bool) -> None:
        """``optimizer.zero_grad()``, before torch's own: gradients held elsewhere are dropped."""
        if self.release is not None:
            self.release.zero_grad(set_to_none)
        else:
            self.discard(set_to_none)

    def pending(self, skip: Iterable[int] = (), zeros: Iterable[int] = ()) -> list[Pending]:
        """The params the usual loop's ``step()`` would step now, in group order: those with a
        gradient here, and those in ``zeros`` (ids of params holding a zero gradient after
        ``zero_grad(set_to_none=False)``), leaving out ``skip`` (ids already applied)."""
        skipped, zeroed = set(skip), set(zeros)
        opt = self.optimizer
        return [(gi, i, p) for gi, g in enumerate(opt.param_groups) for i, p in enumerate(g["params"])
                if id(p) not in skipped and (self.has_gradient(p) or id(p) in zeroed)]  # fmt: skip

    def has_gradient(self, p: torch.Tensor) -> bool:
        return p.grad is not None

    def step_pending(self, skip: Iterable[int] = (), zeros: Iterable[int] = ()) -> list[Pending]:
        """Step :meth:`pending` (every gradient checked before any param changes); returns them."""
        pending = self.pending(skip, zeros)
        opt = self.optimizer
        for gi, i, p in pending:
            opt._check_grad(p, gi, i)
        by_group: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for gi, i, p in pending:
            if p.grad is None:  # a zero gradient the usual loop would hold
                p.grad = torch.zeros_like(p)
            by_group.setdefault(gi, []).append((i, p))
        for gi, params in by_group.items():
            opt._step_params(gi, params, f"group{gi}")
        return pending

    def discard(self, set_to_none: bool) -> None:
        """Drop (``set_to_none``) or zero the gradients this placement holds outside ``p.grad``
        (torch's ``zero_grad`` then does ``p.grad``): none here."""

    def take(self, p: torch.Tensor, gi: int, index: int, *, apply: bool, outermost: bool = True) -> None:
        """A gradient released inside ``backward`` (``p.grad``): on the device it is applied at
        once and freed (how release frees it; ``apply`` is always asked for here)."""
        if not apply:
            raise RuntimeError("on the device a released gradient is applied as it arrives")
        self.optimizer._step_params(gi, [(index, p)], f"group{gi}/param{index}")
        p.grad = None

    def held_gradients(self, params: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """``id(param) -> gradient`` held outside ``p.grad`` (for clipping): none here."""
        return {}


class OnDevice(Placement):
    """States with the params, steps where the params are (the default)."""
