// The AVX2 prefill tile of 4-bit codes x int8 activations for segments of at most 4 chunks, written out
// (avx2.cpp's generic tile_halves computes the same sums; docs/NATIVE.md, "AVX2 8-token tile").  Include
// only from avx2.cpp (compiled with -mavx2 -mfma -mf16c).
#pragma once

#include <immintrin.h>

#include "scalar_util.h"
#include "simd256.h"

namespace quill {
namespace v256 {

// One chunk of the prefill tile below for 8 tokens: q16[m] += maddubs(lo, x_m[off .. off + 3]) +
// maddubs(hi, x_m[off + 4 .. off + 7]).  Written in assembly because gcc, given the same intrinsics, kept
// fewer sums in registers and recomputed token addresses: 6 % slower in a stand-alone harness (Zen 5).
// Registers: the 8 int16 sums, the two code vectors and two scratch ones; token m's bytes are x_m + off.
#define QUILL_I4_TOKEN(X, Q)                      \
  "vpbroadcastd (%[" #X "],%[off]), %%ymm13\n\t"  \
  "vpbroadcastd 4(%[" #X "],%[off]), %%ymm14\n\t" \
  "vpmaddubsw %%ymm13, %[lo], %%ymm13\n\t"        \
  "vpmaddubsw %%ymm14, %[hi], %%ymm14\n\t"        \
  "vpaddw %%ymm13, %%ymm14, %%ymm13\n\t"          \
  "vpaddw %%ymm13, %[" #Q "], %[" #Q "]\n\t"

QUILL_INLINE void chunk8_i4(__m256i lo, __m256i hi, const int8_t* const* x, int64_t off, __m256i* q16) {
  asm(QUILL_I4_TOKEN(x0, q0) QUILL_I4_TOKEN(x1, q1) QUILL_I4_TOKEN(x2, q2) QUILL_I4_TOKEN(x3, q3)
      QUILL_I4_TOKEN(x4, q4) QUILL_I4_TOKEN(x5, q5) QUILL_I4_TOKEN(x6, q6) QUILL_I4_TOKEN(x7, q7)
      : [q0] "+x"(q16[0]), [q1] "+x"(q16[1]), [q2] "+x"(q16[2]), [q3] "+x"(q16[3]), [q4] "+x"(q16[4]),
        [q5] "+x"(q16[5]), [q6] "+x"(q16[6]), [q7] "+x"(q16[7])
      : [off] "r"(off), [lo] "x"(lo), [hi] "x"(hi), [x0] "r"(x[0]), [x1] "r"(x[1]), [x2] "r"(x[2]), [x3] "r"(x[3]),
        [x4] "r"(x[4]), [x5] "r"(x[5]), [x6] "r"(x[6]), [x7] "r"(x[7])
      : "xmm13", "xmm14", "memory");
}
#undef QUILL_I4_TOKEN

// The prefill tile of 4-bit codes x int8 activations for segments of at most 4 chunks (groups of <= 32:
// GGUF Q4_0 / Q4_1, GPTQ / compressed-tensors g32): 8 tokens x half h of row block nb, all of K, with
// per-token scales and the zero point folded (GROUP false: tile_halves<4, 1, 1, 8, h, 1>'s epilogue) or
// one scale per token and segment (GROUP: epilogue_g, any zero point and offsets; with gz of stride 3 its token
// side read precomputed, epilogue_gzo); the sums and epilogue of the template in the same order (the same bits).
// Written out because the generic template's codegen
// spilled sums and recomputed the 8 token addresses in the chunk loop: in a stand-alone harness (Zen 5,
// 1024 x 2048 at 128 tokens) 2.43 -> 2.08 cycles per token, chunk and half folded, 2.60 -> 2.44 with
// per-group scales.  A segment's int16 sums (<= 4 chunks: |sum| <= 4 * 2 * 2 * 15 * 128) widen straight
// into its epilogue.  (Longer segments and the per-token zero-point epilogue written the same way ran
// 5-20 % slower than the template, gcc again: they keep it.)
template <bool GROUP>
QUILL_INLINE void tile8_i4(const Weights& w, const I8Acts& a, int nb, int m0, int h, float (*f)[LANES],
                           GroupSide gz = {}) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const uint8_t* codes = w.codes + int64_t(nb) * w.kc * BLOCK_BYTES + 32 * h;  // [KC, 64], half h
  const int8_t* x[8];                                                          // [Kp] each
  QUILL_UNROLL for (int m = 0; m < 8; ++m) x[m] = a.q + int64_t(m0 + m) * a.ld;
  const int32_t* qsum = a.qsum + int64_t(m0) * w.nseg;  // [8, S]
  const float* gscale = GROUP ? a.gscale + int64_t(m0) * w.nseg : nullptr;  // [8, S]
  const int32_t z = int32_t(w.zconst);
  Supers8 sup;
  __m256 fr[8];
  QUILL_UNROLL for (int m = 0; m < 8; ++m) fr[m] = _mm256_setzero_ps();
  for (int s = 0, c = 0; s < w.nseg; ++s) {
    __m256i q16[8];
    QUILL_UNROLL for (int m = 0; m < 8; ++m) q16[m] = _mm256_setzero_si256();
    for (const int c1 = w.seg_end[s]; c < c1; ++c) {
      const uint8_t* blk = codes + int64_t(c) * BLOCK_BYTES;
      _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH_BYTES), _MM_HINT_T1);  // see common.h
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk));
      chunk8_i4(_mm256_and_si256(v, low), _mm256_and_si256(_mm256_srli_epi16(v, 4), low), x, int64_t(c) * 8, q16);
    }
    const Seg8 sc = seg8(w, nb, s, h, sup);
    const float* tri = gz.stride == 3 ? gz.p + (int64_t(s) * a.m + m0) * 3 : nullptr;  // [8, 3] (g, z xg, xg)
    QUILL_UNROLL for (int m = 0; m < 8; ++m) {
      const __m256i d = _mm256_madd_epi16(q16[m], ones);
      const int32_t xsum = qsum[m * w.nseg + s];
      if constexpr (GROUP) {
        fr[m] = tri ? epilogue_gzo(sc, _mm256_cvtepi32_ps(d), tri + 3 * m, fr[m])
                    : epilogue_g(sc, _mm256_cvtepi32_ps(d), float(xsum), gscale[m * w.nseg + s], fr[m]);
      } else {  // D - z X, exact in float (Weights::fold_zero): epilogue()'s t
        const __m256i t = _mm256_sub_epi32(d, _mm256_set1_epi32(z * xsum));
        fr[m] = _mm256_fmadd_ps(sc.scale, _mm256_cvtepi32_ps(t), fr[m]);
      }
    }
  }
  QUILL_UNROLL for (int m = 0; m < 8; ++m) _mm256_store_ps(f[m] + 8 * h, fr[m]);
}

