// exp and tanh for float32 as branch-free arithmetic, so the element loops that call them vectorise where
// libm's scalar calls do not (Gemma's gelu-tanh over 26 x 6912 values per token took 4 ms of a 54 ms step with
// std::tanh).  Cephes' expf and tanhf: exp's relative error < 2e-7, tanh within 2 ulp of libm's (a sweep of
// every 97th float32; tests/test_fused.py checks gelu-tanh against float64 over [-12, 12]).  The one exp of the
// native code: decode and prefill attention (exp_neg), DeltaNet's SiLU, gelu-tanh.  In an anonymous namespace:
// each ISA's translation units compile their own copy (a shared inline one would be one ISA's for all).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace quill {
namespace {

// exp(x), x clamped to [-87, 88] (float32's normal range): 2^n p(r), n = round(x / ln 2), r = x - n ln 2
inline float exp_vec(float x) {
  const float c = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float t = c * 1.44269504088896341f + 12582912.0f;  // 1.5 * 2^23: rounds to an integer
  const float n = t - 12582912.0f;
  const float r = (c - n * 0.693359375f) - n * -2.12194440e-4f;  // ln 2 in two parts (Cody-Waite)
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &t, 4);
  const int32_t e = (bits - 0x4B400000 + 127) << 23;  // the integer n sits in t's low mantissa bits
  float two_n;
  std::memcpy(&two_n, &e, 4);
  return p * two_n;
}

// tanh(x): x + x^3 P(x^2) below |x| = 0.625, 1 - 2 / (exp(2|x|) + 1) above (1 in float32 past |x| = 9);
// both computed, one kept (a select, not a branch).  NaN stays NaN.
inline float tanh_vec(float x) {
  const float ax = std::fabs(x);
  const float z = x * x;
  float p = -5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const float small = x + x * z * p;
  const float e = exp_vec(2.0f * (ax < 9.0f ? ax : 9.0f));
  const float big = std::copysign(1.0f - 2.0f / (e + 1.0f), x);
  return ax >= 0.625f ? big : small;
}

}  // namespace
}  // namespace quill
