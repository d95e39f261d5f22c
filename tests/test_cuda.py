"""The suite's CUDA cases: leanopt's Triton kernels on the GPU against the reference rule.

Every case is marked ``cuda`` and skipped where CUDA is absent (tests/conftest.py). On a GPU
machine, with Triton compiling for the device rather than interpreting::

    TRITON_INTERPRET=0 python3 -m pytest tests -m cuda

``scripts/gpu_check.sh`` runs exactly that. ``LEANOPT_CUDA_TESTS_ON_CPU=1`` runs the same cases
on the CPU at small sizes with Triton under its interpreter, so that the tests themselves are
checked without a GPU (the cases past 2^31 elements need a GPU and stay skipped there).

What is covered, each against ``backend="reference"`` run on the same device:

* parity of AdamW, AdamW8bit, AdamW4bit and Adafactor for fp32, bf16 and fp16 params, with the
  tolerances of tests/test_backends*.py (fp32 within rounding; bf16/fp16 within one ulp, nearly
  all equal; quantized: one fused step after identical reference steps, codes nearly all equal);
* one multi-tensor launch over many shapes and mixed dtypes in one param group;
* a tensor of more than 2^31 elements (bf16 params, 8/4-bit codes) stepped by the Triton
  kernels and compared, on block-aligned slices around 2^30 (bf16 byte offsets), 2^31 (element
  index) and the tail, with the reference run on those slices alone;
* ``state_dict`` round trips CUDA -> CPU -> CUDA through ``torch.save``/``torch.load``.
"""

from __future__ import annotations

import importlib.util
import io
import math
import os
import random
import zlib

import pytest
import torch

import leanopt
from leanopt import kernels
from leanopt.optim.elementwise import ElementwiseOptimizer
from leanopt.quant import QuantizedState
from registry import OPTIMIZERS

ON_CPU = os.environ.get("LEANOPT_CUDA_TESTS_ON_CPU") == "1"
DEVICE = torch.device("cpu" if ON_CPU else "cuda")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LR = 1e-2

pytestmark = pytest.mark.cuda


def _triton_problem() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        return "needs CUDA"
    if DEVICE.type == "cuda" and kernels.triton_interpreted():
        # leanopt's kernels read tensor addresses from device tables; the interpreter would
        # dereference those device addresses on the host.
        return "TRITON_INTERPRET=1 cannot run leanopt's kernels on CUDA tensors: run with TRITON_INTERPRET=0"
    if DEVICE.type == "cpu" and not kernels.triton_interpreted():
        return "the Triton kernels run on the CPU only under TRITON_INTERPRET=1"
    return None


needs_triton = pytest.mark.skipif(_triton_problem() is not None, reason=_triton_problem() or "")
needs_gpu = pytest.mark.skipif(ON_CPU, reason="needs a real GPU (not run with LEANOPT_CUDA_TESTS_ON_CPU=1)")


def _seed(request: pytest.FixtureRequest) -> int:
    return zlib.crc32(request.node.nodeid.encode())


def _id(kw: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in kw.items()) or "defaults"


# ---- tolerances (as in tests/test_backends.py, test_backends_quant.py, test_backends_adafactor.py)
def ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of ``x``'s dtype at each element of ``x``."""
    mant = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[x.dtype]
    mag = x.detach().float().abs().clamp_min(torch.finfo(x.dtype).tiny)
    return torch.exp2(torch.floor(torch.log2(mag)) - mant)


def close_share(p: torch.Tensor, r: torch.Tensor) -> tuple[float, float, float]:
    """(share of elements within the dense tolerance, share exactly equal, max |p - r|)."""
    diff = (p.detach().float() - r.detach().float()).abs()
    if r.dtype == torch.float32:
        close = diff <= 2e-6 * r.detach().abs().max() + 1e-7
    else:
        close = diff <= ulp(r) * 1.001
    return close.float().mean().item(), (diff == 0).float().mean().item(), diff.max().item()


