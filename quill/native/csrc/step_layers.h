// The pieces of a decoder step's layers (step.cpp): the linears with their biases, one layer's
// weights and options, and the checks the step makes of them.  Included by step.cpp only (one
// glue translation unit, quill/native/build.py).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kv_pool.h"
#include "linear_op.h"
#include "moe.h"
#include "ops.h"

namespace quill {
namespace {

template <class... A>
[[noreturn]] void step_fail(const A&... parts) {
  op_fail("decoder step", parts...);
}

// Row `slot` of a [N, Hkv, D] pool of any element type.
void* pool_row(const at::Tensor& pool, int64_t slot) {
  return static_cast<char*>(pool.data_ptr()) + slot * pool.stride(0) * pool.element_size();
}

void expect_f32(const at::Tensor& t, std::vector<int64_t> shape, const char* what) {
  if (t.scalar_type() != at::kFloat || t.sizes() != at::IntArrayRef(shape) || !t.is_contiguous())
    step_fail("'", what, "' should be contiguous float32 ", at::IntArrayRef(shape), ", found ", t.dtype(), " ", t.sizes());
}

// One [E] norm weight, or none.
std::optional<at::Tensor> opt_norm(std::optional<at::Tensor> w, int64_t e, const char* what) {
  if (w) expect_f32(*w, {e}, what);
  return w;
}

// The feed-forward activation of a gated MLP: act(gate) * up (ops.h)
enum class Act { Silu, GeluTanh };

Act activation(const std::string& name) {
  if (name == "silu") return Act::Silu;
  if (name == "gelu_pytorch_tanh") return Act::GeluTanh;
  step_fail("activation '", name, "': expected silu or gelu_pytorch_tanh");
}

// The first rd channels of each head of x [1, T, heads, D] turned by cos, sin [1, T, rd], in place.
void rotate(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t rd) {
  if (rd == x.size(3)) return rope_(x, cos, sin);
  at::Tensor part = x.narrow(3, 0, rd).contiguous();
  rope_(part, cos, sin);
  x.narrow(3, 0, rd).copy_(part);
}

// One linear and its bias.
struct Proj {
  LinearOp* op = nullptr;
  std::optional<at::Tensor> bias;
  at::Tensor bias_f32;  // float32 [N] (the team call's), undefined without a bias
  at::Tensor operator()(const at::Tensor& x) const { return op->run(x, bias); }  // [T, K] -> [T, N]
  const float* bias_ptr() const { return bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr; }
};

Proj make_proj(LinearOp* op, std::optional<at::Tensor> bias, const char* what, int64_t k, int64_t n) {
  if (op->in_features() != k || op->out_features() != n)
    step_fail(what, ": the linear is [", op->out_features(), ", ", op->in_features(), "], expected [", n, ", ", k, "]");
  Proj p{op, bias, {}};
  if (bias) {
    p.bias_f32 = bias->to(at::kFloat).contiguous();
    if (p.bias_f32.dim() != 1 || p.bias_f32.size(0) != n) step_fail(what, ": bias ", bias->sizes(), ", expected [", n, "]");
  }
  return p;
}

class DeltaNetMixer;  // step_recurrent.h

// Gemma 4's per-layer input: after the feed-forward residual, h += norm(proj(act(gate(h)) * u)), u the layer's
// slice [T, P] of forward's per-layer inputs [T, L, P] (computed in Python: an embedding lookup per token).
struct PerLayerInput {
  Proj gate;  // [T, E] -> [T, P]
  Proj proj;  // [T, P] -> [T, E]
  at::Tensor norm;  // [E]
  double eps = 0;
  int64_t index = -1;  // the layer's slice of the inputs; -1: no per-layer input
  int64_t p = 0;
  Act act = Act::GeluTanh;  // act(gate(h)) * u
};

// Gemma 4's routed experts beside the dense MLP (an MoE layer's router, experts and top_k): the router reads
// rms(h) * router_scale * router_mult (h the residual, the norm weightless), its renormalized top-k weights times
// per-expert scales; the experts read in_norm(h); the feed-forward output is out1(mlp) + out2(experts).
struct BesideMoE {
  bool on = false;
  at::Tensor in_norm, out1, out2, router_scale, ones;  // [E]
  at::Tensor expert_scale;  // [experts]
  double in_eps = 0, out1_eps = 0, out2_eps = 0, router_eps = 0;
  float router_mult = 1;
};

struct Layer {
  const DeltaNetMixer* mixer = nullptr;  // a recurrent layer's token mixer (no q/k/v, no KV pools); o its out_proj
  at::Tensor ln1, ln2;  // [E]
  double eps1 = 0, eps2 = 0;
  // sandwich norms (Gemma 3): the attention's and the feed-forward block's outputs normed before their residual
  std::optional<at::Tensor> attn_out_norm, ffn_out_norm;  // [E]
  double eps_ao = 0, eps_fo = 0;
  Act act = Act::Silu;
  int64_t rope = 0;  // which of the step's rotary tables q and k turn by (Gemma 3's local layers: their own)
  int64_t rd = 0;    // the channels of each head turned (partial rotary: fewer than head_dim)
  bool gated = false;  // Qwen3.5: q_proj gives per head [query D, gate D]; o_proj reads attn * sigmoid(gate)
  // an MoE layer's shared expert (Qwen2/3.5-MoE): routed + sigmoid(shared_gate(x)) * down(silu(gate) * up)
  std::vector<Proj> shared_gate_up;  // one merged [T, 2 si], or gate, up
  Proj shared_down;                  // [T, si] -> [T, E]
  Proj shared_gate;                  // [T, E] -> [T, 1]
  int64_t si = 0;
  std::vector<Proj> qkv;      // one merged [T, (H + 2 Hkv) D], or q, k, v
  Proj o;                     // [T, H D] -> [T, E]
  std::vector<Proj> gate_up;  // one merged [T, 2 I], or gate, up
  Proj down;                  // [T, I] -> [T, E]
  Proj router;                       // MoE layers: [T, E] -> [T, experts] router logits (its bias: gpt-oss)
  const ExpertGroup* experts = nullptr;  // MoE layers: the routed experts (no gate_up / down then)
  int64_t top_k = 0;
  bool renormalize = false;
  std::optional<at::Tensor> q_norm, k_norm;  // [D] (Qwen3)
  double qk_eps = 0;
  int64_t window = 0;  // a local layer's sliding window (attention.h AttnArgs), 0: global
  // its pools are the engine's sliding-window block group: forward's local_slots / local_ctx_slots address them
  bool local = false;
  at::Tensor sinks;    // gpt-oss: float32 [H], one logit per query head in its softmax's denominator; undefined: none
  at::Tensor k_pool, v_pool;  // [N, Hkv, D] (a KV-shared layer: the pools of the layer it reads)
  int64_t hkv = 0, d = 0, i = 0;  // this layer's KV heads, head dim and MLP intermediate (Gemma 4's differ)
  // Gemma 4: values RMSNormed without a weight (v_ones: [D] ones, the norm's weight) before they are stored
  double v_eps = -1;  // < 0: no value norm
  at::Tensor v_ones;
  bool k_eq_v = false;  // the values are the keys before their norm and rope (no v_proj)
  bool kv_shared = false;  // attends k_pool / v_pool, another layer's, written earlier in the step; writes none
  float scalar = 1.0f;  // the layer's output multiplied by it (Gemma 4's layer_scalar)
  PerLayerInput ple;
  BesideMoE beside;
};

// One merged linear over every width, or one linear per width.
std::vector<Proj> projs(const std::vector<LinearOp*>& ops, const std::vector<std::optional<at::Tensor>>& biases,
                        int64_t k, const std::vector<int64_t>& widths, const char* what) {
  if ((ops.size() != 1 && ops.size() != widths.size()) || biases.size() != ops.size())
    step_fail(what, ": expected 1 merged or ", widths.size(), " separate linears with as many biases, found ", ops.size(),
         " and ", biases.size());
  int64_t total = 0;
  for (int64_t w : widths) total += w;
  std::vector<Proj> out;
  for (size_t i = 0; i < ops.size(); ++i) {
    if (ops[i] == nullptr) step_fail(what, ": linear ", i, " is None");
    out.push_back(make_proj(ops[i], biases[i], what, k, ops.size() == 1 ? total : widths[i]));
  }
  return out;
}

// Column blocks [offset, offset + width) of one merged output, or the separate outputs.
std::vector<at::Tensor> outputs(const std::vector<Proj>& ps, const at::Tensor& x, const std::vector<int64_t>& widths,
                                const char* what) {
  std::vector<at::Tensor> out;
  if (ps.size() == 1) {
    const at::Tensor y = ps[0](x);  // [T, sum(widths)]
    int64_t total = 0;
    for (int64_t w : widths) total += w;
    if (y.dim() != 2 || y.size(1) != total) step_fail(what, ": the merged linear gave ", y.sizes(), ", expected [T, ", total, "]");
    int64_t at = 0;
    for (int64_t w : widths) {
      out.push_back(y.narrow(1, at, w));
      at += w;
    }
    return out;
  }
  for (size_t i = 0; i < ps.size(); ++i) {
    out.push_back(ps[i](x));
    if (out.back().dim() != 2 || out.back().size(1) != widths[i])
      step_fail(what, ": linear ", i, " gave ", out.back().sizes(), ", expected [T, ", widths[i], "]");
  }
  return out;
}

}  // namespace
}  // namespace quill
