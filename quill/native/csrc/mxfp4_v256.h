// The MXFP4 kernels' 16-lane vector type on AVX2 + FMA (two ymm: lanes 0-7 and 8-15), shared by
// mxfp4_avx2.cpp and mxfp4_avx512.cpp (the AVX-512 variant runs this code: it has not been run
// on an AVX-512 CPU, so it adds no untested instructions).
#pragma once

#include <immintrin.h>

#include "mxfp4_tile.h"

namespace quill {
namespace {

struct V256x2 {
  __m256 lo, hi;
  struct W {
    __m256i lo, hi;  // int16 pairs (kv of the low nibble, kv of the high nibble), rows 0-7 / 8-15
  };
  struct I {
    __m256i lo, hi;
  };
  static __m128i kv() { return _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12); }
  static void nibbles(const uint8_t* b, __m128i& lo, __m128i& hi) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
    const __m128i m = _mm_set1_epi8(15);
    lo = _mm_shuffle_epi8(kv(), _mm_and_si128(v, m));
    hi = _mm_shuffle_epi8(kv(), _mm_and_si128(_mm_srli_epi16(v, 4), m));
  }
  static V256x2 widen(__m128i v) {  // 16 int8 -> 16 float
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)))};
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
  static void decode(const uint8_t* b, V256x2& lo, V256x2& hi) {
    __m128i l, h;
    nibbles(b, l, h);
    lo = widen(l);
    hi = widen(h);
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
  static W wdecode(const uint8_t* b) {
    __m128i l, h;
    nibbles(b, l, h);
    return {_mm256_cvtepi8_epi16(_mm_unpacklo_epi8(l, h)), _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(l, h))};
  }
  static I izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
  static I idot(const W& w, int8_t a, int8_t b, I acc) {
    const __m256i x = _mm256_set1_epi32(int32_t(uint16_t(int16_t(a))) | (int32_t(b) << 16));
    return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(w.lo, x)), _mm256_add_epi32(acc.hi, _mm256_madd_epi16(w.hi, x))};
  }
  static V256x2 cvt(I d) { return {_mm256_cvtepi32_ps(d.lo), _mm256_cvtepi32_ps(d.hi)}; }
};

}  // namespace
}  // namespace quill
