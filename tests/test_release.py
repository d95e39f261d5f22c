"""leanopt.release_gradients: every optimizer steps inside backward, bit-identical to the usual loop."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import leanopt
from leanopt.optim import clipping
import repo_modules
from registry import OPTIMIZERS, OptimizerCase, representatives

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except Exception:
    HAS_TRITON = False


def backends(case: OptimizerCase) -> list[str]:
    return [b for b in case.backends if b != "triton" or HAS_TRITON]


# The mechanisms of release (hooks, the step cycle, reentrant backwards, clipping, the GradScaler
# and DDP checks) do not depend on the update rule: they run on the optimizer that represents
# each family of state and step code paths (tests/registry.py). What depends on the rule -- each
# optimizer's per-param step giving the bits of its group step -- runs for every optimizer on the
# reference and its CPU backend (test_released_training_is_bit_identical_to_the_usual_loop). On
# Triton a per-param step differs from the group's only in its launch (one param's blocks instead
# of the group's chunk table), which is the family's code, the rule's kernel being the same: each
# family's representative runs it there (interpreted here, 1-7 s a case), and tests/test_rules.py
# holds every rule's kernel to the reference.
MECHANISMS = representatives(OPTIMIZERS)
CASE_BACKENDS = [pytest.param(c, b, id=f"{c.name}-{b}") for c in OPTIMIZERS for b in backends(c)
                 if b != "triton" or c in MECHANISMS]  # fmt: skip


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    # 16 x 256 = 4096 elements: the low-bit optimizers quantize the first weight.
    return torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.Tanh(), torch.nn.Linear(256, 4))


def loss_of(m: torch.nn.Module, step: int) -> torch.Tensor:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
    return m(x).square().mean()


def assert_same_training(ours: torch.nn.Module, opt, usual: torch.nn.Module, usual_opt) -> None:
    """The same params and optimizer states, bit for bit (states matched by param order)."""
    for i, (a, b) in enumerate(zip(ours.parameters(), usual.parameters())):
        assert torch.equal(a, b), f"param {i}"
        assert opt.state[a].keys() == usual_opt.state[b].keys(), f"param {i}"
        for key, value in usual_opt.state[b].items():
            got = opt.state[a][key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(got, value), (i, key)
            else:  # QuantizedState
                assert torch.equal(got.codes, value.codes) and torch.equal(got.absmax, value.absmax), (i, key)


@pytest.mark.parametrize("case,backend", CASE_BACKENDS)
def test_released_training_is_bit_identical_to_the_usual_loop(case: OptimizerCase, backend: str) -> None:
    steps = 8 if backend != "triton" else 6  # StepLR halves the lr at steps 3 and 6; the interpreter is slow
    ours, usual = model(), model()
    opt = case.cls(case.param_groups(ours), backend=backend, **case.kwargs)
    usual_opt = case.cls(case.param_groups(usual), backend=backend, **case.kwargs)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5) if case.lr_key else None
    usual_sched = torch.optim.lr_scheduler.StepLR(usual_opt, step_size=3, gamma=0.5) if case.lr_key else None
    handle = leanopt.release_gradients(ours, opt)
    for step in range(steps):
        # The existing loop, unchanged: zero_grad and step are no-ops while released.
        opt.zero_grad()
        loss_of(ours, step).backward()
        assert all(p.grad is None for p in ours.parameters()), "released gradients are freed in backward"
        opt.step()
        usual_opt.zero_grad()
        loss_of(usual, step).backward()
        usual_opt.step()
        for s in (sched, usual_sched):
            if s is not None:
                s.step()
        for a, b in zip(ours.parameters(), usual.parameters()):
            assert torch.equal(a, b), f"step {step}"
    assert_same_training(ours, opt, usual, usual_opt)
    handle.remove()
    loss_of(ours, 99).backward()
    assert all(p.grad is not None for p in ours.parameters()), "remove() restores the usual loop"


@pytest.mark.parametrize("case", MECHANISMS, ids=str)
@pytest.mark.parametrize("calls", ["zero_grad-first", "none"])
def test_a_second_backward_before_step_is_refused(case: OptimizerCase, calls: str) -> None:
    # On the device every backward pass is a step (the release's declaration): a second one
    # before step() -- gradient accumulation, or a loop that never calls step() -- is refused
    # at its first gradient, before anything of it is applied.
    m = model()
    opt = case.cls(case.param_groups(m), **case.kwargs)
    with leanopt.release_gradients(m, opt):
        if calls == "zero_grad-first":
            opt.zero_grad()
        loss_of(m, 0).backward()
        before = [p.detach().clone() for p in m.parameters()]
        with pytest.raises(RuntimeError, match=r"backward pass 2 since the last optimizer.step\(\).*nothing of this backward"):
            loss_of(m, 1).backward()
        assert all(torch.equal(a, b) for a, b in zip(before, m.parameters())), "refused before any param was stepped twice"
        assert {int(st["step"]) for st in opt.state.values()} <= {1}
        opt.step()
        loss_of(m, 2).backward()  # after step(), the next backward is the next step
    assert {int(st["step"]) for st in opt.state.values()} <= {2}


@pytest.mark.parametrize("value", [0, 2, -1, 1.0, True, "1"])
def test_step_in_backward_on_the_device_must_be_one(value) -> None:
    m = model()
    with pytest.raises(ValueError, match="step_in_backward"):
        leanopt.release_gradients(m, leanopt.AdamW(m.parameters()), step_in_backward=value)
    leanopt.release_gradients(m, leanopt.AdamW(m.parameters()), step_in_backward=1).remove()


def test_refusals_are_value_errors() -> None:
    m = model()
    with pytest.raises(ValueError, match="leanopt optimizer"):
        leanopt.release_gradients(m, torch.optim.AdamW(m.parameters()))
    opt = leanopt.AdamW(m.parameters())
    handle = leanopt.release_gradients(m, opt)
    with pytest.raises(ValueError, match="already released"):
        leanopt.release_gradients(m, opt)
    handle.remove()
    leanopt.release_gradients(m, opt).remove()  # released again after remove()


_PEAK = textwrap.dedent(
    """
    import sys, torch, leanopt
    torch.manual_seed(0)
    layers = [torch.nn.Linear(1024, 1024) for _ in range(12)]
    model = torch.nn.Sequential(*layers)
    opt = leanopt.AdamW(model.parameters())
    if sys.argv[1] == "release":
        leanopt.release_gradients(model, opt)
    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    x = torch.randn(4, 1024)
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        if step == 2:
            base = rss("VmRSS:")
            open("/proc/self/clear_refs", "w").write("5")  # peak RSS := current RSS
        model(x).square().mean().backward()
        opt.step()
    print(rss("VmHWM:") - base)
    """
)


def test_peak_memory_drops_by_most_of_the_gradient_bytes() -> None:
    # The step's peak over the memory before it (weights and state live; no gradients), in a
    # fresh process whose large blocks are returned to the system when freed.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    grad_bytes = 12 * (1024 * 1024 + 1024) * 4
    peaks = {}
    for mode in ("usual", "release"):
        out = subprocess.run([sys.executable, "-c", _PEAK, mode], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        peaks[mode] = int(out.stdout.split()[-1])
    drop = peaks["usual"] - peaks["release"]
    assert drop >= 0.8 * grad_bytes, (peaks, grad_bytes)
    print(f"step peak over weights+state: usual {peaks['usual'] / 2**20:.1f} MiB, released "
          f"{peaks['release'] / 2**20:.1f} MiB; gradients {grad_bytes / 2**20:.1f} MiB, drop {drop / grad_bytes:.0%}")


# ---- gradients that reach a param by a path without a release hook -----------------------
# Each trains as in the usual loop: stepped at the end of the backward, or by optimizer.step().
HOOKLESS = ["unfrozen_after_release", "group_added_after_release", "grad_set_by_hand", "torch_autograd_grad"]


def hookless_run(case: OptimizerCase, path: str, released: bool, steps: int = 3):
    m = model()
    first, last = list(m[0].parameters()), list(m[2].parameters())
    if path == "unfrozen_after_release":  # staged unfreezing: frozen when released
        for p in first:
            p.requires_grad_(False)
    if path == "grad_set_by_hand":  # a param outside the graph, given its gradient by hand
        m.register_parameter("extra", torch.nn.Parameter(torch.zeros(4)))
    opt = case.cls(case.param_groups(last if path == "group_added_after_release" else m.parameters()), **case.kwargs)
    handle = leanopt.release_gradients(m, opt) if released else None
    if path == "group_added_after_release":
        for group in case.param_groups([{"params": first}]):
            opt.add_param_group(group)
    for step in range(steps):
        if path == "unfrozen_after_release" and step == 1:
            for p in first:
                p.requires_grad_(True)
        opt.zero_grad()
        loss = loss_of(m, step)
        if path == "torch_autograd_grad":
            params = list(m.parameters())
            for p, g in zip(params, torch.autograd.grad(loss, params)):
                p.grad = g
        else:
            loss.backward()
        if path == "grad_set_by_hand":
            m.extra.grad = torch.randn(4, generator=torch.Generator().manual_seed(step))
        opt.step()
    return m, opt, handle


@pytest.mark.parametrize("path", HOOKLESS)
@pytest.mark.parametrize("case", MECHANISMS, ids=str)
def test_params_no_hook_sees_are_trained_as_in_the_usual_loop(case: OptimizerCase, path: str) -> None:
    usual, usual_opt, _ = hookless_run(case, path, released=False)
    ours, opt, handle = hookless_run(case, path, released=True)
    start = model()
    assert not torch.equal(usual[0].weight, start[0].weight), "the usual loop trains the first layer"
    assert_same_training(ours, opt, usual, usual_opt)
    assert all(p.grad is None for p in ours.parameters()), "stepped gradients are freed"
    handle.remove()


# ---- AMP GradScaler: its scaled, possibly inf gradients must never be stepped -------
@pytest.mark.parametrize("case", MECHANISMS, ids=str)
def test_a_grad_scaler_is_refused_before_the_first_released_step(case: OptimizerCase) -> None:
    m = model()
    opt = case.cls(case.param_groups(m), **case.kwargs)
    before = [p.detach().clone() for p in m.parameters()]
    scaler = torch.amp.GradScaler("cpu")
    with leanopt.release_gradients(m, opt):
        opt.zero_grad()
        with pytest.raises(ValueError, match="GradScaler"):
            scaler.scale(loss_of(m, 0)).backward()
        assert all(torch.equal(a, b) for a, b in zip(before, m.parameters())), "no param was stepped"
        assert not opt.state
        with pytest.raises(ValueError, match="GradScaler"):  # refused again, not once
            scaler.scale(loss_of(m, 1)).backward()


def test_grad_scaler_step_on_a_released_optimizer_is_refused() -> None:
    # A scaler first used after the release's first backward: its step() is refused by name
    # (not torch's "No inf checks were recorded").
    m = model()
    opt = leanopt.AdamW(m.parameters())
    with leanopt.release_gradients(m, opt):
        loss_of(m, 0).backward()
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(loss_of(m, 1))
        with pytest.raises(ValueError, match="GradScaler"):
            scaler.step(opt)
    assert not hasattr(opt, "_step_supports_amp_scaling"), "remove() gives GradScaler its usual path back"


def test_a_disabled_grad_scaler_trains_as_without_one() -> None:
    runs = []
    for released in (False, True):
        m = model()
        opt = leanopt.AdamW(m.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", enabled=False)  # GradScaler(enabled=use_amp), AMP off
        handle = leanopt.release_gradients(m, opt) if released else None
        for step in range(3):
            opt.zero_grad()
            scaler.scale(loss_of(m, step)).backward()
            scaler.step(opt)
            scaler.update()
        runs.append((m, opt))
    assert_same_training(*runs[1], *runs[0])
    handle.remove()


# ---- reentrant activation checkpointing -----------------------------------------------------
class Segments(torch.nn.Module):
    """Three segments under ``checkpoint(use_reentrant=True)``: each segment's backward is a
    backward of its own, run inside the outer one. ``separate``: a Linear each; ``shared``: one
    Linear applied by all three (its gradient arrives in three parts); ``shared_nested``: the
    three inside a fourth checkpoint."""

    def __init__(self, layout: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layout = layout
        self.inp = torch.nn.Linear(16, 64)
        # 64 x 64 = 4096 elements: the low-bit optimizers quantize the segments' weight.
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3 if layout == "separate" else 1))
        self.out = torch.nn.Linear(64, 4)

    def segments(self, h: torch.Tensor) -> torch.Tensor:
        for i in range(3):
            block = self.blocks[i % len(self.blocks)]
            h = torch.utils.checkpoint.checkpoint(lambda t, b=block: torch.tanh(b(t)), h, use_reentrant=True)
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.layout == "shared_nested":
            h = torch.utils.checkpoint.checkpoint(self.segments, h, use_reentrant=True)
        else:
            h = self.segments(h)
        return self.out(h)


REENTRANT = ["separate", "shared", "shared_nested"]


# The outer checkpoint's forward runs the inner ones under no_grad, so torch warns there; their
# recomputation inside the outer one's backward has the gradients (every param is checked to train).
@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True")
@pytest.mark.parametrize("layout", REENTRANT)
@pytest.mark.parametrize("case", MECHANISMS, ids=str)
def test_reentrant_checkpointing_steps_each_param_once_on_its_whole_gradient(case: OptimizerCase, layout: str) -> None:
    runs = []
    for released in (False, True):
        m = Segments(layout)
        opt = case.cls(case.param_groups(m), **case.kwargs)
        handle = leanopt.release_gradients(m, opt) if released else None
        for step in range(3):
            opt.zero_grad()
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
            m(x).square().mean().backward()
            if released:
                assert all(p.grad is None for p in m.parameters()), "freed by the end of backward"
            opt.step()
        runs.append((m, opt))
    (usual, usual_opt), (ours, opt) = runs
    assert [int(opt.state[p]["step"]) for p in ours.parameters()] == [3] * len(list(ours.parameters()))
    assert_same_training(ours, opt, usual, usual_opt)
    handle.remove()


# ---- DDP over a model released unwrapped ----------------------------------------------------
def test_ddp_over_a_released_model_is_refused_on_every_rank(tmp_path) -> None:
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available in this build")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_scripts", "release_ddp.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LEANOPT_DIST_TIMEOUT": "120"}
    try:
        repo_modules.benchmark("plan_vs_measured").torchrun(script, [str(tmp_path)], 2, env, 300, "release_ddp.py")
    except RuntimeError as err:
        pytest.fail(str(err))
    for rank in range(2):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert out["ddp"]["error"] is None and out["ddp"]["ranks_agree"], out["ddp"]  # the control
        for case in ("release_then_wrap", "release_ddp_module"):
            assert out[case]["error"] is not None, (rank, case, out[case])
            assert out[case]["error"].startswith("ValueError") and "DistributedDataParallel" in out[case]["error"]
            assert out[case]["moved"] == 0.0 and not out[case]["stepped"], "refused before any step"
        # No DDP: each rank trains its own model under a 2-rank process group, as the usual loop.
        own = out["own_model_per_rank"]
        assert own["error"] is None and own["same_as_usual"] and own["moved"] > 0, own


class InsideAndOutside(torch.nn.Module):
    """One weight used by a reentrant-checkpointed segment and outside it: ``outside_first`` uses
    it before the segment (its gradient's outside part arrives after the inside one), else after."""

    def __init__(self, order: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.order = order
        self.inp = torch.nn.Linear(16, 64)
        self.shared = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.order == "outside_first":
            h = torch.tanh(self.shared(h))
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.shared(t)), h, use_reentrant=True)
        return self.shared(h) if self.order == "inside_first" else h


