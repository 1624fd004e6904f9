// The activation quantizers on AVX2 (KernelTable::quantize, quantize_split; their definitions are the
// scalar ones in scalar.cpp): int8 per token or per segment, and the split image of float activations.
// Compiled with -mavx2 -mfma -mf16c only.
#include <immintrin.h>

#include "quantizers.h"
#include "scalar_util.h"

namespace quill {
namespace avx2 {
namespace {

inline __m256 load_x8(const RawX& in, const void* row, int64_t i) {
  switch (in.dtype) {
    case DType::F16:
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(row) + i)));
    case DType::BF16:
      return _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(row) + i))), 16));
    case DType::F32:
    default:
      return _mm256_loadu_ps(static_cast<const float*>(row) + i);
  }
}

inline float hmax(__m256 v) {
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  float r = t[0];
  for (int i = 1; i < 8; ++i) r = std::max(r, t[i]);
  return r;
}

// One token's stream with one scale per segment (quantize_segments_row), identity order: whole
// vectors of 8 inside [p0, K), the rest by the scalar formula.
void quantize_segments(const RawX& in, const void* row, int8_t* out, float* gscale) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 qmin = _mm256_set1_ps(-128.0f), qmax = _mm256_set1_ps(127.0f);
  for (int s = 0, p0 = 0; s < in.nseg; p0 = in.seg_end[s++] * in.chunk) {
    const int64_t p1 = int64_t(in.seg_end[s]) * in.chunk, real = std::min<int64_t>(p1, in.k);
    const int64_t pv = real - p0 >= 8 ? p0 + (real - p0) / 8 * 8 : p0;  // vector part [p0, pv)
    __m256 vabs = _mm256_setzero_ps();
    for (int64_t i = p0; i < pv; i += 8) vabs = _mm256_max_ps(vabs, _mm256_andnot_ps(sign, load_x8(in, row, i)));
    float amax = hmax(vabs);
    for (int64_t i = pv; i < real; ++i) amax = std::max(amax, std::fabs(to_float(row, in.dtype, i)));
    const ActParams ap = act_params(ActQuant{}, 0.0f, 0.0f, amax);  // dynamic symmetric, over the segment
    gscale[s] = ap.scale;
    const __m256 vs = _mm256_set1_ps(ap.scale), vz = _mm256_setzero_ps();
    for (int64_t i = p0; i < pv; i += 8) {
      const __m256 t = _mm256_add_ps(_mm256_div_ps(load_x8(in, row, i), vs), vz);
      const __m256i qi = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(t, qmin), qmax));  // ties to even
      const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(qi), _mm256_extracti128_si256(qi, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i), _mm_packs_epi16(w16, w16));
    }
    for (int64_t i = pv; i < p1; ++i) out[i] = i < in.k ? quantize_one(to_float(row, in.dtype, i), ap) : 0;
  }
}

}  // namespace

void quantize(const RawX& in, const ActQuant& aq, int8_t* q, int32_t* qsum, float* scale, float* zero,
              float* gscale, int m0, int m1) {
  const int esize = in.dtype == DType::F32 ? 4 : 2;
  const int64_t kv = in.k / 8 * 8;  // vector part; the tail runs the scalar formula
  for (int m = m0; m < m1; ++m) {
    const void* row = static_cast<const char*>(in.x) + m * in.k * esize;  // [K]
    if (aq.per_segment) {
      if (in.src) quantize_segments_row(in, m, q + m * in.kp, gscale + m * in.nseg);
      else quantize_segments(in, row, q + m * in.kp, gscale + m * in.nseg);
      segment_sums(in, q + m * in.kp, qsum + m * in.nseg);
      continue;
    }
    float lo = 0.0f, hi = 0.0f, amax = 0.0f;
    if (aq.dynamic) {
      const __m256 sign = _mm256_set1_ps(-0.0f);
      __m256 vlo = _mm256_setzero_ps(), vhi = vlo, vabs = vlo;
      for (int64_t i = 0; i < kv; i += 8) {
        const __m256 v = load_x8(in, row, i);
        vlo = _mm256_min_ps(vlo, v);
        vhi = _mm256_max_ps(vhi, v);
        vabs = _mm256_max_ps(vabs, _mm256_andnot_ps(sign, v));
      }
      lo = -hmax(_mm256_sub_ps(_mm256_setzero_ps(), vlo));
      hi = hmax(vhi);
      amax = hmax(vabs);
      for (int64_t i = kv; i < in.k; ++i) {
        const float v = to_float(in.x, in.dtype, m * in.k + i);
        lo = std::min(lo, v);
        hi = std::max(hi, v);
        amax = std::max(amax, std::fabs(v));
      }
    }
    const ActParams p = act_params(aq, lo, hi, amax);
    scale[m] = p.scale;
    zero[m] = p.zero;
    int8_t* out = q + m * in.kp;  // [Kp]
    int64_t done = 0;
    if (!in.src) {
      const __m256 vs = _mm256_set1_ps(p.scale), vz = _mm256_set1_ps(p.zero);
      const __m256 qmin = _mm256_set1_ps(-128.0f), qmax = _mm256_set1_ps(127.0f);
      for (; done < kv; done += 8) {
        const __m256 t = _mm256_add_ps(_mm256_div_ps(load_x8(in, row, done), vs), vz);
        const __m256i qi = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(t, qmin), qmax));  // ties to even
        const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(qi), _mm256_extracti128_si256(qi, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(out + done), _mm_packs_epi16(w16, w16));
      }
    }
    for (int64_t pos = done; pos < in.kp; ++pos) {
      const int64_t col = in.src ? in.src[pos] : (pos < in.k ? pos : -1);
      out[pos] = col < 0 ? 0 : quantize_one(to_float(in.x, in.dtype, m * in.k + col), p);
    }
    segment_sums(in, out, qsum + m * in.nseg);
  }
}