def assert_param_close(p: torch.Tensor, r: torch.Tensor, what: str, *, min_share: float = 1.0, low_equal: float = 0.98) -> None:
    assert p.shape == r.shape and p.dtype == r.dtype and p.device == r.device, what
    if r.numel() == 0:
        return
    assert torch.isfinite(p).all() == torch.isfinite(r).all(), f"{what}: non-finite values differ"
    close, equal, worst = close_share(p, r)
    assert close >= min_share, f"{what}: {close:.4f} of elements within tolerance (max diff {worst:.3g})"
    if r.dtype != torch.float32:
        assert equal >= low_equal, f"{what}: only {equal:.4f} of elements equal"


def assert_state_close(got, want, what: str, *, rtol: float = 2e-6, code_share: float = 1.0) -> None:
    """Quantized: format and shape equal, codes equal on ``code_share``, scales within 1e-5;
    ``step``: equal; other tensors: within ``rtol`` of ``max(|want|, RMS(want))``."""
    assert type(got) is type(want), what
    if isinstance(want, QuantizedState):
        assert got.format == want.format and got.shape == want.shape, what
        assert got.device == want.device, what
        if want.numel == 0:
            return
        same = (got.codes == want.codes).float().mean().item()
        assert same >= code_share, f"{what}: codes equal on {same:.4f}"
        assert torch.allclose(got.absmax, want.absmax, rtol=1e-5, atol=0), f"{what}: block scales"
        return
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if want.numel() == 0:
        return
    if what.endswith(" step"):
        assert torch.equal(got, want), what
        return
    a, b = got.detach().double(), want.detach().double()
    scale = torch.maximum(b.abs(), b.square().mean().sqrt())  # RMS-relative for values near 0
    err = ((a - b).abs() / scale.clamp_min(1e-300)).max().item()
    assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol}"


def assert_state_equal(got, want, what: str) -> None:
    assert type(got) is type(want), what
    if isinstance(want, QuantizedState):
        assert got.format == want.format and got.shape == want.shape, what
        assert torch.equal(got.codes.cpu(), want.codes.cpu()), f"{what}: codes"
        assert torch.equal(got.absmax.cpu(), want.absmax.cpu()), f"{what}: block scales"
    else:
        assert got.dtype == want.dtype and got.shape == want.shape, what
        assert torch.equal(got.detach().cpu(), want.detach().cpu()), what


