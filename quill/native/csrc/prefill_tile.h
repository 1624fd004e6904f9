// The prefill-attention template (prefill.h), included by attention_{scalar,avx2,avx512}.cpp after
// attention_tile.h (whose exp_neg it shares).  GCC vector types of PF_VW floats (the TU's register:
// 16 zmm, 8 ymm, 4 SSE) and plain loops the compiler vectorises across rows: the arithmetic is
// element-wise and each value's sums run in the same order in every variant (scores over D in
// order, softmax sums and p V over the keys in order), so every variant gives the scalar twin's
// bits.  The vector width and register blocking are the TU's choice and touch no sum's order:
//   QK: PF_QK_KEYS keys x PF_QK_VECS row vectors per pass; PV: PF_PV_ROWS rows x PF_PV_VECS vectors.
//
// Layout of one (KV head, query block) call: rows r = (token i0 + r / G, query head r % G); queries
// transposed, qT [D, rp], so scores for a key are a row of vectors, sT [BK, rp]; K rows and V rows
// are read straight from the pool (V through a zero-padded copy when D is not a multiple of 64).
#pragma once

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "attention_tile.h"
#include "prefill.h"

#ifndef PF_VW
#define PF_VW 4
#define PF_QK_KEYS 2
#define PF_QK_VECS 2
#define PF_PV_ROWS 2
#define PF_PV_VECS 2
#endif

