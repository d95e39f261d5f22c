"""training_memory(): the formulas, held to real CPU training steps.

Two measurements of the same steps:

* exact: the bytes of every live storage (parameters, gradients, master weights, optimizer
  state), each storage counted once, must equal the breakdown to the byte;
* the process's resident memory (RSS) grown by building a model and training it, in a fresh
  process, must be within 5% of the breakdown's total: what the allocator really handed out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import leanopt
from leanopt.memory import PRECISIONS, resolve_optimizer
from leanopt.memory.training import supports_training_modes
from leanopt.quant import QuantizedState

# (name, kwargs); peers only when installed. The state layout does not depend on the backend;
# the reference backend spares these tests the CPU path's compile time on 2 shared cores (and
# the RSS test the compiler's own memory).
REF = {"backend": "reference"}
OPTIMIZERS = [
    ("adamw", REF),
    ("adafactor", REF),
    ("adafactor", {**REF, "beta1": 0.9, "lr": 1e-3, "relative_step": False}),
    ("adamw8bit", REF),
    ("adamw4bit", REF),
    ("torch-adamw", {}),
]
try:
    resolve_optimizer("hf-adafactor")
    OPTIMIZERS.append(("hf-adafactor", {}))
except ValueError:
    pass


def small_transformer() -> torch.nn.Module:
    """~140k params (byte-exact checks need no size; the RSS test below uses 4.2M): embedding,
    2 encoder layers (attention, MLP, norms: 1-D and 2-D params), a head."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(500, 64),
        torch.nn.TransformerEncoder(
            torch.nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True), 2, enable_nested_tensor=False
        ),
        torch.nn.Linear(64, 10),
    )


TOKENS = torch.randint(0, 500, (4, 16), generator=torch.Generator().manual_seed(1))


def _loss(model: torch.nn.Module) -> torch.Tensor:
    return model(TOKENS).float().square().mean()


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, QuantizedState):
        yield from value.tensors()
    elif isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def live_bytes(*roots: Any) -> int:
    """Bytes of the distinct storages reachable from ``roots``."""
    seen: dict[int, int] = {}
    for t in _tensors(list(roots)):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _state(opt: torch.optim.Optimizer) -> list[Any]:
    return list(opt.state.values())


def train_fp32(name: str, kwargs: dict[str, Any]) -> tuple[torch.nn.Module, int]:
    model = small_transformer()
    opt = resolve_optimizer(name)(model.parameters(), **kwargs)
    _loss(model).backward()
    opt.step()
    params = list(model.parameters())
    return model, live_bytes(params, [p.grad for p in params], _state(opt))


