"""leanopt.muon_groups: a model split by what its modules are -- a transformers model with tied
embeddings, a classifier's task head, a conv net, stacked expert weights -- and by dims alone for
params and param groups."""

from __future__ import annotations

import pytest
import torch

import leanopt

transformers = pytest.importorskip("transformers")


def routes(groups) -> dict[str, str]:
    return {r.name: r.rule for r in groups.routes}


def tiny_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def test_gpt2_with_tied_embeddings_keeps_embeddings_and_head_out_of_muon() -> None:
    model = tiny_gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    groups = leanopt.muon_groups(model, aux_lr=3e-4)
    got = routes(groups)
    assert got["transformer.wte.weight"] == got["transformer.wpe.weight"] == "aux rule"
    assert got["transformer.h.0.attn.c_attn.weight"] == got["transformer.h.1.mlp.c_proj.weight"] == "muon"
    assert got["transformer.h.0.ln_1.weight"] == got["transformer.h.0.attn.c_attn.bias"] == "aux rule"
    muon = [p for g in groups if g["use_muon"] for p in g["params"]]
    aux = [p for g in groups if not g["use_muon"] for p in g["params"]]
    assert all(p.dim() == 2 for p in muon) and len(muon) == 8  # 4 matrices a layer
    assert not any(p is model.lm_head.weight for p in muon)
    assert {g["lr"] for g in groups if not g["use_muon"]} == {3e-4}
    assert len(muon) + len(aux) == len(list(model.parameters()))
    # One optimizer for all of it trains: the LM loss goes down.
    opt = leanopt.Muon(groups, lr=0.02)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.95 * losses[0]  # measured: 4.16 -> 3.70
    assert leanopt.estimate(model, "muon").bytes == leanopt.measure(opt).bytes


def test_a_weight_tied_to_an_embedding_by_memory_goes_with_it() -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(50, 16)
            self.body = torch.nn.Linear(16, 16)
            self.out = torch.nn.Linear(16, 50, bias=False)
            self.out.weight = torch.nn.Parameter(self.embed.weight.detach().view(50, 16))  # same memory, another Parameter

    got = routes(leanopt.muon_groups(Tied()))
    assert got["embed.weight"] == "aux rule" and got["out.weight"] == "aux rule" and got["body.weight"] == "muon"


def test_a_classifier_s_task_head_is_outside_its_base_model() -> None:
    config = transformers.DistilBertConfig(vocab_size=128, dim=32, n_layers=1, n_heads=2, hidden_dim=64, max_position_embeddings=32)
    model = transformers.DistilBertForSequenceClassification(config)
    groups = leanopt.muon_groups(model)
    why = {r.name: r.why for r in groups.routes}
    assert why["classifier.weight"] == why["pre_classifier.weight"] == "task head (outside the model's base_model)"
    assert why["distilbert.embeddings.word_embeddings.weight"] == "embedding (Embedding)"
    assert routes(groups)["distilbert.transformer.layer.0.ffn.lin1.weight"] == "muon"
    assert "task head" in str(groups)  # the printed table says why


def test_conv_net_conv_weights_are_flattened_and_the_head_given_goes_to_aux() -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.Conv2d(8, 16, 3),
                              torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, 10))  # fmt: skip
    groups = leanopt.muon_groups(net, head=[net[6]])
    flat = [g for g in groups if g.get("flatten")]
    assert len(flat) == 1 and [tuple(p.shape) for p in flat[0]["params"]] == [(8, 3, 3, 3), (16, 8, 3, 3)]
    assert routes(groups)["6.weight"] == "aux rule" and routes(groups)["1.weight"] == "aux rule"
    opt = leanopt.Muon(groups, lr=0.02)
    x = torch.randn(4, 3, 12, 12, generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, 10, (4,), generator=torch.Generator().manual_seed(3))
    before = net[3].weight.detach().clone()
    torch.nn.functional.cross_entropy(net(x), y).backward()
    opt.step()
    # The conv weight moved as torch's Muon moves its [16, 72] flattening.
    ref = torch.nn.Parameter(before.reshape(16, 72).clone())
    ref.grad = net[3].weight.grad.reshape(16, 72).clone()
    torch.optim.Muon([ref], lr=0.02).step()
    assert torch.equal(net[3].weight.detach().reshape(16, 72), ref.detach())


class Experts(torch.nn.Module):
    """An MoE layer's stacked expert weights, [experts, in, out], applied to routed tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(16, 4)
        self.w = torch.nn.Parameter(torch.randn(4, 16, 32) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.router(x).argmax(-1)
        return torch.einsum("bi,bio->bo", x, self.w[k])


def test_stacked_expert_weights_are_muon_s_and_step_per_expert() -> None:
    torch.manual_seed(0)
    moe = Experts()
    groups = leanopt.muon_groups(moe)
    assert routes(groups)["w"] == "muon (stacked)" and routes(groups)["router.weight"] == "muon"
    opt = leanopt.Muon(groups, lr=0.02, weight_decay=0.0)
    moe(torch.randn(64, 16)).square().mean().backward()
    before = moe.w.detach().clone()
    opt.step()
    for e in range(4):  # each expert's update is orthogonalized on its own: one torch Muon matrix each
        ref = torch.nn.Parameter(before[e].clone())
        ref.grad = moe.w.grad[e].clone()
        torch.optim.Muon([ref], lr=0.02, weight_decay=0.0).step()
        assert torch.equal(moe.w.detach()[e], ref.detach())


def test_params_and_param_groups_split_by_dims_keeping_each_group_s_options() -> None:
    w, b, counts = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8)), torch.tensor([1, 2])
    groups = leanopt.muon_groups([{"params": [w, b, counts], "weight_decay": 0.0, "lr": 0.1},
                                  {"params": [torch.nn.Parameter(torch.randn(4, 4))]}])  # fmt: skip
    assert [(g["use_muon"], len(g["params"]), g.get("weight_decay")) for g in groups] == [(True, 2, 0.0), (False, 1, 0.0),
                                                                                         (True, 1, None)]  # fmt: skip
    # An integer tensor never stepped stays; a frozen float one is routed (it may be unfrozen).
    frozen = torch.nn.Parameter(torch.randn(8), requires_grad=False)
    assert [g["use_muon"] for g in leanopt.muon_groups([w, frozen])] == [True, False]
    with pytest.raises(ValueError, match="mix no param groups with params"):
        leanopt.muon_groups([{"params": [w]}, b])
