// The loop nest shared by the AVX-512 kernels: row block x K block x token tile (by_tokens also serves
// the AVX2 K-quant tile, avx2_super.h).
//
// For one token (M = MT_MAX or fewer) a row block streams its whole K in one pass.
// For more tokens, K is cut into blocks of KBLOCK_CHUNKS chunks so one K block of
// a row block's codes (4-8 KiB) and of a token tile's activations stay in L1 while
// every token tile of the block reuses them; the per-token partial results (the
// running segment sums and the finished segments' total f, 16 lanes each) wait
// in a small LaneState array between K blocks.
#pragma once

#include <algorithm>
#include <type_traits>

#include "common.h"

namespace quill {

constexpr int MT_MAX = 6;           // widest token tile of the AVX-512 kernels
constexpr int KBLOCK_CHUNKS = 64;   // chunks per K block (4 KiB of codes per row block)
// PREFETCH_BYTES (common.h): how far ahead the tiles prefetch their code stream.

// f(std::integral_constant<int, mt>{}) for a tile of mt tokens, 1 <= mt <= MAXT: the token count a tile
// template is instantiated for (its accumulator arrays are sized by it).  MAXT bounds what is compiled:
// every width is a tile function of its own, and they are most of the AVX-512 build's time.
template <int MAXT = MT_MAX, int T = 1, class F>
inline void by_tokens(int mt, const F& f) {
  static_assert(MAXT >= 1 && MAXT <= MT_MAX && T <= MAXT, "tiles of 1 .. MT_MAX tokens");
  if constexpr (T == MAXT) {
    f(std::integral_constant<int, T>{});
  } else {
    if (mt == T) return f(std::integral_constant<int, T>{});
    by_tokens<MAXT, T + 1>(mt, f);
  }
}

template <class D>
struct alignas(64) LaneState {
  D d[LANES];      // the open segment's partial sum (int32; split kernels: Dlo)
  D d2[LANES];     // split kernels: the open segment's Dhi (unused by int8 kernels)
  float f[LANES];  // the finished segments' total
};

// Row blocks [nb0, nb1) for m tokens, RB row blocks per pass (they share the
// activation loads), token tiles of up to MTW tokens.  tile(mt, rb, nb, m0, c0, c1, s, st):
// row blocks nb .. nb+rb-1 (rb <= RB), tokens [m0, m0 + mt), chunks [c0, c1) starting in
// segment s, partial results of row block r in st[r][0..mt).
// finish(nb, m, state): store the outputs of token m for row block nb.
template <class D, int RB, class Tile, class Finish, int MTW = MT_MAX>
void run_kblocked(const Weights& w, int m, int nb0, int nb1, const Tile& tile, const Finish& finish) {
  static_assert(RB >= 1 && RB <= 2 && MTW >= 1 && MTW <= MT_MAX, "one or two row blocks, tiles of <= MT_MAX tokens");
  LaneState<D> state[RB][MAX_BLOCK_TOKENS];
  const int kcb = m <= MTW ? w.kc : KBLOCK_CHUNKS;
  for (int nb = nb0; nb < nb1; nb += RB) {
    const int rb = std::min(RB, nb1 - nb);
    for (int r = 0; r < rb; ++r) std::fill(reinterpret_cast<char*>(state[r]), reinterpret_cast<char*>(state[r] + m), 0);
    for (int c0 = 0, s = 0; c0 < w.kc; c0 += kcb) {
      const int c1 = std::min(w.kc, c0 + kcb);
      while (w.seg_end[s] <= c0) ++s;  // the segment holding chunk c0
      for (int m0 = 0; m0 < m; m0 += MTW) {
        LaneState<D>* st[RB];
        for (int r = 0; r < RB; ++r) st[r] = state[std::min(r, rb - 1)] + m0;
        tile(std::min(MTW, m - m0), rb, nb, m0, c0, c1, s, static_cast<LaneState<D>* const*>(st));
      }
    }
    for (int r = 0; r < rb; ++r)
      for (int t = 0; t < m; ++t) finish(nb + r, t, state[r][t]);
  }
}

}  // namespace quill
