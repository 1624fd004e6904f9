// Gemma 4's layer tail in the decode step (step.cpp): after the feed-forward residual, the per-layer input
// block h += norm(proj(act(gate(h)) * u)) (u: the layer's slice of the per-token per-layer inputs, computed in
// Python before the call), then h *= layer_scalar.  The functions the Python layer calls
// (quill/models/gemma4.py DecoderLayer.forward: the linears' kernels, gelu_tanh_mul, rms_norm), in its order,
// so its bits.  The ops path's and the team path's pieces; included by step.cpp only (one glue TU).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/mul.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>
#include <utility>

#include "ops.h"
#include "step_layers.h"
#include "step_team.h"
#include "team.h"

namespace quill {
namespace {

// Layer l's per-layer input block from hidden size e: gate [E -> P], proj [P -> E], norm [E]; index: its slice.
void set_per_layer_input(Layer& l, int64_t e, LinearOp* gate, LinearOp* proj, std::optional<at::Tensor> norm,
                         double eps, int64_t index, const std::string& act) {
  if (gate == nullptr && proj == nullptr && !norm && index < 0) return;
  if (gate == nullptr || proj == nullptr || !norm || index < 0)
    step_fail("a per-layer input takes its gate and projection linears, its norm and an index >= 0; found index ",
              index);
  l.ple.p = gate->out_features();
  l.ple.gate = make_proj(gate, std::nullopt, "per_layer_input_gate", e, l.ple.p);
  l.ple.proj = make_proj(proj, std::nullopt, "per_layer_projection", l.ple.p, e);
  expect_f32(*norm, {e}, "post_per_layer_input_norm");
  l.ple.norm = std::move(*norm), l.ple.eps = eps, l.ple.index = index, l.ple.act = activation(act);
}

// per_layer: float32 [T, L, P] covering every layer's slice (none: no layer has a per-layer input)
void check_per_layer(const std::vector<Layer>& layers, const std::optional<at::Tensor>& u, int64_t t) {
  int64_t need = 0, p = 0;
  for (const Layer& l : layers)
    if (l.ple.index >= 0) need = std::max(need, l.ple.index + 1), p = l.ple.p;
  if (!need) return;
  if (!u || u->dim() != 3 || u->size(1) < need)
    step_fail("the per-layer inputs should be float32 [", t, ", >= ", need, ", ", p, "], found ",
              u ? u->sizes() : at::IntArrayRef{});
  expect_f32(*u, {t, u->size(1), p}, "per_layer");
}

// The ops path's tail of layer l: h [T, E] (its feed-forward residual added) -> [T, E]; u [T, L, P].
at::Tensor tail_ops(const Layer& l, at::Tensor h, const std::optional<at::Tensor>& u) {
  if (l.ple.index >= 0) {
    const at::Tensor g = l.ple.gate(h);  // [T, P]
    const at::Tensor ui = u->select(1, l.ple.index).contiguous();  // [T, P]
    const at::Tensor a = l.ple.act == Act::GeluTanh ? gelu_tanh_mul(g, ui) : silu_mul(g, ui);
    h = at::add(h, rms_norm(l.ple.proj(a), l.ple.norm, l.ple.eps));
  }
  return l.scalar != 1.0f ? at::mul(h, double(l.scalar)) : h;
}

// The team path: layer l's per-layer input block, from bu.h (its feed-forward residual added by the caller,
// behind a barrier) into bu.o [T, E] (the deferred residual, ffn_residual, norms and adds it); u [T, L, P].
void ple_team(const Layer& l, const TeamBufs& bu, const float* u, int64_t layers, int64_t t, int64_t e, int64_t r0,
              int64_t r1, char* scratch, int tid, int nt, SpinBarrier& bar) {
  const int64_t p = l.ple.p;
  team_linears(&l.ple.gate, 1, bu.h, t, bu.pg, p, scratch, tid, nt, bar, StepOp::PleGate);
  for (int64_t r = r0; r < r1; ++r)
    (l.ple.act == Act::GeluTanh ? gelu_tanh_mul_f32 : silu_mul_f32)(bu.pg + r * p, u + (r * layers + l.ple.index) * p,
                                                                 bu.pa + r * p, 0, p);
  bar.wait();
  step_profile().mark(tid, StepOp::PleAct);
  team_linears(&l.ple.proj, 1, bu.pa, t, bu.o, e, scratch, tid, nt, bar, StepOp::PleProj);
}

}  // namespace
}  // namespace quill
