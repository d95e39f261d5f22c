"""`leanopt convert`: a saved state to another member of the family it declares (fp32, 8-bit,
4-bit), checked by loading it; another family refused in one line."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

import leanopt
from leanopt.cli import build_parser, main
from leanopt.optim import REGISTRY
from leanopt.quant import QuantizedState
from registry import OPTIMIZERS

CASES = {case.name: case for case in OPTIMIZERS}


def _trained_and_saved(tmp_path, make, steps: int):
    """A small model (8192-element first weight: quantized by the low-bit optimizers), ``steps``
    steps of ``make(params)``, its state saved to tmp_path/optimizer.pt."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 4))
    opt = make(model.parameters())
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 64)).square().mean().backward()
        opt.step()
    path = tmp_path / "optimizer.pt"
    torch.save(opt.state_dict(), path)
    return model, path


def saved_adamw(tmp_path):
    return _trained_and_saved(tmp_path, lambda ps: torch.optim.AdamW(ps, lr=1e-3), 3)


def test_convert_to_8bit_shrinks_and_loads(tmp_path, capsys) -> None:
    model, src = saved_adamw(tmp_path)
    dst = tmp_path / "optimizer8.pt"
    assert main(["convert", str(src), str(dst), "--to", "adamw8bit"]) == 0
    assert "adamw8bit" in capsys.readouterr().out
    sd = torch.load(dst, weights_only=True)
    opt8 = leanopt.AdamW8bit(model.parameters(), lr=1e-3)
    opt8.load_state_dict(sd)
    first = model[0].weight  # 8192 elements: quantized
    assert opt8.state[first]["exp_avg"].codes.dtype == torch.uint8
    # 8192-element weight: 1 B codes + a 4 B scale per 256, per moment; the small ones stay fp32
    small = 128 + 128 * 4 + 4
    assert leanopt.measure(opt8).bytes == 2 * (8192 + 4 * 32) + 8 * small + 4 * 4
    assert leanopt.measure(opt8).bytes < 0.35 * (8 * (8192 + small) + 4 * 4)
    # ...and back to fp32, loadable by torch's own AdamW
    back = tmp_path / "optimizer32.pt"
    assert main(["convert", str(dst), str(back), "--to", "adamw"]) == 0
    torch.optim.AdamW(model.parameters()).load_state_dict(torch.load(back, weights_only=True))