// tile8_i4<true> for layers with one zero point z, no offsets and one level of scales of dtype SD (GGUF Q4_0,
// symmetric GPTQ / compressed-tensors g32: one_zero_point), the token side of the epilogue precomputed:
// gz [S, M, 2] holds (g, z * xg) per segment and token (group_terms), so per token and segment the epilogue is
// vpmaddwd, convert, two broadcasts from memory, fmsub and fmadd (epilogue_g adds a scalar convert and
// multiply, register broadcasts, a multiply for z xg, index math and the offset test: 19 instructions against
// 6).  t = d * g - z xg, f += scale * t: seg_epilogue_g's operations on the same values, the same bits.
// Scale dtype and zero point are compile-time here, and a segment's scales and pairs are one pointer step.
template <DType SD>
QUILL_INLINE void tile8_g(const Weights& w, const I8Acts& a, const float* gz, int nb, int m0, int h,
                          float (*f)[LANES]) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const uint8_t* codes = w.codes + int64_t(nb) * w.kc * BLOCK_BYTES + 32 * h;  // [KC, 64], half h
  const int8_t* x[8];                                                          // [Kp] each
  QUILL_UNROLL for (int m = 0; m < 8; ++m) x[m] = a.q + int64_t(m0 + m) * a.ld;
  const float* pair = gz + 2 * int64_t(m0);  // segment s: pair[2m] = g, pair[2m + 1] = z xg of token m0 + m
  const int64_t pair_step = 2 * int64_t(a.m);
  const size_t esize = SD == DType::F32 ? 4 : 2;
  const char* scale = static_cast<const char*>(w.scales) + (int64_t(nb) * w.nseg * LANES + 8 * h) * esize;  // [S, 16]
  __m256 fr[8];
  QUILL_UNROLL for (int m = 0; m < 8; ++m) fr[m] = _mm256_setzero_ps();
  for (int s = 0, c = 0; s < w.nseg; ++s, pair += pair_step, scale += LANES * esize) {
    __m256i q16[8];
    QUILL_UNROLL for (int m = 0; m < 8; ++m) q16[m] = _mm256_setzero_si256();
    for (const int c1 = w.seg_end[s]; c < c1; ++c) {
      const uint8_t* blk = codes + int64_t(c) * BLOCK_BYTES;
      _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH_BYTES), _MM_HINT_T1);  // see common.h
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk));
      chunk8_i4(_mm256_and_si256(v, low), _mm256_and_si256(_mm256_srli_epi16(v, 4), low), x, int64_t(c) * 8, q16);
    }
    const __m256 sc = load8(scale, SD, 0);
    QUILL_UNROLL for (int m = 0; m < 8; ++m)
      fr[m] = epilogue_gz(sc, _mm256_cvtepi32_ps(_mm256_madd_epi16(q16[m], ones)), pair + 2 * m, fr[m]);
  }
  QUILL_UNROLL for (int m = 0; m < 8; ++m) _mm256_store_ps(f[m] + 8 * h, fr[m]);
}

// Both halves of tile8_g, its scale dtype chosen once per tile.
QUILL_INLINE void tile8_g_halves(const Weights& w, const I8Acts& a, const float* gz, int nb, int m0, float (*f)[LANES]) {
  switch (w.scale_dtype) {
    case DType::F16:
      tile8_g<DType::F16>(w, a, gz, nb, m0, 0, f);
      return tile8_g<DType::F16>(w, a, gz, nb, m0, 1, f);
    case DType::BF16:
      tile8_g<DType::BF16>(w, a, gz, nb, m0, 0, f);
      return tile8_g<DType::BF16>(w, a, gz, nb, m0, 1, f);
    case DType::F32:
    default:
      tile8_g<DType::F32>(w, a, gz, nb, m0, 0, f);
      return tile8_g<DType::F32>(w, a, gz, nb, m0, 1, f);
  }
}

}  // namespace v256
}  // namespace quill
