// The decoder step's team path (one parallel region per step) and its Python binding; the class, its
// layers and the ops path: step.h.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <omp.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "step.h"
#include "step_prof.h"
#include "step_team.h"

namespace quill {
namespace {

// ---- the team path ------------------------------------------------------------------------------
//
// Why: each linear and op of the ops path splits its own work across torch's OpenMP pool, and a
// fork/join wakes the pool (~10 us here), so layers under ~256 KiB ran on one thread (most of a
// small model's).  Here one parallel region runs the whole step: every thread walks the same
// layers, each op takes its share (tokens, row blocks, (sequence, KV head) pairs, elements), and a
// barrier separates dependent ops.  Nothing is allocated and no exception can be thrown inside.
// Each op runs the arithmetic of its ops-path twin on the same values, so the bits are the same.

at::Tensor DecoderStep::forward_team(const at::Tensor& h_in, const std::vector<at::Tensor>& cos,
                                     const std::vector<at::Tensor>& sin, const int64_t* slots,
                                     const at::Tensor& ctx_slots, const at::Tensor& lens,
                                     const int64_t* state_rows, const int64_t* local_slots,
                                     const at::Tensor& local_ctx_slots,
                                     const std::optional<at::Tensor>& per_layer) const {
  StepProfile& prof = step_profile();
  prof.start();
  const int64_t t = h_in.size(0);
  // the widest rows of any layer: q [T, H D], k and v [T, Hkv D], q/k/v (gated: 2 H D + 2 Hkv D), MLP (or shared
  // expert), the mixer's output ([T, H D], or [T, Hv dv]), DeltaNet conv, the per-layer input [T, P]
  int64_t hd = 1, kvd = 1, wqkv = 1, imax = 1, attn_w = 1, dn_c = 0, dn_scratch = 0, pmax = 0, dmax = 2;
  for (const Layer& l : layers_) {
    imax = std::max({imax, l.i, l.si}), pmax = std::max(pmax, l.ple.p);
    if (!l.mixer) {
      hd = std::max(hd, h_ * l.d), kvd = std::max(kvd, l.hkv * l.d), dmax = std::max(dmax, l.d);
      wqkv = std::max(wqkv, qkv_width(l)), attn_w = std::max(attn_w, h_ * l.d);
    }
    if (l.mixer) {
      const DeltaNetArgs& d = l.mixer->args();
      wqkv = std::max(wqkv, l.mixer->width()), attn_w = std::max(attn_w, l.mixer->out_width());
      dn_c = std::max(dn_c, d.c), dn_scratch = std::max(dn_scratch, align64(dnet_scratch(d.dk, d.dv) * 4) / 4);
    }
  }
  // the context tables, checked as paged_decode_attention checks them
  if (ctx_slots.scalar_type() != at::kLong || ctx_slots.dim() != 2 || ctx_slots.size(0) != t || !ctx_slots.is_contiguous())
    step_fail("'ctx_slots' should be contiguous int64 [", t, ", S], found ", ctx_slots.dtype(), " ", ctx_slots.sizes());
  if (lens.scalar_type() != at::kLong || lens.sizes() != at::IntArrayRef({t}) || !lens.is_contiguous())
    step_fail("'lens' should be contiguous int64 [", t, "], found ", lens.dtype(), " ", lens.sizes());
  const int64_t s = ctx_slots.size(1);
  const int64_t* cs = ctx_slots.data_ptr<int64_t>();
  const int64_t* lcs = local_ctx_slots.data_ptr<int64_t>();  // (ctx_slots itself without a local group)
  const int64_t* ln = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < t; ++b) {
    if (ln[b] < 1 || ln[b] > s) step_fail("sequence ", b, " has length ", ln[b], "; expected 1..", s);
    for (int g = 0; g < 2; ++g) {
      const int64_t* tab = g ? lcs : cs;
      for (int64_t i = 0; pool_rows_[g] >= 0 && i < ln[b]; ++i)
        if (tab[b * s + i] < 0 || tab[b * s + i] >= pool_rows_[g])
          step_fail("sequence ", b, " position ", i, " names pool row ", tab[b * s + i], "; the pool has ",
                    pool_rows_[g], g ? " (local_ctx_slots: the sliding-window layers' block group)" : "");
    }
  }
  const AttnHead head = backend_->attn_head;
  int threads = 1;
  for (const Layer& l : layers_) threads = std::max<int>(threads, int(l.o.op->threads()));
  threads = std::max(1, std::min(threads, at::get_num_threads()));
  // per thread: a (sequence, KV head) call's G (S + D) floats, + G sink weights (attention.h), for the layer
  // needing most
  int64_t attn_floats = dn_scratch;
  for (const Layer& l : layers_)
    if (!l.mixer) attn_floats = std::max(attn_floats, align64(h_ / l.hkv * (s + l.d + 1) * 4) / 4);
  // [T, E] h, xn, o; [T, wqkv] proj; [T, H D] q, attn; [T, Hkv D] k; [T, 2 I] gu; [T, I] act; [T, H D] output
  // gate; [T, E] shared expert; [T] its gate; [T, C] DeltaNet conv output; [T, Hkv D] normed v; [T, P] the
  // per-layer input's gate and act; [T, E] the experts' and router's inputs beside an MLP; attention / DeltaNet
  // scratch
  int64_t beside = 0;
  for (const Layer& l : layers_) beside = std::max<int64_t>(beside, l.beside.on);
  const int64_t sizes[] = {t * e_, t * e_, t * wqkv, t * hd, t * kvd, t * attn_w, t * e_, 2 * t * imax, t * imax,
                           t * hd, t * e_, t, t * dn_c, t * kvd, t * pmax, t * pmax, beside * t * e_, beside * t * e_};
  constexpr int n_parts = sizeof(sizes) / sizeof(sizes[0]);
  int64_t total = threads * attn_floats;
  for (int64_t n : sizes) total += align64(n * 4) / 4;
  at::Tensor mem = at::empty({total}, h_in.options());
  at::Tensor scratch_mem = at::empty({std::max<int64_t>(team_scratch(t), 64)}, h_in.options().dtype(at::kByte));
  float* at_ = mem.data_ptr<float>();
  float* parts[n_parts];
  for (int i = 0; i < n_parts; ++i) {
    parts[i] = at_;
    at_ += align64(sizes[i] * 4) / 4;
  }
  float* attn_scratch = at_;
  const TeamBufs bu{parts[0], parts[1], parts[2],  parts[3],  parts[4],  parts[5],  parts[6],  parts[7], parts[8],
                    parts[9], parts[10], parts[11], parts[12], parts[13], parts[14], parts[15], parts[16], parts[17]};
  const float* ple_in = per_layer ? per_layer->data_ptr<float>() : nullptr;  // [T, L, P] (checked by forward)
  const int64_t ple_layers = per_layer ? per_layer->size(1) : 0;
  const MoeMem moe = moe_memory(layers_, t, threads, h_in.options());  // (dense models: none)
  std::copy(h_in.data_ptr<float>(), h_in.data_ptr<float>() + t * e_, bu.h);
  char* scratch = static_cast<char*>(scratch_mem.data_ptr());
  std::vector<const float*> cp, sp;  // each table [T, rotary dim]
  for (size_t i = 0; i < cos.size(); ++i) cp.push_back(cos[i].data_ptr<float>()), sp.push_back(sin[i].data_ptr<float>());
  AttnArgs a;
  a.q = bu.q, a.out = bu.attn;
  a.slots = cs, a.lens = ln, a.slot_b = s;
  a.b = t, a.h = h_, a.s = s;  // (each layer's KV heads and head size below)
  a.scale = float(scale_);

