// The native CPU kernel of leanopt.kernels.cpu_native (its docstring says what it does and how it
// is built): shipped as package data and compiled on first use.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#define LEANOPT_AVX512 1
constexpr bool kAvx512 = true;
#else
constexpr bool kAvx512 = false;
#endif

namespace {

constexpr int MAXS = 3;

struct Book {
  uint8_t* codes;          // this param's codes (whole blocks)
  float* absmax;           // one scale per block
  const float* values;     // 2^bits decode values
  const float* thr;        // midpoints, padded with +inf to >= 256 entries
  const float* eyt;        // midpoints as a complete binary search tree (Eytzinger order, from 1)
  const uint8_t* bucket;   // midpoints below each bucket (bucket_key), + 3 bytes of padding
  int lo, rows;            // bucket_key's exponent rows: lo .. lo + rows - 1
  int zero, last;
  bool decays;
};

struct Consts {
  float c[16];
  float progress, growth;
  uint32_t step_term;
  int64_t offset;
  bool vec;                // run the AVX-512 loops (false where not compiled in, and in tests' portable())
};

inline uint32_t fbits(float x) { uint32_t b; std::memcpy(&b, &x, 4); return b; }
inline float bitsf(uint32_t b) { float x; std::memcpy(&x, &b, 4); return x; }
inline bool finite(float x) { return (fbits(x) & 0x7F800000u) != 0x7F800000u; }

// bf16 params and gradients: widened to fp32 for the rule, the new param rounded to the nearest
// bf16, ties to even, and a NaN (a param a non-finite gradient reached outside safe mode) to
// 0xFFFF: torch's vectorised conversion, which the reference's ``p.copy_(fp32)`` and Inductor's
// vector code use (c10::BFloat16's scalar one makes 0x7FC0).
inline void widen_bf16(const uint16_t* __restrict in, float* __restrict out, int n) {
  for (int i = 0; i < n; ++i) out[i] = bitsf(static_cast<uint32_t>(in[i]) << 16);
}
inline uint16_t to_bf16(float x) {
  const uint32_t u = fbits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFF;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline void narrow_bf16(const float* __restrict in, uint16_t* __restrict out, int n) {
  for (int i = 0; i < n; ++i) out[i] = to_bf16(in[i]);
}

// Which of a param and its gradient hold bf16 values (else fp32): the entry points' ``dtypes``.
// They may differ: Muon's momentum writes an fp32 direction from a bf16 param's gradient.
constexpr int kParamBf16 = 1, kGradBf16 = 2;

// Elements off .. off + n - 1 of a param p and its gradient g as fp32 pointers for the element
// loop: fp32 tensors' own memory, or (bf16) pw and gw holding them widened. store() writes pw
// back to a bf16 param once the loop has updated it.
struct Operands {
  float* P;
  const float* G;
  Operands(void* p, const void* g, int dtypes, int64_t off, int n, float* pw, float* gw) {
    if (dtypes & kParamBf16) {
      widen_bf16(static_cast<const uint16_t*>(p) + off, pw, n);
      P = pw;
    } else {
      P = static_cast<float*>(p) + off;
    }
    if (dtypes & kGradBf16) {
      widen_bf16(static_cast<const uint16_t*>(g) + off, gw, n);
      G = gw;
    } else {
      G = static_cast<const float*>(g) + off;
    }
  }
  static void store(void* p, int dtypes, int64_t off, int n, const float* pw) {
    if (dtypes & kParamBf16) narrow_bf16(pw, static_cast<uint16_t*>(p) + off, n);
  }
};

inline uint32_t step_term(int64_t step) { return (uint32_t)((uint64_t)step * 0x85EBCA77ull); }

// leanopt.quant.formats.dither, bit for bit: its hash, and the uniform number in [0, 1).
// The hash from the index's low 32 bits and high_term = (index >> 32) * 0x9E3779B9 (mod 2^32).
inline uint32_t dither_hash32(uint32_t low, uint32_t high_term, uint32_t step_term) {
  uint32_t h = low ^ high_term;
  h = h * 0x9E3779B1u + step_term;
  h ^= h >> 16; h *= 0x7FEB352Du; h ^= h >> 15; h *= 0x846CA68Bu; h ^= h >> 16;
  return h;
}
inline uint32_t dither_hash(int64_t index, uint32_t step_term) {
  uint64_t ui = (uint64_t)index;
  return dither_hash32((uint32_t)(ui & 0xFFFFFFFFu), (uint32_t)(ui >> 32) * 0x9E3779B9u, step_term);
}
inline float dither(int64_t index, uint32_t step_term) {
  return (float)(dither_hash(index, step_term) >> 8) * (1.0f / 16777216.0f);
}

// leanopt.quant.bf16.stochastic_bf16 of x with the dither hash h: the top 16 bits of
// bits(x) + floor(u * 2^16), where u * 2^16 = (h >> 8) / 2^8 exactly, so floor(...) = h >> 16;
// a NaN as to_bf16 writes it.
inline uint16_t stochastic_bf16(float x, uint32_t h) {
  const uint32_t u = fbits(x);
  const uint16_t rounded = static_cast<uint16_t>((u + (h >> 16)) >> 16);
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>(0xFFFF) : rounded;
}

// ---- rules: one element, fp32, torch's operation order -------------------------------------
// Each R<K> reads its scalars c[] at the positions leanopt.kernels.twins.NATIVE declares for its
// rule. K numbers these loops only (a rule and its flags pick one, kernel_of below): 0 AdamW,
// 1 AdamW+amsgrad, 2 Lion, 3 AdEMAMix, 4 SGD with momentum, 5 SGD with Nesterov momentum,
// 6 Muon's momentum, 7 Muon's Nesterov momentum, 8 SGD without momentum (no state: the dense
// loop only). FLOOR false: outside safe mode, where the rules have no floor (the reference
// applies none; the divisors are +inf).
template <int RULE> struct R;

// torch.lerp(a, b, w) on the CPU: fma(w, b - a, a) for |w| < 0.5, else fma(w - 1, b - a, b).
inline float lerp(float a, float b, float w) {
  return std::fabs(w) < 0.5f ? std::fma(w, b - a, a) : std::fma(w - 1.0f, b - a, b);
}

template <> struct R<0> {
  static constexpr int NS = 2;
  template <bool FLOOR = true>
  static inline float apply(float p, float g, float o0, float o1, float o2, float& n0, float& n1, float& n2, const float* c) {
    // decay, w1, b2, 1-b2, eps, step size, sqrt(bc2), floor
    float pn = p * c[0];
    float m = std::fma(c[1], g - o0, o0);  // torch.lerp, weight < 0.5 (ATen's vectorised lerp)
    float v = o1 * c[2] + (c[3] * g) * g;
    if (FLOOR) {
      float f = (m * m) / c[7];
      v = v < f ? f : v;
    }
    n0 = m; n1 = v;
    return pn - c[5] * (m / (std::sqrt(v) / c[6] + c[4]));
  }
};

template <> struct R<1> {
  static constexpr int NS = 3;
  template <bool FLOOR = true>
  static inline float apply(float p, float g, float o0, float o1, float o2, float& n0, float& n1, float& n2, const float* c) {
    float pn = p * c[0];
    float m = std::fma(c[1], g - o0, o0);
    float v = o1 * c[2] + (c[3] * g) * g;
    if (FLOOR) {
      float f = (m * m) / c[7];
      v = v < f ? f : v;
    }
    float vm = o2 < v ? v : o2;
    n0 = m; n1 = v; n2 = vm;
    return pn - c[5] * (m / (std::sqrt(vm) / c[6] + c[4]));
  }
};

template <> struct R<2> {
  static constexpr int NS = 1;
  template <bool FLOOR = true>
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
  template <bool FLOOR = true>
  static inline float apply(float p, float g, float o0, float o1, float o2, float& n0, float& n1, float& n2, const float* c) {
    // decay, b1, 1-b1, b3, 1-b3, b2, 1-b2, bc1, alpha, sqrt(bc2), eps, lr, floor fast, floor slow
    float m1 = o0 * c[1] + c[2] * g;
    float m2 = o1 * c[3] + c[4] * g;
    float nu = o2 * c[5] + (c[6] * g) * g;
    if (FLOOR) {
      float f1 = (m1 * m1) / c[12];
      nu = nu < f1 ? f1 : nu;
      float f2 = (m2 * m2) / c[13];
      nu = nu < f2 ? f2 : nu;
    }
    n0 = m1; n1 = m2; n2 = nu;
    return p * c[0] - c[11] * ((m1 / c[7] + c[8] * m2) / (std::sqrt(nu) / c[9] + c[10]));
  }
};

template <> struct R<4> {
  static constexpr int NS = 1;
  template <bool FLOOR = true>
  static inline float apply(float p, float g, float o0, float o1, float o2, float& n0, float& n1, float& n2, const float* c) {
    // weight_decay, momentum, buffer_decay, buffer_weight, lr
    float d = g + c[0] * p;
    float b = o0 * c[2] + c[3] * d;
    n0 = b;
    return p - c[4] * b;
  }
};

template <> struct R<5> {
  static constexpr int NS = 1;
  template <bool FLOOR = true>
  static inline float apply(float p, float g, float o0, float o1, float o2, float& n0, float& n1, float& n2, const float* c) {
    float d = g + c[0] * p;
    float b = o0 * c[2] + c[3] * d;
    n0 = b;
    return p - c[4] * (d + c[1] * b);
  }
};

template <> struct R<8> {
  static constexpr int NS = 0;
  template <bool FLOOR = true>
  static inline float apply(float p, float g, float o0, float o1, float o2, float& n0, float& n1, float& n2, const float* c) {
    // weight_decay, (momentum, buffer_decay, buffer_weight unread), lr
    float d = g + c[0] * p;
    return p - c[4] * d;
  }
};

// Muon's momentum: the "param" is the direction it writes (its old value is not read).
template <> struct R<6> {
  static constexpr int NS = 1;
  template <bool FLOOR = true>
  static inline float apply(float p, float g, float o0, float o1, float o2, float& n0, float& n1, float& n2, const float* c) {
    // lerp_weight, momentum
    n0 = lerp(o0, g, c[0]);
    return n0;
  }
};

template <> struct R<7> {
  static constexpr int NS = 1;
  template <bool FLOOR = true>
  static inline float apply(float p, float g, float o0, float o1, float o2, float& n0, float& n1, float& n2, const float* c) {
    n0 = lerp(o0, g, c[0]);
    return lerp(g, n0, c[1]);
  }
};

// ---- per-block pieces -----------------------------------------------------------------------
#ifdef LEANOPT_AVX512
// table[ix] for 16 lanes of indices 0..255 without a gather (a gather loads lane by lane):
// eight two-register permutes, each covering 32 entries, and a three-level blend on bits 5-7.
inline __m512 lookup256(__m512i ix, const float* __restrict table) {
  __m512 r[8];
  for (int j = 0; j < 8; ++j)
    r[j] = _mm512_permutex2var_ps(_mm512_loadu_ps(table + 32 * j), ix, _mm512_loadu_ps(table + 32 * j + 16));
  const __mmask16 b5 = _mm512_test_epi32_mask(ix, _mm512_set1_epi32(32));
  const __mmask16 b6 = _mm512_test_epi32_mask(ix, _mm512_set1_epi32(64));
  const __mmask16 b7 = _mm512_test_epi32_mask(ix, _mm512_set1_epi32(128));
  __m512 a = _mm512_mask_blend_ps(b6, _mm512_mask_blend_ps(b5, r[0], r[1]), _mm512_mask_blend_ps(b5, r[2], r[3]));
  __m512 b = _mm512_mask_blend_ps(b6, _mm512_mask_blend_ps(b5, r[4], r[5]), _mm512_mask_blend_ps(b5, r[6], r[7]));
  return _mm512_mask_blend_ps(b7, a, b);
}

// The number of midpoints below each of 16 y (torch.searchsorted) for a 4-bit code: a
// branch-free descent of its 15 midpoints laid out as a complete binary tree (node j's
// children 2j, 2j + 1), all in one register, so every step is a permute, not a load. (For
// 8-bit codes the eight steps, 12 permutes, measured slower than the bucket table.)
inline __m512i search4(__m512 yv, const float* __restrict tree) {
  const __m512i one = _mm512_set1_epi32(1);
  const __m512 nodes = _mm512_loadu_ps(tree);  // entry 0 unused
  __m512i j = one;
  for (int d = 0; d < 4; ++d) {
    __m512i twice = _mm512_add_epi32(j, j);
    j = _mm512_mask_add_epi32(twice, _mm512_cmp_ps_mask(_mm512_permutexvar_ps(j, nodes), yv, _CMP_LT_OQ), twice, one);
  }
  return _mm512_sub_epi32(j, _mm512_set1_epi32(16));
}

// A code book's value (or midpoint) table at 16 indices: one permute for 4-bit codes.
template <int BITS>
inline __m512 lookup(__m512i ix, const float* __restrict table) {
  return BITS == 4 ? _mm512_permutexvar_ps(ix, _mm512_loadu_ps(table)) : lookup256(ix, table);
}

inline __m512 vabs(__m512 x) { return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF))); }

