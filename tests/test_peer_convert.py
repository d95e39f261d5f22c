"""Checkpoints that move between libraries: peers' files in, torch's AdamW out.

* bitsandbytes' ``AdamW8bit``/``Lion8bit``/``AdEMAMix8bit`` and torchao's ``AdamW8bit``/``AdamW4bit``
  files are read as the peer's own values and convert to every member of their family, which
  continues the run (``benchmarks/peer_resume.py``'s paths, at a few steps); a Trainer
  ``optimizer.pt`` of ``optim="adamw_bnb_8bit"`` converts and Trainer resumes from it.
* ``--to torch-adamw`` writes what ``torch.optim.AdamW`` saves, from every AdamW-family state of
  the registry, bf16 rounding included, and says what it left out.
* A small DCP folder converts (one written under FSDP2 on 2 ranks: tests/test_distributed.py, in
  its launch).
* Hostile or malformed peer files are refused in under a second, in one line naming the entry,
  with nothing written and none of their code run.

Every peer file is made here, with the installed peers (bitsandbytes' CPU path; torchao's update
run eagerly): nothing is stored.
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
from same_state import assert_same

import leanopt
from leanopt.checkpoint import (
    TORCH_ADAMW,
    convert_checkpoint,
    convert_state_dict,
    family_members,
    from_peer,
    state_dict_layout,
)
from leanopt.checkpoint_files import read_checkpoint
from leanopt.cli import main
from leanopt.optim import REGISTRY
from leanopt.optim.identity import recognize_states
from leanopt.optim.lowbit import LowBit
import repo_modules
from registry import OPTIMIZERS

bench = repo_modules.benchmark("peer_resume")
CASES = {case.name: case for case in OPTIMIZERS}
ADAMW_FAMILY = [c for c in OPTIMIZERS if c.cls.family == "adamw"]
MARKER = "CODE_RAN"


def the_peer(name: str):
    found = bench.peer(name)
    if found is None:
        pytest.skip(f"{name.split()[0]} is not installed")
    return found


peers = pytest.mark.parametrize("name", bench.PEER_NAMES)


def trained_peer(name: str, steps: int = 3):
    """The peer ``name``, the model it trained ``steps`` steps, its state_dict through a file."""
    peer = the_peer(name)
    with bench.quiet():
        model = bench.make_model()
        opt = peer.make(list(model.parameters()))
        bench.train(model, opt, steps)
    return peer, model, opt, bench.through_file(opt.state_dict())


def peer_values(opt: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    """Each param's states as the peer itself decodes them, under leanopt's keys."""
    out = []
    for p in (p for g in opt.param_groups for p in g["params"]):
        st = opt.state[p]
        if "state1" not in st:  # torchao: Adam's keys, its subclasses decode themselves
            out.append({k: v.dequantize() if hasattr(v, "dequantize") else v for k, v in st.items() if k != "step"})
            continue

        def decode(n: int, row: int | None = None) -> torch.Tensor:
            codes, absmax = st[f"state{n}"], st.get(f"absmax{n}")
            if row is not None:
                codes, absmax = codes[row], None if absmax is None else absmax[row]
            if codes.dtype != torch.uint8:
                return codes
            import bitsandbytes.functional as F  # noqa: N812 - bitsandbytes' own name

            return F.dequantize_blockwise(codes, absmax=absmax, code=st[f"qmap{n}"], blocksize=256)

        if st["state1"].dim() == p.dim() + 1:  # AdEMAMix: fast and slow EMAs stacked
            out.append({"exp_avg_fast": decode(1, 0), "exp_avg_slow": decode(1, 1), "exp_avg_sq": decode(2)})
        else:
            out.append({"exp_avg": decode(1), **({"exp_avg_sq": decode(2)} if "state2" in st else {})})
    return out


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return bench.distance(a, b)[0]


# ---- the peers' files, read and continued ---------------------------------------------------------
@peers
def test_a_peer_file_reads_as_the_peers_own_values(name: str) -> None:
    peer, _, opt, sd = trained_peer(name)
    seen = recognize_states(sd)
    assert seen.peer == name.split()[0] and seen.family == (None if peer.rule else peer.family)
    member = state_dict_layout(sd, rule=peer.rule)
    assert REGISTRY[member].family == peer.family and getattr(REGISTRY[member], "state_bits", 32) == seen.bits
    lean = from_peer(sd, rule=peer.rule)
    assert {g["optimizer"] for g in lean["param_groups"]} == {member}
    assert all(not isinstance(g["lr"], torch.Tensor) for g in lean["param_groups"])  # torchao's tensor lr
    own = peer_values(opt)
    assert len(own) == len(lean["state"]) == 6
    for pid, values in enumerate(own):
        st = lean["state"][pid]
        assert sorted(st) == sorted([*values, "step"]) and st["step"].dtype == torch.float32 and int(st["step"]) == 3
        for key, expected in values.items():
            assert st[key].dtype == torch.float32 and torch.equal(st[key], expected.float()), (pid, key)


def test_the_peers_other_forms_read_as_their_own_values() -> None:
    """bitsandbytes' 32-bit optimizers (fp32 states in the same nested dict) and torchao's fp8
    AdamW (float8 codes times a scale per block) convert as the fp32 and 8-bit members."""
    makers = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import bitsandbytes as bnb

            makers += [(lambda ps: bnb.optim.AdamW(ps, optim_bits=32), "adamw"), (lambda ps: bnb.optim.AdEMAMix(ps), "ademamix")]
        except ImportError:
            pass
        try:
            import torchao.optim as ao

            makers.append((lambda ps: ao.AdamWFp8(ps), "adamw8bit"))
        except ImportError:
            pass
    if not makers:
        pytest.skip("neither bitsandbytes nor torchao is installed")
    for make, member in makers:
        with bench.quiet():
            model = bench.make_model()
            opt = make(list(model.parameters()))
            bench.train(model, opt, 2)
        sd = bench.through_file(opt.state_dict())
        assert state_dict_layout(sd) == member
        lean = from_peer(sd)
        for pid, values in enumerate(peer_values(opt)):
            for key, expected in values.items():
                assert torch.equal(lean["state"][pid][key], expected.float()), (member, pid, key)
        target = REGISTRY[member](model.parameters(), backend="reference")
        target.load_state_dict(convert_state_dict(sd, member))
        bench.train(model, target, 1, start=2)


@peers
def test_a_converted_peer_checkpoint_continues_in_every_member(name: str) -> None:
    peer = the_peer(name)
    paths = bench.resume_paths(peer, steps=5, more=5, backend="reference")
    reference = paths.pop("fp32")  # the peer's own values continued in fp32 (torch's AdamW for AdamW)
    assert set(paths) == {"peer", *family_members(peer.family)}
    for member, params in paths.items():
        assert torch.isfinite(params).all(), member
        far, mean = bench.distance(params, reference)
        if member == "peer":
            assert 0 < far < 1e-2, far  # the peer's own resume rounds its states: not the fp32 path
        elif not issubclass(REGISTRY[member], LowBit):
            assert far <= 1e-7, (member, far)  # the same rule on the same values (torch's AdamW: to rounding)
        else:
            # Five steps of lr 1e-3 (Lion: 1e-4) after requantizing: a few elements up to ~2 lr
            # away (the second-moment floor, on states the peer's rounding left with |m| / sqrt(v)
            # above Adam's bound), the bulk far less; measured max 2.2e-3, means 2.7e-5 (8-bit)
            # and 3.4e-4 (4-bit).
            assert far <= 3e-3 and mean <= {8: 6e-5, 4: 6e-4}[REGISTRY[member].state_bits], (member, far, mean)


@peers
def test_a_peer_file_loads_straight_into_every_member_of_its_family(name: str, tmp_path, capsys) -> None:
    """``load_state_dict`` takes the peer's own file: the same states, and the same run, as the
    file converted first. A bitsandbytes one-state file does not say it is Lion's: the refusal
    names the convert command, which then makes a file that loads."""
    peer, model, _, sd = trained_peer(name)
    for member in family_members(peer.family):
        direct_model, via_file_model = bench.clone(model), bench.clone(model)
        direct = REGISTRY[member](direct_model.parameters(), backend="reference")
        if peer.rule is not None:
            with pytest.raises(ValueError) as err:
                direct.load_state_dict(sd)
            command = f"leanopt convert FILE NEW_FILE --to {member} --rule {peer.rule}"
            assert f"`{command}`" in str(err.value) and "\n" not in str(err.value), str(err.value)
            src, new = tmp_path / "peer.pt", tmp_path / f"{member}.pt"
            torch.save(sd, src)
            args = command.split()[1:]
            args[1:3] = [str(src), str(new)]
            assert main(args) == 0
            sd_member = torch.load(new, weights_only=True)
        else:
            sd_member = sd
        direct.load_state_dict(sd_member)
        via_file = REGISTRY[member](via_file_model.parameters(), backend="reference")
        via_file.load_state_dict(convert_state_dict(sd, member, rule=peer.rule))
        with bench.quiet():
            bench.train(direct_model, direct, 2, start=3)
            bench.train(via_file_model, via_file, 2, start=3)
        assert torch.equal(bench.flat(direct_model), bench.flat(via_file_model)), member
    capsys.readouterr()


def test_a_bitsandbytes_adamw8bit_file_loaded_straight_continues_as_the_peer_does() -> None:
    """bitsandbytes' AdamW8bit trained 5 steps, its state_dict saved with torch.save and read
    with weights_only=True, loaded into leanopt.AdamW8bit and continued 5 steps: within the
    bounds the converted files are held to (against the fp32 continuation of the peer's own
    values, and, as the peer's own resume is, against it)."""
    peer = the_peer("bitsandbytes AdamW8bit")
    with bench.quiet():
        model = bench.make_model()
        opt = peer.make(list(model.parameters()))
        bench.train(model, opt, 5)
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        buf.seek(0)
        saved = torch.load(buf, weights_only=True)
        assert recognize_states(saved).layout == "bitsandbytes 8-bit (Adam-family, 2 states)"

        def resume(make, sd) -> torch.Tensor:
            resumed = bench.clone(model)
            optimizer = make(list(resumed.parameters()))
            optimizer.load_state_dict(sd)
            bench.train(resumed, optimizer, 5, start=5)
            return bench.flat(resumed)

        direct = resume(lambda ps: leanopt.AdamW8bit(ps, backend="reference"), saved)
        own = resume(peer.make, saved)
        reference = resume(lambda ps: torch.optim.AdamW(ps, foreach=False), convert_state_dict(saved, TORCH_ADAMW))
    far, mean = bench.distance(direct, reference)
    assert far <= 3e-3 and mean <= 6e-5, (far, mean)  # measured 1.6e-4 / 2.7e-5
    assert 0 < bench.distance(direct, own)[0] < 1e-2  # measured 3.4e-4


def test_converting_a_peer_file_leaves_it_as_it_was() -> None:
    # bitsandbytes keeps fp32 states for params under 4096 elements; the converted state must not
    # share them: torch's AdamW steps the tensors it loads in place.
    _, model, _, sd = trained_peer("bitsandbytes AdamW8bit")
    before = copy.deepcopy(sd)
    for to in ("adamw", TORCH_ADAMW):
        target = torch.optim.AdamW(model.parameters()) if to == TORCH_ADAMW else leanopt.AdamW(model.parameters())
        target.load_state_dict(convert_state_dict(sd, to))
        bench.train(model, target, 2, start=3)
    head = 5  # the 8-element bias: fp32 states in the file
    nested = sd["state"][head]["__bnb_optimizer_quant_state__"]
    assert nested["state1"].dtype == torch.float32
    for key, value in nested.items():
        assert torch.equal(value, before["state"][head]["__bnb_optimizer_quant_state__"][key]), key


def test_trainer_adamw_bnb_8bit_checkpoint_converts_and_trainer_resumes(tmp_path, capsys) -> None:
    the_peer("bitsandbytes AdamW8bit")
    trainer_tests = pytest.importorskip("test_trainer")  # transformers + accelerate; its tiny model and data
    transformers = trainer_tests.transformers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = trainer_tests.training_args(tmp_path, optim="adamw_bnb_8bit", max_steps=3, save_strategy="steps", save_steps=3)
        trainer = transformers.Trainer(model=trainer_tests.tiny_distilbert(), args=args, train_dataset=trainer_tests.TokenDataset())
        trainer.train()
    checkpoint = tmp_path / "checkpoint-3"
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert len(saved["param_groups"]) == 2 and {g["weight_decay"] for g in saved["param_groups"]} == {0.0, 0.01}
    assert recognize_states(saved).layout == "bitsandbytes 8-bit (Adam-family, 2 states)"
    # The run goes on in leanopt: the checkpoint's optimizer.pt converted in place.
    assert main(["convert", str(checkpoint), str(checkpoint / "optimizer.pt"), "--to", "adamw4bit", "--force"]) == 0
    out = capsys.readouterr().out
    assert "(bitsandbytes 8-bit (Adam-family, 2 states), as adamw8bit, " in out and "(adamw4bit, " in out, out
    converted = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert [g.get("initial_lr") for g in converted["param_groups"]] == [g.get("initial_lr") for g in saved["param_groups"]]
    assert all("alpha" not in g and "t_beta3" not in g for g in converted["param_groups"])  # bitsandbytes' AdEMAMix options
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = trainer_tests.training_args(tmp_path, max_steps=5)
        resumed = transformers.Trainer(model=trainer_tests.tiny_distilbert(seed=1), args=args, train_dataset=trainer_tests.TokenDataset(),
                                       optimizer_cls_and_kwargs=(leanopt.AdamW4bit, {"lr": 1e-3}))  # fmt: skip
        resumed.train(resume_from_checkpoint=str(checkpoint))
    opt = trainer_tests.unwrap_optimizer(resumed.optimizer)
    assert isinstance(opt, leanopt.AdamW4bit) and trainer_tests.state_steps(opt) == {5}


def test_trainer_resumes_a_bitsandbytes_checkpoint_straight_into_adamw8bit(tmp_path, capsys) -> None:
    """Trainer(optim="adamw_bnb_8bit") saves checkpoint-3; Trainer with leanopt.AdamW8bit resumes
    from it as it is (the raw bitsandbytes optimizer.pt) to step 6: the same weights as from the
    file converted first, and within the bound of the peer's own resume of the same checkpoint."""
    the_peer("bitsandbytes AdamW8bit")
    trainer_tests = pytest.importorskip("test_trainer")  # transformers + accelerate; its tiny model and data
    transformers = trainer_tests.transformers

    def run(out, steps: int, checkpoint=None, **kw):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            args = trainer_tests.training_args(out, max_steps=steps, **({"optim": "adamw_bnb_8bit"} if not kw else {}),
                                               **({"save_strategy": "steps", "save_steps": steps} if checkpoint is None else {}))  # fmt: skip
            trainer = transformers.Trainer(model=trainer_tests.tiny_distilbert(seed=0 if checkpoint is None else 1), args=args,
                                           train_dataset=trainer_tests.TokenDataset(), **kw)  # fmt: skip
            trainer.train(resume_from_checkpoint=None if checkpoint is None else str(checkpoint))
        return trainer

    run(tmp_path / "bnb", 3)
    checkpoint = tmp_path / "bnb" / "checkpoint-3"
    converted = tmp_path / "converted"
    shutil.copytree(checkpoint, converted)
    assert main(["convert", str(converted), str(converted / "optimizer.pt"), "--to", "adamw8bit", "--force"]) == 0
    capsys.readouterr()
    lean = {"optimizer_cls_and_kwargs": (leanopt.AdamW8bit, {"lr": 1e-3})}
    straight = run(tmp_path / "straight", 6, checkpoint, **lean)
    via_file = run(tmp_path / "via_file", 6, converted, **lean)
    own = run(tmp_path / "own", 6, checkpoint)
    opt = trainer_tests.unwrap_optimizer(straight.optimizer)
    assert isinstance(opt, leanopt.AdamW8bit) and trainer_tests.state_steps(opt) == {6}

    def flat(trainer) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).double() for p in trainer.model.parameters()])

    assert torch.equal(flat(straight), flat(via_file))
    far, mean = bench.distance(flat(straight), flat(own))
    assert far < 1e-2, (far, mean)


