// llama.cpp's K-quant arithmetic on AVX2 (common.h I8Acts::gsuper): two-level weights (GGUF Q2_K-Q6_K) with
// one int8 activation scale per token and super-block.  Included by avx2.cpp only (-mavx2 -mfma -mf16c).
//
// Per chunk and token, vpmaddubsw's int16 pair sums are added in int16 over the chunks that fit (4-bit and
// less: 4 chunks, 5-bit: 2, 6-bit: 1), then widened by vpmaddwd with the segment's integer sub-scale as the
// pair weight, straight into A (common.h): the sub-scale costs nothing per chunk or segment.  The zero point's
// and the mins' terms, sum_s c[s] X[s], take one vpmaddwd per two segments and token (X pairs fit int16;
// super_acts.h), and one float epilogue per super-block ends it: llama.cpp's instruction count per 256
// weights, against one float epilogue per 32 (Q6_K: 16) with an activation scale per segment.
// Integer sums are exact in any order, so the bits are those of the scalar twin (scalar.cpp gemm_i8_super).
#pragma once

#include <immintrin.h>

#include <algorithm>

#include "kblock.h"
#include "simd256.h"

namespace quill {
namespace v256 {

// Tokens per tile: 6 of 16 ymm registers for A and 6 for the int16 sums (M = 128, 8B-shaped Q4_K / Q6_K on Zen 4's
// AVX2 path: 4 and 6 equal within 2 %, 8 spills and is 5-7 % slower).
constexpr int SUPER_TOKENS = 6;
// Up to this many tokens K is walked once for both halves (a second pass over the codes cost one token 20 %).
constexpr int SUPER_ONE_PASS = 2;

// (a, b) as the int16 pair of every int32 lane: the low halves of a and b (values within int16).
QUILL_INLINE __m256i pair16(__m256i a, __m256i b) {
  return _mm256_or_si256(_mm256_and_si256(a, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(b, 16));
}

// acc[m] += sum over segments s0 .. s0 + gps - 1 of c[s] * X[m0 + m, s], lanes 8h..8h+7, c the sub-values `sub`:
// one vpmaddwd per two segments and token, the weight pair built once per row block half.
template <int MT>
QUILL_INLINE void pair_terms(const void* sub, const Weights& w, const I8Acts& a, int nb, int s0, int h, int m0,
                             __m256i* acc) {
  for (int s = s0; s < s0 + w.gps; s += 2) {
    const bool two = s + 1 < s0 + w.gps;
    const __m256i c = pair16(sub8(sub, w, nb, s, h), two ? sub8(sub, w, nb, s + 1, h) : _mm256_setzero_si256());
    QUILL_UNROLL for (int m = 0; m < MT; ++m) {
      const int32_t* x = a.qsum + int64_t(m0 + m) * w.nseg + s;
      acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(c, _mm256_set1_epi32(int16_pair(x[0], two ? x[1] : 0))));
    }
  }
}

// The end of super-block u for MT tokens and half h: A -= z sum_s sc[s] X[s]; f += (super_scale g) A, then
// f += (super_offset g) B, B = sum_s mn[s] X[s] (common.h I8Acts::gsuper).  acc holds A (and is spent).
template <int MT>
QUILL_INLINE void super_end(const Weights& w, const I8Acts& a, int nb, int u, int h, int m0, int32_t z, __m256i* acc,
                            float (*f)[LANES]) {
  const int nsup = w.nseg / w.gps;
  const int64_t si = super_index(w, nb, u * w.gps, 8 * h);
  if (z != 0) {
    __m256i e[MT];
    QUILL_UNROLL for (int m = 0; m < MT; ++m) e[m] = _mm256_setzero_si256();
    pair_terms<MT>(w.scales, w, a, nb, u * w.gps, h, m0, e);
    QUILL_UNROLL for (int m = 0; m < MT; ++m)
      acc[m] = _mm256_sub_epi32(acc[m], _mm256_mullo_epi32(e[m], _mm256_set1_epi32(z)));
  }
  const __m256 ss = load8(w.super_scales, w.scale_dtype, si);
  QUILL_UNROLL for (int m = 0; m < MT; ++m) {
    const __m256 g = _mm256_set1_ps(a.gscale[int64_t(m0 + m) * nsup + u]);
    _mm256_store_ps(f[m] + 8 * h, _mm256_fmadd_ps(_mm256_mul_ps(ss, g), _mm256_cvtepi32_ps(acc[m]),
                                                  _mm256_load_ps(f[m] + 8 * h)));
  }
  if (!w.offsets) return;
  QUILL_UNROLL for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_si256();
  pair_terms<MT>(w.offsets, w, a, nb, u * w.gps, h, m0, acc);
  const __m256 so = load8(w.super_offsets, w.scale_dtype, si);
  QUILL_UNROLL for (int m = 0; m < MT; ++m) {
    const __m256 g = _mm256_set1_ps(a.gscale[int64_t(m0 + m) * nsup + u]);
    _mm256_store_ps(f[m] + 8 * h, _mm256_fmadd_ps(_mm256_mul_ps(so, g), _mm256_cvtepi32_ps(acc[m]),
                                                  _mm256_load_ps(f[m] + 8 * h)));
  }
}

// MT tokens x halves [H0, H0 + NH) of row block nb (lanes 8h..8h+7 each), all of K, into f[m][8h..8h+7].
// NH = 2 walks K once for both halves (few tokens: their sums fit the registers); NH = 1 one half a pass.
template <int BITS, int MT, int H0, int NH>
QUILL_INLINE void super_halves(const Weights& w, const I8Acts& a, int nb, int m0, float (*f)[LANES]) {
  constexpr int CK = chunk_k(BITS);
  constexpr int SUM16 = BITS <= 4 ? 4 : (BITS == 5 ? 2 : 1);  // chunks whose pair sums int16 holds (|x| <= 128)
  const __m256i low = _mm256_set1_epi8(0x0F);
  const uint8_t* blocks = w.codes + int64_t(nb) * w.kc * BLOCK_BYTES;  // [KC, 64]
  const int nsup = w.nseg / w.gps;
  const int32_t z = int32_t(w.zconst);
  for (int u = 0, c = 0; u < nsup; ++u) {
    __m256i acc[NH][MT];  // A (common.h I8Acts::gsuper)
    QUILL_UNROLL for (int h = 0; h < NH; ++h)
      QUILL_UNROLL for (int m = 0; m < MT; ++m) acc[h][m] = _mm256_setzero_si256();
    for (int s = u * w.gps; s < (u + 1) * w.gps; ++s) {
      __m256i sc[NH], q16[NH][MT];
      QUILL_UNROLL for (int h = 0; h < NH; ++h) {
        const __m256i v = sub8(w.scales, w, nb, s, H0 + h);
        sc[h] = pair16(v, v);
        QUILL_UNROLL for (int m = 0; m < MT; ++m) q16[h][m] = _mm256_setzero_si256();
      }
      for (int n16 = 0, c1 = w.seg_end[s]; c < c1; ++c) {
        const uint8_t* blk = blocks + int64_t(c) * BLOCK_BYTES;
        _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH_BYTES), _MM_HINT_T1);  // see common.h
        QUILL_UNROLL for (int h = 0; h < NH; ++h) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * (H0 + h)));
          if constexpr (BITS <= 3) {  // four 2-bit vectors, positions 16c + 4j .. +3
            __m256i q[4];
            unpack_low<BITS>(v, BITS == 3 ? w.hplane + (int64_t(nb) * w.kc + c) * plane_bytes(3) : nullptr, H0 + h, q);
            QUILL_UNROLL for (int m = 0; m < MT; ++m) {
              const int8_t* x = a.q + (m0 + m) * a.ld + int64_t(c) * CK;
              const __m256i s01 = _mm256_add_epi16(_mm256_maddubs_epi16(q[0], bcast4(x)), _mm256_maddubs_epi16(q[1], bcast4(x + 4)));
              const __m256i s23 = _mm256_add_epi16(_mm256_maddubs_epi16(q[2], bcast4(x + 8)), _mm256_maddubs_epi16(q[3], bcast4(x + 12)));
              q16[h][m] = _mm256_add_epi16(q16[h][m], _mm256_add_epi16(s01, s23));
            }
          } else {  // positions 8c..8c+3 in lo, 8c+4..8c+7 in hi
            __m256i lo = _mm256_and_si256(v, low);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            if constexpr (BITS == 5 || BITS == 6)
              add_high_bits<BITS>(w.hplane + (int64_t(nb) * w.kc + c) * plane_bytes(BITS), H0 + h, lo, hi);
            QUILL_UNROLL for (int m = 0; m < MT; ++m) {
              const int8_t* x = a.q + (m0 + m) * a.ld + int64_t(c) * CK;
              q16[h][m] = _mm256_add_epi16(q16[h][m], _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(x)),
                                                                       _mm256_maddubs_epi16(hi, bcast4(x + 4))));
            }
          }
        }
        if (++n16 == SUM16 || c + 1 == c1) {  // widen with the sub-scale as the pair weight
          QUILL_UNROLL for (int h = 0; h < NH; ++h)
            QUILL_UNROLL for (int m = 0; m < MT; ++m) {
              acc[h][m] = _mm256_add_epi32(acc[h][m], _mm256_madd_epi16(q16[h][m], sc[h]));
              q16[h][m] = _mm256_setzero_si256();
            }
          n16 = 0;
        }
      }
    }
    QUILL_UNROLL for (int h = 0; h < NH; ++h) super_end<MT>(w, a, nb, u, H0 + h, m0, z, acc[h], f);
  }
}

// Row blocks [nb0, nb1) x all tokens, tiles of up to SUPER_TOKENS tokens; more than SUPER_ONE_PASS one half a pass
// (the second reads the row block's codes from L1 / L2).
template <int BITS>
void run_super(const Weights& w, const I8Acts& a, const Out& o, int nb0, int nb1) {
  constexpr int MTW = SUPER_TOKENS;
  for (int nb = nb0; nb < nb1; ++nb)
    for (int m0 = 0; m0 < a.m;) {
      alignas(32) float f[MTW][LANES] = {};
      const int mt = std::min(MTW, a.m - m0);
      by_tokens<MTW>(mt, [&](auto tokens) {
        constexpr int MT = decltype(tokens)::value;
        if constexpr (MT <= SUPER_ONE_PASS) {
          super_halves<BITS, MT, 0, 2>(w, a, nb, m0, f);
        } else {
          super_halves<BITS, MT, 0, 1>(w, a, nb, m0, f);
          super_halves<BITS, MT, 1, 1>(w, a, nb, m0, f);
        }
      });
      for (int m = 0; m < mt; ++m) store_int_row(w, a, o, nb, m0 + m, f[m]);
      m0 += mt;
    }
}

}  // namespace v256
}  // namespace quill
