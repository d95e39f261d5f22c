"""leanopt in Hugging Face Trainer: both plug-ins, exact checkpoint resume, the state-memory callback,
for every optimizer of the registry (``tests/registry.py``).

A DistilBERT built from a tiny config (81,602 params; its 4096+-element matrices are large enough
for the low-bit optimizers to quantize) on synthetic token data, on the CPU: a few seconds a test.
"""

from __future__ import annotations

import pytest
import torch

import leanopt
from leanopt.memory import resolve_optimizer
from leanopt.memory.inspect import inspect_file
from registry import OPTIMIZERS, REGISTERED, representatives

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from leanopt.integrations.transformers import (  # noqa: E402
    OptimizerStateCallback,
    optimizer_cls_and_kwargs,
    unwrap_optimizer,
)

NAMES = [case.name for case in REGISTERED]
# What each optimizer takes besides what Trainer fills (tests/registry.py: SGD's momentum).
EXTRA = {case.name: case.state_kwargs for case in REGISTERED}
names = pytest.mark.parametrize("name", NAMES)
LR = 1e-3


class TokenDataset(torch.utils.data.Dataset):
    """Label 1 iff the second token is in the upper half of the vocabulary: learnable in a few steps."""

    def __init__(self, n: int = 256, seq_len: int = 16, vocab: int = 128, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(1, vocab, (n, seq_len), generator=g)
        self.labels = (self.input_ids[:, 1] >= vocab // 2).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "labels": self.labels[i]}


def tiny_distilbert(seed: int = 0) -> torch.nn.Module:
    config = transformers.DistilBertConfig(
        vocab_size=128, dim=64, n_layers=2, n_heads=2, hidden_dim=128, max_position_embeddings=32, num_labels=2
    )
    torch.manual_seed(seed)
    return transformers.DistilBertForSequenceClassification(config)


def training_args(out, **kw) -> transformers.TrainingArguments:
    base = dict(
        output_dir=str(out),
        per_device_train_batch_size=16,
        learning_rate=LR,
        weight_decay=0.01,
        max_steps=8,
        save_strategy="no",
        logging_steps=100,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    base.update(kw)
    return transformers.TrainingArguments(**base)


CASES = {case.name: case for case in REGISTERED}


def make_optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    cls, kwargs = optimizer_cls_and_kwargs(name, lr=LR, **EXTRA[name])
    cls = getattr(cls, "optimizer_class", cls)  # a factory Trainer calls with the model (Muon's)
    return cls(CASES[name].param_groups(model), **kwargs)


def state_steps(opt: torch.optim.Optimizer) -> set[int]:
    return {int(st["step"]) for st in opt.state.values()}


@names
def test_optimizers_tuple_trains_and_the_callback_logs_measured_bytes_once(name: str, tmp_path) -> None:
    model = tiny_distilbert()
    opt = make_optimizer(name, model)
    callback = OptimizerStateCallback()
    trainer = transformers.Trainer(
        model=model,
        args=training_args(tmp_path, max_steps=3),  # a record at step 1, none at steps 2 and 3
        train_dataset=TokenDataset(),
        optimizers=(opt, None),
        callbacks=[callback],
    )
    result = trainer.train()
    assert unwrap_optimizer(trainer.optimizer) is opt
    assert trainer.state.global_step == 3 and state_steps(opt) == {3}
    assert torch.isfinite(torch.tensor(result.training_loss))
    records = [e for e in trainer.state.log_history if OptimizerStateCallback.KEY in e]
    assert len(records) == 1 and records[0]["step"] == 1
    assert records[0]["optimizer"] == name  # the name the optimizer declares
    # The state's size doesn't change after the first step: the record equals a measurement now.
    assert records[0][OptimizerStateCallback.KEY] == leanopt.measure(opt).bytes
    assert records[0][OptimizerStateCallback.KEY] == leanopt.estimate(model, name, **_kw(name)).bytes


def _kw(name: str) -> dict:
    return optimizer_cls_and_kwargs(name, lr=LR, **EXTRA[name])[1]


@names
def test_optimizer_cls_and_kwargs_gets_trainers_decay_groups_and_args(name: str, tmp_path) -> None:
    model = tiny_distilbert()
    args = training_args(tmp_path, max_steps=2, lr_scheduler_type="constant")
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=TokenDataset(),
        optimizer_cls_and_kwargs=optimizer_cls_and_kwargs(name, args, **EXTRA[name]),
    )
    trainer.train()
    opt = unwrap_optimizer(trainer.optimizer)
    assert type(opt) is resolve_optimizer(name)
    # Trainer's two groups (Muon's factory: its matrices, and its aux groups split the same way).
    assert {g["optimizer"] for g in opt.param_groups} == {name}
    assert {g["weight_decay"] for g in opt.param_groups} == {0.01, 0.0}
    assert {g["lr"] for g in opt.param_groups} == {LR}  # from TrainingArguments, which Trainer doesn't pass
    assert sum(len(g["params"]) for g in opt.param_groups if g["weight_decay"] == 0.0) > 0 and state_steps(opt) == {2}


def test_optimizer_cls_and_kwargs_fills_from_training_arguments(tmp_path) -> None:
    args = training_args(tmp_path, learning_rate=3e-4, adam_beta1=0.8, adam_beta2=0.99, adam_epsilon=1e-6)
    assert optimizer_cls_and_kwargs("adamw", args) == (
        leanopt.AdamW,
        {"lr": 3e-4, "betas": (0.8, 0.99), "eps": 1e-6},
    )
    assert optimizer_cls_and_kwargs("adamw", args, lr=1e-2)[1]["lr"] == 1e-2
    cls, kwargs = optimizer_cls_and_kwargs("adafactor", args)
    assert cls is leanopt.Adafactor
    assert kwargs == {"lr": 3e-4, "relative_step": False, "scale_parameter": False}
    with pytest.raises(ValueError, match="learning rate"):
        optimizer_cls_and_kwargs("adafactor")
    with pytest.raises(ValueError, match="unknown optimizer"):
        optimizer_cls_and_kwargs("adamw3bit")
    # Every registered optimizer, by the rule it runs (as Trainer fills its own optim names):
    # what each fills is declared in its registry entry (tests/registry.py, from_training_args).
    for case in OPTIMIZERS:
        cls, kwargs = optimizer_cls_and_kwargs(case.name, args)
        assert getattr(cls, "optimizer_class", cls) is case.cls and kwargs["lr"] == 3e-4
        assert kwargs == {"lr": 3e-4, **case.from_training_args(args)}, case.name
        lin = torch.nn.Linear(2, 2)
        built = cls()(lin, **kwargs) if hasattr(cls, "optimizer_class") else cls(lin.parameters(), **kwargs)  # it takes them
        assert type(built) is case.cls
    assert optimizer_cls_and_kwargs("torch-adamw", args)[1] == {"lr": 3e-4, "betas": (0.8, 0.99), "eps": 1e-6}
    assert optimizer_cls_and_kwargs("torch-adafactor", args)[1] == {"lr": 3e-4}  # takes no relative_step


def _run(name: str, out, resume: str | None = None, *, steps: int = 4, save_steps: int = 2):
    model = tiny_distilbert(seed=1)  # resuming overwrites these weights from the checkpoint
    args = training_args(out, max_steps=steps, save_strategy="steps", save_steps=save_steps)
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=TokenDataset(),
        optimizer_cls_and_kwargs=optimizer_cls_and_kwargs(name, args, **EXTRA[name]),
    )
    trainer.train(resume_from_checkpoint=resume)
    return model, unwrap_optimizer(trainer.optimizer)


@names
def test_resume_from_checkpoint_ends_with_the_uninterrupted_weights(name: str, tmp_path) -> None:
    full_model, _ = _run(name, tmp_path / "full")
    # Saved after 2 of 4 steps: the resumed run restores the state, the schedule's step and the
    # data position, and takes the last 2 steps.
    checkpoint = tmp_path / "full" / "checkpoint-2"
    # Trainer reads it with torch.load(weights_only=True): only plain types in leanopt's state_dict.
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert {int(st["step"]) for st in saved["state"].values()} == {2}
    # The checkpoint says which optimizer wrote it: `leanopt inspect checkpoint-2` reads it.
    assert {g["optimizer"] for g in saved["param_groups"]} == {name}
    assert inspect_file(checkpoint).optimizer == name
    resumed_model, resumed_opt = _run(name, tmp_path / "resumed", resume=str(checkpoint), save_steps=100)
    for (n, a), b in zip(full_model.named_parameters(), resumed_model.parameters()):
        assert torch.equal(a, b), n
    assert state_steps(resumed_opt) == {4}


def test_resume_with_a_sibling_converts_and_with_another_family_is_refused(tmp_path) -> None:
    # A Lion8bit checkpoint resumes under Trainer with Lion4bit (its state converted on load);
    # resuming it with AdamW fails before training, naming both.
    _run("lion8bit", tmp_path / "full")
    checkpoint = str(tmp_path / "full" / "checkpoint-2")
    _, opt = _run("lion4bit", tmp_path / "resumed", resume=checkpoint, steps=4, save_steps=100)
    assert type(opt) is leanopt.Lion4bit and state_steps(opt) == {4}
    assert {g["optimizer"] for g in opt.param_groups} == {"lion4bit"}
    with pytest.raises(ValueError, match=r"saved by Lion8bit \(lion rule\); AdamW runs the adamw rule"):
        _run("adamw", tmp_path / "refused", resume=checkpoint, steps=4, save_steps=100)


def test_example_script_runs_the_lesson_scenario_on_a_tiny_model(capsys) -> None:
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "trainer_distilbert.py"
    spec = importlib.util.spec_from_file_location("trainer_distilbert", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    results = example.main(["--tiny", "--steps", "3", "--optimizer", OPTIMIZERS[-1].name])
    assert results[OPTIMIZERS[-1].name]["state_bytes"] == results[OPTIMIZERS[-1].name]["estimate_bytes"]
    assert "Number of model parameters: 81,602" in capsys.readouterr().out


def test_default_adafactor_trains_under_trainers_scheduler_and_says_the_schedule_is_ignored(tmp_path) -> None:
    # The README's pairing: Trainer(optimizers=(leanopt.Adafactor(params), None)). Trainer's
    # default linear schedule scales each group's lr; a relative-step Adafactor reports its
    # step size there (it used to be None: TypeError) and warns once that the schedule is ignored.
    model = tiny_distilbert()
    opt = leanopt.Adafactor(model.parameters())
    assert opt.param_groups[0]["lr"] == 1e-2  # rho_1 = min(1e-2, 1/sqrt(1))
    trainer = transformers.Trainer(
        model=model, args=training_args(tmp_path), train_dataset=TokenDataset(), optimizers=(opt, None)
    )
    with pytest.warns(UserWarning, match="relative_step=True.*ignored.*Trainer logs.*RelativeStepSchedule"):
        result = trainer.train()
    assert trainer.state.global_step == 8 and state_steps(opt) == {8}
    assert torch.isfinite(torch.tensor(result.training_loss))


def test_trainer_logs_the_step_size_a_relative_step_adafactor_takes(tmp_path, recwarn) -> None:
    """Trainer logged `learning_rate 0.008125` (its linear decay of 1e-2) while Adafactor took 1e-2 at
    every step; with RelativeStepSchedule the logged lr is the step size taken, and nothing warns."""
    from leanopt.integrations.transformers import RelativeStepSchedule

    model = tiny_distilbert()
    opt = leanopt.Adafactor(model.parameters(), warmup_init=True)  # a step size that changes: 1e-6 t
    trainer = transformers.Trainer(model=model, args=training_args(tmp_path, logging_steps=1), train_dataset=TokenDataset(),
                                   optimizers=(opt, RelativeStepSchedule(opt)))  # fmt: skip
    trainer.train()
    logged = [entry["learning_rate"] for entry in trainer.state.log_history if "learning_rate" in entry]
    # Trainer logs after the step and the schedule's step: the step size of the step just taken.
    assert logged == pytest.approx([1e-6 * t for t in range(1, 9)], rel=1e-9), logged
    assert not [w for w in recwarn if "relative_step" in str(w.message)]


@pytest.mark.parametrize(
    "make_scheduler",
    [
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
        lambda opt: torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0),
    ],
    ids=["lambda-constant", "constant"],
)
def test_default_adafactor_under_a_constant_scheduler_reports_its_step_size(make_scheduler, recwarn) -> None:
    model = tiny_distilbert()
    opt = leanopt.Adafactor(model.parameters(), warmup_init=True)
    scheduler = make_scheduler(opt)
    x = torch.randint(1, 128, (4, 16))
    for t in range(1, 4):
        model(input_ids=x, labels=torch.zeros(4, dtype=torch.long)).loss.backward()
        opt.step()
        opt.zero_grad()
        # The step size transformers' AdafactorSchedule would report: min(1e-6 t, 1/sqrt(t)).
        assert opt.param_groups[0]["lr"] == pytest.approx(1e-6 * t, rel=1e-12)
        scheduler.step()
    assert not [w for w in recwarn if "relative_step" in str(w.message)]


# One per family: Trainer's loop calls step and zero_grad, which release turns into no-ops, and
# each param is stepped in backward by the same code as step(), whatever the rule.
@pytest.mark.parametrize("name", [case.name for case in representatives(REGISTERED)])
def test_released_gradients_under_trainer_equal_the_usual_run(name: str, tmp_path) -> None:
    # Gradient release through Trainer's own loop (optimizer.step/zero_grad are no-ops while
    # released); clipping off, as release needs (max_grad_norm=0).
    finals = []
    for release in (False, True):
        model = tiny_distilbert()
        opt = make_optimizer(name, model)
        handle = leanopt.release_gradients(model, opt) if release else None
        trainer = transformers.Trainer(
            model=model, args=training_args(tmp_path / str(release), max_grad_norm=0.0, max_steps=3),
            train_dataset=TokenDataset(), optimizers=(opt, None),
        )  # fmt: skip
        trainer.train()
        assert state_steps(opt) == {3}
        if handle is not None:
            handle.remove()
        finals.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*finals))


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_pure_bf16_model_with_rounding_trains_under_trainer(rounding: str, tmp_path) -> None:
    # bf16 weights and gradients, no fp32 master copy: the optimizer's rounding writes updates.
    model = tiny_distilbert().to(torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    opt = leanopt.AdamW(model.parameters(), lr=LR, rounding=rounding)
    trainer = transformers.Trainer(
        model=model, args=training_args(tmp_path), train_dataset=TokenDataset(), optimizers=(opt, None)
    )
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss)) and state_steps(opt) == {8}
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()) if a.numel() > 1)
    has_comp = {("kahan_comp" in st) for st in opt.state.values()}
    assert has_comp == {rounding == "kahan"}
