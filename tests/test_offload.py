"""``offload="cpu"`` on CPU params: the host machinery (host copies, the worker thread,
host gradient buffers, clipping on the host, steps inside backward) must give the same bits as
the same optimizer without offload, for every optimizer of the registry (``tests/registry.py``).

CPU params run :class:`leanopt.optim.offload.HostTransport` (host-to-host copies); the CUDA
transport (pinned buffers, streams, events) is the ``offload`` stage of scripts/gpu_check.sh.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest
import torch

import leanopt
from leanopt.optim import clipping
from leanopt.optim import offload as offload_module
from registry import OPTIMIZERS

cases = pytest.mark.parametrize("case", OPTIMIZERS, ids=str)


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    # The first weight has 8192 elements: the low-bit optimizers quantize it, the rest stay dense.
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8)).to(dtype)


def batch(step: int, micro: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(1000 * step + micro)).to(dtype)


def loss_of(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().square().mean()


def scheduler_for(kind: str | None, opt: torch.optim.Optimizer) -> Any:
    if kind == "step":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    if kind == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
    return None


def train(case, *, offload: str | None = None, release: bool = False, steps: int = 20, accumulate: int = 1,
          clip: str | None = None, scheduler: str | None = None, model: torch.nn.Module | None = None,
          opt: torch.optim.Optimizer | None = None, first_step: int = 0,
          each_step: Callable[[int, torch.nn.Module, Any], None] | None = None):  # fmt: skip
    """A loop of ``steps`` optimizer steps of ``accumulate`` backward passes each; ``clip``: None,
    "torch" (torch.nn.utils.clip_grad_norm_ on the model), "optimizer" (its clip_grad_norm_) or
    "value" (torch.nn.utils.clip_grad_value_ on the model)."""
    model = make_model() if model is None else model
    opt = case.cls(case.param_groups(model), **case.kwargs, offload=offload) if opt is None else opt
    handle = leanopt.release_gradients(model, opt) if release else None
    sched = scheduler_for(scheduler, opt)
    norms = []
    for step in range(first_step, first_step + steps):
        for micro in range(accumulate):
            (loss_of(model, batch(step, micro)) / accumulate).backward()
        if clip == "torch":  # in the optimizer's order (Muon's groups reorder the model's params)
            norms.append(torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 0.05))
        elif clip == "optimizer":
            norms.append(opt.clip_grad_norm_(0.05))
        elif clip == "value":
            torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        if each_step is not None:
            each_step(step, model, opt)
    if handle is not None:
        handle.remove()
    return model, opt, norms


def same(a: Any, b: Any) -> bool:
    """Equal to the bit: tensors (values, dtype, shape), and containers of them, recursively."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))  # fmt: skip
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def params_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_same_run(ref, got) -> None:
    (m1, o1, n1), (m2, o2, n2) = ref, got
    assert same(params_of(m1), params_of(m2)), "params differ"
    assert same(o1.state_dict(), o2.state_dict()), "state_dicts differ"
    assert same(n1, n2), "clip norms differ"


# ---- bit identity ---------------------------------------------------------------------------
@cases
def test_offload_is_bit_identical_over_20_steps(case) -> None:
    ref = train(case)
    got = train(case, offload="cpu")
    assert got[1].offload == "cpu" and ref[1].offload is None
    assert all(t.device.type == "cpu" for st in got[1].state.values() for t in st.values() if isinstance(t, torch.Tensor))
    assert_same_run(ref, got)


@cases
@pytest.mark.parametrize("release", [False, True], ids=["kept", "released"])
@pytest.mark.parametrize("accumulate,clip,scheduler", [
    (2, None, "step"), (4, "torch", "lambda"), (1, "optimizer", "step"), (1, None, "lambda"),
])  # fmt: skip
def test_accumulation_clipping_and_schedulers_are_bit_identical(case, release, accumulate, clip, scheduler) -> None:
    # The reference is the usual loop without offload or release: autograd accumulates, torch clips.
    # 6 steps: StepLR halves the lr at step 3, LambdaLR changes it every step.
    ref = train(case, steps=6, accumulate=accumulate, clip=clip and "torch", scheduler=scheduler)
    got = train(case, offload="cpu", release=release, steps=6, accumulate=accumulate, clip=clip, scheduler=scheduler)
    assert_same_run(ref, got)


