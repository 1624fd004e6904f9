// AVX2 helpers of the linear kernels (avx2.cpp): loads of per-segment constants and the segment
// epilogues, 8 lanes (half a row block) wide.  Each performs per lane exactly the scalar operations of
// scalar_util.h.  Include only from translation units compiled with -mavx2 -mfma -mf16c.
#pragma once

#include <immintrin.h>

#include "scalar_util.h"

namespace quill {
namespace v256 {

// Four int8 values (p[0..3]) into every int32 lane: the activations one vpmaddubsw quad multiplies.
QUILL_INLINE __m256i bcast4(const int8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

QUILL_INLINE __m256 load8(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::F16:
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)));
    case DType::BF16: {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    case DType::F32:
    default:
      return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  }
}

QUILL_INLINE __m256i u8x8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }

// (v >> n) & mask per int32 lane, n not a compile-time constant.
QUILL_INLINE __m256i bits_at(__m256i v, int n, int mask) {
  return _mm256_and_si256(_mm256_srl_epi32(v, _mm_cvtsi32_si128(n)), _mm256_set1_epi32(mask));
}

// Lanes 8h..8h+7's integer sub-values of segment s (sub_value).
QUILL_INLINE __m256i sub8(const void* sub, const Weights& w, int nb, int s, int h) {
  if (w.sub_bits == 8)
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(
        reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(sub) + seg_index(w, nb, s, 8 * h))));
  const uint8_t* p = static_cast<const uint8_t*>(sub) + int64_t(nb) * sub_rows(w.sub_bits, w.nseg) * LANES + 8 * h;
  __m256i u;
  if (w.sub_bits == 4) {
    u = bits_at(u8x8(p + (s / 2) * LANES), 4 * (s & 1), 15);
  } else {
    const int g = s / 4, j = s & 3;
    u = _mm256_or_si256(bits_at(u8x8(p + (3 * g + j / 2) * LANES), 4 * (j & 1), 15),
                        _mm256_slli_epi32(bits_at(u8x8(p + (3 * g + 2) * LANES), 2 * j, 3), 4));
  }
  return _mm256_sub_epi32(u, _mm256_set1_epi32(w.sub_bias));
}

// Two-level weights: the super-block scale (and offset) of lanes 8h..8h+7 of one row block,
// converted once per super-block (gps segments) instead of once per segment (simd512.h Supers).
struct Supers8 {
  int g = -1;  // the super-block held (-1: none yet)
  alignas(32) float scale[8], offset[8];
};

// One level: 8 stored values at i.  Two levels: super * integer sub-values (level_at), the super
// value `held`.
QUILL_INLINE __m256 level8(const void* sub, const void* sup, const Weights& w, int nb, int s, int h, int64_t i,
                           const float* held) {
  if (!sup) return load8(sub, w.scale_dtype, i);
  return _mm256_mul_ps(_mm256_load_ps(held), _mm256_cvtepi32_ps(sub8(sub, w, nb, s, h)));
}

// Scale, zero and offset of segment s for lanes 8h..8h+7, loaded once per segment and shared by
// every token of a tile.
struct Seg8 {
  __m256 scale, zero, offset;
  __m256i zero_i;  // the zero point as int32 (split kernels subtract it before rounding)
  bool has_offset;
  bool has_zero;  // false: no zeros and zero point 0 (K-quants with mins), nothing to take off
};

QUILL_INLINE Seg8 seg8(const Weights& w, int nb, int s, int h, Supers8& sup) {
  const int64_t i = seg_index(w, nb, s, 8 * h);
  if (w.super_scales && s / w.gps != sup.g) {
    sup.g = s / w.gps;
    const int64_t si = super_index(w, nb, s, 8 * h);
    _mm256_store_ps(sup.scale, load8(w.super_scales, w.scale_dtype, si));
    if (w.super_offsets) _mm256_store_ps(sup.offset, load8(w.super_offsets, w.scale_dtype, si));
  }
  Seg8 c;
  c.has_zero = w.zeros || w.zconst != 0.0f;
  if (!w.zeros)
    c.zero_i = _mm256_set1_epi32(int32_t(w.zconst));
  else if (w.bits != 8)
    c.zero_i = u8x8(static_cast<const uint8_t*>(w.zeros) + i);
  else
    c.zero_i = _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int16_t*>(w.zeros) + i)));
  c.zero = _mm256_cvtepi32_ps(c.zero_i);
  c.scale = level8(w.scales, w.super_scales, w, nb, s, h, i, sup.scale);
  c.has_offset = w.offsets != nullptr;
  c.offset = c.has_offset ? level8(w.offsets, w.super_offsets, w, nb, s, h, i, sup.offset) : _mm256_setzero_ps();
  return c;
}

