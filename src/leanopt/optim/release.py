"""Gradient release: each parameter is stepped inside ``backward``, as soon as its gradient is ready.

With :func:`release_gradients` a parameter's update runs from its post-accumulate-grad hook and
its gradient is freed at once, so at most the gradients of the layers backward is working on are
alive, instead of all of them: the gradient term of training memory nearly disappears. The maths
is the optimizer's own, per parameter (every leanopt rule updates each parameter from its own
gradient and state), so results are bit-identical to the usual ``backward(); step()`` loop.

What is stepped, and when:

* A param with a hook is stepped by it, inside ``backward``, and its gradient freed.
* A gradient no hook saw is stepped, once, at the end of the backward (after its hooks) or by
  ``optimizer.step()``, and freed: a param unfrozen after the release (a hook needs
  ``requires_grad``: it gets one at the end of that backward, or at ``step()``), one with a gradient set by hand or from
  ``torch.autograd.grad`` (which does not run the hooks). Groups added with
  ``add_param_group`` while released are hooked at once. ``zero_grad()`` drops such gradients,
  as in the usual loop.
* Under reentrant activation checkpointing (``checkpoint(use_reentrant=True)``) each segment's
  backward is a backward of its own, run inside the outer one, and a weight several segments
  share gets its gradient in parts. A param whose gradient arrives in such an inner backward
  is stepped once, on the whole gradient, when the outermost backward ends; its gradient lives
  until then (``use_reentrant=False``, torch's recommendation, has one backward and keeps the
  whole saving). A param used inside and outside such checkpoints whose outside gradient came
  first (and was stepped) raises ``RuntimeError`` when an inside part arrives.

What cannot work is refused rather than trained wrongly:

* **Gradient accumulation** over several backward passes: the first backward already stepped.
  A param whose gradient arrives a second time before ``optimizer.step()``/``zero_grad()`` is
  called raises ``RuntimeError`` (once the loop has called either; a loop that calls neither
  takes one step per backward, which is what release means).
* **Global gradient-norm clipping** (``clip_grad_norm_``, Trainer's default
  ``max_grad_norm=1.0``): the norm needs every gradient at once, and they are freed as they
  come; after backward there is nothing to clip, and torch's function would silently clip
  nothing. The first release routes ``torch.nn.utils.clip_grad_norm_`` (what Trainer and
  Accelerate call) through leanopt's one wrapper (:func:`leanopt.optim.offload.clip_grad_norm_`),
  which raises ``RuntimeError`` for params whose gradients were stepped and freed since the
  loop's last ``step()``/``zero_grad()`` (:func:`freed_by_release`). Set ``max_grad_norm=0``
  (Trainer) or drop the clip, or use ``offload="cpu"``, whose released gradients wait on the host
  and are clipped there. A call with ``max_norm=inf`` clips nothing, and is what Trainer makes
  to log ``grad_norm`` even at ``max_grad_norm=0``: it returns NaN (the norm of gradients that
  are gone is not known), not torch's 0. ``torch.nn.utils.clip_grad_value_`` (Accelerate's
  ``clip_grad_value_``) is routed the same way: refused for freed gradients, applied to the
  host-held ones of ``offload="cpu"``. ``torch.nn.utils.get_total_norm`` takes gradients, not
  params, and is not routed: after release each ``p.grad`` it would be given is ``None``.
* **An AMP GradScaler**: the hooks would step the scaled (possibly inf) gradients, and skipping
  a step on inf needs every gradient before any param is stepped. The scaler is invisible to an
  optimizer until ``scaler.step``, so the first released gradient looks for one: an enabled
  ``GradScaler`` that has scaled a loss, anywhere in the process, raises ``ValueError`` before
  anything is stepped (``GradScaler(enabled=False)`` is not refused). A scaler first used later
  is refused at its ``scaler.step(optimizer)``, after one backward stepped its scaled gradients.
* **DDP and FSDP2**: both reduce gradients across ranks after the hooks run (DDP's reducer) or
  assign them outside autograd's accumulation (FSDP2's reduce-scatter), so a released step
  would use the local, unreduced gradient or never run. Both raise ``ValueError``: a DDP-wrapped
  model or DTensor params at ``release_gradients``; a model wrapped in DDP after the release,
  or released as ``ddp.module``, at the first released gradient (a ``DistributedDataParallel``
  that holds any of the optimizer's params, whatever the world size). Ranks that each train
  their own model, without DDP, are not refused.

The two checks at the first released gradient look through Python's garbage collector for live
``GradScaler`` and ``DistributedDataParallel`` objects (neither announces itself to the
params), once per release: ~0.1 s in a process of 400k objects.
"""

