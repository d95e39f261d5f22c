"""leanopt under torch.distributed (gloo, CPU): DDP and FSDP2 against one process, DCP checkpoints.

One ``torchrun --nproc_per_node 2`` launch (``dist_scripts/parity.py``) runs every check for every
optimizer of the registry (``tests/registry.py``) and writes its measurements; the tests below
read them. A launch costs
more than all the checks together (three Python processes importing torch on 2 shared cores).
Loading the 2-rank checkpoint into one process, and ``leanopt convert`` of its DCP folder against
the state gathered whole, run here, in the pytest process.
"""

from __future__ import annotations

import pathlib
import sys
import warnings

import pytest
import torch
import two_ranks
from same_state import assert_same

import leanopt
from leanopt.integrations.distributed import measure_global
from leanopt.quant import QuantizedState
from registry import OPTIMIZERS

SCRIPTS = pathlib.Path(__file__).resolve().parent / "dist_scripts"
sys.path.insert(0, str(SCRIPTS))
import parity  # noqa: E402

LAUNCH_TIMEOUT_S = 300
# Against the same run on the whole batch in one process only the rounding of the gradient's
# sum differs (two half-batch means averaged vs one mean): ~1e-7 relative is measured for fp32
# states, ~3e-6 for 8-bit ones (a code here and there rounds the other way); 1e-3 is the bar.
LOSS_RTOL = 1e-3
# Against the one-process run that accumulates the same two half-batches (the ranks' exact
# gradient arithmetic) every optimizer is measured bit-identical under DDP and FSDP2, except
# Adafactor under FSDP2 (DTensor sums its column statistics shard by shard: ~1e-7 relative)
# and AdamW's fused CPU kernel, whose vectorized body and scalar tail round a few v elements
# differently when a tensor is cut in two (~1e-7 relative, never the params).
EXACT_ATOL = 1e-6
EXACT_STATE_RTOL = 1e-5


NAMES = list(parity.KWARGS)  # every optimizer of tests/registry.py
CASES = {case.name: case for case in OPTIMIZERS}
names = pytest.mark.parametrize("name", NAMES)


results = two_ranks.results_fixture("parity.py", NAMES)
case = two_ranks.case


def assert_matches_one_process(out: dict) -> None:
    full, accumulated = out["vs_full"], out["vs_accumulated"]
    assert len(full["losses"]) == parity.STEPS
    assert full["max_loss_rel_diff"] <= LOSS_RTOL, full["max_loss_rel_diff"]
    assert accumulated["same_state_keys"]
    assert accumulated["max_loss_rel_diff"] <= EXACT_ATOL, accumulated["max_loss_rel_diff"]
    assert accumulated["max_param_abs_diff"] <= EXACT_ATOL, accumulated["max_param_abs_diff"]
    assert accumulated["max_state_abs_diff"]["step"] == 0.0
    for key, rel in accumulated["max_state_rel_diff"].items():
        assert rel <= EXACT_STATE_RTOL, (key, rel)


@names
def test_ddp_matches_one_process(results: dict, name: str) -> None:
    out = case(results, name, "ddp")
    assert_matches_one_process(out)
    # DDP: every rank holds whole params and state, and does exactly one process's arithmetic.
    assert out["vs_accumulated"]["max_param_abs_diff"] == 0.0


@names
def test_fsdp2_matches_one_process(results: dict, name: str) -> None:
    assert_matches_one_process(case(results, name, "fsdp"))


@names
def test_fsdp2_state_is_sharded_like_its_param(results: dict, name: str) -> None:
    placements = case(results, name, "fsdp")["state_placements"]
    quantized = []
    for pname, entries in placements.items():
        assert entries.pop("step") == "Tensor"  # a plain CPU scalar, the same on every rank
        for key, where in entries.items():
            if where.endswith("QuantizedState"):  # this rank's shard, on the whole tensor's blocks
                quantized.append(pname)
                continue
            # Adafactor's column statistics of a matrix reduce over the sharded rows: replicated.
            expected = "(Replicate(),)" if key == "exp_avg_sq_col" else "(Shard(dim=0),)"
            assert where == expected, (pname, key, where)
    # The quantize-or-not decision is the one-process one (global shape), not the shard's.
    model = parity.make_model()
    opt = parity.build(name, model)
    parity.train(model, opt, range(1), 0, 1)
    expected = [n for n, p in model.named_parameters() for v in opt.state[p].values() if isinstance(v, QuantizedState)]
    assert sorted(quantized) == sorted(expected)