  SpinBarrier bar;
  prof.mark(0, StepOp::Setup);
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
#pragma omp single
    bar.set_size(nt);  // (the end of `single` is a barrier)
    int64_t r0, r1;  // this thread's tokens
    team_share(t, tid, nt, r0, r1);
    float* my_attn = attn_scratch + tid * attn_floats;
    for (size_t li = 0; li < layers_.size(); ++li) {
      const Layer& l = layers_[li];
      for (int64_t r = r0; r < r1; ++r) {  // the previous layer's MLP residual, then this layer's norm
        if (li > 0) ffn_residual(layers_[li - 1], bu, r, e_);
        rms_norm_f32(bu.h, l.ln1.data_ptr<float>(), bu.xn, e_, float(l.eps1), r, r + 1);
      }
      bar.wait();
      prof.mark(tid, StepOp::Norm);
      if (l.mixer) {  // in-projections, then the DeltaNet update (conv pass, barrier, head pass) into bu.attn
        const DeltaNetMixer& m = *l.mixer;
        team_linears(m.proj().data(), m.proj().size(), bu.xn, t, bu.proj, m.width(), scratch, tid, nt, bar,
                     StepOp::DnProj);
        const DeltaNetArgs da = m.step(bu.proj, m.width(), t, state_rows, bu.dn_x, bu.attn);
        deltanet_conv_share(da, backend_->dn_conv, tid, nt);
        bar.wait();
        prof.mark(tid, StepOp::DnConv);
        deltanet_head_share(da, backend_->dn_head, tid, nt, my_attn);
        bar.wait();
        prof.mark(tid, StepOp::DnHeads);
      } else {
        const AttnRow w{h_, q_width(l), qkv_width(l)};
        team_linears(l.qkv.data(), l.qkv.size(), bu.xn, t, bu.proj, w.lw, scratch, tid, nt, bar, StepOp::AttnQkv);
        for (int64_t r = r0; r < r1; ++r)  // q (, gate), k out of the projections (normed), rotated; k, v stored
          attn_prep_token(l, bu, w, r, cp[l.rope], sp[l.rope], l.local ? local_slots[r] : slots[r],
                          backend_->kv_store, kv_type_);
        bar.wait();
        prof.mark(tid, StepOp::AttnPrep);
        AttnArgs la = a;
        const int64_t g = h_ / l.hkv, hd = h_ * l.d;
        la.kh = la.vh = l.d, la.ks = la.vs = l.hkv * l.d, la.hkv = l.hkv, la.d = l.d;
        set_pools(la, l.k_pool, l.v_pool);
        la.window = l.window;
        if (l.local) la.slots = lcs;
        la.sinks = l.sinks.defined() ? l.sinks.data_ptr<float>() : nullptr;
        int64_t q0, q1;  // this thread's query heads of [T, H], in (token, KV head, query head) order
        team_share(t * h_, tid, nt, q0, q1);
        for (int64_t p = q0 / g; p * g < q1; ++p) {  // (token, KV head) pairs, each for its share of heads
          la.g_begin = std::max(q0, p * g) - p * g;
          la.g_end = std::min(q1, (p + 1) * g) - p * g;
          head(la, p / l.hkv, p % l.hkv, my_attn);
        }
        bar.wait();
        prof.mark(tid, StepOp::Attn);
        if (l.gated) {  // attn * sigmoid(gate), this thread's tokens
          for (int64_t r = r0; r < r1; ++r) {
            float* gr = bu.gate + r * hd;
            sigmoid_f32(gr, gr, 0, hd);
            for (int64_t i = 0; i < hd; ++i) bu.attn[r * hd + i] *= gr[i];
          }
          bar.wait();
          prof.mark(tid, StepOp::AttnGate);
        }
      }
      team_linears(&l.o, 1, bu.attn, t, bu.o, e_, scratch, tid, nt, bar, l.mixer ? StepOp::DnOut : StepOp::AttnOut);
      for (int64_t r = r0; r < r1; ++r) {  // the attention residual (its output normed: sandwich), the MLP's norm
        if (l.attn_out_norm) rms_norm_f32(bu.o, l.attn_out_norm->data_ptr<float>(), bu.o, e_, float(l.eps_ao), r, r + 1);
        for (int64_t i = 0; i < e_; ++i) bu.h[r * e_ + i] += bu.o[r * e_ + i];
        rms_norm_f32(bu.h, l.ln2.data_ptr<float>(), bu.xn, e_, float(l.eps2), r, r + 1);
        if (l.beside.on) beside_inputs(l, bu, r, e_);  // the experts' and the router's inputs (step_moe.h)
      }
      bar.wait();
      prof.mark(tid, StepOp::Norm);
      if (l.experts && !l.beside.on) {  // router, each token's top-k, the routed experts (+ the shared expert)
        moe_team(l, bu, moe, t, e_, r0, r1, scratch, tid, nt, bar);
      } else {
        team_linears(l.gate_up.data(), l.gate_up.size(), bu.xn, t, bu.gu, 2 * l.i, scratch, tid, nt, bar,
                     StepOp::MlpGateUp);
        team_act(l.act, bu.gu, bu.act, t, l.i, tid, nt);
        bar.wait();
        prof.mark(tid, StepOp::MlpAct);
        team_linears(&l.down, 1, bu.act, t, bu.o, e_, scratch, tid, nt, bar, StepOp::MlpDown);
        if (l.beside.on) beside_team(l, bu, moe, t, e_, r0, r1, scratch, tid, nt, bar);  // o = out1(o) + out2(moe)
      }
      if (l.ple.index >= 0) {  // Gemma 4: the feed-forward residual now, then the per-layer input block into bu.o
        for (int64_t r = r0; r < r1; ++r) ffn_out_residual(l, bu, r, e_);
        bar.wait();
        prof.mark(tid, StepOp::Norm);
        ple_team(l, bu, ple_in, ple_layers, t, e_, r0, r1, scratch, tid, nt, bar);  // (step_ple.h)
      }
    }
    for (int64_t r = r0; r < r1; ++r) ffn_residual(layers_.back(), bu, r, e_);
  }
  prof.mark(0, StepOp::Norm);  // the last residual (after the region: thread 0's join)
  prof.steps += prof.on;
  return mem.narrow(0, 0, t * e_).view({t, e_});
}

}  // namespace

