// The activation quantizers on AVX-512 (KernelTable::quantize, quantize_split; their definitions are the
// scalar ones in scalar.cpp): int8 per token or per segment, and the split image of float activations.
// Compiled with -mavx512f -mavx512bw -mavx512vl; called only when the CPU has them.
#include <immintrin.h>

#include "quantizers.h"
#include "scalar_util.h"

namespace quill {
namespace avx512 {
namespace {

// 16 input values of token row `x` starting at column i, as float32.
inline __m512 load_x(const RawX& in, const void* row, int64_t i, __mmask16 mask) {
  switch (in.dtype) {
    case DType::F16:
      return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(row) + i));
    case DType::BF16:
      return _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(row) + i)), 16));
    case DType::F32:
    default:
      return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(row) + i);
  }
}

inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1u); }

// One token's stream with one scale per segment (quantize_segments_row), identity order.
void quantize_segments(const RawX& in, const void* row, int8_t* out, float* gscale) {
  const __m512 qmin = _mm512_set1_ps(-128.0f), qmax = _mm512_set1_ps(127.0f);
  for (int s = 0, p0 = 0; s < in.nseg; p0 = in.seg_end[s++] * in.chunk) {
    const int64_t p1 = int64_t(in.seg_end[s]) * in.chunk, real = std::min<int64_t>(p1, in.k);
    __m512 vabs = _mm512_setzero_ps();
    for (int64_t i = p0; i < real; i += 16)
      vabs = _mm512_max_ps(vabs, _mm512_abs_ps(load_x(in, row, i, tail_mask(real - i))));  // masked lanes: 0
    const float g = act_params(ActQuant{}, 0.0f, 0.0f, _mm512_reduce_max_ps(vabs)).scale;  // dynamic symmetric
    gscale[s] = g;
    const __m512 vs = _mm512_set1_ps(g), vz = _mm512_setzero_ps();
    for (int64_t i = p0; i < p1; i += 16) {
      const __mmask16 mk = tail_mask(p1 - i);  // lanes past K load 0 and quantize to 0
      const __m512 t = _mm512_add_ps(_mm512_div_ps(load_x(in, row, i, real > i ? tail_mask(real - i) : 0), vs), vz);
      const __m512i qi = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(t, qmin), qmax));  // ties to even
      _mm_mask_storeu_epi8(out + i, mk, _mm512_cvtepi32_epi8(qi));
    }
  }
}

}  // namespace

void quantize(const RawX& in, const ActQuant& aq, int8_t* q, int32_t* qsum, float* scale, float* zero,
              float* gscale, int m0, int m1) {
  const int esize = in.dtype == DType::F32 ? 4 : 2;
  for (int m = m0; m < m1; ++m) {
    const void* row = static_cast<const char*>(in.x) + m * in.k * esize;  // [K]
    if (aq.per_segment) {
      if (in.src) quantize_segments_row(in, m, q + m * in.kp, gscale + m * in.nseg);
      else quantize_segments(in, row, q + m * in.kp, gscale + m * in.nseg);
      segment_sums(in, q + m * in.kp, qsum + m * in.nseg);
      continue;
    }
    float lo = 0.0f, hi = 0.0f, amax = 0.0f;
    if (aq.dynamic) {  // max / min are exact, so lane order does not matter
      __m512 vlo = _mm512_setzero_ps(), vhi = vlo, vabs = vlo;
      for (int64_t i = 0; i < in.k; i += 16) {
        const __mmask16 mk = tail_mask(in.k - i);
        const __m512 v = load_x(in, row, i, mk);  // masked-off lanes are 0, neutral here
        vlo = _mm512_min_ps(vlo, v);
        vhi = _mm512_max_ps(vhi, v);
        vabs = _mm512_max_ps(vabs, _mm512_abs_ps(v));
      }
      lo = _mm512_reduce_min_ps(vlo);
      hi = _mm512_reduce_max_ps(vhi);
      amax = _mm512_reduce_max_ps(vabs);
    }
    const ActParams p = act_params(aq, lo, hi, amax);
    scale[m] = p.scale;
    zero[m] = p.zero;
    int8_t* out = q + m * in.kp;  // [Kp]
    if (in.src) {  // act-order / padded groups: gather (same scalar arithmetic)
      for (int64_t pos = 0; pos < in.kp; ++pos) {
        const int64_t col = in.src[pos];
        out[pos] = col < 0 ? 0 : quantize_one(to_float(in.x, in.dtype, m * in.k + col), p);
      }
    } else {
      const __m512 vs = _mm512_set1_ps(p.scale), vz = _mm512_set1_ps(p.zero);
      const __m512 qmin = _mm512_set1_ps(-128.0f), qmax = _mm512_set1_ps(127.0f);
      for (int64_t i = 0; i < in.k; i += 16) {
        const __mmask16 mk = tail_mask(in.k - i);
        const __m512 t = _mm512_add_ps(_mm512_div_ps(load_x(in, row, i, mk), vs), vz);
        const __m512i qi = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(t, qmin), qmax));  // ties to even
        _mm_mask_storeu_epi8(out + i, mk, _mm512_cvtepi32_epi8(qi));
      }
      for (int64_t pos = in.k; pos < in.kp; ++pos) out[pos] = 0;
    }
    segment_sums(in, out, qsum + m * in.nseg);
  }
}

