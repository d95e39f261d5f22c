"""torchrun worker: ``leanopt.release_gradients`` and DDP given the unwrapped model.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 tests/dist_scripts/release_ddp.py OUT_DIR

One launch runs every case (a launch costs more than the cases), each for two steps on this
rank's own batch:

* ``ddp``: the usual loop under DDP, the control: the replicas agree.
* ``release_then_wrap``: ``release_gradients(model, opt)``, then ``DDP(model)``.
* ``release_ddp_module``: ``DDP(model)``, then ``release_gradients(ddp.module, opt)``.
  Both must be refused (``ValueError``) before any param is stepped: a released step would use
  this rank's unreduced gradient and the replicas would diverge.
* ``own_model_per_rank``: no DDP; each rank trains its own model under release while a 2-rank
  process group is initialized: allowed, and the same as the usual loop on that rank.

Each rank writes ``OUT_DIR/rank{R}.json``: ``{case: {"error": "Type: message" or None, "moved":
max |param - initial|, "stepped": whether any state exists, ...}}``. The cases are symmetric on
both ranks, so a refusal on one is a refusal on the other and no collective is left waiting.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import teardown
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import leanopt

STEPS = 2


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial replica on every rank, as DDP expects
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * rank + step))


def train(forward, opt) -> None:
    for step in range(STEPS):
        opt.zero_grad()
        forward(batch(step, dist.get_rank())).square().mean().backward()
        opt.step()


def ranks_agree(model: torch.nn.Module) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    return all(torch.equal(everyone[0], other) for other in everyone[1:])


def run(case: str) -> dict:
    model = make_model()
    initial = [p.detach().clone() for p in model.parameters()]
    opt = leanopt.AdamW(model.parameters(), lr=1e-2)
    out: dict = {"error": None}
    handle = None
    try:
        if case == "ddp":
            train(DistributedDataParallel(model), opt)
        elif case == "release_then_wrap":
            handle = leanopt.release_gradients(model, opt)
            train(DistributedDataParallel(model), opt)
        elif case == "release_ddp_module":
            ddp = DistributedDataParallel(model)
            handle = leanopt.release_gradients(ddp.module, opt)
            train(ddp, opt)
        elif case == "own_model_per_rank":
            handle = leanopt.release_gradients(model, opt)
            train(model, opt)
            usual = make_model()
            usual_opt = leanopt.AdamW(usual.parameters(), lr=1e-2)
            train(usual, usual_opt)
            out["same_as_usual"] = all(torch.equal(a, b) for a, b in zip(model.parameters(), usual.parameters()))
    except Exception as err:  # noqa: BLE001  (recorded; the next case runs: both ranks raise alike)
        out["error"] = f"{type(err).__name__}: {err}"
    finally:
        if handle is not None:
            handle.remove()
    out["moved"] = max(float((p.detach() - p0).abs().max()) for p, p0 in zip(model.parameters(), initial))
    out["stepped"] = bool(opt.state)
    out["ranks_agree"] = ranks_agree(model)
    return out


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=int(os.environ.get("LEANOPT_DIST_TIMEOUT", "120"))))
    torch.set_num_threads(1)
    results = {case: run(case) for case in ("ddp", "release_then_wrap", "release_ddp_module", "own_model_per_rank")}
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f, indent=1)
    teardown.finish()


if __name__ == "__main__":
    main()