from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Iterable
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch

from leanopt.optim.base import LeanOptimizer
from leanopt.optim.sharding import is_dtensor

if TYPE_CHECKING:
    from leanopt.optim.offload import Offload

__all__ = ["GradientRelease", "OffloadRelease", "freed_by_release", "release_gradients"]

# A custom autograd Function's backward runs inside this frame; a backward that starts there (a
# reentrant checkpoint's recomputation) is nested in another. The engine tells Python neither
# the nesting nor the outer backward, so the frames are where to see them.
_FUNCTION_BACKWARD = torch.autograd.function.BackwardCFunction.apply.__code__


def _enclosing_function_node() -> Any:
    """The autograd node (a custom Function's) whose backward runs the current backward, or
    ``None`` when the current backward is an outermost one."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _FUNCTION_BACKWARD:
            return frame.f_locals.get("self")
        frame = frame.f_back
    return None


def _with_subclasses(cls: type) -> list[type]:
    out = [cls]
    subclasses: list[type] = cls.__subclasses__()
    for sub in subclasses:
        out += _with_subclasses(sub)
    return out


def _live(classes: list[type]) -> list[Any]:
    """The live instances of ``classes``: an instance refers to its class, so the collector
    finds it among the class's referrers."""
    return [o for o in gc.get_referrers(*classes) if type(o) in classes]


# The on-device releases in effect: what the clipping wrapper asks (freed_by_release).
_RELEASES: weakref.WeakSet[GradientRelease] = weakref.WeakSet()

CLIP_AFTER_RELEASE = (
    "torch.nn.utils.clip_grad_norm_ over params whose gradients leanopt.release_gradients already applied and "
    "freed inside backward: there is nothing left to clip, and clipping would silently do nothing. Clipping needs "
    "every gradient before any param is stepped: set max_grad_norm=0 in Trainer (or drop the clip), train without "
    "release, or make the optimizer with offload='cpu', whose released gradients wait on the host and are clipped there"
)


def freed_by_release(params: Iterable[Any]) -> GradientRelease | None:
    """The on-device release (if any) that stepped and freed the gradient of one of ``params``
    since its loop last called ``step()`` or ``zero_grad()``: a clip of ``params`` now would
    find that gradient gone."""
    ids = {id(p) for p in params if isinstance(p, torch.Tensor)}
    for release in list(_RELEASES):
        if not ids.isdisjoint(release._seen):
            return release
    return None