@cases
def test_a_declared_backward_pass_steps_the_params_as_their_gradients_arrive(case) -> None:
    # step_in_backward=2: from the very first step, the 2nd backward pass after a step() steps
    # each param on the host as its gradient arrives; step() then has nothing left to do.
    model = make_model()
    opt = case.cls(case.param_groups(model), **case.kwargs, offload="cpu")
    handle = leanopt.release_gradients(model, opt, step_in_backward=2)
    counts = []
    for step in range(4):
        for micro in range(2):
            (loss_of(model, batch(step, micro)) / 2).backward()
            assert all(p.grad is None for p in model.parameters())  # freed once on the host
            opt.placement.wait()
            counts.append({int(st["step"]) for st in opt.state.values()} or {0})
        opt.step()
        opt.zero_grad()
        assert not opt.placement.held_gradients(list(model.parameters()))
    handle.remove()
    assert counts == [{0}, {1}, {1}, {2}, {2}, {3}, {3}, {4}]
    assert_same_run(train(case, steps=4, accumulate=2), (model, opt, []))


def test_a_backward_pass_beyond_the_declared_one_is_refused_before_it_is_applied() -> None:
    case = OPTIMIZERS[0]
    model = make_model()
    opt = case.cls(case.param_groups(model), **case.kwargs, offload="cpu")
    leanopt.release_gradients(model, opt, step_in_backward=2)
    for micro in range(2):
        loss_of(model, batch(0, micro)).backward()  # the second is stepped inside backward
    opt.placement.wait()  # the host steps it submitted, and their uploads
    before = params_of(model)
    with pytest.raises(RuntimeError, match=r"backward pass 3 since the last optimizer.step\(\).*step_in_backward=2"):
        loss_of(model, batch(0, 2)).backward()
    opt.placement.wait()
    assert same(before, params_of(model)) and {int(st["step"]) for st in opt.state.values()} == {1}
    with pytest.raises(RuntimeError, match="clip_grad_norm_ over params whose gradients .* already applied"):
        opt.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match="clip_grad_value_ over params whose gradients .* already applied"):
        torch.nn.utils.clip_grad_value_(model.parameters(), 1.0)
    opt.step()  # nothing left: the params were stepped inside backward
    assert {int(st["step"]) for st in opt.state.values()} == {1}


def test_step_in_backward_must_be_a_positive_int() -> None:
    for value in (0, -2, 1.5, True, "2"):
        model = make_model()
        with pytest.raises(ValueError, match="Invalid step_in_backward"):
            leanopt.release_gradients(model, leanopt.AdamW(model.parameters(), offload="cpu"), step_in_backward=value)


def test_clip_grad_value_clamps_the_host_gradients_of_a_release() -> None:
    # Accelerate's clip_grad_value_ is torch's: routed, it clamps what waits on the host, to the
    # bits of the usual loop's clamp (at 1e-3 most elements are clamped: the runs differ without it).
    case = OPTIMIZERS[0]
    model, _, _ = train(case, offload="cpu", release=True, steps=3, clip="value")
    ref = train(case, steps=3, clip="value")
    assert same(params_of(model), params_of(ref[0]))
    assert not same(params_of(ref[0]), params_of(train(case, steps=3)[0]))


def test_torch_clip_grad_norm_is_torch_s_own_for_other_params() -> None:
    model = make_model()
    handle = leanopt.release_gradients(model, leanopt.AdamW(model.parameters(), offload="cpu"))  # routes it
    assert torch.nn.utils.clip_grad_norm_ is clipping.clip_grad_norm_
    a, b = make_model(), make_model()
    for m in (a, b):
        loss_of(m, batch(0, 0)).backward()
    na = torch.nn.utils.clip_grad_norm_(a.parameters(), 0.01)
    nb = clipping.TORCH_CLIP_GRAD_NORM_(b.parameters(), 0.01)
    handle.remove()
    assert same(na, nb) and same([p.grad for p in a.parameters()], [p.grad for p in b.parameters()])


class DeferredTransport(offload_module.HostTransport):
    """A transport whose copies happen only when waited on (uploads also at ``finish``), into
    NaN-filled buffers: the engine's order of waits is what an asynchronous (CUDA) transport
    needs, or results differ. A gradient is read when the copy starts (CUDA: ``record_stream``
    keeps it); a host copy being uploaded is read when the upload ends."""

    def __init__(self) -> None:
        self.uploads: list[list[Any]] = []

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.full(shape, float("nan"), dtype=dtype)

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, mark: Any) -> Any:
        snapshot = src.detach().clone()
        return [lambda: dst.copy_(snapshot)]

    def to_device(self, src: torch.Tensor, dst: torch.Tensor, mark: Any) -> Any:
        handle = [lambda: dst.detach().copy_(src)]
        self.uploads.append(handle)
        return handle

    def wait(self, handle: Any) -> None:
        if handle is not None and handle[0] is not None:
            copy, handle[0] = handle[0], None
            copy()

    def finish(self) -> None:
        for handle in self.uploads:
            self.wait(handle)
        self.uploads = []


