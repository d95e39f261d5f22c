"""Planning in one thread never changes what a training step does in another.

``leanopt.plan`` traces a step on fake tensors with leanopt's own kernels answering for a trace
(``leanopt.kernels.tracing``): stubs for the compiled CPU graphs, the trace's own caches. That
answer is the tracing thread's only. Here a bf16 AdamW8bit model (the compiled CPU path, whose
graph the planner used to swap for a stub module-wide) trains in one thread while another plans
over and over; the training must be bit-identical to the same steps alone, and every plan
identical to a plan made alone. Planning the very model being trained leaves it untouched, and a
plan for a GPU (which replaces a few of torch's own functions on the fake tensors) changes no
torch function for another thread.
"""

from __future__ import annotations

import threading

import pytest
import torch

pytest.importorskip("transformers")
import transformers

import leanopt
from leanopt.memory.plan import plan

# No dropout: the training is a function of the seeds alone, whatever another thread draws.
TINY = {"vocab_size": 500, "dim": 32, "n_layers": 1, "n_heads": 2, "hidden_dim": 64, "max_position_embeddings": 32,
        "dropout": 0.0, "attention_dropout": 0.0, "seq_classif_dropout": 0.0}  # fmt: skip


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.DistilBertConfig(**TINY, num_labels=2)
    return transformers.DistilBertForSequenceClassification(config).to(torch.bfloat16)


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    gen = torch.Generator().manual_seed(i)
    ids = torch.randint(0, TINY["vocab_size"], (2, 8), generator=gen)
    labels = torch.randint(0, 2, (2,), generator=gen)
    model(input_ids=ids, labels=labels).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _plan(model: torch.nn.Module) -> list:
    rows = plan(model, batch=2, seq=8, optimizers=["adamw8bit"], precisions=["bf16-mixed"], checkpointing=[False],
                grad_release=[False], process=False)  # fmt: skip
    return [(r.optimizer, r.peak_bytes, r.breakdown) for r in rows]


def _train(steps: int | None, planned: list | None = None) -> tuple[dict[str, torch.Tensor], int]:
    """Train a fresh model ``steps`` steps, or (``planned``: a list another thread appends its
    plans to) until two plans are done and at least 8 steps; the params and the step count."""
    model = _model()
    opt = leanopt.AdamW8bit(model.parameters(), lr=1e-2, min_quant_size=0)
    i = 0
    while (i < steps) if steps is not None else (i < 8 or len(planned) < 2):
        _train_step(model, opt, i)
        i += 1
    return {n: p.detach().clone() for n, p in model.named_parameters()}, i


@pytest.mark.slow
def test_a_plan_in_another_thread_changes_no_training_step():
    alone_plan = _plan(_model())
    _train(1)  # compiles the quantized graph before the planner runs (the compile is not under test)
    plans: list = []
    errors: list[BaseException] = []
    done = threading.Event()
    planned = _model()

    def planner() -> None:
        try:
            while not done.is_set():
                plans.append(_plan(planned))
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)
            plans.extend([None, None])  # let the training loop end

    thread = threading.Thread(target=planner)
    thread.start()
    try:
        together, steps = _train(None, plans)
    finally:
        done.set()
        thread.join(timeout=300)
    assert not errors, f"the plan failed while a step ran: {errors[0]!r}"
    assert all(p == alone_plan for p in plans)
    alone, _ = _train(steps)
    moved = [n for n in alone if not torch.equal(together[n], alone[n])]
    assert not moved, f"params trained differently ({steps} steps) while another thread planned: {moved[:3]}"


def test_a_plan_of_the_model_being_trained_leaves_it_untouched():
    # The planner traces a copy with fake weights: the training thread's own model never sees one.
    model = _model()
    opt = leanopt.AdamW8bit(model.parameters(), lr=1e-2, min_quant_size=0)
    before = list(model.named_parameters())
    _train_step(model, opt, 0)
    result: list = []
    thread = threading.Thread(target=lambda: result.append(_plan(model)))
    thread.start()
    while thread.is_alive():
        now = list(model.named_parameters())
        assert len(now) == len(before) and all(a is b and n == m for (n, a), (m, b) in zip(now, before))
        assert all(type(p.data) is torch.Tensor for p in model.parameters())
        _train_step(model, opt, 1)
    thread.join()
    assert result and result[0] == _plan(_model())


def test_a_gpu_plan_changes_no_torch_function_in_another_thread():
    # A plan for device="cuda" runs attention by CUDA's kernels and some ops in fp32 on the fake
    # tensors: torch's own functions, replaced for the planning thread only (torch_patches.thread_patch).
    pytest.importorskip("triton")
    model = _model().float()
    ids = torch.randint(0, TINY["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(input_ids=ids).logits
    planned = _model()
    errors: list[BaseException] = []
    plans: list = []

    def planner() -> None:
        try:
            for _ in range(2):
                plans.append(plan(planned, batch=2, seq=8, optimizers=["adamw"], precisions=["bf16-mixed"],
                                  checkpointing=[False], grad_release=[False], device="cuda"))  # fmt: skip
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    thread = threading.Thread(target=planner)
    thread.start()
    forwards = 0
    while thread.is_alive() or forwards == 0:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(model(input_ids=ids).logits, expected)
        forwards += 1
    thread.join()
    assert not errors, f"the plan failed: {errors[0]!r}"
    assert len(plans) == 2 and plans[0] == plans[1]
    from leanopt import torch_patches

    assert not torch_patches._PATCHES  # the last trace out put torch's functions back
    assert torch.nn.functional.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention
