// Scalar building blocks shared by the scalar twins and the SIMD kernels' edges.
//
// These define the per-lane float arithmetic (epilogue, store, activation
// quantization) that every variant must perform in exactly this order.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <limits>
#include <new>

#include "common.h"

namespace quill {

struct ActParams {
  float scale;
  float zero;
};

// compressed-tensors replaces a zero scale by float32 eps (quill/kernels/activation.py).
inline float fix_zero_scale(float s) { return s == 0.0f ? FLT_EPSILON : s; }

// Scale and zero point of one token from its min, max and max |x| (dynamic), or the static ones.
inline ActParams act_params(const ActQuant& aq, float lo, float hi, float amax) {
  if (!aq.dynamic) return {fix_zero_scale(aq.scale), aq.zero};
  if (aq.symmetric) return {fix_zero_scale(amax / 127.5f), 0.0f};
  const float s = fix_zero_scale((hi - lo) / 255.0f);
  const float z = std::nearbyint(std::min(std::max(-128.0f - lo / s, -128.0f), 127.0f));
  return {s, z};
}

// round(clamp(v / scale + zero, -128, 127)), round half to even (the default rounding mode).
inline int8_t quantize_one(float v, const ActParams& p) {
  const float t = std::min(std::max(v / p.scale + p.zero, -128.0f), 127.0f);
  return static_cast<int8_t>(std::nearbyint(t));
}

// One token's stream quantized with one symmetric scale per segment (ActQuant::per_segment): the
// stream positions of segment s map to columns (src, or the identity below k); gscale[s] =
// max |x| over them / 127.5 and q = quantize_one(x, gscale[s]).  Every variant calls this for
// act-order streams and runs its arithmetic for the identity order.
inline void quantize_segments_row(const RawX& in, int64_t m, int8_t* out, float* gscale) {
  auto col = [&](int64_t p) { return in.src ? in.src[p] : (p < in.k ? p : -1); };
  int64_t p = 0;
  for (int s = 0; s < in.nseg; ++s) {
    const int64_t p0 = p, end = int64_t(in.seg_end[s]) * in.chunk;
    float amax = 0.0f;
    for (; p < end; ++p)
      if (col(p) >= 0) amax = std::max(amax, std::fabs(to_float(in.x, in.dtype, m * in.k + col(p))));
    const ActParams ap = act_params(ActQuant{}, 0.0f, 0.0f, amax);  // dynamic symmetric, over the segment
    gscale[s] = ap.scale;
    for (p = p0; p < end; ++p) out[p] = col(p) < 0 ? 0 : quantize_one(to_float(in.x, in.dtype, m * in.k + col(p)), ap);
  }
}

// Exact int32 sums of one token's quantized stream over every segment.
inline void segment_sums(const RawX& in, const int8_t* q, int32_t* qsum) {
  int64_t p = 0;
  for (int s = 0; s < in.nseg; ++s) {
    int32_t acc = 0;
    for (const int64_t end = int64_t(in.seg_end[s]) * in.chunk; p < end; ++p) acc += q[p];
    qsum[s] = acc;
  }
}

// ---- the fixed-point image of float activations (SplitActs) ----

// |v| as an ordered integer: the max over a segment is exact, and NaN (above inf) wins.
inline uint32_t abs_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return u & 0x7FFFFFFFu;
}

// How one segment is scaled: q = round(clamp((x * pre) * inv, -QMAX, QMAX)), ties to even,
// QMAX the image's (split_qmax).
// `pre` (2^64 for a segment whose max |x| is below 2^-64, else 1) keeps `inv` finite; x * pre
// is exact.  A segment holding inf or NaN is stored as zeros with scale NaN, so every output
// it feeds is NaN (as a float product would be, or inf).
struct SplitParams {
  float pre, inv, scale, qmax;
  bool finite;
};

inline SplitParams split_params(uint32_t amax_bits, int parts) {
  const float qmax = split_qmax(parts);
  float amax;
  std::memcpy(&amax, &amax_bits, 4);
  if (amax_bits >= 0x7F800000u) return {1.0f, 0.0f, std::numeric_limits<float>::quiet_NaN(), qmax, false};
  const float pre = amax < 0x1p-64f ? 0x1p64f : 1.0f;
  const float a = amax * pre;
  return {pre, a > 0.0f ? qmax / a : 0.0f, amax / qmax, qmax, true};
}

// One value's image; the comparisons are those of the SIMD max/min (x > y ? x : y).
inline int32_t split_q(float x, const SplitParams& p) {
  float t = (x * p.pre) * p.inv;
  t = t > -p.qmax ? t : -p.qmax;
  t = t < p.qmax ? t : p.qmax;
  return static_cast<int32_t>(std::nearbyint(t));
}