class GradientRelease:
    """The hooks of :func:`release_gradients`; ``remove()`` (or leaving a ``with`` block)
    restores the ordinary loop."""

    # Whether a released gradient is freed once stepped (so a later clip cannot see it); an
    # offloaded release keeps it on the host until step().
    frees_gradients = True

    def __init__(self, optimizer: LeanOptimizer) -> None:
        from leanopt.optim.offload import route_torch_clipping

        self.optimizer = optimizer
        self._handles: dict[int, Any] = {}  # id(param) -> its hook
        self._seen: set[int] = set()  # ids of params stepped since the loop last called step/zero_grad
        self._loop_calls_step = False
        self._checked = False  # the first released gradient checks for a GradScaler and DDP
        self._flush_task: int | None = None  # the backward whose end steps what no hook stepped
        self._nodes: dict[int, Any] = {}  # id(node) -> a post hook on an outer backward's node
        # In the backward under way: params its hooks stepped; params with parts from inner backwards.
        self._this_backward: set[int] = set()
        self._deferred: set[int] = set()
        self._hook_params()
        optimizer._gradient_release = self
        route_torch_clipping()  # the one patch point: refuses a clip of freed gradients (offload: clips host ones)
        if self.frees_gradients:
            _RELEASES.add(self)
        # GradScaler.step then calls optimizer.step() (instead of asserting that it found no
        # gradient to unscale), where a scaler used after the first check is refused by name.
        optimizer._step_supports_amp_scaling = True  # read by GradScaler through getattr (declared on LeanOptimizer)

    def _hook_params(self) -> None:
        """Hook every param that requires grad and has no hook yet (at the release, for groups
        added later, and for params unfrozen since: a hook needs ``requires_grad``)."""
        for gi, group in enumerate(self.optimizer.param_groups):
            for index, p in enumerate(group["params"]):
                if p.requires_grad and id(p) not in self._handles:
                    if is_dtensor(p):
                        raise ValueError(_FSDP2_REFUSAL)
                    self._handles[id(p)] = p.register_post_accumulate_grad_hook(self._hook(gi, index))

    def _hook(self, gi: int, index: int):
        def released(p: torch.Tensor) -> None:
            if not self._checked:
                self._check_process()
            if id(p) in self._seen and self._loop_calls_step:
                raise RuntimeError(
                    f"leanopt.release_gradients: param {index} of group {gi} got a second gradient before "
                    "optimizer.step(): gradient accumulation cannot work when each backward steps and frees "
                    "the gradients (remove the release, or step once per backward)"
                )
            node = _enclosing_function_node()
            if node is not None:
                # An inner backward (reentrant checkpoint): more of this gradient may come from
                # other segments; it accumulates, and is stepped when the outermost backward ends.
                if id(p) in self._this_backward:
                    raise RuntimeError(
                        f"leanopt.release_gradients: param {index} of group {gi} got part of its gradient in a "
                        "reentrant checkpoint's inner backward after it was stepped on the rest (it is used both "
                        "inside and outside checkpoint(use_reentrant=True)); use use_reentrant=False"
                    )
                self._deferred.add(id(p))
                self._after(node)
                return
            self._flush_after_this_backward()
            if id(p) in self._deferred:  # parts came from inner backwards: the rest may still come
                return
            self._seen.add(id(p))
            self._this_backward.add(id(p))
            self.optimizer._step_param(p, gi, index)
            p.grad = None

        return released

    def _after(self, node: Any) -> None:
        """Flush when the backward that runs ``node`` ends (outermost) or, nested itself, the one
        around it: a post hook on the node runs in its own backward, after the inner one."""
        if id(node) not in self._nodes:
            self._nodes[id(node)] = node.register_hook(self._node_done)

    def _node_done(self, grad_inputs: Any, grad_outputs: Any) -> None:
        node = _enclosing_function_node()
        if node is not None:
            self._after(node)
        else:
            self._flush_after_this_backward()

    def _flush_after_this_backward(self) -> None:
        task = torch._C._current_graph_task_id()
        if task != self._flush_task:
            self._flush_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._flush)

    def _flush(self) -> None:
        """The end of a backward: step every gradient no hook stepped (see the module)."""
        self._flush_task = None
        self._forget_backward()
        self._step_unconsumed()
        self._hook_params()

    def _forget_backward(self) -> None:
        for handle in self._nodes.values():
            handle.remove()
        self._nodes.clear()
        self._this_backward.clear()
        self._deferred.clear()

    def _step_unconsumed(self) -> None:
        opt = self.optimizer
        pending = [(gi, i, p) for gi, g in enumerate(opt.param_groups) for i, p in enumerate(g["params"]) if p.grad is not None]
        for gi, i, p in pending:  # every gradient checked before any param changes
            opt._check_grad(p, gi, i)
        for gi, i, p in pending:
            opt._step_param(p, gi, i)
            p.grad = None
            self._seen.add(id(p))

    def _check_process(self) -> None:
        """Refuse a GradScaler in use and a DDP over these params (see the module); route
        accelerate's clipping, imported by now if a Trainer runs this backward."""
        from leanopt.optim.offload import route_accelerate_clipping

        route_accelerate_clipping()
        scalers, ddps = self._scalers_and_ddps()
        if scalers or ddps:  # perhaps unreachable objects the collector has not freed yet
            gc.collect()
            scalers, ddps = self._scalers_and_ddps()
        if scalers:
            raise ValueError(_SCALER_REFUSAL)
        if ddps:
            raise ValueError(
                "leanopt.release_gradients does not work under DDP: the optimizer's params are held by a "
                "DistributedDataParallel (the model was wrapped after release_gradients, or released as "
                "ddp.module), whose reducer all-reduces gradients after the hooks that step them, so each rank "
                "would step on its own gradient; train without release, or shard with FSDP2 and no release"
            )
        self._checked = True

    def _scalers_and_ddps(self) -> tuple[list[Any], list[Any]]:
        ddp_classes = _with_subclasses(torch.nn.parallel.DistributedDataParallel)
        found = _live(_with_subclasses(torch.amp.GradScaler) + ddp_classes)
        ours = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        # An enabled scaler that has scaled a loss has its scale tensor; a disabled one scales nothing.
        scalers = [o for o in found if type(o) not in ddp_classes
                   and getattr(o, "_enabled", False) and getattr(o, "_scale", None) is not None]  # fmt: skip
        ddps = [o for o in found if type(o) in ddp_classes and any(id(p) in ours for p in o.module.parameters())]
        return scalers, ddps

    def _optimizer_stepped(self, step: bool = False) -> None:
        """``optimizer.step()`` (``step=True``) or ``zero_grad()`` was called: one training step
        is over. ``step()`` also steps the gradients no hook stepped."""
        if step:
            if hasattr(self.optimizer, "found_inf"):  # set by GradScaler.step just before it calls step()
                for key in ("found_inf", "grad_scale"):  # GradScaler deletes them only after a step
                    self.optimizer.__dict__.pop(key, None)
                raise ValueError(_SCALER_REFUSAL)
            self._step_unconsumed()
        self._loop_calls_step = True
        self._seen.clear()
        self._forget_backward()  # a backward that raised left its bookkeeping
        self._hook_params()

    def remove(self) -> None:
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()
        self._forget_backward()
        _RELEASES.discard(self)
        self._seen.clear()
        if getattr(self.optimizer, "_gradient_release", None) is self:
            self.optimizer._gradient_release = None
            self.optimizer.__dict__.pop("_step_supports_amp_scaling", None)

    def __enter__(self) -> GradientRelease:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