// dither() of the 16 indices index .. index + 15.
inline __m512 dither16(int64_t index, uint32_t step_term) {
  const uint32_t lo0 = (uint32_t)((uint64_t)index & 0xFFFFFFFFu), hi0 = (uint32_t)((uint64_t)index >> 32);
  const __m512i base = _mm512_set1_epi32((int)lo0);
  __m512i lo = _mm512_add_epi32(base, _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  __m512i hi = _mm512_set1_epi32((int)hi0);
  hi = _mm512_mask_add_epi32(hi, _mm512_cmplt_epu32_mask(lo, base), hi, _mm512_set1_epi32(1));  // carry
  __m512i h = _mm512_xor_si512(lo, _mm512_mullo_epi32(hi, _mm512_set1_epi32((int)0x9E3779B9u)));
  h = _mm512_add_epi32(_mm512_mullo_epi32(h, _mm512_set1_epi32((int)0x9E3779B1u)), _mm512_set1_epi32((int)step_term));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32((int)0x7FEB352Du));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 15));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32((int)0x846CA68Bu));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(h, 8)), _mm512_set1_ps(1.0f / 16777216.0f));
}
#endif

// Each has an AVX-512 loop over 16 lanes (when compiled in and k.vec) and the portable loop for
// the rest; both compute the same fp32 operations, so they agree bit for bit (tests). The
// per-block pieces (decode, nearest, decay_block, pack) are compiled once per bit width, not
// inlined into each rule's loop: a call per block and state costs nothing measurable (AdamW8bit,
// AdamW4bit, Lion8bit, AdEMAMix8bit on 4.2M fp32 and bf16 params, one thread, medians of three
// alternated runs: from 6 % faster to 1.5 % slower), and the cold build takes 9.0 s instead of
// 11.3 with Muon's two loops (2026-12-05, 2 cores, AVX2).
template <int BITS>
[[gnu::noinline]] void decode(const uint8_t* __restrict codes, const float* __restrict values, float scale,
                   float* __restrict out, int bs, bool vec) {
  int i = 0;
#ifdef LEANOPT_AVX512
  if (vec) {
    const __m512 s = _mm512_set1_ps(scale);
    if (BITS == 8) {
      for (; i + 16 <= bs; i += 16) {
        __m512i ix = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(codes + i)));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(lookup<8>(ix, values), s));
      }
    } else {
      const __m128i nib = _mm_set1_epi8(15);
      for (; i + 16 <= bs; i += 16) {
        __m128i b = _mm_loadl_epi64((const __m128i*)(codes + i / 2));
        __m128i pairs = _mm_unpacklo_epi8(_mm_and_si128(b, nib), _mm_and_si128(_mm_srli_epi16(b, 4), nib));
        __m512i ix = _mm512_cvtepu8_epi32(pairs);
        _mm512_storeu_ps(out + i, _mm512_mul_ps(lookup<4>(ix, values), s));
      }
    }
  }
