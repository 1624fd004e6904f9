// A decode step's MoE block (step.cpp): router logits (its bias added: gpt-oss) -> each token's top-k
// softmax weights (moe.h route_token) -> the routed experts as one ExpertGroup (moe.cpp: the experts'
// biases and activation, SiLU or gpt-oss's clamped SwiGLU, are the group's) -> (Qwen2/3.5-MoE) plus
// sigmoid(shared_gate(x)) * the shared expert.  The functions the Python path's SparseMoeBlock calls
// (quill/layers/moe.py, quill/moe/grouped.py), in its order, so its bits.  The ops path and the team
// path's pieces; included by step.cpp only (one glue translation unit, quill/native/build.py).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/ones.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "moe.h"
#include "ops.h"
#include "step_layers.h"
#include "step_team.h"
#include "team.h"

namespace quill {
namespace {

// An MoE layer's shared expert (every token, scaled by sigmoid(shared_gate(x))) from hidden size e.
void set_shared_expert(Layer& l, int64_t e, const std::vector<LinearOp*>& gate_up,
                       const std::vector<std::optional<at::Tensor>>& gate_up_bias, LinearOp* down,
                       std::optional<at::Tensor> down_bias, LinearOp* gate, int64_t intermediate) {
  if (gate == nullptr || intermediate < 1)
    step_fail("a shared expert takes its gate linear and a positive intermediate size, found ", intermediate);
  l.si = intermediate;
  l.shared_gate_up = projs(gate_up, gate_up_bias, e, {l.si, l.si}, "shared gate/up");
  l.shared_down = make_proj(down, std::move(down_bias), "shared down_proj", l.si, e);
  l.shared_gate = make_proj(gate, std::nullopt, "shared expert gate", e, 1);
}

// The router ([T, E] -> [T, experts], its bias or none), the experts and top_k of an MoE layer of hidden size e;
// `dense_gate_up`: the gate/up linears given too (an MoE layer has none).
void set_moe(Layer& l, int64_t e, size_t dense_gate_up, LinearOp* router, std::optional<at::Tensor> router_bias,
             const ExpertGroup* experts, int64_t top_k, bool renormalize) {
  if (dense_gate_up || router == nullptr || experts->hidden() != e || top_k < 1 || top_k > experts->num_experts())
    step_fail("an MoE layer takes a router, experts of hidden size ", e, " and top_k in [1, ", experts->num_experts(),
              "], no gate/up; found ", dense_gate_up, " gate/up linears, experts of hidden size ", experts->hidden(),
              ", top_k ", top_k);
  l.router = make_proj(router, std::move(router_bias), "router", e, experts->num_experts());
  l.experts = experts, l.top_k = top_k, l.renormalize = renormalize;
}

// Gemma 4: the experts beside layer l's dense MLP (its router and experts set by set_moe).  norms: the experts'
// input norm, the MLP's and the experts' output norms, the router's input scale [E] and the per-expert scales
// [experts]; eps: those three norms', the router input's; router_mult: what the router's input is multiplied by.
void set_beside(Layer& l, int64_t e, const std::vector<at::Tensor>& norms, const std::vector<double>& eps,
                double router_mult) {
  if (norms.empty() && eps.empty()) return;
  if (norms.size() != 5 || eps.size() != 4 || l.experts == nullptr)
    step_fail("experts beside the MLP take routed experts, 5 tensors (input norm, the two output norms, router ",
              "scale, per-expert scales) and 4 eps; found ", norms.size(), " and ", eps.size());
  BesideMoE& b = l.beside;
  const char* what[] = {"experts' input norm", "MLP output norm", "experts' output norm", "router scale"};
  for (int i = 0; i < 4; ++i) expect_f32(norms[i], {e}, what[i]);
  expect_f32(norms[4], {l.experts->num_experts()}, "per-expert scales");
  b.on = true, b.in_norm = norms[0], b.out1 = norms[1], b.out2 = norms[2], b.router_scale = norms[3];
  b.expert_scale = norms[4], b.ones = at::ones({e}, norms[0].options());
  b.in_eps = eps[0], b.out1_eps = eps[1], b.out2_eps = eps[2], b.router_eps = eps[3];
  b.router_mult = float(router_mult);
}

// The ops path of the experts beside the MLP: h [T, E] the residual, f [T, E] the MLP's output -> [T, E].
at::Tensor beside_ops(const Layer& l, const at::Tensor& h, const at::Tensor& f) {
  const BesideMoE& b = l.beside;
  const at::Tensor r = at::mul(at::mul(rms_norm(h, b.ones, b.router_eps), b.router_scale), double(b.router_mult));
  auto [w, ids] = route_tokens(l.router(r), l.top_k, l.renormalize);  // [T, k] each
  w = at::mul(w, b.expert_scale.index_select(0, ids.reshape(-1)).view(ids.sizes()));
  const at::Tensor y = l.experts->forward(rms_norm(h, b.in_norm, b.in_eps), ids, w, false);  // [T, E]
  return at::add(rms_norm(f, b.out1, b.out1_eps), rms_norm(y, b.out2, b.out2_eps));
}

// The team path: token r's experts' input x2 and router input y2 from the residual bu.h (before a barrier).
void beside_inputs(const Layer& l, const TeamBufs& bu, int64_t r, int64_t e) {
  const BesideMoE& b = l.beside;
  rms_norm_f32(bu.h, b.in_norm.data_ptr<float>(), bu.x2, e, float(b.in_eps), r, r + 1);
  rms_norm_f32(bu.h, b.ones.data_ptr<float>(), bu.y2, e, float(b.router_eps), r, r + 1);
  const float* s = b.router_scale.data_ptr<float>();
  for (int64_t i = 0; i < e; ++i) bu.y2[r * e + i] = (bu.y2[r * e + i] * s[i]) * b.router_mult;
}

// The ops path: x [T, E] (the normed hidden states) -> [T, E].
at::Tensor moe_ops(const Layer& l, const at::Tensor& x) {
  const auto [w, ids] = route_tokens(l.router(x), l.top_k, l.renormalize);  // [T, k] each
  const at::Tensor routed = l.experts->forward(x, ids, w, false);  // [T, E]
  if (!l.shared_down.op) return routed;
  std::vector<at::Tensor> gu = outputs(l.shared_gate_up, x, {l.si, l.si}, "shared gate/up");
  return at::add(routed, at::mul(sigmoid(l.shared_gate(x)), l.shared_down(silu_mul(gu[0], gu[1]))));
}

// The team path's MoE memory, carved from one allocation: router logits [T, experts], routing weights
// [T, k] and ids [T, k], the experts' work memory; sized for the largest MoE layer (none: a dense model).
struct MoeMem {
  at::Tensor mem;
  float* logits = nullptr;
  float* w = nullptr;
  int64_t* ids = nullptr;
  char* work = nullptr;
};

MoeMem moe_memory(const std::vector<Layer>& layers, int64_t t, int threads, const at::TensorOptions& options) {
  int64_t most_experts = 0, most_k = 0, most_work = 0;
  for (const Layer& l : layers)
    if (l.experts) {
      most_experts = std::max(most_experts, l.experts->num_experts()), most_k = std::max(most_k, l.top_k);
      most_work = std::max(most_work, l.experts->work_bytes(t, l.top_k, threads));
    }
  MoeMem m;
  if (!most_experts) return m;
  m.mem = at::empty({align64(t * most_experts * 4) + 2 * align64(t * most_k * 8) + most_work}, options.dtype(at::kByte));
  m.logits = reinterpret_cast<float*>(m.mem.data_ptr());
  m.w = m.logits + align64(t * most_experts * 4) / 4;
  m.ids = reinterpret_cast<int64_t*>(m.w + align64(t * most_k * 8) / 4);
  m.work = reinterpret_cast<char*>(m.ids) + align64(t * most_k * 8);
  return m;
}

// Every thread of the team: layer l's MoE block of bu.xn [T, E] into bu.o [T, E]; r0..r1 this thread's tokens.
// The last writes to bu.o (the shared expert's) are this thread's own tokens: no barrier after them.
void moe_team(const Layer& l, const TeamBufs& bu, const MoeMem& m, int64_t t, int64_t e, int64_t r0, int64_t r1,
              char* scratch, int tid, int nt, SpinBarrier& bar) {
  const int64_t ne = l.experts->num_experts(), k = l.top_k;
  team_linears(&l.router, 1, bu.xn, t, m.logits, ne, scratch, tid, nt, bar, StepOp::Router);
  for (int64_t r = r0; r < r1; ++r) route_token(m.logits + r * ne, ne, k, l.renormalize, m.ids + r * k, m.w + r * k);
  bar.wait();
  step_profile().mark(tid, StepOp::Route);
  l.experts->team_forward(bu.xn, t, m.ids, m.w, k, bu.o, m.work, scratch, tid, nt, bar);  // (ends with a barrier)
  step_profile().mark(tid, StepOp::Experts);
  if (!l.shared_down.op) return;
  // the shared expert into bu.sh, its gate logit into bu.sg; o += sigmoid(gate) * shared, this thread's tokens
  team_linears(l.shared_gate_up.data(), l.shared_gate_up.size(), bu.xn, t, bu.gu, 2 * l.si, scratch, tid, nt, bar,
               StepOp::SharedGateUp);
  team_act(Act::Silu, bu.gu, bu.act, t, l.si, tid, nt);
  bar.wait();
  step_profile().mark(tid, StepOp::SharedAct);
  team_linears(&l.shared_down, 1, bu.act, t, bu.sh, e, scratch, tid, nt, bar, StepOp::SharedDown);
  team_linears(&l.shared_gate, 1, bu.xn, t, bu.sg, 1, scratch, tid, nt, bar, StepOp::SharedGate);
  for (int64_t r = r0; r < r1; ++r) {
    float sg;
    sigmoid_f32(bu.sg + r, &sg, 0, 1);
    for (int64_t i = 0; i < e; ++i) bu.o[r * e + i] += sg * bu.sh[r * e + i];
  }
}

// Every thread of the team: the experts beside layer l's MLP, whose output is in bu.o; after it
// bu.o = out1(o) + out2(experts), this thread's tokens r0..r1 (no barrier after).
void beside_team(const Layer& l, const TeamBufs& bu, const MoeMem& m, int64_t t, int64_t e, int64_t r0, int64_t r1,
                 char* scratch, int tid, int nt, SpinBarrier& bar) {
  const BesideMoE& b = l.beside;
  const int64_t ne = l.experts->num_experts(), k = l.top_k;
  const float* es = b.expert_scale.data_ptr<float>();
  team_linears(&l.router, 1, bu.y2, t, m.logits, ne, scratch, tid, nt, bar, StepOp::Router);
  for (int64_t r = r0; r < r1; ++r) {
    route_token(m.logits + r * ne, ne, k, l.renormalize, m.ids + r * k, m.w + r * k);
    for (int64_t j = 0; j < k; ++j) m.w[r * k + j] *= es[m.ids[r * k + j]];
  }
  bar.wait();
  step_profile().mark(tid, StepOp::Route);
  l.experts->team_forward(bu.x2, t, m.ids, m.w, k, bu.y2, m.work, scratch, tid, nt, bar);  // (ends with a barrier)
  step_profile().mark(tid, StepOp::Experts);
  for (int64_t r = r0; r < r1; ++r) {
    rms_norm_f32(bu.o, b.out1.data_ptr<float>(), bu.o, e, float(b.out1_eps), r, r + 1);
    rms_norm_f32(bu.y2, b.out2.data_ptr<float>(), bu.y2, e, float(b.out2_eps), r, r + 1);
    for (int64_t i = 0; i < e; ++i) bu.o[r * e + i] += bu.y2[r * e + i];
  }
}

}  // namespace
}  // namespace quill