def test_convert_refuses_to_overwrite_and_bad_input(tmp_path, capsys) -> None:
    _, src = saved_adamw(tmp_path)
    dst = tmp_path / "out.pt"
    dst.write_bytes(b"keep me")
    assert main(["convert", str(src), str(dst), "--to", "adamw4bit"]) == 2
    assert dst.read_bytes() == b"keep me"
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    assert main(["convert", str(garbage), str(tmp_path / "x.pt"), "--to", "adamw"]) == 2
    assert main(["convert", str(src), str(tmp_path / "y.pt"), "--to", "sgd"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("leanopt: error:") for line in err)


def saved(tmp_path, name: str):
    """A small model and ``name``'s state after 2 steps, saved to tmp_path/optimizer.pt."""
    case = CASES[name]
    return _trained_and_saved(tmp_path, lambda ps: case.cls(ps, **{**case.kwargs, "backend": "reference"}), 2)


def test_to_takes_every_registered_name() -> None:
    parser = build_parser()
    for name in REGISTRY:
        assert parser.parse_args(["convert", "a.pt", "b.pt", "--to", name.upper()]).to == name


@pytest.mark.parametrize(
    "src,dst", [("lion8bit", "lion4bit"), ("lion4bit", "lion"), ("lion", "lion8bit"), ("ademamix", "ademamix8bit"),
                ("ademamix8bit", "ademamix"), ("adamw4bit", "adamw8bit")],
)  # fmt: skip
def test_convert_by_declared_name_loads_into_the_target(src: str, dst: str, tmp_path, capsys) -> None:
    model, path = saved(tmp_path, src)
    out = tmp_path / "converted.pt"
    assert main(["convert", str(path), str(out), "--to", dst]) == 0
    assert f"({src}, " in capsys.readouterr().out.split("->")[0]
    sd = torch.load(out, weights_only=True)
    assert {g["optimizer"] for g in sd["param_groups"]} == {dst}
    assert main(["inspect", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["optimizer"] == dst
    case = CASES[dst]
    opt = case.cls(case.param_groups(model), **{**case.kwargs, "backend": "reference"})
    opt.load_state_dict(sd)
    quantized = isinstance(opt.state[model[0].weight][opt.state_keys(opt.param_groups[0])[0]], QuantizedState)
    assert quantized == (getattr(case.cls, "state_bits", None) is not None)
    model(torch.randn(16, 64)).square().mean().backward()
    opt.step()
    assert {int(st["step"]) for st in opt.state.values()} == {3}


def test_convert_to_another_family_is_one_line_naming_both(tmp_path, capsys) -> None:
    _, path = saved(tmp_path, "lion8bit")
    out = tmp_path / "adamw.pt"
    assert main(["convert", str(path), str(out), "--to", "adamw"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"leanopt: error: {path}: cannot convert the lion8bit state_dict to adamw"), err
    assert "Lion8bit runs the lion rule, AdamW the adamw rule" in err[0] and "internal error" not in err[0]
    assert not out.exists()


def test_compare_subcommand_forwards_its_arguments(capsys) -> None:
    assert main(["compare", "--help"]) == 0
    assert "--quick" in capsys.readouterr().out
    assert main(["compare", "--optimizers", "no-such-optimizer"]) == 2


# ---- hostile checkpoints and dense results that own their memory ----------------------------
def _quantized_sd(shape, fmt_name="pow3-s8/b256"):
    from leanopt.quant import format_by_name

    g = torch.Generator().manual_seed(0)
    fmt = format_by_name(fmt_name)
    m = fmt.from_dense(torch.randn(shape, generator=g)).to_state_dict()
    v = format_by_name("pow6-u8/b256").from_dense(torch.rand(shape, generator=g)).to_state_dict()
    return {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": m, "exp_avg_sq": v}},
        "param_groups": [{"params": [0], "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
                          "amsgrad": False, "maximize": False, "quantize": True, "block_size": 256,
                          "min_quant_size": 4096, "state_bits": 8}],
    }


def test_convert_refuses_a_hostile_block_size_naming_the_entry(tmp_path, capsys) -> None:
    sd = _quantized_sd((4096,))
    # One block of 2**24 elements for a 4096-element state: codes and absmax lengths even agree.
    sd["state"][0]["exp_avg"].update(format="pow3-s8/b16777216", absmax=torch.ones(1))
    src, dst = tmp_path / "hostile.pt", tmp_path / "out.pt"
    torch.save(sd, src)
    assert main(["convert", str(src), str(dst), "--to", "adamw"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'exp_avg' of param 0" in err[0] and "block" in err[0], err
    assert "internal error" not in err[0]
    assert not dst.exists()


def test_converted_dense_state_holds_exactly_its_elements(tmp_path, capsys) -> None:
    # 33 x 257 = 8,481 elements: 34 blocks of 256, the last one padded.
    src, dst = tmp_path / "q.pt", tmp_path / "dense.pt"
    torch.save(_quantized_sd((33, 257)), src)
    assert main(["convert", str(src), str(dst), "--to", "adamw"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(dst), "--json"]) == 0
    data = __import__("json").loads(capsys.readouterr().out)
    assert data["bytes"] == 2 * 4 * 33 * 257 + 4  # two fp32 moments and the step
    assert data["bytes_per_param"] < 8.001  # 8.21 when the padded buffer was kept


# ---- the write of DST -------------------------------------------------------------------------
def _leftovers(folder, *expected):
    return sorted(p.name for p in folder.iterdir() if p.name not in expected)


def test_convert_leaves_an_existing_dst_tmp_alone(tmp_path, capsys) -> None:
    _, src = saved_adamw(tmp_path)
    dst = tmp_path / "out.pt"
    (tmp_path / "out.pt.tmp").write_bytes(b"someone else's file")
    assert main(["convert", str(src), str(dst), "--to", "adamw8bit"]) == 0
    assert (tmp_path / "out.pt.tmp").read_bytes() == b"someone else's file"
    assert _leftovers(tmp_path, "optimizer.pt", "out.pt", "out.pt.tmp") == []
    torch.load(dst, weights_only=True)


def test_convert_into_a_missing_folder_is_a_one_line_error(tmp_path, capsys) -> None:
    _, src = saved_adamw(tmp_path)
    assert main(["convert", str(src), str(tmp_path / "nope" / "out.pt"), "--to", "adamw8bit"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("leanopt: error:") and "no such folder" in err[0], err
    assert "internal error" not in err[0]


def test_convert_failed_write_removes_its_temporary(tmp_path, capsys, monkeypatch) -> None:
    import errno

    _, src = saved_adamw(tmp_path)
    dst = tmp_path / "out.pt"
    dst.write_bytes(b"old")
    real_save = torch.save

    def disk_full(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)  # half of it made it to the disk
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    assert main(["convert", str(src), str(dst), "--to", "adamw8bit", "--force"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no space left" in err[0].lower() and str(dst) in err[0], err
    assert dst.read_bytes() == b"old"  # DST is replaced only by a complete file
    assert _leftovers(tmp_path, "optimizer.pt", "out.pt") == []

    def read_only(obj, f, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(torch, "save", read_only)
    assert main(["convert", str(src), str(tmp_path / "new.pt"), "--to", "adamw8bit"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "permission denied" in err[0].lower(), err
    assert _leftovers(tmp_path, "optimizer.pt", "out.pt") == []


# ---- a disk that fills during the write: torch's writer raises RuntimeError ----------------------
# Tests of this block: D's. Torch's zip writer turns the failed write() into "[enforce fail at
# inline_container.cc:672] unexpected pos ..."; the cause must still be named, from the errno.
@pytest.fixture
def small_tmpfs(tmp_path):
    """A 64 KiB tmpfs at tmp_path/small (skipped where mounting is not permitted)."""
    from tmpfs import mounted

    with mounted(tmp_path / "small") as folder:
        yield folder


def test_convert_onto_a_full_tmpfs_names_the_cause(small_tmpfs, tmp_path, capsys) -> None:
    _, src = saved_adamw(tmp_path)  # an fp32 AdamW state of ~75 KB: more than the 64 KiB there
    dst = small_tmpfs / "optimizer.pt"
    dst.write_bytes(b"old")
    assert main(["convert", str(src), str(dst), "--to", "adamw", "--force"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("leanopt: error: "), err
    assert "no space left on" in err[0] and str(dst) in err[0] and str(small_tmpfs) in err[0], err[0]
    assert "internal error" not in err[0] and "enforce fail" not in err[0], err[0]
    assert dst.read_bytes() == b"old" and sorted(p.name for p in small_tmpfs.iterdir()) == ["optimizer.pt"]


def test_convert_over_the_file_size_limit_names_the_cause(tmp_path) -> None:
    """Unprivileged, the same writer failure: RLIMIT_FSIZE (ulimit -f) in a child process, with
    SIGXFSZ ignored so that write() returns EFBIG instead of killing it."""
    import subprocess
    import sys

    _, src = saved_adamw(tmp_path)
    dst = tmp_path / "out.pt"
    script = (
        "import resource, signal, sys\n"
        "from leanopt.cli import main\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (16384, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
        f"sys.exit(main(['convert', {str(src)!r}, {str(dst)!r}, '--to', 'adamw']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("leanopt: error: "), proc.stderr[-2000:]
    assert "file too large" in lines[0] and "16,384" in lines[0] and str(dst) in lines[0], lines[0]
    assert "internal error" not in lines[0]
    assert not dst.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["optimizer.pt"]


# ---- --state-dtype: bf16 moments written by convert -------------------------------------------------
def test_state_dtype_bfloat16_writes_bf16_moments_that_continue(tmp_path, capsys) -> None:
    """8-bit -> AdamW with bf16 moments: 2 B per element per moment (the small params too), loaded
    by AdamW(state_dtype=torch.bfloat16), and its next steps stay within bf16's rounding of the
    fp32 conversion's."""
    model, src = _trained_and_saved(tmp_path, lambda ps: leanopt.AdamW8bit(ps, lr=1e-3), 3)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        dst = tmp_path / f"to-{dtype}.pt"
        assert main(["convert", str(src), str(dst), "--to", "adamw", "--state-dtype", dtype]) == 0
        sd = torch.load(dst, weights_only=True)
        assert {g["state_dtype"] for g in sd["param_groups"]} == {dtype}
        assert {v.dtype for s in sd["state"].values() for k, v in s.items() if k != "step"} == {getattr(torch, dtype)}
        copy = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 4))
        copy.load_state_dict(model.state_dict())
        opt = leanopt.AdamW(copy.parameters(), lr=1e-3, state_dtype=getattr(torch, dtype))
        opt.load_state_dict(sd)
        n = sum(p.numel() for p in copy.parameters())
        assert leanopt.measure(opt).bytes == (8 if dtype == "float32" else 4) * n + 4 * 4
        torch.manual_seed(1)
        for _ in range(5):
            opt.zero_grad()
            copy(torch.randn(16, 64)).square().mean().backward()
            opt.step()
        runs[dtype] = torch.cat([p.detach().flatten() for p in copy.parameters()])
    moved = (runs["float32"] - torch.cat([p.detach().flatten() for p in model.parameters()])).abs().max()
    assert 0 < (runs["bfloat16"] - runs["float32"]).abs().max() < 0.05 * moved
    capsys.readouterr()


# Every registered optimizer without state_dtype= (factored states), and torch's AdamW as a target.
_NO_STATE_DTYPE = [c.name for c in OPTIMIZERS if "state_dtype" not in inspect.signature(c.cls).parameters]


@pytest.mark.parametrize("src_name, to, says", [
    ("adamw8bit", "torch-adamw", "torch-adamw keeps its states in each param's dtype"),
    *[(name, name, f"{CASES[name].cls.__name__} has no state_dtype option") for name in _NO_STATE_DTYPE],
])
def test_state_dtype_refused_where_the_target_has_none(src_name: str, to: str, says: str, tmp_path, capsys) -> None:
    _, src = saved(tmp_path, src_name)
    dst = tmp_path / "out.pt"
    assert main(["convert", str(src), str(dst), "--to", to, "--state-dtype", "bfloat16"]) == 2
    err = capsys.readouterr().err
    assert says in err and "state_dtype=bfloat16" in err and len(err.strip().splitlines()) == 1
    assert not dst.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["optimizer.pt"]
    assert main(["convert", str(src), str(dst), "--to", to, "--state-dtype", "float16"]) == 2
    assert "invalid choice: 'float16'" in capsys.readouterr().err and not dst.exists()
