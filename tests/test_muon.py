"""leanopt.Muon held to torch.optim.Muon itself, its extensions (conv, stacked experts) to torch's
per-matrix orthogonalization, its aux groups to leanopt's AdamW, and its checks of bad input."""

from __future__ import annotations

import copy
import io
import re

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

import leanopt
from leanopt.kernels import newton_schulz

SHAPES = {"square": (48, 48), "tall": (96, 24), "wide": (24, 96)}
VARIANTS = {
    "defaults": {},
    "plain-momentum": {"nesterov": False, "momentum": 0.9, "weight_decay": 0.0},
    "match-rms": {"adjust_lr_fn": "match_rms_adamw", "weight_decay": 0.01, "ns_steps": 3, "eps": 1e-5},
}


def _saved(opt: torch.optim.Optimizer) -> dict:
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("variant", VARIANTS, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bit_identical_to_torch_muon_over_100_steps(shape: str, variant: str, backend: str) -> None:
    # The reference backend and the CPU path (the momentum compiled; torch.lerp's FMA spelled
    # out, kernels.rules.lerp) both give torch's bits: distance 0 after 100 steps.
    torch.manual_seed(0)
    ours = torch.nn.Parameter(torch.randn(SHAPES[shape]))
    theirs = torch.nn.Parameter(ours.detach().clone())
    kwargs = {"lr": 0.02, **VARIANTS[variant]}
    opt = leanopt.Muon([ours], backend=backend, **kwargs)
    ref = torch.optim.Muon([theirs], **kwargs)
    for _ in range(100):
        g = torch.randn(SHAPES[shape])
        ours.grad, theirs.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    assert torch.equal(ours, theirs)
    assert torch.equal(opt.state[ours]["momentum_buffer"], ref.state[theirs]["momentum_buffer"])


def test_torch_checkpoints_load_into_it_and_back() -> None:
    torch.manual_seed(1)
    shapes = [SHAPES["tall"], SHAPES["wide"]]
    a = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    grads = [[torch.randn(s) for s in shapes] for _ in range(12)]

    def run(opt: torch.optim.Optimizer, params: list, steps: range) -> None:
        for k in steps:
            for p, g in zip(params, grads[k]):
                p.grad = g.clone()
            opt.step()

    # torch -> leanopt: a torch.optim.Muon file continues in leanopt.Muon as in torch.
    theirs = torch.optim.Muon(a, lr=0.02)
    run(theirs, a, range(4))
    saved = _saved(theirs)
    for p, q in zip(a, b):
        q.data.copy_(p.data)
    ours = leanopt.Muon(b, lr=0.02)
    ours.load_state_dict(saved)
    run(theirs, a, range(4, 8))
    run(ours, b, range(4, 8))
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    # leanopt -> torch: leanopt's file (its extra step count ignored) continues in torch.optim.Muon.
    again = torch.optim.Muon(a, lr=0.02)
    again.load_state_dict(_saved(ours))
    run(again, a, range(8, 12))
    run(ours, b, range(8, 12))
    assert all(torch.equal(p, q) for p, q in zip(a, b))


@pytest.mark.parametrize("shape", [(3, 16, 40), (2, 3, 40, 16)], ids=["experts", "experts-2d-grid"])
def test_stacked_matrices_are_orthogonalized_each_as_torch_does(shape: tuple) -> None:
    torch.manual_seed(2)
    update = torch.randn(shape)
    got = newton_schulz.orthogonalize(update, newton_schulz.COEFFICIENTS, 5, 1e-7)
    want = torch.stack([_zeropower_via_newtonschulz(m, newton_schulz.COEFFICIENTS, 5, 1e-7) for m in update.reshape(-1, *shape[-2:])])
    assert torch.equal(got, want.view(shape))


def test_conv_weight_is_orthogonalized_as_its_flattening() -> None:
    torch.manual_seed(3)
    update = torch.randn(16, 4, 3, 3)
    got = newton_schulz.orthogonalize(update, newton_schulz.COEFFICIENTS, 5, 1e-7, flatten=True)
    want = _zeropower_via_newtonschulz(update.reshape(16, 36), newton_schulz.COEFFICIENTS, 5, 1e-7)
    assert torch.equal(got, want.view(16, 4, 3, 3))


def test_expert_and_conv_params_step_as_torch_steps_each_matrix() -> None:
    # A [E, rows, cols] param in a Muon group is E torch.optim.Muon matrices; a conv weight in a
    # flatten group is torch's Muon on its [out, in * k * k] flattening, bit for bit.
    torch.manual_seed(4)
    experts = torch.nn.Parameter(torch.randn(3, 32, 12))
    conv = torch.nn.Parameter(torch.randn(8, 3, 3, 3))
    mats = [torch.nn.Parameter(e.detach().clone()) for e in experts] + [torch.nn.Parameter(conv.detach().reshape(8, 27).clone())]
    opt = leanopt.Muon([{"params": [experts]}, {"params": [conv], "flatten": True}], lr=0.03, backend="reference")
    ref = torch.optim.Muon(mats, lr=0.03)
    for _ in range(10):
        ge, gc = torch.randn(experts.shape), torch.randn(conv.shape)
        experts.grad, conv.grad = ge, gc
        for m, g in zip(mats, [*ge, gc.reshape(8, 27)]):
            m.grad = g.clone()
        opt.step()
        ref.step()
    assert all(torch.equal(e, m) for e, m in zip(experts, mats[:3]))
    assert torch.equal(conv.reshape(8, 27), mats[3])


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(50, 24), torch.nn.Linear(24, 48), torch.nn.GELU(), torch.nn.LayerNorm(48),
                               torch.nn.Linear(48, 24))  # fmt: skip


