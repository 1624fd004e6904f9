// Dense linears with 16-bit float weights (bfloat16 or float16, stored exactly as the
// checkpoint has them) and float32 arithmetic: a checkpoint's unquantized layers, above
// all a bf16 lm_head (525 MB per token for a Llama-3.2-1B vocabulary).
//
// Layout: rows in blocks of 16 (one per SIMD lane, N padded with zero rows), columns in
// pairs (K padded to even): one 64-byte block per row block and column pair,
//
//   words [nb][p][r][j] = W[16 nb + r][2 p + j]     (uint16 bits, r < 16, j < 2)
//
// so lane r's 32-bit word holds its two weights of a pair.  Each weight is converted
// exactly to float32 and multiplied with float32 activations (bf16 / f16 inputs are
// widened exactly first), accumulated in float32 by fused multiply-adds: the products
// are exact, only the summation order differs from torch's float32 matmul.  The
// accumulation order is fixed by the token count alone (dense_tile.h), so every ISA
// variant returns the same bits as the scalar twin.
#pragma once

#include <cstdint>

#include "common.h"

namespace quill {

struct DenseWeights {
  const uint16_t* words = nullptr;  // [NB, KP, 16, 2]
  const float* bias = nullptr;      // [N] or null
  int64_t kp = 0;                   // column pairs
  int32_t n = 0;                    // real output features
  int32_t nb = 0;                   // row blocks
  bool f16 = false;                 // float16 words (else bfloat16)
};

struct DenseActs {
  const float* x = nullptr;  // [M, ld], ld >= 2 * KP; position 2 * KP - 1 is 0 when K is odd
  int64_t ld = 0;
  int32_t m = 0;
};

// Row blocks [nb0, nb1) for all M tokens.
using DenseGemm = void (*)(const DenseWeights&, const DenseActs&, const Out&, int nb0, int nb1);

DenseGemm dense_gemm_scalar();
DenseGemm dense_gemm_avx2();
DenseGemm dense_gemm_avx512();

}  // namespace quill
