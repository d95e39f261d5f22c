"""A hand-written C++ kernel for block-quantized states on the CPU (issue #11).

One pass per block, all of a param's blocks spread over torch's intra-op threads
(``at::parallel_for``): decode each state's codes through its code book's value table, run the
rule (AdamW with or without AMSGrad, Lion, AdEMAMix; safe mode always: second-moment floors and
:func:`~leanopt.kernels.rules.skipped_elements`), keep the new states in block-sized local
buffers while their block maximum is reduced, then encode (nearest code by a 2^16-entry bucket
table plus one comparison, the decay rounding of
:meth:`~leanopt.quant.formats.BlockFormat.code_indices` where the gradient is exactly 0) and
pack. The maths is fp32 with every schedule scalar rounded to fp32 and no contraction into FMAs
except where torch's own kernel uses one (``lerp``), so it follows
:func:`~leanopt.kernels.reference.rule_step_` operation by operation -- except ``sqrt``: torch's
CPU ``sqrt`` goes through MKL's VML and is one ulp off the correctly rounded root on ~20 % of
inputs here, the kernel's is correctly rounded (as Inductor's is), so an update may differ by
an ulp (tests/test_cpu_native.py).

Built on first use with :func:`torch.utils.cpp_extension.load_inline` (``-O3 -march=native``)
and cached by torch under a name keyed on the source and the host's CPU flags. If anything
fails (no compiler, no headers), :func:`available` is False and :func:`build_error` says why:
importing this module never builds and never fails.

:func:`leanopt.kernels.cpu_elementwise.quantized` runs the params :func:`takes` accepts here
(fp32 params and gradients, any rule of the three) and the others in its compiled graph; a
failed build falls back to that graph with one warning. ``LEANOPT_NO_NATIVE=1`` (read at the
first build) or :func:`disabled` (tests) turns the kernel off. Under ``FakeTensorMode`` (memory
planning) a native update is in place and allocates nothing of the param's size, so nothing
runs for the whole blocks.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

from leanopt.quant.codebooks import _build
from leanopt.quant.formats import DECAY_GROWTH_RATIO, DECAY_PROGRESS

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int MAXS = 3;

struct Book {
  uint8_t* codes;          // this param's codes (whole blocks)
  float* absmax;           // one scale per block
  const float* values;     // 2^bits decode values
  const float* thr;        // midpoints, padded with +inf to >= last + 1 entries
  const int32_t* bucket;   // 2^16: midpoints below each bucket of the top 16 bits
  int zero, last;
  bool decays;
};

struct Consts {
  float c[16];
  float progress, growth;
  uint32_t step_term;
  int64_t offset;
};

inline uint32_t fbits(float x) { uint32_t b; std::memcpy(&b, &x, 4); return b; }
inline float bitsf(uint32_t b) { float x; std::memcpy(&x, &b, 4); return x; }
inline bool finite(float x) { return (fbits(x) & 0x7F800000u) != 0x7F800000u; }

// leanopt.quant.formats.dither, bit for bit.
inline float dither(int64_t index, uint32_t step_term) {
  uint64_t ui = (uint64_t)index;
  uint32_t h = (uint32_t)(ui & 0xFFFFFFFFu) ^ ((uint32_t)(ui >> 32) * 0x9E3779B9u);
  h = h * 0x9E3779B1u + step_term;
  h ^= h >> 16; h *= 0x7FEB352Du; h ^= h >> 15; h *= 0x846CA68Bu; h ^= h >> 16;
  return (float)(h >> 8) * (1.0f / 16777216.0f);
}

// ---- rules: one element, fp32, torch's operation order -------------------------------------
// rule ids: 0 AdamW, 1 AdamW+amsgrad, 2 Lion, 3 AdEMAMix
template <int RULE> struct R;

template <> struct R<0> {
  static constexpr int NS = 2;
  static inline float apply(float p, float g, float o0, float o1, float o2, float& n0, float& n1, float& n2, const float* c) {
    // decay, w1, b2, 1-b2, eps, step size, sqrt(bc2), floor
    float pn = p * c[0];
    float m = std::fma(c[1], g - o0, o0);  // torch.lerp, weight < 0.5 (ATen's vectorised lerp)
    float v = o1 * c[2] + (c[3] * g) * g;
    float f = (m * m) / c[7];
    v = v < f ? f : v;
    n0 = m; n1 = v;
    return pn - c[5] * (m / (std::sqrt(v) / c[6] + c[4]));
  }
};

template <> struct R<1> {
  static constexpr int NS = 3;
  static inline float apply(float p, float g, float o0, float o1, float o2, float& n0, float& n1, float& n2, const float* c) {
    float pn = p * c[0];
    float m = std::fma(c[1], g - o0, o0);
    float v = o1 * c[2] + (c[3] * g) * g;
    float f = (m * m) / c[7];
    v = v < f ? f : v;
    float vm = o2 < v ? v : o2;
    n0 = m; n1 = v; n2 = vm;
    return pn - c[5] * (m / (std::sqrt(vm) / c[6] + c[4]));
  }
};

template <> struct R<2> {
  static constexpr int NS = 1;
  static inline float apply(float p, float g, float o0, float o1, float o2, float& n0, float& n1, float& n2, const float* c) {
    // decay, b1, 1-b1, b2, 1-b2, lr
    float d = o0 * c[1] + c[2] * g;
    float s = (float)((d > 0.0f) - (d < 0.0f));
    n0 = o0 * c[3] + c[4] * g;
    return p * c[0] - c[5] * s;
  }
};

template <> struct R<3> {
  static constexpr int NS = 3;
  static inline float apply(float p, float g, float o0, float o1, float o2, float& n0, float& n1, float& n2, const float* c) {
    // decay, b1, 1-b1, b3, 1-b3, b2, 1-b2, bc1, alpha, sqrt(bc2), eps, lr, floor fast, floor slow
    float m1 = o0 * c[1] + c[2] * g;
    float m2 = o1 * c[3] + c[4] * g;
    float nu = o2 * c[5] + (c[6] * g) * g;
    float f1 = (m1 * m1) / c[12];
    nu = nu < f1 ? f1 : nu;
    float f2 = (m2 * m2) / c[13];
    nu = nu < f2 ? f2 : nu;
    n0 = m1; n1 = m2; n2 = nu;
    return p * c[0] - c[11] * ((m1 / c[7] + c[8] * m2) / (std::sqrt(nu) / c[9] + c[10]));
  }
};

// ---- per-block pieces -----------------------------------------------------------------------
template <int BITS>
inline void decode(const uint8_t* __restrict codes, const float* __restrict values, float scale,
                   float* __restrict out, int bs) {
  if (BITS == 8) {
    for (int i = 0; i < bs; ++i) out[i] = values[codes[i]] * scale;
  } else {
    for (int j = 0; j < bs / 2; ++j) {
      uint8_t b = codes[j];
      out[2 * j] = values[b & 15] * scale;
      out[2 * j + 1] = values[b >> 4] * scale;
    }
  }
}

inline void nearest(const float* __restrict x, float scale, const Book& bk, int32_t* __restrict idx,
                    float* __restrict y, int bs) {
  const int32_t* __restrict bucket = bk.bucket;
  const float* __restrict thr = bk.thr;
  for (int i = 0; i < bs; ++i) {
    float yi = x[i] / scale;
    y[i] = yi;
    int32_t k = bucket[fbits(yi) >> 16];
    idx[i] = k + (thr[k] < yi ? 1 : 0);
  }
}

// leanopt.quant.formats.decay_rounded on one element, without branches (the block's loop over
// it vectorises: every lane computes, the selects keep the reference's choice bit for bit).
inline int32_t decay_round(int32_t idx, float y, float prev_y, float u, const float* __restrict values, int32_t zero,
                           int32_t last, float progress, float growth) {
  float near = std::fabs(values[idx]);
  bool keep = near < prev_y * progress;
  bool over = (near > std::fabs(y)) & (idx != zero);
  int32_t toward = (idx > zero) - (idx < zero);
  int32_t a = over ? idx - toward : idx;
  int32_t b = a + (y < 0.0f ? -1 : 1);
  b = b < 0 ? 0 : (b > last ? last : b);
  float va = std::fabs(values[a]), vb = std::fabs(values[b]);
  float gap = vb - va;
  float frac = gap > 0.0f ? (std::fabs(y) - va) / gap : 0.0f;  // a lane's 0/0 is selected away
  bool up = (u < frac) & !((vb * progress > prev_y) & (vb > va * growth));
  int32_t r = up ? b : a;
  return keep ? idx : r;
}

// The decay rounding over one block, where the gradient is exactly 0.
inline void decay_block(int32_t* __restrict idx, const float* __restrict y, const float* __restrict old,
                        const float* __restrict gbuf, float safe, int64_t base, const Book& bk, const Consts& k, int bs) {
  const float* __restrict values = bk.values;
  const int32_t zero = bk.zero, last = bk.last;
  const float progress = k.progress, growth = k.growth;
  const uint32_t step_term = k.step_term;
#pragma omp simd
  for (int i = 0; i < bs; ++i) {
    float prev_y = std::fabs(old[i]) / safe;
    int32_t r = decay_round(idx[i], y[i], prev_y, dither(base + i, step_term), values, zero, last, progress, growth);
    idx[i] = gbuf[i] == 0.0f ? r : idx[i];
  }
}

template <int BITS>
inline void pack(const int32_t* __restrict idx, uint8_t* __restrict codes, int bs) {
  if (BITS == 8) {
    for (int i = 0; i < bs; ++i) codes[i] = (uint8_t)idx[i];
  } else {
    for (int j = 0; j < bs / 2; ++j) codes[j] = (uint8_t)(idx[2 * j] | (idx[2 * j + 1] << 4));
  }
}

// The rule over one block: params in place, new states (0 where skipped) into nw, their
// largest magnitude (as fp32 bits: non-negative floats order as integers) into mx, the
// gradient (negated under maximize) into gbuf; returns how many gradients are exactly 0.
template <int RULE>
inline int element_loop(float* __restrict P, const float* __restrict G, float* const* old, float* const* nw,
                        float* __restrict gbuf, int bs, float gsign, const float* cin, uint32_t* mx_out) {
  constexpr int NS = R<RULE>::NS;
  float c[16];  // a local copy: stores through P/n*/gbuf cannot alias it, so it stays in registers
  for (int k = 0; k < 16; ++k) c[k] = cin[k];
  const float* __restrict o0 = old[0];
  const float* __restrict o1 = old[NS > 1 ? 1 : 0];
  const float* __restrict o2 = old[NS > 2 ? 2 : 0];
  float* __restrict n0 = nw[0];
  float* __restrict n1 = nw[NS > 1 ? 1 : 0];
  float* __restrict n2 = nw[NS > 2 ? 2 : 0];
  uint32_t mx0 = 0, mx1 = 0, mx2 = 0;
  int zeros = 0;
#pragma omp simd reduction(max : mx0, mx1, mx2) reduction(+ : zeros)
  for (int i = 0; i < bs; ++i) {
    float gi = G[i] * gsign;
    float pi = P[i];
    float x0 = 0.0f, x1 = 0.0f, x2 = 0.0f;
    float pn = R<RULE>::apply(pi, gi, o0[i], NS > 1 ? o1[i] : 0.0f, NS > 2 ? o2[i] : 0.0f, x0, x1, x2, c);
    bool ok = finite(gi * gi) & finite(x0);
    if (NS > 1) ok = ok & finite(x1);
    if (NS > 2) ok = ok & finite(x2);
    P[i] = ok ? pn : pi;
    float a0 = ok ? x0 : 0.0f;
    n0[i] = a0;
    uint32_t b0 = fbits(a0) & 0x7FFFFFFFu;
    mx0 = mx0 < b0 ? b0 : mx0;
    if (NS > 1) {
      float a1 = ok ? x1 : 0.0f;
      n1[i] = a1;
      uint32_t b1 = fbits(a1) & 0x7FFFFFFFu;
      mx1 = mx1 < b1 ? b1 : mx1;
    }
    if (NS > 2) {
      float a2 = ok ? x2 : 0.0f;
      n2[i] = a2;
      uint32_t b2 = fbits(a2) & 0x7FFFFFFFu;
      mx2 = mx2 < b2 ? b2 : mx2;
    }
    gbuf[i] = gi;
    zeros += gi == 0.0f ? 1 : 0;
  }
  mx_out[0] = mx0; mx_out[1] = mx1; mx_out[2] = mx2;
  return zeros;
}

template <int BITS, int RULE>
void run(float* p, const float* g, Book* books, int64_t nblocks, int bs, bool maximize, const Consts& k) {
  constexpr int NS = R<RULE>::NS;
  const int cb = BITS == 8 ? bs : bs / 2;
  int64_t grain = std::max<int64_t>(1, 16384 / bs);
  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
    std::vector<float> buf((2 * NS + 2) * bs + 64);
    std::vector<int32_t> ibuf(bs + 16);
    float* old[MAXS]; float* nw[MAXS];
    for (int s = 0; s < NS; ++s) { old[s] = buf.data() + s * bs; nw[s] = buf.data() + (NS + s) * bs; }
    float* gbuf = buf.data() + 2 * NS * bs;
    float* y = gbuf + bs;
    int32_t* idx = ibuf.data();
    float c[16];
    for (int i = 0; i < 16; ++i) c[i] = k.c[i];
    for (int64_t blk = b0; blk < b1; ++blk) {
      float* __restrict P = p + blk * bs;
      const float* __restrict G = g + blk * bs;
      for (int s = 0; s < NS; ++s)
        decode<BITS>(books[s].codes + blk * cb, books[s].values, books[s].absmax[blk], old[s], bs);
      uint32_t mx[MAXS] = {0, 0, 0};
      int zeros = element_loop<RULE>(P, G, old, nw, gbuf, bs, maximize ? -1.0f : 1.0f, c, mx);
      for (int s = 0; s < NS; ++s) {
        const Book& bk = books[s];
        float scale = bitsf(mx[s]);
        float safe = scale > 0.0f ? scale : 1.0f;
        nearest(nw[s], safe, bk, idx, y, bs);
        if (bk.decays && zeros) decay_block(idx, y, old[s], gbuf, safe, k.offset + blk * bs, bk, k, bs);
        pack<BITS>(idx, bk.codes + blk * cb, bs);
        bk.absmax[blk] = scale;
      }
    }
  });
}

}  // namespace

void step_blocks(int64_t rule, int64_t bits, int64_t block, bool maximize, at::Tensor p, at::Tensor g,
                 std::vector<at::Tensor> codes, std::vector<at::Tensor> absmax, std::vector<at::Tensor> values,
                 std::vector<at::Tensor> thresholds, std::vector<at::Tensor> buckets, std::vector<int64_t> zeros,
                 std::vector<int64_t> lasts, std::vector<int64_t> decays, int64_t step, int64_t offset,
                 std::vector<double> scalars, double progress, double growth) {
  TORCH_CHECK(p.scalar_type() == at::kFloat && g.scalar_type() == at::kFloat, "fp32 param and grad only");
  TORCH_CHECK(p.is_contiguous() && g.is_contiguous(), "contiguous param and grad only");
  TORCH_CHECK(bits == 8 || (bits == 4 && block % 2 == 0), "8-bit, or 4-bit with an even block size");
  TORCH_CHECK(scalars.size() <= 16, "too many scalars");
  int64_t n = p.numel();
  TORCH_CHECK(n % block == 0 && g.numel() == n, "whole blocks only");
  int64_t nblocks = n / block;
  size_t ns = codes.size();
  TORCH_CHECK(ns >= 1 && ns <= MAXS, "1 to 3 states");
  Book books[MAXS];
  for (size_t s = 0; s < ns; ++s) {
    TORCH_CHECK(codes[s].scalar_type() == at::kByte && codes[s].is_contiguous(), "uint8 codes");
    TORCH_CHECK(codes[s].numel() >= (bits == 8 ? n : n / 2), "codes too short");
    TORCH_CHECK(absmax[s].scalar_type() == at::kFloat && absmax[s].is_contiguous() && absmax[s].numel() >= nblocks,
                "fp32 block scales");
    TORCH_CHECK(values[s].numel() == (1 << bits) && buckets[s].numel() == 65536 &&
                thresholds[s].numel() >= lasts[s] + 1, "tables");
    books[s] = Book{codes[s].data_ptr<uint8_t>(), absmax[s].data_ptr<float>(), values[s].data_ptr<float>(),
                    thresholds[s].data_ptr<float>(), buckets[s].data_ptr<int32_t>(), (int)zeros[s], (int)lasts[s],
                    decays[s] != 0};
  }
  Consts k;
  for (int i = 0; i < 16; ++i) k.c[i] = i < (int)scalars.size() ? (float)scalars[i] : 0.0f;
  k.progress = (float)progress;
  k.growth = (float)growth;
  k.step_term = (uint32_t)((uint64_t)step * 0x85EBCA77ull);
  k.offset = offset;
  float* pp = p.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  int bs = (int)block;
#define LEANOPT_RUN(B, RL) run<B, RL>(pp, gp, books, nblocks, bs, maximize, k)
  int want = rule == 2 ? 1 : (rule == 0 ? 2 : 3);
  TORCH_CHECK((int)ns == want, "wrong number of states for the rule");
  if (bits == 8) {
    switch (rule) { case 0: LEANOPT_RUN(8, 0); break; case 1: LEANOPT_RUN(8, 1); break;
                    case 2: LEANOPT_RUN(8, 2); break; case 3: LEANOPT_RUN(8, 3); break;
                    default: TORCH_CHECK(false, "unknown rule"); }
  } else {
    switch (rule) { case 0: LEANOPT_RUN(4, 0); break; case 1: LEANOPT_RUN(4, 1); break;
                    case 2: LEANOPT_RUN(4, 2); break; case 3: LEANOPT_RUN(4, 3); break;
                    default: TORCH_CHECK(false, "unknown rule"); }
  }
#undef LEANOPT_RUN
}
"""

_CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp"]
# at::parallel_for is OpenMP in the header: without -fopenmp it runs serially. The libgomp.so.1
# linked here is the one torch has already loaded (same soname), so there is one runtime.
_LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_state: dict[str, Any] = {}
_off: list[bool] = []


@contextlib.contextmanager
def disabled():
    """Within it, :func:`takes` answers False (the compiled graph runs): tests of that path."""
    _off.append(True)
    try:
        yield
    finally:
        _off.pop()


def _name() -> str:
    """Extension name keyed on the source, the flags and the host's CPU flags (``-march=native``
    code must not be loaded on another CPU sharing the same cache directory)."""
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "model name")):
                    cpu += line
                if line.startswith("flags"):
                    break
    except OSError:
        pass
    digest = hashlib.sha256((_SOURCE + " ".join(_CFLAGS + _LDFLAGS) + cpu + torch.__version__).encode()).hexdigest()[:12]
    return f"leanopt_cpu_native_{digest}"


def _module() -> Any | None:
    if "module" in _state:
        return _state["module"]
    with _lock:
        if "module" in _state:
            return _state["module"]
        module = None
        if os.environ.get("LEANOPT_NO_NATIVE", "") not in ("", "0"):
            _state["error"] = "disabled by LEANOPT_NO_NATIVE"
        else:
            start = time.perf_counter()
            try:
                from torch.utils.cpp_extension import load_inline

                module = load_inline(
                    name=_name(), cpp_sources=[_SOURCE], functions=["step_blocks"],
                    extra_cflags=_CFLAGS, extra_ldflags=_LDFLAGS, verbose=False,
                )  # fmt: skip
                _state["build_seconds"] = time.perf_counter() - start
            except Exception as err:  # no compiler, no headers, a broken toolchain...
                text = str(err).strip().splitlines()
                _state["error"] = f"{type(err).__name__}: {text[-1] if text else ''}"
                log.warning("leanopt: building the native CPU kernel failed (%s)", _state["error"])
        _state["module"] = module
        return module