def _loss(model: torch.nn.Module, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 50, (16,), generator=g)
    return model(x).square().mean()


@pytest.mark.parametrize("aux", ["adamw", "adamw8bit"])
def test_one_optimizer_steps_aux_groups_with_that_rules_own_code(aux: str) -> None:
    # The aux groups of one Muon equal the aux optimizer run alone on those params, and the
    # Muon groups equal torch.optim.Muon on theirs: one state_dict, one scheduler for both.
    model = _mlp()
    twin = copy.deepcopy(model)
    groups = leanopt.muon_groups(model, aux=aux, aux_lr=3e-3, aux_betas=(0.9, 0.95), aux_weight_decay=0.0)
    opt = leanopt.Muon(groups, lr=0.02)
    twin_groups = leanopt.muon_groups(twin)
    muon_params = [p for g in twin_groups if g["use_muon"] for p in g["params"]]
    aux_params = [p for g in twin_groups if not g["use_muon"] for p in g["params"]]
    ref_muon = torch.optim.Muon(muon_params, lr=0.02)
    ref_aux = leanopt.optim.optimizer_class(aux)(aux_params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (ref_muon, ref_aux)]
    for s in range(6):
        opt.zero_grad()
        _loss(model, s).backward()
        opt.step()
        scheduler.step()
        twin.zero_grad()
        _loss(twin, s).backward()
        ref_muon.step()
        ref_aux.step()
        for r in ref_schedulers:
            r.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    assert [g["lr"] for g in opt.param_groups] == [0.02 * 0.125, 3e-3 * 0.125]
    assert len(opt.state_dict()["state"]) == len(list(model.parameters()))


def test_estimate_of_a_model_equals_measure() -> None:
    model = _mlp()
    for cls in (leanopt.Muon, leanopt.Muon8bit):
        opt = cls(leanopt.muon_groups(model), lr=0.02)
        model.zero_grad()
        _loss(model, 0).backward()
        opt.step()
        assert leanopt.estimate(model, cls).by_key == leanopt.measure(opt).by_key


