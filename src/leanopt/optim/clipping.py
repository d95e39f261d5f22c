"""Gradient clipping over gradients that are not where torch looks for them.

Two things make ``p.grad`` the wrong place to look while leanopt holds gradients:

* ``offload="cpu"`` with :func:`leanopt.release_gradients`: each gradient is copied to a host
  buffer as autograd accumulates it and freed on the device; it waits there for ``step()``
  (also after the release is removed, until that step).
* Gradient release on the device, or a declared ``step_in_backward``: the gradients were applied
  inside ``backward`` -- there is nothing left to clip, and torch's function would clip nothing,
  silently.

Every object that may hold gradients or have applied them (a release; an offloaded optimizer
holding host gradients) registers here with :func:`engage` while it does. :func:`clip_grad_norm_`
and :func:`clip_grad_value_` ask all of them, whatever the number of optimizers: the norm is
over every gradient of the params given, wherever it is, and each is clipped where it is; a
param whose gradient was already applied is refused by name (``RuntimeError``), except in a call
with ``max_norm=inf`` -- which clips nothing and is what Trainer makes to log ``grad_norm`` --
which returns NaN, the norm of gradients that are gone.

``optimizer.clip_grad_norm_`` calls these. So that the loops that call torch's or accelerate's
function (Trainer, Accelerate, a plain loop) get them too, :func:`engage` replaces
``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` (and the names of their defining
module) and ``accelerate.Accelerator.clip_grad_norm_`` -- no extension point of theirs reaches
these gradients -- and the last :func:`disengage` (or the garbage collection of the last
holder) puts the libraries' own objects back: while nothing is engaged, no replacement is in
place. Each call over params no holder concerns is the library's own, called as it was.
Listed, with why, in :mod:`leanopt.torch_patches`.
"""

from __future__ import annotations

import functools
import math
import sys
import threading
import types
import weakref
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any, Protocol

import torch
import torch.nn.utils.clip_grad

__all__ = ["GradientHolder", "clip_grad_norm_", "clip_grad_value_", "disengage", "engage", "engaged"]

TORCH_CLIP_GRAD_NORM_ = torch.nn.utils.clip_grad_norm_
TORCH_CLIP_GRAD_VALUE_ = torch.nn.utils.clip_grad_value_


