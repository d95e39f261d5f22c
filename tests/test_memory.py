"""estimate() and measure(): the seed numbers, peers' layouts, and what naive counting gets wrong."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

import leanopt
from leanopt.memory import OPTIMIZER_NAMES, available_optimizers, resolve_optimizer
from leanopt.memory.estimate import PEER_NAMES
from leanopt.optim import REGISTRY
from registry import OPTIMIZERS

transformers = pytest.importorskip("transformers")

SEED_PARAMS = 65_783_042
SEED_ADAMW_BYTES = 526_264_752  # 2 x 4 B x params + 104 x 4-byte steps
SEED_ADAMW_ELEMENTS = 131_566_188


def distilbert(device: str = "meta") -> torch.nn.Module:
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    with torch.device(device):
        return DistilBertForSequenceClassification(DistilBertConfig(vocab_size=28996))


def step_once(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()


def test_seed_case_estimate_on_meta() -> None:
    model = distilbert("meta")
    assert sum(p.numel() for p in model.parameters()) == SEED_PARAMS
    est = leanopt.estimate(model, "adamw")
    assert est.params == SEED_PARAMS and est.tensors == 104
    assert est.bytes == SEED_ADAMW_BYTES and est.elements == SEED_ADAMW_ELEMENTS
    assert round(est.megabytes) == 502


@pytest.mark.slow
def test_seed_case_measured_after_a_torch_adamw_step() -> None:
    model = distilbert("cpu")
    opt = torch.optim.AdamW(model.parameters())
    step_once(model, opt)
    measured = leanopt.measure(opt)
    assert measured.elements == SEED_ADAMW_ELEMENTS and measured.bytes == SEED_ADAMW_BYTES
    mb, elements = leanopt.compute_optimizer_size(opt.state.values())
    assert round(mb) == 502 and elements == SEED_ADAMW_ELEMENTS
    assert leanopt.estimate(model, torch.optim.AdamW).bytes == measured.bytes


def small_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(50, 16), torch.nn.Linear(16, 24), torch.nn.LayerNorm(24), torch.nn.Linear(24, 3)
    ).to(dtype)


PEERS = [
    (torch.optim.AdamW, {}),
    (torch.optim.AdamW, {"amsgrad": True}),
    (torch.optim.Adam, {}),
    (torch.optim.Adafactor, {}),
    ("hf-adafactor", {}),
    ("hf-adafactor", {"beta1": 0.9}),
]


@pytest.mark.parametrize("optimizer,kwargs", PEERS, ids=lambda v: getattr(v, "__name__", str(v)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_peer_estimates_equal_measure_to_the_byte(optimizer, kwargs, dtype) -> None:
    model = small_model(dtype)
    cls = resolve_optimizer(optimizer)
    opt = cls(model.parameters(), **kwargs)
    step_once(model, opt)
    measured, predicted = leanopt.measure(opt), leanopt.estimate(model, optimizer, **kwargs)
    assert (predicted.bytes, predicted.elements, predicted.by_key) == (measured.bytes, measured.elements, measured.by_key)


def test_estimate_accepts_param_groups_and_named_params() -> None:
    model = small_model()
    groups = [{"params": list(model[0].parameters()), "amsgrad": True}, {"params": list(model[1:].parameters())}]
    est = leanopt.estimate(groups, "adamw")
    n0 = sum(p.numel() for p in model[0].parameters())
    n = sum(p.numel() for p in model.parameters())
    assert est.bytes == 4 * (2 * n + n0) + 4 * len(list(model.parameters()))
    assert leanopt.estimate(list(model.named_parameters()), "adamw").bytes == leanopt.estimate(model, "adamw").bytes


def test_estimate_validates_like_the_optimizer() -> None:
    with pytest.raises(ValueError):
        leanopt.estimate(small_model(), "adamw", lr=-1.0)
    with pytest.raises(ValueError, match="unknown optimizer"):
        leanopt.estimate(small_model(), "sgdx")
    with pytest.raises(ValueError, match="no state layout"):
        leanopt.estimate(small_model(), torch.optim.SGD, lr=0.1)


def test_measure_counts_shared_storage_once() -> None:
    class SharedState(torch.optim.Optimizer):
        """Keeps one buffer and two views of it per param (like flat-buffer optimizers)."""

        def __init__(self, params):
            super().__init__(params, {})

        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    flat = torch.zeros(2 * p.numel())
                    self.state[p] = {"buf": flat, "a": flat[: p.numel()], "b": flat[p.numel() :], "alias": flat}

    w = torch.nn.Parameter(torch.zeros(100))
    opt = SharedState([w])
    opt.step()
    m = leanopt.measure(opt)
    assert m.bytes == 800  # one storage of 200 fp32
    assert m.elements == 400  # buf + two distinct views; the alias is the same view as buf
    naive = sum(t.numel() * t.element_size() for t in opt.state[w].values())
    assert naive == 2400


def test_measure_follows_nested_dicts_and_groups() -> None:
    class Nested(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p] = {"step": 3, "q": {"codes": torch.zeros(p.numel(), dtype=torch.uint8), "absmax": torch.zeros(2)}}

    a, b = torch.nn.Parameter(torch.zeros(64)), torch.nn.Parameter(torch.zeros(32))
    opt = Nested([{"params": [a]}, {"params": [b]}])
    opt.step()
    m = leanopt.measure(opt)
    assert m.bytes == 64 + 8 + 32 + 8 and m.by_key == {"q": 112}
    assert m.by_group == {0: 72, 1: 40}


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed")
def test_measure_sees_through_torchao_tensor_subclasses() -> None:
    from torchao.optim import AdamW8bit

    w = torch.nn.Parameter(torch.randn(256, 256))
    opt = AdamW8bit([w])
    w.grad = torch.randn_like(w)
    opt.step()
    m = leanopt.measure(opt)
    # codes 1 B + one fp32 scale per 256 per state, + the 256-entry code books (shared: counted once each)
    per_param = m.bytes / w.numel()
    assert 2.0 < per_param < 2.1, per_param
    mb, _ = leanopt.compute_optimizer_size(opt.state.values())
    assert mb * 1024**2 == m.bytes
    wrong = sum(v.numel() * v.element_size() for v in opt.state[w].values())  # the lesson's helper
    assert wrong == 4 + 2 * 4 * w.numel()  # it reports 8 B/param, as FACTS.md says


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed")
def test_measure_bitsandbytes_state() -> None:
    import bitsandbytes as bnb

    w = torch.nn.Parameter(torch.randn(1024, 1024))
    opt = bnb.optim.AdamW8bit([w])
    w.grad = torch.randn_like(w)
    opt.step()
    m = leanopt.measure(opt)
    n = w.numel()
    # two uint8 codes, two absmax per 256-block, two 256-entry fp32 code books
    assert m.bytes == 2 * n + 2 * 4 * (n // 256) + 2 * 256 * 4


class TiedLM(torch.nn.Module):
    """An embedding and an output layer that share one weight (tie_word_embeddings)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(100, 16)
        self.mid = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 100, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.embed(tokens)))


