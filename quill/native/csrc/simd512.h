// AVX-512 helpers shared by the AVX-512 translation units: loads of per-segment
// constants, the segment epilogue and the stores, 16 lanes (= 16 output rows) wide.
// Each performs per lane exactly the scalar operations of scalar_util.h.
#pragma once

#include <immintrin.h>

#include "scalar_util.h"

namespace quill {
namespace v512 {

// 4 activation bytes broadcast to every 32-bit lane (vpdpbusd's signed operand).
QUILL_INLINE __m512i bcast4(const int8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// 16 consecutive values of dtype t starting at element i, as float32.
QUILL_INLINE __m512 load16(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::F16:
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i)));
    case DType::BF16: {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    case DType::F32:
    default:
      return _mm512_loadu_ps(static_cast<const float*>(p) + i);
  }
}

// Scale, zero and offset of one segment for the 16 rows of a row block.
struct SegConsts {
  __m512 scale, zero, offset;
  __m512i zero_i;  // the zero point as int32 (split kernels subtract it before rounding)
  bool has_offset;
  bool has_zero;  // false: no zeros and zero point 0 (K-quants with mins), nothing to take off
};

QUILL_INLINE __m512i u8x16(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// (v >> n) & mask per int32 lane, n not a compile-time constant.
QUILL_INLINE __m512i bits_at(__m512i v, int n, int mask) {
  return _mm512_and_si512(_mm512_srl_epi32(v, _mm_cvtsi32_si128(n)), _mm512_set1_epi32(mask));
}

// The 16 lanes' integer sub-values of segment s (sub_value).
QUILL_INLINE __m512i sub16(const void* sub, const Weights& w, int nb, int s) {
  if (w.sub_bits == 8)
    return _mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(sub) + seg_index(w, nb, s, 0))));
  const uint8_t* p = static_cast<const uint8_t*>(sub) + int64_t(nb) * sub_rows(w.sub_bits, w.nseg) * LANES;
  __m512i u;
  if (w.sub_bits == 4) {
    u = bits_at(u8x16(p + (s / 2) * LANES), 4 * (s & 1), 15);
  } else {
    const int g = s / 4, j = s & 3;
    u = _mm512_or_si512(bits_at(u8x16(p + (3 * g + j / 2) * LANES), 4 * (j & 1), 15),
                        _mm512_slli_epi32(bits_at(u8x16(p + (3 * g + 2) * LANES), 2 * j, 3), 4));
  }
  return _mm512_sub_epi32(u, _mm512_set1_epi32(w.sub_bias));
}

// Two-level weights (K-quants): the super-block scale (and offset) of one row block, converted
// once per super-block (gps segments) instead of once per segment.  One token, 8192 x 2048, Zen 5:
// Q4_K W4A16 -14 %, W4A8 -17 % (AVX2 -17 / -28 %), Q6_K W4A8 -11 %; a 16-token Q6_K W4A16 tile
// lost 3-5 %.  Kept in memory, not registers: a wide tile has none to spare, and an L1 load is
// cheap beside the index arithmetic and f16 conversion it replaces.
struct Supers {
  int g = -1;  // the super-block held (-1: none yet)
  alignas(64) float scale[LANES], offset[LANES];
};

// One level: 16 stored values at i.  Two levels: super * integer sub-values (level_at), the super
// value `held` (Supers).
QUILL_INLINE __m512 level16(const void* sub, const void* sup, const Weights& w, int nb, int s, int64_t i,
                                 const float* held) {
  if (!sup) return load16(sub, w.scale_dtype, i);
  return _mm512_mul_ps(_mm512_load_ps(held), _mm512_cvtepi32_ps(sub16(sub, w, nb, s)));
}

QUILL_INLINE SegConsts seg_consts(const Weights& w, int nb, int s, Supers& sup) {
  const int64_t i = seg_index(w, nb, s, 0);
  if (w.super_scales && s / w.gps != sup.g) {
    sup.g = s / w.gps;
    const int64_t si = super_index(w, nb, s, 0);
    _mm512_store_ps(sup.scale, load16(w.super_scales, w.scale_dtype, si));
    if (w.super_offsets) _mm512_store_ps(sup.offset, load16(w.super_offsets, w.scale_dtype, si));
  }
  SegConsts c;
  c.scale = level16(w.scales, w.super_scales, w, nb, s, i, sup.scale);
  c.has_zero = w.zeros || w.zconst != 0.0f;
  if (!w.zeros) {
    c.zero_i = _mm512_set1_epi32(int32_t(w.zconst));
  } else if (w.bits != 8) {
    const __m128i z = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(w.zeros) + i));
    c.zero_i = _mm512_cvtepu8_epi32(z);
  } else {
    const __m256i z = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const int16_t*>(w.zeros) + i));
    c.zero_i = _mm512_cvtepi16_epi32(z);
  }
  c.zero = _mm512_cvtepi32_ps(c.zero_i);
  c.has_offset = w.offsets != nullptr;
  c.offset = c.has_offset ? level16(w.offsets, w.super_offsets, w, nb, s, i, sup.offset) : _mm512_setzero_ps();
  return c;
}