#endif
  if (BITS == 8) {
    for (; i < bs; ++i) out[i] = values[codes[i]] * scale;
  } else {
    for (int j = i / 2; j < bs / 2; ++j) {
      uint8_t b = codes[j];
      out[2 * j] = values[b & 15] * scale;
      out[2 * j + 1] = values[b >> 4] * scale;
    }
  }
}

// The bucket of a finite y with |y| <= 1: sign, exponent clamped to the table's rows, top 7
// mantissa bits. Exponents below the rows all share the bottom row's answer (cpu_native.tables).
inline int32_t bucket_key(uint32_t b, int32_t lo, int32_t rows) {
  int32_t e = (int32_t)((b >> 23) & 0xFFu);
  e = e < lo ? lo : (e > lo + rows - 1 ? lo + rows - 1 : e);
  return (int32_t)(b >> 31) * (rows << 7) + ((e - lo) << 7) + (int32_t)((b >> 16) & 0x7Fu);
}

template <int BITS>
[[gnu::noinline]] void nearest(const float* __restrict x, float scale, const Book& bk, int32_t* __restrict idx,
                    float* __restrict y, int bs, bool vec) {
  const uint8_t* __restrict bucket = bk.bucket;
  const float* __restrict thr = bk.thr;
  int i = 0;
#ifdef LEANOPT_AVX512
  if (vec && BITS == 4) {  // four permute steps down the midpoint tree
    const __m512 s = _mm512_set1_ps(scale);
    for (; i + 16 <= bs; i += 16) {
      __m512 yv = _mm512_div_ps(_mm512_loadu_ps(x + i), s);
      _mm512_storeu_ps(y + i, yv);
      _mm512_storeu_si512((void*)(idx + i), search4(yv, bk.eyt));
    }
  } else if (vec) {  // one gather from the bucket table (in L1), one permuted read of the midpoint above
    const __m512 s = _mm512_set1_ps(scale);
    const __m512i lo = _mm512_set1_epi32(bk.lo), hi = _mm512_set1_epi32(bk.lo + bk.rows - 1);
    const __m512i ff = _mm512_set1_epi32(0xFF), m7 = _mm512_set1_epi32(0x7F), one = _mm512_set1_epi32(1);
    const __m512i half = _mm512_set1_epi32(bk.rows << 7), zero = _mm512_setzero_si512();
    for (; i + 16 <= bs; i += 16) {
      __m512 yv = _mm512_div_ps(_mm512_loadu_ps(x + i), s);
      _mm512_storeu_ps(y + i, yv);
      __m512i b = _mm512_castps_si512(yv);
      __m512i e = _mm512_min_epi32(_mm512_max_epi32(_mm512_and_si512(_mm512_srli_epi32(b, 23), ff), lo), hi);
      __m512i key = _mm512_add_epi32(_mm512_slli_epi32(_mm512_sub_epi32(e, lo), 7),
                                     _mm512_and_si512(_mm512_srli_epi32(b, 16), m7));
      key = _mm512_mask_add_epi32(key, _mm512_cmplt_epi32_mask(b, zero), key, half);
      __m512i k = _mm512_and_si512(_mm512_i32gather_epi32(key, (const void*)bucket, 1), ff);
      __mmask16 up = _mm512_cmp_ps_mask(lookup<BITS>(k, thr), yv, _CMP_LT_OQ);
      _mm512_storeu_si512((void*)(idx + i), _mm512_mask_add_epi32(k, up, k, one));
    }
  }
#endif
  if (BITS == 4) {  // count the 15 midpoints below y: no table reads at all, and it vectorises
    for (; i < bs; ++i) {
      float yi = x[i] / scale;
      y[i] = yi;
      int32_t below = 0;
      for (int t = 0; t < 15; ++t) below += thr[t] < yi ? 1 : 0;  // +inf past the last
      idx[i] = below;
    }
    return;
  }
  // Two loops: the first vectorises (the byte loads of the second would keep it scalar).
  const int32_t lo = bk.lo, rows = bk.rows;
  for (int j = i; j < bs; ++j) {
    y[j] = x[j] / scale;
    idx[j] = bucket_key(fbits(y[j]), lo, rows);
  }
  for (; i < bs; ++i) {
    int32_t k = bucket[idx[i]];
    idx[i] = k + (thr[k] < y[i] ? 1 : 0);
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

// The dither of one block's elements (base .. base + bs - 1): the same for every state.
inline void dither_block(float* __restrict u, int64_t base, uint32_t step_term, int bs, bool vec) {
  int i0 = 0;
#ifdef LEANOPT_AVX512
  if (vec)
    for (; i0 + 16 <= bs; i0 += 16) _mm512_storeu_ps(u + i0, dither16(base + i0, step_term));
#endif
#pragma omp simd
  for (int i = i0; i < bs; ++i) u[i] = dither(base + i, step_term);
}

// The decay rounding over one block, where the gradient is exactly 0. The AVX-512 loop reads
// the dither from u (dither_block, once per block for all states); the portable loop computes
// it inline (on AVX2, a separate dither pass made the 4-bit decay 1.75x slower).
template <int BITS>
[[gnu::noinline]] void decay_block(int32_t* __restrict idx, const float* __restrict y, const float* __restrict old,
                        const float* __restrict gbuf, const float* __restrict u, float safe, int64_t base,
                        const Book& bk, const Consts& k, int bs) {
  const uint32_t step_term = k.step_term;
  const float* __restrict values = bk.values;
  const int32_t zero = bk.zero, last = bk.last;
  const float progress = k.progress, growth = k.growth;
  int i0 = 0;
#ifdef LEANOPT_AVX512
  if (k.vec) {  // decay_round on 16 lanes, its three table reads by permutes
    const __m512i vzero = _mm512_set1_epi32(zero), one = _mm512_set1_epi32(1);
    const __m512i vlast = _mm512_set1_epi32(last), nil = _mm512_setzero_si512();
    const __m512 vsafe = _mm512_set1_ps(safe), vprog = _mm512_set1_ps(progress), vgrow = _mm512_set1_ps(growth);
    const __m512 fzero = _mm512_setzero_ps();
    for (; i0 + 16 <= bs; i0 += 16) {
      const __mmask16 z = _mm512_cmp_ps_mask(_mm512_loadu_ps(gbuf + i0), fzero, _CMP_EQ_OQ);
      if (!z) continue;
      const __m512i ix = _mm512_loadu_si512((const void*)(idx + i0));
      const __m512 yv = _mm512_loadu_ps(y + i0), ay = vabs(yv);
      const __m512 prev = _mm512_div_ps(vabs(_mm512_loadu_ps(old + i0)), vsafe);
      const __m512 near = vabs(lookup<BITS>(ix, values));
      const __mmask16 keep = _mm512_cmp_ps_mask(near, _mm512_mul_ps(prev, vprog), _CMP_LT_OQ);
      const __mmask16 over = _mm512_cmp_ps_mask(near, ay, _CMP_GT_OQ) & _mm512_cmpneq_epi32_mask(ix, vzero);
      __m512i a = _mm512_mask_sub_epi32(ix, over & _mm512_cmpgt_epi32_mask(ix, vzero), ix, one);
      a = _mm512_mask_add_epi32(a, over & _mm512_cmplt_epi32_mask(ix, vzero), a, one);
      __m512i b = _mm512_mask_sub_epi32(_mm512_add_epi32(a, one), _mm512_cmp_ps_mask(yv, fzero, _CMP_LT_OQ), a, one);
      b = _mm512_min_epi32(_mm512_max_epi32(b, nil), vlast);
      const __m512 va = vabs(lookup<BITS>(a, values)), vb = vabs(lookup<BITS>(b, values));
      const __m512 gap = _mm512_sub_ps(vb, va);
      const __m512 frac = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(gap, fzero, _CMP_GT_OQ), _mm512_sub_ps(ay, va), gap);
      const __mmask16 held = _mm512_cmp_ps_mask(_mm512_mul_ps(vb, vprog), prev, _CMP_GT_OQ) &
                             _mm512_cmp_ps_mask(vb, _mm512_mul_ps(va, vgrow), _CMP_GT_OQ);
      const __mmask16 up = _mm512_cmp_ps_mask(_mm512_loadu_ps(u + i0), frac, _CMP_LT_OQ) & (__mmask16)~held;
      const __m512i r = _mm512_mask_blend_epi32(keep, _mm512_mask_blend_epi32(up, a, b), ix);
      _mm512_storeu_si512((void*)(idx + i0), _mm512_mask_blend_epi32(z, ix, r));
    }
  }
#endif
#pragma omp simd
  for (int i = i0; i < bs; ++i) {
    float prev_y = std::fabs(old[i]) / safe;
    int32_t r = decay_round(idx[i], y[i], prev_y, dither(base + i, step_term), values, zero, last, progress, growth);
    idx[i] = gbuf[i] == 0.0f ? r : idx[i];
  }
}

template <int BITS>
[[gnu::noinline]] void pack(const int32_t* __restrict idx, uint8_t* __restrict codes, int bs) {
  if (BITS == 8) {
    for (int i = 0; i < bs; ++i) codes[i] = (uint8_t)idx[i];
  } else {
    for (int j = 0; j < bs / 2; ++j) codes[j] = (uint8_t)(idx[2 * j] | (idx[2 * j + 1] << 4));
  }
}

// Whether an element takes its step: always outside safe mode; in it, unless its gradient
// (squared) or one of its new states is not finite (the element then keeps its param and gets
// zero states). A state a rule does not have is 0 here.
template <int NS, bool SAFE>
inline bool stepped(float g, float x0, float x1, float x2) {
  if (!SAFE) return true;
  bool ok = finite(g * g) & finite(x0);
  if (NS > 1) ok = ok & finite(x1);
  if (NS > 2) ok = ok & finite(x2);
  return ok;
}

// The rule over one block: params in place, new states (0 where skipped) into nw, their
// largest magnitude (as fp32 bits: non-negative floats order as integers) into mx, the
// gradient (negated under maximize) into gbuf; returns how many gradients are exactly 0.
// SAFE false (dense states outside safe mode): nothing is skipped.
template <int RULE, bool SAFE = true>
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
    const bool ok = stepped<NS, SAFE>(gi, x0, x1, x2);
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

// ``dtypes``: which of p and g hold bf16 (uint16) values, widened per block into fp32 buffers.
template <int BITS, int RULE>
void run(void* p, const void* g, int dtypes, Book* books, int64_t nblocks, int bs, bool maximize, const Consts& k) {
  constexpr int NS = R<RULE>::NS;
  const int cb = BITS == 8 ? bs : bs / 2;
  int64_t grain = std::max<int64_t>(1, 16384 / bs);
  at::parallel_for(0, nblocks, grain, [&](int64_t b0, int64_t b1) {
    std::vector<float> buf((2 * NS + 3) * bs + 64);
    std::vector<float> wide(dtypes ? 2 * bs : 0);  // bf16: the block's param and gradient in fp32
    std::vector<int32_t> ibuf(bs + 16);
    float* old[MAXS]; float* nw[MAXS];
    for (int s = 0; s < NS; ++s) { old[s] = buf.data() + s * bs; nw[s] = buf.data() + (NS + s) * bs; }
    float* gbuf = buf.data() + 2 * NS * bs;
    float* y = gbuf + bs;
    float* u = y + bs;
    float* pw = wide.data();
    float* gw = pw + (dtypes ? bs : 0);
    int32_t* idx = ibuf.data();
    float c[16];
    for (int i = 0; i < 16; ++i) c[i] = k.c[i];
    for (int64_t blk = b0; blk < b1; ++blk) {
      const Operands op(p, g, dtypes, blk * bs, bs, pw, gw);
      float* __restrict P = op.P;
      const float* __restrict G = op.G;
      for (int s = 0; s < NS; ++s)
        decode<BITS>(books[s].codes + blk * cb, books[s].values, books[s].absmax[blk], old[s], bs, k.vec);
      uint32_t mx[MAXS] = {0, 0, 0};
      int zeros = element_loop<RULE>(P, G, old, nw, gbuf, bs, maximize ? -1.0f : 1.0f, c, mx);
      bool dithered = false;
      for (int s = 0; s < NS; ++s) {
        const Book& bk = books[s];
        float scale = bitsf(mx[s]);
        float safe = scale > 0.0f ? scale : 1.0f;
        nearest<BITS>(nw[s], safe, bk, idx, y, bs, k.vec);
        if (bk.decays && zeros) {
          if (!dithered && k.vec) dither_block(u, k.offset + blk * bs, k.step_term, bs, true);
          dithered = true;
          decay_block<BITS>(idx, y, old[s], gbuf, u, safe, k.offset + blk * bs, bk, k, bs);
        }
        pack<BITS>(idx, bk.codes + blk * cb, bs);
        bk.absmax[blk] = scale;
      }
      Operands::store(p, dtypes, blk * bs, bs, pw);
    }
  });
}

// ---- dense fp32 states ------------------------------------------------------------------------
// The same rules over fp32 states stored as they are (a low-bit optimizer's small params; AdamW,
// Lion and AdEMAMix in fp32), updated in place: an element reads its old states and writes the
// new ones at its own index, and a dense state keeps no block scale, maximum or gradient copy.
// In safe mode an element whose gradient or new states are not finite keeps its param and gets
// zero states, as in the block loops. Chunks of 256 elements (a bf16 param's and gradient's
// widening buffers).
template <int RULE, bool SAFE>
inline void dense_loop(float* __restrict P, const float* __restrict G, float* const* st, int n, float gsign,
                       const float* cin) {
  constexpr int NS = R<RULE>::NS;
  float c[16];  // a local copy, as in element_loop
  for (int k = 0; k < 16; ++k) c[k] = cin[k];
  float* __restrict s0 = st[0];  // nullptr, never read, for a rule without states
  float* __restrict s1 = st[NS > 1 ? 1 : 0];
  float* __restrict s2 = st[NS > 2 ? 2 : 0];
#pragma omp simd
  for (int i = 0; i < n; ++i) {
    float gi = G[i] * gsign;
    float pi = P[i];
    float x0 = 0.0f, x1 = 0.0f, x2 = 0.0f;
    // Outside safe mode the rules apply no floor (leanopt.kernels.rules): no division for it.
    float pn = R<RULE>::template apply<SAFE>(pi, gi, NS > 0 ? s0[i] : 0.0f, NS > 1 ? s1[i] : 0.0f, NS > 2 ? s2[i] : 0.0f,
                                             x0, x1, x2, c);
    const bool ok = stepped<NS, SAFE>(gi, x0, x1, x2);
    P[i] = ok ? pn : pi;
    if (NS > 0) s0[i] = ok ? x0 : 0.0f;
    if (NS > 1) s1[i] = ok ? x1 : 0.0f;
    if (NS > 2) s2[i] = ok ? x2 : 0.0f;
  }
}

// bf16 states (leanopt.quant.bf16; bit j of ``stored``: state j is bf16, the others fp32): read
// widened to fp32, the rule as above, each new bf16 state written with stochastic rounding by
// the dither of index (first + i) * NS + j (first + i: its element's global index) and the step.
template <int RULE, bool SAFE>
inline void dense_loop_bf16(float* __restrict P, const float* __restrict G, void* const* st, int stored, int n,
                            float gsign, const float* cin, int64_t first, uint32_t sterm) {
  constexpr int NS = R<RULE>::NS;
  float c[16];
  for (int k = 0; k < 16; ++k) c[k] = cin[k];
  float* f[MAXS];
  uint16_t* h[MAXS];
  bool b[MAXS];
  for (int j = 0; j < MAXS; ++j) {
    b[j] = j < NS && ((stored >> j) & 1);
    f[j] = static_cast<float*>(j < NS ? st[j] : nullptr);
    h[j] = static_cast<uint16_t*>(j < NS ? st[j] : nullptr);
  }
  for (int i = 0; i < n; ++i) {
    float gi = G[i] * gsign;
    float pi = P[i];
    float o[MAXS] = {0.0f, 0.0f, 0.0f};
    for (int j = 0; j < NS; ++j) o[j] = b[j] ? bitsf(static_cast<uint32_t>(h[j][i]) << 16) : f[j][i];
    float x[MAXS] = {0.0f, 0.0f, 0.0f};
    float pn = R<RULE>::template apply<SAFE>(pi, gi, o[0], o[1], o[2], x[0], x[1], x[2], c);
    const bool ok = stepped<NS, SAFE>(gi, x[0], x[1], x[2]);
    P[i] = ok ? pn : pi;
    const int64_t index = (first + i) * NS;
    for (int j = 0; j < NS; ++j) {
      const float v = ok ? x[j] : 0.0f;
      if (b[j]) h[j][i] = stochastic_bf16(v, dither_hash(index + j, sterm));
      else f[j][i] = v;
    }
  }
}

// Every state bf16 (state_dtype=torch.bfloat16): the loop above without its per-state choices,
// so that it vectorises, for elements whose dither indices (first + i) * NS + j share their high
// 32 bits (the caller checks): ``low`` is the low 32 bits of first * NS.
template <int RULE, bool SAFE>
inline void dense_loop_all_bf16(float* __restrict P, const float* __restrict G, void* const* st, int n, float gsign,
                                const float* cin, uint32_t low, uint32_t high_term, uint32_t sterm) {
  constexpr int NS = R<RULE>::NS;
  float c[16];
  for (int k = 0; k < 16; ++k) c[k] = cin[k];
  uint16_t* __restrict h0 = static_cast<uint16_t*>(st[0]);
  uint16_t* __restrict h1 = static_cast<uint16_t*>(st[NS > 1 ? 1 : 0]);
  uint16_t* __restrict h2 = static_cast<uint16_t*>(st[NS > 2 ? 2 : 0]);
#pragma omp simd
  for (int i = 0; i < n; ++i) {
    float gi = G[i] * gsign;
    float pi = P[i];
    float x0 = 0.0f, x1 = 0.0f, x2 = 0.0f;
    float pn = R<RULE>::template apply<SAFE>(pi, gi, bitsf(static_cast<uint32_t>(h0[i]) << 16),
                                             NS > 1 ? bitsf(static_cast<uint32_t>(h1[i]) << 16) : 0.0f,
                                             NS > 2 ? bitsf(static_cast<uint32_t>(h2[i]) << 16) : 0.0f, x0, x1, x2, c);
    const bool ok = stepped<NS, SAFE>(gi, x0, x1, x2);
    P[i] = ok ? pn : pi;
    const uint32_t index = low + static_cast<uint32_t>(i) * NS;
    h0[i] = stochastic_bf16(ok ? x0 : 0.0f, dither_hash32(index, high_term, sterm));
    if (NS > 1) h1[i] = stochastic_bf16(ok ? x1 : 0.0f, dither_hash32(index + 1, high_term, sterm));
    if (NS > 2) h2[i] = stochastic_bf16(ok ? x2 : 0.0f, dither_hash32(index + 2, high_term, sterm));
  }
}

// ``dtypes``: which of p and g hold bf16 values, widened per chunk as in run(). ``stored``: which
// states are bf16 (0: the fp32 loop above), ``offset`` the param's element 0's global index.
template <int RULE, bool SAFE>
void run_dense(void* p, const void* g, int dtypes, void* const* st, int stored, int64_t n, bool maximize, const Consts& k) {
  constexpr int NS = R<RULE>::NS;
  constexpr int CH = 256;
  const int64_t chunks = (n + CH - 1) / CH;
  at::parallel_for(0, chunks, std::max<int64_t>(1, 16384 / CH), [&](int64_t c0, int64_t c1) {
    alignas(64) float pw[CH];
    alignas(64) float gw[CH];
    for (int64_t ch = c0; ch < c1; ++ch) {
      const int64_t off = ch * CH;
      const int len = (int)std::min<int64_t>(CH, n - off);
      const Operands op(p, g, dtypes, off, len, pw, gw);
      if (stored == 0) {
        float* here[MAXS] = {nullptr, nullptr, nullptr};
        for (int j = 0; j < NS; ++j) here[j] = static_cast<float*>(st[j]) + off;
        dense_loop<RULE, SAFE>(op.P, op.G, here, len, maximize ? -1.0f : 1.0f, k.c);
      } else {
        void* here[MAXS] = {nullptr, nullptr, nullptr};
        for (int j = 0; j < NS; ++j)
          here[j] = (stored >> j) & 1 ? static_cast<void*>(static_cast<uint16_t*>(st[j]) + off)
                                      : static_cast<void*>(static_cast<float*>(st[j]) + off);
        const uint64_t lo_index = (uint64_t)(k.offset + off) * NS, hi_index = lo_index + (uint64_t)len * NS - 1;
        if (NS > 0 && stored == (1 << NS) - 1 && (lo_index >> 32) == (hi_index >> 32))
          dense_loop_all_bf16<RULE, SAFE>(op.P, op.G, here, len, maximize ? -1.0f : 1.0f, k.c, (uint32_t)lo_index,
                                          (uint32_t)(lo_index >> 32) * 0x9E3779B9u, k.step_term);
        else
          dense_loop_bf16<RULE, SAFE>(op.P, op.G, here, stored, len, maximize ? -1.0f : 1.0f, k.c, k.offset + off,
                                      k.step_term);
      }
      Operands::store(p, dtypes, off, len, pw);
    }
  });
}

}  // namespace