def test_kellerjordan_muon_with_aux_adam_file_loads() -> None:
    # MuonWithAuxAdam's groups (use_muon, lr, momentum, weight_decay / lr, betas, eps,
    # weight_decay) and states (momentum_buffer / exp_avg, exp_avg_sq, an int step), as its
    # muon.py writes them; its Muon group lists its params largest first.
    model = _mlp()
    groups = leanopt.muon_groups(model)
    muon_params = sorted(groups[0]["params"], key=lambda p: p.size(), reverse=True)
    aux_params = groups[1]["params"]
    ids = iter(range(100))
    sd = {
        "param_groups": [
            {"params": [next(ids) for _ in muon_params], "lr": 0.05, "momentum": 0.95, "weight_decay": 0.0, "use_muon": True},
            {"params": [next(ids) for _ in aux_params], "lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0,
             "use_muon": False},
        ],  # fmt: skip
        "state": {},
    }
    for i, p in enumerate(muon_params):
        sd["state"][i] = {"momentum_buffer": torch.full(p.shape, 0.5)}
    for i, p in enumerate(aux_params, start=len(muon_params)):
        sd["state"][i] = {"exp_avg": torch.full(p.shape, 0.1), "exp_avg_sq": torch.full(p.shape, 0.2), "step": 3}
    opt = leanopt.Muon([{"params": muon_params}, {"params": aux_params, "use_muon": False}])
    opt.load_state_dict(sd)
    assert opt.param_groups[1]["eps"] == 1e-10 and opt.param_groups[1]["amsgrad"] is False
    assert opt.param_groups[0]["nesterov"] is True and opt.param_groups[0]["ns_steps"] == 5
    assert int(opt.state[aux_params[0]]["step"]) == 3 and torch.equal(opt.state[muon_params[0]]["momentum_buffer"],
                                                                     torch.full(muon_params[0].shape, 0.5))  # fmt: skip
    _loss(model, 0).backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ---- bad input ----------------------------------------------------------------------------------
def test_bad_input_is_a_value_error_naming_the_group_and_param() -> None:
    w, b = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8))
    with pytest.raises(ValueError, match=r"param 1 of group 0 has shape \(8,\).*>= 2 dims"):
        leanopt.Muon([w, b])
    with pytest.raises(ValueError, match=r"param 0 'bias' of group 1 has shape \(8,\)"):
        leanopt.Muon([{"params": [w]}, {"params": [("bias", b)]}])
    with pytest.raises(ValueError, match=r"param 0 of group 0 is torch.complex64"):
        leanopt.Muon([torch.nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))])
    bad = [({"ns_steps": 100}, r"Number of steps must be less than 100"),
           ({"ns_coefficients": (3.4, -4.7)}, r"exactly 3 values"),
           ({"ns_coefficients": (3.4, -4.7, float("nan"))}, r"exactly 3 values"),
           ({"lr": -0.1}, r"Invalid lr"), ({"momentum": -0.5}, r"Invalid momentum"),
           ({"weight_decay": -0.1}, r"Invalid weight_decay"), ({"eps": 0.0}, r"Invalid eps"),
           ({"adjust_lr_fn": "rms"}, r"Adjust learning rate function rms is not supported"),
           ({"aux": "lion"}, r"Invalid aux")]  # fmt: skip
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            leanopt.Muon([w], **kwargs)
        # The same option in a second group: named by the group.
        key, value = next(iter(kwargs.items()))
        with pytest.raises(ValueError, match=rf"param group 1: .*{message}"):
            leanopt.Muon([{"params": [w]}, {"params": [torch.nn.Parameter(torch.randn(4, 4))], key: value}])
    with pytest.raises(ValueError, match=r"param group 1: .*beta2"):
        leanopt.Muon([{"params": [w]}, {"params": [b], "use_muon": False, "betas": (0.9, 1.5)}])
    with pytest.raises(ValueError, match=r"use_muon must be True or False"):
        leanopt.Muon([{"params": [w], "use_muon": "yes"}])