class OffloadRelease(GradientRelease):
    """:func:`release_gradients` on an optimizer made with ``offload="cpu"``: each gradient is
    copied to the host as autograd accumulates it and freed on the device; the host gradients
    accumulate over backward passes until ``optimizer.step()`` (:mod:`leanopt.optim.offload`).

    Unlike the on-device release this keeps gradient accumulation and global-norm clipping:
    ``optimizer.clip_grad_norm_`` (or ``torch.nn.utils.clip_grad_norm_``, routed there for these
    params) clips the host gradients. The GradScaler and DDP refusals are the same.
    """

    frees_gradients = False

    def __init__(self, optimizer: LeanOptimizer) -> None:
        engine = getattr(optimizer, "_offload", None)
        if engine is None:  # checked before any hook is placed
            raise ValueError("OffloadRelease needs an optimizer made with offload='cpu'; release_gradients picks the release")
        self.engine: Offload = engine
        self._task: int | None = None  # the outermost backward whose gradients are arriving
        super().__init__(optimizer)
        self.engine.released = True

    def _hook(self, gi: int, index: int):
        def released(p: torch.Tensor) -> None:
            if not self._checked:
                self._check_process()
            outermost = _enclosing_function_node() is None
            if outermost:
                task = torch._C._current_graph_task_id()
                if task != self._task:
                    self._task = task
                    self.engine.backward_started()
            self.optimizer._check_grad(p, gi, index)
            self.engine.receive(p, gi, index, outermost=outermost)

        return released

    def _optimizer_stepped(self, step: bool = False) -> None:
        if step:
            if hasattr(self.optimizer, "found_inf"):
                for key in ("found_inf", "grad_scale"):
                    self.optimizer.__dict__.pop(key, None)
                raise ValueError(_SCALER_REFUSAL)
            self.engine.step()
        else:
            self.engine.zero_grad()
        self._task = None
        self._forget_backward()
        self._hook_params()

    def remove(self) -> None:
        # Gradients already on the host stay there for the next step(), which now copies
        # device gradients as the unreleased offload does.
        super().remove()
        self.engine.released = False


_SCALER_REFUSAL = (
    "leanopt.release_gradients does not work with an AMP GradScaler: the hooks would step the scaled (possibly inf) "
    "gradients inside backward, and skipping a step on inf needs every gradient before any param is stepped; "
    "train without the GradScaler (bf16 autocast needs none) or without release"
)
_FSDP2_REFUSAL = (
    "release_gradients does not work with FSDP2 (DTensor params): their gradients are reduce-scattered "
    "outside autograd's accumulation, where no hook sees them"
)


def release_gradients(model: torch.nn.Module | Iterable[torch.Tensor], optimizer: torch.optim.Optimizer) -> GradientRelease:
    """Step each param of ``optimizer`` inside ``backward`` and free its gradient at once.

    ``optimizer.step()`` and ``optimizer.zero_grad()`` keep their place in the loop: ``step()``
    steps only gradients no hook stepped (set by hand, from ``torch.autograd.grad``), so existing
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

    With ``offload="cpu"`` the gradients go to host memory instead and accumulate there until
    ``step()`` (:class:`OffloadRelease`): accumulation and clipping keep working.

    Raises ``ValueError`` for an optimizer that is not leanopt's, one already released, a model
    wrapped in DDP, or DTensor (FSDP2) params; and at the first released gradient for a
    GradScaler in use or a DDP holding the params. See the module for what else is stepped or
    refused.
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
                raise ValueError(_FSDP2_REFUSAL)
    offload: Offload | None = getattr(optimizer, "_offload", None)
    if offload is not None:
        from leanopt.optim.offload import check_host_memory

        extra = offload.host_bytes(released=True) - offload.host_bytes(released=False)
        if offload.transport is not None:
            check_host_memory(extra, "release_gradients with offload='cpu' (host gradient buffers)")
        return OffloadRelease(optimizer)
    return GradientRelease(optimizer)