// ---- entry points --------------------------------------------------------------------------
// Tensors arrive as addresses (Tensor.data_ptr()); leanopt.kernels.cpu_native checks their
// dtype, layout and size before calling. Only Python.h and ATen/Parallel.h are included, not
// torch/extension.h or pybind11 (see the Python module below).
#define LEANOPT_CHECK(cond, msg) do { if (!(cond)) throw std::invalid_argument(msg); } while (0)

template <typename T> inline T* at_addr(int64_t a) { return reinterpret_cast<T*>(static_cast<uintptr_t>(a)); }

// The rule numbers are leanopt.kernels.rules.rule_id's, defined by the build
// (cpu_native._CFLAGS): one numbering for this kernel and the Triton helpers.
#if !defined(LEANOPT_RULE_ADAMW) || !defined(LEANOPT_RULE_LION) || !defined(LEANOPT_RULE_ADEMAMIX) || \
    !defined(LEANOPT_RULE_SGD) || !defined(LEANOPT_RULE_MUON_MOMENTUM)
#error "build through leanopt.kernels.cpu_native, which defines the rule numbers"
#endif

// The loop R<K> of a rule number, its flag bits (bit k: the rule's k-th flag) and its number of
// states; -1: none.
inline int kernel_of(int64_t rule, int64_t flags, size_t states) {
  switch (rule) {
    case LEANOPT_RULE_ADAMW: return flags & 1 ? 1 : 0;  // amsgrad
    case LEANOPT_RULE_LION: return 2;
    case LEANOPT_RULE_ADEMAMIX: return 3;
    case LEANOPT_RULE_SGD: return states == 0 ? 8 : flags & 1 ? 5 : 4;  // no momentum; nesterov
    case LEANOPT_RULE_MUON_MOMENTUM: return flags & 1 ? 7 : 6;  // nesterov
    default: return -1;
  }
}

