"""Files that `leanopt convert` must refuse before it writes anything, and the words and counts
of the commands that read files.

* Every entry of a param's state agrees with the others on the param's shape (an ``exp_avg`` of
  4 x 300 beside an ``exp_avg_sq`` of 7 x 7 is refused, whatever the optimizer).
* Every state tensor holds bytes of its own in the file: entries that share a storage, or a
  tensor whose stride of 0 makes one element millions, would turn a file of kilobytes into a
  conversion of gigabytes.
* The result loads into its target before it replaces DST: a file it would not load into is
  never written, and no temporary is left.
* The refusals say "the adamw state_dict", "an int"; ``inspect`` counts the same thing in its
  header and its rows, and says which.

DCP folders and the peers' files (bitsandbytes, torchao) have their own tables in
``tests/test_peer_convert.py``.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

import leanopt
from leanopt.checkpoint import convert_state_dict, family_members
from leanopt.cli import main
from leanopt.memory.inspect import inspect_state_dict
from leanopt.optim import REGISTRY
from leanopt.writing import write_atomically
from registry import OPTIMIZERS

ADAMW_TARGETS = [*family_members("adamw"), "torch-adamw"]


def torch_adamw_sd(sizes=(1200, 64), steps: int = 1) -> dict:
    """torch.optim.AdamW's state_dict over params of ``sizes`` elements after ``steps`` steps."""
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    opt = torch.optim.AdamW(params)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    return opt.state_dict()