@cases
@pytest.mark.parametrize("release", [False, True], ids=["kept", "released"])
def test_the_engine_waits_for_every_asynchronous_copy(case, release) -> None:
    ref = train(case, steps=6, accumulate=2, scheduler="step")
    model = make_model()
    opt = case.cls(case.param_groups(model), **case.kwargs, offload="cpu")
    opt.placement.transport = DeferredTransport()
    got = train(case, model=model, opt=opt, release=release, steps=6, accumulate=2, scheduler="step")
    assert_same_run(ref, got)


# ---- bf16 params: an fp32 master on the host ---------------------------------------------------
@cases
def test_bf16_params_step_an_fp32_master_on_the_host(case) -> None:
    opt = bf16_run_beside_fp32_masters(case, steps=10)
    assert all(t.dtype == torch.float32 for t in opt.placement._twins.values())


def bf16_run_beside_fp32_masters(case, steps: int):
    """An offloaded run on bf16 params held, every step, to its reference: the same optimizer,
    without offload, on fp32 copies given the same gradients (the device param is the master
    rounded to nearest); the offloaded optimizer, for further checks."""
    model = make_model(dtype=torch.bfloat16)
    opt = case.cls(case.param_groups(model), **case.kwargs, offload="cpu")
    masters = [torch.nn.Parameter(p.detach().float()) for p in model.parameters()]
    ref = case.cls(case.param_groups(masters), **case.kwargs)
    for step in range(steps):
        loss_of(model, batch(step, 0, torch.bfloat16)).backward()
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float()
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
        assert same(params_of(model), [m.detach().to(torch.bfloat16) for m in masters]), step
    assert same(opt.state_dict()["state"], ref.state_dict()["state"])
    return opt


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_rounding_modes_are_refused_for_bf16_params(rounding: str) -> None:
    model = make_model(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rounding"):
        leanopt.AdamW(model.parameters(), rounding=rounding, offload="cpu")
    # fp32 params ignore the rounding: accepted.
    leanopt.AdamW(make_model().parameters(), rounding=rounding, offload="cpu")
    # A checkpoint of a bf16 run with Kahan rounding: refused by name too.
    donor = leanopt.AdamW(model.parameters(), rounding="kahan")
    loss_of(model, batch(0, 0, torch.bfloat16)).backward()
    donor.step()
    target = leanopt.AdamW(model.parameters(), offload="cpu")
    with pytest.raises(ValueError, match="rounding"):
        target.load_state_dict(donor.state_dict())


# ---- checkpoints ------------------------------------------------------------------------------
def _roundtrip(sd: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@cases
@pytest.mark.parametrize("first,second", [(None, "cpu"), ("cpu", None), ("cpu", "cpu")])
def test_a_checkpoint_moves_between_offloaded_and_on_device_training(case, first, second) -> None:
    ref = train(case, steps=10, accumulate=2)
    model, opt, _ = train(case, offload=first, steps=5, accumulate=2)
    saved = _roundtrip(opt.state_dict())
    resumed = case.cls(case.param_groups(model), **case.kwargs, offload=second)
    resumed.load_state_dict(saved)
    got = train(case, model=model, opt=resumed, steps=5, first_step=5, accumulate=2,
                release=second == "cpu")  # fmt: skip
    assert_same_run(ref, got)


@cases
def test_a_param_written_outside_the_optimizer_is_copied_to_the_host_again(case) -> None:
    donor = make_model(seed=7).state_dict()

    def reload(step: int, model: torch.nn.Module, opt: Any) -> None:
        if step == 2:
            model.load_state_dict(donor)  # what a resume of the model weights does
            with torch.no_grad():
                model[2].bias.add_(0.5)  # an in-place edit under no_grad

    assert_same_run(train(case, steps=5, each_step=reload), train(case, offload="cpu", steps=5, each_step=reload))


@pytest.mark.parametrize("case", [c for c in OPTIMIZERS if c.cls.family == OPTIMIZERS[0].cls.family][:2], ids=str)
def test_a_model_converted_after_the_optimizer_was_built_is_refused(case) -> None:
    # On the device the kernels refuse fp64 params with fp32 states (torch's optimizers too);
    # offloaded, the fp32 host copy would go on training the fp64 params in fp32, silently.
    for offload in (None, "cpu"):
        model = make_model()
        opt = case.cls(case.param_groups(model), **case.kwargs, offload=offload)
        loss_of(model, batch(0, 0)).backward()
        opt.step()
        opt.zero_grad()
        model.double()
        loss_of(model, batch(1, 0).double()).backward()
        before = params_of(model)
        with pytest.raises(RuntimeError, match=r"param \d of group 0 is torch.float64, but its optimizer state was made for"):
            opt.step()
        assert same(before, params_of(model))


# ---- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["gpu", "CPU", True, 1, "cuda"])
def test_invalid_offload_values_are_refused(value) -> None:
    for case in OPTIMIZERS:
        with pytest.raises(ValueError, match="Invalid offload"):
            case.cls(case.param_groups(make_model()), **case.kwargs, offload=value)


def test_params_on_several_devices_are_refused() -> None:
    params = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4, device="meta"))]
    with pytest.raises(ValueError, match="one device.*cpu, meta"):
        leanopt.AdamW8bit(params, offload="cpu")


    opt = leanopt.AdamW8bit(params[:1], offload="cpu")
    with pytest.raises(ValueError, match="param group 1 has a param on meta"):
        opt.add_param_group({"params": params[1:]})