inline int states_of(int kernel) {
  switch (kernel) {
    case 0: return R<0>::NS; case 1: return R<1>::NS; case 2: return R<2>::NS;
    case 3: return R<3>::NS; case 4: return R<4>::NS; case 5: return R<5>::NS;
    case 6: return R<6>::NS; case 7: return R<7>::NS; case 8: return R<8>::NS;
    default: return -1;
  }
}

// ``dtypes``: kParamBf16 and kGradBf16 bits (else fp32); ``stored``: bit j, state j is bf16 (else
// fp32), written with stochastic rounding keyed on ``step`` and the global index (``offset``: the
// param's element 0's).
void step_dense(int64_t rule, int64_t flags, bool maximize, bool safe, int64_t p, int64_t g, int dtypes, int64_t n,
                std::vector<int64_t> states, std::vector<double> scalars, int stored, int64_t step, int64_t offset) {
  const int kernel = kernel_of(rule, flags, states.size());
  LEANOPT_CHECK(kernel >= 0, "no loop for this rule number");
  LEANOPT_CHECK((int)states.size() == states_of(kernel), "wrong number of states for the rule");
  LEANOPT_CHECK(scalars.size() <= 16 && n >= 0, "too many scalars, or a negative size");
  LEANOPT_CHECK(stored >= 0 && stored < (1 << states.size()) && step >= 0 && offset >= 0,
                "stored: one bit per state; step and offset non-negative");
  void* st[MAXS] = {nullptr, nullptr, nullptr};
  for (size_t s = 0; s < states.size(); ++s) st[s] = at_addr<void>(states[s]);
  Consts k{};
  for (int i = 0; i < 16; ++i) k.c[i] = i < (int)scalars.size() ? (float)scalars[i] : 0.0f;
  k.step_term = step_term(step);
  k.offset = offset;
  void* pp = at_addr<void>(p);
  const void* gp = at_addr<const void>(g);
#define LEANOPT_DENSE(RL) \
  (safe ? run_dense<RL, true>(pp, gp, dtypes, st, stored, n, maximize, k) \
        : run_dense<RL, false>(pp, gp, dtypes, st, stored, n, maximize, k))
  switch (kernel) { case 0: LEANOPT_DENSE(0); break; case 1: LEANOPT_DENSE(1); break; case 2: LEANOPT_DENSE(2); break;
                    case 3: LEANOPT_DENSE(3); break; case 4: LEANOPT_DENSE(4); break; case 5: LEANOPT_DENSE(5); break;
                    case 6: LEANOPT_DENSE(6); break; case 7: LEANOPT_DENSE(7); break; case 8: LEANOPT_DENSE(8); break; }
#undef LEANOPT_DENSE
}