def refused(tmp_path, capsys, sd: dict, *words: str, to: str = "adamw8bit") -> str:
    """``leanopt convert`` of ``sd`` (saved to a file) exits 2 with one line naming the file and
    holding ``words``, and leaves nothing in the folder but the source."""
    src, dst = tmp_path / "src.pt", tmp_path / "out.pt"
    torch.save(sd, src)
    code = main(["convert", str(src), str(dst), "--to", to, "--min-quant-size", "16"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"leanopt: error: {src}: "), err
    assert "internal error" not in err[0] and all(w in err[0] for w in words), err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.pt"]  # no DST, no temporary
    return err[0]


# ---- every entry against its param's shape ----------------------------------------------------------
@pytest.mark.parametrize("to", ADAMW_TARGETS)
def test_moments_of_two_shapes_are_refused_naming_them(to: str, tmp_path, capsys) -> None:
    sd = torch_adamw_sd()
    sd["state"][0].update(exp_avg=torch.randn(4, 300), exp_avg_sq=torch.rand(7, 7))
    refused(tmp_path, capsys, sd, "param 0", "'exp_avg' [4, 300]", "'exp_avg_sq' [7, 7]", to=to)


@pytest.mark.parametrize("case", OPTIMIZERS, ids=str)
def test_an_entry_of_another_shape_is_refused_for_every_optimizer(case, tmp_path, capsys) -> None:
    """One entry of a param's state replaced by a tensor of one more element: the states no
    longer agree on a param shape (optimizers whose states hold two or more shaped entries;
    one entry alone is a consistent state of another param)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 80), torch.nn.Linear(80, 4))
    opt = case.cls(case.param_groups(model), **{**case.kwargs, "backend": "reference"})
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 64)).square().mean().backward()
        opt.step()
    sd = opt.state_dict()
    shape = list(model[0].weight.shape)
    shapes = {k: list(v["shape"]) if isinstance(v, dict) else list(v.shape) for k, v in sd["state"][0].items()
              if k != "step" and isinstance(v, (dict, torch.Tensor))}  # fmt: skip
    whole = [k for k, s in shapes.items() if s == shape]  # Adafactor's row and column factors fit any matrix
    if len(shapes) < 2 or not whole:
        pytest.skip(f"{case.name} keeps no two entries of which one has the param's shape: nothing to disagree")
    key = whole[-1]
    numel = model[0].weight.numel()
    sd["state"][0][key] = torch.rand(numel + 1)
    for to in family_members(case.name):
        refused(tmp_path, capsys, sd, "param 0", "agree on no param shape", f"{key!r} [{numel + 1}]", to=to)


# ---- bytes of its own --------------------------------------------------------------------------------
def test_a_tensor_with_a_stride_of_zero_is_refused(tmp_path, capsys) -> None:
    # 4 bytes of file standing for 16 MiB of moments (a 1.3 KB file was converted, 5 MB written).
    sd = torch_adamw_sd(sizes=(2**22,), steps=0)
    sd["state"] = {0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(1).expand(2**22), "exp_avg_sq": torch.zeros(1).expand(2**22)}}
    refused(tmp_path, capsys, sd, "'exp_avg' of param 0", "4,194,304 elements held in 4 bytes")


def test_states_that_share_their_bytes_are_refused(tmp_path, capsys) -> None:
    # 32 params whose states are one pair of tensors: the file holds 0.5 MiB, the conversion 32 x.
    sd = torch_adamw_sd(sizes=(2**16,) * 32)
    one = sd["state"][0]
    sd["state"] = {pid: dict(one) for pid in range(32)}
    refused(tmp_path, capsys, sd, "share their bytes", "of param 0", "of param 1")
    # Two entries overlapping by half of one of them.
    sd = torch_adamw_sd(sizes=(2**16,))
    flat = torch.rand(3 * 2**15)
    sd["state"][0].update(exp_avg=flat[: 2**16], exp_avg_sq=flat[2**15:])
    refused(tmp_path, capsys, sd, "'exp_avg_sq' of param 0 and 'exp_avg' of param 0 share their bytes")


def test_states_that_are_disjoint_views_of_one_storage_convert(tmp_path, capsys) -> None:
    # A file whose moments are two halves of one buffer (an optimizer with flat state buffers) is sound.
    sd = torch_adamw_sd(sizes=(2**16,))
    flat = torch.rand(2 * 2**16)
    sd["state"][0].update(exp_avg=flat[: 2**16], exp_avg_sq=flat[2**16:])
    src, dst = tmp_path / "src.pt", tmp_path / "out.pt"
    torch.save(sd, src)
    assert main(["convert", str(src), str(dst), "--to", "adamw8bit"]) == 0, capsys.readouterr().err
    opt = leanopt.AdamW8bit([torch.nn.Parameter(torch.zeros(2**16))], backend="reference")
    opt.load_state_dict(torch.load(dst, weights_only=True))


# ---- the result loads into its target before it is written ---------------------------------------
@pytest.mark.parametrize("to", family_members("adamw"))
def test_a_result_its_target_would_refuse_is_not_written(to: str, tmp_path, capsys) -> None:
    # A state under an int id that no group lists: kept by the conversion as a hook's entry
    # would be, and refused by leanopt's load_state_dict ("state for unknown param id"; torch's
    # AdamW keeps such an entry).
    sd = torch_adamw_sd()
    sd["state"][7] = {k: v.clone() for k, v in sd["state"][0].items()}
    refused(tmp_path, capsys, sd, f"the result would not load into {to}", "unknown param id 7", to=to)


def test_a_written_file_that_fails_its_check_does_not_replace_dst(tmp_path) -> None:
    dst = tmp_path / "out.pt"
    dst.write_bytes(b"the old file")

    def check(path: str) -> None:
        assert open(path, "rb").read() == b"the new file"  # the written bytes, before the rename
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        write_atomically(dst, lambda f: f.write(b"the new file"), check=check)
    assert dst.read_bytes() == b"the old file" and sorted(p.name for p in tmp_path.iterdir()) == ["out.pt"]


def test_a_param_id_that_cannot_be_a_key_is_one_line(tmp_path, capsys) -> None:
    # It was "internal error: TypeError: unhashable type: 'list'" in both commands.
    sd = torch_adamw_sd()
    sd["param_groups"][0]["params"].append([1, 2])
    refused(tmp_path, capsys, sd, "param group 0 lists a list as a param id")
    torch.save(sd, tmp_path / "src.pt")
    assert main(["inspect", str(tmp_path / "src.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"leanopt: error: {tmp_path / 'src.pt'}: param group 0 lists a list as a param id (a param id is a number or a name)"]


# ---- words and counts -------------------------------------------------------------------------------
A_BEFORE_A_VOWEL = re.compile(r"\ba [aeiou]", re.IGNORECASE)


def test_refusals_put_no_a_before_a_vowel() -> None:
    """Every optimizer's state converted to each other family, with a rule it does not run, and
    with an entry of a wrong type: the message names the state_dict without "a adamw"."""
    messages = []
    for source in OPTIMIZERS:
        params = [torch.nn.Parameter(torch.randn(64, 80))]
        opt = source.cls(params, **{**source.kwargs, "backend": "reference"})
        params[0].grad = torch.randn(64, 80)
        opt.step()
        sd = opt.state_dict()
        other_rule = next(n for n, cls in REGISTRY.items() if cls.family != source.cls.family)
        attempts = [(n, {}) for n, cls in REGISTRY.items() if cls.family != source.cls.family]
        attempts += [(source.name, {"rule": REGISTRY[other_rule].family})]
        broken = {**sd, "state": {0: {**sd["state"][0], next(k for k in sd["state"][0] if k != "step"): 3}}}
        for state_dict, (to, kwargs) in [*((sd, a) for a in attempts), (broken, (source.name, {}))]:
            with pytest.raises(ValueError) as err:
                convert_state_dict(state_dict, to, **kwargs)
            messages.append(str(err.value))
    assert any("cannot convert the adamw state_dict" in m for m in messages)
    assert any("holds adamw states" in m for m in messages) and any("is an int" in m for m in messages)
    bad = [m for m in messages if A_BEFORE_A_VOWEL.search(m)]
    assert not bad, bad[:3]


def test_inspect_counts_param_elements_in_its_header_and_state_elements_in_its_rows(tmp_path, capsys) -> None:
    """AdamW8bit on a 512x1024 + 1024x80 model: the moments' rows counted codes and block scales
    (609,840) against the header's 607,472 param elements; now each moment counts one element
    per param element, and the labels say which is which."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 80), torch.nn.LayerNorm(80))
    opt = leanopt.AdamW8bit(model.parameters(), backend="reference")
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    assert main(["inspect", str(tmp_path / "optimizer.pt")]) == 0
    out = capsys.readouterr().out
    assert f"(6 with state, {n:,} param elements)" in out, out
    rows = {cells[0]: cells[2] for line in out.splitlines() if len(cells := [c.strip() for c in line.split("│")]) == 5}
    assert rows == {"step": "6", "exp_avg": f"{n:,}", "exp_avg_sq": f"{n:,}"}, out
    assert "elements: each state's own; a quantized state has one per param element" in out
    assert main(["inspect", str(tmp_path / "optimizer.pt"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["param_elements"] == n == data["by_key"]["exp_avg"]["elements"] == data["by_key"]["exp_avg_sq"]["elements"]
    assert data["elements"] == 2 * n + 6
    # Every optimizer: a key's elements are its states' own, quantized or not. On a smaller model
    # of the same kinds of params (a quantized 64 x 128 matrix, a dense 8 x 128 one, vectors): Muon's
    # reference orthogonalizes in bf16, tens of seconds on the 512 x 1024 matrix on a CPU without bf16
    # instructions.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 8), torch.nn.LayerNorm(8))
    model(torch.randn(2, 64)).sum().backward()
    for case in OPTIMIZERS:
        o = case.cls(case.param_groups(model), **{**case.kwargs, "backend": "reference"})
        o.step()
        want: dict[str, int] = {}
        for st in o.state.values():
            for key, value in st.items():
                want[key] = want.get(key, 0) + math.prod(value.shape)  # a QuantizedState's is its logical shape
        assert inspect_state_dict(o.state_dict()).elements_by_key == want, case.name