@pytest.mark.parametrize("case", MECHANISMS, ids=str)
def test_a_weight_used_inside_and_outside_a_reentrant_checkpoint(case: OptimizerCase) -> None:
    # Outside part last: the inside part is kept, and the whole gradient stepped at the end.
    runs = []
    for released in (False, True):
        m = InsideAndOutside("outside_first")
        opt = case.cls(case.param_groups(m), **case.kwargs)
        handle = leanopt.release_gradients(m, opt) if released else None
        for step in range(3):
            opt.zero_grad()
            m(torch.randn(8, 16, generator=torch.Generator().manual_seed(step))).square().mean().backward()
            opt.step()
        runs.append((m, opt))
    assert_same_training(*runs[1], *runs[0])
    handle.remove()
    # Outside part first: it was stepped when the inside part arrives, which is refused.
    m = InsideAndOutside("inside_first")
    opt = case.cls(case.param_groups(m), **case.kwargs)
    with leanopt.release_gradients(m, opt), pytest.raises(RuntimeError, match="inside and outside checkpoint"):
        m(torch.randn(8, 16)).square().mean().backward()


# ---- clipping after an on-device release: refused, not a silent no-op -------------------------
def _released_after_backward(case: OptimizerCase):
    m = model()
    opt = case.cls(case.param_groups(m), **{**case.kwargs, **case.state_kwargs})
    handle = leanopt.release_gradients(m, opt)
    loss_of(m, 0).backward()  # every param stepped and its gradient freed
    return m, opt, handle


