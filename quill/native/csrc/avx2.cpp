// The AVX2 + FMA + F16C baseline: every kernel family, 8 lanes per register, a
// 16-row block as two halves (rows 0-7 are bytes 0-31 of a block, rows 8-15
// bytes 32-63).  Compiled with -mavx2 -mfma -mf16c only.
//
// Float: lane r's 32-bit word holds its codes at 4 (8-bit) or 8 (4-bit) stream
// positions; each is shifted down, masked, converted and FMA'd with the
// broadcast activation.  Int8: vpmaddubsw multiplies unsigned code bytes with
// signed activation bytes into int16 pairs (no saturation: codes are split into
// nibbles, so |pair| <= 2 * 15 * 128), vpmaddwd widens to int32 exactly.
#include <immintrin.h>

#include "scalar_util.h"

namespace quill {
namespace {

inline __m256 load8(const void* p, DType t, int64_t i) {
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

// f += scale * (d - zero * x) [+ offset * x] for lanes 8h..8h+7 of segment s (seg_epilogue).
inline __m256 epilogue(const Weights& w, int nb, int s, int h, __m256 d, __m256 x, __m256 f) {
  const int64_t i = seg_index(w, nb, s, 8 * h);
  __m256 z;
  if (!w.zeros)
    z = _mm256_set1_ps(w.zconst);
  else if (w.bits == 4)
    z = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(w.zeros) + i))));
  else
    z = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int16_t*>(w.zeros) + i))));
  const __m256 t = _mm256_fnmadd_ps(z, x, d);
  f = _mm256_fmadd_ps(load8(w.scales, w.scale_dtype, i), t, f);
  if (w.offsets) f = _mm256_fmadd_ps(load8(w.offsets, w.scale_dtype, i), x, f);
  return f;
}

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Stream position of value t (bit offset BITS * t) inside a chunk: 4-bit byte b
// holds positions b (low nibble) and b + 4 (high nibble).
constexpr int position(int bits, int t) { return bits == 8 ? t : (t % 2 ? t / 2 + 4 : t / 2); }

template <int BITS, int MT>
void tile_f32(const Weights& w, const F32Acts& a, const Out& o, int nb, int m0) {
  constexpr int CK = chunk_k(BITS), NV = 32 / BITS;
  constexpr int NA = MT == 1 ? 4 : (MT == 2 ? 2 : 1);
  const __m256i mask = _mm256_set1_epi32((1 << BITS) - 1);
  const uint8_t* blocks = w.codes + int64_t(nb) * w.kc * BLOCK_BYTES;  // [KC, 64]
  alignas(32) float f[MT][LANES] = {};
  for (int s = 0, c0 = 0; s < w.nseg; c0 = w.seg_end[s++]) {
    __m256 acc[MT][2][NA];
    for (int m = 0; m < MT; ++m)
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < NA; ++i) acc[m][h][i] = _mm256_setzero_ps();
    for (int c = c0, c1 = w.seg_end[s]; c < c1; ++c) {
      const uint8_t* blk = blocks + int64_t(c) * BLOCK_BYTES;
      _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH_BYTES), _MM_HINT_T1);  // see common.h
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32));
      for (int t = 0; t < NV; ++t) {
        const __m256 w0 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v0, BITS * t), mask));
        const __m256 w1 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v1, BITS * t), mask));
        for (int m = 0; m < MT; ++m) {
          const __m256 x = _mm256_broadcast_ss(a.x + (m0 + m) * a.ld + int64_t(c) * CK + position(BITS, t));
          acc[m][0][t % NA] = _mm256_fmadd_ps(w0, x, acc[m][0][t % NA]);
          acc[m][1][t % NA] = _mm256_fmadd_ps(w1, x, acc[m][1][t % NA]);
        }
      }
    }
    for (int m = 0; m < MT; ++m) {
      const __m256 x = _mm256_set1_ps(a.xsum[(m0 + m) * w.nseg + s]);
      for (int h = 0; h < 2; ++h) {
        __m256 d = acc[m][h][0];
        for (int i = 1; i < NA; ++i) d = _mm256_add_ps(d, acc[m][h][i]);
        _mm256_store_ps(f[m] + 8 * h, epilogue(w, nb, s, h, d, x, _mm256_load_ps(f[m] + 8 * h)));
      }
    }
  }
  for (int m = 0; m < MT; ++m) store_float_row(w, o, nb, m0 + m, f[m]);
}

