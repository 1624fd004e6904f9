// A decode step's Gated DeltaNet token mixer (Qwen3.5's linear_attn layers, step.cpp): the merged
// in-projections, then the native single-token update (deltanet.h: conv, delta rule, gated RMSNorm)
// against each sequence's conv and recurrent state, rows of the engine's state pools
// (quill/engine/state_cache.py) updated in place; out_proj is the layer's `o`.  The same functions
// on the same values as the Python layer's native decode (quill/layers/deltanet.py), so the same bits.
// Included by step.cpp only (one glue translation unit, quill/native/build.py).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>

#include <optional>
#include <vector>

#include "deltanet_op.h"
#include "isa.h"
#include "step_layers.h"

namespace quill {
namespace {

class DeltaNetMixer {
 public:
  // proj: one merged linear [T, E] -> [T, C + Hv dv + 2 Hv] (qkv, z, b, a), or the four; conv_w [C, K];
  // a_log, dt_bias [Hv]; norm_w [dv]; conv_state [N, C, K - 1], state [N, Hv, dk, dv] (the engine's pools,
  // borrowed); tiled: value head h reads key head h % Hk (GGUF), else h / (Hv / Hk).
  DeltaNetMixer(const std::vector<LinearOp*>& proj, const std::vector<std::optional<at::Tensor>>& proj_bias,
                at::Tensor conv_w, at::Tensor a_log, at::Tensor dt_bias, at::Tensor norm_w, double eps,
                at::Tensor conv_state, at::Tensor state, bool tiled)
      : conv_w_(std::move(conv_w)), a_log_(std::move(a_log)), dt_bias_(std::move(dt_bias)),
        norm_w_(std::move(norm_w)), conv_state_(std::move(conv_state)), state_(std::move(state)) {
    args_ = deltanet_layer(conv_w_, std::nullopt, a_log_, dt_bias_, norm_w_, eps, conv_state_, state_,
                           "decoder step: gated deltanet");
    args_.tiled = tiled;
    if (proj.empty() || proj[0] == nullptr) step_fail("gated deltanet: the in-projections are required");
    e_ = proj[0]->in_features();
    proj_ = projs(proj, proj_bias, e_, widths(), "gated deltanet in_proj qkv/z/b/a");
  }

  std::vector<int64_t> widths() const { return {args_.c, args_.hv * args_.dv, args_.hv, args_.hv}; }
  int64_t width() const { return args_.c + args_.hv * args_.dv + 2 * args_.hv; }  // the merged row
  int64_t hidden() const { return e_; }
  int64_t out_width() const { return args_.hv * args_.dv; }  // [T, Hv dv] what out_proj reads
  int64_t state_rows() const { return state_.size(0); }
  const std::vector<Proj>& proj() const { return proj_; }
  const DeltaNetArgs& args() const { return args_; }

  // The ops path: x [T, E] -> [T, Hv dv] (what out_proj reads), state rows `rows` [T] (checked by the
  // caller) updated in place.
  at::Tensor forward(const at::Tensor& x, const int64_t* rows, const IsaBackend& be) const {
    const int64_t t = x.size(0);
    std::vector<at::Tensor> parts = outputs(proj_, x, widths(), "gated deltanet in_proj qkv/z/b/a");
    const at::Tensor p = at::cat(parts, 1).contiguous();  // [T, width]: qkv, z, b, a
    at::Tensor conv_out = at::empty({t, args_.c}, x.options()), out = at::empty({t, out_width()}, x.options());
    const DeltaNetArgs a = step(p.data_ptr<float>(), width(), t, rows, conv_out.data_ptr<float>(), out.data_ptr<float>());
    std::vector<float> scratch(size_t(dnet_scratch(a.dk, a.dv)));
    deltanet_conv_share(a, be.dn_conv, 0, 1);  // every channel's conv before any head reads it
    deltanet_head_share(a, be.dn_head, 0, 1, scratch.data());
    return out;
  }

  // The update's arguments for T tokens: p [T, width()] the projections (rows ldp apart), rows int64 [T]
  // (checked by the caller), x [T, C] work memory, out [T, Hv dv].
  DeltaNetArgs step(const float* p, int64_t ldp, int64_t t, const int64_t* rows, float* x, float* out) const {
    DeltaNetArgs a = args_;
    a.qkv = p, a.ld_qkv = ldp;
    a.z = p + a.c, a.ld_z = ldp;
    a.b = p + a.c + a.hv * a.dv, a.a = a.b + a.hv, a.ld_ab = ldp;
    a.rows = rows, a.x = x, a.out = out, a.ld_out = a.hv * a.dv, a.b_count = t;
    return a;
  }

 private:
  at::Tensor conv_w_, a_log_, dt_bias_, norm_w_, conv_state_, state_;
  DeltaNetArgs args_;
  std::vector<Proj> proj_;
  int64_t e_ = 0;
};

}  // namespace
}  // namespace quill
