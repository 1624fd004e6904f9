// A decode step of a Llama-family decoder (llama, qwen2, qwen3, Mistral-style) with every layer
// in one call: per layer RMSNorm -> q/k/v projections -> (Qwen3: per-head q/k RMSNorm) -> rope
// -> store k, v in the paged pools -> paged decode attention -> o projection -> residual ->
// RMSNorm -> gate/up -> SiLU-and-multiply -> down -> residual; or, in an MoE layer (Qwen3-MoE,
// Mixtral), RMSNorm -> router -> softmax top-k -> the routed experts (moe.cpp) -> residual.
//
// Why: a decode step of a small model spent more time in Python module calls and torch op
// dispatch around the kernels than in the kernels (default model: ~4 ms of a 12 ms token).
// Here the same native functions run in the same order on the same shapes as the Python
// layers (quill/models/llama.py through quill/kernels/fused.py), so the result is the Python
// path's bits; quill/layers/native_step.py builds a step only when every piece of every layer
// is one of these native functions, and checks the equality in its tests.
//
// Every token is a decode token (one new token per sequence): h [T, E], position cos/sin
// [1, T, D], the pool slot each token's k/v is written to [T], and each sequence's context
// slots [T, S] and length [T] as the paged attention reads them.  float32 compute; the KV pools
// float32, bfloat16 or float16 (rounded to nearest even as each k / v row is stored).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
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
#include "team.h"

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

