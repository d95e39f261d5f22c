"""Gradient release never guesses the loop: what a loop does is what happens, or it is refused.

Each test runs a loop of the kind users write -- a skipped step, a backward that raises, an
epoch whose last step has fewer micro-batches, two optimizers clipped as one model, a release
around backward only, ``zero_grad(set_to_none=False)`` with a module left out of a step -- with
the usual loop as the reference, on every placement of a released gradient:

* ``device``: on-device release (every backward pass is a step, declared by the call);
* ``offload``: ``offload="cpu"``, the host gradients wait for ``step()``;
* ``offload-declared``: ``offload="cpu"`` with ``step_in_backward=k`` (params stepped inside the
  ``k``-th backward pass after a step).

Where the placement can follow the loop the params, states and step counts equal the usual
loop's to the bit; where an update was already applied inside backward the loop gets a
``RuntimeError`` naming what was applied, and the run goes on from there. The mechanisms do not
depend on the update rule: they run on the optimizer that represents each family of state and
step code paths (tests/registry.py).
"""

from __future__ import annotations

import gc
import re
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch

import leanopt
from leanopt.optim import clipping
from registry import OPTIMIZERS, representatives

CASES = representatives(OPTIMIZERS)
cases = pytest.mark.parametrize("case", CASES, ids=str)


class Net(torch.nn.Module):
    """Two layers and a side branch that ``forward(x, side=False)`` leaves out of the graph."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        # 64 x 128 = 8192 elements: the low-bit optimizers quantize the first weight.
        self.inp = torch.nn.Linear(64, 128)
        self.out = torch.nn.Linear(128, 8)
        self.side = torch.nn.Linear(64, 8)
        self.fail: Callable[[], None] | None = None  # called in the backward of the hidden activation

    def forward(self, x: torch.Tensor, side: bool = True) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if self.fail is not None:
            h.register_hook(lambda g: self.fail() or g)  # type: ignore[func-returns-value]
        y = self.out(h)
        return y + self.side(x) if side else y


def batch(step: int, micro: int = 0) -> torch.Tensor:
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(1000 * step + micro))


def loss_of(model: Net, step: int, micro: int = 0, side: bool = True) -> torch.Tensor:
    return model(batch(step, micro), side).square().mean()


def build(case, placement: str | None, k: int = 1, params: Any = None) -> tuple[Net, Any, Any]:
    """A Net, its optimizer and (unless ``placement`` is None: the usual loop) its release."""
    model = Net()
    offload = "cpu" if placement in ("offload", "offload-declared") else None
    opt = case.cls(case.param_groups(model) if params is None else params(model), **case.kwargs, offload=offload)
    if placement is None:
        return model, opt, None
    declared = {"step_in_backward": k} if placement == "offload-declared" else {}
    return model, opt, leanopt.release_gradients(model, opt, **declared)


def assert_same(ours: tuple[Net, Any], usual: tuple[Net, Any]) -> None:
    """The same params and optimizer state_dicts, bit for bit."""
    (m1, o1), (m2, o2) = ours, usual
    for (name, a), b in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(a, b), name
    assert same(o1.state_dict(), o2.state_dict())


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def steps_of(opt: Any, model: Net | None = None) -> list[int]:
    """Each param's step count, in the model's order if given (Muon's groups reorder its params)."""
    opt.placement.wait()
    params = list(model.parameters()) if model is not None else [p for g in opt.param_groups for p in g["params"]]
    return [int(opt.state[p]["step"]) if "step" in opt.state.get(p, {}) else 0 for p in params]


# ---- a step skipped with zero_grad() instead of step() ------------------------------------------
def skip_step(opt: Any, errors: list[str]) -> None:
    """The loop gives up on this batch: ``zero_grad()`` without ``step()``, its refusal noted."""
    try:
        opt.zero_grad()
    except RuntimeError as err:
        errors.append(str(err))


def skipping_loop(model: Net, opt: Any, errors: list[str], skip: int = 2, steps: int = 5) -> None:
    for step in range(steps):
        loss_of(model, step).backward()
        if step == skip:  # a loss spike: the step is skipped
            skip_step(opt, errors)
            continue
        opt.step()
        opt.zero_grad()


@cases
@pytest.mark.parametrize("placement", ["device", "offload", "offload-declared"])
def test_a_step_skipped_with_zero_grad(case, placement: str) -> None:
    usual = build(case, None)
    skipping_loop(*usual[:2], errors=[])
    model, opt, handle = build(case, placement)
    errors: list[str] = []
    skipping_loop(model, opt, errors)
    handle.remove()
    if placement == "offload":  # the host gradients waited for step(): dropped as the usual loop drops them
        assert not errors and steps_of(opt) == steps_of(usual[1]) == [4] * 6
        assert_same((model, opt), usual[:2])
    else:  # applied inside the skipped step's backward: said, not hidden
        assert len(errors) == 1 and "zero_grad() without optimizer.step()" in errors[0]
        assert re.search(r"inside backward pass 1 \(step_in_backward=1\): param \d of group \d", errors[0])
        assert "cannot be taken back" in errors[0]
        assert steps_of(opt) == [5] * 6


# ---- an exception in the middle of backward -------------------------------------------------------
class Boom(Exception):
    pass


def failing_loop(model: Net, opt: Any, errors: list[str], at: int = 2, steps: int = 4) -> None:
    def boom() -> None:
        raise Boom

    for step in range(steps):
        model.fail = boom if step == at else None
        try:
            loss_of(model, step).backward()
        except Boom:  # the loop gives up on this batch
            skip_step(opt, errors)
            continue
        opt.step()
        opt.zero_grad()


@cases
@pytest.mark.parametrize("placement", ["device", "offload", "offload-declared"])
def test_an_exception_in_the_middle_of_backward(case, placement: str) -> None:
    usual = build(case, None)
    failing_loop(*usual[:2], errors=[])
    model, opt, handle = build(case, placement)
    errors: list[str] = []
    failing_loop(model, opt, errors)
    handle.remove()
    if placement == "offload":  # nothing was applied: the usual loop's run, to the bit
        assert not errors
        assert_same((model, opt), usual[:2])
        return
    # The hidden activation's backward raised after `out` and `side` (params 2-5) were applied,
    # before `inp` (params 0, 1): the loop is told which, and the run goes on from there.
    assert len(errors) == 1 and "a backward pass raised after 4 params were stepped inside it" in errors[0]
    assert "param 2 of group 0" in errors[0] and "param 0 of group 0" not in errors[0]
    assert steps_of(opt, model) == [3, 3, 4, 4, 4, 4]
    assert all(p.grad is None for p in model.parameters())


@cases
def test_a_backward_after_one_that_raised_is_refused_before_anything_of_it_is_applied(case) -> None:
    model, opt, handle = build(case, "device")
    model.fail = lambda: (_ for _ in ()).throw(Boom())
    with pytest.raises(Boom):
        loss_of(model, 0).backward()
    model.fail = None
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="a backward pass raised after 4 params were stepped inside it"):
        loss_of(model, 1).backward()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    loss_of(model, 1).backward()  # the cycle starts over
    opt.step()
    assert steps_of(opt, model) == [1, 1, 2, 2, 2, 2]
    handle.remove()


