"""Checkpoints of the low-bit AdamWs: weights_only-safe, resumable bit for bit, convertible
between fp32, 8-bit and 4-bit states (through load_state_dict, or a file through
``leanopt.checkpoint.convert_state_dict``)."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import leanopt
from leanopt.checkpoint import convert_state_dict, state_dict_layout
from leanopt.quant import QuantizedState

LOW_BIT = {"adamw8bit": leanopt.AdamW8bit, "adamw4bit": leanopt.AdamW4bit}
low_bit = pytest.mark.parametrize("cls", list(LOW_BIT.values()), ids=list(LOW_BIT))


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    # One quantized-size matrix, one odd-sized one that is quantized too, a small bias.
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(96, 64), (4099,), (33,)]]


def feed(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: int, start: int = 0) -> None:
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 + s)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 0.1
        opt.step()


def through_file(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def moment_bytes(opt: torch.optim.Optimizer) -> int:
    total = 0
    for st in opt.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            v = st[key]
            tensors = v.tensors() if isinstance(v, QuantizedState) else (v,)
            total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def clone(params: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


# ---- save -> load -------------------------------------------------------------------------------
@low_bit
def test_weights_only_round_trip_continues_bit_identically(cls: type) -> None:
    params = make_params()
    opt = cls([{"params": params[:1]}, {"params": params[1:], "block_size": 100}], lr=1e-2)
    feed(opt, params, 4)
    sd = through_file(opt.state_dict())
    exp_avg = sd["state"][0]["exp_avg"]
    assert isinstance(exp_avg, dict) and set(exp_avg) == {"codes", "absmax", "format", "shape"}
    twin = clone(params)
    twin_opt = cls([{"params": twin[:1]}, {"params": twin[1:], "block_size": 100}], lr=1e-2)
    twin_opt.load_state_dict(sd)
    assert twin_opt.state[twin[1]]["exp_avg"].format.block_size == 100
    feed(opt, params, 4, start=4)
    feed(twin_opt, twin, 4, start=4)
    for a, b in zip(params, twin):
        assert torch.equal(a, b)


# ---- fp32 <-> low-bit through load_state_dict ----------------------------------------------------
@low_bit
@pytest.mark.parametrize("source", ["leanopt", "torch"])
def test_fp32_adamw_state_loads_quantized_and_continues_close(cls: type, source: str) -> None:
    params = make_params()
    fp32_cls = leanopt.AdamW if source == "leanopt" else torch.optim.AdamW
    fp32 = fp32_cls(params, lr=1e-3)
    feed(fp32, params, 10)
    sd = through_file(fp32.state_dict())
    resumed = clone(params)
    opt = cls(resumed, lr=1e-3)
    opt.load_state_dict(sd)
    for p in resumed[:2]:
        assert isinstance(opt.state[p]["exp_avg"], QuantizedState)
        assert isinstance(opt.state[p]["exp_avg_sq"], QuantizedState)
        assert opt.state[p]["step"].item() == 10
    assert isinstance(opt.state[resumed[2]]["exp_avg"], torch.Tensor)  # 33 < min_quant_size
    # The state really shrank.
    dense_bytes = moment_bytes(fp32)
    assert moment_bytes(opt) < {leanopt.AdamW8bit: 0.27, leanopt.AdamW4bit: 0.14}[cls] * dense_bytes
    assert opt.param_groups[0]["state_bits"] == cls.state_bits and opt.param_groups[0]["quantize"] is True
    feed(fp32, params, 10, start=10)
    feed(opt, resumed, 10, start=10)
    # Ten more steps at lr 1e-3 move params ~1e-2; the quantized run stays within a few % of that.
    assert max_diff(params, resumed) <= {leanopt.AdamW8bit: 5e-4, leanopt.AdamW4bit: 4e-3}[cls]


@low_bit
def test_low_bit_state_loads_into_leanopt_adamw_dequantized(cls: type) -> None:
    params = make_params()
    opt = cls(params, lr=1e-3)
    feed(opt, params, 10)
    sd = through_file(opt.state_dict())
    resumed = clone(params)
    fp32 = leanopt.AdamW(resumed, lr=1e-3)
    fp32.load_state_dict(sd)
    for p, q in zip(params, resumed):
        for key in ("exp_avg", "exp_avg_sq"):
            dense = fp32.state[q][key]
            assert isinstance(dense, torch.Tensor) and dense.dtype == torch.float32 and dense.shape == q.shape
            ours = opt.state[p][key]
            expected = ours.dequantize() if isinstance(ours, QuantizedState) else ours
            assert torch.equal(dense, expected)
    feed(opt, params, 10, start=10)
    feed(fp32, resumed, 10, start=10)
    assert max_diff(params, resumed) <= {leanopt.AdamW8bit: 5e-4, leanopt.AdamW4bit: 4e-3}[cls]


@pytest.mark.parametrize("src,dst", [("adamw8bit", "adamw4bit"), ("adamw4bit", "adamw8bit")])
def test_low_bit_states_convert_between_precisions(src: str, dst: str) -> None:
    params = make_params()
    opt = LOW_BIT[src](params, lr=1e-3)
    feed(opt, params, 10)
    resumed = clone(params)
    other = LOW_BIT[dst](resumed, lr=1e-3)
    other.load_state_dict(through_file(opt.state_dict()))
    st = other.state[resumed[0]]["exp_avg"]
    assert st.format.code == LOW_BIT[dst].exp_avg_code and st.format.block_size == LOW_BIT[dst].default_block_size
    assert other.param_groups[0]["block_size"] == LOW_BIT[dst].default_block_size
    assert other.param_groups[0]["state_bits"] == LOW_BIT[dst].state_bits
    feed(opt, params, 10, start=10)
    feed(other, resumed, 10, start=10)
    assert max_diff(params, resumed) <= 4e-3


@low_bit
def test_mismatched_shapes_raise_value_error_naming_the_param(cls: type) -> None:
    params = make_params()
    fp32 = leanopt.AdamW(params)
    feed(fp32, params, 1)
    q = cls(make_params())
    feed(q, list(q.param_groups[0]["params"]), 1)
    wrong = [torch.nn.Parameter(torch.randn(64, 96)), torch.nn.Parameter(torch.randn(4099)), torch.nn.Parameter(torch.randn(33))]
    for sd, target in [(fp32.state_dict(), cls(wrong)), (q.state_dict(), cls(wrong)), (q.state_dict(), leanopt.AdamW(wrong))]:
        with pytest.raises(ValueError, match=r"param 0 .*shape \(64, 96\)"):
            target.load_state_dict(through_file(sd))
        assert len(target.state) == 0


@low_bit
def test_amsgrad_state_is_refused(cls: type) -> None:
    params = make_params()
    fp32 = leanopt.AdamW(params, amsgrad=True)
    feed(fp32, params, 1)
    with pytest.raises(ValueError, match="amsgrad"):
        cls(clone(params)).load_state_dict(fp32.state_dict())
    with pytest.raises(ValueError, match="amsgrad"):
        convert_state_dict(fp32.state_dict(), "adamw8bit")


def test_storage_options_of_the_loading_optimizer_win() -> None:
    params = make_params()
    opt = leanopt.AdamW8bit([{"params": params[:1], "quantize": False}, {"params": params[1:]}], lr=1e-3)
    feed(opt, params, 2)
    sd = opt.state_dict()
    resumed = clone(params)
    other = leanopt.AdamW8bit([{"params": resumed[:1]}, {"params": resumed[1:], "quantize": False}], lr=5e-4)
    other.load_state_dict(sd)
    assert isinstance(other.state[resumed[0]]["exp_avg"], QuantizedState)  # fp32 -> quantized
    assert isinstance(other.state[resumed[1]]["exp_avg"], torch.Tensor)  # quantized -> fp32
    assert other.param_groups[0]["lr"] == 1e-3  # hyper-parameters come from the checkpoint


# ---- convert_state_dict on files ---------------------------------------------------------------
def _trained_state_dicts() -> dict[str, dict]:
    out = {}
    for name, cls in {"adamw": leanopt.AdamW, **LOW_BIT}.items():
        params = make_params()
        opt = cls([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}], lr=1e-3)
        feed(opt, params, 3)
        out[name] = through_file(opt.state_dict())
    return out


def test_state_dict_layout_is_recognized() -> None:
    sds = _trained_state_dicts()
    for name, sd in sds.items():
        assert state_dict_layout(sd) == name
    # A low-bit state whose params all kept fp32 states is told by its groups.
    w = torch.nn.Parameter(torch.randn(10))
    opt = leanopt.AdamW4bit([w])
    feed(opt, [w], 1)
    assert state_dict_layout(opt.state_dict()) == "adamw4bit"
    torch_opt = torch.optim.AdamW([w])
    feed(torch_opt, [w], 1)
    assert state_dict_layout(torch_opt.state_dict()) == "adamw"
    ada = leanopt.Adafactor([torch.nn.Parameter(torch.randn(8, 8))], lr=1e-3, relative_step=False)
    feed(ada, ada.param_groups[0]["params"], 1)
    with pytest.raises(ValueError, match="not an AdamW-family"):
        state_dict_layout(ada.state_dict())
    with pytest.raises(ValueError):
        state_dict_layout({"state": {}})


@pytest.mark.parametrize("src", ["adamw", "adamw8bit", "adamw4bit"])
@pytest.mark.parametrize("dst", ["adamw", "adamw8bit", "adamw4bit"])
def test_convert_state_dict_between_every_layout(src: str, dst: str) -> None:
    sd = _trained_state_dicts()[src]
    before = copy.deepcopy(sd)
    out = through_file(convert_state_dict(sd, dst))  # still weights_only-safe
    assert state_dict_layout(out) == dst
    assert state_dict_layout(sd) == src and torch.equal(sd["state"][0]["step"], before["state"][0]["step"])
    for pid, st in out["state"].items():
        assert torch.equal(st["step"], sd["state"][pid]["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            value = st[key]
            small = pid == 2  # 33 elements: fp32 in every layout
            if dst == "adamw" or small:
                assert isinstance(value, torch.Tensor)
            else:
                assert isinstance(value, dict) and value["format"].endswith(f"/b{LOW_BIT[dst].default_block_size}")
    for g_in, g_out in zip(sd["param_groups"], out["param_groups"]):
        assert g_out["lr"] == g_in["lr"] and g_out["weight_decay"] == g_in["weight_decay"]
        assert ("block_size" in g_out) == (dst != "adamw")
    # The converted file loads into the target class and matches loading the original there.
    cls = {"adamw": leanopt.AdamW, **LOW_BIT}[dst]
    a, b = make_params(), make_params()
    opt_a, opt_b = cls([{"params": a[:2]}, {"params": a[2:]}]), cls([{"params": b[:2]}, {"params": b[2:]}])
    opt_a.load_state_dict(out)
    opt_b.load_state_dict(sd)
    for p, q in zip(a, b):
        for key in ("exp_avg", "exp_avg_sq"):
            x, y = opt_a.state[p][key], opt_b.state[q][key]
            if isinstance(x, QuantizedState):
                assert torch.equal(x.codes, y.codes) and torch.equal(x.absmax, y.absmax)
            else:
                assert torch.equal(x, y)


def test_convert_options_block_size_min_quant_size_and_quantize_flag() -> None:
    params = make_params()
    opt = leanopt.AdamW([{"params": params[:1]}, {"params": params[1:]}])
    feed(opt, params, 2)
    sd = opt.state_dict()
    out = convert_state_dict(sd, "adamw8bit", block_size=64, min_quant_size=0)
    assert all(isinstance(st["exp_avg"], dict) for st in out["state"].values())
    assert out["state"][2]["exp_avg"]["format"] == "pow3-s8/b64"
    assert out["param_groups"][0]["block_size"] == 64 and out["param_groups"][0]["min_quant_size"] == 0
    sd["param_groups"][0]["quantize"] = False
    kept = convert_state_dict(sd, "adamw4bit")
    assert isinstance(kept["state"][0]["exp_avg"], torch.Tensor) and kept["param_groups"][0]["quantize"] is False
    assert isinstance(kept["state"][1]["exp_avg"], dict)
    # A torch.optim.AdamW can resume from a dequantized low-bit checkpoint.
    q = leanopt.AdamW8bit(make_params())
    feed(q, list(q.param_groups[0]["params"]), 2)
    fp32 = convert_state_dict(q.state_dict(), "adamw")
    resumed = make_params()
    torch_opt = torch.optim.AdamW(resumed)
    torch_opt.load_state_dict(fp32)
    feed(torch_opt, resumed, 1)
    with pytest.raises(ValueError):
        convert_state_dict(sd, "sgd")
    with pytest.raises(ValueError):
        convert_state_dict(sd, "adamw8bit", block_size=0)
