// The quantized linear's binding: one NativeLinear object per layer holds the prepared tensors
// and the chosen kernel variant; forward(x, bias) is the whole per-call path, and the team
// calls (linear_op.h) split it across a running team of threads (step.cpp).
//
// Threads come from PyTorch's own intra-op pool (at::parallel_for), so native
// kernels and torch ops never run two pools at once; the count is
// min(threads set on the layer, torch.get_num_threads()), reduced for small work.
// Precondition failures throw KernelFailure, raised in Python as
// quill.errors.KernelError.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common.h"
#include "linear.h"
#include "linear_op.h"
#include "parallel.h"
#include "super_acts.h"

namespace quill {
namespace {

// Grow-only scratch of the calling thread (stream, sums, quantized activations).
template <class T>
T* scratch(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

class NativeLinear final : public LinearOp {
 public:
  NativeLinear(at::Tensor codes, at::Tensor scales, std::optional<at::Tensor> zeros, std::optional<at::Tensor> offsets,
               at::Tensor seg_end, std::optional<at::Tensor> src, std::optional<at::Tensor> wsum, int64_t bits,
               int64_t n, int64_t k, std::string family, std::string isa, bool act_dynamic, bool act_symmetric,
               double act_scale, double act_zero, int64_t threads, std::optional<at::Tensor> hplane,
               std::optional<at::Tensor> super_scales, std::optional<at::Tensor> super_offsets,
               std::optional<double> zconst, int64_t sub_bits, int64_t sub_bias, bool act_per_segment,
               int64_t image_bits, bool act_per_super)
      : codes_(std::move(codes)), scales_(std::move(scales)), zeros_(std::move(zeros)), offsets_(std::move(offsets)),
        seg_end_(std::move(seg_end)), src_(std::move(src)), wsum_(std::move(wsum)), hplane_(std::move(hplane)),
        super_scales_(std::move(super_scales)), super_offsets_(std::move(super_offsets)), int8_(family == "int8"),
        isa_(isa), table_(table_for(isa)) {
    if (family != "int8" && family != "float") fail("native kernel: unknown family '", family, "'; supported: float, int8");
    if (image_bits != 24 && image_bits != 16)  // the float activations' fixed-point image (common.h SplitActs)
      fail("native kernel: a ", image_bits, "-bit image of float activations is not supported; supported: 24, 16");
    parts_ = image_bits == 24 ? SPLIT_PARTS : 2;
    if (bits < 2 || bits > 8 || bits == 7)
      fail("native kernel: ", bits, "-bit codes are not supported; supported: 2, 3, 4, 5, 6, 8");
    if (sub_bits != 8 && sub_bits != 4 && sub_bits != 6)
      fail("native kernel: sub_bits ", sub_bits, " is not supported; supported: 8 (int8), 4, 6 (packed)");
    if (sub_bits == 8 ? sub_bias != 0 : (sub_bias < 0 || sub_bias >= (1 << sub_bits)))
      fail("native kernel: sub_bias ", sub_bias, " does not fit ", sub_bits, "-bit sub-values");
    w_.sub_bits = int32_t(sub_bits);
    w_.sub_bias = int32_t(sub_bias);
    if (codes_.dim() != 3) fail("native kernel: codes should be uint8 [NB, KC, 64], found ", shape_of(codes_));
    const int64_t nb = codes_.size(0), kc = codes_.size(1), nseg = seg_end_.numel();
    expect(codes_, at::kByte, {nb, kc, BLOCK_BYTES}, "codes");  // [NB, KC, 64]
    if (n <= 0 || n > nb * LANES || n <= (nb - 1) * LANES)
      fail("native kernel: ", n, " output features do not fill ", nb, " row blocks of ", LANES);
    expect(seg_end_, at::kInt, {nseg}, "seg_end");  // [S]
    const int32_t* se = seg_end_.data_ptr<int32_t>();
    for (int64_t s = 0; s < nseg; ++s)
      if (se[s] <= (s ? se[s - 1] : 0) || (s == nseg - 1 && se[s] != kc))
        fail("native kernel: segment ends must increase strictly up to ", kc, " chunks");
    for (int64_t s = 0; s < nseg && !int8_; ++s)  // the split image's buffers and int32 sums (common.h)
      if ((se[s] - (s ? se[s - 1] : 0)) * chunk_k(int(bits)) > SPLIT_MAX_SEGMENT)
        fail("native kernel: float activations take segments of at most ", SPLIT_MAX_SEGMENT, " positions; segment ", s,
             " holds ", (se[s] - (s ? se[s - 1] : 0)) * chunk_k(int(bits)));
    check_levels(nb, nseg);
    if (zeros_) expect(*zeros_, bits != 8 ? at::kByte : at::kShort, {nb, nseg, LANES}, "zeros");
    if (plane_bytes(int(bits)) != 0) {
      if (!hplane_) fail("native kernel: ", bits, "-bit codes need their high-bit plane (hplane)");
      expect(*hplane_, at::kByte, {nb, kc, plane_bytes(int(bits))}, "hplane");  // [NB, KC, 32 or 16 * (bits - 4)]
    } else if (hplane_) {
      fail("native kernel: a high-bit plane was given for ", bits, "-bit codes, which have none");
    }
    if (wsum_) expect(*wsum_, at::kFloat, {nb * LANES}, "wsum");  // [Np]
    kp_ = kc * chunk_k(bits);
    if (src_) {
      expect(*src_, at::kLong, {kp_}, "src");  // [Kp]
      const int64_t* p = src_->data_ptr<int64_t>();
      for (int64_t i = 0; i < kp_; ++i)
        if (p[i] < -1 || p[i] >= k) fail("native kernel: src[", i, "] = ", p[i], " is outside [-1, ", k, ")");
    } else if (k > kp_ || kp_ - k >= chunk_k(bits)) {  // identity order: only the end is padded
      fail("native kernel: in_features ", k, " does not match the ", kp_, " stream positions");
    }
    k_ = k;
    w_.codes = codes_.data_ptr<uint8_t>();
    w_.scales = scales_.data_ptr();
    w_.zeros = zeros_ ? zeros_->data_ptr() : nullptr;
    w_.offsets = offsets_ ? offsets_->data_ptr() : nullptr;
    w_.seg_end = se;
    w_.wsum = wsum_ ? wsum_->data_ptr<float>() : nullptr;
    w_.bits = int32_t(bits);
    w_.n = int32_t(n);
    w_.nb = int32_t(nb);
    w_.kc = int32_t(kc);
    w_.nseg = int32_t(nseg);
    w_.zconst = float(1 << (bits - 1));
    if (zconst) {
      if (zeros_ || *zconst != double(int(*zconst)) || *zconst < 0 || *zconst > double(1 << bits))
        fail("native kernel: constant zero point ", *zconst, " should be an integer in [0, ", 1 << bits,
             "] given instead of zeros");
      w_.zconst = float(*zconst);
    }
    epilogue_shortcuts(se);
    w_.hplane = hplane_ ? hplane_->data_ptr<uint8_t>() : nullptr;
    w_.super_scales = super_scales_ ? super_scales_->data_ptr() : nullptr;
    w_.super_offsets = super_offsets_ ? super_offsets_->data_ptr() : nullptr;
    aq_.dynamic = act_dynamic;
    aq_.symmetric = act_symmetric;
    aq_.scale = float(act_scale);
    aq_.zero = float(act_zero);
    aq_.per_segment = act_per_segment;
    if (act_per_segment && !(int8_ && act_dynamic && act_symmetric))
      fail("native kernel: one activation scale per segment needs int8 activations, dynamic and symmetric");
    if (act_per_super) {  // llama.cpp's K-quant arithmetic (common.h I8Acts::gsuper)
      const std::string why = act_per_segment ? super_.setup(w_, zeros_.has_value(), super_offsets_.has_value(),
                                                             src_.has_value())
                                              : "needs int8 activations per segment";
      if (!why.empty()) fail("native kernel: one activation scale per super-block ", why);
    }
    if (int8_ && !act_symmetric && !wsum_) fail("native kernel: asymmetric activations need the weight row sums (wsum)");
    set_threads(threads);
  }

  // Weights::fold_zero / fuse_t (common.h): whether the epilogue's shortcuts give its exact bits; and
  // Weights::short_segments.
  void epilogue_shortcuts(const int32_t* se) {
    const int64_t positions = longest_segment(se, w_.nseg, w_.bits);
    const double qmax = double((1 << w_.bits) - 1);
    const double dev = zeros_ ? qmax : std::max<double>(w_.zconst, qmax - w_.zconst);  // max |code - z|
    // int8 kernels fold only while every D is exact in float (their epilogue converts it before subtracting)
    const bool exact_d = !int8_ || qmax * 128.0 * double(positions) <= double(1 << 24);
    w_.fold_zero = !zeros_ && !offsets_ && w_.zconst != 0.0f && exact_d;
    w_.fuse_t = !int8_ && dev * double(positions) * double(split_qmax(parts_)) < 2147483648.0;
    if (!int8_ && parts_ == 2 && !w_.fuse_t)  // the kernels assume it (avx2.cpp / avx512_vnni.cpp run_split_epi)
      fail("native kernel: the 16-bit image's segment sums would overflow int32 (", positions, " positions)");
    w_.short_segments = positions <= 4 * chunk_k(w_.bits);
  }

  void set_threads(int64_t t) {
    if (t < 1) fail("native kernel: threads must be at least 1, found ", t);
    threads_ = int(t);
  }
  int64_t threads() const override { return threads_; }
  std::string isa() const { return isa_; }
  int64_t in_features() const override { return k_; }
  int64_t out_features() const override { return w_.n; }

  at::Tensor run(const at::Tensor& x, const std::optional<at::Tensor>& bias) override { return forward(x, bias); }

  // The team call (linear_op.h).  Scratch: the activations' stream [M, Kp (x parts split)] int8, their
  // segment sums, scales, and (act-order) the gathered floats [M, Kp], as run_split / run_int8 hold them.
  int64_t team_scratch(int64_t m) const override {
    const int64_t per_token = int8_ ? kp_ : kp_ * (src_ ? 4 + parts_ : parts_);
    if (block_tokens(per_token, m) < m) return -1;  // run() cuts such calls into token blocks
    const TeamScratch t = team_layout(m);
    return t.end;
  }

  void team_prepare(const float* x, int64_t m, void* scratch, int tid, int nt) const override {
    const TeamScratch t = team_layout(m);
    char* base = static_cast<char*>(scratch);
    RawX in{x, DType::F32, k_, src_ ? src_->data_ptr<int64_t>() : nullptr, kp_, w_.seg_end, w_.nseg,
            chunk_k(w_.bits), parts_};
    // one token's segments split, not one thread quantizing for all: where every segment's image or int8
    // codes depend on that segment alone (float image, int8 per segment); a share's chunk ends fit the stack
    if (m == 1 && nt > 1 && (!int8_ || aq_.per_segment) && !src_ && !super_.gsuper && w_.nseg <= kMaxShareSegments * nt)
      return split_segments(in, reinterpret_cast<int8_t*>(base), reinterpret_cast<int32_t*>(base + t.qsum),
                            reinterpret_cast<float*>(base + t.scale), reinterpret_cast<float*>(base + t.gscale), tid,
                            nt);
    int64_t b, e;
    team_share(m, tid, nt, b, e);
    if (b == e) return;
    if (int8_) {
      float* sz = reinterpret_cast<float*>(base + t.scale);
      quantize_int8(in, reinterpret_cast<int8_t*>(base), reinterpret_cast<int32_t*>(base + t.qsum), sz, sz + m,
                    reinterpret_cast<float*>(base + t.gscale), int(b), int(e));
      return;
    }
    auto* xs = reinterpret_cast<int8_t*>(base);
    auto* qsum = reinterpret_cast<int32_t*>(base + t.qsum);
    auto* xscale = reinterpret_cast<float*>(base + t.scale);
    if (!src_) return table_.quantize_split(in, xs, qsum, xscale, int(b), int(e));
    float* gathered = reinterpret_cast<float*>(base + t.gathered);
    gather_stream(in, gathered, int(b), int(e));
    RawX g = in;
    g.x = gathered;
    g.k = kp_;
    g.src = nullptr;
    table_.quantize_split(g, xs, qsum, xscale, int(b), int(e));
  }

  // Segments [s0, s1) of the one token's split image or int8 codes (the team's share tid of nt), through the
  // same quantizer: its input and outputs start at segment s0, whose chunk ends it sees from there.  Every
  // segment's values depend on that segment alone, so the bits are those of one thread's call.
  static constexpr int64_t kMaxShareSegments = 512;
  void split_segments(const RawX& in, int8_t* q, int32_t* qsum, float* scale, float* gscale, int tid, int nt) const {
    int64_t s0, s1;
    team_share(w_.nseg, tid, nt, s0, s1);
    if (s0 == s1) return;
    const int32_t c0 = s0 ? w_.seg_end[s0 - 1] : 0;
    int32_t ends[kMaxShareSegments];  // (the team's region allocates nothing)
    for (int64_t s = s0; s < s1; ++s) ends[s - s0] = w_.seg_end[s] - c0;
    const int64_t p0 = int64_t(c0) * in.chunk;
    RawX part = in;
    part.x = static_cast<const float*>(in.x) + std::min(p0, k_);
    part.k = std::max<int64_t>(0, k_ - p0);
    part.kp = int64_t(ends[s1 - s0 - 1]) * in.chunk;
    part.seg_end = ends;
    part.nseg = int32_t(s1 - s0);
    if (!int8_) return table_.quantize_split(part, q + p0 * parts_, qsum + 2 * s0, scale + s0, 0, 1);
    // (per-segment int8 writes no per-token scale or zero: `scale` [2] is left alone)
    table_.quantize(part, aq_, q + p0, qsum + s0, scale, scale + 1, gscale + s0, 0, 1);
  }

  void team_gemm(const float* x, const void* scratch, int64_t m, float* y, int64_t ldy, const float* bias,
                         int tid, int nt) const override {
    const int lt = std::min<int>(threads_, nt);  // the layer's own thread setting caps its share of the team
    if (tid >= lt) return;
    int64_t b, e;
    team_share(w_.nb, tid, lt, b, e);
    if (b == e) return;
    const TeamScratch t = team_layout(m);
    const char* base = static_cast<const char*>(scratch);
    Weights w = w_;
    w.bias = bias;
    const Out o{y, ldy, DType::F32};
    const auto* q = reinterpret_cast<const int8_t*>(base);
    const auto* qsum = reinterpret_cast<const int32_t*>(base + t.qsum);
    const auto* sc = reinterpret_cast<const float*>(base + t.scale);
    if (int8_)
      table_.gemm_i8(w, I8Acts{q, qsum, sc, sc + m, kp_, int32_t(m), !aq_.symmetric,
                               aq_.per_segment ? reinterpret_cast<const float*>(base + t.gscale) : nullptr,
                               super_.gsuper},
                     o, int(b), int(e));
    else
      table_.gemm_split(w, SplitActs{q, qsum, sc, kp_ * parts_, int32_t(m), parts_}, o, int(b), int(e));
  }

  // x [..., K] float32 / bfloat16 / float16 -> y [..., N] of x's dtype (+ bias [N])
  at::Tensor forward(const at::Tensor& x_in, const std::optional<at::Tensor>& bias_in) {
    if (x_in.dim() < 1 || x_in.size(-1) != k_ || x_in.device().is_cuda())
      fail("native kernel: input should be a CPU tensor [..., ", k_, "], found ", shape_of(x_in));
    const DType xdt = dtype_of(x_in.scalar_type(), "input");
    const at::Tensor x = x_in.reshape({-1, k_}).contiguous();  // [M, K]
    const int64_t m = x.size(0);
    at::Tensor bias;
    if (bias_in) {
      bias = bias_in->scalar_type() == at::kFloat ? *bias_in : bias_in->to(at::kFloat);
      expect(bias.contiguous(), at::kFloat, {w_.n}, "bias");
      bias = bias.contiguous();
    }
    // float16 results are computed in float32 and rounded by torch (no f16 store path)
    const auto out_dt = x.scalar_type() == at::kHalf ? at::kFloat : x.scalar_type();
    std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
    shape.back() = w_.n;
    at::Tensor y = at::empty({m, w_.n}, x.options().dtype(out_dt));  // [M, N]
    if (m == 0) return y.to(x.scalar_type()).view(shape);
    Weights w = w_;
    w.bias = bias.defined() ? bias.data_ptr<float>() : nullptr;
    Out o{y.data_ptr(), w_.n, out_dt == at::kBFloat16 ? DType::BF16 : DType::F32};
    RawX in{x.data_ptr(), xdt, k_, src_ ? src_->data_ptr<int64_t>() : nullptr, kp_, w_.seg_end, w_.nseg,
            chunk_k(w_.bits), parts_};
    if (int8_)
      run_int8(w, in, o, m);
    else
      run_split(w, in, o, m);
    return (x.scalar_type() == at::kHalf ? y.to(at::kHalf) : y).view(shape);  // [..., N]
  }

 private:
  int threads_for(int64_t work) const { return quill::threads_for(threads_, work, w_.nb); }

  // scales / offsets [NB, S, 16]: float of one dtype, or int8 sub-values of two-level scales with
  // super_scales / super_offsets [NB, S / GPS, 16] (common.h).
  void check_levels(int64_t nb, int64_t nseg) {
    if (super_offsets_ && !super_scales_) fail("native kernel: super_offsets need super_scales");
    if (super_offsets_ && !offsets_) fail("native kernel: super_offsets need offsets");
    if (!super_scales_) {
      if (w_.sub_bits != 8) fail("native kernel: packed sub-values (sub_bits ", w_.sub_bits, ") need super_scales");
      w_.scale_dtype = dtype_of(scales_.scalar_type(), "scales");
      expect(scales_, scales_.scalar_type(), {nb, nseg, LANES}, "scales");  // [NB, S, 16]
      if (offsets_) expect(*offsets_, scales_.scalar_type(), {nb, nseg, LANES}, "offsets");
      return;
    }
    const auto dt = super_scales_->scalar_type();
    w_.scale_dtype = dtype_of(dt, "super_scales");
    const int64_t nsup = super_scales_->dim() == 3 ? super_scales_->size(1) : 0;
    if (nsup <= 0 || nseg % nsup) fail("native kernel: super_scales should be [", nb, ", S, ", LANES, "] with S dividing ",
                                       nseg, " segments, found ", shape_of(*super_scales_));
    w_.gps = int32_t(nseg / nsup);
    expect(*super_scales_, dt, {nb, nsup, LANES}, "super_scales");  // [NB, S / GPS, 16]
    // int8 sub-values [NB, S, 16], or packed uint8 [NB, SR, 16] (common.h)
    const auto sub_type = w_.sub_bits == 8 ? at::kChar : at::kByte;
    const int64_t sub_n = w_.sub_bits == 8 ? nseg : sub_rows(w_.sub_bits, nseg);
    expect(scales_, sub_type, {nb, sub_n, LANES}, "scales");
    if (offsets_) {
      if (super_offsets_) {
        expect(*super_offsets_, dt, {nb, nsup, LANES}, "super_offsets");
        expect(*offsets_, sub_type, {nb, sub_n, LANES}, "offsets");
      } else {
        expect(*offsets_, dt, {nb, nseg, LANES}, "offsets");
      }
    }
  }

  template <class F>
  void parallel(int parts, int64_t count, const F& body) const { parallel_parts(parts, count, body); }

  template <class Acts, class G>
  void gemm(const Weights& w, const Acts& a, const Out& o, G fn) const {
    const int64_t bytes = int64_t(w.nb) * w.kc * BLOCK_BYTES * (1 + a.m / 4);
    parallel(threads_for(bytes), w.nb, [&](int64_t b, int64_t e) { fn(w, a, o, int(b), int(e)); });
  }

  int prep_threads(int64_t m) const { return threads_for(m * kp_ * 32); }

  // Tokens per block: the block's activation stream (`bytes_per_token` each) stays
  // within ~512 KiB of L2 while every row block of weights streams past it; a
  // multiple of 6 (the widest token tile).  Bounds the scratch for long prompts too.
  static int64_t block_tokens(int64_t bytes_per_token, int64_t m) {
    const int64_t mb = std::clamp<int64_t>((512 << 10) / std::max<int64_t>(bytes_per_token, 1) / 6 * 6, 6,
                                           MAX_BLOCK_TOKENS);
    return std::min(mb, m);
  }

  // Run `body(in, out, tokens)` on token blocks [m0, m0 + mb) of x and y.
  template <class F>
  void for_token_blocks(const RawX& in, const Out& o, int64_t m, int64_t mb, const F& body) const {
    const int64_t xsize = in.dtype == DType::F32 ? 4 : 2, ysize = o.dtype == DType::F32 ? 4 : 2;
    for (int64_t m0 = 0; m0 < m; m0 += mb) {
      RawX bin = in;
      bin.x = static_cast<const char*>(in.x) + m0 * in.k * xsize;
      Out bo = o;
      bo.y = static_cast<char*>(o.y) + m0 * o.ld * ysize;
      body(bin, bo, std::min(mb, m - m0));
    }
  }

  // Float activations: their split fixed-point image (common.h SplitActs), gathered into
  // stream order first when the order is not the identity (act-order, inner padding).
  void run_split(const Weights& w, const RawX& in, const Out& o, int64_t m) const {
    thread_local std::vector<int8_t> xs_buf;
    thread_local std::vector<int32_t> qsum_buf;
    thread_local std::vector<float> scale_buf, gather_buf;
    const int64_t mb = block_tokens(kp_ * (src_ ? 4 + parts_ : parts_), m);
    int8_t* xs = scratch(xs_buf, size_t(mb * kp_ * parts_));  // [MB, KC, parts * CK]
    int32_t* qsum = scratch(qsum_buf, size_t(mb * w.nseg * 2));    // [MB, S, 2]
    float* xscale = scratch(scale_buf, size_t(mb * w.nseg));    // [MB, S]
    float* gathered = src_ ? scratch(gather_buf, size_t(mb * kp_)) : nullptr;  // [MB, Kp]
    for_token_blocks(in, o, m, mb, [&](const RawX& bin, const Out& bo, int64_t mm) {
      parallel(prep_threads(mm), mm, [&](int64_t b, int64_t e) {
        if (!gathered) return table_.quantize_split(bin, xs, qsum, xscale, int(b), int(e));
        gather_stream(bin, gathered, int(b), int(e));
        RawX g = bin;
        g.x = gathered;
        g.dtype = DType::F32;
        g.k = kp_;
        g.src = nullptr;
        table_.quantize_split(g, xs, qsum, xscale, int(b), int(e));
      });
      gemm(w, SplitActs{xs, qsum, xscale, kp_ * parts_, int32_t(mm), parts_}, bo, table_.gemm_split);
    });
  }

  void run_int8(const Weights& w, const RawX& in, const Out& o, int64_t m) const {
    thread_local std::vector<int8_t> q_buf;
    thread_local std::vector<int32_t> qsum_buf;
    thread_local std::vector<float> sz_buf, gs_buf;
    const int64_t mb = block_tokens(kp_, m);
    int8_t* q = scratch(q_buf, size_t(mb * kp_));            // [MB, Kp]
    int32_t* qsum = scratch(qsum_buf, size_t(mb * w.nseg));  // [MB, S]
    float* sz = scratch(sz_buf, size_t(2 * mb));             // scale [MB], zero [MB]
    float* gs = aq_.per_segment ? scratch(gs_buf, size_t(mb * w.nseg)) : nullptr;  // [MB, S]
    for_token_blocks(in, o, m, mb, [&](const RawX& bin, const Out& bo, int64_t mm) {
      parallel(prep_threads(mm), mm, [&](int64_t b, int64_t e) {
        quantize_int8(bin, q, qsum, sz, sz + mm, gs, int(b), int(e));
      });
      gemm(w, I8Acts{q, qsum, sz, sz + mm, kp_, int32_t(mm), !aq_.symmetric, gs, super_.gsuper}, bo, table_.gemm_i8);
    });
  }

  // Tokens [m0, m1) of the int8 stream: q [M, Kp], qsum [M, S], per-token scale and zero [M] or gscale
  // [M, S] per segment / [M, S / gps] per super-block.
  void quantize_int8(const RawX& in, int8_t* q, int32_t* qsum, float* scale, float* zero, float* gscale, int m0,
                     int m1) const {
    if (super_.gsuper) return super_.quantize(table_, in, aq_, q, qsum, gscale, m0, m1);
    table_.quantize(in, aq_, q, qsum, scale, zero, gscale, m0, m1);
  }

  // Byte offsets of the team call's scratch parts (the stream first, at 0).
  struct TeamScratch {
    int64_t qsum, scale, gscale, gathered, end;
  };
  TeamScratch team_layout(int64_t m) const {
    TeamScratch t{};
    const int64_t stream = m * kp_ * (int8_ ? 1 : parts_);  // int8 [M, Kp (x parts)]
    t.qsum = align64(stream);
    t.scale = t.qsum + align64(m * w_.nseg * (int8_ ? 1 : 2) * 4);  // int32 [M, S (x2)]
    t.gscale = t.scale + align64((int8_ ? 2 * m : m * w_.nseg) * 4);  // float [2M] or [M, S]
    t.gathered = t.gscale + (aq_.per_segment ? align64(m * w_.nseg * 4) : 0);  // float [M, S] per-segment scales
    t.end = t.gathered + (src_ && !int8_ ? align64(m * kp_ * 4) : 0);  // float [M, Kp]
    return t;
  }

  at::Tensor codes_, scales_;
  std::optional<at::Tensor> zeros_, offsets_;
  at::Tensor seg_end_;
  std::optional<at::Tensor> src_, wsum_, hplane_, super_scales_, super_offsets_;
  bool int8_;
  std::string isa_;
  const KernelTable& table_;
  Weights w_;
  ActQuant aq_;
  int64_t k_ = 0, kp_ = 0;
  int threads_ = 1;
  SuperActs super_;  // llama.cpp's K-quant arithmetic, or off
  int parts_ = SPLIT_PARTS;  // float activations: the split image's parts (3: 24 bits, 2: 16 bits)
};

}  // namespace

void register_linear(pybind11::module_& m) {
  namespace py = pybind11;
  // the base the fused decode step (step.cpp) holds layers' linears by
  py::class_<LinearOp>(m, "LinearOp");
  py::class_<NativeLinear, LinearOp>(m, "NativeLinear")
      .def(py::init<at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>, at::Tensor,
                    std::optional<at::Tensor>, std::optional<at::Tensor>, int64_t, int64_t, int64_t, std::string,
                    std::string, bool, bool, double, double, int64_t, std::optional<at::Tensor>,
                    std::optional<at::Tensor>, std::optional<at::Tensor>, std::optional<double>, int64_t, int64_t,
                    bool, int64_t, bool>(),
           py::arg("codes"), py::arg("scales"), py::arg("zeros"), py::arg("offsets"), py::arg("seg_end"),
           py::arg("src"), py::arg("wsum"), py::arg("bits"), py::arg("n"), py::arg("k"), py::arg("family"),
           py::arg("isa"), py::arg("act_dynamic") = true, py::arg("act_symmetric") = true, py::arg("act_scale") = 0.0,
           py::arg("act_zero") = 0.0, py::arg("threads") = 1, py::arg("hplane") = py::none(),
           py::arg("super_scales") = py::none(), py::arg("super_offsets") = py::none(), py::arg("zconst") = py::none(),
           py::arg("sub_bits") = 8, py::arg("sub_bias") = 0, py::arg("act_per_segment") = false,
           py::arg("image_bits") = 24, py::arg("act_per_super") = false)
      // the GIL is released while the kernel runs (it touches no Python object)
      .def("forward", &NativeLinear::forward, py::arg("x"), py::arg("bias") = py::none(),
           py::call_guard<py::gil_scoped_release>())
      .def("set_threads", &NativeLinear::set_threads)
      .def_property_readonly("threads", &NativeLinear::threads)
      .def_property_readonly("isa", &NativeLinear::isa);
}

}  // namespace quill
