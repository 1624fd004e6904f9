// The Gated DeltaNet decode update (Qwen3.5's linear-attention layers): one new token per
// sequence against its recurrent state, float32 throughout.  What transformers'
// Qwen3_5GatedDeltaNet computes between its in-projections and out_proj at decode
// (causal_conv1d_update, then torch_recurrent_gated_delta_rule, then Qwen3_5RMSNormGated).
//
// Sizes: Hk key heads and Hv value heads (Hv a multiple of Hk: value head h reads key head
// h / (Hv / Hk), transformers' repeat_interleave; or h % Hk when `tiled`, the order llama.cpp's
// converter stores the value heads in), head dims dk and dv, C = 2 Hk dk + Hv dv conv
// channels (q, then k, then v), conv kernel K.  Two passes, each split across threads:
//
//  conv (per sequence, channel range): x = silu(sum_t w[c][t] * window[t]) over the last K
//    inputs of the channel (K - 1 in the conv state, then the new one); the state shifts by one.
//  head (per sequence, value head h, key head kh):
//    q = l2norm(x_q[kh]) / sqrt(dk), k = l2norm(x_k[kh])       (eps 1e-6 inside the rsqrt)
//    g = -exp(A_log[h]) * softplus(a[h] + dt_bias[h]), beta = sigmoid(b[h])
//    S *= exp(g); mem = S^T k; delta = (x_v[h] - mem) * beta; S += k delta^T; o = S^T q
//    out = rmsnorm(o) * norm_w * silu(z[h])                    (over dv, eps `eps`)
//
// Every product is added with one rounding (std::fma in the scalar twin, the instruction in the
// SIMD variants), every sum over lanes runs in one fixed order (16 partials, a fixed tree), and
// exp is one polynomial; so the scalar twin and each ISA variant -- the same template, vectorised
// by the compiler (deltanet_tile.h) -- give identical bits.
#pragma once

#include <cstdint>

namespace quill {

struct DeltaNetArgs {
  // this step's inputs, one row per sequence
  const float* qkv = nullptr;     // [B, C] the in_proj_qkv output (rows ld_qkv apart)
  const float* z = nullptr;       // [B, Hv * dv] the output gate (rows ld_z apart)
  const float* a = nullptr;       // [B, Hv] the decay input (rows ld_ab apart)
  const float* b = nullptr;       // [B, Hv] the beta input (rows ld_ab apart)
  int64_t ld_qkv = 0, ld_z = 0, ld_ab = 0;
  // the layer's weights
  const float* conv_w = nullptr;  // [C, K] depthwise conv1d weight
  const float* conv_b = nullptr;  // [C] or null (Qwen3.5 has none)
  const float* a_log = nullptr;   // [Hv]
  const float* dt_bias = nullptr; // [Hv]
  const float* norm_w = nullptr;  // [dv] the gated RMSNorm's weight
  float eps = 1e-6f;              // the gated RMSNorm's epsilon
  // per-sequence state, pools of rows: sequence i owns row rows[i] of both (updated in place)
  float* conv_state = nullptr;    // [N, C, K - 1]
  float* state = nullptr;         // [N, Hv, dk, dv]
  const int64_t* rows = nullptr;  // [B]
  float* x = nullptr;             // [B, C] the conv pass's output, the head pass's input (rows C apart)
  float* out = nullptr;           // [B, Hv * dv] (rows ld_out apart)
  int64_t ld_out = 0;
  int64_t b_count = 0, hk = 0, hv = 0, dk = 0, dv = 0, c = 0, k = 0;
  bool tiled = false;  // value head h reads key head h % hk (GGUF), else h / (hv / hk) (transformers)
};

// Channels [c0, c1) of sequence i: conv step, conv state shifted, silu into x.
using DnConv = void (*)(const DeltaNetArgs&, int64_t i, int64_t c0, int64_t c1);
// Value head h of sequence i (after the conv pass of its channels); scratch holds
// dnet_scratch(dk, dv) floats.
using DnHead = void (*)(const DeltaNetArgs&, int64_t i, int64_t h, float* scratch);

inline int64_t dnet_scratch(int64_t dk, int64_t dv) { return 2 * dk + 2 * dv + 64; }

DnConv dn_conv_scalar();
DnConv dn_conv_avx2();
DnConv dn_conv_avx512();
DnHead dn_head_scalar();
DnHead dn_head_avx2();
DnHead dn_head_avx512();

}  // namespace quill