// f += scale * (d - zero * x) [+ offset * x]  (seg_epilogue, 16 lanes)
QUILL_INLINE __m512 epilogue(const SegConsts& c, __m512 d, __m512 x, __m512 f) {
  const __m512 t = _mm512_fnmadd_ps(c.zero, x, d);
  f = _mm512_fmadd_ps(c.scale, t, f);
  if (c.has_offset) f = _mm512_fmadd_ps(c.offset, x, f);
  return f;
}

// f += scale * (d * g - zero * xg) [+ offset * xg], xg = x * g  (seg_epilogue_g, 16 lanes)
QUILL_INLINE __m512 epilogue_g(const SegConsts& c, __m512 d, float x, float g, __m512 f) {
  const float xg = x * g;
  const __m512 t = _mm512_fmsub_ps(d, _mm512_set1_ps(g), _mm512_mul_ps(c.zero, _mm512_set1_ps(xg)));
  f = _mm512_fmadd_ps(c.scale, t, f);
  if (c.has_offset) f = _mm512_fmadd_ps(c.offset, _mm512_set1_ps(xg), f);
  return f;
}

// epilogue_g of a one_zero_point layer with its token side precomputed, pair = (g, z * xg) (group_terms):
// f += scale * (d * g - z * xg), both broadcasts from memory.
QUILL_INLINE __m512 epilogue_gz(__m512 scale, __m512 d, const float* pair, __m512 f) {
  return _mm512_fmadd_ps(scale, _mm512_fmsub_ps(d, _mm512_set1_ps(pair[0]), _mm512_set1_ps(pair[1])), f);
}

// epilogue_g of a layer with one zero point, its token side precomputed, p = (g, z * xg, xg) (group_terms<3>), its
// weight side (two-level scales, offsets) from seg_consts: f += scale * (d * g - z * xg) [+ offset * xg].
QUILL_INLINE __m512 epilogue_gzo(const SegConsts& c, __m512 d, const float* p, __m512 f) {
  f = _mm512_fmadd_ps(c.scale, _mm512_fmsub_ps(d, _mm512_set1_ps(p[0]), _mm512_set1_ps(p[1])), f);
  if (c.has_offset) f = _mm512_fmadd_ps(c.offset, _mm512_set1_ps(p[2]), f);
  return f;
}

// f += (scale * xscale) * (SHIFT * (Dhi - z * Xhi) + (Dlo - z * Xlo))
//      [+ (offset * xscale) * (SHIFT * Xhi + Xlo)]   (split_epilogue, 16 lanes)
// With the zero point folded into the accumulators (Weights::fold_zero) dhi / dlo hold Dhi - z Xhi and
// Dlo - z Xlo already and c.has_zero is false; fuse (Weights::fuse_t) forms T in int32 (common.h).
template <int PARTS>
QUILL_INLINE __m512 split_epilogue(const SegConsts& c, __m512i dhi, __m512i dlo, int32_t xhi, int32_t xlo, float xscale,
                             __m512 f, bool fuse = false) {
  constexpr int SB = split_shift_bits(PARTS);  // SHIFT = 2^SB (common.h SplitActs)
  constexpr float SHIFT = float(1 << SB);
  __m512i ehi = dhi, elo = dlo;
  if (c.has_zero) {
    ehi = _mm512_sub_epi32(dhi, _mm512_mullo_epi32(c.zero_i, _mm512_set1_epi32(xhi)));
    elo = _mm512_sub_epi32(dlo, _mm512_mullo_epi32(c.zero_i, _mm512_set1_epi32(xlo)));
  }
  const __m512 t = fuse ? _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(ehi, SB), elo))
                        : _mm512_fmadd_ps(_mm512_cvtepi32_ps(ehi), _mm512_set1_ps(SHIFT), _mm512_cvtepi32_ps(elo));
  const __m512 xs = _mm512_set1_ps(xscale);
  f = _mm512_fmadd_ps(_mm512_mul_ps(c.scale, xs), t, f);
  if (c.has_offset)
    f = _mm512_fmadd_ps(_mm512_mul_ps(c.offset, xs), _mm512_set1_ps(std::fma(float(xhi), SHIFT, float(xlo))), f);
  return f;
}

