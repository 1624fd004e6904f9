// The routed experts of an MoE layer as one native object (moe.cpp), for the Python MoE path
// (quill/moe/grouped.py) and the native decode step (step.cpp), which call the same code, so an
// MoE model gives the same bits through either.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "linear_op.h"
#include "team.h"

namespace quill {

// Softmax routing of one token: the k experts of the largest logits (ties: the lower id; NaN
// counts as -inf), best first, and their softmax probabilities over all E experts (computed in
// double, rounded once), divided by the k probabilities' sum when `renormalize`.
// logits [E] -> ids [k], weights [k].  k <= E.
void route_token(const float* logits, int64_t e, int64_t k, bool renormalize, int64_t* ids, float* weights);
// logits float32 [T, E] -> (weights float32 [T, k], ids int64 [T, k]), route_token per token
std::tuple<at::Tensor, at::Tensor> route_tokens(const at::Tensor& logits, int64_t k, bool renormalize);

// y = sum_j w_j * down_j(act(gate_j x, up_j x)) over each token's routed experts, gate and up
// stacked into one [2I, H] linear per expert, each linear with its bias or none.  act: "silu",
// silu(gate) * up; "gelu_tanh", gelu(gate) (tanh approximation) * up (Gemma 4); or "swiglu_clamped" (gpt-oss), gate clamped above at `limit`, up to [-limit, limit],
// (up + 1) * gate * sigmoid(alpha * gate).  The linears are borrowed (the Python object holds their owners).
class ExpertGroup {
 public:
  ExpertGroup(int64_t hidden, int64_t intermediate, const std::string& act = "silu", double alpha = 0,
              double limit = 0);
  // gate_up_bias [2I], down_bias [H] (any float dtype, held as float32), or none
  void add_expert(LinearOp* gate_up, LinearOp* down, const std::optional<at::Tensor>& gate_up_bias = std::nullopt,
                  const std::optional<at::Tensor>& down_bias = std::nullopt);
  int64_t num_experts() const { return int64_t(gate_up_.size()); }
  int64_t hidden() const { return h_; }
  int64_t threads() const { return threads_; }

  // x float32 [T, H], ids int64 [T, k], weights float32 [T, k] -> y float32 [T, H].  team: one
  // parallel region when every linear can take T tokens at once; else (or false) the linears' own
  // calls one after another -- the same bits.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, bool team) const;

  // For a team that is already running (step.cpp): bytes of shared scratch for runs of up to m
  // tokens (-1: some linear cannot take m at once), and of shared work memory for T tokens of k
  // experts each and a team of `threads`.  One expert receives at most T slots when no token repeats an expert (a router's).
  int64_t team_scratch(int64_t m) const;
  int64_t work_bytes(int64_t t, int64_t k, int threads) const;
  // Every thread calls it; it ends with a barrier.  x [T, H], ids [T, k] (checked; no expert receives
  // more slots than the scratch was sized for), w [T, k] -> y [T, H].
  void team_forward(const float* x, int64_t t, const int64_t* ids, const float* w, int64_t k, float* y, char* work,
                    char* scratch, int tid, int nt, SpinBarrier& bar) const;

 private:
  struct Work;  // the work memory's parts
  Work carve(char* work, int64_t t, int64_t k) const;
  void plan(const int64_t* ids, int64_t t, int64_t k, const Work& wk) const;
  void solo(const float* x, const int64_t* ids, int64_t k, const Work& wk, int tid, int nt) const;
  void combine(const Work& wk, const float* w, int64_t t, int64_t k, float* y, int64_t c0, int64_t c1) const;
  void ops_forward(const float* x, int64_t t, const int64_t* ids, const float* w, int64_t k, float* y,
                   char* work) const;
  // y[b, e) = act(gate, up) of one position's gu row [2I] (gate [0, I), up [I, 2I)), elements b..e of I
  void act(const float* gu, float* y, int64_t b, int64_t e) const;
  static const float* ptr(const at::Tensor& bias) { return bias.defined() ? bias.data_ptr<float>() : nullptr; }

  int64_t h_, i_;
  bool clamped_ = false;  // the activation: swiglu_clamped(alpha_, limit_), gelu_tanh, else silu
  bool gelu_ = false;
  float alpha_ = 0, limit_ = 0;
  std::vector<LinearOp*> gate_up_, down_;
  std::vector<at::Tensor> gate_up_bias_, down_bias_;  // float32 [2I] / [H] per expert, undefined: none
  int64_t scratch1_ = 0;  // team scratch of one token
  int64_t threads_ = 1;
};

}  // namespace quill
