"""Odd blocks of 4-bit states.

4-bit codes are packed two to a byte in flat order, so an odd block would start mid-byte every
other block: the compiled CPU path (rows of ``block / 2`` bytes), the native kernel and a
state's tail or shard (views at a byte offset) all need whole bytes per block. Odd 4-bit blocks
are refused where the options are checked (the constructor, ``add_param_group``,
``convert_state_dict``, a loaded group) with a ``ValueError`` naming ``block_size``; 8-bit
states take any block size. Every low-bit optimizer of the registry, by its ``state_bits``."""

from __future__ import annotations

import pytest
import torch

from leanopt.checkpoint import convert_state_dict
from leanopt.optim.lowbit import LowBit
from leanopt.quant import BlockFormat, QuantizedState, format_by_name
from registry import OPTIMIZERS, OptimizerCase

LOW_BIT = [c for c in OPTIMIZERS if issubclass(c.cls, LowBit)]
FOUR_BIT = [c for c in LOW_BIT if c.cls.state_bits == 4]
EIGHT_BIT = [c for c in LOW_BIT if c.cls.state_bits == 8]


def test_the_registry_has_both_widths() -> None:
    assert FOUR_BIT and EIGHT_BIT


def _param(n: int = 64 * 255) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(0)))


def _steps(opt: torch.optim.Optimizer, p: torch.nn.Parameter, steps: int = 2) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


@pytest.mark.parametrize("case", FOUR_BIT, ids=str)
@pytest.mark.parametrize("block_size", [127, 1, 255])
def test_odd_4bit_blocks_are_refused_by_the_constructor(case: OptimizerCase, block_size: int) -> None:
    with pytest.raises(ValueError, match=rf"Invalid block_size: {block_size} .*even"):
        case.cls(case.param_groups([_param()]), **case.kwargs, block_size=block_size)


@pytest.mark.parametrize("case", FOUR_BIT, ids=str)
def test_odd_4bit_blocks_are_refused_in_a_param_group(case: OptimizerCase) -> None:
    opt = case.cls(case.param_groups([_param()]), **case.kwargs)
    with pytest.raises(ValueError, match=r"Invalid block_size: 127 .*even"):
        opt.add_param_group({"params": [_param(300)], "block_size": 127})


@pytest.mark.parametrize("case", FOUR_BIT, ids=str)
def test_odd_4bit_blocks_are_refused_by_convert(case: OptimizerCase) -> None:
    p = _param()
    opt = case.cls(case.param_groups([p]), **case.kwargs, min_quant_size=0)
    _steps(opt, p)
    with pytest.raises(ValueError, match=r"param group 0: Invalid block_size: 127 .*even"):
        convert_state_dict(opt.state_dict(), case.name, block_size=127)


@pytest.mark.parametrize("case", FOUR_BIT, ids=str)
def test_a_checkpoint_with_odd_4bit_states_loads_into_the_optimizers_blocks(case: OptimizerCase) -> None:
    """States saved in odd 4-bit blocks (hand-made, or by a leanopt that took them) are
    converted on load to the optimizer's own blocks, and it steps on the default backend."""
    p = _param()
    opt = case.cls(case.param_groups([p]), **case.kwargs, min_quant_size=0)
    _steps(opt, p)
    saved = opt.state_dict()
    for st in saved["state"].values():
        for key, value in st.items():
            if isinstance(value, dict) and QuantizedState.is_state_dict(value):
                odd = BlockFormat(format_by_name(value["format"]).code, 127)
                st[key] = odd.from_dense(QuantizedState.from_state_dict(value).dequantize()).to_state_dict()
                assert st[key]["format"].endswith("/b127")
    fresh = case.cls(case.param_groups([p]), **case.kwargs, min_quant_size=0)
    fresh.load_state_dict(saved)
    for st in fresh.state.values():
        for value in st.values():
            if isinstance(value, QuantizedState):
                assert value.format.block_size == fresh.param_groups[0]["block_size"]
    _steps(fresh, p)
    assert torch.isfinite(p).all()


def _steps_as_the_reference(case: OptimizerCase, block_size: int) -> None:
    """Two steps in blocks of ``block_size`` on the default CPU backend match the reference."""
    params = [_param(), _param()]
    opts = [case.cls([params[0]], **case.kwargs, block_size=block_size, min_quant_size=0),
            case.cls([params[1]], **case.kwargs, block_size=block_size, min_quant_size=0, backend="reference")]  # fmt: skip
    for opt, p in zip(opts, params):
        _steps(opt, p)
    torch.testing.assert_close(params[0], params[1], rtol=0, atol=2e-6 * params[1].abs().max().item() + 1e-7)


@pytest.mark.parametrize("case", FOUR_BIT, ids=str)
def test_even_4bit_blocks_step_as_the_reference(case: OptimizerCase) -> None:
    """126: even but no power of two, on the default CPU backend (the path that crashed for
    127) as on the reference."""
    _steps_as_the_reference(case, 126)


@pytest.mark.parametrize("case", EIGHT_BIT, ids=str)
def test_odd_8bit_blocks_are_taken(case: OptimizerCase) -> None:
    """A code a byte: any block size packs, so 8-bit states keep taking odd ones."""
    _steps_as_the_reference(case, 127)
