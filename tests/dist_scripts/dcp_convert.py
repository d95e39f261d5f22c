"""torchrun worker: FSDP2 runs that save DCP checkpoints for ``leanopt convert`` to read.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 tests/dist_scripts/dcp_convert.py OUT_DIR NAME [NAME...]

For each optimizer NAME (``tests/registry.py``): parity.py's model sharded with ``fully_shard``
(a 33-row matrix whose quantization block straddles the two shards), ``STEPS`` steps, then

* ``OUT_DIR/dcp_NAME``: ``torch.distributed.checkpoint.save({"model": ..., "optim": ...})`` of
  leanopt's ``get_state_dict`` (each rank writes its shards);
* ``OUT_DIR/full_NAME.pt`` (rank 0): the same optimizer state gathered whole
  (``full_state_dict=True``), which converting the DCP folder must reproduce exactly.
"""

from __future__ import annotations

import datetime
import os
import sys

import parity
import teardown
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions

from leanopt.integrations.distributed import get_state_dict

STEPS = 3


def main() -> None:
    out_dir, names = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=int(os.environ.get("LEANOPT_DIST_TIMEOUT", "120"))))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    for name in names:
        model = parity.shard(parity.make_model())
        opt = parity.build(name, model)
        parity.train(model, opt, range(STEPS), rank, world)
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(out_dir, f"dcp_{name}"))
        _, whole = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(whole, os.path.join(out_dir, f"full_{name}.pt"))
        dist.barrier()
    teardown.finish()


if __name__ == "__main__":
    main()
