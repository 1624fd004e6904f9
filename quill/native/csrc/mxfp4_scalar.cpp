// The MXFP4 kernels (mxfp4_tile.h) one lane at a time: the twin every SIMD variant must match
// bit for bit (std::fma rounds once, as vfmadd does).  Its int8 sum is the definition,
// sum_j kv[q_j] x8_j in column order, with signed codes (the SIMD ones bias them: the same integer).
#include <cmath>
#include <cstring>

#include "mxfp4_tile.h"

namespace quill {
namespace {

constexpr int8_t KV[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};  // kvalues_mxfp4

// The code byte of row (lane) r and column j (0..15: its low nibble; j + 16: its high nibble) of
// one group's 256 bytes [4 jj, 16 r, 4 b] (mxfp4.h).
inline uint8_t code_byte(const uint8_t* group, int r, int j) {
  return group[MX_QUAD_BYTES * (j / 4) + 4 * r + j % 4];
}

struct VScalar {
  float v[LANES];
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
  using Q = const uint8_t*;  // quad [16 r, 4 b]
  static Q quad(const uint8_t* codes) { return codes; }
  template <int B>  // kv of columns 4 jj + B and 4 jj + B + 16
  static void column(Q quad, VScalar& lo, VScalar& hi) {
    for (int l = 0; l < LANES; ++l) {
      lo.v[l] = float(KV[quad[4 * l + B] & 15]);
      hi.v[l] = float(KV[quad[4 * l + B] >> 4]);
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
  // group [256] codes, q[T] -> 32 int8 each: d[t] = sum_j kv[q_j] q[t][j] (qsum unused: no bias here)
  template <int T>
  static void group_i8(const uint8_t* group, const int8_t* const* q, const int32_t* /*qsum*/, I* d) {
    for (int t = 0; t < T; ++t)
      for (int l = 0; l < LANES; ++l) {
        int32_t s = 0;
        for (int j = 0; j < 16; ++j) {
          const uint8_t c = code_byte(group, l, j);
          s += KV[c & 15] * q[t][j] + KV[c >> 4] * q[t][j + 16];
        }
        d[t].v[l] = s;
      }
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