// f += scale * (d - zero * x) [+ offset * x] for lanes 8h..8h+7 of one segment (seg_epilogue).
QUILL_INLINE __m256 epilogue(const Seg8& c, __m256 d, __m256 x, __m256 f) {
  const __m256 t = _mm256_fnmadd_ps(c.zero, x, d);
  f = _mm256_fmadd_ps(c.scale, t, f);
  if (c.has_offset) f = _mm256_fmadd_ps(c.offset, x, f);
  return f;
}

// f += scale * (d * g - zero * xg) [+ offset * xg], xg = x * g, for lanes 8h..8h+7 (seg_epilogue_g).
QUILL_INLINE __m256 epilogue_g(const Seg8& c, __m256 d, float x, float g, __m256 f) {
  const float xg = x * g;
  const __m256 t = _mm256_fmsub_ps(d, _mm256_set1_ps(g), _mm256_mul_ps(c.zero, _mm256_set1_ps(xg)));
  f = _mm256_fmadd_ps(c.scale, t, f);
  if (c.has_offset) f = _mm256_fmadd_ps(c.offset, _mm256_set1_ps(xg), f);
  return f;
}

// epilogue_g of a one_zero_point layer with its token side precomputed, pair = (g, z * xg) (group_terms):
// f += scale * (d * g - z * xg), both broadcasts from memory.
QUILL_INLINE __m256 epilogue_gz(__m256 scale, __m256 d, const float* pair, __m256 f) {
  return _mm256_fmadd_ps(scale, _mm256_fmsub_ps(d, _mm256_set1_ps(pair[0]), _mm256_set1_ps(pair[1])), f);
}

// epilogue_g of a layer with one zero point, its token side precomputed, p = (g, z * xg, xg) (group_terms<3>), its
// weight side (two-level scales, offsets) from seg8: f += scale * (d * g - z * xg) [+ offset * xg].
QUILL_INLINE __m256 epilogue_gzo(const Seg8& c, __m256 d, const float* p, __m256 f) {
  f = _mm256_fmadd_ps(c.scale, _mm256_fmsub_ps(d, _mm256_set1_ps(p[0]), _mm256_set1_ps(p[1])), f);
  if (c.has_offset) f = _mm256_fmadd_ps(c.offset, _mm256_set1_ps(p[2]), f);
  return f;
}

// The per-group epilogue's token side precomputed (group_terms): stride 2, (g, z xg), for one_zero_point layers;
// stride 3, (g, z xg, xg), for the other 4-6-bit layers with one zero point (K-quants, Q4_1 / Q5_1); p null: none.
struct GroupSide {
  const float* p = nullptr;  // [S, M, stride]
  int stride = 0;
};

// f += (scale * xscale) * (SHIFT * (Dhi - z * Xhi) + (Dlo - z * Xlo)) [+ (offset * xscale) * (SHIFT * Xhi + Xlo)]
// for lanes 8h..8h+7 (split_epilogue).
// Folded zero point and fused T as in simd512.h's split_epilogue (common.h, Weights::fold_zero / fuse_t).
template <int PARTS>
QUILL_INLINE __m256 epilogue_split(const Seg8& c, __m256i dhi, __m256i dlo, int32_t xhi, int32_t xlo, float xscale,
                                   __m256 f, bool fuse = false) {
  constexpr int SB = split_shift_bits(PARTS);  // SHIFT = 2^SB (common.h SplitActs)
  constexpr float SHIFT = float(1 << SB);
  __m256i ehi = dhi, elo = dlo;
  if (c.has_zero) {
    ehi = _mm256_sub_epi32(dhi, _mm256_mullo_epi32(c.zero_i, _mm256_set1_epi32(xhi)));
    elo = _mm256_sub_epi32(dlo, _mm256_mullo_epi32(c.zero_i, _mm256_set1_epi32(xlo)));
  }
  const __m256 t = fuse ? _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(ehi, SB), elo))
                        : _mm256_fmadd_ps(_mm256_cvtepi32_ps(ehi), _mm256_set1_ps(SHIFT), _mm256_cvtepi32_ps(elo));
  const __m256 xs = _mm256_set1_ps(xscale);
  f = _mm256_fmadd_ps(_mm256_mul_ps(c.scale, xs), t, f);
  if (c.has_offset)
    f = _mm256_fmadd_ps(_mm256_mul_ps(c.offset, xs), _mm256_set1_ps(std::fma(float(xhi), SHIFT, float(xlo))), f);
  return f;
}

