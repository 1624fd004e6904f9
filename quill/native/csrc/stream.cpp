// Exact scalar conversions and the act-order gather (baseline ISA).
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

void gather_stream(const RawX& in, float* out, int m0, int m1) {
  for (int m = m0; m < m1; ++m)
    for (int64_t p = 0; p < in.kp; ++p) {
      const int64_t col = in.src ? in.src[p] : (p < in.k ? p : -1);
      out[m * in.kp + p] = col < 0 ? 0.0f : to_float(in.x, in.dtype, m * in.k + col);  // [M, Kp]
    }
}

}  // namespace quill
