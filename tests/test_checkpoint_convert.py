"""Checkpoints: the optimizer each one declares, and conversion within a family.

The low-bit optimizers' checkpoints are weights_only-safe and resumable bit for bit; every
registered optimizer declares its name in its saved param groups, ``state_dict_layout`` reads
it, and ``convert_state_dict`` turns a state into any member of its family (fp32, 8-bit,
4-bit: through load_state_dict, or a file) and refuses another family. The AdamW-specific
cases (torch's files, amsgrad) are at the end of each section.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

import leanopt
from leanopt.checkpoint import convert_state_dict, declared_optimizer, family_members, state_dict_layout
from leanopt.optim import REGISTRY
from leanopt.optim.lowbit import LowBit
from leanopt.quant import QuantizedState
from registry import OPTIMIZERS, OptimizerCase

CASES = {case.name: case for case in OPTIMIZERS}
LOW_BIT = {"adamw8bit": leanopt.AdamW8bit, "adamw4bit": leanopt.AdamW4bit}
low_bit = pytest.mark.parametrize("cls", list(LOW_BIT.values()), ids=list(LOW_BIT))
every_low_bit = pytest.mark.parametrize("case", [c for c in OPTIMIZERS if issubclass(c.cls, LowBit)], ids=str)
# Every (source, target) of one family, itself included: adamw -> adamw8bit, lion4bit -> lion, ...
SAME_FAMILY = [(a.name, b.name) for a in OPTIMIZERS for b in OPTIMIZERS if a.cls.family == b.cls.family]


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


def build(case: OptimizerCase, params) -> torch.optim.Optimizer:
    """``case``'s optimizer on the reference backend (no compile: these tests are about files)."""
    return case.cls(case.param_groups(params), **{**case.kwargs, "backend": "reference"})


def groups(params: list[torch.Tensor]) -> list[dict]:
    return [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}]


def trained(name: str, steps: int = 2) -> tuple[list[torch.nn.Parameter], dict]:
    """Params and the weights_only round trip of ``name``'s state_dict after ``steps`` steps."""
    params = make_params()
    opt = build(CASES[name], groups(params))
    feed(opt, params, steps)
    return params, through_file(opt.state_dict())


def keys_of(opt: torch.optim.Optimizer, group: dict | None = None) -> list[str]:
    return opt.state_keys(group or opt.param_groups[0]) if hasattr(opt, "state_keys") else []


def undeclared(sd: dict) -> dict:
    """``sd`` without the declared name: a peer's file, or leanopt's from before names were declared."""
    return {**sd, "param_groups": [{k: v for k, v in g.items() if k != "optimizer"} for g in sd["param_groups"]]}


def relabeled(sd: dict, name: str) -> dict:
    """``sd`` declaring ``name``, whoever saved it."""
    return {**sd, "param_groups": [{**g, "optimizer": name} for g in sd["param_groups"]]}


# ---- save -> load -------------------------------------------------------------------------------
@every_low_bit
def test_weights_only_round_trip_continues_bit_identically(case: OptimizerCase) -> None:
    params = make_params()
    kwargs = {**case.kwargs, "backend": "reference"}
    opt = case.cls([{"params": params[:1]}, {"params": params[1:], "block_size": 100}], **kwargs)
    feed(opt, params, 4)
    sd = through_file(opt.state_dict())
    first = keys_of(opt)[0]  # exp_avg, or AdEMAMix's exp_avg_fast
    entry = sd["state"][0][first]
    assert isinstance(entry, dict) and set(entry) == {"codes", "absmax", "format", "shape"}
    assert all(g["optimizer"] == case.name for g in sd["param_groups"])
    twin = clone(params)
    twin_opt = case.cls([{"params": twin[:1]}, {"params": twin[1:], "block_size": 100}], **kwargs)
    twin_opt.load_state_dict(sd)
    assert twin_opt.state[twin[1]][first].format.block_size == 100
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


# ---- the declared name ---------------------------------------------------------------------------
@pytest.mark.parametrize("case", OPTIMIZERS, ids=str)
def test_state_dict_layout_is_the_declared_name(case: OptimizerCase) -> None:
    _, sd = trained(case.name)
    assert declared_optimizer(sd) == case.name and state_dict_layout(sd) == case.name
    assert case.name in family_members(case.name)
    # Saved before the first step: no states, the name still says whose it is.
    fresh = build(case, groups(make_params())).state_dict()
    assert state_dict_layout(through_file(fresh)) == case.name