def train_autocast(name: str, kwargs: dict[str, Any]) -> tuple[torch.nn.Module, int]:
    """torch.autocast, as Trainer(bf16=True) runs it: what stays after the step."""
    model = small_transformer()
    opt = resolve_optimizer(name)(model.parameters(), **kwargs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = _loss(model)
    loss.backward()
    opt.step()
    params = list(model.parameters())
    assert all(p.grad.dtype == torch.float32 for p in params)
    return model, live_bytes(params, [p.grad for p in params], _state(opt))


def train_master(name: str, kwargs: dict[str, Any]) -> tuple[torch.nn.Module, int]:
    """bf16 model weights, fp32 master weights with fp32 gradient buffers (Megatron-style)."""
    model = small_transformer().to(torch.bfloat16)
    params = list(model.parameters())
    master = [p.detach().float().requires_grad_() for p in params]
    opt = resolve_optimizer(name)(master, **kwargs)
    _loss(model).backward()
    for p, m in zip(params, master):
        m.grad = p.grad.float()
        p.grad = None
    opt.step()
    with torch.no_grad():
        for p, m in zip(params, master):
            p.copy_(m)
    return model, live_bytes(params, master, [m.grad for m in master], _state(opt))


def train_bf16(name: str, kwargs: dict[str, Any]) -> tuple[torch.nn.Module, int]:
    model = small_transformer().to(torch.bfloat16)
    opt = resolve_optimizer(name)(model.parameters(), **kwargs)
    _loss(model).backward()
    opt.step()
    params = list(model.parameters())
    return model, live_bytes(params, [p.grad for p in params], _state(opt))


def _ids(case: Any) -> str:
    name, kwargs = case
    return name + ("-beta1" if "beta1" in kwargs else "")


@pytest.mark.parametrize("case", OPTIMIZERS, ids=_ids)
def test_fp32_equals_a_measured_step(case: tuple[str, dict[str, Any]]) -> None:
    name, kwargs = case
    model, measured = train_fp32(name, kwargs)
    predicted = leanopt.training_memory(model, name, precision="fp32", **kwargs)
    assert predicted.master_weights == 0
    assert measured == predicted.total


@pytest.mark.parametrize("case", OPTIMIZERS, ids=_ids)
def test_bf16_mixed_equals_measured_steps(case: tuple[str, dict[str, Any]]) -> None:
    name, kwargs = case
    model, master_measured = train_master(name, kwargs)
    predicted = leanopt.training_memory(model, name, precision="bf16-mixed", **kwargs)
    assert master_measured == predicted.total
    # Under autocast the fp32 parameters are the master weights and the bf16 weight copies
    # live only from forward to backward, so after the step all but those copies remain.
    _, autocast_measured = train_autocast(name, kwargs)
    assert autocast_measured == predicted.total - predicted.weights


@pytest.mark.parametrize("case", OPTIMIZERS, ids=_ids)
def test_bf16_equals_a_measured_step(case: tuple[str, dict[str, Any]]) -> None:
    name, kwargs = case
    model, measured = train_bf16(name, kwargs)
    predicted = leanopt.training_memory(model, name, precision="bf16", **kwargs)
    assert measured == predicted.total


# ---- pure bf16 with each rounding, and gradient release ---------------------------------------
LEAN = [case for case in OPTIMIZERS if supports_training_modes(case[0])]


@pytest.mark.parametrize("rounding", ["nearest", "stochastic", "kahan"])
@pytest.mark.parametrize("case", LEAN, ids=_ids)
def test_bf16_with_each_rounding_equals_a_measured_step(case: tuple[str, dict[str, Any]], rounding: str) -> None:
    name, kwargs = case
    kwargs = {**kwargs, "rounding": rounding}
    model, measured = train_bf16(name, kwargs)
    predicted = leanopt.training_memory(model, name, precision="bf16", **kwargs)
    assert measured == predicted.total
    assert predicted.rounding == rounding and predicted.mode == f"bf16 {rounding}"
    n = sum(p.numel() for p in model.parameters())
    # Kahan: a bf16 compensation per param element, in the optimizer state; the others keep none.
    assert predicted.compensation == (2 * n if rounding == "kahan" else 0)
    opt = resolve_optimizer(name)(model.parameters(), **kwargs)
    _loss(model).backward()
    opt.step()
    assert leanopt.measure(opt).bytes == predicted.optimizer_state
    assert leanopt.measure(opt).by_key.get("kahan_comp", 0) == predicted.compensation


def test_bf16_rounding_rows_add_only_the_compensation() -> None:
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 7))
    n = sum(p.numel() for p in model.parameters())
    nearest, stochastic, kahan = (leanopt.training_memory(model, "adamw", precision="bf16", rounding=r).total
                                  for r in ("nearest", "stochastic", "kahan"))  # fmt: skip
    assert nearest == stochastic == kahan - 2 * n
    assert leanopt.training_memory(model, "adamw", precision="bf16").rounding == "nearest"  # the default
    assert leanopt.training_memory(model, "adamw", precision="fp32", rounding="kahan").compensation == 0  # fp32 params ignore it
    with pytest.raises(ValueError, match="no rounding= option"):
        leanopt.training_memory(model, "torch-adamw", precision="bf16", rounding="kahan")
    assert leanopt.training_memory(model, "torch-adamw", precision="bf16").rounding is None


def _released_step(name: str, kwargs: dict[str, Any], precision: str) -> tuple[torch.nn.Module, int, int]:
    """One released step: the most gradient bytes live at once (from a hook that runs before the
    release's own), and the bytes live after it (weights, state, gradients left)."""
    model = small_transformer()
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    params = list(model.parameters())
    opt = resolve_optimizer(name)(params, **kwargs)
    most = [0]

    def seen(_: torch.Tensor) -> None:
        most[0] = max(most[0], live_bytes([p.grad for p in params if p.grad is not None]))

    hooks = [p.register_post_accumulate_grad_hook(seen) for p in params]
    with leanopt.release_gradients(model, opt):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = _loss(model)
        loss.backward()
        opt.step()
        opt.zero_grad()
    for h in hooks:
        h.remove()
    assert all(p.grad is None for p in params)
    return model, most[0], live_bytes(params, [p.grad for p in params], _state(opt))


