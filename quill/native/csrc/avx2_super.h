// llama.cpp's K-quant arithmetic on AVX2 (common.h I8Acts::gsuper): two-level weights (GGUF Q2_K-Q6_K) with
// one int8 activation scale per token and super-block.  Included by avx2.cpp only (-mavx2 -mfma -mf16c).
//
// Per chunk and token, vpmaddubsw's int16 pair sums are added in int16 over the chunks that fit (4-bit and
// less: 4 chunks, 5-bit: 2, 6-bit: 1), then widened by vpmaddwd with the segment's integer sub-scale as the
// pair weight, straight into A (common.h): the sub-scale costs nothing per chunk or segment.  The zero point's
// and the mins' terms, sum_s c[s] X[s], take one vpmaddwd per two segments and token (X pairs fit int16;
// super_acts.h), and one float epilogue per super-block ends it: llama.cpp's instruction count per 256
// weights, against one float epilogue per 32 (Q6_K: 16) with an activation scale per segment.
// More than two tokens run super-block by super-block over groups of tokens: a super-block's codes stay in L1
// for every token tile of the group, its sub-values are decoded once (super_consts), the X pairs once a call.
// Integer sums are exact in any order, so the bits are those of the scalar twin (scalar.cpp gemm_i8_super).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "kblock.h"
#include "simd256.h"

namespace quill {
namespace v256 {

// Tokens per tile, and up to how many a tile walks both halves at once (each activation broadcast then feeds two
// vpmaddubsw).  4-bit codes: 4 tokens, both halves (8 int16 sums, 4 code vectors; Q4_K at M = 128 on Zen 4's AVX2
// path 175 GFLOP/s against 166 one half a pass with 6).  5- and 6-bit codes (their high bits cost registers): 6
// tokens one half a pass (Q6_K 116 against 108 with 4 both halves); 2-3 bit codes (four code vectors a half) too.
constexpr int super_tokens(int bits) { return bits == 4 ? 4 : 6; }
constexpr int super_one_pass(int bits) { return bits == 4 ? 4 : 2; }
// Calls of up to this many tokens walk K once a tile and decode the sub-scales in passing (building them first
// cost a one-token call 10-20 %: nothing shares them).
constexpr int SUPER_LAZY = 2;

// (a, b) as the int16 pair of every int32 lane: the low halves of a and b (values within int16).
QUILL_INLINE __m256i pair16(__m256i a, __m256i b) {
  return _mm256_or_si256(_mm256_and_si256(a, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(b, 16));
}

// One super-block u of one row block, both halves: the constants every token tile of it uses, built once
// (sub8 of a 6-bit sub-scale is ~12 instructions a segment and half; per tile they were 11 % of Q4_K's time).
struct SuperConsts {
  const __m256i* sc = nullptr;  // [gps][2] pair16(sub, sub) of segment s and half h: the pair weight widening its sums
  const __m256i* zc = nullptr;  // [np][2] pair16(sub[s0 + 2j], sub[s0 + 2j + 1]) (z != 0), np = (gps + 1) / 2
  const __m256i* oc = nullptr;  // [np][2] the same of the sub-offsets (offsets only)
};

inline int super_pairs(const Weights& w) { return (w.gps + 1) / 2; }

// Segment s's integer sub-values (sub_value) of all 16 lanes: lanes 0..7 in v[0], 8..15 in v[1].  One 16-byte
// row load per field for both halves (sub8's loads are 8 bytes a half).
QUILL_INLINE void sub16(const void* sub, const Weights& w, int nb, int s, __m256i* v) {
  __m128i b;
  if (w.sub_bits == 8) {
    b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(sub) + seg_index(w, nb, s, 0)));
    v[0] = _mm256_cvtepi8_epi32(b);
    v[1] = _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8));
    return;
  }
  const uint8_t* p = static_cast<const uint8_t*>(sub) + int64_t(nb) * sub_rows(w.sub_bits, w.nseg) * LANES;
  const auto row = [p](int i) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i * LANES)); };
  const __m128i nib = _mm_set1_epi8(15);
  if (w.sub_bits == 4) {
    b = _mm_and_si128(_mm_srli_epi16(row(s / 2), 4 * (s & 1)), nib);
  } else {
    const int g = s / 4, j = s & 3;
    b = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(row(3 * g + j / 2), 4 * (j & 1)), nib),
                     _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(row(3 * g + 2), 2 * j), _mm_set1_epi8(3)), 4));
  }
  const __m256i bias = _mm256_set1_epi32(w.sub_bias);
  v[0] = _mm256_sub_epi32(_mm256_cvtepu8_epi32(b), bias);
  v[1] = _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)), bias);
}

