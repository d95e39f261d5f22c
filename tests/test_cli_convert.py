"""`leanopt convert`: a saved AdamW state between fp32, 8-bit and 4-bit, checked by loading it."""

from __future__ import annotations

import torch

import leanopt
from leanopt.cli import main


def saved_adamw(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(16, 64)).square().mean().backward()
        opt.step()
    path = tmp_path / "optimizer.pt"
    torch.save(opt.state_dict(), path)
    return model, path


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


def test_compare_subcommand_forwards_its_arguments(capsys) -> None:
    assert main(["compare", "--help"]) == 0
    assert "--quick" in capsys.readouterr().out
    assert main(["compare", "--optimizers", "no-such-optimizer"]) == 2