def available() -> bool:
    """Whether the extension builds (or is cached) and loads here; builds it on first call."""
    return _module() is not None


def build_error() -> str | None:
    """Why :func:`available` is False (None while it is True or before the first try)."""
    return _state.get("error")


def build_seconds() -> float | None:
    """Seconds the first :func:`available` took in this process (compile or cache load)."""
    return _state.get("build_seconds")


# ---- tables -------------------------------------------------------------------------------------
_TABLES: dict[str, tuple[Tensor, Tensor, Tensor, int, int] | None] = {}


def tables(book: Any) -> tuple[Tensor, Tensor, Tensor, int, int] | None:
    """``(values, thresholds, buckets, zero_index, last)`` for the kernel, or None when the code
    book's midpoints are too close for the bucket table (two in one bucket of the top 16 bits
    of an fp32; none of the shipped codes). ``buckets[top16(y)]``: midpoints below the bucket;
    the nearest code of ``y`` is that plus ``thresholds[it] < y`` (``torch.searchsorted``)."""
    if book.name not in _TABLES:
        # Real tensors even when first asked inside a FakeTensorMode trace (leanopt.plan): a
        # fake table must not be cached for the real steps after it.
        with unset_fake_temporarily():
            _TABLES[book.name] = _tables(_build(book.name, torch.device("cpu")))
    return _TABLES[book.name]