// Fills buf [2 gps + 4 np] for super-block u of row block nb: every sub-value decoded once.
inline SuperConsts super_consts(const Weights& w, int nb, int u, __m256i* buf, bool zero_point) {
  const int gps = w.gps, np = super_pairs(w), s0 = u * gps;
  const SuperConsts k{buf, buf + 2 * gps, buf + 2 * gps + 2 * np};
  __m256i* sc = buf;
  __m256i* zc = buf + 2 * gps;
  __m256i* oc = zc + 2 * np;
  for (int j = 0; j < np; ++j) {
    const int s = s0 + 2 * j;
    const bool two = 2 * j + 1 < gps;
    __m256i a[2], b[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    sub16(w.scales, w, nb, s, a);
    if (two) sub16(w.scales, w, nb, s + 1, b);
    for (int h = 0; h < 2; ++h) {
      sc[2 * (2 * j) + h] = pair16(a[h], a[h]);
      if (two) sc[2 * (2 * j + 1) + h] = pair16(b[h], b[h]);
      if (zero_point) zc[2 * j + h] = pair16(a[h], b[h]);
    }
    if (!w.offsets) continue;
    sub16(w.offsets, w, nb, s, a);
    if (two) sub16(w.offsets, w, nb, s + 1, b);
    for (int h = 0; h < 2; ++h) oc[2 * j + h] = pair16(a[h], b[h]);
  }
  return k;
}

// xp [M, nsup, np]: every token's segment sums X of each super-block as int16 pairs (X[s0 + 2j], X[s0 + 2j + 1]),
// the second 0 past the super-block's end (super_acts.h checks X fits int16).  Built once per call: every row block
// multiplies them.
inline void super_x_pairs(const Weights& w, const I8Acts& a, int32_t* xp) {
  const int nsup = w.nseg / w.gps, np = super_pairs(w);
  for (int m = 0; m < a.m; ++m)
    for (int u = 0; u < nsup; ++u) {
      const int32_t* x = a.qsum + int64_t(m) * w.nseg + u * w.gps;
      int32_t* p = xp + (int64_t(m) * nsup + u) * np;
      for (int j = 0; j < np; ++j) p[j] = int16_pair(x[2 * j], 2 * j + 1 < w.gps ? x[2 * j + 1] : 0);
    }
}

// acc[m] += sum over super-block u's segments s of c[s] * X[m0 + m, s], lanes 8h..8h+7, c the sub-values `sub`
// (w.scales or w.offsets): one vpmaddwd per two segments and token, both made here (one or two tokens, where
// building them first cost a one-token call 10-20 %; more tokens: super_end_built).
template <int MT>
QUILL_INLINE void pair_terms(const void* sub, const Weights& w, const I8Acts& a, int nb, int u, int m0, int h,
                             __m256i* acc) {
  for (int j = 0, np = super_pairs(w); j < np; ++j) {
    const int s = u * w.gps + 2 * j;
    const bool two = 2 * j + 1 < w.gps;
    const __m256i c = pair16(sub8(sub, w, nb, s, h), two ? sub8(sub, w, nb, s + 1, h) : _mm256_setzero_si256());
    QUILL_UNROLL for (int m = 0; m < MT; ++m) {
      const int32_t* q = a.qsum + int64_t(m0 + m) * w.nseg + s;
      acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(c, _mm256_set1_epi32(int16_pair(q[0], two ? q[1] : 0))));
    }
  }
}

