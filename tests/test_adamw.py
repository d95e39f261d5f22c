"""leanopt.AdamW against torch.optim.AdamW: same rule, same state, interchangeable checkpoints."""

from __future__ import annotations

import itertools

import pytest
import torch

import leanopt

SHAPES = [(7, 3), (5,), (0,), (2, 3, 4), (1,), (1, 1), (33, 17)]
FLAGS = list(itertools.product([False, True], [False, True], [0.0, 1e-2]))  # amsgrad, maximize, wd


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def run_pair(dtype: torch.dtype, seed: int, steps: int = 20, **kwargs):
    torch.manual_seed(seed)
    init = [torch.randn(s, dtype=dtype) for s in SHAPES]
    ours = [p.clone().requires_grad_() for p in init]
    ref = [p.clone().requires_grad_() for p in init]
    opt = leanopt.AdamW(ours, lr=1e-2, **kwargs)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, **kwargs)
    for step in range(steps):
        for i, (a, b) in enumerate(zip(ours, ref)):
            if (step + i) % 4 == 0:  # some params get no gradient on some steps
                a.grad = b.grad = None
                continue
            g = torch.randn_like(a)
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    return ours, ref, opt, ref_opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("amsgrad,maximize,weight_decay", FLAGS)
def test_matches_torch_adamw(dtype, amsgrad, maximize, weight_decay) -> None:
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    ours, ref, opt, ref_opt = run_pair(dtype, seed, amsgrad=amsgrad, maximize=maximize, weight_decay=weight_decay)
    for a, b in zip(ours, ref):
        assert rel_err(a.detach(), b.detach()) <= 1e-6, f"seed {seed}"
        sa, sb = opt.state.get(a, {}), ref_opt.state.get(b, {})
        assert set(sa) == set(sb)
        for key in sb:
            assert sa[key].dtype == sb[key].dtype
            assert rel_err(sa[key], sb[key]) <= 1e-6, f"{key}, seed {seed}"


@pytest.mark.parametrize("direction", ["torch->leanopt", "leanopt->torch"])
def test_checkpoints_are_interchangeable_with_torch(direction: str, tmp_path) -> None:
    ours, ref, opt, ref_opt = run_pair(torch.float32, seed=3, steps=5, amsgrad=True)
    src, dst_params = (ref_opt, ours) if direction == "torch->leanopt" else (opt, ref)
    path = tmp_path / "opt.pt"
    torch.save(src.state_dict(), path)
    continued_src_params = ref if direction == "torch->leanopt" else ours
    dst_cls = leanopt.AdamW if direction == "torch->leanopt" else torch.optim.AdamW
    # dst_params hold the same values as src's params (run_pair keeps them equal), load and continue both.
    dst = dst_cls(dst_params, lr=1e-2, amsgrad=True)
    dst.load_state_dict(torch.load(path, weights_only=True))
    for step in range(5):
        for a, b in zip(continued_src_params, dst_params):
            g = torch.randn_like(a)
            a.grad, b.grad = g.clone(), g.clone()
        src.step()
        dst.step()
    for a, b in zip(continued_src_params, dst_params):
        assert rel_err(b.detach(), a.detach()) <= 1e-6


def test_bf16_params_keep_fp32_state_and_compute_in_fp32() -> None:
    torch.manual_seed(0)
    w32 = torch.randn(64, 64)
    w16 = w32.to(torch.bfloat16).requires_grad_()
    opt = leanopt.AdamW([w16], lr=1e-2)
    shadow = w16.detach().float().requires_grad_()
    ref = torch.optim.AdamW([shadow], lr=1e-2)
    for _ in range(5):
        g = torch.randn(64, 64)
        w16.grad, shadow.grad = g.to(torch.bfloat16), g.to(torch.bfloat16).float()
        opt.step()
        ref.step()
        shadow.data.copy_(shadow.data.to(torch.bfloat16).float())  # the param itself is stored in bf16
    assert opt.state[w16]["exp_avg"].dtype == torch.float32
    assert torch.equal(w16.detach().float(), shadow.detach())


def test_amsgrad_resume_from_non_amsgrad_state() -> None:
    w = torch.nn.Parameter(torch.randn(10))
    opt = leanopt.AdamW([w])
    w.grad = torch.randn(10)
    opt.step()
    sd = opt.state_dict()
    sd["param_groups"][0]["amsgrad"] = True
    other = leanopt.AdamW([w], amsgrad=True)
    other.load_state_dict(sd)
    assert torch.equal(other.state[w]["max_exp_avg_sq"], opt.state[w]["exp_avg_sq"])


def test_sparse_gradients_are_refused() -> None:
    w = torch.nn.Parameter(torch.randn(4, 3))
    w.grad = torch.randn(4, 3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        leanopt.AdamW([w]).step()


@pytest.mark.parametrize("direction", ["torch->leanopt", "leanopt->torch"])
def test_channels_last_checkpoint_continues_in_the_other_optimizer(direction: str) -> None:
    # torch keeps a channels_last param's moments channels_last (zeros_like); leanopt keeps
    # them row-major. A checkpoint must carry the same *logical* moments either way: the fused
    # CPU kernel used to pair elements by memory order and continue from scrambled moments.
    torch.manual_seed(0)
    init = torch.randn(16, 8, 3, 3).contiguous(memory_format=torch.channels_last)
    grads = [torch.randn(16, 8, 3, 3).contiguous(memory_format=torch.channels_last) for _ in range(8)]
    first, second = (torch.optim.AdamW, leanopt.AdamW) if direction == "torch->leanopt" else (leanopt.AdamW, torch.optim.AdamW)
    a, b = init.clone().requires_grad_(), init.clone().requires_grad_()
    opt_a, opt_ref = first([a], lr=1e-2), torch.optim.AdamW([b], lr=1e-2)
    for g in grads[:4]:
        a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_ref.step()
    opt_c = second([a], lr=1e-2)
    opt_c.load_state_dict(opt_a.state_dict())
    for g in grads[4:]:
        a.grad, b.grad = g.clone(), g.clone()
        opt_c.step()
        opt_ref.step()
    assert a.is_contiguous(memory_format=torch.channels_last)
    assert rel_err(a.detach(), b.detach()) <= 1e-6
    for key in ("exp_avg", "exp_avg_sq"):
        assert rel_err(opt_c.state[a][key], opt_ref.state[b][key]) <= 1e-6, key
