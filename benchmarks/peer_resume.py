"""Resuming a peer's run in leanopt: how far a converted checkpoint's continuation lands.

For each peer optimizer installed (bitsandbytes AdamW8bit, Lion8bit, AdEMAMix8bit; torchao
AdamW8bit, AdamW4bit), an MLP (32-256-256-8, 76,296 params: two matrices of 8,192 and 65,536
elements that every peer quantizes, a 2,048-element head that keeps fp32 states) is trained
``--steps`` steps with the peer on a fixed regression task, and its ``state_dict`` saved
through a file. From that one save the run goes on ``--more`` steps along each path:

* **the peer**: the same peer class, the saved state loaded (its own resume);
* **leanopt <member>**: the save converted (``leanopt.checkpoint.convert_state_dict``, as
  ``leanopt convert`` does) to every member of the family, loaded into that leanopt class;
* **fp32 reference**: the save converted to fp32 -- the peer's own values, dequantized -- and
  continued in fp32: ``torch.optim.AdamW`` (``to="torch-adamw"``) for the AdamW peers,
  leanopt's fp32 ``Lion`` / ``AdEMAMix`` (the peers' rules) for the others.

Printed per path: max and mean ``|Δp|`` over all params against the fp32 reference and
against the peer's own resume. All paths see the same batches; each computes its own
gradients, so a path's distance is what its state precision does to a real continuation.
torchao's update runs eagerly (``torch.compile`` made a pass-through: the same maths, no
per-param compile).

Run: ``python benchmarks/peer_resume.py [--steps 200] [--more 200]``
(docs/integrations.md shows the table). ``tests/test_peer_convert.py`` runs the same paths
at a few steps.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

import leanopt
from leanopt.checkpoint import convert_state_dict, family_members
from leanopt.optim import REGISTRY

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accuracy_vs_peers import eager_torch_compile  # noqa: E402

BATCH = 64
STEPS = 200
MORE = 200


@dataclass(frozen=True)
class Peer:
    """A peer optimizer: ``make(params)`` builds it; ``family`` is the rule it runs (leanopt's
    name); ``rule`` is what convert must be told (bitsandbytes' one-state files do not say)."""

    name: str
    make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
    family: str
    rule: str | None = None


PEER_NAMES = ("bitsandbytes AdamW8bit", "bitsandbytes Lion8bit", "bitsandbytes AdEMAMix8bit", "torchao AdamW8bit",
              "torchao AdamW4bit")  # fmt: skip


def peer(name: str) -> Peer | None:
    """The peer of the table called ``name`` (one of :data:`PEER_NAMES`), or None where its
    library does not import here."""
    library, cls = name.split(" ")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            module = importlib.import_module("bitsandbytes.optim" if library == "bitsandbytes" else "torchao.optim")
        except Exception:  # noqa: BLE001 - any import failure means "absent"
            return None
    cls_ = getattr(module, cls)
    kwargs = {"lr": 1e-4, "weight_decay": 0.1} if cls == "Lion8bit" else {"lr": 1e-3}

    def make(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        if library == "bitsandbytes":
            # Its per-param overrides are keyed by id(param) in a process-wide singleton (Trainer
            # registers fp32 states for embeddings there): a new param that gets a dead one's id
            # would inherit them.
            module.GlobalOptimManager.get_instance().initialize()
        return cls_(params, **kwargs)

    family = "lion" if cls == "Lion8bit" else "ademamix" if cls.startswith("AdEMAMix") else "adamw"
    return Peer(name, make, family, "lion" if family == "lion" else None)


def installed_peers() -> list[Peer]:
    """The peers of the table whose library imports here."""
    return [p for name in PEER_NAMES if (p := peer(name)) is not None]


def make_model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8)
    )


