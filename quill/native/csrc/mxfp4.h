// MXFP4 linears at their stored 4.25 bits per weight: FP4 E2M1 codes with one E8M0 (power-of-two)
// scale per 32 input columns, with float32 activations or int8 activations quantized per 32 columns.
//
// Layout (quill/native/mxfp4_pack.py): rows in blocks of 16 (one per SIMD lane, N padded with zero
// rows), columns in groups of 32 (K is a multiple of 32); one 32-bit lane holds 4 consecutive columns
// of one row, so one 64-byte load is 16 rows x 4 columns, ready for a 4-byte dot product per lane:
//
//   codes  [NB, G, 4 jj, 16 r, 4 b]  byte = q[16 nb + r][32 g + 4 jj + b] | q[16 nb + r][32 g + 4 jj + b + 16] << 4
//   scales [NB, G, 16 r]             E8M0 exponent e of row 16 nb + r, group g
//
// (ggml's block_mxfp4 order within a row: low nibbles are columns 0..15, high 16..31.)  Values in
// ggml's convention, exact: a code is 2 x E2M1 (kvalues_mxfp4, integers in [-12, 12]) and the scale
// 2^(e - 128) (ggml_e8m0_to_fp32_half), so w = kv[q] * 2^(e - 128) = E2M1[q] * 2^(e - 127).
//
//   float:  f += (sum_j kv[q_j] x_j) * s          (fma; the sum in float32, two chains per group:
//                                                  columns 0..15 and 16..31, each in column order)
//   int8:   f += (float(sum_j kv[q_j] x8_j) * g) * s   (exact int32 sum; g the activations' group scale)
//
// The int8 sum is an exact integer, so each variant forms it in its own order: the SIMD ones take
// unsigned codes kv + 12 (in [0, 24], for vpdpbusd / vpmaddubsw) and start at -12 * sum_j x8_j.
// s a power of two, so each step rounds once.  The kernel (mxfp4_tile.h) is written once over a
// 16-lane vector type (the int8 group sum is the type's own), so the AVX2 / AVX-512 variants return
// the scalar twin's bits.
#pragma once

#include <cstdint>

#include "common.h"

namespace quill {

constexpr int MX_GROUP = 32;
constexpr int MX_GROUP_BYTES = 256;  // codes of one row block and group: 4 quads x 16 rows x 4 bytes
constexpr int MX_QUAD_BYTES = 64;    // 16 rows x 4 columns (and their partners 16 columns on)
constexpr int MX_KV_BIAS = 12;       // kv + 12 >= 0: the SIMD int8 kernels' unsigned codes

struct Mxfp4Weights {
  const uint8_t* codes = nullptr;   // [NB, G, 4, 16, 4]
  const uint8_t* scales = nullptr;  // [NB, G, 16]
  const float* bias = nullptr;      // [N] or null
  int32_t n = 0;                    // real output features
  int32_t nb = 0;                   // row blocks
  int32_t groups = 0;               // K / 32
};

struct Mxfp4Acts {
  const float* x = nullptr;        // float: [M, ld] float32
  const int8_t* q = nullptr;       // int8: [M, ld] codes, 32 per group
  const float* gscale = nullptr;   // int8: [M, G] the group scales
  const int32_t* qsum = nullptr;   // int8: [M, G] exact sums of each group's 32 codes
  int64_t ld = 0;
  int32_t m = 0;
};

struct Mxfp4Kernels {
  void (*gemm_f32)(const Mxfp4Weights&, const Mxfp4Acts&, const Out&, int nb0, int nb1);
  void (*gemm_i8)(const Mxfp4Weights&, const Mxfp4Acts&, const Out&, int nb0, int nb1);
};

const Mxfp4Kernels& mxfp4_scalar();
const Mxfp4Kernels& mxfp4_avx2();
const Mxfp4Kernels& mxfp4_avx512();

// ggml_e8m0_to_fp32_half: 2^(e - 128) as float32 bits (subnormal for e < 2).
inline uint32_t e8m0_half_bits(uint32_t e) { return e < 2 ? 0x00200000u << e : (e - 1) << 23; }

}  // namespace quill
