// llama.cpp's arithmetic for two-level weights (GGUF K-quants; common.h I8Acts::gsuper): the layout checks and
// the activation quantizer of one linear (linear.cpp).
#pragma once

#include <string>
#include <vector>

#include "common.h"
#include "scalar_util.h"

namespace quill {

struct SuperActs {
  std::vector<int32_t> ends;  // [S / gps] the exclusive end chunk of every super-block
  int32_t gsuper = 0;         // 0: off

  // Why the layout cannot take one activation scale per super-block, or "" (then `ends` is set): A and B
  // (common.h I8Acts::gsuper) must fit int32, and a segment's X int16 (the SIMD kernels pair two segments'
  // X in one vpmaddwd / vpdpwssd).
  std::string setup(const Weights& w, bool has_zeros, bool has_super_offsets, bool reordered) {
    if (!w.super_scales) return "needs two-level scales";
    if (has_zeros || reordered) return "needs one zero point and the identity order";
    if (w.offsets && !has_super_offsets) return "needs two-level offsets";
    const int64_t positions = longest_segment(w.seg_end, w.nseg, w.bits);
    const double qmax = double((1 << w.bits) - 1), dev = std::max<double>(w.zconst, qmax - w.zconst);
    const double sub = w.sub_bits == 8 ? 128.0 : double(1 << w.sub_bits), x = 128.0 * double(positions);
    if (x > 32767.0) return "segments longer than 255 positions";
    if (double(w.gps) * sub * x * std::max(dev, w.zconst + 1.0) >= 2147483648.0)
      return "super-block sums that could overflow int32";
    ends.clear();
    for (int u = 1; u <= w.nseg / w.gps; ++u) ends.push_back(w.seg_end[u * w.gps - 1]);
    gsuper = w.gps;
    return "";
  }

  // Tokens [m0, m1): q [M, Kp] and gscale [M, S / gps] through the ISA's per-segment quantizer over the
  // super-blocks (the same codes and scales it gives any segment), then qsum [M, S] per segment.  One token a
  // call, its super-block sums written into its own row of qsum, which the segment sums then replace.
  void quantize(const KernelTable& t, const RawX& in, const ActQuant& aq, int8_t* q, int32_t* qsum, float* gscale,
                int m0, int m1) const {
    RawX sup = in;
    sup.seg_end = ends.data();
    sup.nseg = int32_t(ends.size());
    for (int m = m0; m < m1; ++m) {
      float unused[2];
      t.quantize(sup, aq, q, qsum + int64_t(m) * (in.nseg - sup.nseg), unused, unused + 1, gscale, m, m + 1);
      segment_sums(in, q + m * in.kp, qsum + int64_t(m) * in.nseg);
    }
  }
};

}  // namespace quill