// 5/6-bit codes: OR the high plane (common.h) into the nibbles of half h, in place.
// lo holds positions 8c..8c+3, hi positions 8c+4..8c+7 of lanes 8h..8h+7.
template <int BITS>
QUILL_INLINE void add_high_bits(const uint8_t* plane, int h, __m256i& lo, __m256i& hi) {
  constexpr int HB = BITS - 4;
  __m256i v;
  if (BITS == 6) {  // lanes 8h + r in byte row r at bits 4h (low nibble's) and 4h + 2 (high nibble's)
    v = _mm256_srl_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(plane)), _mm_cvtsi32_si128(4 * h));
  } else {  // 5-bit: lanes 8h + r in byte row r % 4 at bit 2 * (2h + r / 4) (+1 for the high nibble's)
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(plane)));
    const int s0 = 4 * h;
    v = _mm256_srlv_epi32(b, _mm256_setr_epi32(s0, s0, s0, s0, s0 + 2, s0 + 2, s0 + 2, s0 + 2));
  }
  const __m256i m = _mm256_set1_epi8((1 << HB) - 1);
  lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(v, m), 4));
  hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(v, _mm256_slli_epi16(m, HB)), 4 - HB));
}

// 2/3-bit codes (common.h): the 2-bit pairs of half h's 32 bytes as 4 byte vectors (q[j]:
// positions 16c + 4j .. +3 of lanes 8h..8h+7), the third bit's plane ORed in for 3-bit.
template <int BITS>
QUILL_INLINE void unpack_low(__m256i v, const uint8_t* plane, int h, __m256i q[4]) {
  const __m256i m3 = _mm256_set1_epi8(3);
  q[0] = _mm256_and_si256(v, m3);
  q[1] = _mm256_and_si256(_mm256_srli_epi16(v, 2), m3);
  q[2] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m3);
  q[3] = _mm256_and_si256(_mm256_srli_epi16(v, 6), m3);
  if constexpr (BITS == 3) {  // lanes 8h + r in byte row r at bit 4h + j: move bit j to bit 2
    const __m256i p = _mm256_srl_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(plane)), _mm_cvtsi32_si128(4 * h));
    const __m256i m4 = _mm256_set1_epi8(4);
    q[0] = _mm256_or_si256(q[0], _mm256_and_si256(_mm256_slli_epi16(p, 2), m4));
    q[1] = _mm256_or_si256(q[1], _mm256_and_si256(_mm256_slli_epi16(p, 1), m4));
    q[2] = _mm256_or_si256(q[2], _mm256_and_si256(p, m4));
    q[3] = _mm256_or_si256(q[3], _mm256_and_si256(_mm256_srli_epi16(p, 1), m4));
  }
}

// store_float_row / store_int_row, 8 lanes a store for a full row block of float32 outputs (the scalar rows'
// 16 single stores, each to an output line the call has not touched yet, stalled the store buffer: 4 % of an
// AVX2 K-quant prefill); the same operations per lane, so the same bits.
QUILL_INLINE bool full_f32_row(const Weights& w, const Out& o, int nb) {
  return o.dtype == DType::F32 && (nb + 1) * LANES <= w.n;
}

inline void store_float_row8(const Weights& w, const Out& o, int nb, int m, const float* f) {
  if (!full_f32_row(w, o, nb)) return store_float_row(w, o, nb, m, f);
  float* y = static_cast<float*>(o.y) + int64_t(m) * o.ld + nb * LANES;
  for (int h = 0; h < 2; ++h) {
    __m256 v = _mm256_loadu_ps(f + 8 * h);
    if (w.bias) v = _mm256_add_ps(v, _mm256_loadu_ps(w.bias + nb * LANES + 8 * h));
    _mm256_storeu_ps(y + 8 * h, v);
  }
}

inline void store_int_row8(const Weights& w, const I8Acts& a, const Out& o, int nb, int m, const float* f) {
  if (!full_f32_row(w, o, nb)) return store_int_row(w, a, o, nb, m, f);
  float* y = static_cast<float*>(o.y) + int64_t(m) * o.ld + nb * LANES;
  for (int h = 0; h < 2; ++h) {
    __m256 v = _mm256_loadu_ps(f + 8 * h);
    if (a.asym) v = _mm256_fnmadd_ps(_mm256_set1_ps(a.zero[m]), _mm256_loadu_ps(w.wsum + nb * LANES + 8 * h), v);
    if (!a.gscale) v = _mm256_mul_ps(v, _mm256_set1_ps(a.scale[m]));  // per-segment scales are in f already
    if (w.bias) v = _mm256_add_ps(v, _mm256_loadu_ps(w.bias + nb * LANES + 8 * h));
    _mm256_storeu_ps(y + 8 * h, v);
  }
}

}  // namespace v256
}  // namespace quill