// The end of super-block u for MT tokens (from m0) and half h, one or two tokens (the sub-values decoded here):
// A -= z sum_s sc[s] X[s]; f += (super_scale g) A, then f += (super_offset g) B, B = sum_s mn[s] X[s] (common.h
// I8Acts::gsuper).  acc holds A (and is spent).
template <int MT>
QUILL_INLINE void super_end(const Weights& w, const I8Acts& a, int nb, int u, int h, int m0, int32_t z, __m256i* acc,
                            float (*f)[LANES]) {
  const int nsup = w.nseg / w.gps;
  const int64_t si = super_index(w, nb, u * w.gps, 8 * h);
  if (z != 0) {
    __m256i e[MT];
    QUILL_UNROLL for (int m = 0; m < MT; ++m) e[m] = _mm256_setzero_si256();
    pair_terms<MT>(w.scales, w, a, nb, u, m0, h, e);
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
  pair_terms<MT>(w.offsets, w, a, nb, u, m0, h, acc);
  const __m256 so = load8(w.super_offsets, w.scale_dtype, si);
  QUILL_UNROLL for (int m = 0; m < MT; ++m) {
    const __m256 g = _mm256_set1_ps(a.gscale[int64_t(m0 + m) * nsup + u]);
    _mm256_store_ps(f[m] + 8 * h, _mm256_fmadd_ps(_mm256_mul_ps(so, g), _mm256_cvtepi32_ps(acc[m]),
                                                  _mm256_load_ps(f[m] + 8 * h)));
  }
}

// The end of super-block u for MT tokens from m0 and halves [H0, H0 + NH) once its codes are summed (three
// tokens or more): per token, A -= z sum_s sc[s] X[s]; f += (super_scale g) A; f += (super_offset g) B,
// B = sum_s mn[s] X[s] (common.h I8Acts::gsuper), the float steps those of super_end (one or two tokens).  Each
// X pair is broadcast once for both halves (no GGUF type has both a zero point and mins), and f is loaded and
// stored once per token and half (per half and term, the epilogue had been 16 % of Q4_K's tile).
template <int MT, int H0, int NH>
QUILL_INLINE void super_end_built(const Weights& w, const I8Acts& a, const SuperConsts& k, const int32_t* xp, int nb,
                                  int u, int m0, int32_t z, __m256i (*acc)[MT], float (*f)[LANES]) {
  const int nsup = w.nseg / w.gps, np = super_pairs(w);
  const int32_t* x = xp + (int64_t(m0) * nsup + u) * np;  // token m's pairs at x + m nsup np
  // sum_s c[s] X[m, s] of every token and half (c: k.zc or k.oc), one broadcast of X's pair for both halves
  const auto terms = [&](const __m256i* c, __m256i (*e)[MT]) {
    QUILL_UNROLL for (int h = 0; h < NH; ++h)
      QUILL_UNROLL for (int m = 0; m < MT; ++m) e[h][m] = _mm256_setzero_si256();
    for (int j = 0; j < np; ++j)
      QUILL_UNROLL for (int m = 0; m < MT; ++m) {
        const __m256i xj = _mm256_set1_epi32(x[int64_t(m) * nsup * np + j]);
        QUILL_UNROLL for (int h = 0; h < NH; ++h)
          e[h][m] = _mm256_add_epi32(e[h][m], _mm256_madd_epi16(c[2 * j + H0 + h], xj));
      }
  };
  __m256i e[NH][MT];
  if (z != 0) {
    terms(k.zc, e);
    QUILL_UNROLL for (int h = 0; h < NH; ++h)
      QUILL_UNROLL for (int m = 0; m < MT; ++m)
        acc[h][m] = _mm256_sub_epi32(acc[h][m], _mm256_mullo_epi32(e[h][m], _mm256_set1_epi32(z)));
  }
  const bool off = w.offsets != nullptr;
  if (off) terms(k.oc, e);  // B
  QUILL_UNROLL for (int h = 0; h < NH; ++h) {
    const int64_t si = super_index(w, nb, u * w.gps, 8 * (H0 + h));
    const __m256 ss = load8(w.super_scales, w.scale_dtype, si);
    const __m256 so = off ? load8(w.super_offsets, w.scale_dtype, si) : _mm256_setzero_ps();
    QUILL_UNROLL for (int m = 0; m < MT; ++m) {
      const __m256 g = _mm256_set1_ps(a.gscale[int64_t(m0 + m) * nsup + u]);
      float* fh = f[m] + 8 * (H0 + h);
      __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(ss, g), _mm256_cvtepi32_ps(acc[h][m]), _mm256_load_ps(fh));
      if (off) v = _mm256_fmadd_ps(_mm256_mul_ps(so, g), _mm256_cvtepi32_ps(e[h][m]), v);
      _mm256_store_ps(fh, v);
    }
  }
}

