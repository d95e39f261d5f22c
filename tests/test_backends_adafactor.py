"""Every Adafactor backend against the reference rule: fresh random inputs, every code path.

Each case runs ``leanopt.Adafactor(backend=...)`` and ``leanopt.Adafactor(backend="reference")``
side by side for ``STEPS`` steps on the same gradients (random scales so the clip engages on
some steps and not others, zero rows, params that miss steps) and compares params and states.

Tolerances (``_check``):

* fp32 tensors (fp32 params, and the fp32 states of every param): elementwise
  ``|a - b| <= RTOL * max(|b|, RMS(b))`` with ``RTOL = 1e-5``: relative, except that elements
  far below the tensor's RMS (an ``exp_avg`` entry that cancelled to ~0) are judged at the
  tensor's scale. The backends sum rows, columns and ``sum(u^2)`` in other orders than the
  reference, so they differ from it by rounding, not more.
* bf16/fp16 params: every element within 1 ulp of the reference's (the spacing of the param
  dtype at the reference value), and at most ``LOW_PRECISION_FLIP_SHARE`` of the elements
  differ at all: an fp32 value within rounding of a bf16/fp16 tie may round either way.
* ``backend="reference"`` against itself: bit-identical (the rule is deterministic).
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

import leanopt
from leanopt import kernels
from leanopt.kernels import cpu_adafactor as cpu

STEPS = 10
RTOL = 1e-5
LOW_PRECISION_FLIP_SHARE = 0.02

# 0-D, 1-element, a length just over one Triton chunk (2048), 2-D with 1-sized dims, 3-D and
# 4-D (factored over the last two dims), and empty ones.
SHAPES = [(), (1,), (2049,), (37,), (1, 1), (9, 1), (1, 40), (5, 6), (45, 70), (3, 20, 33), (2, 1, 3, 5), (0, 3), (4, 0, 2)]
# The Triton interpreter runs a program at a time in Python: fewer, smaller tensors.
TRITON_SHAPES = [(), (2049,), (1, 40), (5, 6), (3, 20, 33), (0, 3)]
# Shapes spanning several tiles / finalize programs once the tiles are made tiny.
MULTI_TILE_SHAPES = [(37,), (20, 35), (2, 9, 17)]


def _flag_grid() -> list[dict]:
    grid = []
    for scale_parameter, (relative_step, warmup_init), beta1, weight_decay in itertools.product(
        (True, False), ((True, False), (True, True), (False, False)), (None, 0.9), (0.0, 0.01)
    ):
        kw = dict(scale_parameter=scale_parameter, relative_step=relative_step, warmup_init=warmup_init)
        kw |= dict(beta1=beta1, weight_decay=weight_decay)
        if not relative_step:
            kw["lr"] = 1e-2
        grid.append(kw)
    return grid


FLAGS = _flag_grid()
DEFAULT = dict()
EVERYTHING = dict(beta1=0.9, weight_decay=0.01, warmup_init=True)
EXTERNAL_LR = dict(lr=1e-2, relative_step=False, scale_parameter=False, weight_decay=0.01)
LOW_PRECISION = [torch.bfloat16, torch.float16]


def _id(kw: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in kw.items()) or "defaults"


def _seed(request: pytest.FixtureRequest) -> int:
    return zlib.crc32(request.node.nodeid.encode())


def _run(backend: str, shapes: list, dtypes: list[torch.dtype], kw: dict, seed: int, steps: int = STEPS):
    gen = torch.Generator().manual_seed(seed)
    init = [(torch.randn(s, generator=gen) * 2.0 ** (i % 3 - 1)).to(dtypes[i % len(dtypes)]) for i, s in enumerate(shapes)]
    ours = [p.clone().requires_grad_() for p in init]
    ref = [p.clone().requires_grad_() for p in init]
    opt = leanopt.Adafactor(ours, backend=backend, **kw)
    ref_opt = leanopt.Adafactor(ref, backend="reference", **kw)
    for t in range(steps):
        for i, (a, b) in enumerate(zip(ours, ref)):
            if (t + i) % 5 == 4:  # params miss some steps: each counts its own
                a.grad = b.grad = None
                continue
            scale = 10.0 ** torch.empty(()).uniform_(-3, 1, generator=gen).item()
            g = torch.randn(a.shape, generator=gen) * scale
            if g.ndim >= 2 and g.shape[-2] > 1 and t % 3 == 0:
                g[..., 0, :] = 0.0  # a zero row now and then
            if i % 2 == 0 and g.numel():
                # A column (1-D: an element) always zero: its second moment is eps1 alone.
                g.view(-1, g.shape[-1] if g.ndim else 1)[:, 0] = 0.0
            a.grad, b.grad = g.to(a.dtype), g.to(a.dtype).clone()
        opt.step()
        ref_opt.step()
    return ours, opt, ref, ref_opt


def _close_fp32(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype == torch.float32, what
    if b.numel() == 0:
        return
    a64, b64 = a.detach().double(), b.detach().double()
    rms = b64.square().mean().sqrt()
    err = ((a64 - b64).abs() / torch.maximum(b64.abs(), rms).clamp_min(1e-300)).max().item()
    assert err <= RTOL, f"{what}: error {err:.3g} > {RTOL}"


def _close_low_precision(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, what
    if b.numel() == 0:
        return
    ulp = (torch.nextafter(b, torch.full_like(b, float("inf"))) - b).abs().double()
    diff = (a.double() - b.double()).abs()
    assert (diff <= ulp).all(), f"{what}: {(diff / ulp).max().item():.3g} ulp apart"
    share = (diff > 0).double().mean().item()
    assert share <= LOW_PRECISION_FLIP_SHARE, f"{what}: {share:.1%} of elements differ"


def _check(ours, opt, ref, ref_opt, *, exact: bool = False) -> None:
    for i, (a, b) in enumerate(zip(ours, ref)):
        what = f"param {i} {tuple(b.shape)} {b.dtype}"
        state, ref_state = opt.state[a], ref_opt.state[b]
        assert set(state) == set(ref_state), what
        assert torch.equal(state["step"], ref_state["step"]), what
        tensors = [(a, b, "param")] + [(state[k], ref_state[k], k) for k in sorted(state) if k != "step"]
        for x, y, name in tensors:
            if exact:
                assert torch.equal(x, y), f"{what} {name}"
            elif y.dtype == torch.float32:
                _close_fp32(x, y, f"{what} {name}")
            else:
                _close_low_precision(x, y, f"{what} {name}")


# ---- reference: deterministic -------------------------------------------------------------------
def test_reference_is_deterministic(request: pytest.FixtureRequest) -> None:
    _check(*_run("reference", SHAPES, [torch.float32, torch.bfloat16], EVERYTHING, _seed(request)), exact=True)


# ---- cpu ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", [cpu.ADAFACTOR_BLOCK, 64], ids=["one-block", "many-blocks"])
@pytest.mark.parametrize("kw", FLAGS, ids=_id)
def test_cpu_matches_reference(kw: dict, block: int, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    monkeypatch.setattr(cpu, "ADAFACTOR_BLOCK", block)  # 64: most factored params in several blocks
    _check(*_run("cpu", SHAPES, [torch.float32], kw, _seed(request)))


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("kw", [DEFAULT, EVERYTHING, EXTERNAL_LR], ids=_id)
def test_cpu_low_precision_matches_reference(
    dtype: torch.dtype, kw: dict, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    monkeypatch.setattr(cpu, "ADAFACTOR_BLOCK", 64)
    _check(*_run("cpu", SHAPES, [dtype], kw, _seed(request)))


def test_cpu_mixed_dtypes_in_one_group(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    # fp32, bf16, fp16 and fp64 params of one group: one fp32 call (several param dtypes), one fp64.
    monkeypatch.setattr(cpu, "ADAFACTOR_BLOCK", 64)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
    ours, opt, ref, ref_opt = _run("cpu", SHAPES, dtypes, EVERYTHING, _seed(request))
    fp64 = [i for i, p in enumerate(ref) if p.dtype == torch.float64]
    for i in fp64:  # fp64: the same rule in fp64, compared at fp64 rounding
        keys = [k for k in opt.state[ours[i]] if k != "step"]
        for x, y in [(ours[i], ref[i])] + [(opt.state[ours[i]][k], ref_opt.state[ref[i]][k]) for k in keys]:
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    keep = [i for i in range(len(ref)) if i not in fp64]
    _check([ours[i] for i in keep], opt, [ref[i] for i in keep], ref_opt)


def test_cpu_is_the_auto_backend_on_cpu() -> None:
    p = torch.zeros(3, 4, requires_grad=True)
    row, col = torch.zeros(3), torch.zeros(4)
    assert kernels.select("auto", "adafactor", p, torch.ones(3, 4), [None, row, col, None]) == "cpu-adafactor"
    assert kernels.select("reference", "adafactor", p, torch.ones(3, 4), [None, row, col, None]) == "reference"


# ---- triton (under TRITON_INTERPRET=1 on the CPU) ----------------------------------------------
needs_triton = pytest.mark.skipif(not kernels.triton_available(), reason="triton not installed")


@needs_triton
@pytest.mark.parametrize(
    "dtypes, kw",
    [
        ([torch.float32], DEFAULT),
        ([torch.float32], EXTERNAL_LR),
        ([torch.bfloat16, torch.float16], EVERYTHING),
    ],
    ids=["fp32-defaults", "fp32-external-lr", "bf16-fp16-everything"],
)
def test_triton_matches_reference(dtypes: list, kw: dict, request: pytest.FixtureRequest) -> None:
    _check(*_run("triton", TRITON_SHAPES, dtypes, kw, _seed(request)))


@needs_triton
def test_triton_multi_tile(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    # Tiny tiles, so small shapes cover several tiles, row blocks, finalize programs and chunks.
    from leanopt.kernels import triton_adafactor as ta

    tiny = dict(TILE_ROWS=8, TILE_COLS=16, SUB_ROWS=4, FIN_ROWS=4, FIN_COLS=8, CHUNK=16, REDUCE_BLOCK=4)
    for name, value in tiny.items():
        monkeypatch.setattr(ta, name, value)
    _check(*_run("triton", MULTI_TILE_SHAPES, [torch.float32], dict(beta1=0.9, weight_decay=0.01), _seed(request), steps=4))


# The interpreter runs what CUDA may refuse to compile (it let through a name bound to a scalar
# in one branch and a vector in the other). Compile every kernel for sm_90 without a GPU, in a
# process without TRITON_INTERPRET.
_COMPILE_FOR_CUDA = r"""
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from leanopt.kernels import triton_adafactor as ta

