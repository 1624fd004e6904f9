// The MXFP4 kernels (mxfp4.h) written once over a 16-lane vector type V (lane = output row),
// instantiated by mxfp4_scalar.cpp, mxfp4_avx2.cpp and mxfp4_avx512.cpp.  V provides:
//
//   V::zero(), V::fma(a, float b, acc) = acc + a * b and V::fmav(a, b, acc) (one rounding),
//   V::add(a, b), V::mul(a, float b), V::store(v, float[16]),
//   V::decode(bytes[16], lo, hi): the 16 lanes' kv values (float) of the low / high nibbles,
//   V::scale(e[16]): 2^(e - 128) per lane,
//   V::W / V::I: decoded codes for integer dot products / 16 int32 accumulators:
//   V::wdecode(bytes[16]) -> W, V::izero(), V::idot(W, int8 a, int8 b, I) = I + lo * a + hi * b,
//   V::cvt(I) -> V.
//
// Every lane performs the same operations in the same order whatever the variant.
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

template <class V, int T>
void tile_f32(const Mxfp4Weights& w, const Mxfp4Acts& a, const Out& o, int nb, int m0) {
  V acc[T];
  QUILL_UNROLL for (int m = 0; m < T; ++m) acc[m] = V::zero();
  const uint8_t* codes = w.codes + int64_t(nb) * w.groups * 256;
  const uint8_t* scales = w.scales + int64_t(nb) * w.groups * LANES;
  for (int g = 0; g < w.groups; ++g) {
    V plo[T], phi[T];
    QUILL_UNROLL for (int m = 0; m < T; ++m) plo[m] = phi[m] = V::zero();
    const uint8_t* blk = codes + int64_t(g) * 256;
    __builtin_prefetch(blk + PREFETCH_BYTES, 0, 2);
    for (int j = 0; j < 16; ++j) {
      V lo, hi;
      V::decode(blk + 16 * j, lo, hi);
      QUILL_UNROLL for (int m = 0; m < T; ++m) {
        const float* x = a.x + (m0 + m) * a.ld + MX_GROUP * g + j;
        plo[m] = V::fma(lo, x[0], plo[m]);
        phi[m] = V::fma(hi, x[16], phi[m]);
      }
    }
    const V s = V::scale(scales + g * LANES);
    QUILL_UNROLL for (int m = 0; m < T; ++m) acc[m] = V::fmav(V::add(plo[m], phi[m]), s, acc[m]);
  }
  store_tile(w, o, nb, m0, T, acc);
}

template <class V, int T>
void tile_i8(const Mxfp4Weights& w, const Mxfp4Acts& a, const Out& o, int nb, int m0) {
  V acc[T];
  QUILL_UNROLL for (int m = 0; m < T; ++m) acc[m] = V::zero();
  const uint8_t* codes = w.codes + int64_t(nb) * w.groups * 256;
  const uint8_t* scales = w.scales + int64_t(nb) * w.groups * LANES;
  for (int g = 0; g < w.groups; ++g) {
    typename V::I d[T];
    QUILL_UNROLL for (int m = 0; m < T; ++m) d[m] = V::izero();
    const uint8_t* blk = codes + int64_t(g) * 256;
    __builtin_prefetch(blk + PREFETCH_BYTES, 0, 2);
    for (int j = 0; j < 16; ++j) {
      const typename V::W c = V::wdecode(blk + 16 * j);
      QUILL_UNROLL for (int m = 0; m < T; ++m) {
        const int8_t* q = a.q + (m0 + m) * a.ld + MX_GROUP * g + j;
        d[m] = V::idot(c, q[0], q[16], d[m]);
      }
    }
    const V s = V::scale(scales + g * LANES);
    QUILL_UNROLL for (int m = 0; m < T; ++m)
      acc[m] = V::fmav(V::mul(V::cvt(d[m]), a.gscale[int64_t(m0 + m) * w.groups + g]), s, acc[m]);
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