// 5/6-bit codes: OR the high plane (common.h) of one chunk into the nibbles of all 16 lanes,
// in place (lo: positions 8c..8c+3, hi: 8c+4..8c+7).
template <int BITS>
QUILL_INLINE void add_high_bits(const uint8_t* plane, __m512i& lo, __m512i& hi) {
  constexpr int HB = BITS - 4;
  __m512i v;
  if (BITS == 6) {  // lane r in byte row r % 8 at bit 4 * (r / 8) (+2 for the high nibble's)
    const __m512i b = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(plane)));
    v = _mm512_srlv_epi32(b, _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0));
  } else {  // 5-bit: lane r in byte row r % 4 at bit 2 * (r / 4) (+1)
    const __m512i b = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(plane)));
    v = _mm512_srlv_epi32(b, _mm512_set_epi32(6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0));
  }
  const __m512i m = _mm512_set1_epi8((1 << HB) - 1);
  lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(v, m), 4));
  hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(v, _mm512_slli_epi16(m, HB)), 4 - HB));
}

// 2/3-bit codes: the 2-bit pairs of one chunk's 64 bytes as 4 byte vectors (q[j]: positions
// 16c + 4j .. +3 of all 16 lanes), with the third bit's plane (common.h) ORed in for 3-bit.
template <int BITS>
QUILL_INLINE void unpack_low(const __m512i v, const uint8_t* plane, __m512i q[4]) {
  const __m512i m3 = _mm512_set1_epi8(3);
  q[0] = _mm512_and_si512(v, m3);
  q[1] = _mm512_and_si512(_mm512_srli_epi16(v, 2), m3);
  q[2] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m3);
  q[3] = _mm512_and_si512(_mm512_srli_epi16(v, 6), m3);
  if constexpr (BITS == 3) {  // lane r in byte row r % 8 at bit 4 * (r / 8) + j: move bit j to bit 2
    const __m512i b = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(plane)));
    const __m512i p = _mm512_srlv_epi32(b, _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0));
    const __m512i m4 = _mm512_set1_epi8(4);
    q[0] = _mm512_or_si512(q[0], _mm512_and_si512(_mm512_slli_epi16(p, 2), m4));
    q[1] = _mm512_or_si512(q[1], _mm512_and_si512(_mm512_slli_epi16(p, 1), m4));
    q[2] = _mm512_or_si512(q[2], _mm512_and_si512(p, m4));
    q[3] = _mm512_or_si512(q[3], _mm512_and_si512(_mm512_srli_epi16(p, 1), m4));
  }
}

inline __mmask16 row_mask(const Weights& w, int nb) {
  const int left = w.n - nb * LANES;
  return left >= LANES ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1u);
}

// float32 -> bfloat16 with ties to even, NaN kept quiet (f32_to_bf16_rne, 16 lanes).
inline __m256i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  const __m512i nan = _mm512_or_si512(u, _mm512_set1_epi32(0x400000));
  const __mmask16 is_nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_mask_blend_epi32(is_nan, r, nan), 16));
}

inline void store(const Out& o, int m, int n0, __mmask16 mask, __m512 v) {
  if (o.dtype == DType::BF16)
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(o.y) + m * o.ld + n0, mask, to_bf16(v));
  else
    _mm512_mask_storeu_ps(static_cast<float*>(o.y) + m * o.ld + n0, mask, v);
}

// y = f (+ bias)  (store_float_row)
inline void store_float(const Weights& w, const Out& o, int nb, int m, __m512 f) {
  const __mmask16 mask = row_mask(w, nb);
  if (w.bias) f = _mm512_add_ps(f, _mm512_maskz_loadu_ps(mask, w.bias + nb * LANES));
  store(o, m, nb * LANES, mask, f);
}

// y = (f - zero_a * wsum) * scale_a (+ bias)  (store_int_row)
inline void store_int(const Weights& w, const I8Acts& a, const Out& o, int nb, int m, __m512 f) {
  const __mmask16 mask = row_mask(w, nb);
  if (a.asym) f = _mm512_fnmadd_ps(_mm512_set1_ps(a.zero[m]), _mm512_loadu_ps(w.wsum + nb * LANES), f);
  if (!a.gscale) f = _mm512_mul_ps(f, _mm512_set1_ps(a.scale[m]));  // per-segment scales are in f already
  if (w.bias) f = _mm512_add_ps(f, _mm512_maskz_loadu_ps(mask, w.bias + nb * LANES));
  store(o, m, nb * LANES, mask, f);
}

}  // namespace v512
}  // namespace quill