# ---- bitsandbytes' one-state files: the rule is said --------------------------------------------
def test_a_bitsandbytes_one_state_file_needs_its_rule_said(tmp_path, capsys) -> None:
    peer, _, _, sd = trained_peer("bitsandbytes Lion8bit")
    assert recognize_states(sd).layout == "bitsandbytes 8-bit (1 state: Lion or SGD momentum)"
    with pytest.raises(ValueError, match=r"rule='lion', `leanopt convert --rule lion`"):
        convert_state_dict(sd, "lion8bit")
    src, dst = tmp_path / "lion.pt", tmp_path / "out.pt"
    torch.save(sd, src)
    assert main(["convert", str(src), str(dst), "--to", "lion4bit"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--rule lion" in err[0] and not dst.exists(), err
    assert main(["convert", str(src), str(dst), "--to", "lion4bit", "--rule", "lion"]) == 0
    assert torch.load(dst, weights_only=True)["param_groups"][0]["optimizer"] == "lion4bit"
    assert "eps" not in torch.load(dst, weights_only=True)["param_groups"][0]  # bitsandbytes saves Lion's eps as 0.0
    # RMSprop saves one state too, with its eps: not Lion's, whatever the rule said.
    bnb = pytest.importorskip("bitsandbytes")
    model = bench.make_model()
    rms = bnb.optim.RMSprop8bit(model.parameters(), lr=1e-3)
    bench.train(model, rms, 1)
    assert "RMSprop or Adagrad" in recognize_states(rms.state_dict()).layout
    with pytest.raises(ValueError, match="RMSprop's or Adagrad's"):
        convert_state_dict(rms.state_dict(), "lion", rule="lion")
    with pytest.raises(ValueError, match=r"not a lion-rule state leanopt recognizes \(bitsandbytes 8-bit \(1 state: RMSprop") as err:
        leanopt.Lion8bit(model.parameters()).load_state_dict(rms.state_dict())  # no convert command offered: not Lion's
    assert "--rule lion" not in str(err.value)
    # A rule that is not the one the states show is refused, peer's or leanopt's.
    _, _, _, adam = trained_peer("bitsandbytes AdamW8bit")
    with pytest.raises(ValueError, match=r"rule='lion', but the states are bitsandbytes 8-bit \(Adam-family"):
        convert_state_dict(adam, "lion", rule="lion")
    w = torch.nn.Parameter(torch.randn(64))
    ours = leanopt.AdamW([w])
    w.grad = torch.randn(64)
    ours.step()
    with pytest.raises(ValueError, match="rule='lion', but the state_dict holds adamw states"):
        convert_state_dict(ours.state_dict(), "adamw8bit", rule="lion")


def test_bitsandbytes_update_norm_clipping_is_not_adamw() -> None:
    bnb = pytest.importorskip("bitsandbytes")
    model = bench.make_model()
    opt = bnb.optim.LAMB8bit(model.parameters(), lr=1e-3)  # Adam's two states and an update-norm clip
    with bench.quiet():
        bench.train(model, opt, 1)
    sd = opt.state_dict()
    assert recognize_states(sd).family is None
    with pytest.raises(ValueError, match="update-norm clipping: LAMB or max_unorm.*not a rule leanopt runs"):
        convert_state_dict(sd, "adamw8bit")


# ---- leaving leanopt: torch.optim.AdamW --------------------------------------------------------------
def make_params(dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in [(96, 64), (4099,), (33,)]]


def feed(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: int, start: int = 0) -> None:
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 + s)
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * 0.1).to(p.dtype)
        opt.step()