INT64 = {"meta", "part_off", "chunk_start", "numels"}
INT32 = {"tile_tensor", "fin_tensor", "chunk_tensor"}
SCALARS = {"eps1", "clip_threshold", "beta1", "neg_weight_decay"}
CONSTS = dict(TR=ta.TILE_ROWS, TC=ta.TILE_COLS, SR=ta.SUB_ROWS, META=ta.META_WIDTH, HP=ta.HP_WIDTH,
              FR=ta.FIN_ROWS, FC=ta.FIN_COLS, CHUNK=ta.CHUNK, RB=ta.REDUCE_BLOCK, P_DTYPE=tl.bfloat16,
              G_DTYPE=tl.float16, SCALE_PARAMETER=True, BETA1=True, WEIGHT_DECAY=True)
kernels = [ta._factored_stats, ta._factored_finalize, ta._factored_update_sq, ta._scalars,
           ta._factored_apply, ta._unfactored_stats, ta._unfactored_apply]
for fn in kernels:
    names = fn.arg_names
    def kind(a):
        if a in CONSTS: return "constexpr"
        if a.endswith("_ptrs") or a in INT64: return "*i64"
        if a in INT32: return "*i32"
        if a in SCALARS: return "fp32"
        if a.endswith("_base"): return "i32"
        return "*fp32"
    src = ASTSource(fn, {a: kind(a) for a in names}, constexprs={(names.index(a),): CONSTS[a] for a in names if a in CONSTS})
    triton.compile(src, target=GPUTarget("cuda", 90, 32))
    print("compiled", fn.__name__)
"""


@needs_triton
def test_triton_kernels_compile_for_cuda() -> None:
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
    out = subprocess.run([sys.executable, "-c", _COMPILE_FOR_CUDA], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("compiled") == 7
