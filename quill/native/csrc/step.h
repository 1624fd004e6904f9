// A decode step of a Llama-family decoder (llama, qwen2, qwen3, Mistral-style) with every layer
// in one call: per layer RMSNorm -> q/k/v projections -> (Qwen3: per-head q/k RMSNorm) -> rope
// -> store k, v in the paged pools -> paged decode attention -> o projection -> residual ->
// RMSNorm -> gate/up -> SiLU-and-multiply -> down -> residual; or, in an MoE layer (Qwen3-MoE,
// Mixtral), RMSNorm -> router -> softmax top-k -> the routed experts (moe.cpp) -> residual.
// Gemma 3: each block's output RMSNormed before its residual (sandwich norms), gelu-tanh for SiLU,
// and the local layers' q and k turned by their own rotary table (forward takes one or more).
// Qwen3.5: q_proj gives each head a query and an output gate (o_proj reads attn * sigmoid(gate)),
// rotary over the first rotary_dim channels, an MoE layer's sigmoid-gated shared expert, and in
// place of attention in most layers a Gated DeltaNet mixer (step_recurrent.h) over each sequence's
// rows of the engine's state pools.
// gpt-oss: q/k/v/o biases, each query head's sink logit in its attention softmax, a biased router and
// routed experts with biases and a clamped SwiGLU (step_moe.h: the Python path's ExpertGroup).
// Gemma 4: each layer's own head size, KV heads and MLP width; values RMSNormed without a weight, taken from the
// keys in global layers (step_attn.h); KV-shared layers attending an earlier layer's pools and writing none; a
// per-layer input block and a layer scalar after the feed-forward residual (step_ple.h); in the MoE variant routed
// experts beside every dense MLP (step_moe.h).
//
// Why: a decode step of a small model spent more time in Python module calls and torch op
// dispatch around the kernels than in the kernels (default model: ~4 ms of a 12 ms token).
// Here the same native functions run in the same order on the same shapes as the Python
// layers (quill/models/llama.py through quill/kernels/fused.py), so the result is the Python
// path's bits; quill/layers/native_step.py builds a step only when every piece of every layer
// is one of these native functions, and checks the equality in its tests.
//
// Every token is a decode token (one new token per sequence): h [T, E], position cos/sin
// [1, T, D] per rotary table, the pool slot each token's k/v is written to [T], and each sequence's context
// slots [T, S] and length [T] as the paged attention reads them.  float32 compute; the KV pools
// float32, bfloat16 or float16 (rounded to nearest even as each k / v row is stored).
// Layers added with `local` keep their pools in the engine's sliding-window block group (a pool of its own
// size, blocks freed once out of every local layer's window): they write through local_slots [T] and read
// through local_ctx_slots [T, S] (the same positions, that group's rows; out-of-window blocks name its null
// block, never read).

// The class: its layers (add_layer's checks), the ops path, and forward_team's declaration (the team
// path and the Python binding: step.cpp).  Included by step.cpp only (one glue translation unit).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/ones.h>
#include <immintrin.h>
#include <omp.h>
#include <sched.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "attention.h"
#include "isa.h"
#include "kv_pool.h"
#include "linear_op.h"
#include "moe.h"
#include "ops.h"
#include "step_attn.h"
#include "step_layers.h"
#include "step_moe.h"
#include "step_ple.h"
#include "step_prof.h"
#include "step_recurrent.h"
#include "step_team.h"
#include "team.h"

namespace quill {
namespace {

class DecoderStep {
 public:
  DecoderStep(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double scale,
              std::string isa)
      : e_(hidden), h_(heads), hkv_(kv_heads), d_(head_dim), i_(intermediate), scale_(scale), isa_(std::move(isa)) {
    if (e_ < 1 || h_ < 1 || hkv_ < 1 || d_ < 2 || d_ % 2 || i_ < 1 || h_ % hkv_)
      step_fail("hidden ", e_, ", heads ", h_, ", kv_heads ", hkv_, ", head_dim ", d_, ", intermediate ", i_,
           ": expected positive sizes, an even head_dim and heads a multiple of kv_heads");
  }