class GradientHolder(Protocol):
    """What clipping asks of an object that holds gradients elsewhere or has applied them."""

    def held_gradients(self, params: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """``id(param) -> gradient`` for those of ``params`` whose gradient it holds (the whole
        gradient the usual loop would have in ``p.grad``, a device part folded in)."""
        ...

    def applied(self, params: list[torch.Tensor]) -> list[str]:
        """Names of those of ``params`` whose gradient it applied since the loop's last
        ``step()``/``zero_grad()`` (nothing left to clip)."""
        ...



_HOLDERS: weakref.WeakSet[Any] = weakref.WeakSet()
_LOCK = threading.RLock()


def engage(holder: GradientHolder) -> None:
    """``holder`` may hold or have applied gradients from now on: clipping asks it, and the
    library functions are routed here while any holder is engaged."""
    with _LOCK:
        if holder in _HOLDERS:
            return
        _HOLDERS.add(holder)
        weakref.finalize(holder, _refresh)
        _refresh()


def disengage(holder: GradientHolder) -> None:
    """``holder`` holds no gradient and applied none any more."""
    with _LOCK:
        _HOLDERS.discard(holder)
        _refresh()


def engaged() -> bool:
    """Whether any holder is engaged (the library functions are routed here)."""
    return any(True for _ in _HOLDERS)


def _refresh() -> None:
    """Route the library functions here while a holder is engaged; restore them otherwise."""
    with _LOCK:
        if engaged():
            _route_torch()
            route_accelerate()
        else:
            _restore_torch()
            _restore_accelerate()


def _route_torch() -> None:
    # Written out, not looped over owners: tests/test_patch_points.py audits every assignment.
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    torch.nn.utils.clip_grad_value_ = clip_grad_value_
    torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_
    torch.nn.utils.clip_grad.clip_grad_value_ = clip_grad_value_


def _restore_torch() -> None:
    # Only our own replacements are taken back: one made since by someone else is theirs.
    if torch.nn.utils.clip_grad_norm_ is clip_grad_norm_:
        torch.nn.utils.clip_grad_norm_ = TORCH_CLIP_GRAD_NORM_
    if torch.nn.utils.clip_grad_value_ is clip_grad_value_:
        torch.nn.utils.clip_grad_value_ = TORCH_CLIP_GRAD_VALUE_
    if torch.nn.utils.clip_grad.clip_grad_norm_ is clip_grad_norm_:
        torch.nn.utils.clip_grad.clip_grad_norm_ = TORCH_CLIP_GRAD_NORM_
    if torch.nn.utils.clip_grad.clip_grad_value_ is clip_grad_value_:
        torch.nn.utils.clip_grad.clip_grad_value_ = TORCH_CLIP_GRAD_VALUE_


# ---- what the holders say about some params ---------------------------------------------------
def _sources(params: list[torch.Tensor]) -> tuple[dict[int, torch.Tensor], list[str]]:
    held: dict[int, torch.Tensor] = {}
    applied: list[str] = []
    for holder in list(_HOLDERS):
        held.update(holder.held_gradients(params))
        applied += holder.applied(params)
    return held, applied


def _refusal(what: str, applied: list[str]) -> RuntimeError:
    return RuntimeError(
        f"{what} over params whose gradients leanopt.release_gradients already applied inside backward "
        f"({names_of(applied)}): "
        "there is nothing left to clip, and clipping would silently do nothing. Clipping needs every gradient before "
        "any param is stepped: set max_grad_norm=0 in Trainer (or drop the clip), train without release, or make "
        "the optimizer with offload='cpu' and release without step_in_backward, so that the gradients wait on the "
        "host for step() and are clipped there"
    )


def _tensors(parameters: Any) -> list[Any]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:  # fmt: skip
    """``torch.nn.utils.clip_grad_norm_`` over ``parameters``' gradients wherever they are (see
    the module); torch's own for params no holder concerns."""
    params = _tensors(parameters)
    tensors = [p for p in params if isinstance(p, torch.Tensor)]
    held, applied = _sources(tensors)
    if not held and not applied:
        # torch's own, given what it was given (it warns about an empty generator)
        given = iter(params) if isinstance(parameters, types.GeneratorType) else parameters
        return TORCH_CLIP_GRAD_NORM_(given, max_norm, norm_type, error_if_nonfinite, foreach)
    return _clip_norm(tensors, held, applied, max_norm, norm_type, error_if_nonfinite, foreach)


def _clip_norm(tensors: list[torch.Tensor], held: dict[int, torch.Tensor], applied: list[str], max_norm: float,
               norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:  # fmt: skip
    if applied:
        if float(max_norm) == math.inf and not error_if_nonfinite:
            return torch.full((), math.nan, device=tensors[0].device)
        raise _refusal("clip_grad_norm_", applied)
    # A held gradient is a host buffer, not its param's .grad: a stand-in holds it there.
    targets: list[Any] = []
    grads: list[torch.Tensor] = []
    for p in tensors:
        grad = held.get(id(p), p.grad)
        if grad is not None:
            targets.append(SimpleNamespace(grad=grad) if id(p) in held else p)
            grads.append(grad)
    total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    torch.nn.utils.clip_grads_with_norm_(targets, max_norm, total, foreach)
    return total.to(tensors[0].device)


setattr(clip_grad_norm_, "__wrapped__", TORCH_CLIP_GRAD_NORM_)  # what functools.wraps would set: inspect sees torch's


def clip_grad_value_(parameters: Any, clip_value: float, foreach: bool | None = None) -> None:
    """``torch.nn.utils.clip_grad_value_`` over ``parameters``' gradients wherever they are (as
    :func:`clip_grad_norm_`): each element clamped to ``[-clip_value, clip_value]``."""
    params = _tensors(parameters)
    tensors = [p for p in params if isinstance(p, torch.Tensor)]
    held, applied = _sources(tensors)
    if applied:
        raise _refusal("clip_grad_value_", applied)
    if not held:
        given = iter(params) if isinstance(parameters, types.GeneratorType) else parameters
        return TORCH_CLIP_GRAD_VALUE_(given, clip_value, foreach)
    targets = [SimpleNamespace(grad=held[id(p)]) if id(p) in held else p for p in tensors]
    # torch's own clamp of each gradient: the same bits as torch's function on device gradients;
    # torch reads only each one's .grad; its annotation asks for Tensors, which the stand-ins are not.
    TORCH_CLIP_GRAD_VALUE_(targets, clip_value, foreach)  # type: ignore[arg-type]


setattr(clip_grad_value_, "__wrapped__", TORCH_CLIP_GRAD_VALUE_)


# ---- accelerate ---------------------------------------------------------------------------------
def _accelerator_class() -> Any:
    from leanopt.torch_patches import PEER_PATCHES

    (module_name, class_name, attr, _), = PEER_PATCHES  # the one listed: accelerate's clip_grad_norm_
    return getattr(sys.modules.get(module_name), class_name, None), attr


def route_accelerate() -> None:
    """While a holder is engaged: make ``accelerate.Accelerator.clip_grad_norm_`` (what Trainer
    calls for ``max_grad_norm``) see held and applied gradients, once accelerate is imported
    (called at :func:`engage` and again at each released backward, by when a Trainer has
    imported it). Since accelerate 1.16 it clips with ``get_total_norm`` over the params whose
    ``.grad`` is set, not through ``torch.nn.utils.clip_grad_norm_``, so it would clip released
    gradients not at all, silently. Over params no holder concerns the call is accelerate's own."""
    with _LOCK:
        accelerator, attr = _accelerator_class()
        original = getattr(accelerator, attr, None)
        if original is None or getattr(original, "_leanopt_original", None) is not None or not engaged():
            return

        @functools.wraps(original)
        def routed(self: Any, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
            params = _tensors(parameters)
            tensors = [p for p in params if isinstance(p, torch.Tensor)]
            held, applied = _sources(tensors)
            if not held and not applied:
                return original(self, params, max_norm, norm_type)
            self.unscale_gradients()
            return _clip_norm(tensors, held, applied, max_norm, norm_type)

        routed._leanopt_original = original  # type: ignore[attr-defined]
        setattr(accelerator, attr, routed)


def _restore_accelerate() -> None:
    accelerator, attr = _accelerator_class()
    current = getattr(accelerator, attr, None)
    original = getattr(current, "_leanopt_original", None)
    if original is not None:
        setattr(accelerator, attr, original)


def names_of(params: Iterable[Any], limit: int = 4) -> str:
    """For messages: the first ``limit`` of ``params`` (strings) and how many more."""
    shown = list(params)
    return ", ".join(shown[:limit]) + (f" and {len(shown) - limit} more" if len(shown) > limit else "")
