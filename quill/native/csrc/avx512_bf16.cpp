// W4A16 / W8A16 on AVX-512 BF16 (vdpbf16ps).  Compiled with -mavx512f -mavx512bw
// -mavx512vl -mavx512bf16 only; called only when the CPU has all of them.
//
// One 64-byte block holds 32 code words of 16 bits (lane r owns words 2r, 2r+1),
// four nibbles each.  Nibble t of every word becomes a bf16 number through one
// vpermw (a 16-entry table, duplicated so the bit above the nibble is ignored);
// vdpbf16ps then multiplies word pair (2r, 2r+1) of lane r with the activation
// pair the stream holds for nibble t (stream.cpp) and adds both products to
// lane r.  Codes enter as exact small integers; the zero point and scale are
// applied per segment (common.h), so activations stay float (bf16 exactly, or
// float32 split into bf16 hi + lo).
#include <immintrin.h>

#include "simd512.h"

namespace quill {
namespace {

using v512::SegConsts;

inline __m512i nibble_table() {
  // bf16 bit patterns of 0..15, twice (vpermw indexes 32 words with 5 bits)
  return _mm512_set_epi16(0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0,
                          0x4080, 0x4040, 0x4000, 0x3F80, 0x0000, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120,
                          0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000);
}

inline __m512bh bcast_pair(const uint16_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

// MT tokens x one row block: y[m0 .. m0+MT, rows of nb].  NA accumulators per
// token keep enough vdpbf16ps chains in flight when MT is small.
template <int MT, bool SPLIT>
void tile(const Weights& w, const Bf16Acts& a, const Out& o, int nb, int m0) {
  constexpr int WORDS = SPLIT ? 16 : 8;  // stream words per chunk
  constexpr int DOTS = SPLIT ? 8 : 4;    // vdpbf16ps per chunk and token
  constexpr int NA = MT == 1 ? DOTS : (MT == 2 ? 4 : (MT <= 4 ? 2 : 1));
  const __m512i lut = nibble_table();
  const uint8_t* blocks = w.codes + int64_t(nb) * w.kc * BLOCK_BYTES;  // [KC, 64]
  const uint16_t* xs[MT];
  __m512 f[MT];
  for (int m = 0; m < MT; ++m) {
    xs[m] = a.x + (m0 + m) * a.ld;  // [KC, WORDS]
    f[m] = _mm512_setzero_ps();
  }
  for (int s = 0, c0 = 0; s < w.nseg; c0 = w.seg_end[s++]) {
    __m512 acc[MT][NA];
    for (int m = 0; m < MT; ++m)
      for (int i = 0; i < NA; ++i) acc[m][i] = _mm512_setzero_ps();
    for (int c = c0, c1 = w.seg_end[s]; c < c1; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(blocks + int64_t(c + 16) * BLOCK_BYTES), _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(blocks + int64_t(c) * BLOCK_BYTES);
      const __m512bh q[4] = {
          (__m512bh)_mm512_permutexvar_epi16(v, lut), (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), lut),
          (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 8), lut),
          (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 12), lut)};
      for (int m = 0; m < MT; ++m) {
        const uint16_t* x = xs[m] + int64_t(c) * WORDS;
        for (int d = 0; d < DOTS; ++d)
          acc[m][d % NA] = _mm512_dpbf16_ps(acc[m][d % NA], q[d % 4], bcast_pair(x + 2 * d));
      }
    }
    const SegConsts sc = v512::seg_consts(w, nb, s);
    for (int m = 0; m < MT; ++m) {
      __m512 d = acc[m][0];
      for (int i = 1; i < NA; ++i) d = _mm512_add_ps(d, acc[m][i]);
      f[m] = v512::epilogue(sc, d, _mm512_set1_ps(a.xsum[(m0 + m) * w.nseg + s]), f[m]);
    }
  }
  for (int m = 0; m < MT; ++m) v512::store_float(w, o, nb, m0 + m, f[m]);
}

template <bool SPLIT>
void run(const Weights& w, const Bf16Acts& a, const Out& o, int nb0, int nb1) {
  constexpr int MT_MAX = 6;
  for (int nb = nb0; nb < nb1; ++nb) {
    for (int m0 = 0; m0 < a.m;) {
      switch (a.m - m0 >= MT_MAX ? MT_MAX : a.m - m0) {
        case 1: tile<1, SPLIT>(w, a, o, nb, m0); m0 += 1; break;
        case 2: tile<2, SPLIT>(w, a, o, nb, m0); m0 += 2; break;
        case 3: tile<3, SPLIT>(w, a, o, nb, m0); m0 += 3; break;
        case 4: tile<4, SPLIT>(w, a, o, nb, m0); m0 += 4; break;
        case 5: tile<5, SPLIT>(w, a, o, nb, m0); m0 += 5; break;
        default: tile<6, SPLIT>(w, a, o, nb, m0); m0 += 6; break;
      }
    }
  }
}

}  // namespace

void gemm_bf16_avx512(const Weights& w, const Bf16Acts& a, const Out& o, int nb0, int nb1) {
  if (a.split)
    run<true>(w, a, o, nb0, nb1);
  else
    run<false>(w, a, o, nb0, nb1);
}

}  // namespace quill