  void add_layer(at::Tensor ln1, double eps1, at::Tensor ln2, double eps2, const std::vector<LinearOp*>& qkv,
                 const std::vector<std::optional<at::Tensor>>& qkv_bias, LinearOp* o, std::optional<at::Tensor> o_bias,
                 const std::vector<LinearOp*>& gate_up, const std::vector<std::optional<at::Tensor>>& gate_up_bias,
                 LinearOp* down, std::optional<at::Tensor> down_bias, std::optional<at::Tensor> q_norm,
                 std::optional<at::Tensor> k_norm, double qk_eps, at::Tensor k_pool, at::Tensor v_pool,
                 LinearOp* router, const ExpertGroup* experts, int64_t top_k, bool renormalize, int64_t window,
                 std::optional<at::Tensor> attn_out_norm, double attn_out_eps, std::optional<at::Tensor> ffn_out_norm,
                 double ffn_out_eps, const std::string& act, int64_t rope, bool output_gate, int64_t rotary_dim,
                 const std::vector<LinearOp*>& shared_gate_up,
                 const std::vector<std::optional<at::Tensor>>& shared_gate_up_bias, LinearOp* shared_down,
                 std::optional<at::Tensor> shared_down_bias, LinearOp* shared_gate, int64_t shared_intermediate,
                 const DeltaNetMixer* mixer, std::optional<at::Tensor> sinks, std::optional<at::Tensor> router_bias,
                 bool local, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double v_norm_eps, bool k_eq_v,
                 bool kv_shared, double layer_scalar, LinearOp* ple_gate, LinearOp* ple_proj,
                 std::optional<at::Tensor> ple_norm, double ple_eps, int64_t ple_index, const std::string& ple_act,
                 const std::vector<at::Tensor>& beside_norms, const std::vector<double>& beside_eps,
                 double router_mult) {
    const bool beside = !beside_norms.empty() || !beside_eps.empty();  // Gemma 4: experts beside the dense MLP
    // this layer's attention and MLP sizes (Gemma 4's local and global layers differ); 0: the step's
    const int64_t hkv = kv_heads ? kv_heads : hkv_, d = head_dim ? head_dim : d_, im = intermediate ? intermediate : i_;
    if (hkv < 1 || h_ % hkv || d < 2 || d % 2 || im < 1)
      step_fail("layer ", layers_.size(), ": kv_heads ", hkv, ", head_dim ", d, ", intermediate ", im,
                ": expected ", h_, " heads a multiple of kv_heads, an even head_dim and a positive intermediate");
    if ((kv_shared || k_eq_v || v_norm_eps >= 0) && mixer != nullptr)
      step_fail("a recurrent layer takes no value norm, values from keys or another layer's KV");
    if (window < 0) step_fail("window ", window, ": expected 0 (global) or a positive number of positions");
    if (local && (mixer != nullptr || window == 0))
      step_fail("only a sliding-window attention layer keeps its pools in the local block group");
    if (rope < 0) step_fail("rope table ", rope, ": expected an index >= 0 into forward's tables");
    if (rotary_dim < 0 || rotary_dim > d || rotary_dim % 2)
      step_fail("rotary_dim ", rotary_dim, ": expected 0 (all ", d, " channels) or an even count up to it");
    expect_f32(ln1, {e_}, "input_layernorm");
    expect_f32(ln2, {e_}, "post_attention_layernorm");
    // (a KV-shared layer computes no keys: its q norm comes alone)
    if (kv_shared ? k_norm.has_value() : q_norm.has_value() != k_norm.has_value())
      step_fail(kv_shared ? "a KV-shared layer takes no k_norm" : "q_norm and k_norm come together");
    if (q_norm) expect_f32(*q_norm, {d}, "q_norm");
    if (sinks && mixer != nullptr) step_fail("a recurrent layer takes no attention sinks");
    if (sinks) expect_f32(*sinks, {h_}, "sinks");  // [H] float32 (the Python path's Vector slot)
    if (router_bias && experts == nullptr) step_fail("a router bias without routed experts");
    if (k_norm) expect_f32(*k_norm, {d}, "k_norm");
    if (mixer != nullptr && (!qkv.empty() || mixer->hidden() != e_))
      step_fail("a recurrent layer takes its mixer's in-projections from hidden size ", e_, " and no q/k/v; found ",
                qkv.size(), " q/k/v linears, hidden size ", mixer->hidden());
    if (mixer == nullptr) {  // an attention layer: its KV pools
      if (k_pool.dim() != 3 || k_pool.size(1) != hkv)
        step_fail("'k_pool' should be [N, ", hkv, ", ", d, "], found ", k_pool.sizes());
      if (const std::string problem = pools_problem(k_pool, v_pool, d); !problem.empty()) step_fail(problem);
      if ((pool_rows_[0] >= 0 || pool_rows_[1] >= 0) && pool_type(k_pool) != kv_type_)
        step_fail("layer ", layers_.size(), "'s pools are ", k_pool.dtype(), "; an earlier layer's differ",
                  " (one KV cache type for every layer)");
    }
    if (o == nullptr) step_fail("o_proj is required");
    if (beside ? down == nullptr || experts == nullptr : (down == nullptr) != (experts != nullptr))
      step_fail(beside ? "experts beside the MLP take down_proj and routed experts"
                       : "a layer takes either down_proj or routed experts");
    Layer l;
    l.hkv = hkv, l.d = d, l.i = im, l.k_eq_v = k_eq_v, l.kv_shared = kv_shared, l.scalar = float(layer_scalar);
    if (v_norm_eps >= 0) l.v_eps = v_norm_eps, l.v_ones = at::ones({d}, ln1.options());
    set_per_layer_input(l, e_, ple_gate, ple_proj, std::move(ple_norm), ple_eps, ple_index, ple_act);  // step_ple.h
    l.ln1 = std::move(ln1), l.ln2 = std::move(ln2), l.eps1 = eps1, l.eps2 = eps2, l.window = window, l.local = local;
    l.attn_out_norm = opt_norm(std::move(attn_out_norm), e_, "attention output norm"), l.eps_ao = attn_out_eps;
    l.ffn_out_norm = opt_norm(std::move(ffn_out_norm), e_, "feed-forward output norm"), l.eps_fo = ffn_out_eps;
    l.act = activation(act), l.rope = rope;
    tables_ = std::max(tables_, rope + 1);
    l.gated = output_gate, l.rd = rotary_dim ? rotary_dim : d, l.mixer = mixer;
    if (mixer) {
      l.o = make_proj(o, std::move(o_bias), "out_proj", mixer->out_width(), e_);
      recurrent_ = true;
    } else {
      l.qkv = projs(qkv, qkv_bias, e_, qkv_widths(l), "q/k/v");
      l.o = make_proj(o, std::move(o_bias), "o_proj", h_ * d, e_);
    }
    if (experts != nullptr) {
      set_moe(l, e_, beside ? 0 : gate_up.size(), router, std::move(router_bias), experts, top_k, renormalize);
      set_beside(l, e_, beside_norms, beside_eps, router_mult);  // step_moe.h
      if (shared_down != nullptr)
        set_shared_expert(l, e_, shared_gate_up, shared_gate_up_bias, shared_down, std::move(shared_down_bias),
                          shared_gate, shared_intermediate);
    }
    if (down != nullptr) {
      l.gate_up = projs(gate_up, gate_up_bias, e_, {im, im}, "gate/up");
      l.down = make_proj(down, std::move(down_bias), "down_proj", im, e_);
    }
    l.q_norm = std::move(q_norm), l.k_norm = std::move(k_norm), l.qk_eps = qk_eps;
    if (!mixer) {
      int64_t& rows = pool_rows_[local];
      rows = rows < 0 ? k_pool.size(0) : std::min(rows, k_pool.size(0));
      kv_type_ = pool_type(k_pool);
      l.k_pool = std::move(k_pool), l.v_pool = std::move(v_pool);
      if (sinks) l.sinks = std::move(*sinks);
    }
    layers_.push_back(std::move(l));
  }