def batches(steps: int, start: int = 0, seed: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batch ``t`` of a fixed regression task (a random two-layer teacher), the same for every path."""
    g = torch.Generator().manual_seed(seed)
    teacher = (torch.randn(32, 64, generator=g), torch.randn(64, 8, generator=g))
    for t in range(start, start + steps):
        x = torch.randn(BATCH, 32, generator=torch.Generator().manual_seed(seed * 100_003 + t))
        yield x, torch.tanh(x @ teacher[0]) @ teacher[1] / 8


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    for x, y in batches(steps, start):
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def through_file(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)  # torchao's states are its tensor subclasses


def clone(model: torch.nn.Module) -> torch.nn.Module:
    copy = make_model()
    copy.load_state_dict(model.state_dict())
    return copy


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def distance(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    d = (a - b).abs()
    return d.max().item(), d.mean().item()


def reference_name(peer: Peer) -> str:
    return "fp32 torch.optim.AdamW" if peer.family == "adamw" else f"fp32 leanopt {REGISTRY[peer.family].__name__}"


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    with warnings.catch_warnings(), eager_torch_compile():
        warnings.simplefilter("ignore")
        yield


def resume_paths(peer: Peer, steps: int = STEPS, more: int = MORE, backend: str = "auto") -> dict[str, torch.Tensor]:
    """The flat params after ``more`` steps along each path from one save after ``steps`` (see
    the module): ``"peer"``, ``"fp32"`` (the reference) and each leanopt member's name, its
    optimizer on ``backend``. Every optimizer resumes with the hyper-parameters the save holds."""
    with quiet():
        model = make_model()
        opt = peer.make(list(model.parameters()))
        train(model, opt, steps)
        saved = through_file(opt.state_dict())

        def resume(make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], sd: dict) -> torch.Tensor:
            resumed = clone(model)
            optimizer = make(list(resumed.parameters()))
            optimizer.load_state_dict(sd)
            train(resumed, optimizer, more, start=steps)
            return flat(resumed)

        out = {"peer": resume(peer.make, saved)}
        if peer.family == "adamw":
            out["fp32"] = resume(lambda ps: torch.optim.AdamW(ps, foreach=False), convert_state_dict(saved, "torch-adamw"))
        else:
            out["fp32"] = resume(lambda ps: REGISTRY[peer.family](ps, backend="reference"),
                                 convert_state_dict(saved, peer.family, rule=peer.rule))  # fmt: skip
        for member in family_members(peer.family):
            out[member] = resume(lambda ps, m=member: REGISTRY[m](ps, backend=backend), convert_state_dict(saved, member, rule=peer.rule))
    return out


def table(steps: int, more: int) -> list[str]:
    lines = [
        f"{steps} steps with the peer, saved; {more} more along each path. |Δp| over 76,296 params.",
        "",
        "| checkpoint of | continued with | max / mean vs fp32 | max / mean vs the peer's own resume |",
        "|---|---|---:|---:|",
    ]
    for peer in installed_peers():
        paths = resume_paths(peer, steps, more)
        for name, params in paths.items():
            if name == "fp32":
                continue
            label = f"{peer.name} (its own resume)" if name == "peer" else f"leanopt {REGISTRY[name].__name__}"
            vs_ref = "{:.2e} / {:.2e}".format(*distance(params, paths["fp32"]))
            vs_peer = "—" if name == "peer" else "{:.2e} / {:.2e}".format(*distance(params, paths["peer"]))
            lines.append(f"| {peer.name} | {label} | {vs_ref} | {vs_peer} |")
        lines.append(f"| {peer.name} | {reference_name(peer)} (the reference) | 0 | "
                     "{:.2e} / {:.2e} |".format(*distance(paths["fp32"], paths["peer"])))  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS, help="steps with the peer before the save")
    parser.add_argument("--more", type=int, default=MORE, help="steps along each path after it")
    args = parser.parse_args(argv)
    print(f"leanopt {leanopt.__version__}, torch {torch.__version__}")
    print("\n".join(table(args.steps, args.more)))


if __name__ == "__main__":
    main()