def test_a_lion8bit_state_is_not_taken_for_adamw8bit() -> None:
    # The case: the same 8-bit code and block size as AdamW8bit's exp_avg, one state.
    _, sd = trained("lion8bit")
    assert state_dict_layout(sd) == "lion8bit"
    with pytest.raises(ValueError, match=r"lion8bit.*adamw8bit.*Lion8bit runs the lion rule, AdamW8bit the adamw rule"):
        convert_state_dict(sd, "adamw8bit")


def test_undeclared_files_are_recognized_by_their_states() -> None:
    # leanopt's AdamW files from before names were declared: told apart by their bits.
    for name in ("adamw", "adamw8bit", "adamw4bit"):
        assert state_dict_layout(undeclared(trained(name)[1])) == name
    # A low-bit state whose params all kept fp32 states is told by its groups' state_bits.
    w = torch.nn.Parameter(torch.randn(10))
    opt = leanopt.AdamW4bit([w])
    feed(opt, [w], 1)
    assert state_dict_layout(undeclared(opt.state_dict())) == "adamw4bit"
    torch_opt = torch.optim.AdamW([w])
    feed(torch_opt, [w], 1)
    assert declared_optimizer(torch_opt.state_dict()) is None
    assert state_dict_layout(torch_opt.state_dict()) == "adamw"
    # Every other leanopt state shows its rule too (keys, options): Lion's one momentum with betas
    # and no eps, AdEMAMix's two EMAs, Adafactor's options.
    for case in OPTIMIZERS:
        assert state_dict_layout(undeclared(trained(case.name)[1])) == case.name
    # What shows no rule leanopt runs is not guessed: torch's Adafactor. (torch's SGD momentum is
    # leanopt.SGD's state: tests/test_sgd.py loads it.)
    for peer in (lambda ps: torch.optim.Adafactor(ps),):
        params = make_params()
        opt = peer(params)
        feed(opt, params, 1)
        with pytest.raises(ValueError, match="declare no 'optimizer' .*: not a state leanopt recognizes"):
            state_dict_layout(opt.state_dict())
    with pytest.raises(ValueError):
        state_dict_layout({"state": {}})


def test_declared_names_are_checked() -> None:
    _, sd = trained("lion")
    unknown = {**sd, "param_groups": [{**g, "optimizer": "lion2bit"} for g in sd["param_groups"]]}
    with pytest.raises(ValueError, match="'lion2bit', which this leanopt does not know"):
        state_dict_layout(unknown)
    mixed = {**sd, "param_groups": [{**sd["param_groups"][0], "optimizer": "lion"}, {**sd["param_groups"][1], "optimizer": "lion8bit"}]}
    with pytest.raises(ValueError, match="different optimizers: lion, lion8bit"):
        state_dict_layout(mixed)
    # A name that does not match the states: an AdamW file must hold exp_avg_sq, a Lion one no more.
    with pytest.raises(ValueError, match=r"not adamw's state \(missing 'exp_avg_sq'\)"):
        state_dict_layout(relabeled(sd, "adamw"))
    with pytest.raises(ValueError, match=r"not lion's state \('exp_avg_sq' is another rule's\)"):
        state_dict_layout(relabeled(trained("adamw")[1], "lion"))


