"""The DistilBERT lesson's own ``compute_optimizer_size``, run as the lesson wrote it, on every
registered optimizer's state (the lesson is what drop-in users run): it calls ``torch.tensor`` on each state value, so
every value -- a quantized one too -- must convert, and the sum must be the state's true bytes
(``leanopt.measure``, which ``leanopt.estimate`` equals)."""

from __future__ import annotations

import importlib.util
import inspect
import warnings

import pytest
import torch

import leanopt
from leanopt.quant import QuantizedState
from registry import GENERIC, OptimizerCase, representatives

# One per family: the lesson's sum converts each state value by its type (a dense tensor, a
# QuantizedState, on the device or offloaded to the host), which the family decides, not the
# rule; every case's estimate equals its measured state in
# tests/test_generic.py::test_estimate_equals_measure_to_the_byte (fp32 and bf16 params).
families = pytest.mark.parametrize("case", representatives(GENERIC), ids=str)


def lesson_compute_optimizer_size(optimizer_state):
    # The lesson's function, as it is written there (its loop, its torch.tensor call, its MB).
    total_size_megabytes, total_num_elements = 0, 0

    for params in optimizer_state:

        for name, tensor in params.items():
            tensor = torch.tensor(tensor)

            num_elements = tensor.numel()

            element_size = tensor.element_size()

            total_num_elements += num_elements

            total_size_megabytes += num_elements * element_size / (1024**2)

    return total_size_megabytes, total_num_elements


def lesson_bytes(optimizer: torch.optim.Optimizer) -> int:
    with warnings.catch_warnings():
        # torch.tensor(a_tensor) warns that detach().clone() is the recommended copy; the lesson ignores it.
        warnings.simplefilter("ignore", UserWarning)
        megabytes, _ = lesson_compute_optimizer_size(optimizer.state.values())
    return round(megabytes * 1024**2)


def make_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    # 8192- and 4096-element weights are quantized by the low-bit optimizers; the biases are not.
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 16)).to(dtype)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 1) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 32, generator=g).to(next(model.parameters()).dtype)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()


@families
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("offload", [None, "cpu"])
def test_the_lesson_s_function_gives_the_true_state_bytes(case: OptimizerCase, dtype: torch.dtype, offload: str | None) -> None:
    model = make_model(dtype)
    kwargs = {**case.kwargs, **case.state_kwargs}
    opt = case.cls(case.param_groups(model), **kwargs, offload=offload)
    step(model, opt)
    measured = leanopt.measure(opt)
    assert measured.bytes > 0
    assert lesson_bytes(opt) == measured.bytes, measured.by_key
    assert measured.bytes == leanopt.estimate(model, case.cls, **kwargs).bytes
    # leanopt's own helper of that name agrees.
    assert round(leanopt.compute_optimizer_size(opt.state.values())[0] * 1024**2) == measured.bytes


def quantized_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    lowbit = [c for c in GENERIC if not c.external and "block_size" in inspect.signature(c.cls).parameters]
    assert lowbit, "the registry has quantized optimizers"
    model = make_model()
    opt = lowbit[0].cls(model.parameters(), **{**lowbit[0].kwargs, **lowbit[0].state_kwargs})
    step(model, opt)
    return model, opt


def quantized_entries(opt: torch.optim.Optimizer) -> list[QuantizedState]:
    found = [v for st in opt.state.values() for v in st.values() if isinstance(v, QuantizedState)]
    assert found, "the first weight's states are quantized"
    return found


def test_torch_tensor_of_a_quantized_state_is_a_copy_of_its_bytes() -> None:
    _, opt = quantized_optimizer()
    for q in quantized_entries(opt):
        t = torch.tensor(q)
        assert t.dtype == torch.uint8 and t.numel() * t.element_size() == q.nbytes == q.format.nbytes(q.numel)
        assert torch.equal(t[: q.codes.numel()], q.codes)
        assert torch.equal(t[q.codes.numel() :].view(torch.float32), q.absmax)
        t.fill_(0)  # a copy: the state keeps its values
        assert q.absmax.abs().sum() > 0
        assert torch.equal(torch.from_dlpack(q), q.as_bytes())
        with pytest.raises(BufferError, match="copy"):
            q.__dlpack__(copy=False)


def test_generic_code_moves_every_state_value_with_to() -> None:
    # What code that moves an optimizer to a device does: v.to(device, non_blocking=True) on every value.
    model, opt = quantized_optimizer()
    twin_model, twin = quantized_optimizer()
    for state in twin.state.values():
        for k, v in state.items():
            state[k] = v.to(torch.device("cpu"), non_blocking=True, copy=True)
    moved = quantized_entries(twin)
    assert all(q.codes.data_ptr() != o.codes.data_ptr() for q, o in zip(moved, quantized_entries(opt)))
    step(model, opt, 3)
    step(twin_model, twin, 3)
    for a, b in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(a, b)
    q = quantized_entries(opt)[0]
    on_meta = q.to(device="meta")
    assert on_meta.device.type == "meta" and on_meta.absmax.device.type == "meta" and on_meta.shape == q.shape
    assert q.to(torch.zeros(1)).device == q.device and q.cpu().device.type == "cpu"
    with pytest.raises(TypeError, match="no dtype"):
        q.to(torch.float16)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed")
def test_the_lesson_s_function_counts_bitsandbytes_flat_states() -> None:
    # bitsandbytes keeps its 8-bit state as plain tensors in the per-param dict (state1,
    # absmax1, qmap1, ...), not a nested dict: the lesson's sum counts it, plus each param's int
    # step as an 8-byte tensor and the code maps it shares between params once per param.
    import bitsandbytes as bnb

    model = make_model()
    opt = bnb.optim.AdamW8bit(model.parameters())
    step(model, opt)
    states = list(opt.state.values())
    assert all(not isinstance(v, dict) for st in states for v in st.values())
    quantized = [st for st in states if "qmap1" in st]
    shared_maps = sum(st["qmap1"].nbytes + st["qmap2"].nbytes for st in quantized[1:])
    int_steps = 8 * sum(isinstance(st["step"], int) for st in states)
    assert lesson_bytes(opt) == leanopt.measure(opt).bytes + shared_maps + int_steps
