// The dense 16-bit kernel (dense_tile.h) on AVX-512F: one zmm per row block.
// Compiled with -mavx512f -mavx512bw -mavx512vl; called only when the CPU has them.
#include <immintrin.h>

#include "dense_tile.h"

namespace quill {
namespace {

struct V512 {
  __m512 v;
  static V512 zero() { return {_mm512_setzero_ps()}; }
  static V512 fma(V512 w, float x, V512 acc) { return {_mm512_fmadd_ps(w.v, _mm512_set1_ps(x), acc.v)}; }
  static V512 add(V512 a, V512 b) { return {_mm512_add_ps(a.v, b.v)}; }
  static void store(V512 a, float* out) { _mm512_store_ps(out, a.v); }
  template <bool F16>
  static void pair(const uint16_t* blk, V512& even, V512& odd) {
    const __m512i v = _mm512_loadu_si512(blk);
    if (F16) {
      even.v = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v));
      odd.v = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)));
    } else {  // bf16 bits are the top half of a float32
      even.v = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      odd.v = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
    }
  }
};

}  // namespace

DenseGemm dense_gemm_avx512() { return dense::run<V512>; }

}  // namespace quill