# ---- convert_state_dict on files ---------------------------------------------------------------
@pytest.mark.parametrize("src,dst", SAME_FAMILY, ids=[f"{a}-{b}" for a, b in SAME_FAMILY])
def test_convert_within_a_family_loads_into_the_target_and_continues(src: str, dst: str) -> None:
    # Train 2 steps with src, save, convert to dst, load into dst, step.
    _, sd = trained(src)
    before = copy.deepcopy(sd)
    out = through_file(convert_state_dict(sd, dst))  # still weights_only-safe
    assert state_dict_layout(out) == dst and all(g["optimizer"] == dst for g in out["param_groups"])
    assert state_dict_layout(sd) == src and torch.equal(sd["state"][0]["step"], before["state"][0]["step"])
    # Each group's states are stored as the target stores that group's (Muon: by its rule runner).
    blank = build(CASES[dst], groups(make_params()))
    stores = [blank.storage(g) for g in blank.param_groups]
    group_of = {pid: gi for gi, g in enumerate(out["param_groups"]) for pid in g["params"]}
    for pid, st in out["state"].items():
        assert torch.equal(st["step"], sd["state"][pid]["step"])
        store, group = stores[group_of[pid]], blank.param_groups[group_of[pid]]
        for key in keys_of(store, group):
            value = st[key]
            small = pid == 2  # 33 elements: fp32 in every layout
            if not isinstance(store, LowBit) or small:
                assert isinstance(value, torch.Tensor) and value.dtype == torch.float32, (key, pid)
            else:
                code = getattr(store, f"{key}_code")
                assert isinstance(value, dict) and value["format"] == f"{code}/b{type(store).default_block_size}", (key, pid)
    for gi, (g_in, g_out) in enumerate(zip(sd["param_groups"], out["param_groups"])):
        assert g_out["lr"] == g_in["lr"] and g_out["weight_decay"] == g_in["weight_decay"]
        assert ("block_size" in g_out) == isinstance(stores[gi], LowBit)
    # The converted file loads into the target class as the original does (its load converts too).
    a, b = make_params(), make_params()
    opt_a, opt_b = build(CASES[dst], groups(a)), build(CASES[dst], groups(b))
    opt_a.load_state_dict(out)
    opt_b.load_state_dict(sd)
    for p, q in zip(a, b):
        assert opt_a.state[p].keys() == opt_b.state[q].keys()
        for key, x in opt_a.state[p].items():
            y = opt_b.state[q][key]
            if isinstance(x, QuantizedState):
                assert torch.equal(x.codes, y.codes) and torch.equal(x.absmax, y.absmax)
            else:
                assert torch.equal(x, y)
    # ... and training goes on from it.
    start = [p.detach().clone() for p in a]
    feed(opt_a, a, 1, start=2)
    assert {int(st["step"]) for st in opt_a.state.values()} == {3}
    assert all(torch.isfinite(p).all() for p in a) and any(not torch.equal(p, s) for p, s in zip(a, start))
    assert state_dict_layout(opt_a.state_dict()) == dst


def test_convert_across_families_is_refused_naming_both() -> None:
    for source in OPTIMIZERS:
        _, sd = trained(source.name, steps=1)
        for target in OPTIMIZERS:
            if target.cls.family == source.cls.family:
                continue
            with pytest.raises(ValueError) as err:
                convert_state_dict(sd, target.name)
            line = str(err.value)
            assert "\n" not in line and f"cannot convert the {source.name} state_dict to {target.name}" in line, line
            assert f"{source.cls.__name__} runs the {source.cls.family} rule" in line, line


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
    with pytest.raises(ValueError, match="unknown leanopt optimizer 'adamw2bit'"):
        convert_state_dict(sd, "adamw2bit")
    with pytest.raises(ValueError, match="block_size"):
        convert_state_dict(sd, "adamw8bit", block_size=0)
    with pytest.raises(ValueError, match="min_quant_size"):
        convert_state_dict(sd, "adamw4bit", min_quant_size=-1)


@pytest.mark.parametrize("dst", ["adamw", "adamw8bit", "adamw4bit"])
def test_torch_adamw_file_converts_to_every_adamw_member(dst: str) -> None:
    params = make_params()
    opt = torch.optim.AdamW(groups(params), lr=1e-3)
    feed(opt, params, 3)
    out = through_file(convert_state_dict(through_file(opt.state_dict()), dst))
    assert state_dict_layout(out) == dst and out["param_groups"][0]["foreach"] is None  # torch's options kept
    resumed = clone(params)
    target = REGISTRY[dst](groups(resumed), backend="reference")
    target.load_state_dict(out)
    feed(target, resumed, 1, start=3)