# ---- inputs ------------------------------------------------------------------------------------
def _spread_grad(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Scales 1e-4..1 inside each block and 30% exact zeros (the momentum's decay rounding)."""
    scale = 10.0 ** torch.randint(-4, 1, shape, generator=gen).float()
    keep = torch.rand(shape, generator=gen) > 0.3
    return torch.randn(shape, generator=gen) * scale * keep


def _side_by_side(cls, shapes, dtypes, seed: int, kwargs: dict, *, steps: int, fused_from: int = 0,
                  groups: int = 1, spread: bool = False, nan_last: bool = False):  # fmt: skip
    """Two copies of the same params on DEVICE: ``cls(backend="triton")`` from step ``fused_from``
    on (the reference before it) and ``cls(backend="reference")``, fed the same gradients (some
    params miss steps). Returns (ours, opt, ref, ref_opt)."""
    gen = torch.Generator().manual_seed(seed)
    init = [(torch.randn(s, generator=gen) * 2.0 ** (i % 3 - 1)).to(dtypes[i % len(dtypes)]) for i, s in enumerate(shapes)]
    # copy=True: on the CPU (LEANOPT_CUDA_TESTS_ON_CPU=1) .to() would return the same tensor.
    ours = [p.to(DEVICE, copy=True).requires_grad_() for p in init]
    ref = [p.to(DEVICE, copy=True).requires_grad_() for p in init]

    def param_groups(ps):
        if groups == 1:
            return ps
        return [{"params": ps[k::groups], **({"lr": LR / (k + 1)} if kwargs.get("lr") else {})} for k in range(groups)]

    opt = cls(param_groups(ours), backend="reference" if fused_from > 0 else "triton", **kwargs)
    ref_opt = cls(param_groups(ref), backend="reference", **kwargs)
    for t in range(steps):
        if t == fused_from:
            opt.backend = "triton"
        for i, (a, b) in enumerate(zip(ours, ref)):
            if (t + i) % 5 == 4 and t != steps - 1:  # params miss some steps: each counts its own
                a.grad = b.grad = None
                continue
            g = _spread_grad(tuple(a.shape), gen) if spread else torch.randn(a.shape, generator=gen) * 10.0 ** torch.empty(()).uniform_(-3, 0, generator=gen).item()
            if nan_last and t == steps - 1 and g.numel() > 1:
                g.view(-1)[1] = float("nan")
            a.grad = g.to(device=DEVICE, dtype=a.dtype, copy=True)
            b.grad = a.grad.clone()
        opt.step()
        ref_opt.step()
    return ours, opt, ref, ref_opt


# ---- parity ------------------------------------------------------------------------------------
ADAMW_SHAPES = [(1,), (7,), (2049,), (4097,), (33, 65), (3, 5, 7), (0, 4)] + ([] if ON_CPU else [(1000, 300), (70001,)])
ADAMW_FLAGS = [{}, dict(amsgrad=True, maximize=True, weight_decay=0.1)]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("flags", ADAMW_FLAGS, ids=_id)
def test_adamw_matches_reference(dtype: torch.dtype, flags: dict, request: pytest.FixtureRequest) -> None:
    ours, opt, ref, ref_opt = _side_by_side(leanopt.AdamW, ADAMW_SHAPES, [dtype], _seed(request), dict(lr=LR, **flags), steps=6)
    for i, (p, r) in enumerate(zip(ours, ref)):
        assert_param_close(p, r, f"param {i} {tuple(p.shape)}", low_equal=0.99)
        for key, want in ref_opt.state[r].items():
            assert_state_close(opt.state[p][key], want, f"param {i} {key}")


QUANT_SHAPES = [(1,), (5,), (300,), (2049,), (4097,), (33, 65), (3, 0)] + ([] if ON_CPU else [(513, 1000)])
QUANT_CASES = [(torch.float32, {}), (torch.bfloat16, {}), (torch.float16, {"weight_decay": 0.0}),
               (torch.float32, {"maximize": True, "weight_decay": 0.1})]  # fmt: skip


# Every registered low-bit optimizer, and every other elementwise one (tests/registry.py).
LOW_BIT = [c.cls for c in OPTIMIZERS if hasattr(c.cls, "state_bits") and issubclass(c.cls, ElementwiseOptimizer)]
OTHER_RULES = [c.cls for c in OPTIMIZERS if issubclass(c.cls, ElementwiseOptimizer) and not hasattr(c.cls, "state_bits")
               and c.cls is not leanopt.AdamW]  # fmt: skip
# What each needs besides its defaults to keep a state (tests/registry.py: SGD's momentum).
STATEFUL = {c.cls: c.state_kwargs for c in OPTIMIZERS}


@needs_triton
@pytest.mark.parametrize("cls", OTHER_RULES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_other_rules_match_reference(cls, dtype: torch.dtype, request: pytest.FixtureRequest) -> None:
    ours, opt, ref, ref_opt = _side_by_side(cls, ADAMW_SHAPES, [dtype], _seed(request), dict(lr=LR, weight_decay=0.1, **STATEFUL[cls]),
                                            steps=6)
    for i, (p, r) in enumerate(zip(ours, ref)):
        assert_param_close(p, r, f"param {i} {tuple(p.shape)}", low_equal=0.99)
        for key, want in ref_opt.state[r].items():
            assert_state_close(opt.state[p][key], want, f"param {i} {key}")


@needs_triton
@pytest.mark.parametrize("cls", LOW_BIT, ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype,flags", QUANT_CASES, ids=lambda v: str(v) if isinstance(v, torch.dtype) else _id(v))
def test_quantized_matches_reference(cls, dtype: torch.dtype, flags: dict, request: pytest.FixtureRequest) -> None:
    # Five identical reference steps, then one fused step: values within an ulp of the boundary
    # between two codes may take the other code, and this compares one update, not what follows.
    ours, opt, ref, ref_opt = _side_by_side(
        cls, QUANT_SHAPES, [dtype], _seed(request), dict(lr=LR, min_quant_size=100, **flags, **STATEFUL[cls]),
        steps=6, fused_from=5, spread=True, nan_last=True,
    )  # fmt: skip
    quantized = 0
    for i, (p, r) in enumerate(zip(ours, ref)):
        if r.numel() == 0:
            continue
        assert_param_close(p, r, f"param {i}", min_share=0.99, low_equal=0.98)
        assert close_share(p, r)[2] <= LR / 10, f"param {i}: a step off by more than lr/10"
        for key in opt.state_keys(opt.param_groups[0]):
            got, want = opt.state[p][key], ref_opt.state[r][key]
            quantized += isinstance(want, QuantizedState)
            assert_state_close(got, want, f"param {i} {key}", rtol=1e-4, code_share=0.99)
    assert quantized >= 4


ADAFACTOR_SHAPES = [(), (1,), (2049,), (1, 40), (5, 6), (45, 70), (3, 20, 33), (0, 3)] + (
    [] if ON_CPU else [(300, 700), (2, 260, 520), (70001,)]
)
ADAFACTOR_FLAGS = [
    {},
    dict(beta1=0.9, weight_decay=0.01, warmup_init=True),
    dict(lr=LR, relative_step=False, scale_parameter=False, weight_decay=0.01),
]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("flags", ADAFACTOR_FLAGS, ids=_id)
def test_adafactor_matches_reference(dtype: torch.dtype, flags: dict, request: pytest.FixtureRequest) -> None:
    ours, opt, ref, ref_opt = _side_by_side(leanopt.Adafactor, ADAFACTOR_SHAPES, [dtype], _seed(request), flags, steps=6)
    for i, (p, r) in enumerate(zip(ours, ref)):
        # Row/column sums and RMS(u) add up in other orders than torch's reductions.
        if dtype == torch.float32:
            assert_state_close(p.detach(), r.detach(), f"param {i}", rtol=1e-5)
        else:
            assert_param_close(p, r, f"param {i}", low_equal=0.98)
        for key, want in ref_opt.state[r].items():
            assert_state_close(opt.state[p][key], want, f"param {i} {key}", rtol=1e-5)


# ---- one launch over many shapes ---------------------------------------------------------------
def _many_shapes(count: int, seed: int, big: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    shapes: list[tuple[int, ...]] = [(0,), (1,), (2048,), (2049,)]
    while len(shapes) < count:
        kind = rng.random()
        if kind < 0.35:
            shapes.append((rng.randint(1, big),))
        elif kind < 0.85:
            side = int(big**0.5)
            shapes.append((rng.randint(1, side), rng.randint(1, side)))
        else:
            shapes.append((rng.randint(1, 6), rng.randint(1, 40), rng.randint(1, 70)))
    return shapes


MANY = dict(count=12, big=6000) if ON_CPU else dict(count=160, big=90000)


@needs_triton
@pytest.mark.parametrize("name", ["AdamW", "AdamW8bit", "AdamW4bit", "Adafactor"])
def test_one_launch_over_many_shapes_and_dtypes(name: str, request: pytest.FixtureRequest) -> None:
    cls = getattr(leanopt, name)
    seed = _seed(request)
    shapes = _many_shapes(MANY["count"], seed, MANY["big"])
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float16]
    if name == "Adafactor":
        kw, steps, fused_from = {}, 3, 0
    elif name == "AdamW":
        kw, steps, fused_from = dict(lr=LR), 3, 0
    else:  # quantized: compare one fused step after identical reference steps
        kw, steps, fused_from = dict(lr=LR), 3, 2
    ours, _, ref, _ = _side_by_side(cls, shapes, dtypes, seed, kw, steps=steps, fused_from=fused_from, groups=2)
    for i, (p, r) in enumerate(zip(ours, ref)):
        what = f"param {i} {tuple(p.shape)} {p.dtype}"
        if name == "AdamW":
            assert_param_close(p, r, what, low_equal=0.99)
        else:
            assert_param_close(p, r, what, min_share=0.99, low_equal=0.97)
        if name != "Adafactor" and r.numel():
            assert close_share(p, r)[2] <= LR / 10 + 1e-6, what


# ---- past 2^31 elements ------------------------------------------------------------------------
BIG = 2**31 + 2**20 + 77  # > 2^31 elements, the last block partial
WINDOW = 8192


def _free_bytes() -> int:
    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0


def _windows(n: int, align: int) -> list[tuple[int, int]]:
    """Block-aligned slices: the start, around 2^30 (bf16 byte offsets pass 2^31), around 2^31
    (element indices pass 2^31), and the tail."""
    lo = lambda x: (x // align) * align  # noqa: E731
    return [(0, WINDOW), (lo(2**30 - WINDOW // 2), lo(2**30 - WINDOW // 2) + WINDOW),
            (lo(2**31 - WINDOW // 2), lo(2**31 - WINDOW // 2) + WINDOW), (lo(n - WINDOW - 100), n)]  # fmt: skip


def _slice_state(value, a: int, b: int):
    """State of elements [a, b) of a flat param (a, b on block boundaries, b may be the end)."""
    if isinstance(value, QuantizedState):
        fmt = value.format
        bs = fmt.block_size
        codes = value.codes[a : b] if fmt.bits == 8 else value.codes[a // 2 : (b + 1) // 2]
        return QuantizedState(codes.clone(), value.absmax[a // bs : -(-b // bs)].clone(), fmt, (b - a,))
    if value.dim() == 0:
        return value.clone()
    return value[a:b].clone()


@needs_gpu
@needs_triton
@pytest.mark.parametrize("name,need_gb", [("AdamW8bit", 16), ("AdamW4bit", 14), ("AdamW", 30)])
def test_tensor_past_2_31_elements(name: str, need_gb: int) -> None:
    torch.cuda.empty_cache()
    if _free_bytes() < need_gb * 2**30:
        pytest.skip(f"needs {need_gb} GiB of free GPU memory")
    cls = getattr(leanopt, name)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    p = torch.nn.Parameter(torch.empty(BIG, dtype=torch.bfloat16, device=DEVICE).normal_(generator=gen))
    grad = torch.empty_like(p.data)
    opt = cls([p], lr=LR, backend="triton")
    align = 256
    try:
        for step in range(2):
            grad.normal_(generator=gen).mul_(0.1)
            # The reference, run on each window alone from the same param and state.
            refs = []
            for a, b in _windows(BIG, align):
                q = torch.nn.Parameter(p.data[a:b].clone())
                q.grad = grad[a:b].clone()
                small = cls([q], lr=LR, backend="reference", **({} if name == "AdamW" else {"min_quant_size": 0}))
                if opt.state.get(p):
                    small.state[q] = {k: _slice_state(v, a, b) for k, v in opt.state[p].items()}
                small.step()
                refs.append((a, b, q, small))
            p.grad = grad
            opt.step()
            torch.cuda.synchronize()
            for a, b, q, small in refs:
                what = f"{name} step {step + 1}, elements [{a}, {b})"
                assert_param_close(p.data[a:b], q.data, what, min_share=0.99, low_equal=0.98)
                assert close_share(p.data[a:b], q.data)[2] <= LR / 10, what
                for key, want in small.state[q].items():
                    if key != "step":
                        assert_state_close(_slice_state(opt.state[p][key], a, b), want, f"{what} {key}", rtol=1e-4, code_share=0.99)
            assert torch.isfinite(p.data[-WINDOW:]).all()
    finally:
        del opt, p, grad
        torch.cuda.empty_cache()


@needs_gpu
@needs_triton
def test_adafactor_tensor_past_2_31_elements() -> None:
    torch.cuda.empty_cache()
    if _free_bytes() < 90 * 2**30:
        pytest.skip("needs 90 GiB of free GPU memory (the reference upcasts the whole tensor)")
    side = math.isqrt(2**31) + 1  # side * side > 2^31
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    p = torch.nn.Parameter(torch.empty(side, side, dtype=torch.bfloat16, device=DEVICE).normal_(generator=gen))
    p.grad = torch.empty_like(p.data).normal_(generator=gen)
    r = torch.nn.Parameter(p.data.clone())
    r.grad = p.grad.clone()
    opt = leanopt.Adafactor([p], backend="triton")
    ref_opt = leanopt.Adafactor([r], backend="reference")
    try:
        opt.step()
        ref_opt.step()
        torch.cuda.synchronize()
        for rows in (slice(0, 64), slice(side // 2, side // 2 + 64), slice(side - 64, side)):
            assert_param_close(p.data[rows], r.data[rows], f"rows {rows}", low_equal=0.98)
        for key in ("exp_avg_sq_row", "exp_avg_sq_col"):
            assert_state_close(opt.state[p][key], ref_opt.state[r][key], key, rtol=1e-5)
    finally:
        del opt, ref_opt, p, r
        torch.cuda.empty_cache()


# ---- checkpoints between devices ---------------------------------------------------------------
CKPT_SHAPES = [(64, 130), (300,), (5000,), (3, 40, 50)]


def _save_load(sd: dict, map_location=None) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, map_location=map_location, weights_only=True)


@needs_triton
@pytest.mark.parametrize("name", ["AdamW", "AdamW8bit", "AdamW4bit", "Adafactor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_checkpoint_round_trip_between_cpu_and_device(name: str, dtype: torch.dtype, request: pytest.FixtureRequest) -> None:
    cls = getattr(leanopt, name)
    kw = dict(beta1=0.9) if name == "Adafactor" else dict(lr=LR)
    gen = torch.Generator().manual_seed(_seed(request))
    init = [torch.randn(s, generator=gen).to(dtype) for s in CKPT_SHAPES]
    grads = [[torch.randn(s, generator=gen).to(dtype) for s in CKPT_SHAPES] for _ in range(4)]
    params = [p.to(DEVICE, copy=True).requires_grad_() for p in init]
    opt = cls(params, backend="triton", **kw)
    for t in range(3):
        for p, g in zip(params, grads[t]):
            p.grad = g.to(DEVICE)
        opt.step()

    # Device -> CPU: loaded onto CPU params, every state equal and on the CPU, fp32 kept fp32.
    cpu_params = [p.detach().cpu().clone().requires_grad_() for p in params]
    cpu_opt = cls(cpu_params, backend="reference", **kw)
    cpu_opt.load_state_dict(_save_load(opt.state_dict(), map_location="cpu"))
    for p, c in zip(params, cpu_params):
        for key, want in opt.state[p].items():
            got = cpu_opt.state[c][key]
            assert got.device.type == "cpu", key
            assert_state_equal(got, want, f"{name} {key} after CUDA -> CPU")

    # CPU -> device: a fresh optimizer over device params takes the CPU optimizer's checkpoint.
    dev_params = [p.detach().clone().requires_grad_() for p in params]
    dev_opt = cls(dev_params, backend="triton", **kw)
    dev_opt.load_state_dict(_save_load(cpu_opt.state_dict()))
    for p, d in zip(params, dev_params):
        for key, want in opt.state[p].items():
            got = dev_opt.state[d][key]
            assert got.device == (torch.device("cpu") if key == "step" else want.device), key
            assert_state_equal(got, want, f"{name} {key} after CPU -> CUDA")

    # The next step: the round-tripped optimizer continues bit for bit; the CPU one within tolerance.
    for ps in (params, dev_params, cpu_params):
        for p, g in zip(ps, grads[3]):
            p.grad = g.to(p.device)
    opt.step()
    dev_opt.step()
    cpu_opt.step()
    for p, d, c in zip(params, dev_params, cpu_params):
        assert torch.equal(p.detach(), d.detach()), f"{name}: the round-tripped optimizer's step differs"
        assert_param_close(c, p.detach().cpu(), f"{name}: CPU step after loading", min_share=0.99, low_equal=0.97)


@needs_gpu
@needs_triton
def test_auto_backend_is_triton_on_cuda() -> None:
    assert kernels.resolve_backend("auto", torch.device("cuda")) == "triton"
    w = torch.nn.Parameter(torch.randn(4096, device="cuda"))
    w.grad = torch.randn(4096, device="cuda")
    before = w.detach().clone()
    leanopt.AdamW8bit([w]).step()
    assert not torch.equal(before, w.detach()) and torch.isfinite(w).all()