// 24 bits: q = 65536 * hi + 256 * mid + lo, each part in [-128, 127]: lo = q - 256 * r with
// r = round(q / 256) (ties up, arithmetic shift), then r = 256 * hi + mid the same way
// (|r| <= 32639, so |hi| <= 127).  16 bits: q = 256 * hi + lo the same way (|q| <= 32639), mid 0.
struct SplitParts {
  int8_t hi, mid, lo;
};

inline SplitParts split_parts(int32_t q, int parts) {
  const int32_t r = (q + 128) >> 8;
  if (parts != SPLIT_PARTS) return {static_cast<int8_t>(r), 0, static_cast<int8_t>(q - 256 * r)};
  const int32_t hi = (r + 128) >> 8;
  return {static_cast<int8_t>(hi), static_cast<int8_t>(r - 256 * hi), static_cast<int8_t>(q - 256 * r)};
}

// Stream position p (of one token's stream `out`, chunks of ck positions, `parts` runs each) gets the
// parts of q; xhi and xlo gather the segment's sums Xhi = sum(hi), Xlo = sum(q - SHIFT * hi).
inline void put_split(int8_t* out, int ck, int parts, int64_t p, int32_t q, int32_t& xhi, int32_t& xlo) {
  const SplitParts sp = split_parts(q, parts);
  int8_t* chunk = out + p / ck * parts * ck;
  chunk[p % ck] = sp.hi;
  if (parts == SPLIT_PARTS) chunk[ck + p % ck] = sp.mid;
  chunk[(parts - 1) * ck + p % ck] = sp.lo;
  xhi += sp.hi;
  xlo += q - sp.hi * (1 << split_shift_bits(parts));
}

// Positions [p, p + n) of one token's stream get the parts already split (the vector kernels'
// quantize_split: hi / mid / lo of each position, in order; mid unused for 2 parts): the
// chunk-interleaved stores of put_split, a chunk's run at a time.
inline void put_split_run(int8_t* out, int ck, int parts, int64_t p, int n, const int8_t* hi, const int8_t* mid,
                          const int8_t* lo) {
  for (int j = 0; j < n;) {
    const int64_t c = (p + j) / ck, off = (p + j) % ck;
    const int len = int(std::min<int64_t>(ck - off, n - j));
    int8_t* chunk = out + c * parts * ck + off;
    std::memcpy(chunk, hi + j, len);
    if (parts == SPLIT_PARTS) std::memcpy(chunk + ck, mid + j, len);
    std::memcpy(chunk + (parts - 1) * ck, lo + j, len);
    j += len;
  }
}

// (a, b) as one int32 of two int16 halves, a low (the SIMD kernels' vpmaddwd pairs; values within int16).
inline int32_t int16_pair(int32_t a, int32_t b) { return int32_t((uint32_t(a) & 0xFFFFu) | (uint32_t(b) << 16)); }

// Positions of the longest segment (seg_end [nseg] in chunks of chunk_k(bits)).
inline int64_t longest_segment(const int32_t* seg_end, int64_t nseg, int bits) {
  int64_t most = 0;
  for (int64_t s = 0; s < nseg; ++s) most = std::max<int64_t>(most, int64_t(seg_end[s] - (s ? seg_end[s - 1] : 0)));
  return most * chunk_k(bits);
}

inline int64_t seg_index(const Weights& w, int nb, int s, int r) { return (int64_t(nb) * w.nseg + s) * LANES + r; }

inline float zero_at(const Weights& w, int64_t i) {
  if (!w.zeros) return w.zconst;
  return w.bits != 8 ? float(static_cast<const uint8_t*>(w.zeros)[i]) : float(static_cast<const int16_t*>(w.zeros)[i]);
}

// Index of lane r's super-block value for segment s (two-level scales).
inline int64_t super_index(const Weights& w, int nb, int s, int r) {
  return (int64_t(nb) * (w.nseg / w.gps) + s / w.gps) * LANES + r;
}

// Lane r's integer sub-value of segment s (two-level scales): int8, or packed 4 / 6 bits (common.h).
inline int32_t sub_value(const void* sub, const Weights& w, int nb, int s, int r) {
  if (w.sub_bits == 8) return static_cast<const int8_t*>(sub)[seg_index(w, nb, s, r)];
  const uint8_t* p = static_cast<const uint8_t*>(sub) + int64_t(nb) * sub_rows(w.sub_bits, w.nseg) * LANES + r;
  int32_t u;
  if (w.sub_bits == 4) {
    u = (p[(s / 2) * LANES] >> (4 * (s & 1))) & 15;
  } else {
    const int g = s / 4, j = s & 3;
    u = ((p[(3 * g + j / 2) * LANES] >> (4 * (j & 1))) & 15) | (((p[(3 * g + 2) * LANES] >> (2 * j)) & 3) << 4);
  }
  return u - w.sub_bias;
}