// ``dtypes``: kParamBf16 and kGradBf16 bits (else fp32).
void step_blocks(int64_t rule, int64_t flags, int64_t bits, int64_t block, bool maximize, int64_t p, int64_t g,
                 int dtypes, int64_t nblocks,
                 std::vector<int64_t> codes, std::vector<int64_t> absmax, std::vector<int64_t> values,
                 std::vector<int64_t> thresholds, std::vector<int64_t> trees, std::vector<int64_t> buckets,
                 std::vector<int64_t> lows, std::vector<int64_t> zeros, std::vector<int64_t> lasts,
                 std::vector<int64_t> decays, int64_t step, int64_t offset, std::vector<double> scalars,
                 double progress, double growth, bool vec) {
  const size_t ns = codes.size();
  const int kernel = kernel_of(rule, flags, ns);
  LEANOPT_CHECK(kernel >= 0 && states_of(kernel) >= 1, "no block loop for this rule number and number of states");
  LEANOPT_CHECK(bits == 8 || (bits == 4 && block % 2 == 0), "8-bit, or 4-bit with an even block size");
  LEANOPT_CHECK(block >= 1 && nblocks >= 0 && scalars.size() <= 16, "bad block size or count, or too many scalars");
  LEANOPT_CHECK((int)ns == states_of(kernel), "wrong number of states for the rule");
  for (const auto* v : {&absmax, &values, &thresholds, &trees, &buckets, &lows, &zeros, &lasts, &decays})
    LEANOPT_CHECK(v->size() == ns, "one entry per state in every list");
  Book books[MAXS];
  for (size_t s = 0; s < ns; ++s) {
    LEANOPT_CHECK(lows[s] >= 0 && lows[s] < 128 && lasts[s] >= 1 && lasts[s] < (1 << bits) && zeros[s] >= 0 &&
                  zeros[s] <= lasts[s], "tables");
    books[s] = Book{at_addr<uint8_t>(codes[s]), at_addr<float>(absmax[s]), at_addr<const float>(values[s]),
                    at_addr<const float>(thresholds[s]), at_addr<const float>(trees[s]),
                    at_addr<const uint8_t>(buckets[s]), (int)lows[s], (int)(128 - lows[s]), (int)zeros[s],
                    (int)lasts[s], decays[s] != 0};
  }
  Consts k;
  for (int i = 0; i < 16; ++i) k.c[i] = i < (int)scalars.size() ? (float)scalars[i] : 0.0f;
  k.progress = (float)progress;
  k.growth = (float)growth;
  k.step_term = step_term(step);
  k.offset = offset;
  k.vec = vec && kAvx512;
  void* pp = at_addr<void>(p);
  const void* gp = at_addr<const void>(g);
  int bs = (int)block;
#define LEANOPT_RUN(B, RL) run<B, RL>(pp, gp, dtypes, books, nblocks, bs, maximize, k)
  if (bits == 8) {
    switch (kernel) { case 0: LEANOPT_RUN(8, 0); break; case 1: LEANOPT_RUN(8, 1); break; case 2: LEANOPT_RUN(8, 2); break;
                      case 3: LEANOPT_RUN(8, 3); break; case 4: LEANOPT_RUN(8, 4); break; case 5: LEANOPT_RUN(8, 5); break;
                      case 6: LEANOPT_RUN(8, 6); break; case 7: LEANOPT_RUN(8, 7); break; }
  } else {
    switch (kernel) { case 0: LEANOPT_RUN(4, 0); break; case 1: LEANOPT_RUN(4, 1); break; case 2: LEANOPT_RUN(4, 2); break;
                      case 3: LEANOPT_RUN(4, 3); break; case 4: LEANOPT_RUN(4, 4); break; case 5: LEANOPT_RUN(4, 5); break;
                      case 6: LEANOPT_RUN(4, 6); break; case 7: LEANOPT_RUN(4, 7); break; }
  }
#undef LEANOPT_RUN
}