def clone(params: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


@pytest.mark.parametrize("case", ADAMW_FAMILY, ids=str)
def test_torch_adamw_target_is_what_torch_saves_and_continues_as_leanopt_adamw(case) -> None:
    params = make_params()
    opt = case.cls(case.param_groups(params), **{**case.kwargs, "backend": "reference"})
    feed(opt, params, 3)
    sd = bench.through_file(opt.state_dict())
    before = copy.deepcopy(sd)
    done = convert_checkpoint(sd, TORCH_ADAMW)
    out = bench.through_file(done.state_dict)  # weights_only-safe
    assert done.target == TORCH_ADAMW and done.source == case.name and done.notes == []
    # torch's own state_dict of the same params, for the keys, dtypes and options it holds.
    torch_params = clone(params)
    torch_opt = torch.optim.AdamW(torch_params)
    feed(torch_opt, torch_params, 1)
    theirs = torch_opt.state_dict()
    assert list(out["param_groups"][0]) == list(theirs["param_groups"][0])
    assert out["param_groups"][0]["lr"] == case.kwargs["lr"]
    for pid, st in out["state"].items():
        assert list(st) == list(theirs["state"][pid])
        assert st["step"].shape == () and st["step"].dtype == torch.float32 and int(st["step"]) == 3
        assert all(v.dtype == torch.float32 and v.shape == params[pid].shape for k, v in st.items() if k != "step")
    # torch's AdamW continues it as leanopt's fp32 AdamW continues the same state (its own rule).
    torch_params = clone(params)
    torch_opt = torch.optim.AdamW(torch_params, foreach=False)
    torch_opt.load_state_dict(done.state_dict)
    ours = clone(params)
    fp32 = leanopt.AdamW(ours, backend="reference")
    fp32.load_state_dict(convert_state_dict(sd, "adamw"))
    feed(torch_opt, torch_params, 5, start=3)
    feed(fp32, ours, 5, start=3)
    assert max(max_diff(a, b) for a, b in zip(torch_params, ours)) <= 1e-6
    assert state_dict_layout(out) == "adamw" and recognize_states(out).layout == "torch.optim.AdamW"
    # ... and the file it came from is as it was (torch steps the tensors it loads in place).
    for pid, st in sd["state"].items():
        for key, value in st.items():
            expected = before["state"][pid][key]
            assert torch.equal(value["codes"], expected["codes"]) if isinstance(value, dict) else torch.equal(value, expected)


@pytest.mark.parametrize("case", ADAMW_FAMILY, ids=str)
@pytest.mark.parametrize("rounding", ["kahan", "stochastic"])
def test_torch_adamw_from_bf16_rounding_states_says_what_it_leaves_out(case, rounding: str, tmp_path, capsys) -> None:
    params = make_params(torch.bfloat16)
    opt = case.cls(case.param_groups(params), **{**case.kwargs, "backend": "reference", "rounding": rounding})
    feed(opt, params, 3)
    src, dst = tmp_path / "bf16.pt", tmp_path / "torch.pt"
    torch.save(opt.state_dict(), src)
    assert main(["convert", str(src), str(dst), "--to", TORCH_ADAMW]) == 0
    first, *notes = capsys.readouterr().out.strip().splitlines()
    assert f"-> {dst} ({TORCH_ADAMW}, " in first, first
    dropped = [f"note: rounding={rounding} left out"] + (["note: kahan_comp of 3 params left out"] if rounding == "kahan" else [])
    assert len(notes) == len(dropped) and all(n.startswith(d) for n, d in zip(notes, dropped)), notes
    out = torch.load(dst, weights_only=True)
    assert all(sorted(st) == ["exp_avg", "exp_avg_sq", "step"] for st in out["state"].values())
    assert all("rounding" not in g and "optimizer" not in g for g in out["param_groups"])
    # torch's AdamW takes it on bf16 params (casting the moments to bf16, as it keeps them) and goes on.
    resumed = clone(params)
    torch_opt = torch.optim.AdamW(resumed, foreach=False)
    torch_opt.load_state_dict(out)
    assert torch_opt.state[resumed[0]]["exp_avg"].dtype == torch.bfloat16
    feed(torch_opt, resumed, 3, start=3)
    feed(opt, params, 3, start=3)
    # Three steps of lr 1e-2 from the same state: apart by the roundings only (bf16 ulps).
    assert all(torch.isfinite(p).all() for p in resumed) and max(max_diff(a.float(), b.float()) for a, b in zip(resumed, params)) < 0.05


def test_torch_adamw_takes_only_adamw_family_states() -> None:
    for case in OPTIMIZERS:
        if case.cls.family == "adamw":
            continue
        params = make_params()
        opt = case.cls(case.param_groups(params), **{**case.kwargs, "backend": "reference"})
        feed(opt, params, 1)
        with pytest.raises(ValueError, match=rf"cannot convert the {case.name} state_dict to torch-adamw: .* the {case.cls.family} rule, "
                           "torch.optim.AdamW the adamw rule"):  # fmt: skip
            convert_state_dict(opt.state_dict(), TORCH_ADAMW)


# ---- hostile and malformed files --------------------------------------------------------------------
def refused(tmp_path, capsys, src, *words: str, to: str = "adamw") -> str:
    """``leanopt convert SRC`` fails in one line holding ``words``, writing nothing. (Before
    allocating what the file declares: the entries that would inflate an allocation -- shapes,
    strides, aliased bytes -- have their own cases in tests/test_hostile_files.py.)"""
    dst = tmp_path / "out.pt"
    code = main(["convert", str(src), str(dst), "--to", to])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("leanopt: error: "), err
    assert "internal error" not in err[0] and all(w in err[0] for w in words), err[0]
    assert not dst.exists() and not (tmp_path / MARKER).exists()
    return err[0]


def nested(sd: dict, pid: int = 0) -> dict:
    return sd["state"][pid]["__bnb_optimizer_quant_state__"]


class RunsCode:
    """Pickles as a call to ``os.system``: what a hostile checkpoint would run when unpickled."""

    def __init__(self, folder) -> None:
        self.command = f"touch {folder / MARKER}"

    def __reduce__(self):
        return (os.system, (self.command,))


BNB_DAMAGE = {
    "code book of 128 values": (lambda sd, _: nested(sd).update(qmap1=torch.linspace(-1, 1, 128)), "'qmap1' of param 0"),
    "a code book beyond [-1, 1]": (lambda sd, _: nested(sd)["qmap2"].mul_(1e30), "'qmap2' of param 0", "[-1, 1]"),
    "NaN block scale": (lambda sd, _: nested(sd)["absmax1"].__setitem__(0, float("nan")), "'absmax1' of param 0", "non-finite"),
    "too few block scales": (lambda sd, _: nested(sd).update(absmax2=nested(sd)["absmax2"][:-1]), "'absmax2' of param 0"),
    "int16 codes": (lambda sd, _: nested(sd).update(state1=nested(sd)["state1"].to(torch.int16)), "'state1' of param 0"),
    "a step that is a word": (lambda sd, _: sd["state"][0].update(step="three"), "'step' of param 0"),
    "non-blockwise max1": (lambda sd, _: nested(sd).update(max1=torch.zeros(1)), "state of param 0", "max1"),
    # Param 5 (the 2,048-element head) keeps fp32 states, which bitsandbytes saves without scales:
    # 10^6 of them were ignored, and the file converted.
    "10^6 block scales beside fp32 states": (lambda sd, _: nested(sd, 5).update(absmax1=torch.rand(10**6)), "'absmax1' of param 5",
                                             "without block scales"),
    "state2 of another size": (lambda sd, _: nested(sd).update(state2=nested(sd)["state2"].reshape(-1)[:1000].clone(),
                                                               absmax2=nested(sd)["absmax2"][:4].clone()), "'state1' of param 0", "[1000]"),
    "state1 of another shape": (lambda sd, _: nested(sd).update(state1=nested(sd)["state1"].reshape(-1, 64)), "'state1' of param 0",
                                "not the states of one param"),
    "8-bit state1 beside fp32 state2": (lambda sd, _: nested(sd).update(state2=torch.rand(nested(sd)["state2"].shape)), "'state1' of param 0",
                                        "one width"),
    "code run on load": (lambda sd, tmp: sd["state"][0].update(evil=RunsCode(tmp)), "refuses", "system"),
}


@pytest.mark.parametrize("damage", list(BNB_DAMAGE))
def test_a_damaged_bitsandbytes_file_is_refused_naming_the_entry(damage: str, tmp_path, capsys) -> None:
    _, _, _, sd = trained_peer("bitsandbytes AdamW8bit")
    change, *words = BNB_DAMAGE[damage]
    change(sd, tmp_path)
    src = tmp_path / "bnb.pt"
    torch.save(sd, src)
    refused(tmp_path, capsys, src, *words)


TORCHAO_DAMAGE = {
    "scales that are not whole blocks": (lambda st: setattr(st, "scale", st.scale[:-3]), "'exp_avg' of param 0", "whole blocks"),
    "NaN in the code book": (lambda st: st.qmap.__setitem__(3, float("nan")), "'exp_avg' of param 0 (qmap)"),
    "int32 codes": (lambda st: setattr(st, "codes", st.codes.to(torch.int32)), "'exp_avg' of param 0", "int32"),
}


@pytest.mark.parametrize("damage", list(TORCHAO_DAMAGE))
def test_a_damaged_torchao_file_is_refused_naming_the_entry(damage: str, tmp_path, capsys) -> None:
    _, _, _, sd = trained_peer("torchao AdamW8bit")
    change, *words = TORCHAO_DAMAGE[damage]
    change(sd["state"][0]["exp_avg"])
    src = tmp_path / "ao.pt"
    torch.save(sd, src)
    refused(tmp_path, capsys, src, *words)


def test_a_torchao_file_that_runs_code_is_refused(tmp_path, capsys) -> None:
    _, _, _, sd = trained_peer("torchao AdamW8bit")
    sd["state"][0]["evil"] = RunsCode(tmp_path)
    src = tmp_path / "ao.pt"
    torch.save(sd, src)
    refused(tmp_path, capsys, src, "refuses", "system")


CHILD = """
import sys, time
sys.modules["torchao"] = None  # torchao is not importable: its states are read without it
from leanopt.cli import main
for src, dst in zip(sys.argv[1::2], sys.argv[2::2]):
    start = time.perf_counter()
    code = main(["convert", src, dst, "--to", "adamw"])
    print("RESULT", code, round(time.perf_counter() - start, 3), flush=True)
"""


def test_torchao_files_are_read_without_torchao_and_nothing_else_is(tmp_path) -> None:
    """In a process where torchao cannot be imported, its 8-bit and 4-bit files convert to what
    they convert to here (with torchao's own classes); a file whose state carries a field torchao
    does not save is refused."""
    files, expected = [], []
    for name in ("torchao AdamW8bit", "torchao AdamW4bit"):
        _, _, _, sd = trained_peer(name)
        src = tmp_path / f"{name.split()[1]}.pt"
        torch.save(sd, src)
        files += [src, tmp_path / f"{name.split()[1]}-adamw.pt"]
        expected.append(convert_state_dict(sd, "adamw"))
    _, _, _, sd = trained_peer("torchao AdamW8bit")
    sd["state"][0]["exp_avg"].extra = torch.zeros(1)  # pickled in the state's fields
    torch.save(sd, tmp_path / "extra.pt")
    files += [tmp_path / "extra.pt", tmp_path / "extra-adamw.pt"]
    proc = subprocess.run([sys.executable, "-c", CHILD, *map(str, files)], capture_output=True, text=True, timeout=300)
    results = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert [r[0] for r in results] == ["0", "0", "2"], proc.stderr[-2000:]
    for converted, want in zip(files[1:4:2], expected):
        assert_same(torch.load(converted, weights_only=True), want)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("leanopt: error:")]
    assert len(errors) == 1 and "no field 'extra'" in errors[0] and float(results[2][1]) < 1.0, proc.stderr[-2000:]
    assert not (tmp_path / "extra-adamw.pt").exists()


