// The MXFP4 kernels' 16-lane vector type on AVX-512 F/BW + VNNI: one zmm of 16 rows, for
// mxfp4_avx512.cpp.  A zmm load of a quad (mxfp4.h) is 16 rows x 4 columns: one int32 lane per row.
#pragma once

#include <immintrin.h>

#include "mxfp4_tile.h"
#include "simd512.h"

namespace quill {
namespace {

struct V512 {
  __m512 v;
  using I = __m512i;
  static V512 zero() { return {_mm512_setzero_ps()}; }
  static V512 fma(V512 a, float b, V512 acc) { return {_mm512_fmadd_ps(a.v, _mm512_set1_ps(b), acc.v)}; }
  static V512 fmav(V512 a, V512 b, V512 acc) { return {_mm512_fmadd_ps(a.v, b.v, acc.v)}; }
  static V512 add(V512 a, V512 b) { return {_mm512_add_ps(a.v, b.v)}; }
  static V512 mul(V512 a, float b) { return {_mm512_mul_ps(a.v, _mm512_set1_ps(b))}; }
  static void store(V512 a, float* out) { _mm512_store_ps(out, a.v); }

  using Q = __m512i;  // quad [16 r, 4 b]: one int32 lane per row
  static Q quad(const uint8_t* codes) { return _mm512_loadu_si512(codes); }
  // kv of columns 4 jj + B and 4 jj + B + 16 as float: vpermps reads the low 4 bits of each int32
  // index, so the code byte shifted down to its nibble indexes the table directly.
  template <int B>
  static void column(Q c, V512& lo, V512& hi) {
    const __m512 kv = _mm512_setr_ps(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    lo.v = _mm512_permutexvar_ps(B == 0 ? c : _mm512_srli_epi32(c, 8 * B), kv);
    hi.v = _mm512_permutexvar_ps(_mm512_srli_epi32(c, 8 * B + 4), kv);
  }
  static V512 scale(const uint8_t* e) {  // e8m0_half_bits of 16 exponents
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(e)));
    const __m512i norm = _mm512_slli_epi32(_mm512_sub_epi32(x, _mm512_set1_epi32(1)), 23);
    const __m512i sub = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), x);
    const __mmask16 small = _mm512_cmplt_epu32_mask(x, _mm512_set1_epi32(2));
    return {_mm512_castsi512_ps(_mm512_mask_blend_epi32(small, norm, sub))};
  }
  // One group [256] against T tokens' 32 activations: per quad one vpdpbusd per token and nibble,
  // (kv + 12) as unsigned bytes (one vpshufb of the nibbles) times the 4 activations of the
  // quad's columns; two chains per token (low / high nibbles), started at -12 x qsum and 0.
  template <int T>
  static void group_i8(const uint8_t* group, const int8_t* const* q, const int32_t* qsum, I* d) {
    const __m512i ukv = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    const __m512i m = _mm512_set1_epi8(15);
    __m512i dh[T];
    QUILL_UNROLL for (int t = 0; t < T; ++t) {
      d[t] = _mm512_set1_epi32(-MX_KV_BIAS * qsum[t]);
      dh[t] = _mm512_setzero_si512();
    }
    QUILL_UNROLL for (int jj = 0; jj < 4; ++jj) {
      const __m512i c = _mm512_loadu_si512(group + MX_QUAD_BYTES * jj);
      const __m512i lo = _mm512_shuffle_epi8(ukv, _mm512_and_si512(c, m));
      const __m512i hi = _mm512_shuffle_epi8(ukv, _mm512_and_si512(_mm512_srli_epi16(c, 4), m));
      QUILL_UNROLL for (int t = 0; t < T; ++t) {
        d[t] = _mm512_dpbusd_epi32(d[t], lo, v512::bcast4(q[t] + 4 * jj));
        dh[t] = _mm512_dpbusd_epi32(dh[t], hi, v512::bcast4(q[t] + 4 * jj + 16));
      }
    }
    QUILL_UNROLL for (int t = 0; t < T; ++t) d[t] = _mm512_add_epi32(d[t], dh[t]);
  }
  static V512 cvt(I d) { return {_mm512_cvtepi32_ps(d)}; }
};

}  // namespace
}  // namespace quill