def _tables(book: Any) -> tuple[Tensor, Tensor, Tensor, int, int] | None:
    from leanopt.kernels.cpu_elementwise import midpoints_below_buckets

    thresholds = book.thresholds.to(device="cpu", dtype=torch.float32)
    below, finite, usable = midpoints_below_buckets(thresholds)
    last = thresholds.numel()
    padded = torch.cat([thresholds, torch.full((max(16, 256 - last),), float("inf"))])
    values = book.values.to(device="cpu", dtype=torch.float32).contiguous()
    # NaN buckets: any in-range index (y is always finite here).
    buckets = torch.where(finite, below, 0).to(torch.int32).contiguous()
    return (values, padded.contiguous(), buckets, int(book.zero_index), last) if usable else None


_RULE_IDS = {"adamw": 0, "lion": 2, "ademamix": 3}


def _rule_id(rule: Any, hp: Mapping[str, Any]) -> int | None:
    rid = _RULE_IDS.get(rule.name)
    if rid == 0 and hp.get("amsgrad"):
        rid = 1
    return rid


def takes(rule: Any, p: Tensor, g: Tensor, states: Sequence[Any], hp: Mapping[str, Any]) -> bool:
    """Whether :func:`quantized` runs this param natively: a known rule, fp32 CPU param and
    gradient, quantized states of one bit width and block size whose code books have bucket
    tables (4-bit: even blocks), and the extension available (built on first call)."""
    from leanopt.quant import QuantizedState

    if _off or _rule_id(rule, hp) is None or p.device.type != "cpu" or p.dtype != torch.float32 or g.dtype != torch.float32:
        return False
    if not states or not all(isinstance(q, QuantizedState) for q in states):
        return False
    fmt = states[0].format
    if any(q.format.bits != fmt.bits or q.format.block_size != fmt.block_size for q in states):
        return False
    if fmt.bits == 4 and fmt.block_size % 2:
        return False
    if any(tables(q.format.book("cpu")) is None for q in states):
        return False
    return available()