@pytest.mark.parametrize("case", MECHANISMS, ids=str)
def test_clipping_gradients_the_release_freed_is_refused(case: OptimizerCase) -> None:
    m, opt, handle = _released_after_backward(case)
    assert all(p.grad is None for p in m.parameters())
    for clip in (lambda: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0),
                 lambda: torch.nn.utils.clip_grad.clip_grad_norm_(list(m.parameters())[:1], 0.5, norm_type=1.0),
                 lambda: torch.nn.utils.clip_grad_norm_(m.parameters(), float("inf"), error_if_nonfinite=True)):  # fmt: skip
        with pytest.raises(RuntimeError, match="already applied inside backward.*param 0 of group 0.*max_grad_norm=0.*offload='cpu'"):
            clip()
    with pytest.raises(RuntimeError, match="release_gradients"):
        opt.clip_grad_norm_(1.0)
    for clip in (lambda: torch.nn.utils.clip_grad_value_(m.parameters(), 0.1),
                 lambda: torch.nn.utils.clip_grad.clip_grad_value_(list(m.parameters())[:1], 0.1)):
        with pytest.raises(RuntimeError, match="clip_grad_value_ over params whose gradients .* already applied"):
            clip()
    # A norm-only call (Trainer's grad_norm log at max_grad_norm=0) clips nothing: the norm is unknown.
    assert torch.isnan(torch.nn.utils.clip_grad_norm_(m.parameters(), float("inf")))
    # Once the loop has stepped, no gradient is missing: torch's own answer (no gradients: 0).
    opt.step()
    opt.zero_grad()
    assert torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0).item() == 0.0
    loss_of(m, 1).backward()
    with pytest.raises(RuntimeError, match="already applied inside backward"):
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    opt.step()
    handle.remove()
    # After remove() torch's own function is back, and the usual loop clips as torch does.
    assert torch.nn.utils.clip_grad_norm_ is clipping.TORCH_CLIP_GRAD_NORM_
    loss_of(m, 2).backward()
    twin = [torch.nn.Parameter(p.detach().clone()) for p in m.parameters()]
    for t, p in zip(twin, m.parameters()):
        t.grad = p.grad.clone()
    assert torch.equal(torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3), clipping.TORCH_CLIP_GRAD_NORM_(twin, 1e-3))
    assert all(torch.equal(p.grad, t.grad) for p, t in zip(m.parameters(), twin))


