// The MXFP4 kernels (mxfp4.h) written once over a 16-lane vector type V (lane = output row),
// instantiated by mxfp4_scalar.cpp, mxfp4_avx2.cpp (mxfp4_v256.h) and mxfp4_avx512.cpp
// (mxfp4_v512.h).  V provides:
//
//   V::zero(), V::fma(a, float b, acc) = acc + a * b and V::fmav(a, b, acc) (one rounding),
//   V::add(a, b), V::mul(a, float b), V::store(v, float[16]),
//   V::Q V::quad(codes[64]): one quad of a group (mxfp4.h: 16 rows x 4 columns) loaded, and
//   V::column<b>(Q, lo, hi): its 16 lanes' kv values (float) of columns 4 jj + b and 4 jj + b + 16
//     (one column at a time: the AVX2 type has 16 ymm registers for the decoded values and sums),
//   V::scale(e[16]): 2^(e - 128) per lane,
//   V::I: 16 int32 sums; V::group_i8<T>(codes[256], q[T], qsum[T], d[T]): per token t, the exact
//     d[t] = sum_j kv[code of column j] * q[t][j] over the group's 32 columns (q[t] its 32 int8
//     activations, qsum[t] their sum), in any order (an exact integer),
//   V::cvt(I) -> V.
//
// The float sums keep one order (per lane: columns 0..15 into one chain, 16..31 into another, each in
// column order), so every variant returns the same bits; the int8 sums are exact, so their order is free.
#pragma once

#include <algorithm>

#include "mxfp4.h"
#include "scalar_util.h"

namespace quill {
namespace mx {

constexpr int MT = 4;  // tokens per tile: their sums share one decode of the codes

template <class V>
void store_tile(const Mxfp4Weights& w, const Out& o, int nb, int m0, int mt, const V* acc) {
  for (int m = 0; m < mt; ++m) {
    alignas(64) float f[LANES];
    V::store(acc[m], f);
    for (int l = 0; l < LANES && nb * LANES + l < w.n; ++l) {
      const int n = nb * LANES + l;
      store_value(o, m0 + m, n, w.bias ? f[l] + w.bias[n] : f[l]);
    }
  }
}

// Column k0 + B (and k0 + B + 16) of one quad into T tokens' two chains, plo / phi.
template <class V, int T, int B>
QUILL_INLINE void column(const typename V::Q& quad, const Mxfp4Acts& a, int m0, int64_t k0, V* plo, V* phi) {
  V lo, hi;
  V::template column<B>(quad, lo, hi);
  QUILL_UNROLL for (int m = 0; m < T; ++m) {
    const float* x = a.x + (m0 + m) * a.ld + k0 + B;
    plo[m] = V::fma(lo, x[0], plo[m]);
    phi[m] = V::fma(hi, x[16], phi[m]);
  }
}

// Tokens m0 .. m0 + T of row block nb, float activations.
template <class V, int T>
void tile_f32(const Mxfp4Weights& w, const Mxfp4Acts& a, const Out& o, int nb, int m0) {
  V acc[T];
  QUILL_UNROLL for (int m = 0; m < T; ++m) acc[m] = V::zero();
  const uint8_t* codes = w.codes + int64_t(nb) * w.groups * MX_GROUP_BYTES;
  const uint8_t* scales = w.scales + int64_t(nb) * w.groups * LANES;
  for (int g = 0; g < w.groups; ++g) {
    V plo[T], phi[T];  // columns 0..15 / 16..31 of the group, each summed in column order
    QUILL_UNROLL for (int m = 0; m < T; ++m) plo[m] = phi[m] = V::zero();
    const uint8_t* blk = codes + int64_t(g) * MX_GROUP_BYTES;
    __builtin_prefetch(blk + PREFETCH_BYTES, 0, 2);
    _Pragma("GCC unroll 1") for (int jj = 0; jj < 4; ++jj) {  // unrolled, gcc spilled the AVX2 sums
      const typename V::Q quad = V::quad(blk + MX_QUAD_BYTES * jj);
      column<V, T, 0>(quad, a, m0, MX_GROUP * g + 4 * jj, plo, phi);
      column<V, T, 1>(quad, a, m0, MX_GROUP * g + 4 * jj, plo, phi);
      column<V, T, 2>(quad, a, m0, MX_GROUP * g + 4 * jj, plo, phi);
      column<V, T, 3>(quad, a, m0, MX_GROUP * g + 4 * jj, plo, phi);
    }
    const V s = V::scale(scales + g * LANES);
    QUILL_UNROLL for (int m = 0; m < T; ++m) acc[m] = V::fmav(V::add(plo[m], phi[m]), s, acc[m]);
  }
  store_tile(w, o, nb, m0, T, acc);
}

// Tokens m0 .. m0 + T of row block nb, int8 activations (one scale per token and group).
template <class V, int T>
void tile_i8(const Mxfp4Weights& w, const Mxfp4Acts& a, const Out& o, int nb, int m0) {
  V acc[T];
  QUILL_UNROLL for (int m = 0; m < T; ++m) acc[m] = V::zero();
  const uint8_t* codes = w.codes + int64_t(nb) * w.groups * MX_GROUP_BYTES;
  const uint8_t* scales = w.scales + int64_t(nb) * w.groups * LANES;
  for (int g = 0; g < w.groups; ++g) {
    const uint8_t* blk = codes + int64_t(g) * MX_GROUP_BYTES;
    __builtin_prefetch(blk + PREFETCH_BYTES, 0, 2);
    const int8_t* q[T];   // each token's 32 activations of group g
    int32_t qsum[T];      // and their sum
    float gs[T];          // and their scale
    QUILL_UNROLL for (int m = 0; m < T; ++m) {
      const int64_t i = int64_t(m0 + m) * w.groups + g;
      q[m] = a.q + (m0 + m) * a.ld + MX_GROUP * g;
      qsum[m] = a.qsum[i];
      gs[m] = a.gscale[i];
    }
    typename V::I d[T];
    V::template group_i8<T>(blk, q, qsum, d);
    const V s = V::scale(scales + g * LANES);
    QUILL_UNROLL for (int m = 0; m < T; ++m) acc[m] = V::fmav(V::mul(V::cvt(d[m]), gs[m]), s, acc[m]);
  }
  store_tile(w, o, nb, m0, T, acc);
}

template <class V, bool I8>
void gemm(const Mxfp4Weights& w, const Mxfp4Acts& a, const Out& o, int nb0, int nb1) {
  for (int nb = nb0; nb < nb1; ++nb)
    for (int m0 = 0; m0 < a.m; m0 += MT) {
      switch (std::min(MT, a.m - m0)) {
        case 1: I8 ? tile_i8<V, 1>(w, a, o, nb, m0) : tile_f32<V, 1>(w, a, o, nb, m0); break;
        case 2: I8 ? tile_i8<V, 2>(w, a, o, nb, m0) : tile_f32<V, 2>(w, a, o, nb, m0); break;
        case 3: I8 ? tile_i8<V, 3>(w, a, o, nb, m0) : tile_f32<V, 3>(w, a, o, nb, m0); break;
        default: I8 ? tile_i8<V, 4>(w, a, o, nb, m0) : tile_f32<V, 4>(w, a, o, nb, m0); break;
      }
    }
}

template <class V>
const Mxfp4Kernels& kernels() {
  static const Mxfp4Kernels k{gemm<V, false>, gemm<V, true>};
  return k;
}

}  // namespace mx
}  // namespace quill
