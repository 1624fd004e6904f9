// Where a decode step's time goes (step.cpp's team path): thread 0 reads the clock after each op's
// closing barrier and adds the interval since its previous reading to the op's kind, so each kind
// holds the team's wall time for it (the slower thread's, waits included).  Off unless the
// environment sets QUILL_STEP_PROFILE (or Python calls step_profile_enable): one predictable branch
// per op then.  Read by quill.bench.step_profile.  Included by step.cpp only (one glue translation
// unit, quill/native/build.py).
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdlib>

namespace quill {
namespace {

// Setup: forward() before the team starts (checks, buffers).  Prepare: every linear's activation image or
// int8 quantization and the barrier after it.  The residual adds and norms count as Norm (an MoE layer's
// shared-expert add falls into the next layer's Norm: it ends without a barrier).
enum class StepOp : int {
  Setup, Norm, Prepare, DnProj, DnConv, DnHeads, DnOut, AttnQkv, AttnPrep, Attn, AttnGate, AttnOut,
  MlpGateUp, MlpAct, MlpDown, Router, Route, Experts, SharedGateUp, SharedAct, SharedDown, SharedGate,
  PleGate, PleAct, PleProj, Count
};

constexpr const char* STEP_OP_NAMES[] = {
    "setup", "norm", "prepare", "dn_in_proj", "dn_conv", "dn_heads", "dn_out_proj", "attn_qkv", "attn_qk_rope_kv",
    "attn", "attn_gate", "attn_o_proj", "mlp_gate_up", "mlp_act", "mlp_down", "moe_router", "moe_route",
    "moe_experts", "shared_gate_up", "shared_act", "shared_down", "shared_gate",
    "ple_gate", "ple_act", "ple_proj"};
static_assert(sizeof(STEP_OP_NAMES) / sizeof(STEP_OP_NAMES[0]) == int(StepOp::Count), "a name per op");

struct StepProfile {
  bool on = std::getenv("QUILL_STEP_PROFILE") != nullptr;
  double ns[int(StepOp::Count)] = {};
  int64_t steps = 0;
  std::chrono::steady_clock::time_point last;

  void start() {
    if (on) last = std::chrono::steady_clock::now();
  }
  void mark(int tid, StepOp op) {
    if (!on || tid != 0) return;
    const auto t = std::chrono::steady_clock::now();
    ns[int(op)] += double(std::chrono::duration_cast<std::chrono::nanoseconds>(t - last).count());
    last = t;
  }
  void reset() {
    for (double& v : ns) v = 0;
    steps = 0;
  }
};

// One per process: steps run one at a time (the engine's loop), and only thread 0 writes.
StepProfile& step_profile() {
  static StepProfile p;
  return p;
}

}  // namespace
}  // namespace quill
