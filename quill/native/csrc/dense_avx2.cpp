// The dense 16-bit kernel (dense_tile.h) on AVX2 + FMA + F16C: a row block as two ymm
// (rows 0-7 are bytes 0-31 of a block, rows 8-15 bytes 32-63).
#include <immintrin.h>

#include "dense_tile.h"

namespace quill {
namespace {

struct V256x2 {
  __m256 lo, hi;
  static V256x2 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static V256x2 fma(V256x2 w, float x, V256x2 acc) {
    const __m256 b = _mm256_set1_ps(x);
    return {_mm256_fmadd_ps(w.lo, b, acc.lo), _mm256_fmadd_ps(w.hi, b, acc.hi)};
  }
  static V256x2 add(V256x2 a, V256x2 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
  static void store(V256x2 a, float* out) {
    _mm256_store_ps(out, a.lo);
    _mm256_store_ps(out + 8, a.hi);
  }
  // 8 lanes' (even, odd) weights of one 32-byte half
  template <bool F16>
  static void half(const __m256i v, __m256& even, __m256& odd) {
    if (F16) {  // words 0, 2, 4, 6 | 1, 3, 5, 7 of each 128-bit lane, then the lanes' halves together
      const __m256i idx = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                           0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
      const __m256i w = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, idx), 0xD8);
      even = _mm256_cvtph_ps(_mm256_castsi256_si128(w));
      odd = _mm256_cvtph_ps(_mm256_extracti128_si256(w, 1));
    } else {
      even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
    }
  }
  template <bool F16>
  static void pair(const uint16_t* blk, V256x2& even, V256x2& odd) {
    half<F16>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)), even.lo, odd.lo);
    half<F16>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)), even.hi, odd.hi);
  }
};

}  // namespace

DenseGemm dense_gemm_avx2() { return dense::run<V256x2>; }

}  // namespace quill
