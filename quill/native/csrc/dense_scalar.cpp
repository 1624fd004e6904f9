// The dense 16-bit kernel (dense_tile.h) one lane at a time: the twin every SIMD variant
// must match bit for bit (std::fma rounds once, as vfmadd does).
#include <cmath>

#include "dense_tile.h"

namespace quill {
namespace {

struct VScalar {
  float v[LANES];
  static VScalar zero() { return {}; }
  static VScalar fma(const VScalar& w, float x, const VScalar& acc) {
    VScalar r;
    for (int l = 0; l < LANES; ++l) r.v[l] = std::fma(w.v[l], x, acc.v[l]);
    return r;
  }
  static VScalar add(const VScalar& a, const VScalar& b) {
    VScalar r;
    for (int l = 0; l < LANES; ++l) r.v[l] = a.v[l] + b.v[l];
    return r;
  }
  static void store(const VScalar& a, float* out) {
    for (int l = 0; l < LANES; ++l) out[l] = a.v[l];
  }
  template <bool F16>
  static void pair(const uint16_t* blk, VScalar& even, VScalar& odd) {
    const DType t = F16 ? DType::F16 : DType::BF16;
    for (int l = 0; l < LANES; ++l) {
      even.v[l] = to_float(blk, t, 2 * l);
      odd.v[l] = to_float(blk, t, 2 * l + 1);
    }
  }
};

}  // namespace

DenseGemm dense_gemm_scalar() { return dense::run<VScalar>; }

}  // namespace quill