// Super-blocks [u0, u1) of row block nb: ntiles tiles of MT tokens from m0 x halves [H0, H0 + NH) (lanes 8h..8h+7
// each), into f[m][8h..]; k holds super-block u0's constants (LAZY: none, decoded here; one tile).  The tiles loop
// here, not in the caller: a call's set-up had been 7 % of Q4_K's tile.
// NH = 2 walks the super-block once for both halves (few tokens: their sums fit the registers); NH = 1 one half a
// pass (the second reads the super-block's 2 KiB of codes from L1).
template <int BITS, int MT, int H0, int NH, bool LAZY>
void super_halves(const Weights& w, const I8Acts& a, const SuperConsts& k, const int32_t* xp, int nb,
                  int u0, int u1, int m0, float (*f)[LANES], int ntiles = 1) {
  constexpr int CK = chunk_k(BITS);
  constexpr int SUM16 = BITS <= 4 ? 4 : (BITS == 5 ? 2 : 1);  // chunks whose pair sums int16 holds (|x| <= 128)
  const __m256i low = _mm256_set1_epi8(0x0F);
  const uint8_t* blocks = w.codes + int64_t(nb) * w.kc * BLOCK_BYTES;  // [KC, 64]
  const int32_t z = int32_t(w.zconst);
  // ntiles is a compile-time 1 for one half a pass (Q6_K's tile ran 5 % slower with a runtime count)
  const int nt = NH == 2 && !LAZY ? ntiles : 1;
  for (int u = u0; u < u1; ++u) {
    for (int t = 0, mt0 = m0; t < nt; ++t, mt0 += MT) {
      int c = u ? w.seg_end[u * w.gps - 1] : 0;
      __m256i acc[NH][MT];  // A (common.h I8Acts::gsuper)
      QUILL_UNROLL for (int h = 0; h < NH; ++h)
        QUILL_UNROLL for (int m = 0; m < MT; ++m) acc[h][m] = _mm256_setzero_si256();
      const int s0 = u * w.gps;
      for (int s = s0; s < s0 + w.gps; ++s) {
        __m256i q16[NH][MT], sc[NH];
        QUILL_UNROLL for (int h = 0; h < NH; ++h) {
          if constexpr (LAZY) {
            const __m256i v = sub8(w.scales, w, nb, s, H0 + h);
            sc[h] = pair16(v, v);
          } else {
            sc[h] = k.sc[2 * (s - s0) + H0 + h];
          }
          QUILL_UNROLL for (int m = 0; m < MT; ++m) q16[h][m] = _mm256_setzero_si256();
        }
        for (int n16 = 0, c1 = w.seg_end[s]; c < c1; ++c) {
          const uint8_t* blk = blocks + int64_t(c) * BLOCK_BYTES;
          _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH_BYTES), _MM_HINT_T1);  // see common.h
          QUILL_UNROLL for (int h = 0; h < NH; ++h) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * (H0 + h)));
            if constexpr (BITS <= 3) {  // four 2-bit vectors, positions 16c + 4j .. +3
              __m256i q[4];
              const uint8_t* hp = BITS == 3 ? w.hplane + (int64_t(nb) * w.kc + c) * plane_bytes(3) : nullptr;
              unpack_low<BITS>(v, hp, H0 + h, q);
              QUILL_UNROLL for (int m = 0; m < MT; ++m) {
                const int8_t* x = a.q + (mt0 + m) * a.ld + int64_t(c) * CK;
                const __m256i s01 = _mm256_add_epi16(_mm256_maddubs_epi16(q[0], bcast4(x)),
                                                     _mm256_maddubs_epi16(q[1], bcast4(x + 4)));
                const __m256i s23 = _mm256_add_epi16(_mm256_maddubs_epi16(q[2], bcast4(x + 8)),
                                                     _mm256_maddubs_epi16(q[3], bcast4(x + 12)));
                q16[h][m] = _mm256_add_epi16(q16[h][m], _mm256_add_epi16(s01, s23));
              }
            } else {  // positions 8c..8c+3 in lo, 8c+4..8c+7 in hi
              __m256i lo = _mm256_and_si256(v, low);
              __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
              if constexpr (BITS == 5 || BITS == 6)
                add_high_bits<BITS>(w.hplane + (int64_t(nb) * w.kc + c) * plane_bytes(BITS), H0 + h, lo, hi);
              QUILL_UNROLL for (int m = 0; m < MT; ++m) {
                const int8_t* x = a.q + (mt0 + m) * a.ld + int64_t(c) * CK;
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
      if constexpr (LAZY) {
        QUILL_UNROLL for (int h = 0; h < NH; ++h) super_end<MT>(w, a, nb, u, H0 + h, mt0, z, acc[h], f + t * MT);
      } else {
        super_end_built<MT, H0, NH>(w, a, k, xp, nb, u, mt0, z, acc, f + t * MT);
      }
    }
  }
}