# ---- load_state_dict: a state continues only in its own family -----------------------------------
def refused_message(case: OptimizerCase, sd: dict) -> str:
    """Load ``sd`` into a fresh ``case`` optimizer: it must raise a one-line ValueError and leave the
    optimizer as it was (no state, its own hyper-parameters); returns the message."""
    opt = build(case, groups(make_params()))
    options = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    with pytest.raises(ValueError) as err:
        opt.load_state_dict(sd)
    assert len(opt.state) == 0 and [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == options
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{case.cls.__name__}.load_state_dict: "), message
    return message


def loads(case: OptimizerCase, sd: dict) -> torch.optim.Optimizer:
    params = make_params()
    opt = build(case, groups(params))
    opt.load_state_dict(sd)
    assert len(opt.state) == len(params) and {int(st["step"]) for st in opt.state.values()} == {2}
    feed(opt, params, 1, start=2)  # and it goes on
    return opt


def test_a_state_of_another_family_is_refused_on_load_declared_or_not() -> None:
    for source in OPTIMIZERS:
        _, sd = trained(source.name)
        members = [cls.__name__ for cls in REGISTRY.values() if cls.family == source.cls.family]
        for target in OPTIMIZERS:
            if target.cls.family == source.cls.family:
                loads(target, sd)  # its own and its siblings' states load (and convert),
                loads(target, undeclared(sd))  # and so they do without the name: recognized by their states
                continue
            message = refused_message(target, sd)
            assert f"saved by {source.cls.__name__} ({source.cls.family} rule)" in message, message
            assert f"{target.cls.__name__} runs the {target.cls.family} rule" in message, message
            # Without the name, the state is read as the family its states show, and only as that.
            message = refused_message(target, undeclared(sd))
            assert "declares no optimizer" in message and f"({source.cls.family} rule)" in message, message
            assert f"load it into leanopt.{', '.join(members)}" in message, message


def test_a_state_declaring_another_family_is_refused_naming_both() -> None:
    # The case: a leanopt AdamW state whose groups say "lion" continued as Lion (exp_avg
    # taken for the momentum, exp_avg_sq dropped, AdamW's lr and betas kept).
    adamw = next(c for c in OPTIMIZERS if c.cls is leanopt.AdamW)
    lion = next(c for c in OPTIMIZERS if c.cls is leanopt.Lion)
    message = refused_message(lion, relabeled(trained(adamw.name)[1], lion.name))
    assert "declares 'lion'" in message and "'exp_avg_sq' has no place" in message, message
    assert "its states are leanopt AdamW's (the adamw rule)" in message, message
    for source in OPTIMIZERS:
        _, sd = trained(source.name)
        for target in OPTIMIZERS:
            if target.cls.family == source.cls.family:
                continue
            # Refused by its options or its state keys; either way naming what the states are.
            message = refused_message(target, relabeled(sd, target.name))
            assert f"(the {source.cls.family} rule)" in message, message
            with pytest.raises(ValueError, match=rf"\(the {source.cls.family} rule\)"):  # convert reads it the same way
                convert_state_dict(relabeled(sd, target.name), target.name)


def test_peer_files_load_into_their_family_only() -> None:
    params = make_params()
    torch_opt = torch.optim.AdamW(groups(params), lr=1e-3)
    feed(torch_opt, params, 2)
    sd = through_file(torch_opt.state_dict())
    family = REGISTRY[state_dict_layout(sd)].family
    for case in OPTIMIZERS:
        if case.cls.family == family:
            opt = loads(case, sd)
            assert opt.param_groups[0]["lr"] == 1e-3 and opt.param_groups[0]["optimizer"] == case.name
        else:
            message = refused_message(case, sd)
            assert "declares no optimizer" in message and f"({family} rule)" in message, message


def test_transformers_adafactor_file_loads_into_adafactor_only() -> None:
    hf = pytest.importorskip("transformers.optimization")
    params = make_params()
    hf_opt = hf.Adafactor(groups(params), lr=1e-3, relative_step=False, scale_parameter=False, beta1=0.9)
    feed(hf_opt, params, 2)
    sd = through_file(hf_opt.state_dict())
    for case in OPTIMIZERS:
        if isinstance(case.cls, type) and issubclass(case.cls, leanopt.Adafactor):
            loads(case, sd)
        else:
            message = refused_message(case, sd)
            assert "declares no optimizer" in message and "Adafactor (transformers)" in message, message


def test_a_torch_sgd_file_converts_within_its_family_and_back() -> None:
    """torch.optim.SGD saves a momentum_buffer and no step (leanopt's SGD fills it on load): its
    file converts to SGD8bit and back to a state torch's SGD loads, within 8-bit error."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 128))
    sgd = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    for _ in range(3):
        p.grad = torch.randn_like(p)
        sgd.step()
    saved = sgd.state_dict()
    assert state_dict_layout(saved) == "sgd"
    low = convert_state_dict(saved, "sgd8bit")
    back = convert_state_dict(low, "sgd")
    again = torch.optim.SGD([torch.nn.Parameter(p.detach().clone())], lr=0.1, momentum=0.9)
    again.load_state_dict(back)
    before, after = saved["state"][0]["momentum_buffer"], next(iter(again.state.values()))["momentum_buffer"]
    assert (after - before).abs().max() <= 0.02 * before.abs().max()
