// The MXFP4 kernels (mxfp4_tile.h) one lane at a time: the twin every SIMD variant must match
// bit for bit (std::fma rounds once, as vfmadd does).
#include <cmath>
#include <cstring>

#include "mxfp4_tile.h"

namespace quill {
namespace {

constexpr int8_t KV[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};  // kvalues_mxfp4

struct VScalar {
  float v[LANES];
  struct W {
    int32_t lo[LANES], hi[LANES];
  };
  struct I {
    int32_t v[LANES];
  };
  static VScalar zero() { return {}; }
  static VScalar fma(const VScalar& a, float b, const VScalar& acc) {
    VScalar r;
    for (int l = 0; l < LANES; ++l) r.v[l] = std::fma(a.v[l], b, acc.v[l]);
    return r;
  }
  static VScalar fmav(const VScalar& a, const VScalar& b, const VScalar& acc) {
    VScalar r;
    for (int l = 0; l < LANES; ++l) r.v[l] = std::fma(a.v[l], b.v[l], acc.v[l]);
    return r;
  }
  static VScalar add(const VScalar& a, const VScalar& b) {
    VScalar r;
    for (int l = 0; l < LANES; ++l) r.v[l] = a.v[l] + b.v[l];
    return r;
  }
  static VScalar mul(const VScalar& a, float b) {
    VScalar r;
    for (int l = 0; l < LANES; ++l) r.v[l] = a.v[l] * b;
    return r;
  }
  static void store(const VScalar& a, float* out) {
    for (int l = 0; l < LANES; ++l) out[l] = a.v[l];
  }
  static void decode(const uint8_t* b, VScalar& lo, VScalar& hi) {
    for (int l = 0; l < LANES; ++l) {
      lo.v[l] = float(KV[b[l] & 15]);
      hi.v[l] = float(KV[b[l] >> 4]);
    }
  }
  static VScalar scale(const uint8_t* e) {
    VScalar r;
    for (int l = 0; l < LANES; ++l) {
      const uint32_t bits = e8m0_half_bits(e[l]);
      std::memcpy(&r.v[l], &bits, 4);
    }
    return r;
  }
  static W wdecode(const uint8_t* b) {
    W w;
    for (int l = 0; l < LANES; ++l) {
      w.lo[l] = KV[b[l] & 15];
      w.hi[l] = KV[b[l] >> 4];
    }
    return w;
  }
  static I izero() { return {}; }
  static I idot(const W& w, int8_t a, int8_t b, const I& acc) {
    I r;
    for (int l = 0; l < LANES; ++l) r.v[l] = acc.v[l] + w.lo[l] * a + w.hi[l] * b;
    return r;
  }
  static VScalar cvt(const I& d) {
    VScalar r;
    for (int l = 0; l < LANES; ++l) r.v[l] = float(d.v[l]);
    return r;
  }
};

}  // namespace

const Mxfp4Kernels& mxfp4_scalar() { return mx::kernels<VScalar>(); }

}  // namespace quill