@pytest.mark.parametrize("precision, rounding", [("fp32", None), ("bf16-mixed", None), ("bf16", "kahan"), ("bf16", "stochastic")])
@pytest.mark.parametrize("case", LEAN, ids=_ids)
def test_grad_release_equals_a_measured_step(case: tuple[str, dict[str, Any]], precision: str, rounding: str | None) -> None:
    name, kwargs = case
    kwargs = {**kwargs, **({"rounding": rounding} if rounding else {})}
    model, most_gradients, after = _released_step(name, kwargs, precision)
    predicted = leanopt.training_memory(model, name, precision=precision, grad_release=True, **kwargs)
    assert predicted.grad_release and predicted.mode.endswith("+ grad release")
    largest = max(p.numel() for p in model.parameters())
    assert most_gradients == predicted.gradients == (2 if precision == "bf16" else 4) * largest
    # Nothing of the gradients persists; under autocast, neither do the bf16 weight copies.
    transient = predicted.gradients + (predicted.weights if precision == "bf16-mixed" else 0)
    assert after == predicted.total - transient
    assert predicted.total == leanopt.training_memory(model, name, precision=precision, **kwargs).total - (
        predicted.params * PRECISIONS[precision][1] - predicted.gradients
    )


def test_grad_release_needs_a_leanopt_optimizer() -> None:
    with pytest.raises(ValueError, match="leanopt optimizer"):
        leanopt.training_memory(torch.nn.Linear(2, 2), "torch-adamw", grad_release=True)
    with pytest.raises(ValueError, match="grad_release"):
        leanopt.training_memory(torch.nn.Linear(2, 2), "adamw", grad_release="yes")


def test_formulas_per_precision() -> None:
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 7))
    n = sum(p.numel() for p in model.parameters())
    for precision, (w, g, m, dtype) in PRECISIONS.items():
        mem = leanopt.training_memory(model, "torch-adamw", precision=precision)
        assert (mem.params, mem.weights, mem.gradients, mem.master_weights) == (n, w * n, g * n, m * n)
        itemsize = torch.empty((), dtype=dtype).element_size()
        assert mem.optimizer_state == 2 * itemsize * n + 4 * 4  # torch keeps its state in the param dtype
        assert mem.total == sum(mem.as_dict()[k] for k in ("weights", "gradients", "master_weights", "optimizer_state"))


def test_only_trainable_params_count_and_groups_pass_through() -> None:
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 10))
    model[0].requires_grad_(False)
    mem = leanopt.training_memory(model, "adamw")
    assert mem.params == 1010 and mem.weights == 4 * 1010
    groups = [{"params": [model[1].weight], "weight_decay": 0.1}, {"params": [model[1].bias], "weight_decay": 0.0}]
    assert leanopt.training_memory(groups, "adamw").total == mem.total


def test_seed_model_breakdown() -> None:
    pytest.importorskip("transformers")
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    with torch.device("meta"):
        model = DistilBertForSequenceClassification(DistilBertConfig(vocab_size=28996))
    fp32 = leanopt.training_memory(model, "adamw")
    assert fp32.params == 65_783_042
    assert round(fp32.state.megabytes) == 502 and round(fp32.weights / 1024**2) == 251
    assert round(fp32.megabytes) == 1004
    assert round(leanopt.training_memory(model, "adamw", precision="bf16-mixed").megabytes) == 1129


def test_unknown_precision() -> None:
    with pytest.raises(ValueError, match="precision"):
        leanopt.training_memory(torch.nn.Linear(2, 2), "adamw", precision="fp8")


RSS_CHILD = textwrap.dedent(
    """
    import gc, json, os, sys
    import torch
    import leanopt
    from leanopt.memory import resolve_optimizer

    torch.set_num_threads(1)

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])

    x = torch.randn(8, 1024)
    cases = json.loads(sys.argv[1])

    def train(name, m):
        opt = resolve_optimizer(name)(m.parameters(), **cases[name])
        m(x[:, : m[0].in_features]).square().mean().backward()
        opt.step()
        return opt

    for name in cases:  # warm up: imports, autograd, thread pools are not what we measure
        train(name, torch.nn.Sequential(torch.nn.Linear(64, 64)))
    out = {}
    for name in cases:
        gc.collect()
        before = rss()
        m = model()
        opt = train(name, m)
        gc.collect()
        out[name] = [rss() - before, leanopt.training_memory(m, name, **cases[name]).total]
        del m, opt
    print(json.dumps(out))
    """
)


def test_resident_memory_of_a_real_step_matches_within_5_percent() -> None:
    if not os.path.exists("/proc/self/statm"):
        pytest.skip("needs /proc (Linux)")
    # A fixed mmap threshold: glibc then maps every large block itself and returns it on free,
    # so RSS follows live tensors (with the default, freed activations would stay resident);
    # a zero trim threshold returns freed heap tops too.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0", "OMP_NUM_THREADS": "1"}
    cases = {"adamw": REF, "adafactor": REF}
    proc = subprocess.run(
        [sys.executable, "-c", RSS_CHILD, json.dumps(cases)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in cases:
        grown, predicted = result[name]
        assert abs(grown - predicted) <= 0.05 * predicted, (name, grown, predicted)