namespace {

// 8 values of token row `row` from position p; positions at or past `real` read as 0.
inline __m256 load_x8_upto(const RawX& in, const void* row, int64_t p, int64_t real) {
  if (p + 8 <= real) return load_x8(in, row, p);
  alignas(32) float t[8] = {};
  for (int64_t j = p; j < real; ++j) t[j - p] = to_float(row, in.dtype, j);
  return _mm256_load_ps(t);
}

}  // namespace

// The split stream of tokens [m0, m1) (quantize_split in scalar.cpp): the image 8 positions
// a step, split on whole vectors, each chunk's run of parts stored at once (O(K) per token,
// beside the O(N K) kernel); identity order (the binding gathers act-order first).
void quantize_split(const RawX& in, int8_t* xs, int32_t* qsum, float* scale, int m0, int m1) {
  const int esize = in.dtype == DType::F32 ? 4 : 2;
  const __m256i absmask = _mm256_set1_epi32(0x7FFFFFFF);
  const int parts = in.parts, sb = split_shift_bits(parts);
  const __m256 qmin = _mm256_set1_ps(-split_qmax(parts)), qmax = _mm256_set1_ps(split_qmax(parts));
  for (int m = m0; m < m1; ++m) {
    const void* row = static_cast<const char*>(in.x) + m * in.k * esize;  // [K]
    int8_t* out = xs + m * in.kp * parts;  // [KC, parts * CK]
    for (int s = 0, p0 = 0; s < in.nseg; p0 = in.seg_end[s++] * in.chunk) {
      const int64_t p1 = int64_t(in.seg_end[s]) * in.chunk, real = std::min<int64_t>(p1, in.k);
      __m256i vmax = _mm256_setzero_si256();
      for (int64_t p = p0; p < real; p += 8)
        vmax = _mm256_max_epu32(vmax, _mm256_and_si256(_mm256_castps_si256(load_x8_upto(in, row, p, real)), absmask));
      alignas(32) uint32_t lanes[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), vmax);
      const SplitParams sp = split_params(*std::max_element(lanes, lanes + 8), parts);
      const int64_t i = int64_t(m) * in.nseg + s;
      scale[i] = sp.scale;
      int32_t xhi = 0, xlo = 0;
      if (!sp.finite) {
        for (int64_t p = p0; p < p1; ++p) put_split(out, in.chunk, parts, p, 0, xhi, xlo);
      } else {
        const __m256 pre = _mm256_set1_ps(sp.pre), inv = _mm256_set1_ps(sp.inv);
        const __m256i r128 = _mm256_set1_epi32(128);
        __m256i shi = _mm256_setzero_si256(), slo = _mm256_setzero_si256();
        alignas(16) int8_t bytes[3][16];
        for (int64_t p = p0; p < p1; p += 8) {
          const __m256 v = load_x8_upto(in, row, p, real);
          const __m256 t = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_mul_ps(v, pre), inv), qmin), qmax);
          const __m256i q = _mm256_cvtps_epi32(t);  // ties to even
          // split_parts on 8 lanes: r = (q + 128) >> 8, lo = q - 256 r; 24 bits: hi = (r + 128) >> 8,
          // mid = r - 256 hi; 16 bits: hi = r
          const __m256i r = _mm256_srai_epi32(_mm256_add_epi32(q, r128), 8);
          const __m256i hi = parts == SPLIT_PARTS ? _mm256_srai_epi32(_mm256_add_epi32(r, r128), 8) : r;
          const __m256i mid = _mm256_sub_epi32(r, _mm256_slli_epi32(hi, 8));
          const __m256i lo = _mm256_sub_epi32(q, _mm256_slli_epi32(r, 8));
          const int n = int(std::min<int64_t>(8, p1 - p));  // lanes past n are 0 (past K) and not stored
          shi = _mm256_add_epi32(shi, hi);
          slo = _mm256_add_epi32(slo, _mm256_sub_epi32(q, _mm256_sll_epi32(hi, _mm_cvtsi32_si128(sb))));
          const __m256i parts_v[3] = {hi, mid, lo};
          for (int k = 0; k < 3; ++k) {  // 8 int32 in [-128, 127] -> 8 bytes, in order
            const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(parts_v[k]), _mm256_extracti128_si256(parts_v[k], 1));
            _mm_store_si128(reinterpret_cast<__m128i*>(bytes[k]), _mm_packs_epi16(w16, w16));
          }
          put_split_run(out, in.chunk, parts, p, n, bytes[0], bytes[1], bytes[2]);
        }
        alignas(32) int32_t sums[2][8];  // integer sums: any order
        _mm256_store_si256(reinterpret_cast<__m256i*>(sums[0]), shi);
        _mm256_store_si256(reinterpret_cast<__m256i*>(sums[1]), slo);
        for (int j = 0; j < 8; ++j) xhi += sums[0][j], xlo += sums[1][j];
      }
      qsum[2 * i] = xhi;
      qsum[2 * i + 1] = xlo;
    }
  }
}

}  // namespace avx2
}  // namespace quill