  int64_t num_layers() const { return int64_t(layers_.size()); }

  // Whether forward(team=true) of T tokens runs the team path, which makes every check and allocation
  // before it writes a state row or KV slot and cannot fail after: its caller need not keep copies of the
  // state rows to restore (native_step.py).  The ops path allocates between layers, so it can fail midway.
  bool all_or_nothing(int64_t t) const { return team_scratch(t) >= 0; }

  // h [T, E]; cos, sin: the rotary tables, each [1, T, D] (a layer turns by table `rope`); slots int64 [T];
  // ctx_slots int64 [T, S]; lens int64 [T]; state_rows int64 [T] (recurrent layers: each token's sequence's row
  // of the state pools, updated in place); local_slots int64 [T], local_ctx_slots int64 [T, S]: the same for
  // the layers of the sliding-window block group (required when there are such layers); per_layer float32
  // [T, L, P]: each token's per-layer inputs (Gemma 4; required when a layer has one) -> [T, E].
  // team: run the step inside one parallel region (below); false, or when a linear cannot take T
  // tokens in one call, runs the ops one after another (each splitting its own work) -- the same bits.
  at::Tensor forward(const at::Tensor& h_in, const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                     const at::Tensor& slots, const at::Tensor& ctx_slots, const at::Tensor& lens, bool team,
                     const std::optional<at::Tensor>& state_rows, const std::optional<at::Tensor>& local_slots,
                     const std::optional<at::Tensor>& local_ctx_slots,
                     const std::optional<at::Tensor>& per_layer) const {
    if (h_in.dim() != 2) step_fail("'h' should be float32 [T, ", e_, "], found ", h_in.sizes());
    const int64_t t = h_in.size(0);
    expect_f32(h_in, {t, e_}, "h");
    if (int64_t(cos.size()) < tables_ || sin.size() != cos.size())
      step_fail("the layers turn by ", tables_, " rotary tables; found ", cos.size(), " cos and ", sin.size(), " sin");
    for (const Layer& l : layers_) {  // each attention layer's table [1, T, its rotary dim]
      if (l.mixer) {
        if (!state_rows) step_fail("the recurrent layers need 'state_rows', int64 [", t, "]");
        deltanet_check_rows(*state_rows, t, l.mixer->state_rows(), "decoder step");
        continue;
      }
      expect_f32(cos[l.rope], {1, t, l.rd}, "cos");
      expect_f32(sin[l.rope], {1, t, l.rd}, "sin");
    }
    const int64_t* sl = checked_slots(slots, t, pool_rows_[0], false);
    const int64_t* lsl = nullptr;
    if (pool_rows_[1] >= 0) {  // layers in the local block group
      if (!local_slots || !local_ctx_slots)
        step_fail("the sliding-window layers' pools are a block group of their own: forward needs 'local_slots' "
                  "and 'local_ctx_slots'");
      lsl = checked_slots(*local_slots, t, pool_rows_[1], true);
      if (local_ctx_slots->scalar_type() != at::kLong || local_ctx_slots->sizes() != ctx_slots.sizes() ||
          !local_ctx_slots->is_contiguous())
        step_fail("'local_ctx_slots' should be contiguous int64 ", ctx_slots.sizes(), " (as ctx_slots), found ",
                  local_ctx_slots->dtype(), " ", local_ctx_slots->sizes());
    }
    const at::Tensor& lctx = lsl ? *local_ctx_slots : ctx_slots;
    const int64_t* rows = state_rows ? state_rows->data_ptr<int64_t>() : nullptr;
    check_per_layer(layers_, per_layer, t);  // step_ple.h
    if (team && team_scratch(t) >= 0)
      return forward_team(h_in, cos, sin, sl, ctx_slots, lens, rows, lsl, lctx, per_layer);
    at::Tensor h = h_in;
    for (const Layer& l : layers_) {
      const at::Tensor x = rms_norm(h, l.ln1, l.eps1);
      const at::Tensor a = l.mixer ? recurrent(l, x, rows)
                                   : l.local ? attention(l, x, cos[l.rope], sin[l.rope], lsl, lctx, lens)
                                             : attention(l, x, cos[l.rope], sin[l.rope], sl, ctx_slots, lens);
      h = at::add(h, l.attn_out_norm ? rms_norm(a, *l.attn_out_norm, l.eps_ao) : a);
      at::Tensor f = mlp(l, rms_norm(h, l.ln2, l.eps2));
      if (l.beside.on) f = beside_ops(l, h, f);  // Gemma 4's experts beside the MLP (step_moe.h)
      h = tail_ops(l, at::add(h, l.ffn_out_norm ? rms_norm(f, *l.ffn_out_norm, l.eps_fo) : f), per_layer);
    }
    return h;
  }

