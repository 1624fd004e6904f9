// llama.cpp's K-quant arithmetic on AVX-512 VNNI (common.h I8Acts::gsuper): two-level weights (GGUF Q2_K-Q6_K)
// with one int8 activation scale per token and super-block.  Included by avx512_vnni.cpp only.
//
// vpdpbusd sums a segment's D in int32 as tile_i8 does; at the segment's end one vpmulld by the 16 rows'
// integer sub-scales adds it into A (common.h).  The zero point's and the mins' terms, sum_s c[s] X[s], take
// one vpdpwssd per two segments and token (X pairs fit int16; super_acts.h), and one float epilogue per
// super-block ends it, instead of a convert and three fma per segment.  Integer sums are exact in any order:
// the bits of the scalar twin (scalar.cpp gemm_i8_super).
#pragma once

#include <immintrin.h>

#include "kblock.h"
#include "simd512.h"

namespace quill {
namespace v512 {

// (a, b) as the int16 pair of every int32 lane (values within int16).
QUILL_INLINE __m512i pair16(__m512i a, __m512i b) {
  return _mm512_or_si512(_mm512_and_si512(a, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(b, 16));
}

// acc[m] += sum over segments s0 .. s0 + gps - 1 of c[s] * X[m0 + m, s], c the sub-values `sub` of row block nb.
template <int MT>
QUILL_INLINE void pair_terms(const void* sub, const Weights& w, const I8Acts& a, int nb, int s0, int m0,
                             __m512i* acc) {
  for (int s = s0; s < s0 + w.gps; s += 2) {
    const bool two = s + 1 < s0 + w.gps;
    const __m512i c = pair16(sub16(sub, w, nb, s), two ? sub16(sub, w, nb, s + 1) : _mm512_setzero_si512());
    QUILL_UNROLL for (int m = 0; m < MT; ++m) {
      const int32_t* x = a.qsum + int64_t(m0 + m) * w.nseg + s;
      acc[m] = _mm512_dpwssd_epi32(acc[m], c, _mm512_set1_epi32(int16_pair(x[0], two ? x[1] : 0)));
    }
  }
}

constexpr int SUPER_TOKENS = 6;  // tokens per tile
constexpr int PAIRED_SUPER_TOKENS = 32;  // from here two row blocks a pass share the activation broadcasts

// MT tokens x RB row blocks from nb x chunks [c0, c1) starting in segment s (kblock.h); per row block r and
// token m, the open segment's D in st[r][m].d, the open super-block's A in st[r][m].d2, the finished
// super-blocks' total in st[r][m].f (read and written at super-block ends only: no registers to spare).
template <int BITS, int MT, int RB>
void tile_super(const Weights& w, const I8Acts& a, int nb, int m0, int c0, int c1, int s,
                LaneState<int32_t>* const* st) {
  constexpr int CK = chunk_k(BITS);
  constexpr int CHAINS = RB * MT;
  constexpr int NA = CHAINS <= 2 ? 4 : (CHAINS <= 6 ? 2 : 1);  // int32 chains per (row block, token), as tile_i8
  constexpr int NSUB = BITS <= 3 ? 4 : 2;  // byte vectors per chunk
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int nsup = w.nseg / w.gps;
  const int32_t z = int32_t(w.zconst);
  __m512i acc[RB][MT][NA], sa[RB][MT];
  QUILL_UNROLL for (int r = 0; r < RB; ++r)
    QUILL_UNROLL for (int m = 0; m < MT; ++m) {
      acc[r][m][0] = _mm512_load_si512(st[r][m].d);
      QUILL_UNROLL for (int i = 1; i < NA; ++i) acc[r][m][i] = _mm512_setzero_si512();
      sa[r][m] = _mm512_load_si512(st[r][m].d2);
    }
  auto chunk = [&](int cc, auto parity) {
    constexpr int H = decltype(parity)::value;
    __m512i q[RB][4];
    QUILL_UNROLL for (int r = 0; r < RB; ++r) {
      const uint8_t* p = w.codes + (int64_t(nb + r) * w.kc + cc) * BLOCK_BYTES;
      _mm_prefetch(reinterpret_cast<const char*>(p + RB * PREFETCH_BYTES), _MM_HINT_T1);
      const __m512i v = _mm512_loadu_si512(p);
      if constexpr (BITS <= 3) {
        unpack_low<BITS>(v, BITS == 3 ? w.hplane + (int64_t(nb + r) * w.kc + cc) * plane_bytes(3) : nullptr, q[r]);
      } else {
        q[r][0] = _mm512_and_si512(v, low);
        q[r][1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        if constexpr (BITS == 5 || BITS == 6)
          add_high_bits<BITS>(w.hplane + (int64_t(nb + r) * w.kc + cc) * plane_bytes(BITS), q[r][0], q[r][1]);
      }
    }
    QUILL_UNROLL for (int m = 0; m < MT; ++m) {
      const int8_t* x = a.q + (m0 + m) * a.ld + int64_t(cc) * CK;
      QUILL_UNROLL for (int j = 0; j < NSUB; ++j) {
        const __m512i xb = bcast4(x + 4 * j);
        const int i = NA == 4 ? 2 * H + (j & 1) : (NA == 2 ? (j & 1) : 0);
        QUILL_UNROLL for (int r = 0; r < RB; ++r) acc[r][m][i] = _mm512_dpbusd_epi32(acc[r][m][i], q[r][j], xb);
      }
    }
  };
  using Even = std::integral_constant<int, 0>;
  using Odd = std::integral_constant<int, 1>;
  int left = w.gps - s % w.gps;  // segments of the open super-block from s on (no division per segment)
  for (int c = c0; c < c1; ++s) {
    const int end = std::min(c1, w.seg_end[s]);
    for (; c + 1 < end; c += 2) {
      chunk(c, Even{});
      chunk(c + 1, Odd{});
    }
    if (c < end) chunk(c, Even{});
    c = end;
    if (c != w.seg_end[s]) break;  // the segment continues in the next K block
    QUILL_UNROLL for (int r = 0; r < RB; ++r) {  // A += sc * D
      const __m512i sc = sub16(w.scales, w, nb + r, s);
      QUILL_UNROLL for (int m = 0; m < MT; ++m) {
        __m512i d = acc[r][m][0];
        QUILL_UNROLL for (int i = 1; i < NA; ++i) d = _mm512_add_epi32(d, acc[r][m][i]);
        sa[r][m] = _mm512_add_epi32(sa[r][m], _mm512_mullo_epi32(sc, d));
        QUILL_UNROLL for (int i = 0; i < NA; ++i) acc[r][m][i] = _mm512_setzero_si512();
      }
    }
    if (--left) continue;
    left = w.gps;
    const int s0 = s + 1 - w.gps, u = s0 / w.gps;  // super-block u ends
    QUILL_UNROLL for (int r = 0; r < RB; ++r) {
      const int64_t si = super_index(w, nb + r, s0, 0);
      __m512i t[MT];
      if (z != 0) {  // A -= z sum_s sc[s] X[s]
        QUILL_UNROLL for (int m = 0; m < MT; ++m) t[m] = _mm512_setzero_si512();
        pair_terms<MT>(w.scales, w, a, nb + r, s0, m0, t);
        QUILL_UNROLL for (int m = 0; m < MT; ++m)
          sa[r][m] = _mm512_sub_epi32(sa[r][m], _mm512_mullo_epi32(t[m], _mm512_set1_epi32(z)));
      }
      const __m512 ss = load16(w.super_scales, w.scale_dtype, si);
      QUILL_UNROLL for (int m = 0; m < MT; ++m) {
        const __m512 g = _mm512_set1_ps(a.gscale[int64_t(m0 + m) * nsup + u]);
        _mm512_store_ps(st[r][m].f, _mm512_fmadd_ps(_mm512_mul_ps(ss, g), _mm512_cvtepi32_ps(sa[r][m]),
                                                    _mm512_load_ps(st[r][m].f)));
        sa[r][m] = _mm512_setzero_si512();
      }
      if (w.offsets) {  // B = sum_s mn[s] X[s]
        QUILL_UNROLL for (int m = 0; m < MT; ++m) t[m] = _mm512_setzero_si512();
        pair_terms<MT>(w.offsets, w, a, nb + r, s0, m0, t);
        const __m512 so = load16(w.super_offsets, w.scale_dtype, si);
        QUILL_UNROLL for (int m = 0; m < MT; ++m) {
          const __m512 g = _mm512_set1_ps(a.gscale[int64_t(m0 + m) * nsup + u]);
          _mm512_store_ps(st[r][m].f, _mm512_fmadd_ps(_mm512_mul_ps(so, g), _mm512_cvtepi32_ps(t[m]),
                                                      _mm512_load_ps(st[r][m].f)));
        }
      }
    }
  }
  QUILL_UNROLL for (int r = 0; r < RB; ++r)
    QUILL_UNROLL for (int m = 0; m < MT; ++m) {
      __m512i d = acc[r][m][0];
      QUILL_UNROLL for (int i = 1; i < NA; ++i) d = _mm512_add_epi32(d, acc[r][m][i]);
      _mm512_store_si512(st[r][m].d, d);
      _mm512_store_si512(st[r][m].d2, sa[r][m]);
    }
}

// Row blocks [nb0, nb1) x all tokens: K blocks and token tiles as the other int8 kernels (kblock.h), two row
// blocks a pass from PAIRED_SUPER_TOKENS tokens.
template <int BITS>
void run_super(const Weights& w, const I8Acts& a, const Out& o, int nb0, int nb1) {
  auto tiles = [&](int mt, int rb, int nb, int m0, int c0, int c1, int s, LaneState<int32_t>* const* st) {
    by_tokens<SUPER_TOKENS>(mt, [&](auto tokens) {
      constexpr int MT = decltype(tokens)::value;
      if (rb == 2) return tile_super<BITS, MT, 2>(w, a, nb, m0, c0, c1, s, st);
      tile_super<BITS, MT, 1>(w, a, nb, m0, c0, c1, s, st);
    });
  };
  auto finish = [&](int nb, int m, const LaneState<int32_t>& st) { store_int(w, a, o, nb, m, _mm512_load_ps(st.f)); };
  if (a.m < PAIRED_SUPER_TOKENS)
    return run_kblocked<int32_t, 1, decltype(tiles), decltype(finish), SUPER_TOKENS>(w, a.m, nb0, nb1, tiles, finish);
  run_kblocked<int32_t, 2, decltype(tiles), decltype(finish), SUPER_TOKENS>(w, a.m, nb0, nb1, tiles, finish);
}

}  // namespace v512
}  // namespace quill