template <int BITS, int MT>
void tile_i8(const Weights& w, const I8Acts& a, const Out& o, int nb, int m0) {
  constexpr int CK = chunk_k(BITS);
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16);
  const uint8_t* blocks = w.codes + int64_t(nb) * w.kc * BLOCK_BYTES;  // [KC, 64]
  alignas(32) float f[MT][LANES] = {};
  for (int s = 0, c0 = 0; s < w.nseg; c0 = w.seg_end[s++]) {
    __m256i acc[MT][2];
    for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
    for (int c = c0, c1 = w.seg_end[s]; c < c1; ++c) {
      const uint8_t* blk = blocks + int64_t(c) * BLOCK_BYTES;
      _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH_BYTES), _MM_HINT_T1);  // see common.h
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * h));
        const __m256i lo = _mm256_and_si256(v, low);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int m = 0; m < MT; ++m) {
          const int8_t* x = a.q + (m0 + m) * a.ld + int64_t(c) * CK;
          __m256i d;
          if (BITS == 4) {  // positions 8c..8c+3 in the low nibbles, 8c+4..8c+7 in the high ones
            const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(x)), _mm256_maddubs_epi16(hi, bcast4(x + 4)));
            d = _mm256_madd_epi16(p, ones);
          } else {  // code = 16 * hi + lo at positions 4c..4c+3
            const __m256i xa = bcast4(x);
            d = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, xa), ones),
                                 _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xa), sixteen));
          }
          acc[m][h] = _mm256_add_epi32(acc[m][h], d);
        }
      }
    }
    for (int m = 0; m < MT; ++m) {
      const __m256 x = _mm256_set1_ps(float(a.qsum[(m0 + m) * w.nseg + s]));
      for (int h = 0; h < 2; ++h)
        _mm256_store_ps(f[m] + 8 * h,
                        epilogue(w, nb, s, h, _mm256_cvtepi32_ps(acc[m][h]), x, _mm256_load_ps(f[m] + 8 * h)));
    }
  }
  for (int m = 0; m < MT; ++m) store_int_row(w, a, o, nb, m0 + m, f[m]);
}

// Row blocks [nb0, nb1) x all tokens in tiles of up to 4 tokens.
template <class Acts, void (*T1)(const Weights&, const Acts&, const Out&, int, int),
          void (*T2)(const Weights&, const Acts&, const Out&, int, int),
          void (*T3)(const Weights&, const Acts&, const Out&, int, int),
          void (*T4)(const Weights&, const Acts&, const Out&, int, int)>
void run(const Weights& w, const Acts& a, const Out& o, int nb0, int nb1) {
  for (int nb = nb0; nb < nb1; ++nb)
    for (int m0 = 0; m0 < a.m;) {
      const int left = a.m - m0;
      if (left >= 4) { T4(w, a, o, nb, m0); m0 += 4; }
      else if (left == 3) { T3(w, a, o, nb, m0); m0 += 3; }
      else if (left == 2) { T2(w, a, o, nb, m0); m0 += 2; }
      else { T1(w, a, o, nb, m0); m0 += 1; }
    }
}

void gemm_f32(const Weights& w, const F32Acts& a, const Out& o, int nb0, int nb1) {
  if (w.bits == 4)
    run<F32Acts, tile_f32<4, 1>, tile_f32<4, 2>, tile_f32<4, 3>, tile_f32<4, 4>>(w, a, o, nb0, nb1);
  else
    run<F32Acts, tile_f32<8, 1>, tile_f32<8, 2>, tile_f32<8, 3>, tile_f32<8, 4>>(w, a, o, nb0, nb1);
}

void gemm_i8(const Weights& w, const I8Acts& a, const Out& o, int nb0, int nb1) {
  if (w.bits == 4)
    run<I8Acts, tile_i8<4, 1>, tile_i8<4, 2>, tile_i8<4, 3>, tile_i8<4, 4>>(w, a, o, nb0, nb1);
  else
    run<I8Acts, tile_i8<8, 1>, tile_i8<8, 2>, tile_i8<8, 3>, tile_i8<8, 4>>(w, a, o, nb0, nb1);
}

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

void quantize(const RawX& in, const ActQuant& aq, int8_t* q, int32_t* qsum, float* scale, float* zero, int m0,
              int m1) {
  const int esize = in.dtype == DType::F32 ? 4 : 2;
  const int64_t kv = in.k / 8 * 8;  // vector part; the tail runs the scalar formula
  for (int m = m0; m < m1; ++m) {
    const void* row = static_cast<const char*>(in.x) + m * in.k * esize;  // [K]
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

}  // namespace

const KernelTable& table_avx2() {
  static const KernelTable t{"avx2", gemm_f32, nullptr, gemm_i8, quantize};
  return t;
}

}  // namespace quill
