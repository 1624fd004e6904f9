// The dense 16-bit kernel (dense.h) written once over a 16-lane float32 vector type V,
// instantiated by dense_scalar.cpp, dense_avx2.cpp and dense_avx512.cpp.  V provides:
//
//   V::zero(), V::fma(w, x, acc) = acc + w * x (one rounding), V::add(a, b),
//   V::pair<F16>(block, even, odd): the 16 lanes' two weights of a column pair as float32,
//   V::store(v, float[16]).
//
// The loop nest and every accumulation depend on the token count only, so all variants
// perform the same fused multiply-adds in the same order per lane.
#pragma once

#include <algorithm>

#include "dense.h"
#include "scalar_util.h"

namespace quill {
namespace dense {

constexpr int MT_MAX = 6;           // widest token tile
constexpr int KBLOCK_PAIRS = 256;   // column pairs per K block when M > MT_MAX (16 KiB per row block)

// MT tokens x RB row blocks x column pairs [p0, p1); partial sums in/out through st[r][m].
// NA accumulators per token and row block (pair parity) keep enough FMA chains in flight;
// NA depends on MT alone, so the sums are the same whichever threads own which row blocks.
template <class V, bool F16, int MT, int RB>
void tile(const DenseWeights& w, const DenseActs& a, int nb, int m0, int64_t p0, int64_t p1, float (*st[RB])[LANES]) {
  constexpr int NA = MT == 1 ? 2 : 1;  // by MT only: the same sums whatever the row-block pairing
  V acc[RB][MT][2 * NA];  // [.., even/odd x NA]
  for (int r = 0; r < RB; ++r)
    for (int m = 0; m < MT; ++m)
      for (int i = 0; i < 2 * NA; ++i) acc[r][m][i] = V::zero();
  const uint16_t* blocks[RB];
  for (int r = 0; r < RB; ++r) blocks[r] = w.words + (int64_t(nb + r) * w.kp) * 2 * LANES;
  for (int64_t p = p0; p < p1; ++p) {
    const int i = NA == 2 ? int(p & 1) * 2 : 0;
    V even[RB], odd[RB];
    for (int r = 0; r < RB; ++r) {
      const uint16_t* blk = blocks[r] + p * 2 * LANES;
      __builtin_prefetch(reinterpret_cast<const char*>(blk) + PREFETCH_BYTES, 0, 2);
      V::template pair<F16>(blk, even[r], odd[r]);
    }
    for (int m = 0; m < MT; ++m) {
      const float* x = a.x + (m0 + m) * a.ld + 2 * p;
      for (int r = 0; r < RB; ++r) {
        acc[r][m][i] = V::fma(even[r], x[0], acc[r][m][i]);
        acc[r][m][i + 1] = V::fma(odd[r], x[1], acc[r][m][i + 1]);
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int m = 0; m < MT; ++m) {
      V t = acc[r][m][0];
      for (int j = 1; j < 2 * NA; ++j) t = V::add(t, acc[r][m][j]);
      alignas(64) float part[LANES];
      V::store(t, part);
      for (int l = 0; l < LANES; ++l) st[r][m][l] = st[r][m][l] + part[l];
    }
}

template <class V, bool F16, int RB>
void tile_mt(int mt, const DenseWeights& w, const DenseActs& a, int nb, int m0, int64_t p0, int64_t p1,
             float (*st[RB])[LANES]) {
  switch (mt) {
    case 1: return tile<V, F16, 1, RB>(w, a, nb, m0, p0, p1, st);
    case 2: return tile<V, F16, 2, RB>(w, a, nb, m0, p0, p1, st);
    case 3: return tile<V, F16, 3, RB>(w, a, nb, m0, p0, p1, st);
    case 4: return tile<V, F16, 4, RB>(w, a, nb, m0, p0, p1, st);
    case 5: return tile<V, F16, 5, RB>(w, a, nb, m0, p0, p1, st);
    default: return tile<V, F16, 6, RB>(w, a, nb, m0, p0, p1, st);
  }
}

// Row blocks [nb0, nb1): two per pass sharing the activation loads when M <= 3; K in
// blocks of KBLOCK_PAIRS when M > MT_MAX so a block of weights stays in L1 for every tile.
template <class V, bool F16>
void gemm(const DenseWeights& w, const DenseActs& a, const Out& o, int nb0, int nb1) {
  static thread_local float state[2][MAX_BLOCK_TOKENS][LANES];
  const int rbmax = a.m <= 3 ? 2 : 1;
  const int64_t kb = a.m <= MT_MAX ? w.kp : KBLOCK_PAIRS;
  for (int nb = nb0; nb < nb1; nb += rbmax) {
    const int rb = std::min(rbmax, nb1 - nb);
    for (int r = 0; r < rb; ++r) std::fill(&state[r][0][0], &state[r][0][0] + a.m * LANES, 0.0f);
    for (int64_t p0 = 0; p0 < w.kp; p0 += kb) {
      const int64_t p1 = std::min(w.kp, p0 + kb);
      for (int m0 = 0; m0 < a.m; m0 += MT_MAX) {
        const int mt = std::min(MT_MAX, a.m - m0);
        float (*st[2])[LANES] = {state[0] + m0, state[1] + m0};
        if (rb == 2) tile_mt<V, F16, 2>(mt, w, a, nb, m0, p0, p1, st);
        else tile_mt<V, F16, 1>(mt, w, a, nb, m0, p0, p1, st);
      }
    }
    for (int r = 0; r < rb; ++r)
      for (int m = 0; m < a.m; ++m)
        for (int l = 0; l < LANES && (nb + r) * LANES + l < w.n; ++l) {
          const int n = (nb + r) * LANES + l;
          store_value(o, m, n, w.bias ? state[r][m][l] + w.bias[n] : state[r][m][l]);
        }
  }
}

template <class V>
void run(const DenseWeights& w, const DenseActs& a, const Out& o, int nb0, int nb1) {
  if (w.f16) gemm<V, true>(w, a, o, nb0, nb1);
  else gemm<V, false>(w, a, o, nb0, nb1);
}

}  // namespace dense
}  // namespace quill
