// The team path's pieces (step.cpp's forward_team): its buffers and the ops every thread calls with
// its share.  Included by step.cpp only (one glue translation unit, quill/native/build.py).
#pragma once

#include <algorithm>
#include <cstdint>

#include "ops.h"
#include "step_layers.h"
#include "step_prof.h"
#include "team.h"

namespace quill {
namespace {

// float32 buffers of one step, carved from one allocation
struct TeamBufs {
  float *h, *xn, *proj, *q, *k, *attn, *o, *gu, *act, *gate, *sh, *sg, *dn_x;
  float *v, *pg, *pa;  // Gemma 4: normed values [T, Hkv D]; the per-layer input's gate and act [T, P]
  float *x2, *y2;  // Gemma 4: the experts' input and the router's input / the experts' output [T, E]
};

// y [T, sum widths] (rows ldy apart) = the group's linears of x [T, K]; every thread calls it.  kind: what
// the step's profile (step_prof.h) counts the products as.
void team_linears(const Proj* ps, size_t n, const float* x, int64_t t, float* y, int64_t ldy, char* scratch,
                  int tid, int nt, SpinBarrier& bar, StepOp kind) {
  int64_t col = 0;
  for (size_t i = 0; i < n; ++i) {
    const Proj& p = ps[i];
    p.op->team_prepare(x, t, scratch, tid, nt);
    bar.wait();
    step_profile().mark(tid, StepOp::Prepare);
    p.op->team_gemm(x, scratch, t, y + col, ldy, p.bias_ptr(), tid, nt);
    bar.wait();  // the scratch is the next call's
    step_profile().mark(tid, kind);
    col += p.op->out_features();
  }
}

// act [T, I] = act(gate) * up of gu [T, 2 I] (gate, up per row): this thread's share of the elements
void team_act(Act act, const float* gu, float* y, int64_t t, int64_t i, int tid, int nt) {
  int64_t e0, e1;
  team_share(t * i, tid, nt, e0, e1);
  for (int64_t r = e0 / i; r < t && r * i < e1; ++r) {
    const int64_t b = std::max(e0, r * i) - r * i, e = std::min(e1, (r + 1) * i) - r * i;
    const float* gr = gu + r * 2 * i;
    (act == Act::GeluTanh ? gelu_tanh_mul_f32 : silu_mul_f32)(gr, gr + i, y + r * i, b, e);
  }
}

// h[r] += the feed-forward output o[r] of layer l (normed first: sandwich norms); token r's row only
void ffn_out_residual(const Layer& l, const TeamBufs& bu, int64_t r, int64_t e) {
  if (l.ffn_out_norm) rms_norm_f32(bu.o, l.ffn_out_norm->data_ptr<float>(), bu.o, e, float(l.eps_fo), r, r + 1);
  for (int64_t i = 0; i < e; ++i) bu.h[r * e + i] += bu.o[r * e + i];
}

// Layer l's last residual, deferred to the next layer's first op: the feed-forward output's, or with a per-layer
// input (Gemma 4) that block's (its feed-forward residual added before it, step_ple.h); then h *= layer_scalar.
void ffn_residual(const Layer& l, const TeamBufs& bu, int64_t r, int64_t e) {
  if (l.ple.index < 0) {
    ffn_out_residual(l, bu, r, e);
  } else {
    rms_norm_f32(bu.o, l.ple.norm.data_ptr<float>(), bu.o, e, float(l.ple.eps), r, r + 1);
    for (int64_t i = 0; i < e; ++i) bu.h[r * e + i] += bu.o[r * e + i];
  }
  if (l.scalar != 1.0f)
    for (int64_t i = 0; i < e; ++i) bu.h[r * e + i] *= l.scalar;
}

}  // namespace
}  // namespace quill