# ---- gradient accumulation whose last step of an epoch is shorter ---------------------------------
def epochs_loop(model: Net, opt: Any, accumulate: int = 4, per_epoch: int = 10, epochs: int = 2) -> None:
    step = 0
    for _ in range(epochs):
        for i in range(per_epoch):
            (loss_of(model, step, i) / accumulate).backward()
            if (i + 1) % accumulate == 0 or i == per_epoch - 1:  # the epoch's last step: 2 micro-batches
                opt.step()
                opt.zero_grad()
                step += 1


@cases
@pytest.mark.parametrize("placement", ["offload", "offload-declared"])
def test_accumulation_whose_last_step_has_fewer_micro_batches(case, placement: str) -> None:
    usual = build(case, None)
    epochs_loop(*usual[:2])
    model, opt, handle = build(case, placement, k=4)
    epochs_loop(model, opt)
    handle.remove()
    assert steps_of(opt) == [6] * 6
    assert_same((model, opt), usual[:2])


# ---- two offloaded, released optimizers clipped as one model --------------------------------------
def two_optimizers_loop(model: Net, opts: list[Any], clip: str, steps: int = 4) -> list[torch.Tensor]:
    norms = []
    for step in range(steps):
        for micro in range(2):
            (loss_of(model, step, micro) / 2).backward()
        if clip == "norm":
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
        else:
            torch.nn.utils.clip_grad_value_(model.parameters(), 2e-3)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return norms


@cases
@pytest.mark.parametrize("clip", ["norm", "value"])
def test_two_offloaded_released_optimizers_are_clipped_as_one_model(case, clip: str) -> None:
    runs = []
    for offload in (None, "cpu"):
        model = Net()
        halves = [list(model.inp.parameters()), list(model.out.parameters()) + list(model.side.parameters())]
        opts = [case.cls(case.param_groups(half), **case.kwargs, offload=offload) for half in halves]
        handles = [leanopt.release_gradients(half, opt) for half, opt in zip(halves, opts)] if offload else []
        norms = two_optimizers_loop(model, opts, clip)
        for handle in handles:
            handle.remove()
        runs.append((model, opts, norms))
    (usual, usual_opts, usual_norms), (model, opts, norms) = runs
    assert same(norms, usual_norms)
    for a, b in zip(opts, usual_opts):
        assert_same((model, a), (usual, b))
    # The clip mattered: without it the run differs.
    unclipped = Net()
    plain = [case.cls(case.param_groups(unclipped), **case.kwargs)]
    for step in range(4):
        for micro in range(2):
            (loss_of(unclipped, step, micro) / 2).backward()
        plain[0].step()
        plain[0].zero_grad()
    assert not torch.equal(unclipped.inp.weight, usual.inp.weight)