// One level: the stored value at i.  Two levels: super * integer sub-value, one float32 rounding (exact).
inline float level_at(const void* sub, const void* sup, const Weights& w, int nb, int s, int r, int64_t i) {
  if (!sup) return to_float(sub, w.scale_dtype, i);
  return to_float(sup, w.scale_dtype, super_index(w, nb, s, r)) * float(sub_value(sub, w, nb, s, r));
}

inline float scale_at(const Weights& w, int nb, int s, int r, int64_t i) {
  return level_at(w.scales, w.super_scales, w, nb, s, r, i);
}

inline float offset_at(const Weights& w, int nb, int s, int r, int64_t i) {
  return level_at(w.offsets, w.super_offsets, w, nb, s, r, i);
}

// f += scale * (D - zero * X) [+ offset * X] for lane r of segment s.
inline float seg_epilogue(const Weights& w, int nb, int s, int r, float d, float x, float f) {
  const int64_t i = seg_index(w, nb, s, r);
  const float t = std::fma(-zero_at(w, i), x, d);
  f = std::fma(scale_at(w, nb, s, r, i), t, f);
  if (w.offsets) f = std::fma(offset_at(w, nb, s, r, i), x, f);
  return f;
}

// The same with a per-(token, segment) activation scale g (I8Acts::gscale): xg = X * g,
// f += scale * (D * g - zero * xg) [+ offset * xg].
inline float seg_epilogue_g(const Weights& w, int nb, int s, int r, float d, float x, float g, float f) {
  const int64_t i = seg_index(w, nb, s, r);
  const float xg = x * g;
  const float t = std::fma(d, g, -(zero_at(w, i) * xg));
  f = std::fma(scale_at(w, nb, s, r, i), t, f);
  if (w.offsets) f = std::fma(offset_at(w, nb, s, r, i), xg, f);
  return f;
}

// Layers whose every row has the one zero point zconst, no offsets and one level of scales (GGUF Q4_0 / Q5_0 /
// Q8_0, symmetric GPTQ / compressed-tensors): seg_epilogue_g's token side is the same for every row.
inline bool one_zero_point(const Weights& w) { return !w.zeros && !w.offsets && !w.super_scales; }

namespace {
// A thread's grow-only float scratch (group_terms).  Internal to each TU, as is its code: a std::vector's
// member templates are weak symbols the linker may take from any TU, e.g. an AVX-512-compiled resize for the
// AVX2 kernels.
struct FloatScratch {
  float* p = nullptr;
  size_t n = 0;
  ~FloatScratch() { std::free(p); }
  float* get(size_t want) {
    if (want > n) {
      std::free(p);
      p = static_cast<float*>(std::malloc(want * sizeof(float)));
      n = p ? want : 0;
      if (!p) throw std::bad_alloc();
    }
    return p;
  }
};
}  // namespace

// That token side precomputed once per kernel call for one_zero_point layers: per segment s and token m,
// out[(s * M + m) * 2 + {0, 1}] = g and z * xg (xg = X * g), rounded as seg_epilogue_g rounds them, so the
// SIMD epilogue is t = fma(d, g, -zxg) from two broadcasts (no convert, multiply or index math per token,
// row block and half).  Segment-major [S, M, 2]: a token tile's pairs of one segment share a base pointer.
// O(M S) beside the call's O(N K M).  buf: the calling thread's scratch; returns its data.  Always inlined:
// each ISA's TU compiles it with its own flags, and a shared out-of-line copy could be the AVX-512 TU's,
// called from the AVX2 one.
// STRIDE 3 adds xg itself, p[2] (the offset term's factor): layers with one zero point and offsets or two-level
// scales (K-quants), whose weight side stays per row (seg_consts) but whose token side is the same.
template <int STRIDE = 2>
QUILL_INLINE const float* group_terms(const Weights& w, const I8Acts& a, FloatScratch& buf) {
  static_assert(STRIDE == 2 || STRIDE == 3, "(g, z xg) or (g, z xg, xg)");
  float* out = buf.get(size_t(STRIDE) * a.m * w.nseg);
  for (int m = 0; m < a.m; ++m)
    for (int s = 0; s < w.nseg; ++s) {
      const int64_t i = int64_t(m) * w.nseg + s;
      const float g = a.gscale[i], xg = float(a.qsum[i]) * g;
      float* p = out + (int64_t(s) * a.m + m) * STRIDE;
      p[0] = g;
      p[1] = w.zconst * xg;
      if constexpr (STRIDE == 3) p[2] = xg;
    }
  return out;
}