 private:
  // slots (int64 [t], contiguous) checked against a group's pool rows (none: no layer of that group)
  static const int64_t* checked_slots(const at::Tensor& slots, int64_t t, int64_t pool_rows, bool local) {
    const char* name = local ? "local_slots" : "slots";
    if (slots.scalar_type() != at::kLong || slots.sizes() != at::IntArrayRef({t}) || !slots.is_contiguous())
      step_fail("'", name, "' should be contiguous int64 [", t, "], found ", slots.dtype(), " ", slots.sizes());
    const int64_t* sl = slots.data_ptr<int64_t>();
    for (int64_t i = 0; pool_rows >= 0 && i < t; ++i)  // against the smallest pool of the group's layers
      if (sl[i] < 0 || sl[i] >= pool_rows)
        step_fail("token ", i, " writes pool row ", sl[i], "; the pool has ", pool_rows,
                  local ? " (local_slots: the sliding-window layers' block group)" : "");
    return sl;
  }

  // Scratch bytes every linear's team call of T tokens fits in, or -1 if one cannot take T at once.
  int64_t team_scratch(int64_t t) const {
    int64_t most = 0;
    for (const Layer& l : layers_) {
      std::vector<const Proj*> ps = {&l.o};
      if (l.experts) ps.push_back(&l.router);
      if (l.down.op) ps.push_back(&l.down);
      if (l.mixer)
        for (const Proj& p : l.mixer->proj()) ps.push_back(&p);
      for (const Proj& p : l.qkv) ps.push_back(&p);
      for (const Proj& p : l.gate_up) ps.push_back(&p);
      if (l.shared_down.op) ps.insert(ps.end(), {&l.shared_down, &l.shared_gate});
      for (const Proj& p : l.shared_gate_up) ps.push_back(&p);
      if (l.ple.index >= 0) ps.insert(ps.end(), {&l.ple.gate, &l.ple.proj});
      if (l.experts) {
        const int64_t b = l.experts->team_scratch(t);
        if (b < 0) return -1;
        most = std::max(most, b);
      }
      for (const Proj* p : ps) {
        const int64_t b = p->op->team_scratch(t);
        if (b < 0) return -1;
        most = std::max(most, b);
      }
    }
    return most;
  }