def test_not_enough_host_memory_is_a_runtime_error(monkeypatch) -> None:
    model = make_model()
    probe = leanopt.AdamW8bit(model.parameters(), offload="cpu")
    needed = probe.placement.host_bytes()
    monkeypatch.setattr(offload_module, "host_memory_available", lambda: needed - 1)
    with pytest.raises(RuntimeError, match="host memory"):
        leanopt.AdamW8bit(model.parameters(), offload="cpu")
    monkeypatch.setattr(offload_module, "host_memory_available", lambda: needed)
    opt = leanopt.AdamW8bit(model.parameters(), offload="cpu")
    with pytest.raises(RuntimeError, match="host gradient buffers"):
        # release adds a gradient buffer per param; ``needed`` bytes are not left for it
        monkeypatch.setattr(offload_module, "host_memory_available", lambda: 1)
        leanopt.release_gradients(model, opt)


def test_offload_is_a_keyword_of_every_constructor_and_not_saved() -> None:
    import inspect

    for case in OPTIMIZERS:
        parameter = inspect.signature(case.cls.__init__).parameters["offload"]
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.default is None
        opt = case.cls(case.param_groups(make_model()), **case.kwargs, offload="cpu")
        assert "offload" not in opt.param_groups[0] and "offload" not in opt.defaults


# ---- host memory per param ----------------------------------------------------------------------
@pytest.mark.parametrize("name,limit", [("adamw8bit", 6.1), ("adamw4bit", 5.1)])
def test_host_bytes_per_bf16_param_within_the_issue_s_budget(name: str, limit: float) -> None:
    # 128 bf16 weights of 1024 x 1024 on the meta device (nothing allocated): fp32 master 4 B +
    # states + the gradient buffers of the two params in flight (2 x 2 MiB over 128 MiB).
    with torch.device("meta"):
        weights = [torch.nn.Parameter(torch.empty(1024, 1024, dtype=torch.bfloat16)) for _ in range(128)]
    opt = leanopt.optim.registry.optimizer_class(name)(weights, offload="cpu")
    n = 128 * 2**20
    states = sum(spec.nbytes() for w in weights for spec in opt._param_layout(w, opt.param_groups[0]))
    assert opt.placement.host_bytes() == 4 * n + states + 2 * (2 * 2**20)
    assert opt.placement.host_bytes() / n <= limit
    # Released, a gradient buffer per param is the bound until step() (bf16: 2 B).
    assert opt.placement.host_bytes(released=True) == 4 * n + states + 2 * n


@cases
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("release", [False, True])
def test_training_memory_counts_what_the_engine_holds(case, precision, release) -> None:
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    model = make_model(dtype=dtype)
    opt = case.cls(case.param_groups(model), **case.kwargs, offload="cpu")
    m = leanopt.training_memory(make_model(), case.cls, precision=precision, grad_release=release, offload=True,
                                **case.kwargs)  # fmt: skip
    assert m.host_bytes == opt.placement.host_bytes(released=release)
    n = sum(p.numel() for p in model.parameters())
    assert m.total == m.weights + m.gradients and m.optimizer_state == m.master_weights == 0
    assert m.weights == n * model[0].weight.element_size() and "offload" in m.mode
    assert m.as_dict()["host_bytes"] == m.host_bytes