// dither_block's numbers for elements base .. base + n - 1 at a step, into out (tests).
void dither_values(int64_t out, int64_t base, int64_t n, int64_t step, bool vec) {
  LEANOPT_CHECK(n >= 0 && n < (1 << 30), "bad size");
  dither_block(at_addr<float>(out), base, step_term(step), (int)n, vec && kAvx512);
}

bool avx512() { return kAvx512; }

// ---- the Python module -------------------------------------------------------------------------
// Written against Python's C API (not pybind11, whose headers and templates were half the cold
// build): each function parses its arguments, releases the GIL for the loops, and turns a failed
// LEANOPT_CHECK into a ValueError.
namespace {

// A list or tuple of ints (or floats) into ``out``; false with a TypeError set otherwise.
template <typename T>
bool to_vector(PyObject* obj, const char* what, std::vector<T>& out) {
  PyObject* seq = PySequence_Fast(obj, what);
  if (seq == nullptr) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  out.resize(static_cast<size_t>(n));
  PyObject** items = PySequence_Fast_ITEMS(seq);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<T, double>) out[i] = PyFloat_AsDouble(items[i]);
    else out[i] = static_cast<T>(PyLong_AsLongLong(items[i]));
    if (PyErr_Occurred()) { Py_DECREF(seq); return false; }
  }
  Py_DECREF(seq);
  return true;
}

