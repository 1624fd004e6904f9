// The int8-activation linear kernels on AVX-512 VNNI (vpdpbusd): W4A8 / W8A8, and the variant's
// KernelTable; the float-activation ones (W4A16 / W8A16, the split image) are avx512_split.cpp, the
// activation quantizers avx512_quant.cpp.  Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512vnni;
// called only when the CPU has all of them.
//
// vpdpbusd multiplies 4 unsigned bytes of lane r (codes of row r at 4 stream
// positions) with 4 signed activation bytes broadcast to every lane, and adds
// the 4 products to lane r in int32, exactly.  4-bit blocks give two such byte
// vectors (low and high nibbles, positions 8c..8c+3 and 8c+4..8c+7); 8-bit
// blocks are one (positions 4c..4c+3) and need no unpacking at all; 2/3-bit blocks give
// four (2-bit pairs, positions 16c + 4j .. +3, j < 4, plus the third bit's plane).
#include <immintrin.h>

#include "avx512_super.h"
#include "kblock.h"
#include "quantizers.h"
#include "simd512.h"

namespace quill {
namespace {

// ---- W4A8 / W8A8: int8 activations (I8Acts) ----

// MT tokens x RB row blocks x chunks [c0, c1), starting in segment s; partial results in/out
// through st[r] (kblock.h).  The row blocks share the activation broadcasts.  NA int32
// accumulators per (row block, token), summed exactly, keep enough vpdpbusd chains in flight.
// FOLD (per-token scales only): each segment's sum starts at -z X (common.h Weights::fold_zero).
// GZ >= 0 (per-group scales, one_zero_point layers): the epilogue reads its token side precomputed,
// gz [S, M, 2] = (g, z xg) (group_terms), and the scales as DType(GZ) (GZ_ANY: w.scale_dtype at run time):
// per row block and token a convert, fmsub with both broadcasts from memory and fmadd (epilogue_g adds a
// scalar convert and multiply, register broadcasts, a multiply for z xg, index math and run-time scale /
// zero / offset dispatch).  seg_epilogue_g's operations on the same values: the same bits.
// GZ_SEG: the token side precomputed as (g, z xg, xg) (group_terms<3>), the weight side per row block as epilogue_g
// has it (seg_consts: two-level scales, offsets): layers with one zero point otherwise (GGUF K-quants, Q4_1), where
// it saves the same scalar convert, multiply, broadcasts and index math per token and row block.
constexpr int GZ_ANY = 3;  // tile_i8's GZ for a scale dtype read at run time
constexpr int GZ_SEG = 4;
template <int BITS, bool FOLD, int MT, int RB, int GZ = -1>
void tile_i8(const Weights& w, const I8Acts& a, int nb, int m0, int c0, int c1, int s,
             LaneState<int32_t>* const* st, const float* gz) {
  constexpr int CK = chunk_k(BITS);
  const int32_t zc = int32_t(w.zconst);
  auto open = [&](int m, int s) { return _mm512_set1_epi32(-zc * a.qsum[int64_t(m0 + m) * w.nseg + s]); };
  constexpr int CHAINS = RB * MT;
  constexpr int NA = CHAINS <= 2 ? 4 : (CHAINS <= 6 ? 2 : 1);
  const __m512i low = _mm512_set1_epi8(0x0F);
  const uint8_t* blocks[RB];  // [KC, 64] each
  const int8_t* xs[MT];
  __m512i acc[RB][MT][NA];
  __m512 f[RB][MT];
  v512::Supers sup[RB];
  QUILL_UNROLL for (int r = 0; r < RB; ++r) blocks[r] = w.codes + int64_t(nb + r) * w.kc * BLOCK_BYTES;
  QUILL_UNROLL for (int m = 0; m < MT; ++m) xs[m] = a.q + (m0 + m) * a.ld;  // [Kp]
  QUILL_UNROLL for (int r = 0; r < RB; ++r)
    QUILL_UNROLL for (int m = 0; m < MT; ++m) {
      f[r][m] = _mm512_load_ps(st[r][m].f);
      acc[r][m][0] = FOLD && c0 == 0 ? open(m, s) : _mm512_load_si512(st[r][m].d);  // c0 = 0: a fresh state
      QUILL_UNROLL for (int i = 1; i < NA; ++i) acc[r][m][i] = _mm512_setzero_si512();
    }
  // accumulator of sub-vector j (nibble / 2-bit pair / chunk half) in chunk parity H: any
  // assignment gives the same exact sums; this one spreads the chains
  auto slot = [](int h, int j) { return NA == 4 ? 2 * h + (j & 1) : (NA == 2 ? (j & 1) : 0); };
  // chunk cc into accumulator set H (chunk parity).  H is a compile-time constant so every
  // accumulator index is one and the arrays stay in registers.
  auto chunk = [&](int cc, auto parity) {
    constexpr int H = decltype(parity)::value;
    __m512i q[RB][4];
    QUILL_UNROLL for (int r = 0; r < RB; ++r) {
      const uint8_t* p = blocks[r] + int64_t(cc) * BLOCK_BYTES;
      _mm_prefetch(reinterpret_cast<const char*>(p + RB * PREFETCH_BYTES), _MM_HINT_T1);
      const __m512i v = _mm512_loadu_si512(p);
      if constexpr (BITS <= 3) {
        v512::unpack_low<BITS>(v, BITS == 3 ? w.hplane + (int64_t(nb + r) * w.kc + cc) * plane_bytes(3) : nullptr,
                               q[r]);
      } else if constexpr (BITS != 8) {
        q[r][0] = _mm512_and_si512(v, low);
        q[r][1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        if constexpr (BITS == 5 || BITS == 6)
          v512::add_high_bits<BITS>(w.hplane + (int64_t(nb + r) * w.kc + cc) * plane_bytes(BITS), q[r][0], q[r][1]);
      } else {
        q[r][0] = v;
      }
    }
    constexpr int NSUB = BITS <= 3 ? 4 : (BITS != 8 ? 2 : 1);
    QUILL_UNROLL for (int m = 0; m < MT; ++m) {
      const int8_t* x = xs[m] + int64_t(cc) * CK;
      QUILL_UNROLL for (int j = 0; j < NSUB; ++j) {
        const __m512i xb = v512::bcast4(x + 4 * j);
        const int i = slot(H, BITS == 8 ? H : j);
        QUILL_UNROLL for (int r = 0; r < RB; ++r) acc[r][m][i] = _mm512_dpbusd_epi32(acc[r][m][i], q[r][j], xb);
      }
    }
  };
  using Even = std::integral_constant<int, 0>;
  using Odd = std::integral_constant<int, 1>;
  for (int c = c0; c < c1; ++s) {
    const int end = std::min(c1, w.seg_end[s]);
    for (; c + 1 < end; c += 2) {  // two chunks per step
      chunk(c, Even{});
      chunk(c + 1, Odd{});
    }
    if (c < end) chunk(c, Even{});
    c = end;
    if (c != w.seg_end[s]) break;  // the segment continues in the next K block
    constexpr int STRIDE = GZ == GZ_SEG ? 3 : 2;
    const float* pair = GZ >= 0 ? gz + (int64_t(s) * a.m + m0) * STRIDE : nullptr;  // [MT, STRIDE] (g, z xg[, xg])
    QUILL_UNROLL for (int r = 0; r < RB; ++r) {
      v512::SegConsts sc;
      if constexpr (GZ >= 0 && GZ != GZ_SEG)
        sc.scale = v512::load16(w.scales, GZ == GZ_ANY ? w.scale_dtype : DType(GZ), seg_index(w, nb + r, s, 0));
      else sc = v512::seg_consts(w, nb + r, s, sup[r]);
      QUILL_UNROLL for (int m = 0; m < MT; ++m) {
        __m512i d = acc[r][m][0];
        QUILL_UNROLL for (int i = 1; i < NA; ++i) d = _mm512_add_epi32(d, acc[r][m][i]);
        const int64_t i = int64_t(m0 + m) * w.nseg + s;
        if constexpr (GZ == GZ_SEG)
          f[r][m] = v512::epilogue_gzo(sc, _mm512_cvtepi32_ps(d), pair + 3 * m, f[r][m]);
        else if constexpr (GZ >= 0)
          f[r][m] = v512::epilogue_gz(sc.scale, _mm512_cvtepi32_ps(d), pair + 2 * m, f[r][m]);
        else if (FOLD)  // d holds D - z X: t = cvt(d) is epilogue()'s t (no offsets where folded)
          f[r][m] = _mm512_fmadd_ps(sc.scale, _mm512_cvtepi32_ps(d), f[r][m]);
        else if (a.gscale)
          f[r][m] = v512::epilogue_g(sc, _mm512_cvtepi32_ps(d), float(a.qsum[i]), a.gscale[i], f[r][m]);
        else
          f[r][m] = v512::epilogue(sc, _mm512_cvtepi32_ps(d), _mm512_set1_ps(float(a.qsum[i])), f[r][m]);
        QUILL_UNROLL for (int i = 0; i < NA; ++i) acc[r][m][i] = _mm512_setzero_si512();
        if (FOLD && s + 1 < w.nseg) acc[r][m][0] = open(m, s + 1);  // carried in st into the next K block
      }
    }
  }
  QUILL_UNROLL for (int r = 0; r < RB; ++r)
    QUILL_UNROLL for (int m = 0; m < MT; ++m) {
      __m512i d = acc[r][m][0];
      QUILL_UNROLL for (int i = 1; i < NA; ++i) d = _mm512_add_epi32(d, acc[r][m][i]);
      _mm512_store_si512(st[r][m].d, d);
      _mm512_store_ps(st[r][m].f, f[r][m]);
    }
}

template <int BITS, bool FOLD, int RB, int GZ>
void tile_i8_mt(int mt, const Weights& w, const I8Acts& a, int nb, int m0, int c0, int c1, int s,
                LaneState<int32_t>* const* st, const float* gz) {
  by_tokens(mt, [&](auto tokens) {
    tile_i8<BITS, FOLD, decltype(tokens)::value, RB, GZ>(w, a, nb, m0, c0, c1, s, st, gz);
  });
}

// From PAIRED_I8_TOKENS tokens, two row blocks per pass sharing the activation broadcasts (half
// the broadcast loads per vpdpbusd; Zen 5, 32-128 tokens: -5..-15 %); fewer tokens run one row
// block at a time (at 8-16 tokens pairing measured 13-50 % slower at 4096 x 4096).
constexpr int PAIRED_I8_TOKENS = 32;
template <int BITS, bool FOLD = false, int GZ = -1>
void run_i8(const Weights& w, const I8Acts& a, const Out& o, int nb0, int nb1, const float* gz = nullptr) {
  auto tiles = [&](int mt, int rb, int nb, int m0, int c0, int c1, int s, LaneState<int32_t>* const* st) {
    if constexpr (BITS >= 4)  // (compile-time: 2/3-bit codes never pair, so their paired tiles are not compiled)
      if (rb == 2 && mt >= 2) return tile_i8_mt<BITS, FOLD, 2, GZ>(mt, w, a, nb, m0, c0, c1, s, st, gz);
    for (int r = 0; r < rb; ++r) tile_i8_mt<BITS, FOLD, 1, GZ>(mt, w, a, nb + r, m0, c0, c1, s, st + r, gz);
  };
  auto finish = [&](int nb, int m, const LaneState<int32_t>& st) {
    v512::store_int(w, a, o, nb, m, _mm512_load_ps(st.f));
  };
  if (a.m < PAIRED_I8_TOKENS) return run_kblocked<int32_t, 1>(w, a.m, nb0, nb1, tiles, finish);
  run_kblocked<int32_t, 2>(w, a.m, nb0, nb1, tiles, finish);
}

// The per-group epilogue's token side (group_terms [S, M, 2]) of this thread's calls: grow-only.
thread_local FloatScratch group_terms_buf;

// Per-group scales on a one_zero_point layer (GGUF Q4_0 / Q5_0 / Q8_0, symmetric GPTQ / CT): the epilogue's
// token side precomputed; 4-bit codes also take the scale dtype at compile time (tile_i8's GZ).
template <int BITS>
void run_i8_g(const Weights& w, const I8Acts& a, const Out& o, int nb0, int nb1) {
  const float* gz = group_terms(w, a, group_terms_buf);
  if constexpr (BITS != 4) {
    run_i8<BITS, false, GZ_ANY>(w, a, o, nb0, nb1, gz);
  } else {
    switch (w.scale_dtype) {
      case DType::F16: return run_i8<BITS, false, int(DType::F16)>(w, a, o, nb0, nb1, gz);
      case DType::BF16: return run_i8<BITS, false, int(DType::BF16)>(w, a, o, nb0, nb1, gz);
      case DType::F32:
      default: return run_i8<BITS, false, int(DType::F32)>(w, a, o, nb0, nb1, gz);
    }
  }
}

// The zero point folded (Weights::fold_zero) for layers with one (3-8 bit) and per-token scales
// (W4A8 at 128 tokens, Q4_0-shaped: -8 % on Zen 5); per-group scales take run_i8_g where it applies,
// GZ_SEG for other layers with one zero point, epilogue_g otherwise.
template <int BITS>
void run_i8_epi(const Weights& w, const I8Acts& a, const Out& o, int nb0, int nb1) {
  if (a.gscale && one_zero_point(w)) return run_i8_g<BITS>(w, a, o, nb0, nb1);
  if constexpr (BITS >= 4 && BITS <= 6)  // Q4_K, Q5_K, Q6_K, Q4_1, Q5_1 (compiled for these widths only)
    if (a.gscale && !w.zeros)
      return run_i8<BITS, false, GZ_SEG>(w, a, o, nb0, nb1, group_terms<3>(w, a, group_terms_buf));
  if constexpr (BITS >= 3)
    if (w.fold_zero && !a.gscale) return run_i8<BITS, true>(w, a, o, nb0, nb1);
  run_i8<BITS>(w, a, o, nb0, nb1);
}

// llama.cpp's K-quant arithmetic (common.h I8Acts::gsuper; avx512_super.h)
void gemm_i8_super(const Weights& w, const I8Acts& a, const Out& o, int nb0, int nb1) {
  switch (w.bits) {
    case 2: return v512::run_super<2>(w, a, o, nb0, nb1);
    case 3: return v512::run_super<3>(w, a, o, nb0, nb1);
    case 4: return v512::run_super<4>(w, a, o, nb0, nb1);
    case 5: return v512::run_super<5>(w, a, o, nb0, nb1);
    case 6: return v512::run_super<6>(w, a, o, nb0, nb1);
    default: return table_scalar().gemm_i8(w, a, o, nb0, nb1);  // 8-bit codes (no GGUF type): the scalar twin
  }
}

void gemm_i8(const Weights& w, const I8Acts& a, const Out& o, int nb0, int nb1) {
  if (a.gsuper) return gemm_i8_super(w, a, o, nb0, nb1);
  switch (w.bits) {
    case 2: return run_i8_epi<2>(w, a, o, nb0, nb1);
    case 3: return run_i8_epi<3>(w, a, o, nb0, nb1);
    case 4: return run_i8_epi<4>(w, a, o, nb0, nb1);
    case 5: return run_i8_epi<5>(w, a, o, nb0, nb1);
    case 6: return run_i8_epi<6>(w, a, o, nb0, nb1);
    default: return run_i8_epi<8>(w, a, o, nb0, nb1);
  }
}

}  // namespace

const KernelTable& table_avx512() {
  static const KernelTable t{"avx512", avx512::gemm_split, gemm_i8, avx512::quantize, avx512::quantize_split};
  return t;
}

}  // namespace quill
