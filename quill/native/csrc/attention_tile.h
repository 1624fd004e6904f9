// The decode-attention template (attention.h), included by attention_{scalar,avx2,avx512}.cpp:
// plain loops over fixed-width lane arrays that each TU's flags let the compiler vectorise.
#pragma once

#include <cstring>

#include "attention.h"

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

template <class T>
inline float dot(const float* a, const T* b, int64_t d) {  // a, b [d]
  float part[L] = {};
  int64_t i = 0;
  for (; i + L <= d; i += L)
    for (int j = 0; j < L; ++j) part[j] += a[i + j] * widen(b[i + j]);
  for (int j = 0; i < d; ++i, ++j) part[j] += a[i] * widen(b[i]);
  return tree(part);
}

// exp(x) for x <= 0: 2^n * p(r), n = round(x / ln 2), r = x - n ln 2 (Cephes' expf polynomial);
// 0 below -87 (where float32 exp underflows to denormals anyway).
inline float exp_neg(float x) {
  const float c = x < -87.0f ? -87.0f : x;
  const float t = c * 1.44269504088896341f + 12582912.0f;  // 1.5 * 2^23: rounds to an integer
  const float n = t - 12582912.0f;
  const float r = (c - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &t, 4);
  const int32_t e = (bits - 0x4B400000 + 127) << 23;  // the integer n sits in t's low mantissa bits
  float two_n;
  std::memcpy(&two_n, &e, 4);
  return x < -87.0f ? 0.0f : p * two_n;
}

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

// DC: the head dimension when known at compile time (64, 128), else 0 (a.d at run time);
// T: the K / V element (float, or uint16_t bfloat16 words).
template <int DC, class T>
void head(const AttnArgs& a, const T* k, const T* v, int64_t b, int64_t kvh, float* __restrict scratch) {
  // Paged: S is this sequence's length, rows come through its slot table (masked padding
  // past the length would add exact zeros to the same lanes: the bits do not change).
  const int64_t G = a.h / a.hkv, S = a.slots ? a.lens[b] : a.s, D = DC ? DC : a.d;
  const int64_t g0 = a.g_begin, NG = (a.g_end < 0 ? G : a.g_end) - g0;  // this call's query heads
  const float* __restrict q = a.q + (b * a.h + kvh * G + g0) * D;  // [NG, D]
  const int64_t* rows = a.slots ? a.slots + b * a.slot_b : nullptr;  // [S] pool rows
  const T* kbase = k + (rows ? 0 : b * a.kb) + kvh * a.kh;     // [S, D], rows ks apart
  const T* vbase = v + (rows ? 0 : b * a.vb) + kvh * a.vh;     // [S, D], rows vs apart
  const uint8_t* mask = a.mask ? a.mask + b * a.mask_b : nullptr;  // [S]
  float* __restrict scores = scratch;        // [NG, S]
  float* __restrict acc = scratch + NG * S;  // [NG, D]
  for (int64_t s = 0; s < S; ++s) {  // each K row once, for all G query heads
    const T* __restrict krow = kbase + (rows ? rows[s] : s) * a.ks;
    const bool on = !mask || mask[s];
    for (int64_t g = 0; g < NG; ++g) scores[g * S + s] = on ? dot(q + g * D, krow, D) * a.scale : kMasked;
  }
  for (int64_t g = 0; g < NG; ++g) {  // p = exp(score - max): 0 at masked positions (kMasked - max < -87)
    float* __restrict sc = scores + g * S;
    const float mx = max(sc, S);
    const bool none = mx == kMasked;  // every position masked
    for (int64_t s = 0; s < S; ++s) sc[s] = none ? 0.0f : exp_neg(sc[s] - mx);
    float* __restrict o = acc + g * D;
    for (int64_t i = 0; i < D; ++i) o[i] = 0.0f;
  }
  for (int64_t s = 0; s < S; ++s) {  // each V row once
    if (mask && !mask[s]) continue;
    const T* __restrict vrow = vbase + (rows ? rows[s] : s) * a.vs;
    for (int64_t g = 0; g < NG; ++g) {
      const float w = scores[g * S + s];
      float* __restrict o = acc + g * D;
      for (int64_t i = 0; i < D; ++i) o[i] += w * widen(vrow[i]);
    }
  }
  for (int64_t g = 0; g < NG; ++g) {  // a fully masked row (quill's cache never builds one): zeros
    const float total = sum(scores + g * S, S);
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    float* __restrict out = a.out + (b * a.h + kvh * G + g0 + g) * D;
    const float* __restrict o = acc + g * D;
    for (int64_t i = 0; i < D; ++i) out[i] = o[i] * inv;
  }
}

template <class T>
inline void typed_head(const AttnArgs& a, const T* k, const T* v, int64_t b, int64_t kvh, float* scratch) {
  if (a.d == 64) return head<64>(a, k, v, b, kvh, scratch);
  if (a.d == 128) return head<128>(a, k, v, b, kvh, scratch);
  head<0>(a, k, v, b, kvh, scratch);
}

inline void any_head(const AttnArgs& a, int64_t b, int64_t kvh, float* scratch) {
  if (a.k16) return typed_head(a, a.k16, a.v16, b, kvh, scratch);
  typed_head(a, a.k, a.v, b, kvh, scratch);
}

}  // namespace
}  // namespace quill::attn
