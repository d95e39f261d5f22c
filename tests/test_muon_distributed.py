"""Muon under torch.distributed (gloo, CPU, 2 ranks): each matrix orthogonalized whole, exactly once.

One ``torchrun --nproc_per_node 2`` launch (``dist_scripts/muon_parity.py``) runs DDP and FSDP2
against one process for Muon and Muon8bit, records ``optimizer.orthogonalized`` on both ranks
every step, saves a DCP checkpoint, and runs the refusals; the tests below read its results.
The one-process load of the 2-rank checkpoint runs here, in the pytest process.
"""

from __future__ import annotations

import pathlib
import sys
import warnings

import pytest
import torch
import two_ranks

import leanopt
from leanopt.memory import resolve_optimizer
from leanopt.optim.muon_dist import owners

SCRIPTS = pathlib.Path(__file__).resolve().parent / "dist_scripts"
sys.path.insert(0, str(SCRIPTS))
import muon_parity  # noqa: E402

LAUNCH_TIMEOUT_S = 300
# FSDP2 on the default backend, against one process: the biases' AdamW group goes through torch's
# fused CPU kernel, which rounds a few v elements differently where FSDP2 cuts a bias
# (muon_parity.EXACT); measured at most 4.7e-10 on a param (one ulp of a bias, 2026-12-05, AVX-512)
# or 0. The runs on the reference backend are held to the bit.
DEFAULT_BACKEND_ATOL = 1e-6
DEFAULT_BACKEND_LOSS_RTOL = 1e-6
# Muon and one block-quantized sibling (its momentum runs on each shard with the shard's offset).
NAMES = ["muon", "muon8bit"]
names = pytest.mark.parametrize("name", NAMES)


results = two_ranks.results_fixture("muon_parity.py", NAMES)
case = two_ranks.case


def assert_each_matrix_once_per_step(out: dict) -> None:
    """Every step: the ranks together orthogonalized every Muon-group param exactly once (and
    each rank some of them), and each rank reports the same total."""
    expected = out["muon_params"]
    n_params = len(expected)
    n_elements = sum(c[1] for c in expected.values())
    n_matrices = sum(c[2] for c in expected.values())
    assert n_params == 6 and n_matrices == 8  # conv, tall, square, wide, 3 experts, one row
    per_rank = out["counts"]
    assert len(per_rank) == 2 and all(len(steps) == muon_parity.STEPS for steps in per_rank)
    for step in range(muon_parity.STEPS):
        here = [per_rank[r][step] for r in range(2)]
        assert sum(c["params"] for c in here) == n_params, (step, here)
        assert sum(c["elements"] for c in here) == n_elements, (step, here)
        assert sum(c["matrices"] for c in here) == n_matrices, (step, here)
        assert all(c["params"] > 0 for c in here), here  # the work is spread over both ranks
        for c in here:
            assert (c["total_params"], c["total_elements"], c["total_matrices"], c["world_size"]) == (
                n_params, n_elements, n_matrices, 2)  # fmt: skip
    # One process orthogonalizes every one of them itself, every step.
    for c in out["ref_counts"]:
        assert (c["params"], c["total_params"], c["matrices"], c["world_size"]) == (n_params, n_params, n_matrices, 1)


def assert_bit_identical(out: dict) -> None:
    assert out["identical_params"], out["max_param_abs_diff"]
    assert out["losses"] == out["ref_losses"]


def assert_within_default_backend_bound(out: dict) -> None:
    assert max(out["max_param_abs_diff"].values()) <= DEFAULT_BACKEND_ATOL, out["max_param_abs_diff"]
    assert out["max_loss_rel_diff"] <= DEFAULT_BACKEND_LOSS_RTOL, out["max_loss_rel_diff"]


@names
def test_ddp_is_bit_identical_to_one_process_and_orthogonalizes_each_matrix_once(results: dict, name: str) -> None:
    out = case(results, name, "ddp")
    assert_bit_identical(out)
    assert_each_matrix_once_per_step(out)


@names
def test_fsdp2_is_bit_identical_to_one_process_and_orthogonalizes_each_matrix_once(results: dict, name: str) -> None:
    out = case(results, name, "fsdp_exact")  # the reference backend
    assert_bit_identical(out)
    assert_each_matrix_once_per_step(out)
    # The default backend: within the bound of torch's fused CPU AdamW on the cut biases.
    default = case(results, name, "fsdp")
    assert_within_default_backend_bound(default)
    assert_each_matrix_once_per_step(default)
    # The momentum stays sharded like its param (quantized: this rank's shard of the codes).
    for placements in (out["momentum_placements"], default["momentum_placements"]):
        assert len(placements) == 6
        assert all(v in ("(Shard(dim=0),)", "ShardQuantizedState", "QuantizedState") for v in placements.values()), placements


def test_exchanges_in_buckets_are_bit_identical_too(results: dict) -> None:
    out = case(results, "muon", "fsdp_buckets")
    assert out["exchanges"] == 2 * muon_parity.STEPS  # the queue cut once per step, then flushed at its end
    assert_bit_identical(out)
    assert_each_matrix_once_per_step(out)


