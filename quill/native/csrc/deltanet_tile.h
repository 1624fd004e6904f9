// The Gated DeltaNet decode template (deltanet.h), included by deltanet_{scalar,avx2,avx512}.cpp:
// GCC vector types of DN_W floats (8: AVX2 and the scalar twin, 16: AVX-512) for the two passes
// over the state, plain loops the compiler vectorises for the rest.  Each value is the same chain
// of roundings in every TU (deltanet.h), so the variants equal the scalar twin bit for bit.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "deltanet.h"
#include "vmath.h"

// The vector helpers have internal linkage, so their ABI (AVX vectors in the scalar twin) is moot.
#pragma GCC diagnostic ignored "-Wpsabi"

// Internal linkage: each TU keeps its own copy, compiled with its own ISA flags.
namespace quill::dnet {
namespace {

#ifndef DN_W
#define DN_W 8
#endif
constexpr int W = DN_W;
static_assert(W == 8 || W == 16, "DN_W is 8 or 16");
constexpr int NB = 4;  // vectors of state columns held in registers across a pass's rows (then 1, then single columns)
typedef float vw __attribute__((vector_size(W * 4)));

inline vw vload(const float* p) {
  vw v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void vstore(float* p, const vw& v) { std::memcpy(p, &v, sizeof v); }
inline vw splat(float x) { return vw{} + x; }

// a * b + c rounded once per lane: the instruction where the TU has it, std::fma (exact, in
// software on the baseline) in the scalar twin -- the same value either way
inline vw vfma(const vw& a, const vw& b, const vw& c) {
#if DN_W == 16 && defined(__AVX512F__)
  return (vw)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif DN_W == 8 && defined(__FMA__)
  return (vw)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  vw r;
  for (int j = 0; j < W; ++j) r[j] = std::fma(a[j], b[j], c[j]);
  return r;
#endif
}

// sum of x[i]^2 over n values: 16 lane partials, then ((p0 + p8) + (p4 + p12)) + ...
inline float sum_sq(const float* x, int64_t n) {
  float p[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) p[j] = std::fma(x[i + j], x[i + j], p[j]);
  for (int j = 0; i < n; ++i, ++j) p[j] = std::fma(x[i], x[i], p[j]);
  float a[8], b[4];
  for (int j = 0; j < 8; ++j) a[j] = p[j] + p[j + 8];
  for (int j = 0; j < 4; ++j) b[j] = a[j] + a[j + 4];
  return (b[0] + b[2]) + (b[1] + b[3]);
}

inline float silu(float x) { return x / (1.0f + exp_vec(-x)); }  // (vmath.h)

// Channels [c0, c1) of sequence i: x = silu(conv over the state's K - 1 inputs and the new one);
// the state drops its oldest input and keeps the new one.  conv_state row [C, K - 1].
inline void conv(const DeltaNetArgs& a, int64_t i, int64_t c0, int64_t c1) {
  const int64_t kk = a.k, km = kk - 1;
  const float* __restrict in = a.qkv + i * a.ld_qkv;    // [C]
  float* __restrict st = a.conv_state + a.rows[i] * a.c * km;  // [C, K - 1]
  float* __restrict x = a.x + i * a.c;                  // [C]
  for (int64_t c = c0; c < c1; ++c) {
    const float* w = a.conv_w + c * kk;
    float* s = st + c * km;
    float acc = a.conv_b ? a.conv_b[c] : 0.0f;
    for (int64_t t = 0; t < km; ++t) acc = std::fma(w[t], s[t], acc);
    acc = std::fma(w[km], in[c], acc);
    for (int64_t t = 0; t + 1 < km; ++t) s[t] = s[t + 1];
    if (km > 0) s[km - 1] = in[c];
    x[c] = acc;
  }
  for (int64_t c = c0; c < c1; ++c) x[c] = silu(x[c]);
}

// Columns [j, j + U W): S[r] *= decay for every row r < dk, mem = S^T k (the decayed S).
template <int U>
inline void decay_read_block(float* __restrict s, const float* __restrict k, float decay, float* __restrict mem,
                             int64_t dk, int64_t dv) {
  vw acc[U] = {};
  const vw d = splat(decay);
  for (int64_t r = 0; r < dk; ++r) {
    const vw kr = splat(k[r]);
    for (int u = 0; u < U; ++u) {
      const vw v = vload(s + r * dv + u * W) * d;
      vstore(s + r * dv + u * W, v);
      acc[u] = vfma(v, kr, acc[u]);
    }
  }
  for (int u = 0; u < U; ++u) vstore(mem + u * W, acc[u]);
}

// Columns [j, j + U W): S[r] += k[r] delta for every row r < dk, o = S^T q (the updated S).
template <int U>
inline void update_read_block(float* __restrict s, const float* __restrict k, const float* __restrict delta,
                              const float* __restrict q, float* __restrict o, int64_t dk, int64_t dv) {
  vw acc[U] = {}, dl[U];
  for (int u = 0; u < U; ++u) dl[u] = vload(delta + u * W);
  for (int64_t r = 0; r < dk; ++r) {
    const vw kr = splat(k[r]), qr = splat(q[r]);
    for (int u = 0; u < U; ++u) {
      const vw v = vfma(kr, dl[u], vload(s + r * dv + u * W));
      vstore(s + r * dv + u * W, v);
      acc[u] = vfma(v, qr, acc[u]);
    }
  }
  for (int u = 0; u < U; ++u) vstore(o + u * W, acc[u]);
}

// The same two passes for columns [j0, dv) past the blocks, one column at a time (the same
// roundings per element as the blocks).
inline void decay_read_tail(float* s, const float* k, float decay, float* mem, int64_t dk, int64_t dv, int64_t j0) {
  for (int64_t j = j0; j < dv; ++j) {
    float acc = 0.0f;
    for (int64_t r = 0; r < dk; ++r) {
      const float v = s[r * dv + j] * decay;
      s[r * dv + j] = v;
      acc = std::fma(v, k[r], acc);
    }
    mem[j] = acc;
  }
}

inline void update_read_tail(float* s, const float* k, const float* delta, const float* q, float* o, int64_t dk,
                             int64_t dv, int64_t j0) {
  for (int64_t j = j0; j < dv; ++j) {
    float acc = 0.0f;
    for (int64_t r = 0; r < dk; ++r) {
      const float v = std::fma(k[r], delta[j], s[r * dv + j]);
      s[r * dv + j] = v;
      acc = std::fma(v, q[r], acc);
    }
    o[j] = acc;
  }
}

// Value head h of sequence i: normalised q / k of its key head, decay and beta, the delta rule on
// its state [dk, dv], the gated RMSNorm into out.  scratch: dnet_scratch(dk, dv) floats.
inline void head(const DeltaNetArgs& a, int64_t i, int64_t h, float* scratch) {
  const int64_t dk = a.dk, dv = a.dv, kh = a.tiled ? h % a.hk : h / (a.hv / a.hk);
  const float* xr = a.x + i * a.c;  // [C]: q [Hk, dk], k [Hk, dk], v [Hv, dv]
  const float* xq = xr + kh * dk;
  const float* xk = xr + a.hk * dk + kh * dk;
  const float* xv = xr + 2 * a.hk * dk + h * dv;
  float* __restrict q = scratch;     // [dk]
  float* __restrict k = q + dk;      // [dk]
  float* __restrict delta = k + dk;  // [dv] mem, then delta
  float* __restrict o = delta + dv;  // [dv]
  // l2norm as transformers' (x * rsqrt(sum x^2 + 1e-6)), q then divided by sqrt(dk)
  const float iq = 1.0f / std::sqrt(sum_sq(xq, dk) + 1e-6f), ik = 1.0f / std::sqrt(sum_sq(xk, dk) + 1e-6f);
  const float root_dk = std::sqrt(float(dk));
  for (int64_t j = 0; j < dk; ++j) q[j] = xq[j] * iq / root_dk;
  for (int64_t j = 0; j < dk; ++j) k[j] = xk[j] * ik;
  // softplus as torch's (threshold 20: x itself above it)
  const float ab = a.a[i * a.ld_ab + h] + a.dt_bias[h];
  const float softplus = ab > 20.0f ? ab : std::log1p(std::exp(ab));
  const float decay = std::exp(-std::exp(a.a_log[h]) * softplus);
  const float beta = 1.0f / (1.0f + std::exp(-a.b[i * a.ld_ab + h]));
  float* s = a.state + (a.rows[i] * a.hv + h) * dk * dv;  // [dk, dv]
  // Column by column the rule is independent (delta[j] needs only column j's mem), so both passes
  // run on one block of columns while it sits in L1 (NB W columns x dk rows: 16 KiB at dk 128 with
  // AVX2): the state is read from memory once and written once per step.
  constexpr int64_t BW = NB * W;
  int64_t j = 0;
  for (; j + BW <= dv; j += BW) {
    decay_read_block<NB>(s + j, k, decay, delta + j, dk, dv);
    for (int64_t c = j; c < j + BW; ++c) delta[c] = (xv[c] - delta[c]) * beta;
    update_read_block<NB>(s + j, k, delta + j, q, o + j, dk, dv);
  }
  for (; j + W <= dv; j += W) {
    decay_read_block<1>(s + j, k, decay, delta + j, dk, dv);
    for (int64_t c = j; c < j + W; ++c) delta[c] = (xv[c] - delta[c]) * beta;
    update_read_block<1>(s + j, k, delta + j, q, o + j, dk, dv);
  }
  decay_read_tail(s, k, decay, delta, dk, dv, j);
  for (int64_t c = j; c < dv; ++c) delta[c] = (xv[c] - delta[c]) * beta;
  update_read_tail(s, k, delta, q, o, dk, dv, j);
  // gated RMSNorm: o * rsqrt(mean o^2 + eps) * w * silu(z)
  const float r = 1.0f / std::sqrt(sum_sq(o, dv) / float(dv) + a.eps);
  const float* z = a.z + i * a.ld_z + h * dv;
  const float* w = a.norm_w;
  float* out = a.out + i * a.ld_out + h * dv;
  for (int64_t c = 0; c < dv; ++c) out[c] = w[c] * (o[c] * r) * silu(z[c]);
}

}  // namespace
}  // namespace quill::dnet
