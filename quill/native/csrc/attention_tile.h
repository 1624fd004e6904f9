// The decode-attention template (attention.h), included by attention_{scalar,avx2,avx512}.cpp:
// plain loops over fixed-width lane arrays that each TU's flags let the compiler vectorise.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>

#include "attention.h"
#include "vmath.h"

// Internal linkage: each TU keeps its own copy, compiled with its own ISA flags (one shared
// inline definition would let the linker pick, say, the AVX-512 one for every variant).
namespace quill::attn {
namespace {

constexpr int L = 16;  // lane partials of every sum: the fixed order all variants share
constexpr float kMasked = -3.0e38f;  // the score of a masked position

// ((p0 + p8) + (p4 + p12)) + ... : halves added lane-wise, unrolled so the compiler keeps
// it in registers (a loop over the width went through the stack: half the kernel's time)
inline float tree(const float* p) {
  float a[8], b[4];
  for (int j = 0; j < 8; ++j) a[j] = p[j] + p[j + 8];
  for (int j = 0; j < 4; ++j) b[j] = a[j] + a[j + 4];
  return (b[0] + b[2]) + (b[1] + b[3]);
}

inline float widen(float x) { return x; }
inline float widen(uint16_t h) {  // bfloat16 -> float32, exact
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float widen(_Float16 h) { return float(h); }  // IEEE float16 -> float32, exact

// One k or v row into a pool (KVStore).  bfloat16: round to nearest even on the bits (NaN stays a
// quiet NaN), as torch rounds; float16: saturated to +-65504 (a value past float16's range would
// otherwise become inf and every later attention output NaN; NaN stays NaN), then the compiler's
// conversion (vcvtps2ph with F16C, software in the scalar twin), also to nearest even.
constexpr float kF16Max = 65504.0f;
inline float f16_range(float x) { return x > kF16Max ? kF16Max : (x < -kF16Max ? -kF16Max : x); }
inline uint16_t to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40u);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline void store_kv(void* dst, const float* __restrict src, int64_t n, KVType type) {
  if (type == KVType::F32) {
    std::memcpy(dst, src, size_t(n) * sizeof(float));
  } else if (type == KVType::BF16) {
    uint16_t* __restrict d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = to_bf16(src[i]);
  } else {
    _Float16* __restrict d = static_cast<_Float16*>(dst);
    int64_t i = 0;
#ifdef __F16C__  // (GCC 12 converts _Float16 vectors element by element)
    const __m256 hi = _mm256_set1_ps(kF16Max), lo = _mm256_set1_ps(-kF16Max);
    for (; i + 8 <= n; i += 8) {  // min / max return their second operand when one is NaN: x's NaN stays
      const __m256 x = _mm256_max_ps(lo, _mm256_min_ps(hi, _mm256_loadu_ps(src + i)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    }
#endif
    for (; i < n; ++i) d[i] = _Float16(f16_range(src[i]));
  }
}

// dst[0 .. n) = src widened to float32 (exact)
template <class T>
inline void widen_row(const T* __restrict src, float* __restrict dst, int64_t n) {
  int64_t i = 0;
#ifdef __F16C__
  if constexpr (std::is_same_v<T, _Float16>)
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = widen(src[i]);
}

template <class T>
inline float dot(const float* a, const T* b, int64_t d) {  // a, b [d]
  float part[L] = {};
  int64_t i = 0;
  for (; i + L <= d; i += L)
    for (int j = 0; j < L; ++j) part[j] = std::fma(a[i + j], widen(b[i + j]), part[j]);
  for (int j = 0; i < d; ++i, ++j) part[j] = std::fma(a[i], widen(b[i]), part[j]);
  return tree(part);
}

// exp(x) for x <= 0 (vmath.h's exp_vec); 0 below -87 (where float32 exp underflows to denormals anyway)
inline float exp_neg(float x) { return x < -87.0f ? 0.0f : exp_vec(x); }

// sum of x[0 .. n) in the fixed lane order
inline float sum(const float* x, int64_t n) {
  float part[L] = {};
  int64_t i = 0;
  for (; i + L <= n; i += L)
    for (int j = 0; j < L; ++j) part[j] += x[i + j];
  for (int j = 0; i < n; ++i, ++j) part[j] += x[i];
  return tree(part);
}

inline float max(const float* x, int64_t n) {
  float part[L];
  for (int j = 0; j < L; ++j) part[j] = kMasked;
  int64_t i = 0;
  for (; i + L <= n; i += L)
    for (int j = 0; j < L; ++j) part[j] = x[i + j] > part[j] ? x[i + j] : part[j];
  for (int j = 0; i < n; ++i, ++j) part[j] = x[i] > part[j] ? x[i] : part[j];
  float m = part[0];  // max is exact: the order does not matter
  for (int j = 1; j < L; ++j) m = part[j] > m ? part[j] : m;
  return m;
}

// ---- Blocked passes for head dimensions known at compile time (64, 128) ----------------------
//
// The same sums as dot() / tree() and the p V loop below, in the same order, only arranged so
// that no value leaves the vector registers: each key's 16 lane partials are reduced together
// with the partials of ATT_W - 1 other keys (a butterfly whose stages are exactly tree()'s pairs:
// lanes j + 8, then j + 4, then j + 2, then j + 1), and p V keeps each query head's D sums in
// registers across the keys (two heads a pass, sharing each V row).  Which lanes a register
// holds is the TU's choice (ATT_W: 16 with AVX-512, 8 otherwise); no sum's order depends on it.
#ifndef ATT_W
#define ATT_W 8
#endif
constexpr int W = ATT_W;
static_assert(W == 8 || W == 16, "ATT_W is 8 or 16");
typedef float vw __attribute__((vector_size(W * 4)));
typedef uint32_t uw __attribute__((vector_size(W * 4)));
typedef uint16_t hw __attribute__((vector_size(W * 2)));

inline vw vload(const float* p) {
  vw v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vw vload(const uint16_t* p) {  // W bfloat16 words -> float32, exact
  hw h;
  std::memcpy(&h, p, sizeof h);
  const uw u = __builtin_convertvector(h, uw) << 16;
  vw v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
typedef _Float16 fw __attribute__((vector_size(W * 2)));
inline vw vload(const _Float16* p) {  // W float16 values -> float32, exact
#if ATT_W == 16 && defined(__AVX512F__)
  return (vw)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif ATT_W == 8 && defined(__F16C__)
  return (vw)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  fw h;
  std::memcpy(&h, p, sizeof h);
  return __builtin_convertvector(h, vw);
#endif
}
inline void vstore(float* p, const vw& v) { std::memcpy(p, &v, sizeof v); }
// a * b + c rounded once, lane by lane, for a GCC vector V of 4, 8 or 16 floats: the FMA
// instruction where the TU has one, std::fma (exact, in software on the baseline) in the scalar
// twin -- the same value either way (decode attention here, prefill_tile.h too)
template <class V>
inline V fused(const V& a, const V& b, const V& c) {
  constexpr int n = int(sizeof(V) / sizeof(float));
#ifdef __AVX512F__
  if constexpr (n == 16) return (V)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#endif
#ifdef __FMA__
  if constexpr (n == 8) return (V)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#endif
  V r;
  for (int j = 0; j < n; ++j) r[j] = std::fma(a[j], b[j], c[j]);
  return r;
}
inline vw vfma(const vw& a, const vw& b, const vw& c) { return fused(a, b, c); }

// Output lane o of a butterfly stage over segments of LEN lanes (one key's values each): inputs a
// (lanes 0 .. W) and b (W .. 2W) hold W / LEN keys each; the output holds all 2W / LEN keys, a's
// first, each as LEN / 2 lanes: lane j of key k takes its input lane j (HI = 0) or j + LEN / 2.
constexpr int stage_lane(int len, int hi, int o) {
  const int half = len / 2, per = W / len, seg = o / half;
  return (seg < per ? 0 : W) + (seg % per) * len + o % half + hi * half;
}
template <int LEN, int HI, size_t... I>
inline vw pick(const vw& a, const vw& b, std::index_sequence<I...>) {
  return __builtin_shufflevector(a, b, stage_lane(LEN, HI, int(I))...);
}
template <int LEN>
inline void stage(vw* x, int n) {  // n vectors -> n / 2, each key's values halved by pairwise sums
  for (int m = 0; m < n / 2; ++m)
    x[m] = pick<LEN, 0>(x[2 * m], x[2 * m + 1], std::make_index_sequence<W>{}) +
           pick<LEN, 1>(x[2 * m], x[2 * m + 1], std::make_index_sequence<W>{});
}
// x[k]: key k's lane partials folded to W lanes (for W = 8: p[j] + p[j + 8]) -> the W keys' tree()s
inline vw reduce_keys(vw* x) {
  if constexpr (W == 16) stage<16>(x, 16);
  stage<8>(x, 8);
  stage<4>(x, 4);
  stage<2>(x, 2);
  return x[0];
}

// scores[g][s0 .. s0 + W) = scale * dot(q[g], K[s]) for W keys (rows `krows`), query heads [0, NG)
template <int D, class T>
inline void qk_block(const float* __restrict q, const T* const* krows, int64_t ng, float scale, float* __restrict scores,
                     int64_t sstride) {
  constexpr int NPW = L / W;  // registers per 16-lane partial
  for (int64_t g = 0; g < ng; ++g) {
    const float* qg = q + g * D;
    vw x[W];
    for (int kk = 0; kk < W; ++kk) {
      vw p[NPW] = {};
      for (int i = 0; i < D; i += L)
        for (int u = 0; u < NPW; ++u) p[u] = vfma(vload(qg + i + u * W), vload(krows[kk] + i + u * W), p[u]);
      if constexpr (NPW == 2) x[kk] = p[0] + p[1];  // tree()'s first level: p[j] + p[j + 8]
      else x[kk] = p[0];
    }
    vstore(scores + g * sstride, reduce_keys(x) * scale);
  }
}

// Rows (K or V) this far ahead are prefetched: a sequence's rows come through its slot table, one
// head's D values out of every pool row (a strided walk the hardware prefetchers did not keep ahead
// of: 14 GB/s from DRAM at 4096 cached tokens).  Prefetching changes no value.
constexpr int64_t kAheadRows = 32;
template <class T>
inline void prefetch_row(const T* row, int64_t d) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < d * int64_t(sizeof(T)); off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

// acc_g += sum_s p[g][s] V[s] over keys [0, n) in order (masked keys skipped), two query heads at a
// time sharing each V row; acc_g starts at 0 (first) or from `acc`, and ends in `acc` or, on the
// last block, as out[g] = acc_g * inv_g.  The sums run key by key exactly as one pass would.
template <int D, class T, int NQ>
inline void pv_heads(const float* __restrict p, int64_t sstride, const T* vbase, const int64_t* rows, int64_t vs,
                     const uint8_t* mask, int64_t n, bool first, bool last, float* __restrict acc_mem,
                     const float* inv, float* __restrict out) {
  constexpr int C = D / W;
  vw acc[NQ][C] = {};
  if (!first)
    for (int g = 0; g < NQ; ++g)
      for (int c = 0; c < C; ++c) acc[g][c] = vload(acc_mem + g * D + c * W);
  for (int64_t s = 0; s < n; ++s) {
    if (s + kAheadRows < n) prefetch_row(vbase + (rows ? rows[s + kAheadRows] : s + kAheadRows) * vs, D);
    if (mask && !mask[s]) continue;
    const T* vrow = vbase + (rows ? rows[s] : s) * vs;
    vw vv[C];
    for (int c = 0; c < C; ++c) vv[c] = vload(vrow + c * W);
    for (int g = 0; g < NQ; ++g) {
      const vw w = vw{} + p[g * sstride + s];
      for (int c = 0; c < C; ++c) acc[g][c] = vfma(w, vv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < NQ; ++g)
    for (int c = 0; c < C; ++c) {
      if (last) vstore(out + g * D + c * W, acc[g][c] * inv[g]);
      else vstore(acc_mem + g * D + c * W, acc[g][c]);
    }
}

// Keys per p V block: its V rows (32 KiB of float32 rows at D = 128) stay in L1 while every pair
// of query heads passes over them.
constexpr int64_t kPvKeys = 64;

// DC: the head dimension when known at compile time (64, 128, 256), else 0 (a.d at run time);
// T: the K / V element (float, uint16_t bfloat16 words, or _Float16).
template <int DC, class T>
void head(const AttnArgs& a, const T* k, const T* v, int64_t b, int64_t kvh, float* __restrict scratch) {
  // Paged: S is this sequence's length, rows come through its slot table (masked padding
  // past the length would add exact zeros to the same lanes: the bits do not change).
  // A window starts the sequence `first` positions in: the rows before it are never read.
  const int64_t len = a.slots ? a.lens[b] : a.s;
  const int64_t first = a.slots && a.window > 0 && len > a.window ? len - a.window : 0;
  const int64_t G = a.h / a.hkv, S = len - first, D = DC ? DC : a.d;
  const int64_t g0 = a.g_begin, NG = (a.g_end < 0 ? G : a.g_end) - g0;  // this call's query heads
  const float* __restrict q = a.q + (b * a.h + kvh * G + g0) * D;  // [NG, D]
  const int64_t* rows = a.slots ? a.slots + b * a.slot_b + first : nullptr;  // [S] pool rows
  const T* kbase = k + (rows ? 0 : b * a.kb) + kvh * a.kh;     // [S, D], rows ks apart
  const T* vbase = v + (rows ? 0 : b * a.vb) + kvh * a.vh;     // [S, D], rows vs apart
  const uint8_t* mask = a.mask ? a.mask + b * a.mask_b : nullptr;  // [S]
  float* __restrict scores = scratch;        // [NG, S]
  float* __restrict acc = scratch + NG * S;  // [NG, D]
  int64_t s = 0;
  if constexpr (DC != 0) {  // whole blocks of W keys (masked keys are overwritten below)
    for (; s + W <= S; s += W) {
      const T* krows[W];
      for (int kk = 0; kk < W; ++kk) krows[kk] = kbase + (rows ? rows[s + kk] : s + kk) * a.ks;
      for (int64_t j = s + kAheadRows; j < std::min(S, s + kAheadRows + W); ++j)
        prefetch_row(kbase + (rows ? rows[j] : j) * a.ks, D);
      qk_block<DC>(q, krows, NG, a.scale, scores + s, S);
      if (mask)
        for (int kk = 0; kk < W; ++kk)
          if (!mask[s + kk])
            for (int64_t g = 0; g < NG; ++g) scores[g * S + s + kk] = kMasked;
    }
  }
  for (; s < S; ++s) {  // each K row once, for all G query heads
    const T* __restrict krow = kbase + (rows ? rows[s] : s) * a.ks;
    const bool on = !mask || mask[s];
    for (int64_t g = 0; g < NG; ++g) scores[g * S + s] = on ? dot(q + g * D, krow, D) * a.scale : kMasked;
  }
  // With sinks: each head's sink logit joins the max, and exp(sink - max) the sum (kept past the scores)
  float* __restrict sink_p = a.sinks ? scratch + NG * (S + D) : nullptr;  // [NG]
  for (int64_t g = 0; g < NG; ++g) {  // p = exp(score - max): 0 at masked positions (kMasked - max < -87)
    float* __restrict sc = scores + g * S;
    float mx = max(sc, S);
    const bool none = mx == kMasked;  // every position masked
    if (sink_p) {
      const float sink = a.sinks[kvh * G + g0 + g];
      mx = none || sink > mx ? sink : mx;
      sink_p[g] = exp_neg(sink - mx);
    }
    for (int64_t i = 0; i < S; ++i) sc[i] = none ? 0.0f : exp_neg(sc[i] - mx);
  }
  float* out = a.out + (b * a.h + kvh * G + g0) * D;  // [NG, D]
  if constexpr (DC != 0) {
    float* sums = acc;  // [NG, D] partial sums between key blocks
    for (int64_t s0 = 0; s0 < S; s0 += kPvKeys) {
      const int64_t n = std::min<int64_t>(kPvKeys, S - s0);
      const T* vb = rows ? vbase : vbase + s0 * a.vs;
      const int64_t* rb = rows ? rows + s0 : nullptr;
      const uint8_t* mb = mask ? mask + s0 : nullptr;
      const bool first = s0 == 0, last = s0 + n == S;
      for (int64_t g = 0; g < NG; g += 2) {
        const int nq = NG - g >= 2 ? 2 : 1;
        float inv[2] = {};
        for (int j = 0; last && j < nq; ++j) {  // a fully masked row (quill's cache never builds one): zeros
          const float total = sum(scores + (g + j) * S, S) + (sink_p ? sink_p[g + j] : 0.0f);
          inv[j] = total > 0.0f ? 1.0f / total : 0.0f;
        }
        if (nq == 2)
          pv_heads<DC, T, 2>(scores + g * S + s0, S, vb, rb, a.vs, mb, n, first, last, sums + g * D, inv, out + g * D);
        else
          pv_heads<DC, T, 1>(scores + g * S + s0, S, vb, rb, a.vs, mb, n, first, last, sums + g * D, inv, out + g * D);
      }
    }
    return;
  }
  for (int64_t g = 0; g < NG; ++g)
    for (int64_t i = 0; i < D; ++i) acc[g * D + i] = 0.0f;
  for (int64_t j = 0; j < S; ++j) {  // each V row once
    if (mask && !mask[j]) continue;
    const T* __restrict vrow = vbase + (rows ? rows[j] : j) * a.vs;
    for (int64_t g = 0; g < NG; ++g) {
      const float w = scores[g * S + j];
      float* __restrict o = acc + g * D;
      for (int64_t i = 0; i < D; ++i) o[i] = std::fma(w, widen(vrow[i]), o[i]);
    }
  }
  for (int64_t g = 0; g < NG; ++g) {  // a fully masked row (quill's cache never builds one): zeros
    const float total = sum(scores + g * S, S) + (sink_p ? sink_p[g] : 0.0f);
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    const float* __restrict o = acc + g * D;
    for (int64_t i = 0; i < D; ++i) out[g * D + i] = o[i] * inv;
  }
}

template <class T>
inline void typed_head(const AttnArgs& a, const T* k, const T* v, int64_t b, int64_t kvh, float* scratch) {
  if (a.d == 64) return head<64>(a, k, v, b, kvh, scratch);
  if (a.d == 128) return head<128>(a, k, v, b, kvh, scratch);
  if (a.d == 256) return head<256>(a, k, v, b, kvh, scratch);  // Gemma 3 / 4's local heads, Qwen3.5's
  head<0>(a, k, v, b, kvh, scratch);
}

inline void any_head(const AttnArgs& a, int64_t b, int64_t kvh, float* scratch) {
  if (a.k16 && a.f16)
    return typed_head(a, reinterpret_cast<const _Float16*>(a.k16), reinterpret_cast<const _Float16*>(a.v16), b, kvh,
                      scratch);
  if (a.k16) return typed_head(a, a.k16, a.v16, b, kvh, scratch);
  typed_head(a, a.k, a.v, b, kvh, scratch);
}

}  // namespace
}  // namespace quill::attn
