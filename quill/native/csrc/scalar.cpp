// Scalar twins: the oracle of every SIMD kernel, and the kernels of CPUs without AVX2.
//
// Each function has the signature of its SIMD siblings and follows the layout
// comment in common.h literally, one lane (output row) at a time.  The int8
// kernels and the activation quantizers perform exactly the operations of the
// SIMD versions in the same order per lane (exact int32 sums, then the same float
// epilogue), so they must agree bit for bit.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

#include "scalar_util.h"

namespace quill {
namespace {

// Float activations as their split fixed-point image (common.h SplitActs): per lane,
// Dhi = sum(code * hi) and Dlo = 256 * sum(code * mid) + sum(code * lo) (2 parts: sum(code * lo)), exactly.
void gemm_split(const Weights& w, const SplitActs& a, const Out& o, int nb0, int nb1) {
  const int ck = chunk_k(w.bits), parts = a.parts;
  float f[LANES];
  int32_t dh[LANES], dm[LANES], dl[LANES];
  for (int nb = nb0; nb < nb1; ++nb) {
    for (int m = 0; m < a.m; ++m) {
      const int8_t* xs = a.x + m * a.ld;  // [KC, parts * CK]
      std::fill(f, f + LANES, 0.0f);
      for (int s = 0, c0 = 0; s < w.nseg; c0 = w.seg_end[s++]) {
        std::fill(dh, dh + LANES, 0);
        std::fill(dm, dm + LANES, 0);
        std::fill(dl, dl + LANES, 0);
        for (int c = c0; c < w.seg_end[s]; ++c) {
          const int8_t* x = xs + int64_t(c) * parts * ck;
          for (int r = 0; r < LANES; ++r)
            for (int j = 0; j < ck; ++j) {
              const int32_t q = code_at(w, nb, c, r, j);
              dh[r] += q * x[j];
              if (parts == SPLIT_PARTS) dm[r] += q * x[ck + j];
              dl[r] += q * x[(parts - 1) * ck + j];
            }
        }
        const int64_t i = int64_t(m) * w.nseg + s;
        for (int r = 0; r < LANES; ++r)
          f[r] = split_epilogue(w, nb, s, r, dh[r], 256 * dm[r] + dl[r], a.qsum[2 * i], a.qsum[2 * i + 1], a.scale[i],
                                f[r], parts);
      }
      store_float_row(w, o, nb, m, f);
    }
  }
}

// llama.cpp's K-quant arithmetic (common.h I8Acts::gsuper): integer sub-values, one float epilogue per super-block.
void gemm_i8_super(const Weights& w, const I8Acts& a, const Out& o, int nb0, int nb1) {
  const int ck = chunk_k(w.bits), nsup = w.nseg / w.gps;
  const uint32_t z = uint32_t(int32_t(w.zconst));
  float f[LANES];
  uint32_t sa[LANES], sb[LANES];  // A and B, int32 with wrap-around as the SIMD lanes (exact at the end)
  for (int nb = nb0; nb < nb1; ++nb) {
    for (int m = 0; m < a.m; ++m) {
      const int8_t* q = a.q + m * a.ld;  // [Kp]
      std::fill(f, f + LANES, 0.0f);
      for (int u = 0, c = 0; u < nsup; ++u) {
        std::fill(sa, sa + LANES, 0u);
        std::fill(sb, sb + LANES, 0u);
        for (int s = u * w.gps; s < (u + 1) * w.gps; ++s) {
          const uint32_t x = uint32_t(a.qsum[m * w.nseg + s]);
          for (int r = 0; r < LANES; ++r) {
            uint32_t d = 0;
            for (int cc = c; cc < w.seg_end[s]; ++cc)
              for (int j = 0; j < ck; ++j) d += uint32_t(code_at(w, nb, cc, r, j) * int32_t(q[cc * ck + j]));
            sa[r] += uint32_t(sub_value(w.scales, w, nb, s, r)) * (d - z * x);
            if (w.offsets) sb[r] += uint32_t(sub_value(w.offsets, w, nb, s, r)) * x;
          }
          c = w.seg_end[s];
        }
        const float g = a.gscale[m * nsup + u];
        for (int r = 0; r < LANES; ++r) {
          const int64_t i = super_index(w, nb, u * w.gps, r);
          f[r] = std::fma(to_float(w.super_scales, w.scale_dtype, i) * g, float(int32_t(sa[r])), f[r]);
          if (w.offsets) f[r] = std::fma(to_float(w.super_offsets, w.scale_dtype, i) * g, float(int32_t(sb[r])), f[r]);
        }
      }
      store_int_row(w, a, o, nb, m, f);
    }
  }
}

void gemm_i8(const Weights& w, const I8Acts& a, const Out& o, int nb0, int nb1) {
  if (a.gsuper) return gemm_i8_super(w, a, o, nb0, nb1);
  const int ck = chunk_k(w.bits);
  float f[LANES];
  uint32_t d[LANES];  // int32 arithmetic with wrap-around, as the SIMD lanes do
  for (int nb = nb0; nb < nb1; ++nb) {
    for (int m = 0; m < a.m; ++m) {
      const int8_t* q = a.q + m * a.ld;  // [Kp]
      std::fill(f, f + LANES, 0.0f);
      for (int s = 0, c0 = 0; s < w.nseg; c0 = w.seg_end[s++]) {
        std::fill(d, d + LANES, 0u);
        for (int c = c0; c < w.seg_end[s]; ++c) {
          for (int r = 0; r < LANES; ++r)
            for (int j = 0; j < ck; ++j) d[r] += uint32_t(code_at(w, nb, c, r, j) * int32_t(q[c * ck + j]));
        }
        const float x = float(a.qsum[m * w.nseg + s]);
        if (a.gscale) {
          const float g = a.gscale[m * w.nseg + s];
          for (int r = 0; r < LANES; ++r) f[r] = seg_epilogue_g(w, nb, s, r, float(int32_t(d[r])), x, g, f[r]);
        } else {
          for (int r = 0; r < LANES; ++r) f[r] = seg_epilogue(w, nb, s, r, float(int32_t(d[r])), x, f[r]);
        }
      }
      store_int_row(w, a, o, nb, m, f);
    }
  }
}

void quantize(const RawX& in, const ActQuant& aq, int8_t* q, int32_t* qsum, float* scale, float* zero,
              float* gscale, int m0, int m1) {
  for (int m = m0; m < m1; ++m) {
    if (aq.per_segment) {
      quantize_segments_row(in, m, q + m * in.kp, gscale + m * in.nseg);
      segment_sums(in, q + m * in.kp, qsum + m * in.nseg);
      continue;
    }
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

// The split stream of tokens [m0, m1); identity order (the binding gathers act-order first).
void quantize_split(const RawX& in, int8_t* xs, int32_t* qsum, float* scale, int m0, int m1) {
  const int ck = in.chunk;
  for (int m = m0; m < m1; ++m) {
    int8_t* out = xs + m * in.kp * in.parts;  // [KC, parts * CK]
    for (int s = 0, p0 = 0; s < in.nseg; p0 = in.seg_end[s++] * ck) {
      const int p1 = in.seg_end[s] * ck;
      auto value = [&](int64_t p) { return p < in.k ? to_float(in.x, in.dtype, m * in.k + p) : 0.0f; };
      uint32_t amax = 0;
      for (int64_t p = p0; p < p1; ++p) amax = std::max(amax, abs_bits(value(p)));
      const SplitParams sp = split_params(amax, in.parts);
      int32_t xhi = 0, xlo = 0;
      for (int64_t p = p0; p < p1; ++p) {
        put_split(out, ck, in.parts, p, sp.finite ? split_q(value(p), sp) : 0, xhi, xlo);
      }
      const int64_t i = int64_t(m) * in.nseg + s;
      qsum[2 * i] = xhi;
      qsum[2 * i + 1] = xlo;
      scale[i] = sp.scale;
    }
  }
}

}  // namespace

const KernelTable& table_scalar() {
  static const KernelTable t{"scalar", gemm_split, gemm_i8, quantize, quantize_split};
  return t;
}

}  // namespace quill