# ---- a release around backward only, clipping and step() after the block ---------------------------
@cases
def test_a_release_around_backward_keeps_its_gradients_for_the_clip_and_step_after_it(case) -> None:
    runs = []
    for offload in (None, "cpu"):
        model = Net()
        opt = case.cls(case.param_groups(model), **case.kwargs, offload=offload)
        norms = []
        for step in range(4):
            if offload:
                with leanopt.release_gradients(model, opt):
                    loss_of(model, step).backward()
                assert torch.nn.utils.clip_grad_norm_ is clipping.clip_grad_norm_  # host gradients wait
            else:
                loss_of(model, step).backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
            opt.step()
            opt.zero_grad()
            assert torch.nn.utils.clip_grad_norm_ is clipping.TORCH_CLIP_GRAD_NORM_  # nothing held: torch's own
        runs.append((model, opt, norms))
    (usual, usual_opt, usual_norms), (model, opt, norms) = runs
    assert all(n > 0.05 for n in usual_norms) and same(norms, usual_norms)
    assert_same((model, opt), (usual, usual_opt))


# ---- zero_grad(set_to_none=False) with a module left out of a step's graph --------------------------
def zeroing_loop(model: Net, opt: Any, steps: int = 6) -> None:
    for step in range(steps):
        opt.zero_grad(set_to_none=False)
        loss_of(model, step, side=step % 2 == 0).backward()  # the side branch only every other step
        opt.step()


@cases
@pytest.mark.parametrize("placement", ["device", "offload", "offload-declared"])
def test_zero_grad_without_set_to_none_steps_what_the_graph_left_out(case, placement: str) -> None:
    usual = build(case, None)
    zeroing_loop(*usual[:2])
    model, opt, handle = build(case, placement)
    zeroing_loop(model, opt)
    handle.remove()
    # The usual loop steps the side branch on its zero gradient every step (moments decay,
    # weight decay applies): 6 steps for every param.
    assert steps_of(usual[1]) == steps_of(opt) == [6] * 6
    assert_same((model, opt), usual[:2])


# ---- no replacement of torch or accelerate outlives its use ----------------------------------------
@pytest.mark.parametrize("placement", ["device", "offload"])
def test_a_release_never_removed_goes_with_its_model_and_optimizer(placement: str) -> None:
    """A loop that never calls remove() (the usual one) and drops its model and optimizer: the
    release, its hooks and torch's clipping go with them. The params' hooks live on torch's C++
    side, where the garbage collector cannot follow a reference back to the release; one kept
    torch's functions replaced for the rest of the process."""
    assert torch.nn.utils.clip_grad_norm_ is clipping.TORCH_CLIP_GRAD_NORM_, "another test left the replacement in place"
    model, opt, handle = build(CASES[0], placement)
    loss_of(model, 0).backward()
    opt.step()
    opt.zero_grad()
    loss_of(model, 1).backward()
    if placement == "device":  # a second backward without step() raises in a hook: that is let go too
        with pytest.raises(RuntimeError, match="backward pass 2"):
            loss_of(model, 2).backward()
    assert torch.nn.utils.clip_grad_norm_ is clipping.clip_grad_norm_
    released = weakref.ref(handle)
    del model, opt, handle
    gc.collect()
    assert released() is None
    assert torch.nn.utils.clip_grad_norm_ is clipping.TORCH_CLIP_GRAD_NORM_
    assert torch.nn.utils.clip_grad_value_ is clipping.TORCH_CLIP_GRAD_VALUE_


# ---- no replacement of torch or accelerate outlives its use ----------------------------------------
@pytest.mark.parametrize("placement", ["device", "offload"])
def test_torch_and_accelerate_get_their_own_clipping_back(placement: str) -> None:
    accelerate = pytest.importorskip("accelerate")
    originals = (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad_value_,
                 torch.nn.utils.clip_grad.clip_grad_norm_, torch.nn.utils.clip_grad.clip_grad_value_,
                 accelerate.Accelerator.clip_grad_norm_)  # fmt: skip
    assert originals[0] is clipping.TORCH_CLIP_GRAD_NORM_, "another test left the replacement in place"
    model, opt, handle = build(CASES[0], placement)
    loss_of(model, 0).backward()
    assert torch.nn.utils.clip_grad_norm_ is clipping.clip_grad_norm_
    assert torch.nn.utils.clip_grad.clip_grad_value_ is clipping.clip_grad_value_
    assert accelerate.Accelerator.clip_grad_norm_ is not originals[4]
    handle.remove()
    if placement == "offload":  # its host gradients still wait for step(): clipping must still see them
        assert torch.nn.utils.clip_grad_norm_ is clipping.clip_grad_norm_
    del model, opt, handle
    gc.collect()
    now = (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad_value_,
           torch.nn.utils.clip_grad.clip_grad_norm_, torch.nn.utils.clip_grad.clip_grad_value_,
           accelerate.Accelerator.clip_grad_norm_)  # fmt: skip
    assert all(a is b for a, b in zip(now, originals))