# ---- hostile DCP folders: a small one saved in this process, then damaged ---------------------------
def dcp_folder(tmp_path) -> os.PathLike[str]:
    import torch.distributed.checkpoint as dcp

    params = make_params()
    opt = leanopt.AdamW8bit(params, backend="reference")
    feed(opt, params, 1)
    folder = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"optim": {"state": {f"p{i}": st for i, st in opt.state_dict()["state"].items()},
                            "param_groups": [{**g, "params": [f"p{i}" for i in g["params"]]} for g in opt.state_dict()["param_groups"]]}},
                 checkpoint_id=folder)  # fmt: skip
    return folder


def edit_metadata(folder, change) -> None:
    with open(folder / ".metadata", "rb") as f:
        meta = pickle.load(f)  # our own file
    change(meta)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(meta, f)


def first_tensor(meta, prefix: str = "optim.state.p0.exp_avg.codes"):
    return next(v for k, v in meta.state_dict_metadata.items() if k == prefix)


def storage_of(meta, fqn: str):
    return next(v for k, v in meta.storage_data.items() if k.fqn == fqn)


def test_a_small_dcp_folder_converts(tmp_path, capsys) -> None:
    folder = dcp_folder(tmp_path)
    sd = read_checkpoint(folder)
    assert state_dict_layout(sd) == "adamw8bit" and set(sd["state"]) == {"p0", "p1", "p2"}
    assert main(["convert", str(folder), str(tmp_path / "out.pt"), "--to", "adamw4bit"]) == 0