struct Layer {
  at::Tensor ln1, ln2;  // [E]
  double eps1 = 0, eps2 = 0;
  std::vector<Proj> qkv;      // one merged [T, (H + 2 Hkv) D], or q, k, v
  Proj o;                     // [T, H D] -> [T, E]
  std::vector<Proj> gate_up;  // one merged [T, 2 I], or gate, up
  Proj down;                  // [T, I] -> [T, E]
  Proj router;                       // MoE layers: [T, E] -> [T, experts] router logits, no bias
  const ExpertGroup* experts = nullptr;  // MoE layers: the routed experts (no gate_up / down then)
  int64_t top_k = 0;
  bool renormalize = false;
  std::optional<at::Tensor> q_norm, k_norm;  // [D] (Qwen3)
  double qk_eps = 0;
  int64_t window = 0;  // a local layer's sliding window (attention.h AttnArgs), 0: global
  at::Tensor k_pool, v_pool;  // [N, Hkv, D]
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
                 LinearOp* router, const ExpertGroup* experts, int64_t top_k, bool renormalize, int64_t window) {
    if (window < 0) step_fail("window ", window, ": expected 0 (global) or a positive number of positions");
    expect_f32(ln1, {e_}, "input_layernorm");
    expect_f32(ln2, {e_}, "post_attention_layernorm");
    if (q_norm.has_value() != k_norm.has_value()) step_fail("q_norm and k_norm come together");
    if (q_norm) expect_f32(*q_norm, {d_}, "q_norm");
    if (k_norm) expect_f32(*k_norm, {d_}, "k_norm");
    if (k_pool.dim() != 3 || k_pool.size(1) != hkv_)
      step_fail("'k_pool' should be [N, ", hkv_, ", ", d_, "], found ", k_pool.sizes());
    if (const std::string problem = pools_problem(k_pool, v_pool, d_); !problem.empty()) step_fail(problem);
    if (!layers_.empty() && pool_type(k_pool) != kv_type_)
      step_fail("layer ", layers_.size(), "'s pools are ", k_pool.dtype(), "; the first layer's are ",
           layers_[0].k_pool.dtype(), " (one KV cache type for every layer)");
    if (o == nullptr) step_fail("o_proj is required");
    if ((down == nullptr) != (experts != nullptr)) step_fail("a layer takes either down_proj or routed experts");
    Layer l;
    l.ln1 = std::move(ln1), l.ln2 = std::move(ln2), l.eps1 = eps1, l.eps2 = eps2, l.window = window;
    l.qkv = projs(qkv, qkv_bias, e_, {h_ * d_, hkv_ * d_, hkv_ * d_}, "q/k/v");
    l.o = make_proj(o, std::move(o_bias), "o_proj", h_ * d_, e_);
    if (experts != nullptr) {
      if (!gate_up.empty() || router == nullptr || experts->hidden() != e_ || top_k < 1 || top_k > experts->num_experts())
        step_fail("an MoE layer takes a router, experts of hidden size ", e_, " and top_k in [1, ", experts->num_experts(),
             "], no gate/up; found ", gate_up.size(), " gate/up linears, experts of hidden size ", experts->hidden(),
             ", top_k ", top_k);
      l.router = make_proj(router, std::nullopt, "router", e_, experts->num_experts());
      l.experts = experts, l.top_k = top_k, l.renormalize = renormalize;
    } else {
      l.gate_up = projs(gate_up, gate_up_bias, e_, {i_, i_}, "gate/up");
      l.down = make_proj(down, std::move(down_bias), "down_proj", i_, e_);
    }
    l.q_norm = std::move(q_norm), l.k_norm = std::move(k_norm), l.qk_eps = qk_eps;
    rows_ = layers_.empty() ? k_pool.size(0) : std::min(rows_, k_pool.size(0));
    kv_type_ = pool_type(k_pool);
    l.k_pool = std::move(k_pool), l.v_pool = std::move(v_pool);
    layers_.push_back(std::move(l));
  }

  int64_t num_layers() const { return int64_t(layers_.size()); }

  // h [T, E]; cos, sin [1, T, D]; slots int64 [T]; ctx_slots int64 [T, S]; lens int64 [T] -> [T, E].
  // team: run the step inside one parallel region (below); false, or when a linear cannot take T
  // tokens in one call, runs the ops one after another (each splitting its own work) -- the same bits.
  at::Tensor forward(const at::Tensor& h_in, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                     const at::Tensor& ctx_slots, const at::Tensor& lens, bool team) const {
    if (h_in.dim() != 2) step_fail("'h' should be float32 [T, ", e_, "], found ", h_in.sizes());
    const int64_t t = h_in.size(0);
    expect_f32(h_in, {t, e_}, "h");
    expect_f32(cos, {1, t, d_}, "cos");
    expect_f32(sin, {1, t, d_}, "sin");
    if (slots.scalar_type() != at::kLong || slots.sizes() != at::IntArrayRef({t}) || !slots.is_contiguous())
      step_fail("'slots' should be contiguous int64 [", t, "], found ", slots.dtype(), " ", slots.sizes());
    const int64_t* sl = slots.data_ptr<int64_t>();
    for (int64_t i = 0; i < t; ++i)  // against the smallest pool of the layers
      if (sl[i] < 0 || sl[i] >= rows_) step_fail("token ", i, " writes pool row ", sl[i], "; the pool has ", rows_);
    if (team && team_scratch(t) >= 0) return forward_team(h_in, cos, sin, sl, ctx_slots, lens);
    at::Tensor h = h_in;
    for (const Layer& l : layers_) {
      h = at::add(h, attention(l, rms_norm(h, l.ln1, l.eps1), cos, sin, sl, ctx_slots, lens));
      h = at::add(h, mlp(l, rms_norm(h, l.ln2, l.eps2)));
    }
    return h;
  }

 private:
  // Scratch bytes every linear's team call of T tokens fits in, or -1 if one cannot take T at once.
  int64_t team_scratch(int64_t t) const {
    int64_t most = 0;
    for (const Layer& l : layers_) {
      std::vector<const Proj*> ps = {&l.o, l.experts ? &l.router : &l.down};
      for (const Proj& p : l.qkv) ps.push_back(&p);
      for (const Proj& p : l.gate_up) ps.push_back(&p);
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

  at::Tensor forward_team(const at::Tensor& h_in, const at::Tensor& cos, const at::Tensor& sin, const int64_t* slots,
                          const at::Tensor& ctx_slots, const at::Tensor& lens) const;

  // x [T, E] -> [T, E]
  at::Tensor attention(const Layer& l, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                       const int64_t* slots, const at::Tensor& ctx_slots, const at::Tensor& lens) const {
    const int64_t t = x.size(0);
    std::vector<at::Tensor> qkv = outputs(l.qkv, x, {h_ * d_, hkv_ * d_, hkv_ * d_}, "q/k/v");
    at::Tensor q = qkv[0].reshape({1, t, h_, d_}), k = qkv[1].reshape({1, t, hkv_, d_});
    q = l.q_norm ? rms_norm(q, *l.q_norm, l.qk_eps) : q.contiguous();  // [1, T, H, D]
    k = l.k_norm ? rms_norm(k, *l.k_norm, l.qk_eps) : k.contiguous();  // [1, T, Hkv, D]
    rope_(q, cos, sin);
    rope_(k, cos, sin);
    const at::Tensor& v = qkv[2];  // [T, Hkv D], rows `v.stride(0)` apart
    const int64_t row = hkv_ * d_;
    const float* kr = k.data_ptr<float>();
    const float* vr = v.data_ptr<float>();
    for (int64_t i = 0; i < t; ++i) {
      backend_->kv_store(pool_row(l.k_pool, slots[i]), kr + i * row, row, kv_type_);
      backend_->kv_store(pool_row(l.v_pool, slots[i]), vr + i * v.stride(0), row, kv_type_);
    }
    const at::Tensor out = paged_decode_attention(q.view({t, h_, 1, d_}), l.k_pool, l.v_pool, ctx_slots, lens,
                                                  scale_, isa_, l.window);  // [T, H, 1, D]
    return l.o(out.view({t, h_ * d_}));
  }

  // x [T, E] -> [T, E]
  at::Tensor mlp(const Layer& l, const at::Tensor& x) const {
    if (l.experts) {
      const auto [w, ids] = route_tokens(l.router(x), l.top_k, l.renormalize);  // [T, k] each
      return l.experts->forward(x, ids, w, false);
    }
    std::vector<at::Tensor> gu = outputs(l.gate_up, x, {i_, i_}, "gate/up");
    return l.down(silu_mul(gu[0], gu[1]));
  }

  int64_t e_, h_, hkv_, d_, i_;
  double scale_;
  std::string isa_;
  std::vector<Layer> layers_;
  int64_t rows_ = 0;  // pool rows of the smallest layer pool (the tables are checked against it)
  KVType kv_type_ = KVType::F32;  // every layer's pools
  const IsaBackend* backend_ = &backend_for(isa_, "decoder step");  // chosen once (isa.h)
};


// ---- the team path ------------------------------------------------------------------------------
//
// Why: each linear and op of the ops path splits its own work across torch's OpenMP pool, and a
// fork/join wakes the pool (~10 us here), so layers under ~256 KiB ran on one thread (most of a
// small model's).  Here one parallel region runs the whole step: every thread walks the same
// layers, each op takes its share (tokens, row blocks, (sequence, KV head) pairs, elements), and a
// barrier separates dependent ops.  Nothing is allocated and no exception can be thrown inside.
// Each op runs the arithmetic of its ops-path twin on the same values, so the bits are the same.

// float32 buffers of one step, carved from one allocation
struct TeamBufs {
  float *h, *xn, *proj, *q, *k, *attn, *o, *gu, *act;
};

// y [T, sum widths] (rows ldy apart) = the group's linears of x [T, K]; every thread calls it
void team_linears(const Proj* ps, size_t n, const float* x, int64_t t, float* y, int64_t ldy, char* scratch,
                  int tid, int nt, SpinBarrier& bar) {
  int64_t col = 0;
  for (size_t i = 0; i < n; ++i) {
    const Proj& p = ps[i];
    p.op->team_prepare(x, t, scratch, tid, nt);
    bar.wait();
    p.op->team_gemm(x, scratch, t, y + col, ldy, p.bias_ptr(), tid, nt);
    bar.wait();  // the scratch is the next call's
    col += p.op->out_features();
  }
}

at::Tensor DecoderStep::forward_team(const at::Tensor& h_in, const at::Tensor& cos, const at::Tensor& sin,
                                     const int64_t* slots, const at::Tensor& ctx_slots, const at::Tensor& lens) const {
  const int64_t t = h_in.size(0), kvd = hkv_ * d_, wqkv = h_ * d_ + 2 * kvd;
  // the context tables, checked as paged_decode_attention checks them
  if (ctx_slots.scalar_type() != at::kLong || ctx_slots.dim() != 2 || ctx_slots.size(0) != t || !ctx_slots.is_contiguous())
    step_fail("'ctx_slots' should be contiguous int64 [", t, ", S], found ", ctx_slots.dtype(), " ", ctx_slots.sizes());
  if (lens.scalar_type() != at::kLong || lens.sizes() != at::IntArrayRef({t}) || !lens.is_contiguous())
    step_fail("'lens' should be contiguous int64 [", t, "], found ", lens.dtype(), " ", lens.sizes());
  const int64_t s = ctx_slots.size(1);
  const int64_t* cs = ctx_slots.data_ptr<int64_t>();
  const int64_t* ln = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < t; ++b) {
    if (ln[b] < 1 || ln[b] > s) step_fail("sequence ", b, " has length ", ln[b], "; expected 1..", s);
    for (int64_t i = 0; i < ln[b]; ++i)
      if (cs[b * s + i] < 0 || cs[b * s + i] >= rows_)
        step_fail("sequence ", b, " position ", i, " names pool row ", cs[b * s + i], "; the pool has ", rows_);
  }
  const AttnHead head = backend_->attn_head;
  int threads = 1;
  for (const Layer& l : layers_) threads = std::max<int>(threads, int(l.o.op->threads()));
  threads = std::max(1, std::min(threads, at::get_num_threads()));
  const int64_t g = h_ / hkv_, attn_floats = align64(g * (s + d_) * 4) / 4;  // per thread
  // [T, E] h, xn, o; [T, wqkv] proj; [T, H D] q, attn; [T, Hkv D] k; [T, 2 I] gu; [T, I] act; attention scratch
  const int64_t sizes[] = {t * e_, t * e_, t * wqkv, t * h_ * d_, t * kvd, t * h_ * d_, t * e_, 2 * t * i_, t * i_};
  int64_t total = threads * attn_floats;
  for (int64_t n : sizes) total += align64(n * 4) / 4;
  at::Tensor mem = at::empty({total}, h_in.options());
  at::Tensor scratch_mem = at::empty({std::max<int64_t>(team_scratch(t), 64)}, h_in.options().dtype(at::kByte));
  float* at_ = mem.data_ptr<float>();
  float* parts[9];
  for (int i = 0; i < 9; ++i) {
    parts[i] = at_;
    at_ += align64(sizes[i] * 4) / 4;
  }
  float* attn_scratch = at_;
  const TeamBufs bu{parts[0], parts[1], parts[2], parts[3], parts[4], parts[5], parts[6], parts[7], parts[8]};
  // MoE layers: router logits [T, experts], routing weights [T, k] and ids [T, k], the experts' work memory
  int64_t most_experts = 0, most_k = 0, most_work = 0;
  for (const Layer& l : layers_)
    if (l.experts) {
      most_experts = std::max(most_experts, l.experts->num_experts()), most_k = std::max(most_k, l.top_k);
      most_work = std::max(most_work, l.experts->work_bytes(t, l.top_k, threads));
    }
  at::Tensor moe_mem;  // (dense models: none)
  if (most_experts)
    moe_mem = at::empty({align64(t * most_experts * 4) + 2 * align64(t * most_k * 8) + most_work},
                        h_in.options().dtype(at::kByte));
  float* logits = moe_mem.defined() ? reinterpret_cast<float*>(moe_mem.data_ptr()) : nullptr;
  float* route_w = logits + align64(t * most_experts * 4) / 4;
  int64_t* route_ids = reinterpret_cast<int64_t*>(route_w + align64(t * most_k * 8) / 4);
  char* moe_work = reinterpret_cast<char*>(route_ids) + align64(t * most_k * 8);
  std::copy(h_in.data_ptr<float>(), h_in.data_ptr<float>() + t * e_, bu.h);
  char* scratch = static_cast<char*>(scratch_mem.data_ptr());
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  AttnArgs a;
  a.q = bu.q, a.out = bu.attn;
  a.kh = a.vh = d_, a.ks = a.vs = kvd;
  a.slots = cs, a.lens = ln, a.slot_b = s;
  a.b = t, a.h = h_, a.hkv = hkv_, a.s = s, a.d = d_;
  a.scale = float(scale_);

  SpinBarrier bar;
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
        if (li > 0)
          for (int64_t i = 0; i < e_; ++i) bu.h[r * e_ + i] += bu.o[r * e_ + i];
        rms_norm_f32(bu.h, l.ln1.data_ptr<float>(), bu.xn, e_, float(l.eps1), r, r + 1);
      }
      bar.wait();
      team_linears(l.qkv.data(), l.qkv.size(), bu.xn, t, bu.proj, wqkv, scratch, tid, nt, bar);
      for (int64_t r = r0; r < r1; ++r) {  // q, k out of the projections (normed: Qwen3), rotated; k, v stored
        float* q = bu.q + r * h_ * d_;
        float* k = bu.k + r * kvd;
        const float* row = bu.proj + r * wqkv;
        std::copy(row, row + h_ * d_, q);
        std::copy(row + h_ * d_, row + h_ * d_ + kvd, k);
        if (l.q_norm) {
          rms_norm_f32(q, l.q_norm->data_ptr<float>(), q, d_, float(l.qk_eps), 0, h_);
          rms_norm_f32(k, l.k_norm->data_ptr<float>(), k, d_, float(l.qk_eps), 0, hkv_);
        }
        rope_f32(bu.q, cp, sp, h_, d_, r, r + 1);
        rope_f32(bu.k, cp, sp, hkv_, d_, r, r + 1);
        backend_->kv_store(pool_row(l.k_pool, slots[r]), k, kvd, kv_type_);
        backend_->kv_store(pool_row(l.v_pool, slots[r]), row + h_ * d_ + kvd, kvd, kv_type_);
      }
      bar.wait();
      AttnArgs la = a;
      set_pools(la, l.k_pool, l.v_pool);
      la.window = l.window;
      int64_t q0, q1;  // this thread's query heads of [T, H], in (token, KV head, query head) order
      team_share(t * h_, tid, nt, q0, q1);
      for (int64_t p = q0 / g; p * g < q1; ++p) {  // (token, KV head) pairs, each for its share of heads
        la.g_begin = std::max(q0, p * g) - p * g;
        la.g_end = std::min(q1, (p + 1) * g) - p * g;
        head(la, p / hkv_, p % hkv_, my_attn);
      }
      bar.wait();
      team_linears(&l.o, 1, bu.attn, t, bu.o, e_, scratch, tid, nt, bar);
      for (int64_t r = r0; r < r1; ++r) {  // the attention residual, then the MLP's norm
        for (int64_t i = 0; i < e_; ++i) bu.h[r * e_ + i] += bu.o[r * e_ + i];
        rms_norm_f32(bu.h, l.ln2.data_ptr<float>(), bu.xn, e_, float(l.eps2), r, r + 1);
      }
      bar.wait();
      if (l.experts) {  // router logits, each token's top-k, the routed experts into bu.o (ends with a barrier)
        const int64_t ne = l.experts->num_experts(), k = l.top_k;
        team_linears(&l.router, 1, bu.xn, t, logits, ne, scratch, tid, nt, bar);
        for (int64_t r = r0; r < r1; ++r)
          route_token(logits + r * ne, ne, k, l.renormalize, route_ids + r * k, route_w + r * k);
        bar.wait();
        l.experts->team_forward(bu.xn, t, route_ids, route_w, k, bu.o, moe_work, scratch, tid, nt, bar);
        continue;
      }
      team_linears(l.gate_up.data(), l.gate_up.size(), bu.xn, t, bu.gu, 2 * i_, scratch, tid, nt, bar);
      int64_t e0, e1;  // this thread's elements of [T, I]
      team_share(t * i_, tid, nt, e0, e1);
      for (int64_t r = e0 / i_; r < t && r * i_ < e1; ++r) {
        const int64_t b = std::max(e0, r * i_) - r * i_, e = std::min(e1, (r + 1) * i_) - r * i_;
        silu_mul_f32(bu.gu + r * 2 * i_, bu.gu + r * 2 * i_ + i_, bu.act + r * i_, b, e);
      }
      bar.wait();
      team_linears(&l.down, 1, bu.act, t, bu.o, e_, scratch, tid, nt, bar);
    }
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t i = 0; i < e_; ++i) bu.h[r * e_ + i] += bu.o[r * e_ + i];
  }
  return mem.narrow(0, 0, t * e_).view({t, e_});
}

}  // namespace

void register_step(pybind11::module_& m) {
  namespace py = pybind11;
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
           py::keep_alive<1, 20>())  // the step holds the experts' Python object
      .def_property_readonly("num_layers", &DecoderStep::num_layers)
      .def("forward", &DecoderStep::forward, py::arg("h"), py::arg("cos"), py::arg("sin"), py::arg("slots"),
           py::arg("ctx_slots"), py::arg("lens"), py::arg("team") = true, py::call_guard<py::gil_scoped_release>());
}

}  // namespace quill
