// Prefill attention: a chunk of n new tokens of one sequence against its whole context (the
// positions before the chunk and the chunk itself, causal), read through the paged pool's slot
// table, the query heads grouped by their KV head (GQA), float32 throughout.
//
// One call handles one (KV head, block of query tokens): its rows are (token, query head) pairs,
// and key blocks of 64 positions stream past them flash-style -- scores = q K^T for the block,
// a running max and sum per row (online softmax), acc = acc * alpha + p V -- so K and V are read
// once per block of rows, never gathered, and no [n, S] score matrix exists.  The output lands
// token-major, [n, H, D], the layout the o projection reads.
//
// Every value is computed in one fixed order (dot products over D in order, softmax sums and
// p V over the keys in order, each product added with one rounding: FMA, std::fma in the scalar
// twin), so the scalar twin and each ISA variant -- the same template (prefill_tile.h) -- return
// identical bits.
#pragma once

#include <cstdint>
#include <string>

namespace quill {

struct PrefillArgs {
  const float* q = nullptr;        // [n, H, D] contiguous: the chunk's queries
  const float* k = nullptr;        // pool [N, Hkv, D] contiguous
  const float* v = nullptr;        // pool [N, Hkv, D] contiguous
  const uint16_t* k16 = nullptr;   // 16-bit pools instead (bfloat16, or float16 when f16): widened exactly
  const uint16_t* v16 = nullptr;   // as each key block is read (attention.h AttnArgs)
  bool f16 = false;
  const int64_t* ctx = nullptr;    // [start + n] pool rows of the context, in position order
  float* out = nullptr;            // [n, H, D] contiguous
  int64_t n = 0, start = 0;        // chunk tokens; positions before the chunk (token i sits at start + i)
  int64_t h = 0, hkv = 0, d = 0;
  float scale = 1.0f;
  // A sliding window: position p attends keys (p - window, p] only (attention.h AttnArgs); 0: [0, p].
  int64_t window = 0;
  // Attention sinks (attention.h AttnArgs): [H] logits in every row's softmax denominator; null: none.
  const float* sinks = nullptr;
};

constexpr int64_t kPrefillKeys = 64;  // keys per block, in every variant (it fixes the softmax's rounding)

// Query tokens per block for G query heads per KV head: rows = tokens x G stay at most 64.
inline int64_t prefill_tokens_per_block(int64_t g) { return g >= 64 ? 1 : 64 / g; }
// Rows padded to a multiple of 64 (every variant's row pass), columns of the accumulators to 64.
inline int64_t prefill_rows(int64_t r) { return (r + 63) / 64 * 64; }
inline int64_t prefill_cols(int64_t d) { return (d + 63) / 64 * 64; }
// Scratch floats one block of `tokens` query tokens needs (prefill_tile.h's layout): transposed
// queries, a key block's scores, the accumulators, a padded V block, a widened K block (16-bit
// pools), four per-row floats and an int64.
inline int64_t prefill_scratch(int64_t g, int64_t d, int64_t tokens) {
  const int64_t rp = prefill_rows(tokens * g), dp = prefill_cols(d);
  return d * rp + kPrefillKeys * rp + rp * dp + kPrefillKeys * dp + kPrefillKeys * d + 6 * rp;
}

// Query tokens [i0, i1) of KV head kv_head; scratch: prefill_scratch(G, D, i1 - i0) floats, 64-byte aligned.
using PrefillBlock = void (*)(const PrefillArgs&, int64_t kv_head, int64_t i0, int64_t i1, float* scratch);

PrefillBlock prefill_block_scalar();
PrefillBlock prefill_block_avx2();
PrefillBlock prefill_block_avx512();

}  // namespace quill
