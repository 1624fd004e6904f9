// The functions of a SIMD variant compiled in translation units of their own beside the GEMMs whose
// KernelTable lists them (common.h: the signatures and what they write): the activation quantizers
// (avx2_quant.cpp, avx512_quant.cpp) and AVX-512's float-activation GEMM (avx512_split.cpp).
#pragma once

#include "common.h"

namespace quill {
namespace avx2 {
void quantize(const RawX& in, const ActQuant& aq, int8_t* q, int32_t* qsum, float* scale, float* zero, float* gscale,
              int m0, int m1);
void quantize_split(const RawX& in, int8_t* xs, int32_t* qsum, float* scale, int m0, int m1);
}  // namespace avx2
namespace avx512 {
void quantize(const RawX& in, const ActQuant& aq, int8_t* q, int32_t* qsum, float* scale, float* zero, float* gscale,
              int m0, int m1);
void quantize_split(const RawX& in, int8_t* xs, int32_t* qsum, float* scale, int m0, int m1);
void gemm_split(const Weights& w, const SplitActs& a, const Out& o, int nb0, int nb1);
}  // namespace avx512
}  // namespace quill
