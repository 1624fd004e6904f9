// The team path's attention preparation, one token at a time (step.cpp's forward_team): q (and Qwen3.5's
// output gate), k and v out of the layer's q/k/v row, q and k normed (Qwen3, Gemma) and rotated, v normed
// without a weight (Gemma 4), k and v stored in the layer's pools.  Each layer has its own head size and
// KV heads (Gemma 4's global layers are wider); a KV-shared layer (Gemma 4) takes only its query.  And the ops
// path's attention (attention_ops), the same ops on tensors, so the same bits.  Included by step.cpp only (one glue TU).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/mul.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "attention.h"
#include "ops.h"
#include "step_layers.h"
#include "step_team.h"

namespace quill {
namespace {

// The sizes of layer l's attention rows: q_proj's width qw, the q/k/v row's lw, H query heads.
struct AttnRow {
  int64_t h, qw, lw;
};

// Token r of layer l: bu.proj's row r (lw wide) -> bu.q [T, H D] (bu.gate when gated), and unless KV-shared the
// key and value rows stored at pool row `slot` (k through bu.k, a normed v through bu.v); cos, sin [T, rd].
void attn_prep_token(const Layer& l, const TeamBufs& bu, const AttnRow& w, int64_t r, const float* cos,
                     const float* sin, int64_t slot, KVStore store, KVType type) {
  const int64_t d = l.d, hd = w.h * d, kvd = l.hkv * d;
  float* q = bu.q + r * hd;
  const float* row = bu.proj + r * w.lw;
  if (l.gated)  // per head [query D, gate D]
    for (int64_t j = 0; j < w.h; ++j) {
      std::copy(row + j * 2 * d, row + j * 2 * d + d, q + j * d);
      std::copy(row + j * 2 * d + d, row + (j + 1) * 2 * d, bu.gate + r * hd + j * d);
    }
  else
    std::copy(row, row + hd, q);
  if (l.q_norm) rms_norm_f32(q, l.q_norm->data_ptr<float>(), q, d, float(l.qk_eps), 0, w.h);
  rope_f32(bu.q, cos, sin, w.h, l.rd, d, r, r + 1);
  if (l.kv_shared) return;  // its source layer stored this token's k and v earlier in the step
  float* k = bu.k + r * kvd;
  std::copy(row + w.qw, row + w.qw + kvd, k);
  const float* v = l.k_eq_v ? row + w.qw : row + w.qw + kvd;  // (k_eq_v: the keys before their norm and rope)
  if (l.v_eps >= 0) {
    rms_norm_f32(v, l.v_ones.data_ptr<float>(), bu.v + r * kvd, d, float(l.v_eps), 0, l.hkv);
    v = bu.v + r * kvd;
  }
  if (l.k_norm) rms_norm_f32(k, l.k_norm->data_ptr<float>(), k, d, float(l.qk_eps), 0, l.hkv);
  rope_f32(bu.k, cos, sin, l.hkv, l.rd, d, r, r + 1);
  store(pool_row(l.k_pool, slot), k, kvd, type);
  store(pool_row(l.v_pool, slot), v, kvd, type);
}

// The ops path: layer l's attention of x [T, E] -> [T, E] (o_proj included); widths: its q/k/v outputs', h query
// heads; the new k and v rows stored through `store` at pool rows slots[T] unless the layer is KV-shared.
at::Tensor attention_ops(const Layer& l, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                         const int64_t* slots, const at::Tensor& ctx_slots, const at::Tensor& lens,
                         const std::vector<int64_t>& widths, int64_t h, double scale, const std::string& isa,
                         KVStore store, KVType type) {
  const int64_t t = x.size(0), d = l.d, row = l.hkv * d;
  std::vector<at::Tensor> qkv = outputs(l.qkv, x, widths, "q/k/v");
  const at::Tensor qg = qkv[0].reshape({1, t, h, l.gated ? 2 * d : d});  // per head: query (, gate)
  at::Tensor q = qg.narrow(3, 0, d);
  q = l.q_norm ? rms_norm(q, *l.q_norm, l.qk_eps) : q.contiguous();  // [1, T, H, D]
  rotate(q, cos, sin, l.rd);
  if (!l.kv_shared) {  // (a KV-shared layer attends what its source layer stored)
    at::Tensor k = qkv[1].reshape({1, t, l.hkv, d});
    at::Tensor v = l.k_eq_v ? qkv[1] : qkv[2];  // [T, Hkv D], rows `v.stride(0)` apart (k_eq_v: the raw keys)
    if (l.v_eps >= 0)
      v = rms_norm(v.reshape({t, l.hkv, d}), l.v_ones, l.v_eps).view({t, row});
    else if (l.k_eq_v)
      v = v.clone();  // (k may be rotated in place below)
    k = l.k_norm ? rms_norm(k, *l.k_norm, l.qk_eps) : k.contiguous();  // [1, T, Hkv, D]
    rotate(k, cos, sin, l.rd);
    const float* kr = k.data_ptr<float>();
    const float* vr = v.data_ptr<float>();
    for (int64_t i = 0; i < t; ++i) {
      store(pool_row(l.k_pool, slots[i]), kr + i * row, row, type);
      store(pool_row(l.v_pool, slots[i]), vr + i * v.stride(0), row, type);
    }
  }
  const std::optional<at::Tensor> sinks = l.sinks.defined() ? std::optional<at::Tensor>(l.sinks) : std::nullopt;
  const at::Tensor out = paged_decode_attention(q.view({t, h, 1, d}), l.k_pool, l.v_pool, ctx_slots, lens, scale,
                                                isa, l.window, sinks);  // [T, H, 1, D]
  if (!l.gated) return l.o(out.view({t, h * d}));
  return l.o(at::mul(out.view({t, h * d}), sigmoid(qg.narrow(3, d, d).reshape({t, h * d}))));
}

}  // namespace
}  // namespace quill
