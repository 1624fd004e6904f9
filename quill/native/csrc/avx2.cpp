// The AVX2 + FMA + F16C baseline: every kernel family, 8 lanes per register, a
// 16-row block as two halves (rows 0-7 are bytes 0-31 of a block, rows 8-15
// bytes 32-63).  Compiled with -mavx2 -mfma -mf16c only.
//
// vpmaddubsw multiplies unsigned code bytes with signed activation bytes into
// int16 pairs (no saturation: codes are split into nibbles, so |pair| <= 2 * 15 *
// 128), vpmaddwd widens them to int32 exactly, weighting each pair sum (the high
// nibble of 8-bit codes by 16, the hi part of split float activations by 256).
// int8 activations (W4A8, W8A8) are one part; float activations (W4A16, W8A16) are
// their split fixed-point image (common.h SplitActs), two parts.
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

// f += (scale * xscale) * (d - zero * x) [+ (offset * xscale) * x] for lanes 8h..8h+7 (split_epilogue).
inline __m256 epilogue_split(const Weights& w, int nb, int s, int h, __m256 d, __m256 x, __m256 xscale, __m256 f) {
  const int64_t i = seg_index(w, nb, s, 8 * h);
  __m256 z;
  if (!w.zeros)
    z = _mm256_set1_ps(w.zconst);
  else if (w.bits == 4)
    z = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(w.zeros) + i))));
  else
    z = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int16_t*>(w.zeros) + i))));
  const __m256 t = _mm256_fnmadd_ps(z, x, d);
  f = _mm256_fmadd_ps(_mm256_mul_ps(load8(w.scales, w.scale_dtype, i), xscale), t, f);
  if (w.offsets) f = _mm256_fmadd_ps(_mm256_mul_ps(load8(w.offsets, w.scale_dtype, i), xscale), x, f);
  return f;
}

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

inline const int8_t* stream_of(const I8Acts& a) { return a.q; }
inline const int8_t* stream_of(const SplitActs& a) { return a.x; }

// MT tokens x one row block, all of K.  PARTS = 1: int8 activations; PARTS = 2: the
// split image of float activations, whose hi part enters vpmaddwd with weight 256, so
// one int32 accumulator per token and half holds D = 256 * sum(code * hi) + sum(code * lo).
template <int BITS, int PARTS, int MT, class Acts>
void tile(const Weights& w, const Acts& a, const Out& o, int nb, int m0) {
  constexpr int CK = chunk_k(BITS), STRIDE = PARTS * CK;
  const __m256i low = _mm256_set1_epi8(0x0F);
  // vpmaddwd weights of the int16 pair sums: [part][nibble] (8-bit codes = 16 * high nibble + low)
  const __m256i wt[2][2] = {{_mm256_set1_epi16(PARTS == 2 ? 256 : 1), _mm256_set1_epi16(PARTS == 2 ? 4096 : 16)},
                            {_mm256_set1_epi16(1), _mm256_set1_epi16(16)}};
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
          const int8_t* x = stream_of(a) + (m0 + m) * a.ld + int64_t(c) * STRIDE;
          __m256i d = _mm256_setzero_si256();
          for (int p = 0; p < PARTS; ++p) {
            const int8_t* xp = x + p * CK;
            if (BITS == 4) {  // positions 8c..8c+3 in the low nibbles, 8c+4..8c+7 in the high ones (|pair| <= 3840)
              const __m256i q = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(xp)), _mm256_maddubs_epi16(hi, bcast4(xp + 4)));
              d = _mm256_add_epi32(d, _mm256_madd_epi16(q, wt[p][0]));
            } else {  // code = 16 * hi + lo at positions 4c..4c+3
              const __m256i xa = bcast4(xp);
              d = _mm256_add_epi32(d, _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, xa), wt[p][0]),
                                                       _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xa), wt[p][1])));
            }
          }
          acc[m][h] = _mm256_add_epi32(acc[m][h], d);
        }
      }
    }
    for (int m = 0; m < MT; ++m) {
      const int64_t i = int64_t(m0 + m) * w.nseg + s;
      const __m256 x = _mm256_set1_ps(float(a.qsum[i]));
      for (int h = 0; h < 2; ++h) {
        const __m256 d = _mm256_cvtepi32_ps(acc[m][h]), fo = _mm256_load_ps(f[m] + 8 * h);
        __m256 fn;
        if constexpr (PARTS == 1) fn = epilogue(w, nb, s, h, d, x, fo);
        else fn = epilogue_split(w, nb, s, h, d, x, _mm256_set1_ps(a.scale[i]), fo);
        _mm256_store_ps(f[m] + 8 * h, fn);
      }
    }
  }
  for (int m = 0; m < MT; ++m) {
    if constexpr (PARTS == 1) store_int_row(w, a, o, nb, m0 + m, f[m]);
    else store_float_row(w, o, nb, m0 + m, f[m]);
  }
}