def test_clipping_other_params_is_torch_s_own_while_released() -> None:
    case = OPTIMIZERS[0]
    _, _, handle = _released_after_backward(case)
    assert torch.nn.utils.clip_grad_norm_ is clipping.clip_grad_norm_  # routed while a release is in effect
    a, b = model(1), model(1)
    loss_of(a, 0).backward()
    loss_of(b, 0).backward()
    na = torch.nn.utils.clip_grad_norm_(a.parameters(), 0.01)
    nb = clipping.TORCH_CLIP_GRAD_NORM_(b.parameters(), 0.01)
    assert torch.equal(na, nb)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))
    assert torch.nn.utils.clip_grad_value_ is clipping.clip_grad_value_
    torch.nn.utils.clip_grad_value_(a.parameters(), 1e-4)
    clipping.TORCH_CLIP_GRAD_VALUE_(b.parameters(), 1e-4)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))
    assert max(p.grad.abs().max().item() for p in a.parameters()) == pytest.approx(1e-4)
    handle.remove()


# The refusals are release's, the same for every optimizer; a Trainer run costs ~10 s.
@pytest.mark.parametrize("case", MECHANISMS, ids=str)
def test_trainer_with_release_and_its_default_clipping_raises_the_clear_error(case: OptimizerCase, tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from test_trainer import TokenDataset, tiny_distilbert, training_args

    def trainer(max_grad_norm: float, accumulate: int = 1):
        m = tiny_distilbert()
        opt = case.cls(case.param_groups(m), **{**case.kwargs, **case.state_kwargs})
        handle = leanopt.release_gradients(m, opt)
        args = training_args(tmp_path / f"{max_grad_norm}-{accumulate}", max_grad_norm=max_grad_norm, max_steps=2,
                             logging_steps=1, gradient_accumulation_steps=accumulate)  # fmt: skip
        return transformers.Trainer(model=m, args=args, train_dataset=TokenDataset(), optimizers=(opt, None)), handle

    t, handle = trainer(1.0)  # Trainer's default max_grad_norm
    with pytest.raises(RuntimeError, match="already applied inside backward.*max_grad_norm=0"):
        t.train()
    handle.remove()
    t, handle = trainer(0.0, accumulate=2)  # the window's second backward: refused
    with pytest.raises(RuntimeError, match="backward pass 2 since the last optimizer.step"):
        t.train()
    handle.remove()
    # The documented alternative trains; the gradient norm it logs is unknown (NaN), not 0.
    t, handle = trainer(0.0)
    t.train()
    norms = [log["grad_norm"] for log in t.state.log_history if "grad_norm" in log]
    assert len(norms) == 2 and all(n != n for n in norms)
    handle.remove()