def _huge(meta) -> None:
    entry = first_tensor(meta)
    entry.size = torch.Size([10**12])
    entry.chunks[0].sizes = torch.Size([10**12])


def _outside(meta) -> None:
    storage_of(meta, "optim.state.p0.exp_avg.codes").offset = 10**9


def _escape(meta) -> None:
    storage_of(meta, "optim.state.p0.exp_avg.codes").relative_path = "../../etc/passwd"


def _gap(meta) -> None:
    first_tensor(meta).size = torch.Size([2 * first_tensor(meta).size[0]])


def _alias(meta) -> None:
    """Every chunk of a tensor 16 times its size reads the bytes of the one chunk saved: each
    chunk lies in the file and holds its elements, so the tensor grew 16 times with no byte
    more of file (128 chunks of 512 KiB: 1,080,360 bytes of files converted into a
    67,635,489-byte file, and the factor grows with the chunks)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    fqn = "optim.state.p0.exp_avg.codes"
    entry, info = first_tensor(meta, fqn), storage_of(meta, fqn)
    n = entry.size[0]
    entry.size = torch.Size([16 * n])
    entry.chunks = [ChunkStorageMetadata(offsets=torch.Size([i * n]), sizes=torch.Size([n])) for i in range(16)]
    meta.storage_data.update({MetadataIndex(fqn, torch.Size([i * n])): info for i in range(16)})


def _borrow(meta) -> None:
    """One entry's chunk reads another entry's bytes (each range lies in the file)."""
    mine, theirs = storage_of(meta, "optim.state.p0.exp_avg.codes"), storage_of(meta, "optim.state.p0.exp_avg_sq.codes")
    mine.offset, mine.length = theirs.offset, theirs.length


DCP_DAMAGE = {
    "a tensor of 10^12 elements": (_huge, "'optim.state.p0.exp_avg.codes'", "has only"),
    "chunks that read one byte range": (_alias, "'optim.state.p0.exp_avg.codes'", "reads the same bytes"),
    "an entry that reads another's bytes": (_borrow, "'optim.state.p0.exp_avg", "reads bytes of entry 'optim.state.p0.exp_avg"),
    "a chunk outside its file": (_outside, "'optim.state.p0.exp_avg.codes'", "lie outside"),
    "a data file outside the folder": (_escape, "'optim.state.p0.exp_avg.codes'", "not a file of the checkpoint folder"),
    "chunks that do not cover the tensor": (_gap, "'optim.state.p0.exp_avg.codes'", "do not tile"),
}


@pytest.mark.parametrize("damage", list(DCP_DAMAGE))
def test_a_damaged_dcp_folder_is_refused_naming_the_entry(damage: str, tmp_path, capsys) -> None:
    folder = dcp_folder(tmp_path)
    change, *words = DCP_DAMAGE[damage]
    edit_metadata(folder, change)
    refused(tmp_path, capsys, folder, str(folder), *words)


def test_a_dcp_folder_that_runs_code_is_refused(tmp_path, capsys) -> None:
    folder = dcp_folder(tmp_path)
    # Its metadata: torch's own reader (dcp_to_torch_save) would run this with pickle.load.
    edit_metadata(folder, lambda meta: meta.storage_meta.__dict__.update(checkpoint_id=RunsCode(tmp_path)))
    refused(tmp_path, capsys, folder, ".metadata", "system")
    # One record: torch's reader would load it with torch.load(weights_only=False).
    folder = dcp_folder(tmp_path / "again")
    with open(folder / "evil.distcp", "wb") as f:
        buf = io.BytesIO()
        torch.save({"lr": RunsCode(tmp_path)}, buf)
        f.write(buf.getvalue())
    lr = "optim.param_groups.0.lr"

    def point_lr_at_evil(meta) -> None:
        info = storage_of(meta, lr)
        info.relative_path, info.offset, info.length = "evil.distcp", 0, len(buf.getvalue())

    edit_metadata(folder, point_lr_at_evil)
    refused(tmp_path, capsys, folder, f"entry {lr!r}", "weights_only")
