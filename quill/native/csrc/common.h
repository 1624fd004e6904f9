// Shared declarations of quill's native linear kernels.
//
// Nothing here includes torch: the per-ISA translation units (scalar.cpp,
// avx2.cpp, avx512.cpp) see raw pointers only, so each compiles in seconds with
// its own -m flags, and one build runs on any x86-64 (the ISA is chosen at load).
//
// Weight layout ("row blocks of 16 lanes"): output rows are grouped in blocks
// of 16 (N padded to Np = 16 * NB); each SIMD lane owns one output row.  The
// input dimension is reordered into a *stream* of Kp positions (groups made
// contiguous for act-order, each segment padded to a whole chunk) and cut into
// chunks of CHUNK_K(bits) positions; one chunk of one row block is 64 bytes:
//
//   4-bit, chunk = 8 positions:  byte 4*r + b = q[r][8c + b] | q[r][8c + 4 + b] << 4   (r < 16, b < 4)
//   8-bit, chunk = 4 positions:  byte 4*r + b = q[r][4c + b]
//   5/6-bit, chunk = 8 positions: the 4-bit block of the low 4 bits, plus a high plane
//     of HB = bits - 4 bits per code, PLANE_BYTES(bits) = 16 * HB bytes per chunk:
//     lane r's high bits sit in byte 4 * (r % R) + b, R = 4 * HB rows of bytes, at bit
//     HB * (2 * (r / R) + n) for position 8c + 4n + b (n = 0: low nibble's, 1: high's).
//   2/3-bit, chunk = 16 positions: byte 4*r + b = sum_j (q[r][16c + 4j + b] & 3) << 2j  (j < 4),
//     3-bit adds a plane of the third bits, PLANE_BYTES(3) = 32 bytes per chunk: lane r's bit
//     of position 16c + 4j + b sits in byte 4 * (r % 8) + b at bit 4 * (r / 8) + j.
//     (GGUF Q2_K / Q3_K at their stored bits: 2 and 3 bits per code.)
//
//   codes   [NB, KC, 64]  uint8      (KC = Kp / CHUNK_K)
//   hplane  [NB, KC, PLANE_BYTES]  uint8, 5/6-bit only
//   scales  [NB, S, 16]   f32/f16/bf16, one per segment and row
//   zeros   [NB, S, 16]   uint8 (4-6 bit) / int16 (8-bit), or none (one constant zero, zconst)
//   offsets [NB, S, 16]   same dtype as scales, or none
//
// Two-level scales (GGUF K-quants: an f16 per 256-wide super-block times a 6-bit integer
// per 16/32-wide group): scales and offsets are int8 [NB, S, 16] and
//   super_scales / super_offsets [NB, S / GPS, 16] of scale_dtype,
//   scale[s, n] = super_scales[s / GPS, n] * scales[s, n]   (float32, exact: 11 x 8 bits)
// (every segment is one group; GPS groups per super-block).
// Packed sub-values (sub_bits 4 or 6, Q2_K's 4-bit and Q3_K's 6-bit sub-scales, so they cost
// the file's bits): scales / offsets are uint8 [NB, SR, 16] holding u = value + sub_bias,
//   sub_bits 4: SR = ceil(S / 2), segment s in row s / 2 at bit 4 * (s % 2) (a nibble);
//   sub_bits 6: SR = 3 * ceil(S / 4), segment s = 4g + j: low nibble in row 3g + j / 2 at bit
//     4 * (j % 2), high 2 bits in row 3g + 2 at bit 2j.
//
// A segment is a run of chunks sharing one scale (a quantization group, or a
// piece of one).  With raw codes q and activations x:
//
//   y[m, n] = sum_s ( scale[s, n] * (D[m, s, n] - zero[s, n] * X[m, s]) + offset[s, n] * X[m, s] )
//   D[m, s, n] = sum_{k in s} q[n, k] * x[m, k]        X[m, s] = sum_{k in s} x[m, k]
//
// Every kernel accumulates D and X in int32 exactly (int8 activations, or float
// activations as a 24-bit fixed-point image split in three int8 parts; SplitActs) and
// then applies the same float epilogue lane by lane, so each SIMD kernel reproduces
// its scalar twin bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>