@names
def test_measure_global_adds_up_ranks_and_equals_the_estimate_unsharded(results: dict, name: str) -> None:
    fsdp = case(results, name, "fsdp")
    m = fsdp["measure"]
    assert fsdp["estimate"] == fsdp["reference_measure"]
    # A quantization block that straddles the two shards keeps a scale on both ranks.
    assert m["unsharded"] == fsdp["estimate"] + 4 * fsdp["shared_blocks"]
    assert m["total"] == sum(m["rank_bytes"])
    assert all(b < 0.6 * m["unsharded"] for b in m["rank_bytes"])  # each rank holds about half
    ddp = case(results, name, "ddp")["measure"]
    assert ddp["rank_bytes"] == [ddp["unsharded"]] * 2 and ddp["unsharded"] == fsdp["reference_measure"]


@names
def test_dcp_checkpoint_resumes_identically_on_two_ranks(results: dict, name: str) -> None:
    out = case(results, name, "dcp")
    assert out["identical_losses"] and out["identical_weights"] and out["identical_state"]
    assert out["declared"] == [name]  # every param group of the checkpoint names its optimizer


@names
def test_dcp_checkpoint_of_two_ranks_continues_in_one_process(results: dict, name: str) -> None:
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from leanopt.integrations.distributed import get_state_dict  # quantized states dense, as saved

    dcp_case = case(results, name, "dcp")
    model = parity.make_model(seed=1)
    opt = parity.build(name, model)
    model_sd, optim_sd = get_state_dict(model, opt)
    sd = {"model": model_sd, "optim": optim_sd}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        load(sd, checkpoint_id=dcp_case["checkpoint"])
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert {int(st["step"]) for st in opt.state.values()} == {parity.SAVE_AT}
    losses = parity.train(model, opt, range(parity.SAVE_AT, parity.STEPS), 0, 1)
    two_ranks = dcp_case["continued_losses"]
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, two_ranks))
    assert worst <= LOSS_RTOL, worst


@names
def test_a_dcp_folder_converts_as_its_gathered_state_does(results: dict, name: str, tmp_path, capsys) -> None:
    """``leanopt convert`` of the DCP folder the two ranks wrote: read, it is the state gathered
    whole on rank 0 (leanopt's ``get_state_dict``, ``full_state_dict=True``), and it converts to
    each optimizer of its rule (and torch's AdamW for the AdamW family) as that file does; through
    the command, into an optimizer in one process (the DCP keys are param names)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from leanopt.checkpoint import TORCH_ADAMW, convert_state_dict, family_members
    from leanopt.checkpoint_files import read_checkpoint
    from leanopt.cli import main

    dcp_case = case(results, name, "dcp")
    folder = pathlib.Path(dcp_case["checkpoint"])
    whole = torch.load(dcp_case["gathered"], weights_only=True)
    assert (folder / "__0_0.distcp").is_file() and (folder / "__1_0.distcp").is_file()  # both ranks wrote shards
    read = read_checkpoint(folder)
    assert_same(read, whole)
    targets = family_members(name) + ([TORCH_ADAMW] if CASES[name].cls.family == "adamw" else [])
    for to in targets:
        assert_same(convert_state_dict(read, to), convert_state_dict(whole, to), to)
    dst = tmp_path / "converted.pt"
    to = targets[-1]
    assert main(["convert", str(folder), str(dst), "--to", to]) == 0
    assert f"{folder} ({name}, " in capsys.readouterr().out
    model = parity.make_model()
    target = (torch.optim.AdamW(model.parameters()) if to == TORCH_ADAMW
              else CASES[to].cls(CASES[to].param_groups(model), **{**CASES[to].kwargs, "backend": "reference"}))  # fmt: skip
    set_state_dict(model, target, model_state_dict=model.state_dict(), optim_state_dict=torch.load(dst, weights_only=True))
    model(torch.randn(4, 16)).square().mean().backward()
    target.step()
    assert {int(st["step"]) for st in target.state.values()} == {parity.SAVE_AT + 1}


@names
def test_one_process_state_dict_loads_into_fsdp2_shards(results: dict, name: str) -> None:
    out = case(results, name, "load_one_process")
    assert out["sharded"] and out["same_state_keys"] and out["max_state_abs_diff"] == 0.0


def test_fsdp2_example_runs_and_resumes_to_the_same_weights(results: dict) -> None:
    (out,) = results["example"].values()
    assert "error" not in out, out["error"]
    assert out["same_final_weights"]


def test_measure_global_without_a_process_group_is_this_process() -> None:
    model = parity.make_model()
    opt = leanopt.AdamW(model.parameters())
    parity.train(model, opt, range(1), 0, 1)
    m = measure_global(opt)
    assert m.rank_bytes == [leanopt.measure(opt).bytes] and m.world_size == 1
    assert m.total_bytes == m.unsharded_bytes == leanopt.estimate(model, "adamw").bytes