// Row blocks [nb0, nb1) x all tokens in tiles of up to 4 tokens.
template <int BITS, int PARTS, class Acts>
void run(const Weights& w, const Acts& a, const Out& o, int nb0, int nb1) {
  for (int nb = nb0; nb < nb1; ++nb)
    for (int m0 = 0; m0 < a.m;) {
      const int left = a.m - m0;
      if (left >= 4) { tile<BITS, PARTS, 4>(w, a, o, nb, m0); m0 += 4; }
      else if (left == 3) { tile<BITS, PARTS, 3>(w, a, o, nb, m0); m0 += 3; }
      else if (left == 2) { tile<BITS, PARTS, 2>(w, a, o, nb, m0); m0 += 2; }
      else { tile<BITS, PARTS, 1>(w, a, o, nb, m0); m0 += 1; }
    }
}

void gemm_split(const Weights& w, const SplitActs& a, const Out& o, int nb0, int nb1) {
  if (w.bits == 4) run<4, 2>(w, a, o, nb0, nb1);
  else run<8, 2>(w, a, o, nb0, nb1);
}

void gemm_i8(const Weights& w, const I8Acts& a, const Out& o, int nb0, int nb1) {
  if (w.bits == 4) run<4, 1>(w, a, o, nb0, nb1);
  else run<8, 1>(w, a, o, nb0, nb1);
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

// 8 values of token row `row` from position p; positions at or past `real` read as 0.
inline __m256 load_x8_upto(const RawX& in, const void* row, int64_t p, int64_t real) {
  if (p + 8 <= real) return load_x8(in, row, p);
  alignas(32) float t[8] = {};
  for (int64_t j = p; j < real; ++j) t[j - p] = to_float(row, in.dtype, j);
  return _mm256_load_ps(t);
}

// The split stream of tokens [m0, m1) (quantize_split in scalar.cpp), 8 positions a step;
// identity order (the binding gathers act-order first).
void quantize_split(const RawX& in, int8_t* xs, int32_t* qsum, float* scale, int m0, int m1) {
  const int esize = in.dtype == DType::F32 ? 4 : 2;
  const __m256i absmask = _mm256_set1_epi32(0x7FFFFFFF), half = _mm256_set1_epi32(128);
  const __m256 qmin = _mm256_set1_ps(-SPLIT_QMAX), qmax = _mm256_set1_ps(SPLIT_QMAX);
  for (int m = m0; m < m1; ++m) {
    const void* row = static_cast<const char*>(in.x) + m * in.k * esize;  // [K]
    int8_t* out = xs + m * in.kp * 2;  // [KC, 2 * CK]
    for (int s = 0, p0 = 0; s < in.nseg; p0 = in.seg_end[s++] * in.chunk) {
      const int64_t p1 = int64_t(in.seg_end[s]) * in.chunk, real = std::min<int64_t>(p1, in.k);
      __m256i vmax = _mm256_setzero_si256();
      for (int64_t p = p0; p < real; p += 8)
        vmax = _mm256_max_epu32(vmax, _mm256_and_si256(_mm256_castps_si256(load_x8_upto(in, row, p, real)), absmask));
      alignas(32) uint32_t lanes[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), vmax);
      const SplitParams sp = split_params(*std::max_element(lanes, lanes + 8));
      const int64_t i = int64_t(m) * in.nseg + s;
      scale[i] = sp.scale;
      if (!sp.finite) {
        std::fill(out + 2 * p0, out + 2 * p1, int8_t(0));
        qsum[i] = 0;
        continue;
      }
      const __m256 pre = _mm256_set1_ps(sp.pre), inv = _mm256_set1_ps(sp.inv);
      __m256i sum = _mm256_setzero_si256();
      for (int64_t p = p0; p < p1; p += 8) {
        const __m256 v = load_x8_upto(in, row, p, real);
        const __m256 t = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_mul_ps(v, pre), inv), qmin), qmax);
        const __m256i q = _mm256_cvtps_epi32(t);  // ties to even
        sum = _mm256_add_epi32(sum, q);
        // int16 [h0-3 l0-3 | h4-7 l4-7] -> bytes, qwords 0 and 2: h0-3 l0-3 h4-7 l4-7 (no saturation:
        // hi, lo in [-128, 127]); split_hi / split_lo
        const __m256i hi = _mm256_srai_epi32(_mm256_add_epi32(q, half), 8);
        const __m256i w16 = _mm256_packs_epi32(hi, _mm256_sub_epi32(q, _mm256_slli_epi32(hi, 8)));
        __m128i b = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packs_epi16(w16, w16), 0x08));
        if (in.chunk == 8) b = _mm_shuffle_epi32(b, 0xD8);  // one chunk: h0-7 l0-7
        if (p + 8 <= p1) _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * p), b);
        else _mm_storel_epi64(reinterpret_cast<__m128i*>(out + 2 * p), b);  // a last 4-position chunk
      }
      alignas(32) int32_t parts[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(parts), sum);
      int32_t total = 0;
      for (int j = 0; j < 8; ++j) total += parts[j];
      qsum[i] = total;
    }
  }
}

}  // namespace

const KernelTable& table_avx2() {
  static const KernelTable t{"avx2", gemm_split, gemm_i8, quantize, quantize_split};
  return t;
}

}  // namespace quill