inline int32_t zero_int_at(const Weights& w, int64_t i) {
  if (!w.zeros) return static_cast<int32_t>(w.zconst);
  return w.bits != 8 ? int32_t(static_cast<const uint8_t*>(w.zeros)[i]) : int32_t(static_cast<const int16_t*>(w.zeros)[i]);
}

// The code of lane r at position j of chunk c of row block nb (the layout of common.h).
inline int code_at(const Weights& w, int nb, int64_t c, int r, int j) {
  const uint8_t* blk = w.codes + (int64_t(nb) * w.kc + c) * BLOCK_BYTES;
  if (w.bits == 8) return blk[4 * r + j];
  const int b = j % 4, n = j / 4;
  if (w.bits <= 3) {  // 2-bit pairs, plus the third bit's plane for 3-bit
    int q = (blk[4 * r + b] >> (2 * n)) & 3;
    if (w.hplane) {
      const uint8_t byte = w.hplane[(int64_t(nb) * w.kc + c) * plane_bytes(3) + 4 * (r % 8) + b];
      q |= ((byte >> (4 * (r / 8) + n)) & 1) << 2;
    }
    return q;
  }
  int q = (blk[4 * r + b] >> (4 * n)) & 0x0F;
  if (w.hplane) {
    const int hb = w.bits - 4, rows = 4 * hb;
    const uint8_t byte = w.hplane[(int64_t(nb) * w.kc + c) * plane_bytes(w.bits) + 4 * (r % rows) + b];
    q |= ((byte >> (hb * (2 * (r / rows) + n))) & ((1 << hb) - 1)) << 4;
  }
  return q;
}

// The float kernels' epilogue for lane r of segment s (common.h SplitActs):
//   t = SHIFT * (Dhi - z * Xhi) + (Dlo - z * Xlo)     (both brackets exact in int32)
//   f += (scale * xscale) * t [+ (offset * xscale) * (SHIFT * Xhi + Xlo)]
// SHIFT = 65536 (24-bit image) or 256 (16-bit).  Taking the zero point off in int32 matters: Dlo
// and z * Xlo are large and nearly equal for codes centred on z, and rounding either to float
// first would cost the image's bits.
inline float split_epilogue(const Weights& w, int nb, int s, int r, int32_t dhi, int32_t dlo, int32_t xhi,
                            int32_t xlo, float xscale, float f, int parts) {
  const int64_t i = seg_index(w, nb, s, r);
  const int32_t z = zero_int_at(w, i);
  const float shift = float(1 << split_shift_bits(parts));
  const float t = std::fma(float(dhi - z * xhi), shift, float(dlo - z * xlo));
  f = std::fma(scale_at(w, nb, s, r, i) * xscale, t, f);
  if (w.offsets)
    f = std::fma(offset_at(w, nb, s, r, i) * xscale, std::fma(float(xhi), shift, float(xlo)), f);
  return f;
}

inline void store_value(const Out& o, int m, int n, float v) {
  if (o.dtype == DType::BF16)
    static_cast<uint16_t*>(o.y)[m * o.ld + n] = f32_to_bf16_rne(v);
  else
    static_cast<float*>(o.y)[m * o.ld + n] = v;
}

// y = f (+ bias) for the real rows of row block nb.
inline void store_float_row(const Weights& w, const Out& o, int nb, int m, const float* f) {
  for (int r = 0; r < LANES && nb * LANES + r < w.n; ++r) {
    const int n = nb * LANES + r;
    float v = f[r];
    if (w.bias) v = v + w.bias[n];
    store_value(o, m, n, v);
  }
}

// y = (f - zero_a * wsum) * scale_a (+ bias): undo the activation quantization.
inline void store_int_row(const Weights& w, const I8Acts& a, const Out& o, int nb, int m, const float* f) {
  for (int r = 0; r < LANES && nb * LANES + r < w.n; ++r) {
    const int n = nb * LANES + r;
    float u = a.asym ? std::fma(-a.zero[m], w.wsum[n], f[r]) : f[r];
    float v = a.gscale ? u : u * a.scale[m];  // per-segment scales are in f already
    if (w.bias) v = v + w.bias[n];
    store_value(o, m, n, v);
  }
}

}  // namespace quill
