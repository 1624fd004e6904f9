// The MXFP4 kernels' 16-lane vector type on AVX2 + FMA (two ymm: lanes 0-7 and 8-15), for
// mxfp4_avx2.cpp.  A ymm load of a quad (mxfp4.h) is 8 rows x 4 columns: one int32 lane per row.
#pragma once

#include <immintrin.h>

#include "mxfp4_tile.h"
#include "simd256.h"

namespace quill {
namespace {

struct V256x2 {
  __m256 lo, hi;
  struct I {
    __m256i lo, hi;  // rows 0-7 / 8-15
  };
  // kvalues_mxfp4 biased by 12, as unsigned bytes
  static __m256i ukv() { return _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                                 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0); }
  // 32 code bytes -> the table's bytes of their low / high nibbles (byte for byte)
  static void nibbles(const uint8_t* b, __m256i table, __m256i& lo, __m256i& hi) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
    const __m256i m = _mm256_set1_epi8(15);
    lo = _mm256_shuffle_epi8(table, _mm256_and_si256(v, m));
    hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), m));
  }
  static V256x2 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static V256x2 fma(V256x2 a, float b, V256x2 acc) {
    const __m256 x = _mm256_set1_ps(b);
    return {_mm256_fmadd_ps(a.lo, x, acc.lo), _mm256_fmadd_ps(a.hi, x, acc.hi)};
  }
  static V256x2 fmav(V256x2 a, V256x2 b, V256x2 acc) {
    return {_mm256_fmadd_ps(a.lo, b.lo, acc.lo), _mm256_fmadd_ps(a.hi, b.hi, acc.hi)};
  }
  static V256x2 add(V256x2 a, V256x2 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
  static V256x2 mul(V256x2 a, float b) {
    const __m256 x = _mm256_set1_ps(b);
    return {_mm256_mul_ps(a.lo, x), _mm256_mul_ps(a.hi, x)};
  }
  static void store(V256x2 a, float* out) {
    _mm256_store_ps(out, a.lo);
    _mm256_store_ps(out + 8, a.hi);
  }
  struct Q {
    __m256i lo0, hi0, lo1, hi1;  // kv + 12 as bytes of the low / high nibbles, rows 0-7 / 8-15
  };
  static Q quad(const uint8_t* codes) {  // [16 r, 4 b]
    Q q;
    nibbles(codes, ukv(), q.lo0, q.hi0);
    nibbles(codes + 32, ukv(), q.lo1, q.hi1);
    return q;
  }
  // Byte B of each int32 lane (kv + 12, in [0, 24]) as float kv, exactly: vpshufb moves it to the
  // lane's low byte (zeros above), OR-ing 2^23's exponent makes the float 2^23 + kv + 12, and one
  // subtraction leaves kv (+0 for kv = 0, as the scalar twin's float(0)).  Shuffle, OR and subtract
  // leave the shift / convert ports to the FMAs (two shifts and a convert measured the same here: the
  // float path is bound by its FMA chains, 16 deep per group, whose order fixes the bits).
  template <int B>
  static __m256 byte_to_float(__m256i v) {
    const __m256i to_low = _mm256_setr_epi8(B, -1, -1, -1, 4 + B, -1, -1, -1, 8 + B, -1, -1, -1, 12 + B, -1, -1, -1,
                                            B, -1, -1, -1, 4 + B, -1, -1, -1, 8 + B, -1, -1, -1, 12 + B, -1, -1, -1);
    const __m256i magic = _mm256_set1_epi32(0x4B000000);  // 2^23
    const __m256 off = _mm256_set1_ps(8388608.0f + MX_KV_BIAS);
    return _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(_mm256_shuffle_epi8(v, to_low), magic)), off);
  }
  template <int B>  // kv of columns 4 jj + B and 4 jj + B + 16, as float
  static void column(const Q& q, V256x2& lo, V256x2& hi) {
    lo = {byte_to_float<B>(q.lo0), byte_to_float<B>(q.lo1)};
    hi = {byte_to_float<B>(q.hi0), byte_to_float<B>(q.hi1)};
  }
  static __m256 scale8(__m128i e8) {  // e8m0_half_bits of 8 exponents
    const __m256i e = _mm256_cvtepu8_epi32(e8);
    const __m256i norm = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(norm, sub, small));
  }
  static V256x2 scale(const uint8_t* e) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(e));
    return {scale8(v), scale8(_mm_srli_si128(v, 8))};
  }
  // Rows 8 h .. 8 h + 7 of one group [256] against T tokens' 32 activations: per quad pair, the
  // vpmaddubsw sums of (kv + 12) x (16 products per int32 lane, each |p| <= 24 x 128, so the int16
  // pairs hold 8: <= 24576) widen by one vpmaddwd; the sums start at -12 x qsum (kv's bias).
  template <int T>
  static void half_i8(const uint8_t* group, int h, const int8_t* const* q, const int32_t* qsum, __m256i* d) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t* x8[T];
    QUILL_UNROLL for (int t = 0; t < T; ++t) {
      d[t] = _mm256_set1_epi32(-MX_KV_BIAS * qsum[t]);
      x8[t] = q[t];
      // Opaque to gcc: else it keeps the broadcasts of the first half for the second and, out of
      // ymm registers for T > 2, spills them (measured: T = 4 ran ~2x slower).
      __asm__ volatile("" : "+r"(x8[t]));
    }
    QUILL_UNROLL for (int p = 0; p < 2; ++p) {  // quads 2p, 2p + 1: columns 8p .. 8p + 7 and + 16
      __m256i l0, h0, l1, h1;
      nibbles(group + MX_QUAD_BYTES * (2 * p) + 32 * h, ukv(), l0, h0);
      nibbles(group + MX_QUAD_BYTES * (2 * p + 1) + 32 * h, ukv(), l1, h1);
      QUILL_UNROLL for (int t = 0; t < T; ++t) {
        const int8_t* x = x8[t] + 8 * p;
        __m256i s = _mm256_maddubs_epi16(l0, v256::bcast4(x));
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(h0, v256::bcast4(x + 16)));
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(l1, v256::bcast4(x + 4)));
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(h1, v256::bcast4(x + 20)));
        d[t] = _mm256_add_epi32(d[t], _mm256_madd_epi16(s, ones));
      }
    }
  }
  template <int T>
  static void group_i8(const uint8_t* group, const int8_t* const* q, const int32_t* qsum, I* d) {
    __m256i r[T];
    half_i8<T>(group, 0, q, qsum, r);
    QUILL_UNROLL for (int t = 0; t < T; ++t) d[t].lo = r[t];
    half_i8<T>(group, 1, q, qsum, r);
    QUILL_UNROLL for (int t = 0; t < T; ++t) d[t].hi = r[t];
  }
  static V256x2 cvt(I d) { return {_mm256_cvtepi32_ps(d.lo), _mm256_cvtepi32_ps(d.hi)}; }
};

}  // namespace
}  // namespace quill