def test_a_state_loads_only_into_groups_of_its_kind() -> None:
    w, b = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8))
    mixed = leanopt.Muon([{"params": [w]}, {"params": [b], "use_muon": False}])
    w.grad, b.grad = torch.randn_like(w), torch.randn_like(b)
    mixed.step()
    sd = mixed.state_dict()
    swapped = leanopt.Muon([{"params": [torch.nn.Parameter(torch.randn(8))], "use_muon": False},
                            {"params": [torch.nn.Parameter(torch.randn(8, 8))]}])  # fmt: skip
    with pytest.raises(ValueError, match=re.escape("param group 0: the state_dict's group has use_muon=True")):
        swapped.load_state_dict(sd)
    # torch.optim.Muon's groups do not say: its buffer does not fit an aux (AdamW) group.
    theirs = torch.optim.Muon([torch.nn.Parameter(torch.randn(8, 8))])
    theirs.param_groups[0]["params"][0].grad = torch.randn(8, 8)
    theirs.step()
    aux_only = leanopt.Muon([{"params": [torch.nn.Parameter(torch.randn(8, 8))], "use_muon": False}])
    with pytest.raises(ValueError, match="'momentum_buffer' has no place in it"):
        aux_only.load_state_dict(theirs.state_dict())
    assert not swapped.state and not aux_only.state


def test_temporaries_are_one_matrix_at_a_time() -> None:
    # The step's tensor peak over many params is that of its largest param alone: one param's
    # direction and one matrix's Newton-Schulz iteration at a time, not the model's worth.
    from leanopt.compare.meter import TensorPeak

    def peak(params: list) -> int:
        opt = leanopt.Muon(params, lr=0.02)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()  # states made
        meter = TensorPeak()
        if not meter.start():
            pytest.skip("the torch profiler does not run here")
        opt.step()
        got = meter.stop()
        assert got is not None
        return got

    torch.manual_seed(5)
    largest = torch.nn.Parameter(torch.randn(8, 64, 32))  # 8 experts: one matrix's iteration at a time too
    others = [torch.nn.Parameter(torch.randn(96, 64)) for _ in range(6)]
    alone, together = peak([largest]), peak([largest, *others])
    one_expert = peak([torch.nn.Parameter(torch.randn(1, 64, 32))])
    assert together <= alone + 1024, (together, alone)
    # 7 more experts add their direction (fp32) and result (bf16) rows, 6 B an element, and not 7
    # more iterations (one iteration's peak here: 25,600 B); slack of two bf16 matrices.
    assert alone - one_expert <= 7 * 64 * 32 * (4 + 2) + 2 * 64 * 32 * 2, (alone, one_expert)


@pytest.mark.parametrize("cls", [leanopt.Muon, leanopt.Muon8bit], ids=lambda c: c.__name__)
def test_aux_betas_and_eps_are_the_aux_groups_defaults(cls: type) -> None:
    """Trainer's Adam betas and eps reach the aux groups through the constructor (what
    optimizer_cls_and_kwargs passes, and leanopt.estimate takes with the same kwargs); a group
    that sets its own keeps them."""
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    opt = cls(model, lr=0.02, aux_betas=(0.8, 0.95), aux_eps=1e-6)
    aux = [g for g in opt.param_groups if not g["use_muon"]]
    assert aux and all(g["betas"] == (0.8, 0.95) and g["eps"] == 1e-6 for g in aux)
    plain = cls(model, lr=0.02)
    assert all(g["betas"] == (0.9, 0.999) and g["eps"] == 1e-8 for g in plain.param_groups if not g["use_muon"])
    own = cls([{"params": [model[1].weight]}, {"params": [model[2].weight], "use_muon": False, "betas": (0.5, 0.6)}],
              lr=0.02, aux_betas=(0.8, 0.95))  # fmt: skip
    assert own.param_groups[1]["betas"] == (0.5, 0.6)
    assert leanopt.estimate(model, cls, lr=0.02, aux_betas=(0.8, 0.95), aux_eps=1e-6).bytes == leanopt.estimate(model, cls).bytes
