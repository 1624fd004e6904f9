// Activation stream builders and exact scalar conversions (baseline ISA).
//
// A stream is the input row reordered into the weight's stream order (act-order
// groups made contiguous, segments padded with zeros to whole chunks), so the
// kernels read activations sequentially.  Built once per call, O(M * K).
#include <cstring>

#include "common.h"

namespace quill {

float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t f32_to_bf16_rne(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<uint16_t>(u >> 16);
}

static float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, u;
  if (exp == 0x1F) {
    u = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal half: normalise
    exp = 113;
    while (!(man & 0x400)) { man <<= 1; --exp; }
    u = sign | (exp << 23) | ((man & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float to_float(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::F32: return static_cast<const float*>(p)[i];
    case DType::BF16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::F16: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
  return 0.0f;
}

// Stream position p of token m as float32 (0 for padding).
static inline float stream_value(const RawX& in, int64_t m, int64_t p) {
  const int64_t col = in.src ? in.src[p] : (p < in.k ? p : -1);
  return col < 0 ? 0.0f : to_float(in.x, in.dtype, m * in.k + col);
}

// Sum of n floats in 8 interleaved partial sums (a fixed order the compiler can vectorise).
static float sum8(const float* v, int64_t n) {
  float part[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) part[j] += v[i + j];
  for (int j = 0; i < n; ++i, ++j) part[j] += v[i];
  return ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
}

void build_f32_stream(const RawX& in, float* out, float* xsum, int m0, int m1) {
  for (int m = m0; m < m1; ++m) {
    float* o = out + m * in.kp;  // [Kp]
    if (in.src) {
      for (int64_t p = 0; p < in.kp; ++p) o[p] = stream_value(in, m, p);
    } else {  // identity order: straight conversions the compiler vectorises
      if (in.dtype == DType::F32) {
        std::memcpy(o, static_cast<const float*>(in.x) + m * in.k, in.k * sizeof(float));
      } else if (in.dtype == DType::BF16) {
        const uint16_t* x = static_cast<const uint16_t*>(in.x) + m * in.k;
        for (int64_t p = 0; p < in.k; ++p) {
          const uint32_t u = uint32_t(x[p]) << 16;
          std::memcpy(o + p, &u, 4);
        }
      } else {
        for (int64_t p = 0; p < in.k; ++p) o[p] = to_float(in.x, in.dtype, m * in.k + p);
      }
      std::memset(o + in.k, 0, (in.kp - in.k) * sizeof(float));
    }
    for (int s = 0, p = 0; s < in.nseg; p = in.seg_end[s++] * in.chunk)
      xsum[m * in.nseg + s] = sum8(o + p, int64_t(in.seg_end[s]) * in.chunk - p);
  }
}

// Word order of one chunk: nibble position t of the code words pairs stream
// positions (PAIRS[t][0], PAIRS[t][1]); for 8-bit codes the high nibble's
// position is multiplied by 16 (exact in bf16).
static constexpr int W4_PAIRS[4][2] = {{0, 2}, {4, 6}, {1, 3}, {5, 7}};
static constexpr int W8_PAIRS[4][2] = {{0, 2}, {0, 2}, {1, 3}, {1, 3}};

void build_bf16_stream(const RawX& in, int bits, bool split, uint16_t* out, float* xsum, int m0, int m1) {
  const int chunk = chunk_k(bits);
  const int64_t kc = in.kp / chunk;
  const int words = split ? 16 : 8;
  const auto& pairs = bits == 4 ? W4_PAIRS : W8_PAIRS;
  float hi[8], lo[8];
  for (int m = m0; m < m1; ++m) {
    uint16_t* o = out + m * kc * words;  // [KC, words]
    int s = 0;
    float acc = 0.0f;
    for (int64_t c = 0; c < kc; ++c) {
      for (int j = 0; j < chunk; ++j) {
        const float v = stream_value(in, m, c * chunk + j);
        const uint16_t h = f32_to_bf16_rne(v);
        hi[j] = bf16_to_f32(h);
        lo[j] = split ? bf16_to_f32(f32_to_bf16_rne(v - hi[j])) : 0.0f;
        acc += hi[j] + lo[j];
      }
      for (int t = 0; t < 4; ++t) {
        const float mul = (bits == 8 && (t & 1)) ? 16.0f : 1.0f;
        for (int e = 0; e < 2; ++e) {
          o[c * words + 2 * t + e] = f32_to_bf16_rne(hi[pairs[t][e]] * mul);
          if (split) o[c * words + 8 + 2 * t + e] = f32_to_bf16_rne(lo[pairs[t][e]] * mul);
        }
      }
      if (c + 1 == in.seg_end[s]) {
        xsum[m * in.nseg + s] = acc;
        acc = 0.0f;
        ++s;
      }
    }
  }
}

}  // namespace quill