def test_optimizer_names_are_the_registry_then_the_peers() -> None:
    # The registry is the one list of leanopt's optimizers: every name, in its order, and nothing else.
    assert [n for n, target in OPTIMIZER_NAMES.items() if target.startswith("leanopt:")] == list(REGISTRY)
    assert list(OPTIMIZER_NAMES) == [*REGISTRY, *PEER_NAMES]
    assert sorted(case.name for case in OPTIMIZERS) == sorted(REGISTRY)  # tests/registry.py matches it
    for name, cls in REGISTRY.items():
        assert resolve_optimizer(name) is cls and resolve_optimizer(name.upper()) is cls
    assert set(REGISTRY) <= set(available_optimizers())


@pytest.mark.parametrize("optimizer", [*OPTIMIZERS, torch.optim.AdamW], ids=lambda o: getattr(o, "__name__", str(o)))
def test_estimate_counts_tied_weights_once(optimizer) -> None:
    model = TiedLM()
    kwargs = {}
    groups: Any = lambda params: params  # noqa: E731  (what the optimizer is built over: the params)
    if not isinstance(optimizer, type):  # a registry case: its kwargs, the reference backend (no compile)
        kwargs = {**optimizer.kwargs, "backend": "reference"}
        if getattr(optimizer.cls, "state_bits", None) is not None:
            kwargs["min_quant_size"] = 0  # low-bit: quantize even these small tensors
        # Its groups of each view (Muon: by dims, the same split for every view of these params).
        groups, optimizer = optimizer.param_groups, optimizer.name
    opt = resolve_optimizer(optimizer)(groups(list(model.parameters())), **kwargs)
    model(torch.arange(10)).square().mean().backward()
    opt.step()
    measured = leanopt.measure(opt)
    tied = model.embed.weight
    views = {
        "named, remove_duplicate=False": list(model.named_parameters(remove_duplicate=False)),
        "a generator of named params": model.named_parameters(remove_duplicate=False),
        "a list with the same tensor twice": [tied, *model.mid.parameters(), tied],
        "groups that repeat it": [{"params": [tied, *model.mid.parameters()]}, {"params": [tied], "weight_decay": 0.0}],
    }
    for what, params in views.items():
        est = leanopt.estimate(groups(params), optimizer, **kwargs)
        assert (est.bytes, est.params, est.tensors) == (measured.bytes, 100 * 16 + 16 * 16 + 16, 3), what
        train = leanopt.training_memory(
            groups(list(model.named_parameters(remove_duplicate=False)) if "generator" in what else params), optimizer, **kwargs
        )
        assert train.optimizer_state == measured.bytes and train.params == est.params, what


def test_estimate_treats_two_views_of_one_storage_as_one_tensor() -> None:
    w = torch.nn.Parameter(torch.zeros(64, 8))
    alias = w.detach().view(64, 8)  # another tensor object, the same memory and shape
    assert leanopt.estimate([w, alias], "adamw").bytes == leanopt.estimate([w], "adamw").bytes
    other = torch.nn.Parameter(torch.zeros(64, 8))  # same shape, other memory: counted
    assert leanopt.estimate([w, other], "adamw").tensors == 2