// ``body`` without the GIL; a std::invalid_argument it throws becomes a ValueError.
template <typename F>
PyObject* released(F&& body) {
  std::string error;
  Py_BEGIN_ALLOW_THREADS
  try { body(); } catch (const std::invalid_argument& e) { error = e.what(); }
  Py_END_ALLOW_THREADS
  if (!error.empty()) { PyErr_SetString(PyExc_ValueError, error.c_str()); return nullptr; }
  Py_RETURN_NONE;
}

PyObject* py_step_dense(PyObject*, PyObject* args) {
  long long rule, flags, p, g, n, step, offset;
  int maximize, safe, dtypes, stored;
  PyObject *states_obj, *scalars_obj;
  if (!PyArg_ParseTuple(args, "LLppLLiLOOiLL:step_dense", &rule, &flags, &maximize, &safe, &p, &g, &dtypes, &n,
                        &states_obj, &scalars_obj, &stored, &step, &offset))
    return nullptr;
  std::vector<int64_t> states;
  std::vector<double> scalars;
  if (!to_vector(states_obj, "states must be a list of addresses", states) ||
      !to_vector(scalars_obj, "scalars must be a list of floats", scalars))
    return nullptr;
  return released([&] {
    LEANOPT_CHECK(dtypes >= 0 && dtypes <= (kParamBf16 | kGradBf16), "dtypes: the param's and the gradient's bf16 bits");
    step_dense(rule, flags, maximize, safe, p, g, dtypes, n, std::move(states), std::move(scalars), stored, step, offset);
  });
}

PyObject* py_step_blocks(PyObject*, PyObject* args) {
  long long rule, flags, bits, block, p, g, nblocks, step, offset;
  int maximize, dtypes, vec;
  double progress, growth;
  PyObject* lists[11];
  if (!PyArg_ParseTuple(args, "LLLLpLLiLOOOOOOOOOOLLOddp:step_blocks", &rule, &flags, &bits, &block, &maximize, &p, &g,
                        &dtypes, &nblocks, &lists[0], &lists[1], &lists[2], &lists[3], &lists[4], &lists[5], &lists[6],
                        &lists[7], &lists[8], &lists[9], &step, &offset, &lists[10], &progress, &growth, &vec))
    return nullptr;
  std::vector<int64_t> v[10];
  std::vector<double> scalars;
  for (int i = 0; i < 10; ++i)
    if (!to_vector(lists[i], "the per-state arguments must be lists of ints", v[i])) return nullptr;
  if (!to_vector(lists[10], "scalars must be a list of floats", scalars)) return nullptr;
  return released([&] {
    LEANOPT_CHECK(dtypes >= 0 && dtypes <= (kParamBf16 | kGradBf16), "dtypes: the param's and the gradient's bf16 bits");
    step_blocks(rule, flags, bits, block, maximize, p, g, dtypes, nblocks, std::move(v[0]), std::move(v[1]), std::move(v[2]),
                std::move(v[3]), std::move(v[4]), std::move(v[5]), std::move(v[6]), std::move(v[7]), std::move(v[8]),
                std::move(v[9]), step, offset, std::move(scalars), progress, growth, vec);
  });
}

PyObject* py_dither_values(PyObject*, PyObject* args) {
  long long out, base, n, step;
  int vec;
  if (!PyArg_ParseTuple(args, "LLLLp:dither_values", &out, &base, &n, &step, &vec)) return nullptr;
  return released([&] { dither_values(out, base, n, step, vec); });
}

PyObject* py_avx512(PyObject*, PyObject*) { return PyBool_FromLong(avx512()); }

PyMethodDef methods[] = {
    {"step_blocks", py_step_blocks, METH_VARARGS, "One step of a param's whole blocks, block-quantized states."},
    {"step_dense", py_step_dense, METH_VARARGS, "One step of a param over dense fp32 or bf16 states."},
    {"dither_values", py_dither_values, METH_VARARGS, "The stochastic rounding's numbers for a range of elements."},
    {"avx512", py_avx512, METH_NOARGS, "Whether the AVX-512 loops were compiled in."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, nullptr, "leanopt's native CPU kernel", -1, methods};

}  // namespace

#define LEANOPT_CAT2(a, b) a##b
#define LEANOPT_CAT(a, b) LEANOPT_CAT2(a, b)
#define LEANOPT_STR2(a) #a
#define LEANOPT_STR(a) LEANOPT_STR2(a)

PyMODINIT_FUNC LEANOPT_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  module_def.m_name = LEANOPT_STR(TORCH_EXTENSION_NAME);
  return PyModule_Create(&module_def);
}
