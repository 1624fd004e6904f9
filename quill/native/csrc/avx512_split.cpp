// The float-activation GEMMs (W4A16 / W8A16) on AVX-512 VNNI: the activations as their split fixed-point
// image (common.h SplitActs), multiplied by vpdpbusd exactly as the int8 kernels of avx512_vnni.cpp do.  A
// translation unit of its own so that the two halves of the AVX-512 kernels compile side by side (each is
// about half of the build's longest compile).  Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512vnni;
// called only when the CPU has all of them.
#include <immintrin.h>

#include "kblock.h"
#include "quantizers.h"
#include "simd512.h"

namespace quill {
namespace {
// ---- W4A16 / W8A16: float activations as their split image (SplitActs) ----

// MT tokens x RB row blocks x chunks [c0, c1), starting in segment s; partial
// results in/out through st[r] (kblock.h).  PARTS = 3 (the 24-bit image): hi, mid, then lo
// bytes per chunk, Dhi = part 0, Dlo = 256 * part 1 + part 2; PARTS = 2 (16 bits): hi, then lo,
// Dlo = part 1.  The partial state holds Dhi and Dlo, so they enter the first and last parts.
// The row blocks share the activation broadcasts; NA accumulators per part (4-bit:
// nibble x chunk parity, 8-bit: chunk parity) keep enough vpdpbusd chains in flight.
// EPI: the epilogue's shortcuts (common.h Weights::fold_zero / fuse_t): 0 none, 1 the zero point folded
// into the segment sums, 2 that and T formed in int32, 3 offsets and no zero point (run_split_epi).
// Compile-time, so the per-segment work has no branch.
template <int BITS, int PARTS, int EPI, int MT, int RB>
void tile(const Weights& w, const SplitActs& a, int nb, int m0, int c0, int c1, int s, LaneState<int32_t>* const* st) {
  constexpr int CK = chunk_k(BITS), STRIDE = PARTS * CK, LO = PARTS - 1;
  constexpr bool FOLD = EPI == 1 || EPI == 2, FUSE = EPI == 2, NOZ = EPI == 3;
  constexpr int NSUB = CK / 4;  // byte vectors per chunk: 1 (8-bit), 2 (4-6 bit), 4 (2/3-bit)
  constexpr int CHAINS = RB * MT * PARTS;
  constexpr int NA = CHAINS == 1 ? 4 : (CHAINS <= 6 ? 2 : 1);
  const __m512i low = _mm512_set1_epi8(0x0F);
  const uint8_t* blocks[RB];  // [KC, 64] each
  const int8_t* xs[MT];       // [KC, STRIDE] each
  __m512i acc[RB][MT][PARTS][NA];
  __m512 f[RB][MT];  // the finished segments' total
  v512::Supers sup[RB];
  QUILL_UNROLL for (int r = 0; r < RB; ++r) blocks[r] = w.codes + int64_t(nb + r) * w.kc * BLOCK_BYTES;
  QUILL_UNROLL for (int m = 0; m < MT; ++m) xs[m] = a.x + (m0 + m) * a.ld;
  auto reset = [&](int r, int m) {
    QUILL_UNROLL for (int p = 0; p < PARTS; ++p)
      QUILL_UNROLL for (int i = 0; i < NA; ++i) acc[r][m][p][i] = _mm512_setzero_si512();
  };
  auto part = [&](int r, int m, int p) {
    __m512i d = acc[r][m][p][0];
    QUILL_UNROLL for (int i = 1; i < NA; ++i) d = _mm512_add_epi32(d, acc[r][m][p][i]);
    return d;
  };
  // the open segment's exact sums: Dhi, Dlo
  auto dhi = [&](int r, int m) { return part(r, m, 0); };
  auto dlo = [&](int r, int m) {
    if constexpr (PARTS == 2) return part(r, m, LO);
    else return _mm512_add_epi32(_mm512_slli_epi32(part(r, m, 1), 8), part(r, m, LO));
  };
  // FOLD: segment s's Dhi and Dlo accumulators start at -z * Xhi, -z * Xlo
  const int32_t zc = int32_t(w.zconst);
  auto open = [&](int r, int m, int s) {  // after a reset
    const int64_t i = int64_t(m0 + m) * w.nseg + s;
    acc[r][m][0][0] = _mm512_set1_epi32(-zc * a.qsum[2 * i]);
    acc[r][m][LO][0] = _mm512_set1_epi32(-zc * a.qsum[2 * i + 1]);
  };
  QUILL_UNROLL for (int r = 0; r < RB; ++r)
    QUILL_UNROLL for (int m = 0; m < MT; ++m) {
      reset(r, m);
      if (FOLD && c0 == 0) {
        open(r, m, s);  // a row block's first segment (later ones open at the reset below)
      } else {
        acc[r][m][0][0] = _mm512_load_si512(st[r][m].d2);
        acc[r][m][LO][0] = _mm512_load_si512(st[r][m].d);
      }
      f[r][m] = _mm512_load_ps(st[r][m].f);
    }
  // one chunk into accumulator set PAR (0 or 1: chunk parity)
  auto chunk = [&](int c, auto par) {
    constexpr int P = decltype(par)::value;
    __m512i q[RB][4];
    QUILL_UNROLL for (int r = 0; r < RB; ++r) {
      const uint8_t* p = blocks[r] + int64_t(c) * BLOCK_BYTES;
      // RB row blocks stream side by side, and row blocks are contiguous: RB x the distance
      // reaches past the pass's other row block
      _mm_prefetch(reinterpret_cast<const char*>(p + RB * PREFETCH_BYTES), _MM_HINT_T1);
      const __m512i v = _mm512_loadu_si512(p);
      if constexpr (BITS <= 3) {
        v512::unpack_low<BITS>(v, BITS == 3 ? w.hplane + (int64_t(nb + r) * w.kc + c) * plane_bytes(3) : nullptr, q[r]);
      } else if (BITS != 8) {
        q[r][0] = _mm512_and_si512(v, low);
        q[r][1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        if constexpr (BITS == 5 || BITS == 6)
          v512::add_high_bits<BITS>(w.hplane + (int64_t(nb + r) * w.kc + c) * plane_bytes(BITS), q[r][0], q[r][1]);
      } else {
        q[r][0] = q[r][1] = v;
      }
    }
    QUILL_UNROLL for (int m = 0; m < MT; ++m) {
      const int8_t* x = xs[m] + int64_t(c) * STRIDE;
      QUILL_UNROLL for (int p = 0; p < PARTS; ++p)
        QUILL_UNROLL for (int h = 0; h < NSUB; ++h) {
          const __m512i xb = v512::bcast4(x + p * CK + 4 * h);
          constexpr int NI = NA;  // accumulator index: nibble h, then parity (2/3-bit: sub-vector h)
          const int i = BITS <= 3 ? (NI == 4 ? h : (NI == 2 ? (h & 1) : 0))
                                  : BITS != 8 ? (NI >= 2 ? h + (NI == 4 ? 2 * P : 0) : 0) : (NI >= 2 ? P : 0);
          QUILL_UNROLL for (int r = 0; r < RB; ++r) acc[r][m][p][i] = _mm512_dpbusd_epi32(acc[r][m][p][i], q[r][h], xb);
        }
    }
  };
  using Even = std::integral_constant<int, 0>;
  using Odd = std::integral_constant<int, 1>;
  for (int c = c0; c < c1; ++s) {
    const int end = std::min(c1, w.seg_end[s]);
    for (; c + 1 < end; c += 2) {
      chunk(c, Even{});
      chunk(c + 1, Odd{});
    }
    if (c < end) chunk(c++, Even{});
    if (c != w.seg_end[s]) break;  // the segment continues in the next K block
    QUILL_UNROLL for (int r = 0; r < RB; ++r) {
      v512::SegConsts sc = v512::seg_consts(w, nb + r, s, sup[r]);
      sc.has_zero = sc.has_zero && !FOLD && !NOZ;
      sc.has_offset = NOZ || (sc.has_offset && !FOLD);  // folded layers have none (linear.cpp): known at compile time
      QUILL_UNROLL for (int m = 0; m < MT; ++m) {
        const int64_t i = int64_t(m0 + m) * w.nseg + s;
        f[r][m] = v512::split_epilogue<PARTS>(sc, dhi(r, m), dlo(r, m), a.qsum[2 * i], a.qsum[2 * i + 1], a.scale[i], f[r][m],
                                       FUSE);
        reset(r, m);
        if (FOLD && s + 1 < w.nseg) open(r, m, s + 1);  // carried in st when it starts in the next K block
      }
    }
  }
  QUILL_UNROLL for (int r = 0; r < RB; ++r)
    QUILL_UNROLL for (int m = 0; m < MT; ++m) {
      _mm512_store_si512(st[r][m].d, dlo(r, m));
      _mm512_store_si512(st[r][m].d2, dhi(r, m));
      _mm512_store_ps(st[r][m].f, f[r][m]);
    }
}

// The widest token tile that runs two row blocks a pass: the accumulators, RB x MT x PARTS, fill the registers
// (24-bit image: 2 x 3 x 3; the 16-bit one: 2 x 4 x 2).
constexpr int split_pair_tokens(int parts) { return parts == SPLIT_PARTS ? 3 : 4; }

// The widest tile of a split image: the 24-bit one (opt-in exact float activations) at most
// split_pair_tokens, so its wider single-row-block tiles are not compiled (4-6 tokens run K-blocked tiles of
// 3 instead, the same arithmetic per token); the 16-bit default up to MT_MAX.
constexpr int split_widest(int parts) { return parts == SPLIT_PARTS ? split_pair_tokens(parts) : MT_MAX; }

template <int BITS, int PARTS, int EPI, int RB>
void tile_mt(int mt, const Weights& w, const SplitActs& a, int nb, int m0, int c0, int c1, int s,
             LaneState<int32_t>* const* st) {
  by_tokens<split_widest(PARTS)>(mt, [&](auto tokens) {
    constexpr int MT = decltype(tokens)::value;
    tile<BITS, PARTS, EPI, MT, (MT <= split_pair_tokens(PARTS) ? RB : 1)>(w, a, nb, m0, c0, c1, s, st);
  });
}

// Row blocks [nb0, nb1): two per pass sharing the activation broadcasts, in tiles of 2-3 tokens
// (two row blocks x 3 tokens x 3 parts fill the registers; against one row block x 6 tokens:
// 1.2B gate_up at 128 tokens 21.3 -> 18.5 ms on Zen 5), one at a time for one token: decode
// streams its weights from DRAM, and one row block after the other is one sequential stream
// (Zen 5, one token through the native step: 1.2B Q4_0 W4A16 +29 %, the default model +14 %;
// with weights cached, two per pass are faster, 179 vs 258 us at 4096 x 4096, but decode is not cached).
template <int BITS, int PARTS, int EPI>
void run_split(const Weights& w, const SplitActs& a, const Out& o, int nb0, int nb1) {
  auto tiles = [&](int mt, int rb, int nb, int m0, int c0, int c1, int s, LaneState<int32_t>* const* st) {
    if (rb == 2 && mt >= 2 && mt <= split_pair_tokens(PARTS)) return tile_mt<BITS, PARTS, EPI, 2>(mt, w, a, nb, m0, c0, c1, s, st);
    for (int r = 0; r < rb; ++r) tile_mt<BITS, PARTS, EPI, 1>(mt, w, a, nb + r, m0, c0, c1, s, st + r);
  };
  auto finish = [&](int nb, int m, const LaneState<int32_t>& st) {
    v512::store_float(w, o, nb, m, _mm512_load_ps(st.f));
  };
  if (a.m <= split_widest(PARTS))
    return run_kblocked<int32_t, 2, decltype(tiles), decltype(finish), split_widest(PARTS)>(w, a.m, nb0, nb1, tiles, finish);
  // K-blocked (weights reused from L1 by every token tile): tiles of at most 3 tokens, so that
  // every tile of two or more runs two row blocks at once
  run_kblocked<int32_t, 2, decltype(tiles), decltype(finish), split_pair_tokens(PARTS)>(w, a.m, nb0, nb1, tiles, finish);
}

// The epilogue's shortcuts are instantiated where they occur: T in int32 for 3/4-bit symmetric layers (GGUF
// Q4_0, Q3_K, GPTQ / compressed-tensors symmetric g32: Weights::fuse_t); the zero point folded for
// every layer with one (Q3_K's 4, Q5_0's 16, Q6_K's 32, Q8_0's 128, symmetric GPTQ / CT); 2-bit layers
// (Q2_K) have offsets instead.
template <int BITS, int PARTS>
void run_split_epi(const Weights& w, const SplitActs& a, const Out& o, int nb0, int nb1) {
  if (offsets_only(w)) return run_split<BITS, PARTS, 3>(w, a, o, nb0, nb1);
  if (!w.fold_zero) return run_split<BITS, PARTS, 0>(w, a, o, nb0, nb1);
  if constexpr (PARTS == 2) {  // the 16-bit image's T always fits int32 (common.h Weights::fuse_t)
    run_split<BITS, PARTS, 2>(w, a, o, nb0, nb1);
  } else {
    if constexpr (BITS <= 4)
      if (w.fuse_t) return run_split<BITS, PARTS, 2>(w, a, o, nb0, nb1);
    run_split<BITS, PARTS, 1>(w, a, o, nb0, nb1);
  }
}

template <int PARTS>
void gemm_split_parts(const Weights& w, const SplitActs& a, const Out& o, int nb0, int nb1) {
  switch (w.bits) {
    case 2:
      return offsets_only(w) ? run_split<2, PARTS, 3>(w, a, o, nb0, nb1) : run_split<2, PARTS, 0>(w, a, o, nb0, nb1);
    case 3: return run_split_epi<3, PARTS>(w, a, o, nb0, nb1);
    case 4: return run_split_epi<4, PARTS>(w, a, o, nb0, nb1);
    case 5: return run_split_epi<5, PARTS>(w, a, o, nb0, nb1);
    case 6: return run_split_epi<6, PARTS>(w, a, o, nb0, nb1);
    default: return run_split_epi<8, PARTS>(w, a, o, nb0, nb1);
  }
}

}  // namespace

namespace avx512 {

void gemm_split(const Weights& w, const SplitActs& a, const Out& o, int nb0, int nb1) {
  if (a.parts == SPLIT_PARTS) return gemm_split_parts<SPLIT_PARTS>(w, a, o, nb0, nb1);
  gemm_split_parts<2>(w, a, o, nb0, nb1);
}

}  // namespace avx512
}  // namespace quill
