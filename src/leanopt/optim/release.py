"""Gradient release: each gradient leaves ``p.grad`` as soon as autograd has accumulated it.

:func:`release_gradients` hooks every param of an optimizer (post-accumulate-grad hooks) and
attaches a :class:`GradientRelease` to the optimizer's placement. What happens to a released
gradient depends on where the optimizer steps, and on what the user declared -- never on what
earlier steps of the loop looked like:

* **On the device** the only way to free a gradient inside ``backward`` is to apply it: each
  param is stepped by its hook, inside the backward that produced its gradient, and its gradient
  freed. Calling ``release_gradients`` on such an optimizer declares exactly that: one
  ``step()`` per backward pass (``step_in_backward=1``, the only value it takes). The gradient
  term of training memory nearly disappears; results are bit-identical to the usual
  ``backward(); step()`` loop.
* **With** ``offload="cpu"`` each gradient is copied to a host buffer and freed on the device.
  By default the host gradients wait for ``optimizer.step()``: gradient accumulation, clipping
  (:mod:`leanopt.optim.clipping`), skipped steps and ``zero_grad()`` work as in the usual loop,
  bit for bit. With ``step_in_backward=k`` the user declares that every ``k``-th backward pass
  after a ``step()``/``zero_grad()`` is the last of a step: its params are stepped on the host as
  their gradients arrive, while backward goes on.

In the declared mode an update happens inside ``backward``, where it cannot be taken back, so
whatever the declaration did not cover is refused -- before any param is updated where that is
possible, naming what was already applied where it is not:

* a backward pass beyond the ``k``-th before ``step()`` raises ``RuntimeError`` at its first
  released gradient, before anything of it is applied (on the device: a second backward pass
  before ``step()``, i.e. gradient accumulation);
* ``zero_grad()`` without ``step()`` after params were applied (a skipped step) raises,
  naming them;
* a backward pass that raised after some of its params were applied: the next ``step()``,
  ``zero_grad()`` or backward raises, naming them (the others were not stepped);
* clipping gradients already applied raises (:mod:`leanopt.optim.clipping`).

``zero_grad(set_to_none=False)`` keeps the usual loop's meaning: a param that had a gradient
keeps a zero one, so the next ``step()`` steps it even if the next backward does not reach it
(its moments decay, weight decay applies).

Also stepped, once: a gradient no hook saw -- a param unfrozen after the release (a hook needs
``requires_grad``: it gets one at the end of that backward, or at ``step()``), one set by hand
or from ``torch.autograd.grad`` (which does not run the hooks) -- at the end of the backward on
the device, at ``step()`` with offload. Groups added with ``add_param_group`` while released
are hooked at once. Under reentrant activation checkpointing (``checkpoint(use_reentrant=True)``)
each segment's backward is a backward of its own, run inside the outer one, and a weight several
segments share gets its gradient in parts: such a param is stepped once, on its whole gradient,
when the outermost backward ends (on the device; its gradient lives until then) or at ``step()``
(offload). A param used inside and outside such checkpoints whose outside gradient came first
(and was applied) raises ``RuntimeError`` when an inside part arrives.

What cannot work is refused rather than trained wrongly:

* **An AMP GradScaler**: the hooks would handle the scaled (possibly inf) gradients, and
  skipping a step on inf needs every gradient before any param is stepped. The scaler is
  invisible to an optimizer until ``scaler.step``, so the first released gradient looks for one:
  an enabled ``GradScaler`` that has scaled a loss, anywhere in the process, raises
  ``ValueError`` before anything is stepped (``GradScaler(enabled=False)`` is not refused). A
  scaler first used later is refused at its ``scaler.step(optimizer)``.
* **DDP and FSDP2**: both reduce gradients across ranks after the hooks run (DDP's reducer) or
  assign them outside autograd's accumulation (FSDP2's reduce-scatter), so a released step
  would use the local, unreduced gradient or never run. Both raise ``ValueError``: a DDP-wrapped
  model or DTensor params at ``release_gradients``; a model wrapped in DDP after the release,
  or released as ``ddp.module``, at the first released gradient.

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
from typing import Any

import torch

from leanopt.optim import clipping
from leanopt.optim.base import LeanOptimizer
from leanopt.optim.sharding import is_dtensor

__all__ = ["GradientRelease", "release_gradients"]

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


def _passes(k: int) -> str:
    return f"{k} backward pass{'es' if k != 1 else ''}"


class GradientRelease:
    """The hooks and the step cycle of :func:`release_gradients`; ``remove()`` (or leaving a
    ``with`` block) restores the ordinary loop."""

    def __init__(self, optimizer: LeanOptimizer, step_in_backward: int | None) -> None:
        self.optimizer = optimizer
        self.placement = optimizer.placement
        # The backward pass (since the loop's last step()/zero_grad()) whose params are applied
        # as their gradients arrive; None: none is, gradients wait for step() (offload only).
        self.step_in_backward = step_in_backward
        self._handles: dict[int, Any] = {}  # id(param) -> its hook
        self._checked = False  # the first released gradient checks for a GradScaler and DDP
        # The cycle: what happened since the loop's last step() or zero_grad().
        self._backwards = 0  # outermost backward passes begun
        self._task: int | None = None  # the outermost backward under way (None between backwards)
        self._applied: dict[int, str] = {}  # id(param) -> its name, for params stepped inside backward
        self._received: set[int] = set()  # params that got a gradient
        # Across cycles: params with a gradient since the last zero_grad(set_to_none=True), and
        # those holding a zero gradient after a zero_grad(set_to_none=False).
        self._had: set[int] = set()
        self._zeroed: set[int] = set()
        # Reentrant checkpoints: post hooks on an outer backward's nodes, params stepped by an
        # outermost hook in this backward, params with parts from inner backwards.
        self._nodes: dict[int, Any] = {}
        self._this_backward: set[int] = set()
        self._deferred: set[int] = set()
        self._flush_task: int | None = None  # the backward whose end runs _flush
        self.hook_params()
        self.placement.release = self
        clipping.engage(self)
        # GradScaler.step then calls optimizer.step() (instead of asserting that it found no
        # gradient to unscale), where a scaler used after the first check is refused by name.
        optimizer._step_supports_amp_scaling = True  # read by GradScaler through getattr (declared on LeanOptimizer)

    # ---- hooks ------------------------------------------------------------------------------
    def hook_params(self) -> None:
        """Hook every param that requires grad and has no hook yet (at the release, for groups
        added later, and for params unfrozen since: a hook needs ``requires_grad``)."""
        for gi, group in enumerate(self.optimizer.param_groups):
            for index, p in enumerate(group["params"]):
                if p.requires_grad and id(p) not in self._handles:
                    if is_dtensor(p):
                        raise ValueError(_FSDP2_REFUSAL)
                    self._handles[id(p)] = p.register_post_accumulate_grad_hook(self._hook(gi, index))

    def _hook(self, gi: int, index: int):
        # The hook holds the release weakly: a tensor's hooks live on its C++ side, out of reach of
        # Python's garbage collector, so a strong reference there would keep the release (and
        # torch's clipping functions replaced) alive after the model and optimizer are dropped.
        # The optimizer's placement holds the release while the optimizer lives.
        ref = weakref.ref(self)

        def released(p: torch.Tensor) -> None:
            self = ref()
            if self is None:
                return
            if not self._checked:
                self._check_process()
            node = _enclosing_function_node()
            if node is not None:
                self._inner_part(p, gi, index, node)
                return
            self._outermost_backward()
            self._flush_after_this_backward()
            if id(p) in self._deferred:  # parts came from inner backwards: the rest may still come
                return
            self.optimizer._check_grad(p, gi, index)
            self._take(p, gi, index, apply=self._applies())

        return released

    def _applies(self) -> bool:
        """Whether a gradient arriving now in an outermost backward is applied at once."""
        return self.step_in_backward is not None and self._backwards == self.step_in_backward

    def _take(self, p: torch.Tensor, gi: int, index: int, *, apply: bool) -> None:
        self.placement.take(p, gi, index, apply=apply)
        self._received.add(id(p))
        self._had.add(id(p))
        if apply:
            self._applied[id(p)] = _name(self.optimizer, gi, index)
            self._this_backward.add(id(p))

    def _inner_part(self, p: torch.Tensor, gi: int, index: int, node: Any) -> None:
        """A gradient part from an inner backward (a reentrant checkpoint's): more may come from
        other segments. On the device it accumulates in ``p.grad`` and is applied when the
        outermost backward ends; offloaded, it goes to the host and waits for ``step()``."""
        if id(p) in self._this_backward:
            raise RuntimeError(
                f"leanopt.release_gradients: {_name(self.optimizer, gi, index)} got part of its gradient in a "
                "reentrant checkpoint's inner backward after it was stepped on the rest (it is used both "
                "inside and outside checkpoint(use_reentrant=True)); use use_reentrant=False"
            )
        if self.placement.offload is None:
            self._deferred.add(id(p))
        else:
            self.optimizer._check_grad(p, gi, index)
            self._take(p, gi, index, apply=False)
        self._after(node)

    def _outermost_backward(self) -> None:
        """Called from every released gradient of an outermost backward: the first of a new
        backward checks the cycle before anything of it is taken."""
        task = torch._C._current_graph_task_id()
        if task == self._task:
            return
        if self._task is not None:
            self._unfinished("a new backward pass")
        k = self.step_in_backward
        if k is not None and self._backwards >= k:
            raise RuntimeError(
                f"leanopt.release_gradients: backward pass {self._backwards + 1} since the last optimizer.step(), "
                f"but the release steps the params inside backward pass {k} (step_in_backward={k}"
                f"{', the only value on the device' if self.placement.offload is None else ''}): they were already "
                f"stepped, and cannot take more gradient (nothing of this backward pass was applied). Call "
                f"optimizer.step() after {'each backward pass' if k == 1 else f'every {_passes(k)}'}; for gradient "
                "accumulation make the optimizer with offload='cpu' and release it without step_in_backward, or "
                "with the number of backward passes per step"
            )
        self._task = task
        self._backwards += 1
        clipping.route_accelerate()  # accelerate may have been imported since (a Trainer's)

    def _after(self, node: Any) -> None:
        """Flush when the backward that runs ``node`` ends (outermost) or, nested itself, the one
        around it: a post hook on the node runs in its own backward, after the inner one."""
        if id(node) not in self._nodes:
            ref = weakref.ref(self)  # held weakly by the graph's node, as the params' hooks are

            def done(grad_inputs: Any, grad_outputs: Any) -> None:
                release = ref()
                if release is not None:
                    release._node_done(grad_inputs, grad_outputs)

            self._nodes[id(node)] = node.register_hook(done)

    def _node_done(self, grad_inputs: Any, grad_outputs: Any) -> None:
        node = _enclosing_function_node()
        if node is not None:
            self._after(node)
        else:
            self._outermost_backward()
            self._flush_after_this_backward()

    def _flush_after_this_backward(self) -> None:
        task = torch._C._current_graph_task_id()
        if task != self._flush_task:
            self._flush_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._flush)

    def _flush(self) -> None:
        """The end of an outermost backward (it does not run if the backward raised). On the
        device: apply every gradient no hook applied (see the module)."""
        self._flush_task = None
        self._task = None
        self._forget_backward()
        if self.placement.offload is None:
            opt = self.optimizer
            pending = [(gi, i, p) for gi, g in enumerate(opt.param_groups) for i, p in enumerate(g["params"])
                       if p.grad is not None]  # fmt: skip
            for gi, i, p in pending:  # every gradient checked before any param changes
                opt._check_grad(p, gi, i)
            for gi, i, p in pending:
                self._take(p, gi, i, apply=True)
        self.hook_params()

    def _forget_backward(self) -> None:
        for handle in self._nodes.values():
            handle.remove()
        self._nodes.clear()
        self._this_backward.clear()
        self._deferred.clear()

    # ---- the loop's calls (through the placement) ----------------------------------------------
    def step(self) -> None:
        """``optimizer.step()``: step what was not applied inside backward (host gradients, a
        gradient set by hand, zero gradients the usual loop would hold)."""
        self._unfinished("optimizer.step()")
        if hasattr(self.optimizer, "found_inf"):  # set by GradScaler.step just before it calls step()
            for key in ("found_inf", "grad_scale"):  # GradScaler deletes them only after a step
                self.optimizer.__dict__.pop(key, None)
            raise ValueError(_SCALER_REFUSAL)
        stepped = self.placement.step_pending(skip=self._applied, zeros=self._zeroed - self._received)
        for _, _, p in stepped:
            p.grad = None  # released: no gradient outlives its step
            self._had.add(id(p))
        self._new_cycle()

    def zero_grad(self, set_to_none: bool) -> None:
        """``optimizer.zero_grad()``: the gradients waiting are dropped (or zeroed); a step
        already applied inside backward cannot be skipped, and is named."""
        self._unfinished("optimizer.zero_grad()")
        applied = list(self._applied.values())
        if set_to_none:
            self._had.clear()
            self._zeroed.clear()
        else:
            self._zeroed = set(self._had)
        self.placement.discard(set_to_none)
        self._new_cycle()
        if applied:
            k = self.step_in_backward
            raise RuntimeError(
                f"leanopt.release_gradients: zero_grad() without optimizer.step() after {len(applied)} params were "
                f"stepped inside backward pass {k} (step_in_backward={k}): {clipping.names_of(applied)}. Their "
                "updates cannot be taken back, so this step was not skipped; a loop that skips steps needs "
                "offload='cpu' with a release without step_in_backward, or no release"
            )

    def _unfinished(self, now: str) -> None:
        """A backward that never reached its end (it raised) left the cycle open: what it applied
        is named (``RuntimeError``), after its leftovers are dropped; if it applied nothing, its
        gradients stay, as the usual loop keeps what a failed backward accumulated."""
        if self._task is None:
            return
        self._task = None
        self._flush_task = None
        self._forget_backward()
        applied = list(self._applied.values())
        if not applied:
            return
        self.placement.discard(True)
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        self._new_cycle()
        raise RuntimeError(
            f"leanopt.release_gradients: a backward pass raised after {len(applied)} params were stepped inside it "
            f"({clipping.names_of(applied)}); those updates cannot be taken back and the other params were not "
            f"stepped. Its remaining gradients were dropped; {now} was not carried out (restore the model and the "
            "optimizer from a checkpoint if the partial step must be undone)"
        )

    def _new_cycle(self) -> None:
        self._backwards = 0
        self._task = None
        self._flush_task = None
        self._applied.clear()
        self._received.clear()
        self._forget_backward()
        self.hook_params()

    # ---- clipping (leanopt.optim.clipping asks) --------------------------------------------------
    def held_gradients(self, params: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        return {}

    def applied(self, params: list[torch.Tensor]) -> list[str]:
        return [self._applied[id(p)] for p in params if id(p) in self._applied]

    # ---- process checks ---------------------------------------------------------------------------
    def _check_process(self) -> None:
        """Refuse a GradScaler in use and a DDP over these params (see the module)."""
        clipping.route_accelerate()
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

    # ---- the end ----------------------------------------------------------------------------------
    def remove(self) -> None:
        """End the release: the hooks are removed and the optimizer steps as before. Offloaded
        gradients already on the host stay there for the next ``step()`` (clipping still sees
        them), which adds the device gradients of any backward since."""
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()
        self._forget_backward()
        if self.placement.release is self:
            self.placement.release = None
            self.optimizer.__dict__.pop("_step_supports_amp_scaling", None)
        clipping.disengage(self)

    def __enter__(self) -> GradientRelease:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def _name(optimizer: LeanOptimizer, gi: int, index: int) -> str:
    names = optimizer.param_groups[gi].get("param_names")
    return f"param {index} of group {gi}" + (f" ({names[index]!r})" if names and index < len(names) else "")


_SCALER_REFUSAL = (
    "leanopt.release_gradients does not work with an AMP GradScaler: the hooks would step the scaled (possibly inf) "
    "gradients inside backward, and skipping a step on inf needs every gradient before any param is stepped; "
    "train without the GradScaler (bf16 autocast needs none) or without release"
)
_FSDP2_REFUSAL = (
    "release_gradients does not work with FSDP2 (DTensor params): their gradients are reduce-scattered "
    "outside autograd's accumulation, where no hook sees them"
)


def _check_step_in_backward(value: Any, offloaded: bool) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"Invalid step_in_backward: {value!r} (None, or the number of backward passes per step: an int >= 1)")
    if offloaded:
        return value
    if value not in (None, 1):
        raise ValueError(
            f"Invalid step_in_backward: {value!r} on the device: a released gradient is freed by applying it inside "
            "the backward that produced it, so every backward pass is a step (step_in_backward=1, the default here). "
            "For gradient accumulation make the optimizer with offload='cpu', whose released gradients wait on the host"
        )
    return 1


def release_gradients(model: torch.nn.Module | Iterable[torch.Tensor], optimizer: torch.optim.Optimizer, *,
                      step_in_backward: int | None = None) -> GradientRelease:  # fmt: skip
    """Free each param's gradient inside ``backward`` as soon as autograd has accumulated it.

    On the device each param is stepped inside the backward that produced its gradient (one
    ``step()`` per backward pass: accumulation and clipping cannot work, and are refused). With an
    optimizer made with ``offload="cpu"`` the gradients go to host memory and wait there for
    ``optimizer.step()`` (accumulation, clipping and skipped steps work as usual), unless
    ``step_in_backward=k`` declares that every ``k``-th backward pass after a step is the last
    of the next one: its params are then stepped on the host while backward goes on. See the
    module for what a declared loop may not do.

    ``optimizer.step()`` and ``optimizer.zero_grad()`` keep their place in the loop, so existing
    loops, LR schedulers, Trainer and Accelerate keep working. Returns a handle:
    ``handle.remove()`` (or leaving a ``with`` block) ends the release.

    >>> import torch, leanopt
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = leanopt.AdamW(model.parameters(), lr=1e-2)
    >>> handle = leanopt.release_gradients(model, opt)
    >>> model(torch.randn(8, 4)).square().mean().backward()   # the step happens here
    >>> model.weight.grad is None, int(opt.state[model.weight]["step"])
    (True, 1)
    >>> opt.step()   # nothing left to step: the loop goes on as it was written
    >>> handle.remove()

    Raises ``ValueError`` for an optimizer that is not leanopt's, one already released, an
    invalid ``step_in_backward``, a model wrapped in DDP, or DTensor (FSDP2) params; and at the
    first released gradient for a GradScaler in use or a DDP holding the params.
    """
    if not isinstance(optimizer, LeanOptimizer):
        raise ValueError(
            f"release_gradients needs a leanopt optimizer (it steps one param at a time), got {type(optimizer).__name__}"
        )
    if optimizer.placement.release is not None:
        raise ValueError("this optimizer's gradients are already released: remove() the first handle before releasing again")
    k = _check_step_in_backward(step_in_backward, optimizer.offload is not None)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise ValueError(
            "release_gradients does not work under DDP: its reducer all-reduces gradients after the hooks that "
            "would step them; train without release, or shard with FSDP2 and no release"
        )
    for group in optimizer.param_groups:
        for p in group["params"]:
            if is_dtensor(p):
                raise ValueError(_FSDP2_REFUSAL)
    optimizer.placement.check_release_memory()
    return GradientRelease(optimizer, k)
