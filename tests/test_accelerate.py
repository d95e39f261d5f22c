"""leanopt in an Accelerate loop: prepare, accumulate, bf16 autocast on the CPU, save_state/load_state,
for every optimizer of the registry (``tests/registry.py``).

Every optimizer trains, accumulates, saves and resumes through Accelerate
(``test_bf16_accumulated_run_resumes_exactly_from_save_state``). What Accelerate does to the
gradients before ``step`` (accumulation), the dtypes a save keeps, and gradient release with
rounding do not depend on the rule: one optimizer per family runs them (``registry.representatives``).

The loop under test is the one in ``examples/accelerate_train.py``: running it here is what keeps
the example honest.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

from leanopt.memory import resolve_optimizer
from registry import REGISTERED, representatives

pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "accelerate_train.py"
_spec = importlib.util.spec_from_file_location("accelerate_train", EXAMPLE)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


names = pytest.mark.parametrize("name", [case.name for case in REGISTERED])
family_names = pytest.mark.parametrize("name", [case.name for case in representatives(REGISTERED)])
# What each optimizer takes besides lr (tests/registry.py: SGD's momentum, so there is a state to resume).
EXTRA = {case.name: case.state_kwargs for case in REGISTERED}
CASES = {case.name: case for case in REGISTERED}


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@names
def test_bf16_accumulated_run_resumes_exactly_from_save_state(name: str, tmp_path) -> None:
    # Saved after 2 of 4 steps: the resumed run restores the state and the data position and takes the last 2.
    model, opt, losses = example.train(name, steps=4, grad_accum=2, save_at=2, checkpoint_dir=str(tmp_path),
                                         optimizer_kwargs=EXTRA[name])
    inner = opt.optimizer
    assert type(inner) is resolve_optimizer(name)
    # Accumulation: 8 micro-batches, 4 optimizer steps.
    assert {int(st["step"]) for st in inner.state.values()} == {4}
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    resumed, resumed_opt, resumed_losses = example.train(name, steps=4, grad_accum=2, resume_from=str(tmp_path), model_seed=1,
                                                            optimizer_kwargs=EXTRA[name])
    assert resumed_losses == losses[2:]
    for (n, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), n
    for st, rst in zip(inner.state.values(), resumed_opt.optimizer.state.values()):
        assert st.keys() == rst.keys()
    # save_state wrote the optimizer's declared name with its state; load_state checked it.
    assert {g["optimizer"] for g in resumed_opt.optimizer.param_groups} == {name}


def test_prepared_model_runs_in_bf16_autocast_on_the_cpu() -> None:
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    model = accelerator.prepare(example.make_model())
    seen = []
    model[0].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    x, _ = example.make_data(4)[:]
    out = model(x)
    # Layers compute in bf16; Accelerate hands the output back in fp32; params stay fp32.
    assert seen == [torch.bfloat16] and out.dtype == torch.float32
    assert next(model.parameters()).dtype == torch.float32


# One per family: Accelerate sums the micro-batches' gradients before step, whatever the rule.
@family_names
def test_accumulating_two_micro_batches_matches_one_double_batch(name: str) -> None:
    _, _, accumulated = example.train(name, steps=4, grad_accum=2, batch_size=16, mixed_precision="no")
    _, _, whole = example.train(name, steps=4, grad_accum=1, batch_size=32, mixed_precision="no")
    assert torch.allclose(torch.tensor(accumulated), torch.tensor(whole), rtol=1e-5, atol=0)


# One per family: the state dtype for bf16 params is the family's layout (every case's through a
# plain save and load: tests/test_generic.py::test_low_precision_params_keep_fp32_state_through_save_load).
@family_names
def test_bf16_params_keep_fp32_state_through_save_and_load_state(name: str, tmp_path) -> None:
    def prepared(seed: int):
        accelerator = Accelerator(mixed_precision="bf16", cpu=True)
        model = example.make_model(seed).to(torch.bfloat16)
        cls = resolve_optimizer(name)
        kwargs = {**CASES[name].kwargs, "lr": 1e-3}  # the registry's (Adafactor: a plain lr)
        model, opt = accelerator.prepare(model, cls(CASES[name].param_groups(model), **kwargs))
        return accelerator, model, opt

    accelerator, model, opt = prepared(0)
    x, y = example.make_data(16)[:]
    accelerator.backward(torch.nn.functional.cross_entropy(model(x.bfloat16()).float(), y))
    opt.step()
    accelerator.save_state(str(tmp_path))
    dtypes = {k: v.dtype for st in opt.state.values() for k, v in st.items() if isinstance(v, torch.Tensor)}
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator, _, loaded = prepared(1)
    accelerator.load_state(str(tmp_path))
    loaded_dtypes = {k: v.dtype for st in loaded.state.values() for k, v in st.items() if isinstance(v, torch.Tensor)}
    assert loaded_dtypes == dtypes and torch.float32 in dtypes.values() and torch.bfloat16 not in dtypes.values()


def test_example_script_runs() -> None:
    assert example.main(["--optimizer", "adamw", "--steps", "4"]) == 0


def _accelerate_run(name: str, *, release: bool, rounding: str, steps: int = 6) -> torch.nn.Module:
    """A plain Accelerate loop (prepare, backward, step, zero_grad) on a bf16 model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1)).to(torch.bfloat16)
    cls = resolve_optimizer(name)
    opt = cls(CASES[name].param_groups(model), **{**CASES[name].kwargs, "lr": 1e-3}, rounding=rounding)  # the registry's (Adafactor: a plain lr)
    accelerator = Accelerator(cpu=True)
    model, opt = accelerator.prepare(model, opt)
    import leanopt

    handle = leanopt.release_gradients(model, opt.optimizer) if release else None
    for step in range(steps):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
        loss = model(x).float().square().mean()
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
    if handle is not None:
        handle.remove()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return model


# One per family: release steps each param through the same rounding code as step(), whatever the rule.
@family_names
@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_released_gradients_and_bf16_rounding_through_accelerate(name: str, rounding: str) -> None:
    # Both bf16 training modes in Accelerate's loop: pure bf16 weights with the rounding
    # mode, with and without gradient release; released training equals the usual loop.
    usual = _accelerate_run(name, release=False, rounding=rounding)
    released = _accelerate_run(name, release=True, rounding=rounding)
    start = _accelerate_run(name, release=False, rounding=rounding, steps=0)
    assert any(not torch.equal(a, b) for a, b in zip(usual.parameters(), start.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(usual.parameters(), released.parameters()))