def step_blocks(rule: Any, p: Tensor, g: Tensor, states: Sequence[Any], step: int, hp: Mapping[str, Any],
                offset: int, blocks: int) -> None:  # fmt: skip
    """The first ``blocks`` whole blocks of one param (flat, contiguous fp32 ``p``/``g``) and
    its quantized ``states``, in place."""
    module = _module()
    assert module is not None, build_error()
    fmt = states[0].format
    bs = fmt.block_size
    n = blocks * bs
    kinds = rule.states(hp)
    tabs = [tables(q.format.book("cpu")) for q in states]
    cb = fmt.code_bytes(n)
    module.step_blocks(
        _rule_id(rule, hp), fmt.bits, bs, bool(hp["maximize"]), p[:n], g[:n],
        [q.codes[:cb] for q in states], [q.absmax[:blocks] for q in states],
        [t[0] for t in tabs], [t[1] for t in tabs], [t[2] for t in tabs],
        [t[3] for t in tabs], [t[4] for t in tabs], [int(k.decays) for k in kinds],
        int(step), int(offset), [float(c) for c in rule.scalars(hp, step, True)],
        float(DECAY_PROGRESS), float(DECAY_GROWTH_RATIO),
    )  # fmt: skip


def quantized(rule: Any, params, grads, states, steps: Sequence[int], hp: Mapping[str, Any],
              offsets: Sequence[int] | None = None) -> None:  # fmt: skip
    """Drop-in for :func:`leanopt.kernels.cpu_elementwise.quantized` on params :func:`takes`
    accepts: whole blocks natively, the last partial block by the reference."""
    from leanopt.kernels.cpu_elementwise import partial_block

    offsets = [0] * len(params) if offsets is None else offsets
    for i, p in enumerate(params):
        n = p.numel()
        if n == 0:
            continue
        qs = states[i]
        fmt = qs[0].format
        bs = fmt.block_size
        full = n // bs
        flat_p, flat_g = p.view(-1), grads[i].reshape(-1).contiguous()
        if full and not (is_fake(p) or p.device.type == "meta"):  # a trace: in place, nothing allocated
            step_blocks(rule, flat_p, flat_g, qs, steps[i], hp, offsets[i], full)
        if full * bs < n:
            partial_block(rule, flat_p, flat_g, qs, steps[i], hp, offsets[i], full * bs)