// The per-segment helpers (scale loads, epilogues) sit inside the kernels' hottest loops; a
// call there cost the 2-bit kernel half its speed when gcc chose not to inline them.
#define QUILL_INLINE inline __attribute__((always_inline))
// The kernels' small loops over tokens / row blocks / parts / accumulators index register
// arrays; fully unrolled, those arrays stay in registers (a loop left rolled puts them on the stack).
#define QUILL_UNROLL _Pragma("GCC unroll 16")

namespace quill {

constexpr int LANES = 16;       // output rows per row block
constexpr int BLOCK_BYTES = 64;  // bytes of one chunk of one row block

// Software prefetch of the code stream into L2, 16 KiB ahead.  Small layers (a 135M
// model's 576-wide ones, 70-570 KB) end before the hardware prefetchers ramp up, and L1
// miss buffers alone cap a core near 12 GB/s from DRAM; with this prefetch SmolLM2-135M's
// 211 linears went from 7.0 to 4.6 ms per token.  Large layers were unchanged within
// the noise of the shared machine (a second, L1 prefetch 2 KiB ahead cost int8 kernels
// 15 % when weights sit in L2 and did not help from DRAM).
constexpr int PREFETCH_BYTES = 16384;

// Most tokens a kernel call receives: the binding cuts longer inputs into blocks.
constexpr int MAX_BLOCK_TOKENS = 252;

constexpr int chunk_k(int bits) { return bits == 8 ? 4 : (bits <= 3 ? 16 : 8); }
constexpr int plane_bytes(int bits) { return bits == 3 ? 32 : (bits > 4 && bits < 8 ? 16 * (bits - 4) : 0); }
// Rows of packed sub-values per row block (sub_bits 4 / 6; common.h layout above).
constexpr int64_t sub_rows(int sub_bits, int64_t nseg) { return sub_bits == 4 ? (nseg + 1) / 2 : 3 * ((nseg + 3) / 4); }

enum class DType : int32_t { F32 = 0, F16 = 1, BF16 = 2 };

// The prepared weight of one layer (read-only views; the binding owns the storage).
struct Weights {
  const uint8_t* codes = nullptr;  // [NB, KC, 64]
  const void* scales = nullptr;    // [NB, S, 16] of scale_dtype
  const void* zeros = nullptr;     // [NB, S, 16] uint8 (bits 4) / int16 (bits 8), or null
  const void* offsets = nullptr;   // [NB, S, 16] of scale_dtype, or null
  const uint8_t* hplane = nullptr;  // [NB, KC, plane_bytes(bits)] (5/6-bit), or null
  const void* super_scales = nullptr;   // [NB, S / gps, 16] of scale_dtype (two-level: scales are int8), or null
  const void* super_offsets = nullptr;  // [NB, S / gps, 16] of scale_dtype (two-level offsets), or null
  int32_t gps = 1;                      // groups (segments) per super-block
  int32_t sub_bits = 8;                 // two-level sub-values: 8 (int8 [NB, S, 16]) or packed 4 / 6 bits
  int32_t sub_bias = 0;                 // packed sub-values: value = stored u - sub_bias
  const int32_t* seg_end = nullptr;  // [S] exclusive end chunk of every segment
  const float* bias = nullptr;     // [N] or null
  const float* wsum = nullptr;     // [Np] row sums of the dequantized weight (asymmetric int8 activations), or null
  DType scale_dtype = DType::F32;
  int32_t bits = 4;
  int32_t n = 0;     // real output features
  int32_t nb = 0;    // row blocks
  int32_t kc = 0;    // chunks per row block
  int32_t nseg = 0;  // segments
  float zconst = 8.0f;  // zero point when zeros == null
  // Shortcuts of the segment epilogue, set with the layout (linear.cpp); both give the bits of
  // split_epilogue / seg_epilogue (scalar_util.h), which the scalar twin keeps computing in full:
  //   fold_zero: one zero point z != 0 for the whole layer (zconst) and no offsets: a segment's
  //     accumulators start at -z X (split: Dhi / Dlo at -z Xhi / -z Xlo), so they end holding D - z X,
  //     the same int32 (int8 kernels: only while |D| <= 2^24, where their float D - z X is exact too).
  //   fuse_t: |T| = |SHIFT (Dhi - z Xhi) + (Dlo - z Xlo)| < 2^31 in every segment (max |code - z| x
  //     positions x the image's QMAX; Q4_0 at 32 positions is 8 x 32 x 8355711 < 2^31; the 16-bit image
  //     always, 255 x 128 x 32639 < 2^31), so T is summed in
  //     int32 (wrapping on the way, exact at the end) and rounded once: the same float as the fmadd of
  //     its two exact halves.
  bool fold_zero = false;
  bool fuse_t = false;
  // Every segment at most 4 chunks (set with the layout, linear.cpp): AVX2's written-out 8-token tile
  // of 4-bit codes x int8 activations (avx2_tile8.h) sums a segment in int16 whole.
  bool short_segments = false;
};

// Offsets and no zero point (GGUF Q4_1, Q5_1 and the K-quants' mins: Q2_K, Q4_K, Q5_K): the float kernels'
// epilogue variant without zero-point terms.  (Never fold_zero, which needs a zero point and no offsets.)
inline bool offsets_only(const Weights& w) { return !w.zeros && w.zconst == 0.0f && w.offsets; }

// Float activations as a fixed-point image, one scale per token and segment, in one of two
// precisions (the layer's choice, SplitActs::parts; quantize_split in each TU, the definition
// the scalar one):
//
//   24 bits, 3 parts (the exact mode):
//     q = round(x * 8355711 / amax)   (|q| <= 8355711 = 127 * 65793, amax = max |x| over the segment)
//     q = 65536 * hi + 256 * mid + lo (three int8 parts; split_parts in scalar_util.h)
//   16 bits, 2 parts (the default):
//     q = round(x * 32639 / amax)     (|q| <= 32639 = 127 * 257)
//     q = 256 * hi + lo
//
// 24 bits: one position's error is at most amax / 16711422, i.e. 2^-24 of the segment's
// largest |x|, which is float32's own rounding unit, so a few large channels (AWQ folds
// its activation scales into the RMSNorm weights) no longer cost the others their
// precision.  16 bits: 2^-16 of amax per position, two int8 products per weight instead of
// three; on the real checkpoints of the tests mean KL 5e-8 against the 24-bit image
// (docs/ACCURACY.md), but 1.9e-3 in max |d logprob| on the AWQ cut, so the exact mode stays.
//
// Per chunk the stream holds the CK hi bytes, (the CK mid bytes,) then the CK lo bytes.
// Kernels form, per lane and segment, exactly in int32:
//   Dhi = sum(code * hi)                         |Dhi| <= 255 * 128 * 128
//   Dlo = 256 * sum(code * mid) + sum(code * lo) |Dlo| <= 255 * 32767 * 128 < 2^31  (3 parts)
//   Dlo = sum(code * lo)                                                            (2 parts)
// and with Xhi = sum(hi), Xlo = sum(q - SHIFT * hi) (qsum) the epilogue subtracts the zero
// point in int32 before any rounding: t = SHIFT * (Dhi - z * Xhi) + (Dlo - z * Xlo), SHIFT =
// 65536 (3 parts) or 256 (2 parts).
struct SplitActs {
  const int8_t* x = nullptr;      // [M, ld]
  const int32_t* qsum = nullptr;  // [M, S, 2] exact sums (Xhi, Xlo) over each segment
  const float* scale = nullptr;   // [M, S] amax / QMAX (NaN when the segment holds inf or NaN)
  int64_t ld = 0;
  int32_t m = 0;
  int32_t parts = 3;  // 3: the 24-bit image, 2: the 16-bit one
};

constexpr int SPLIT_PARTS = 3;  // int8 parts of one position's 24-bit image (the most of either image)

// Largest segment of the float kernels (positions): keeps Dlo and z * Xlo within int32
// for 8-bit codes (128 * 255 * 32767 < 2^31).
constexpr int SPLIT_MAX_SEGMENT = 128;
constexpr float SPLIT_QMAX = 8355711.0f;  // the 24-bit image's largest |q| whose hi part fits int8
constexpr float SPLIT16_QMAX = 32639.0f;  // the 16-bit image's
constexpr float split_qmax(int parts) { return parts == SPLIT_PARTS ? SPLIT_QMAX : SPLIT16_QMAX; }
// log2 SHIFT: the weight of the hi part
constexpr int split_shift_bits(int parts) { return parts == SPLIT_PARTS ? 16 : 8; }

// int8 activations, quantized per token (or per tensor) in stream order.
struct I8Acts {
  const int8_t* q = nullptr;     // [M, ld]
  const int32_t* qsum = nullptr;  // [M, S] exact sums of q over each segment
  const float* scale = nullptr;  // [M]
  const float* zero = nullptr;   // [M] (all 0 for symmetric)
  int64_t ld = 0;
  int32_t m = 0;
  bool asym = false;
  // [M, S] one scale per token and segment (ActQuant::per_segment), or null: `scale` per token.
  // Then segment s adds (with X its sum, g its scale, z / scale / offset the weight's):
  //   xg = X * g;  f += scale * (D * g - z * xg) [+ offset * xg]   (seg_epilogue_g; y = f + bias)
  const float* gscale = nullptr;
  // Two-level weights (GGUF K-quants) with llama.cpp's arithmetic (its Q8_K activations): gsuper = Weights::gps and
  // gscale [M, S / gsuper], one scale per token and super-block u; qsum stays per segment.  Per u and lane, exactly:
  //   A = sum_{s in u} sub_scale[s] * (D[s] - z X[s])     B = sum_{s in u} sub_offset[s] * X[s]   (int32)
  //   f = fma(super_scale * g, float(A), f)  [then f = fma(super_offset * g, float(B), f)]
  // one float epilogue per super-block instead of one per segment (linear.cpp checks A and B fit int32).
  int32_t gsuper = 0;
};

// Output: y[m * ld + n] for n < Weights::n, float32 or bfloat16.
struct Out {
  void* y = nullptr;
  int64_t ld = 0;
  DType dtype = DType::F32;
};

// How to quantize activations (quill/kernels/activation.py is the definition).
struct ActQuant {
  bool dynamic = true;
  bool symmetric = true;
  float scale = 0.0f;  // static only
  float zero = 0.0f;   // static only
  bool per_segment = false;  // dynamic symmetric: one scale per token and segment (the weight's groups)
};

// Raw float input of the activation quantizer and stream builders.
struct RawX {
  const void* x = nullptr;  // [M, K] row-major
  DType dtype = DType::F32;
  int64_t k = 0;            // real in_features
  const int64_t* src = nullptr;  // [Kp] source column of every stream position (-1: padding), or null = identity
  int64_t kp = 0;           // stream length
  const int32_t* seg_end = nullptr;  // [S] in chunks
  int32_t nseg = 0;
  int32_t chunk = 8;
  int32_t parts = 3;  // the split image's parts (quantize_split): 3 (24 bits) or 2 (16 bits)
};

// Every entry point of one ISA variant.  Kernels process row blocks [nb0, nb1)
// for all M tokens; quantizers process tokens [m0, m1).
struct KernelTable {
  const char* name;
  void (*gemm_split)(const Weights&, const SplitActs&, const Out&, int nb0, int nb1);
  void (*gemm_i8)(const Weights&, const I8Acts&, const Out&, int nb0, int nb1);
  // q [M, Kp] int8, qsum [M, S], scale [M], zero [M]; per_segment: gscale [M, S] instead of scale / zero
  void (*quantize)(const RawX&, const ActQuant&, int8_t* q, int32_t* qsum, float* scale, float* zero,
                   float* gscale, int m0, int m1);
  // the split stream of float activations (RawX::parts): x [M, KC * parts * CK], qsum [M, S, 2], scale [M, S]
  void (*quantize_split)(const RawX&, int8_t* x, int32_t* qsum, float* scale, int m0, int m1);
};

const KernelTable& table_scalar();
const KernelTable& table_avx2();
const KernelTable& table_avx512();

// Tokens [m0, m1) of `in` gathered into stream order (zeros at padding), float32 [M, Kp]:
// the input of the split quantizers when the order is not the identity (act-order).
void gather_stream(const RawX& in, float* out, int m0, int m1);

// Scalar helpers shared by every TU (exact, no ISA needed).
float to_float(const void* p, DType t, int64_t i);
uint16_t f32_to_bf16_rne(float f);
float bf16_to_f32(uint16_t h);

}  // namespace quill