void register_step(pybind11::module_& m) {
  namespace py = pybind11;
  // the team path's time per op kind (step_prof.h): seconds summed over the steps since the last reset
  m.def("step_profile_enable", [](bool on) { step_profile().on = on; }, py::arg("on") = true);
  m.def("step_profile", [](bool reset) {
    StepProfile& p = step_profile();
    py::dict d;
    for (int i = 0; i < int(StepOp::Count); ++i) d[STEP_OP_NAMES[i]] = p.ns[i] * 1e-9;
    d["steps"] = p.steps;
    if (reset) p.reset();
    return d;
  }, py::arg("reset") = false);
  // the linears are borrowed (the caller keeps their Python objects alive), the tensors held
  py::class_<DeltaNetMixer>(m, "DeltaNetMixer")
      .def(py::init<const std::vector<LinearOp*>&, const std::vector<std::optional<at::Tensor>>&, at::Tensor,
                    at::Tensor, at::Tensor, at::Tensor, double, at::Tensor, at::Tensor, bool>(),
           py::arg("proj"), py::arg("proj_bias"), py::arg("conv_w"), py::arg("A_log"), py::arg("dt_bias"),
           py::arg("norm_w"), py::arg("eps"), py::arg("conv_state"), py::arg("state"), py::arg("tiled") = false);
  py::class_<DecoderStep>(m, "DecoderStep")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, std::string>(), py::arg("hidden"),
           py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("intermediate"), py::arg("scale"),
           py::arg("isa"))
      // the linears are borrowed: the caller keeps their Python objects alive as long as the step
      .def("add_layer", &DecoderStep::add_layer, py::arg("ln1"), py::arg("eps1"), py::arg("ln2"), py::arg("eps2"),
           py::arg("qkv"), py::arg("qkv_bias"), py::arg("o"), py::arg("o_bias"), py::arg("gate_up"),
           py::arg("gate_up_bias"), py::arg("down"), py::arg("down_bias"), py::arg("q_norm"), py::arg("k_norm"),
           py::arg("qk_eps"), py::arg("k_pool"), py::arg("v_pool"), py::arg("router") = nullptr,
           py::arg("experts") = nullptr, py::arg("top_k") = 0, py::arg("renormalize") = false, py::arg("window") = 0,
           py::arg("attn_out_norm") = std::nullopt, py::arg("attn_out_eps") = 0.0, py::arg("ffn_out_norm") = std::nullopt,
           py::arg("ffn_out_eps") = 0.0, py::arg("activation") = "silu", py::arg("rope") = 0,
           py::arg("output_gate") = false, py::arg("rotary_dim") = 0,
           py::arg("shared_gate_up") = std::vector<LinearOp*>{},
           py::arg("shared_gate_up_bias") = std::vector<std::optional<at::Tensor>>{}, py::arg("shared_down") = nullptr,
           py::arg("shared_down_bias") = std::nullopt, py::arg("shared_gate") = nullptr,
           py::arg("shared_intermediate") = 0, py::arg("mixer") = nullptr, py::arg("sinks") = std::nullopt,
           py::arg("router_bias") = std::nullopt, py::arg("local") = false, py::arg("kv_heads") = 0,
           py::arg("head_dim") = 0, py::arg("intermediate") = 0, py::arg("v_norm_eps") = -1.0,
           py::arg("k_eq_v") = false, py::arg("kv_shared") = false, py::arg("layer_scalar") = 1.0,
           py::arg("ple_gate") = nullptr, py::arg("ple_proj") = nullptr, py::arg("ple_norm") = std::nullopt,
           py::arg("ple_eps") = 0.0, py::arg("ple_index") = -1, py::arg("ple_activation") = "gelu_pytorch_tanh",
           py::arg("beside_norms") = std::vector<at::Tensor>{}, py::arg("beside_eps") = std::vector<double>{},
           py::arg("router_mult") = 1.0,
           py::keep_alive<1, 20>(), py::keep_alive<1, 38>())  // the step holds the experts' and mixer's objects
      .def_property_readonly("num_layers", &DecoderStep::num_layers)
      .def("all_or_nothing", &DecoderStep::all_or_nothing, py::arg("tokens"))
      .def("forward", &DecoderStep::forward, py::arg("h"), py::arg("cos"), py::arg("sin"), py::arg("slots"),
           py::arg("ctx_slots"), py::arg("lens"), py::arg("team") = true,
           py::arg("state_rows") = std::nullopt, py::arg("local_slots") = std::nullopt,
           py::arg("local_ctx_slots") = std::nullopt, py::arg("per_layer") = std::nullopt, py::call_guard<py::gil_scoped_release>());
}

}  // namespace quill
