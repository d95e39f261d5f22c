"""DistilBERT sequence classification through Hugging Face Trainer, with each leanopt optimizer.

The lesson's scenario: DistilBERT (cased, 2 labels: 65,783,042 params) trained by ``Trainer``,
first asking how much memory the optimizer state will take, then measuring it.

    python examples/trainer_distilbert.py                       # from config, all optimizers
    python examples/trainer_distilbert.py --optimizer adamw8bit --steps 50
    python examples/trainer_distilbert.py --pretrained ~/models/distilbert-base-cased --csv train.csv
    python examples/trainer_distilbert.py --tiny                # an 82k-param model: seconds

Without ``--pretrained`` the model is built from ``DistilBertConfig(vocab_size=28996)`` (random
weights, nothing downloaded) and trained on synthetic token sequences whose label is
learnable; ``--pretrained DIR`` loads real weights and tokenizer from a local directory (and
``--csv`` a file with ``text,label`` columns; otherwise the synthetic data again).
"""

from __future__ import annotations

import argparse
import tempfile

import numpy as np
import torch
import transformers

import leanopt
from leanopt.integrations.transformers import OptimizerStateCallback, optimizer_cls_and_kwargs
from leanopt.memory import available_optimizers

LEANOPT_NAMES = tuple(leanopt.optim.REGISTRY)  # every registered optimizer


class SyntheticTokens(torch.utils.data.Dataset):
    """Random token ids; label 1 iff the first token is in the upper half of the vocabulary."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(1, vocab, (n, seq_len), generator=g)
        self.labels = (self.input_ids[:, 0] >= vocab // 2).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "labels": self.labels[i]}


class TextDataset(torch.utils.data.Dataset):
    def __init__(self, texts: list[str], labels: list[int], tokenizer, seq_len: int) -> None:
        self.enc = tokenizer(texts, truncation=True, max_length=seq_len, padding="max_length", return_tensors="pt")
        self.labels = torch.tensor(labels)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.enc["input_ids"][i], "attention_mask": self.enc["attention_mask"][i], "labels": self.labels[i]}


def build_model(args) -> transformers.PreTrainedModel:
    if args.pretrained:
        return transformers.AutoModelForSequenceClassification.from_pretrained(args.pretrained, num_labels=2)
    if args.tiny:
        config = transformers.DistilBertConfig(
            vocab_size=128, dim=64, n_layers=2, n_heads=2, hidden_dim=128, max_position_embeddings=32, num_labels=2
        )
    else:
        config = transformers.DistilBertConfig(vocab_size=28996, num_labels=2)  # distilbert-base-cased's shape
    torch.manual_seed(args.seed)
    return transformers.DistilBertForSequenceClassification(config)


def build_data(args, model) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset]:
    if args.pretrained and args.csv:
        import csv

        tokenizer = transformers.AutoTokenizer.from_pretrained(args.pretrained)
        with open(args.csv, newline="") as f:
            rows = list(csv.DictReader(f))
        texts, labels = [r["text"] for r in rows], [int(r["label"]) for r in rows]
        cut = max(1, len(rows) * 4 // 5)
        return (
            TextDataset(texts[:cut], labels[:cut], tokenizer, args.seq_len),
            TextDataset(texts[cut:], labels[cut:], tokenizer, args.seq_len),
        )
    vocab = model.config.vocab_size
    return SyntheticTokens(512, args.seq_len, vocab, seed=0), SyntheticTokens(128, args.seq_len, vocab, seed=1)


def compute_metrics(eval_pred) -> dict[str, float]:
    logits, labels = eval_pred
    pred = np.argmax(logits, axis=-1)
    tp = float(((pred == 1) & (labels == 1)).sum())
    precision = tp / max(float((pred == 1).sum()), 1.0)
    recall = tp / max(float((labels == 1).sum()), 1.0)
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"accuracy": float((pred == labels).mean()), "f1": f1}


def run(name: str, args, output_dir: str) -> dict[str, float]:
    model = build_model(args)
    train_dataset, eval_dataset = build_data(args, model)
    training_args = transformers.TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        learning_rate=args.lr,
        weight_decay=0.01,
        max_steps=args.steps,
        eval_strategy="no",
        save_strategy="no",
        logging_steps=max(1, args.steps // 4),
        use_cpu=not args.gpu,
        report_to=[],
        disable_tqdm=True,
        seed=args.seed,
    )
    callback = OptimizerStateCallback()
    trainer = transformers.Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        compute_metrics=compute_metrics,
        optimizer_cls_and_kwargs=optimizer_cls_and_kwargs(name, training_args),
        callbacks=[callback],
    )
    trainer.train()
    metrics = trainer.evaluate()
    predicted = leanopt.estimate(model, name, **optimizer_cls_and_kwargs(name, training_args)[1])
    measured = callback.measurement
    print(
        f"{name:10s} state: estimated {predicted.bytes:>13,} B ({predicted.megabytes:6.1f} MB), "
        f"measured {measured.bytes:>13,} B ({measured.megabytes:6.1f} MB); "
        f"eval accuracy {metrics['eval_accuracy']:.3f}, f1 {metrics['eval_f1']:.3f}"
    )
    return {"state_bytes": measured.bytes, "estimate_bytes": predicted.bytes, **metrics}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--optimizer", default="all", help="all, or one of: " + ", ".join(LEANOPT_NAMES))
    parser.add_argument("--pretrained", help="a local directory with DistilBERT weights and tokenizer")
    parser.add_argument("--csv", help="with --pretrained: a CSV file with text,label columns")
    parser.add_argument("--tiny", action="store_true", help="an 82k-param DistilBERT (for a quick check)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpu", action="store_true", help="train on the accelerator instead of the CPU")
    args = parser.parse_args(argv)

    available = [n for n in LEANOPT_NAMES if n in available_optimizers()]
    names = available if args.optimizer == "all" else [args.optimizer]
    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"Number of model parameters: {n_params:,}")
    for name in names:  # before any training: from the layouts, nothing allocated
        print(f"  {leanopt.estimate(model, name, **optimizer_cls_and_kwargs(name, lr=args.lr)[1])}")
    del model
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            results[name] = run(name, args, tmp)
    return results


if __name__ == "__main__":
    main()