  at::Tensor forward_team(const at::Tensor& h_in, const std::vector<at::Tensor>& cos,
                          const std::vector<at::Tensor>& sin, const int64_t* slots, const at::Tensor& ctx_slots,
                          const at::Tensor& lens, const int64_t* state_rows, const int64_t* local_slots,
                          const at::Tensor& local_ctx_slots, const std::optional<at::Tensor>& per_layer) const;

  // x [T, E] -> [T, E]: the layer's DeltaNet mixer, state rows `rows` [T] (checked) updated in place
  at::Tensor recurrent(const Layer& l, const at::Tensor& x, const int64_t* rows) const {
    return l.o(l.mixer->forward(x, rows, *backend_));  // [T, Hv dv] -> [T, E]
  }

  // x [T, E] -> [T, E] (step_attn.h)
  at::Tensor attention(const Layer& l, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                       const int64_t* slots, const at::Tensor& ctx_slots, const at::Tensor& lens) const {
    return attention_ops(l, x, cos, sin, slots, ctx_slots, lens, qkv_widths(l), h_, scale_, isa_, backend_->kv_store,
                         kv_type_);
  }

  int64_t q_width(const Layer& l) const { return (l.gated ? 2 : 1) * h_ * l.d; }  // q_proj's [T, width]
  // q/k/v's widths: q, k, v; q, k (the values are the keys: Gemma 4's attention_k_eq_v); q alone (KV-shared)
  std::vector<int64_t> qkv_widths(const Layer& l) const {
    const int64_t kvd = l.hkv * l.d;
    if (l.kv_shared) return {q_width(l)};
    if (l.k_eq_v) return {q_width(l), kvd};
    return {q_width(l), kvd, kvd};
  }
  int64_t qkv_width(const Layer& l) const {  // the q/k/v row
    int64_t w = 0;
    for (int64_t x : qkv_widths(l)) w += x;
    return w;
  }

  // x [T, E] -> [T, E]
  at::Tensor mlp(const Layer& l, const at::Tensor& x) const {
    if (l.experts && !l.beside.on) return moe_ops(l, x);  // step_moe.h
    std::vector<at::Tensor> gu = outputs(l.gate_up, x, {l.i, l.i}, "gate/up");
    return l.down(l.act == Act::GeluTanh ? gelu_tanh_mul(gu[0], gu[1]) : silu_mul(gu[0], gu[1]));
  }

  int64_t e_, h_, hkv_, d_, i_;
  double scale_;
  std::string isa_;
  std::vector<Layer> layers_;
  // per block group (0: global layers', 1: the local group's) the rows of its smallest layer pool (the tables
  // are checked against it), -1: no layer of that group
  int64_t pool_rows_[2] = {-1, -1};
  bool recurrent_ = false;  // a layer is recurrent: forward takes each token's state row
  int64_t tables_ = 1;  // rotary tables forward takes (one more than the largest layer's `rope`)
  KVType kv_type_ = KVType::F32;  // every layer's pools
  const IsaBackend* backend_ = &backend_for(isa_, "decoder step");  // chosen once (isa.h)
};

}  // namespace
}  // namespace quill