// Row blocks [nb0, nb1) x all tokens: per row block and group of up to 10 tiles of tokens, super-block by
// super-block (its codes, 2 KiB for Q4_K, stay in L1 while every token tile of the group reads them, and its
// constants are built once), tiles of up to super_tokens(BITS) tokens.
template <int BITS>
void run_super(const Weights& w, const I8Acts& a, const Out& o, int nb0, int nb1) {
  constexpr int MTW = super_tokens(BITS), GROUP = 10 * MTW, ONE_PASS = super_one_pass(BITS);
  const int nsup = w.nseg / w.gps, np = super_pairs(w);
  if (a.m <= SUPER_LAZY) {
    for (int nb = nb0; nb < nb1; ++nb) {
      alignas(32) float f[SUPER_LAZY][LANES] = {};
      by_tokens<SUPER_LAZY>(a.m, [&](auto tokens) {
        super_halves<BITS, decltype(tokens)::value, 0, 2, true>(w, a, SuperConsts{}, nullptr, nb, 0, nsup, 0, f);
      });
      for (int m = 0; m < a.m; ++m) store_int_row8(w, a, o, nb, m, f[m]);
    }
    return;
  }
  thread_local std::vector<int32_t> xp_buf;  // (grows to the largest call once: no allocation after)
  thread_local std::vector<__m256i> k_buf;
  if (xp_buf.size() < size_t(a.m) * nsup * np) xp_buf.resize(size_t(a.m) * nsup * np);
  if (k_buf.size() < size_t(2 * w.gps + 4 * np)) k_buf.resize(size_t(2 * w.gps + 4 * np));
  int32_t* xp = xp_buf.data();  // (a dynamic-TLS lookup each use: once a call)
  super_x_pairs(w, a, xp);
  __m256i* kb = k_buf.data();
  alignas(32) float f[GROUP][LANES];
  for (int nb = nb0; nb < nb1; ++nb)
    for (int g0 = 0; g0 < a.m; g0 += GROUP) {
      const int gm = std::min(GROUP, a.m - g0);
      std::fill(f[0], f[gm], 0.0f);
      for (int u = 0; u < nsup; ++u) {
        const SuperConsts k = super_consts(w, nb, u, kb, int32_t(w.zconst) != 0);
        // the group's full tiles in one call each pass, then the rest (fewer tokens) in one tile
        const int full = gm / MTW, rest = gm - full * MTW;
        const auto tiles = [&](auto tokens, int m0, int n) {
          constexpr int MT = decltype(tokens)::value;
          if constexpr (MT <= ONE_PASS) {
            super_halves<BITS, MT, 0, 2, false>(w, a, k, xp, nb, u, u + 1, m0, f + (m0 - g0), n);
          } else {  // one half a pass, tile by tile
            for (int t = 0; t < n; ++t, m0 += MT) {
              super_halves<BITS, MT, 0, 1, false>(w, a, k, xp, nb, u, u + 1, m0, f + (m0 - g0));
              super_halves<BITS, MT, 1, 1, false>(w, a, k, xp, nb, u, u + 1, m0, f + (m0 - g0));
            }
          }
        };
        if (full) tiles(std::integral_constant<int, MTW>{}, g0, full);
        if (rest) by_tokens<MTW>(rest, [&](auto tokens) { tiles(tokens, g0 + full * MTW, 1); });
      }
      for (int m = 0; m < gm; ++m) store_int_row8(w, a, o, nb, g0 + m, f[m]);
    }
}

}  // namespace v256
}  // namespace quill
