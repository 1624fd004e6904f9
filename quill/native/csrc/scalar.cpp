// Scalar twins: the oracle of every SIMD kernel, and the kernels of CPUs without AVX2.
//
// Each function has the signature of its SIMD siblings and follows the layout
// comment in common.h literally, one lane (output row) at a time.  The int8
// kernel and the activation quantizer perform exactly the operations of the
// SIMD versions in the same order per lane, so they must agree bit for bit;
// the float kernels agree to float32 rounding.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

#include "scalar_util.h"

namespace quill {
namespace {

// Code of row r, stream position j (< chunk) of one 64-byte block.
inline int code_at(const uint8_t* blk, int bits, int r, int j) {
  if (bits == 8) return blk[4 * r + j];
  return j < 4 ? (blk[4 * r + j] & 0xF) : (blk[4 * r + j - 4] >> 4);
}

// D[r] of one segment for one token: float positions `xs` (stream order).
void seg_dot_f32(const Weights& w, const uint8_t* blocks, int c0, int c1, const float* xs, float* d) {
  const int ck = chunk_k(w.bits);
  for (int r = 0; r < LANES; ++r) d[r] = 0.0f;
  for (int c = c0; c < c1; ++c) {
    const uint8_t* blk = blocks + int64_t(c) * BLOCK_BYTES;
    for (int r = 0; r < LANES; ++r)
      for (int j = 0; j < ck; ++j) d[r] = std::fma(float(code_at(blk, w.bits, r, j)), xs[c * ck + j], d[r]);
  }
}

void gemm_f32(const Weights& w, const F32Acts& a, const Out& o, int nb0, int nb1) {
  float d[LANES], f[LANES];
  for (int nb = nb0; nb < nb1; ++nb) {
    const uint8_t* blocks = w.codes + int64_t(nb) * w.kc * BLOCK_BYTES;  // [KC, 64]
    for (int m = 0; m < a.m; ++m) {
      std::fill(f, f + LANES, 0.0f);
      for (int s = 0, c0 = 0; s < w.nseg; c0 = w.seg_end[s++]) {
        seg_dot_f32(w, blocks, c0, w.seg_end[s], a.x + m * a.ld, d);
        const float x = a.xsum[m * w.nseg + s];
        for (int r = 0; r < LANES; ++r) f[r] = seg_epilogue(w, nb, s, r, d[r], x, f[r]);
      }
      store_float_row(w, o, nb, m, f);
    }
  }
}

// bf16 stream: nibble position t of word (r, h) pairs with stream words 2t + h.
void gemm_bf16(const Weights& w, const Bf16Acts& a, const Out& o, int nb0, int nb1) {
  const int words = a.split ? 16 : 8;
  float d[LANES], f[LANES];
  for (int nb = nb0; nb < nb1; ++nb) {
    const uint8_t* blocks = w.codes + int64_t(nb) * w.kc * BLOCK_BYTES;
    for (int m = 0; m < a.m; ++m) {
      const uint16_t* xs = a.x + m * a.ld;  // [KC, words]
      std::fill(f, f + LANES, 0.0f);
      for (int s = 0, c0 = 0; s < w.nseg; c0 = w.seg_end[s++]) {
        std::fill(d, d + LANES, 0.0f);
        for (int c = c0; c < w.seg_end[s]; ++c) {
          const uint8_t* blk = blocks + int64_t(c) * BLOCK_BYTES;
          for (int r = 0; r < LANES; ++r)
            for (int h = 0; h < 2; ++h) {
              const int word = blk[4 * r + 2 * h] | (blk[4 * r + 2 * h + 1] << 8);
              for (int t = 0; t < 4; ++t) {
                const float q = float((word >> (4 * t)) & 0xF);
                for (int part = 0; part < words / 8; ++part)
                  d[r] = std::fma(q, bf16_to_f32(xs[c * words + 8 * part + 2 * t + h]), d[r]);
              }
            }
        }
        const float x = a.xsum[m * w.nseg + s];
        for (int r = 0; r < LANES; ++r) f[r] = seg_epilogue(w, nb, s, r, d[r], x, f[r]);
      }
      store_float_row(w, o, nb, m, f);
    }
  }
}

void gemm_i8(const Weights& w, const I8Acts& a, const Out& o, int nb0, int nb1) {
  const int ck = chunk_k(w.bits);
  float f[LANES];
  uint32_t d[LANES];  // int32 arithmetic with wrap-around, as the SIMD lanes do
  for (int nb = nb0; nb < nb1; ++nb) {
    const uint8_t* blocks = w.codes + int64_t(nb) * w.kc * BLOCK_BYTES;
    for (int m = 0; m < a.m; ++m) {
      const int8_t* q = a.q + m * a.ld;  // [Kp]
      std::fill(f, f + LANES, 0.0f);
      for (int s = 0, c0 = 0; s < w.nseg; c0 = w.seg_end[s++]) {
        std::fill(d, d + LANES, 0u);
        for (int c = c0; c < w.seg_end[s]; ++c) {
          const uint8_t* blk = blocks + int64_t(c) * BLOCK_BYTES;
          for (int r = 0; r < LANES; ++r)
            for (int j = 0; j < ck; ++j) d[r] += uint32_t(code_at(blk, w.bits, r, j) * int32_t(q[c * ck + j]));
        }
        const float x = float(a.qsum[m * w.nseg + s]);
        for (int r = 0; r < LANES; ++r) f[r] = seg_epilogue(w, nb, s, r, float(int32_t(d[r])), x, f[r]);
      }
      store_int_row(w, a, o, nb, m, f);
    }
  }
}

void quantize(const RawX& in, const ActQuant& aq, int8_t* q, int32_t* qsum, float* scale, float* zero, int m0,
              int m1) {
  for (int m = m0; m < m1; ++m) {
    float lo = 0.0f, hi = 0.0f, amax = 0.0f;
    if (aq.dynamic) {
      for (int64_t i = 0; i < in.k; ++i) {
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
    for (int64_t pos = 0; pos < in.kp; ++pos) {
      const int64_t col = in.src ? in.src[pos] : (pos < in.k ? pos : -1);
      out[pos] = col < 0 ? 0 : quantize_one(to_float(in.x, in.dtype, m * in.k + col), p);
    }
    segment_sums(in, out, qsum + m * in.nseg);
  }
}

}  // namespace

const KernelTable& table_scalar() {
  static const KernelTable t{"scalar", gemm_f32, gemm_bf16, gemm_i8, quantize};
  return t;
}

}  // namespace quill
