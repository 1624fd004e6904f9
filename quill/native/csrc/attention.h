// Decode attention: one query token per sequence against its cached keys and values, the
// query heads grouped by their KV head (GQA), float32 throughout.
//
// One call handles one (sequence b, KV head h): its G = H / Hkv query heads read each K
// and V row once.  Three passes over the S cached positions:
//   scores[g][s] = scale * dot(q[g], K[s])            (masked positions skipped)
//   p[g][s]      = exp(scores[g][s] - max_s), sum_g  (a polynomial exp, rel. error < 2e-7)
//   out[g]       = sum_s p[g][s] V[s] / sum_g
// Every sum runs in a fixed order (16 lane partials, then a fixed tree; p V key by key) and
// each product is added with one rounding (fused multiply-add: the instruction in the SIMD
// variants, std::fma in the scalar twin), so the scalar twin and each ISA variant -- the same
// template, vectorised by the compiler -- return identical bits.
#pragma once

#include <cstdint>
#include <string>

namespace quill {

struct AttnArgs {
  const float* q = nullptr;      // [B, H, D] contiguous
  const float* k = nullptr;      // [B, Hkv, S, D] with strides (kb, kh, ks), last dim contiguous
  const float* v = nullptr;      // as k, strides (vb, vh, vs)
  // Paged pools of 16-bit words instead (a 16-bit KV cache: bfloat16, or IEEE float16 when f16),
  // widened exactly to float32 as they are read: the same bits as float32 pools holding those
  // values.  Null: k / v.
  const uint16_t* k16 = nullptr;
  const uint16_t* v16 = nullptr;
  bool f16 = false;
  const uint8_t* mask = nullptr; // [B or 1, S] (1 = may attend) or null (every position)
  // Paged: row s of sequence b is pool row slots[b * slot_b + s] (k + row * ks + kv_head * kh;
  // kb and vb unused) for s < lens[b]; positions past lens[b] do not exist.  Null: dense rows.
  const int64_t* slots = nullptr; // [B, S] pool rows, or null
  const int64_t* lens = nullptr;  // [B] context lengths (<= S), with slots
  int64_t slot_b = 0;
  // Paged: a sliding window, sequence b attends its last `window` positions only (those past
  // lens[b] - window; the current token is one of them, as transformers counts); 0: all of them.
  int64_t window = 0;
  // Attention sinks (gpt-oss): one learned logit per query head [H] that joins each softmax's
  // denominator (max and sum) and weighs no value; null: none (every other model, and the decode step).
  // With sinks a call's scratch holds G * (S + D + 1) floats.
  const float* sinks = nullptr;
  float* out = nullptr;          // [B, H, D] contiguous
  int64_t kb = 0, kh = 0, ks = 0, vb = 0, vh = 0, vs = 0;
  int64_t mask_b = 0;            // mask row stride: S, or 0 when one row serves every sequence
  int64_t b = 0, h = 0, hkv = 0, s = 0, d = 0;
  float scale = 1.0f;
  // Query heads [g_begin, g_end) of each KV head's group (g_end < 0: all G).  Each query head's
  // result depends only on its own scores, so a group split across calls gives the same bits.
  int64_t g_begin = 0, g_end = -1;
};

// One (sequence, KV head); scratch holds G * (S + D) floats.  A paged call gives the same bits
// as the dense call on the gathered rows with the positions past each length masked.
using AttnHead = void (*)(const AttnArgs&, int64_t b, int64_t kv_head, float* scratch);

// The element type of a KV pool.
enum class KVType : uint8_t { F32, BF16, F16 };

// dst[0 .. n) = src[0 .. n) stored as `type`, rounded to nearest even (as torch's .to() rounds):
// one token's k or v row written into a pool.
using KVStore = void (*)(void* dst, const float* src, int64_t n, KVType type);

AttnHead attn_head_scalar();
AttnHead attn_head_avx2();
AttnHead attn_head_avx512();
KVStore kv_store_scalar();
KVStore kv_store_avx2();
KVStore kv_store_avx512();

}  // namespace quill