namespace {

// 16 lanes, the first `left` set (none when left <= 0).
inline __mmask16 first_lanes(int64_t left) {
  return left <= 0 ? __mmask16(0) : (left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1u));
}

}  // namespace

// The split stream of tokens [m0, m1) (quantize_split in scalar.cpp): the image 16 positions
// a step, split on whole vectors, each chunk's run of parts stored at once (O(K) per token,
// beside the O(N K) kernel); identity order (the binding gathers act-order first).
void quantize_split(const RawX& in, int8_t* xs, int32_t* qsum, float* scale, int m0, int m1) {
  const int esize = in.dtype == DType::F32 ? 4 : 2;
  const __m512i absmask = _mm512_set1_epi32(0x7FFFFFFF);
  const int parts = in.parts, sb = split_shift_bits(parts);
  const __m512 qmin = _mm512_set1_ps(-split_qmax(parts)), qmax = _mm512_set1_ps(split_qmax(parts));
  for (int m = m0; m < m1; ++m) {
    const void* row = static_cast<const char*>(in.x) + m * in.k * esize;  // [K]
    int8_t* out = xs + m * in.kp * parts;  // [KC, parts * CK]
    for (int s = 0, p0 = 0; s < in.nseg; p0 = in.seg_end[s++] * in.chunk) {
      const int64_t p1 = int64_t(in.seg_end[s]) * in.chunk, real = std::min<int64_t>(p1, in.k);
      __m512i vmax = _mm512_setzero_si512();
      for (int64_t p = p0; p < p1; p += 16)
        vmax = _mm512_max_epu32(vmax, _mm512_and_si512(_mm512_castps_si512(load_x(in, row, p, first_lanes(real - p))), absmask));
      const SplitParams sp = split_params(uint32_t(_mm512_reduce_max_epu32(vmax)), parts);
      const int64_t i = int64_t(m) * in.nseg + s;
      scale[i] = sp.scale;
      int32_t xhi = 0, xlo = 0;
      if (!sp.finite) {
        for (int64_t p = p0; p < p1; ++p) put_split(out, in.chunk, parts, p, 0, xhi, xlo);
      } else {
        const __m512 pre = _mm512_set1_ps(sp.pre), inv = _mm512_set1_ps(sp.inv);
        const __m512i r128 = _mm512_set1_epi32(128);
        __m512i shi = _mm512_setzero_si512(), slo = _mm512_setzero_si512();
        alignas(16) int8_t bytes[3][16];
        for (int64_t p = p0; p < p1; p += 16) {
          const __m512 v = load_x(in, row, p, first_lanes(real - p));  // lanes past the segment or K: 0
          const __m512 t = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_mul_ps(v, pre), inv), qmin), qmax);
          const __m512i q = _mm512_cvtps_epi32(t);  // ties to even
          // split_parts on 16 lanes: r = (q + 128) >> 8, lo = q - 256 r; 24 bits: hi = (r + 128) >> 8,
          // mid = r - 256 hi; 16 bits: hi = r
          const __m512i r = _mm512_srai_epi32(_mm512_add_epi32(q, r128), 8);
          const __m512i hi = parts == SPLIT_PARTS ? _mm512_srai_epi32(_mm512_add_epi32(r, r128), 8) : r;
          const __m512i mid = _mm512_sub_epi32(r, _mm512_slli_epi32(hi, 8));
          const __m512i lo = _mm512_sub_epi32(q, _mm512_slli_epi32(r, 8));
          const int n = int(std::min<int64_t>(16, p1 - p));  // lanes past n are 0 (past K) and not stored
          shi = _mm512_add_epi32(shi, hi);
          slo = _mm512_add_epi32(slo, _mm512_sub_epi32(q, _mm512_sll_epi32(hi, _mm_cvtsi32_si128(sb))));
          _mm_store_si128(reinterpret_cast<__m128i*>(bytes[0]), _mm512_cvtepi32_epi8(hi));
          _mm_store_si128(reinterpret_cast<__m128i*>(bytes[1]), _mm512_cvtepi32_epi8(mid));
          _mm_store_si128(reinterpret_cast<__m128i*>(bytes[2]), _mm512_cvtepi32_epi8(lo));
          put_split_run(out, in.chunk, parts, p, n, bytes[0], bytes[1], bytes[2]);
        }
        xhi = _mm512_reduce_add_epi32(shi);  // integer sums: any order
        xlo = _mm512_reduce_add_epi32(slo);
      }
      qsum[2 * i] = xhi;
      qsum[2 * i + 1] = xlo;
    }
  }
}

}  // namespace avx512
}  // namespace quill