@names
def test_dcp_checkpoint_of_two_ranks_continues_in_one_process_identically(results: dict, name: str) -> None:
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from leanopt.integrations.distributed import get_state_dict

    checkpoint = case(results, name, "fsdp_exact")["checkpoint"]
    model = muon_parity.make_model(seed=1)
    opt = resolve_optimizer(name)(leanopt.muon_groups(model), **muon_parity.KWARGS, **muon_parity.EXACT)
    model_sd, optim_sd = get_state_dict(model, opt)
    sd = {"model": model_sd, "optim": optim_sd}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        load(sd, checkpoint_id=checkpoint)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert {int(st["step"]) for st in opt.state.values()} == {muon_parity.SAVE_AT}
    muon_parity.train(model, opt, range(muon_parity.SAVE_AT, muon_parity.STEPS), 0, 1, micro_batches=2)
    # The one-process run that never stopped: the same bits.
    never_stopped, _, _ = muon_parity.one_process(name, 2, **muon_parity.EXACT)
    reference = dict(never_stopped.named_parameters())
    for n, p in model.named_parameters():
        assert torch.equal(p, reference[n]), (n, float((p - reference[n]).abs().max()))


def test_refusals_name_the_param_and_change_nothing(results: dict) -> None:
    out = case(results, "refusals", "all")
    # A placement Muon cannot gather from: refused when the optimizer is built.
    assert out["shard1"].startswith("ValueError: Muon: param 0 of group 0 is a DTensor placed as Shard(dim=1)"), out["shard1"]
    # A process group other than the ranks the DTensor is sharded over (rank 1 is told it is not in it).
    assert out["mismatch"] == ("ValueError: Muon: param 0 of group 0 is sharded over ranks [0, 1], process_group holds ranks "
                               "[0]: Muon exchanges a step's matrices over one process group"), out["mismatch"]  # fmt: skip
    # One model per rank, no DDP: the default process group refuses before stepping anything ...
    assert "differs between rank 0 and rank 1" in out["own_model_default"], out["own_model_default"]
    assert "process_group='local'" in out["own_model_default"]
    assert out["own_model_default_moved"] is False
    # ... and process_group="local" orthogonalizes every matrix on its own rank.
    assert out["own_model_local"] is None and out["own_model_local_moved"] is True
    local = out["own_model_local_counts"]
    assert local["params"] == local["total_params"] == 6 and local["world_size"] == 1
    # Ranks about to step different matrices (one gradient missing on rank 1).
    assert "the ranks would step different Muon matrices: matrix 1 is param 1 of group 0 [48, 48] whole on rank 0 and param 2 of group 0 [12, 48] whole on rank 1" in out["different_params"], out["different_params"]  # fmt: skip
    # Rounding of bf16 params is applied in the same call as the update: not built here.
    assert "rounding='stochastic' of a torch.bfloat16 param is not built for Muon's distributed step" in out["rounded"], out["rounded"]  # fmt: skip
    assert out["rounded_unchanged"] is True
    assert "offload='cpu' is not built for Muon's distributed step" in out["offloaded"], out["offloaded"]
    assert out["offloaded_unchanged"] is True


def test_owners_are_balanced_by_size_and_deterministic() -> None:
    costs = [100, 90, 10, 10, 10, 5, 1]
    owner = owners(costs, 2)
    assert owner == owners(list(costs), 2)
    load = [sum(c for c, r in zip(costs, owner) if r == rank) for rank in range(2)]
    assert load == [111, 115] or load == [115, 111], load  # largest first, each to the lighter rank
    assert owners(costs, 1) == [0] * len(costs)
    assert sorted(set(owners([1] * 8, 4))) == [0, 1, 2, 3]
    # Ties between ranks go to the exchange's first rank: one-matrix exchanges take turns.
    assert [owners([7], 2, first=k % 2) for k in range(4)] == [[0], [1], [0], [1]]
    assert owners([5, 5, 5], 3, first=2) == [2, 0, 1]


def test_one_process_counts_every_matrix_it_orthogonalized() -> None:
    model = muon_parity.make_model()
    opt = leanopt.Muon(model, **muon_parity.KWARGS)
    assert opt.orthogonalized.total_params == 0
    muon_parity.train(model, opt, range(1), 0, 1)
    o = opt.orthogonalized
    assert (o.params, o.total_params, o.matrices, o.world_size) == (6, 6, 8, 1)
    assert o.elements == sum(p.numel() for g in opt.param_groups if g["use_muon"] for p in g["params"])
    opt.zero_grad()
    opt.step()  # no gradients: nothing orthogonalized this step
    assert opt.orthogonalized.total_params == 0


def test_process_group_is_checked() -> None:
    with pytest.raises(ValueError, match="Invalid process_group: 'world'"):
        leanopt.Muon([torch.nn.Parameter(torch.randn(4, 4))], process_group="world")


def test_one_process_count_under_gradient_release() -> None:
    # Released gradients are orthogonalized inside backward, one param at a time: they count
    # towards the step they belong to, not a step of their own.
    model = muon_parity.make_model()
    opt = leanopt.Muon(model, **muon_parity.KWARGS)
    with leanopt.release_gradients(model, opt):
        for step in range(2):
            muon_parity.train(model, opt, range(step, step + 1), 0, 1)
            o = opt.orthogonalized
            assert (o.params, o.total_params, o.matrices) == (6, 6, 8), o