def test_training_memory_refuses_offload_where_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="bf16-mixed"):
        leanopt.training_memory(make_model(), "adamw", precision="bf16-mixed", offload=True)
    with pytest.raises(ValueError, match="rounding"):
        leanopt.training_memory(make_model(), "adamw", precision="bf16", rounding="kahan", offload=True)
    with pytest.raises(ValueError, match="leanopt's optimizers"):
        leanopt.training_memory(make_model(), torch.optim.AdamW, offload=True)


def test_inspect_and_convert_read_an_offloaded_checkpoint() -> None:
    # The same file as without offload, so the same report and conversion; the converted
    # 4-bit state loads back into an offloaded AdamW4bit.
    from leanopt.checkpoint import convert_state_dict
    from leanopt.memory.inspect import inspect_state_dict

    sds = [_roundtrip(train(OPTIMIZERS[1], offload=off, steps=3)[1].state_dict()) for off in (None, "cpu")]
    assert inspect_state_dict(sds[0]).as_dict() == inspect_state_dict(sds[1]).as_dict()
    converted = [convert_state_dict(sd, "adamw4bit") for sd in sds]
    assert same(converted[0], converted[1])
    model = make_model()
    target = leanopt.AdamW4bit(model.parameters(), lr=1e-2, offload="cpu")
    target.load_state_dict(converted[1])
    assert all(v.device.type == "cpu" for st in target.state.values() for v in _tensors(st))


def _tensors(value: Any) -> list[torch.Tensor]:
    from leanopt.memory.measure import leaf_tensors

    return list(leaf_tensors(value))


def test_estimate_and_measure_work_on_an_offloaded_optimizer() -> None:
    model = make_model()
    est = leanopt.estimate(model, "adamw8bit", offload="cpu")
    _, opt, _ = train(OPTIMIZERS[1], offload="cpu", steps=1)
    assert leanopt.measure(opt).bytes == est.bytes == leanopt.estimate(model, "adamw8bit").bytes


# ---- Trainer and Accelerate -------------------------------------------------------------------
def clipped_on_the_host(opt: Any) -> list[int]:
    """How many host gradients each clip of ``opt``'s placement gave to clipping, as it goes."""
    seen: list[int] = []
    held = opt.placement.held_gradients

    def counted(params: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        out = held(params)
        if out:
            seen.append(len(out))
        return out

    opt.placement.held_gradients = counted
    return seen


@cases
def test_trainer_with_clipping_and_a_scheduler_matches_the_on_device_run(case, tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from leanopt.integrations.transformers import optimizer_cls_and_kwargs
    from test_trainer import LR, TokenDataset, tiny_distilbert, training_args

    finals = []
    for mode in ("device", "offload+release"):  # (offload without release: the loops above)
        model = tiny_distilbert()
        cls, kwargs = optimizer_cls_and_kwargs(case.name, lr=LR)
        cls = getattr(cls, "optimizer_class", cls)  # a factory Trainer calls with the model (Muon's)
        opt = cls(case.param_groups(model), **kwargs, offload=None if mode == "device" else "cpu")
        handle = leanopt.release_gradients(model, opt) if mode == "offload+release" else None
        # Trainer's defaults: max_grad_norm=1.0 (clipping through accelerate), a linear schedule.
        trainer = transformers.Trainer(model=model, args=training_args(tmp_path / mode, gradient_accumulation_steps=2, max_steps=3),
                                       train_dataset=TokenDataset(), optimizers=(opt, None))  # fmt: skip
        clipped = clipped_on_the_host(opt)
        trainer.train()
        if handle is not None:
            # Each step's two backward passes waited on the host and were clipped there (Trainer ->
            # accelerate -> leanopt's clipping).
            assert clipped == [len(list(model.parameters()))] * trainer.state.global_step
            handle.remove()
        finals.append(params_of(model))
    assert same(finals[0], finals[1])


@cases
def test_accelerate_loop_with_accumulation_and_clipping_matches_the_on_device_run(case) -> None:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    finals = []
    for offload, release in ((None, False), ("cpu", False), ("cpu", True)):
        model = make_model()
        opt = case.cls(case.param_groups(model), **case.kwargs, offload=offload)
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
        model, prepared = accelerator.prepare(model, opt)
        handle = leanopt.release_gradients(model, opt) if release else None
        clipped = clipped_on_the_host(opt)
        for step in range(8):
            with accelerator.accumulate(model):
                accelerator.backward(loss_of(model, batch(step // 2, step % 2)))
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 0.05)
                prepared.step()
                prepared.zero_grad()
        if handle is not None:
            assert clipped == [len(list(model.parameters()))] * 4  # every step's gradients, on the host
            handle.remove()
        finals.append(params_of(model))
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    assert same(finals[0], finals[1]) and same(finals[0], finals[2])