namespace quill::attn {
namespace {

constexpr int64_t BK = kPrefillKeys;
constexpr int64_t VW = PF_VW;  // floats per vector
typedef float vf __attribute__((vector_size(PF_VW * 4)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, const vf& v) { std::memcpy(p, &v, sizeof v); }
inline vf splat(float x) { return vf{} + x; }

// sT[j][r0 .. r0 + RV VW) = k_j . qT[:, r] for keys [j0, j0 + KB): k rows `krow` floats apart
template <int KB, int RV>
inline void qk(const float* const* __restrict krows, const float* __restrict qT, float* __restrict sT, int64_t j0,
               int64_t r0, int64_t d, int64_t rp) {
  vf s[KB][RV];
  for (int kk = 0; kk < KB; ++kk)
    for (int c = 0; c < RV; ++c) s[kk][c] = vf{};
  for (int64_t i = 0; i < d; ++i) {
    vf qv[RV];
    for (int c = 0; c < RV; ++c) qv[c] = load(qT + i * rp + r0 + c * VW);
    for (int kk = 0; kk < KB; ++kk) {
      const vf kb = splat(krows[j0 + kk][i]);
      for (int c = 0; c < RV; ++c) s[kk][c] = fused(kb, qv[c], s[kk][c]);
    }
  }
  for (int kk = 0; kk < KB; ++kk)
    for (int c = 0; c < RV; ++c) store(sT + (j0 + kk) * rp + r0 + c * VW, s[kk][c]);
}

// acc[r] = acc[r] * alpha[r] + sum_{j < nk} pT[j][r] v_j, rows [r0, r0 + RB), columns [dc, dc + DV VW)
template <int RB, int DV>
inline void pv(const float* const* __restrict vrows, const float* __restrict pT, const float* __restrict alpha,
               float* __restrict acc, int64_t r0, int64_t dc, int64_t dp, int64_t rp, int64_t nk) {
  vf a[RB][DV];
  for (int rr = 0; rr < RB; ++rr) {
    const vf al = splat(alpha[r0 + rr]);
    for (int c = 0; c < DV; ++c) a[rr][c] = load(acc + (r0 + rr) * dp + dc + c * VW) * al;
  }
  for (int64_t j = 0; j < nk; ++j) {
    vf vv[DV];
    for (int c = 0; c < DV; ++c) vv[c] = load(vrows[j] + dc + c * VW);
    for (int rr = 0; rr < RB; ++rr) {
      const vf pb = splat(pT[j * rp + r0 + rr]);
      for (int c = 0; c < DV; ++c) a[rr][c] = fused(pb, vv[c], a[rr][c]);
    }
  }
  for (int rr = 0; rr < RB; ++rr)
    for (int c = 0; c < DV; ++c) store(acc + (r0 + rr) * dp + dc + c * VW, a[rr][c]);
}

// Online softmax of one key block, every row at once: sT becomes p = exp(score - new max) where
// key j0 + j <= the row's position (and within its window), else 0; alpha the factor the row's earlier
// sums are rescaled by.  A row none of whose keys are seen yet keeps m = kMasked and l = 0.
inline void softmax_block(float* __restrict sT, const int64_t* __restrict pos, float* __restrict m,
                          float* __restrict l, float* __restrict alpha, float* __restrict bm, int64_t j0, int64_t nk,
                          int64_t rp, int64_t window) {
  // a key is seen when pos - window < key <= pos (window 0: every key up to pos)
  auto seen = [&](int64_t key, int64_t p) { return key <= p && (window == 0 || key > p - window); };
  for (int64_t r = 0; r < rp; ++r) bm[r] = m[r];
  for (int64_t j = 0; j < nk; ++j)  // the max is exact whatever the order
    for (int64_t r = 0; r < rp; ++r) {
      const float s = sT[j * rp + r];
      bm[r] = seen(j0 + j, pos[r]) && s > bm[r] ? s : bm[r];
    }
  for (int64_t r = 0; r < rp; ++r) {
    alpha[r] = m[r] == kMasked ? 0.0f : exp_neg(m[r] - bm[r]);
    l[r] = l[r] * alpha[r];
    m[r] = bm[r];
  }
  for (int64_t j = 0; j < nk; ++j)
    for (int64_t r = 0; r < rp; ++r) {
      const float p = seen(j0 + j, pos[r]) ? exp_neg(sT[j * rp + r] - m[r]) : 0.0f;
      sT[j * rp + r] = p;
      l[r] = l[r] + p;
    }
}

// T: the pools' element (float, uint16_t bfloat16 words, _Float16); 16-bit rows are widened into
// the scratch block by block (exactly, so the bits are those of float32 pools holding the values).
template <class T>
void prefill_typed(const PrefillArgs& a, const T* kpool, const T* vpool, int64_t kvh, int64_t i0, int64_t i1,
                   float* __restrict scratch) {
  const int64_t G = a.h / a.hkv, D = a.d, R = (i1 - i0) * G;
  const int64_t rp = prefill_rows(R), dp = prefill_cols(D), row = a.hkv * D;  // row: the pools' row stride
  float* __restrict qT = scratch;            // [D, rp] scaled queries, transposed (zero rows past R)
  float* __restrict sT = qT + D * rp;        // [BK, rp] scores, then p
  float* __restrict acc = sT + BK * rp;      // [rp, dp]
  float* __restrict vb = acc + rp * dp;      // [BK, dp] the block's V rows, zero-padded (D < dp only)
  float* __restrict m = vb + BK * dp;        // [rp] running max
  float* __restrict l = m + rp;              // [rp] running sum
  float* __restrict alpha = l + rp;          // [rp] this block's rescale
  float* __restrict bm = alpha + rp;         // [rp] this block's new max
  float* __restrict kw = bm + rp;            // [BK, D] the block's K rows widened (16-bit pools only)
  int64_t* __restrict pos = reinterpret_cast<int64_t*>(kw + BK * D);  // [rp] each row's position (keys <= it)
  const float* krows[BK];
  const float* vrows[BK];
  for (int64_t r = 0; r < rp; ++r) {
    const int64_t rr = std::min(r, R - 1);  // rows past R repeat the last (their results are dropped)
    const float* q = a.q + ((i0 + rr / G) * a.h + kvh * G + rr % G) * D;
    for (int64_t i = 0; i < D; ++i) qT[i * rp + r] = r < R ? q[i] * a.scale : 0.0f;
    for (int64_t i = 0; i < dp; ++i) acc[r * dp + i] = 0.0f;
    // a sink is a key every row sees first, with no value: the running max starts at it, the sum at exp(0)
    if (a.sinks) m[r] = a.sinks[kvh * G + rr % G], l[r] = 1.0f;
    else m[r] = kMasked, l[r] = 0.0f;
    pos[r] = a.start + i0 + rr / G;
  }
  const int64_t last = a.start + i1 - 1;  // the block's last position: keys [0, last]
  // with a window, keys before the first row's window are never read
  const int64_t first = a.window > 0 ? std::max<int64_t>(0, a.start + i0 - a.window + 1) : 0;
  for (int64_t j0 = first; j0 <= last; j0 += BK) {
    const int64_t nk = std::min(BK, last + 1 - j0);
    for (int64_t j = 0; j < nk; ++j) {
      const T* kr = kpool + a.ctx[j0 + j] * row + kvh * D;
      const T* vr = vpool + a.ctx[j0 + j] * row + kvh * D;
      if constexpr (std::is_same_v<T, float>) {
        krows[j] = kr;
        if (dp == D) {
          vrows[j] = vr;
          continue;
        }
      } else {
        widen_row(kr, kw + j * D, D);
        krows[j] = kw + j * D;
      }
      widen_row(vr, vb + j * dp, D);
      for (int64_t i = D; i < dp; ++i) vb[j * dp + i] = 0.0f;
      vrows[j] = vb + j * dp;
    }
    int64_t j = 0;
    for (; j + PF_QK_KEYS <= nk; j += PF_QK_KEYS)
      for (int64_t r0 = 0; r0 < rp; r0 += PF_QK_VECS * VW) qk<PF_QK_KEYS, PF_QK_VECS>(krows, qT, sT, j, r0, D, rp);
    for (; j < nk; ++j)
      for (int64_t r0 = 0; r0 < rp; r0 += PF_QK_VECS * VW) qk<1, PF_QK_VECS>(krows, qT, sT, j, r0, D, rp);
    softmax_block(sT, pos, m, l, alpha, bm, j0, nk, rp, a.window);
    for (int64_t r0 = 0; r0 < rp; r0 += PF_PV_ROWS)
      for (int64_t dc = 0; dc < dp; dc += PF_PV_VECS * VW)
        pv<PF_PV_ROWS, PF_PV_VECS>(vrows, sT, alpha, acc, r0, dc, dp, rp, nk);
  }
  for (int64_t r = 0; r < R; ++r) {  // every row saw its own position: l > 0
    const float inv = 1.0f / l[r];
    float* o = a.out + ((i0 + r / G) * a.h + kvh * G + r % G) * D;
    for (int64_t i = 0; i < D; ++i) o[i] = acc[r * dp + i] * inv;
  }
}

void prefill_block(const PrefillArgs& a, int64_t kvh, int64_t i0, int64_t i1, float* __restrict scratch) {
  if (a.k16 && a.f16)
    return prefill_typed(a, reinterpret_cast<const _Float16*>(a.k16), reinterpret_cast<const _Float16*>(a.v16), kvh,
                         i0, i1, scratch);
  if (a.k16) return prefill_typed(a, a.k16, a.v16, kvh, i0, i1, scratch);
  prefill_typed(a, a.k, a.v, kvh, i0, i1, scratch);
}

}  // namespace
}  // namespace quill::attn
