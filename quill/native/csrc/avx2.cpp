// The AVX2 + FMA + F16C baseline: every kernel family, 8 lanes per register, a
// 16-row block as two halves (rows 0-7 are bytes 0-31 of a block, rows 8-15
// bytes 32-63).  Compiled with -mavx2 -mfma -mf16c only.
//
// vpmaddubsw multiplies unsigned code bytes with signed activation bytes into
// int16 pairs (no saturation: codes are split into nibbles, so |pair| <= 2 * 15 *
// 128), vpmaddwd widens them to int32 exactly, weighting each pair sum (the high
// nibble of 8-bit codes by 16, the mid part of split float activations by 256).
// 2/3-bit codes are four 2-bit byte vectors per chunk (positions 16c + 4j .. +3).
// int8 activations (W4A8, W8A8) are one part; float activations (W4A16, W8A16) are
// their split fixed-point image (common.h SplitActs), three parts (24 bits) or two (16 bits).
#include <immintrin.h>

#include "avx2_super.h"
#include "avx2_tile8.h"
#include "quantizers.h"
#include "scalar_util.h"
#include "simd256.h"

namespace quill {
namespace {

using namespace v256;  // the segment helpers (simd256.h)

inline const int8_t* stream_of(const I8Acts& a) { return a.q; }
inline const int8_t* stream_of(const SplitActs& a) { return a.x; }

// MT tokens x one row block, all of K.  PARTS = 1: int8 activations, one int32
// accumulator per token and half holding D.  PARTS = 3 or 2: the split image of float
// activations (common.h SplitActs): accumulator 0 holds Dhi = sum(code * hi), accumulator
// 1 holds Dlo = 256 * sum(code * mid) + sum(code * lo) (mid enters vpmaddwd with weight 256;
// 2 parts: sum(code * lo)).
// Halves [H0, H0 + NH) of the row block (8 rows each) into f: NH = 2 walks K once for both halves;
// NH = 1 walks it for one half, its accumulators and float sums in registers (see tile()).
// gz: the per-group epilogue's precomputed token side (group_terms), or none.
template <int BITS, int PARTS, int EPI, int MT, int H0, int NH, class Acts>
QUILL_INLINE void tile_halves(const Weights& w, const Acts& a, int nb, int m0, float (*f)[LANES], GroupSide gz) {
  constexpr int CK = chunk_k(BITS), STRIDE = PARTS * CK;
  constexpr bool SPLIT = PARTS > 1;
  // the split epilogue's variants (run_split_epi): the zero point folded (1), and T fused (2); no zero point (3)
  constexpr bool FOLD = SPLIT && (EPI == 1 || EPI == 2), FUSE = SPLIT && EPI == 2, NOZ = SPLIT && EPI == 3;
  constexpr bool FOLD8 = !SPLIT && EPI == 1;  // int8 activations per token, the zero point folded (gemm_i8)
  const __m256i low = _mm256_set1_epi8(0x0F);
  // vpmaddwd weights of the int16 pair sums: [part][nibble] (8-bit codes = 16 * high nibble + low),
  // and the accumulator each part feeds
  const __m256i one[2] = {_mm256_set1_epi16(1), _mm256_set1_epi16(16)};
  const __m256i w256[2] = {_mm256_set1_epi16(256), _mm256_set1_epi16(4096)};
  const __m256i* wt[3] = {one, PARTS == 3 ? w256 : one, one};
  constexpr int dest[3] = {SPLIT ? 0 : 1, 1, 1};
  // 4-bit codes: chunk sums (|q| <= 4 * 15 * 128) added in int16 over up to 4 chunks before widening,
  // one vpmaddwd per part instead of four.  For int8 activations one half a pass (single tokens: no
  // gain); for the split image with a folded zero point every tile (its three parts per chunk make the
  // widening a larger share: M = 1-128 4-8 % faster on Zen 5; without the fold the epilogue's zero
  // point and offset terms then spill, 7-10 % slower, so those keep int32 sums).  Integer sums: the same bits.
  constexpr bool I16 = BITS == 4 && ((PARTS == 1 && NH == 1) || ((FOLD || NOZ) && (NH == 1 || MT == 1)));
  // 8-bit codes x int8 activations, one half a pass: the low and high nibbles' pair sums (|q| <= 2 * 15 * 128
  // a chunk) added in int16 over up to 8 chunks, then widened with their weights 1 and 16: two vpmaddwd
  // and two adds per 8 chunks instead of per chunk.  Integer sums: the same bits.
  constexpr bool I16_8 = BITS == 8 && PARTS == 1 && NH == 1;
  constexpr int I16_CHUNKS = I16_8 ? 8 : 4;
  const uint8_t* blocks = w.codes + int64_t(nb) * w.kc * BLOCK_BYTES;  // [KC, 64]
  Supers8 sup[2];  // per half
  __m256 fr[MT];  // NH = 1: half H0's float sums
  QUILL_UNROLL for (int m = 0; m < MT; ++m) fr[m] = _mm256_setzero_ps();
  for (int s = 0, c0 = 0; s < w.nseg; c0 = w.seg_end[s++]) {
    __m256i acc[MT][2][2];  // [token][half][Dhi, D or Dlo]
    QUILL_UNROLL for (int m = 0; m < MT; ++m)
      QUILL_UNROLL for (int h = 0; h < 2; ++h) acc[m][h][0] = acc[m][h][1] = _mm256_setzero_si256();
    if (FOLD)  // Dhi and Dlo start at -z * Xhi, -z * Xlo (common.h Weights::fold_zero)
      QUILL_UNROLL for (int m = 0; m < MT; ++m) {
        const int64_t i = int64_t(m0 + m) * w.nseg + s;
        const int32_t z = int32_t(w.zconst);
        QUILL_UNROLL for (int h = H0; h < H0 + NH; ++h) {
          acc[m][h][0] = _mm256_set1_epi32(-z * a.qsum[2 * i]);
          acc[m][h][1] = _mm256_set1_epi32(-z * a.qsum[2 * i + 1]);
        }
      }
    if (FOLD8)  // D starts at -z * X
      QUILL_UNROLL for (int m = 0; m < MT; ++m) {
        const int32_t zx = -int32_t(w.zconst) * a.qsum[int64_t(m0 + m) * w.nseg + s];
        QUILL_UNROLL for (int h = H0; h < H0 + NH; ++h) acc[m][h][1] = _mm256_set1_epi32(zx);
      }
    __m256i q16[MT][2][PARTS];  // I16: int16 pair sums of up to 4 chunks, per token, half and part
    __m256i q16h[MT];           // I16_8: the high nibbles' sums (q16 holds the low ones)
    QUILL_UNROLL for (int m = 0; m < MT; ++m) {
      q16h[m] = _mm256_setzero_si256();
      QUILL_UNROLL for (int h = 0; h < 2; ++h)
        QUILL_UNROLL for (int p = 0; p < PARTS; ++p) q16[m][h][p] = _mm256_setzero_si256();
    }
    int n16 = 0;
    for (int c = c0, c1 = w.seg_end[s]; c < c1; ++c) {
      const uint8_t* blk = blocks + int64_t(c) * BLOCK_BYTES;
      _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH_BYTES), _MM_HINT_T1);  // see common.h
      QUILL_UNROLL for (int h = H0; h < H0 + NH; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * h));
        if constexpr (BITS <= 3) {  // codes < 8: 4 pair sums of 2 * 7 * 128 stay within int16
          __m256i q[4];
          unpack_low<BITS>(v, BITS == 3 ? w.hplane + (int64_t(nb) * w.kc + c) * plane_bytes(3) : nullptr, h, q);
          QUILL_UNROLL for (int m = 0; m < MT; ++m) {
            const int8_t* x = stream_of(a) + (m0 + m) * a.ld + int64_t(c) * STRIDE;
            QUILL_UNROLL for (int p = 0; p < PARTS; ++p) {
              const int8_t* xp = x + p * CK;
              const __m256i s01 = _mm256_add_epi16(_mm256_maddubs_epi16(q[0], bcast4(xp)), _mm256_maddubs_epi16(q[1], bcast4(xp + 4)));
              const __m256i s23 = _mm256_add_epi16(_mm256_maddubs_epi16(q[2], bcast4(xp + 8)), _mm256_maddubs_epi16(q[3], bcast4(xp + 12)));
              acc[m][h][dest[p]] = _mm256_add_epi32(acc[m][h][dest[p]], _mm256_madd_epi16(_mm256_add_epi16(s01, s23), wt[p][0]));
            }
          }
          continue;
        }
        __m256i lo = _mm256_and_si256(v, low);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        if constexpr (BITS == 5 || BITS == 6)
          add_high_bits<BITS>(w.hplane + (int64_t(nb) * w.kc + c) * plane_bytes(BITS), h, lo, hi);
        QUILL_UNROLL for (int m = 0; m < MT; ++m) {
          const int8_t* x = stream_of(a) + (m0 + m) * a.ld + int64_t(c) * STRIDE;
          QUILL_UNROLL for (int p = 0; p < PARTS; ++p) {
            const int8_t* xp = x + p * CK;
            __m256i d;
            if (BITS != 8) {  // positions 8c..8c+3 in lo, 8c+4..8c+7 in hi (codes < 64: |sum| <= 4 * 63 * 128)
              const __m256i q = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(xp)), _mm256_maddubs_epi16(hi, bcast4(xp + 4)));
              if constexpr (I16) {
                q16[m][h][p] = _mm256_add_epi16(q16[m][h][p], q);
                continue;
              }
              d = _mm256_madd_epi16(q, wt[p][0]);
            } else {  // code = 16 * hi + lo at positions 4c..4c+3
              const __m256i xa = bcast4(xp);
              if constexpr (I16_8) {
                q16[m][h][0] = _mm256_add_epi16(q16[m][h][0], _mm256_maddubs_epi16(lo, xa));
                q16h[m] = _mm256_add_epi16(q16h[m], _mm256_maddubs_epi16(hi, xa));
                continue;
              }
              d = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, xa), wt[p][0]),
                                   _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xa), wt[p][1]));
            }
            acc[m][h][dest[p]] = _mm256_add_epi32(acc[m][h][dest[p]], d);
          }
        }
      }
      if constexpr (I16 || I16_8)
        if (++n16 == I16_CHUNKS || c + 1 == c1) {
          QUILL_UNROLL for (int m = 0; m < MT; ++m)
            QUILL_UNROLL for (int h = H0; h < H0 + NH; ++h) {
              QUILL_UNROLL for (int p = 0; p < PARTS; ++p) {
                acc[m][h][dest[p]] = _mm256_add_epi32(acc[m][h][dest[p]], _mm256_madd_epi16(q16[m][h][p], wt[p][0]));
                q16[m][h][p] = _mm256_setzero_si256();
              }
              if constexpr (I16_8) {
                acc[m][h][1] = _mm256_add_epi32(acc[m][h][1], _mm256_madd_epi16(q16h[m], wt[0][1]));
                q16h[m] = _mm256_setzero_si256();
              }
            }
          n16 = 0;
        }
    }
    QUILL_UNROLL for (int h = H0; h < H0 + NH; ++h) {
      Seg8 sc = seg8(w, nb, s, h, sup[h]);
      sc.has_zero = sc.has_zero && !FOLD && !NOZ;
      sc.has_offset = NOZ || (sc.has_offset && !FOLD);  // folded layers have none (linear.cpp): known at compile time
      QUILL_UNROLL for (int m = 0; m < MT; ++m) {
        const int64_t i = int64_t(m0 + m) * w.nseg + s;
        const __m256 fo = NH == 1 ? fr[m] : _mm256_load_ps(f[m] + 8 * h);
        __m256 fn;
        if constexpr (FOLD8)  // acc holds D - z X, exact in float (Weights::fold_zero): epilogue()'s t
          fn = _mm256_fmadd_ps(sc.scale, _mm256_cvtepi32_ps(acc[m][h][1]), fo);
        else if constexpr (SPLIT)
          fn = epilogue_split<PARTS>(sc, acc[m][h][0], acc[m][h][1], a.qsum[2 * i], a.qsum[2 * i + 1], a.scale[i], fo,
                              FUSE);
        else if (gz.stride == 3)
          fn = epilogue_gzo(sc, _mm256_cvtepi32_ps(acc[m][h][1]), gz.p + (int64_t(s) * a.m + m0 + m) * 3, fo);
        else if (gz.p)
          fn = epilogue_gz(sc.scale, _mm256_cvtepi32_ps(acc[m][h][1]), gz.p + (int64_t(s) * a.m + m0 + m) * 2, fo);
        else if (a.gscale)
          fn = epilogue_g(sc, _mm256_cvtepi32_ps(acc[m][h][1]), float(a.qsum[i]), a.gscale[i], fo);
        else
          fn = epilogue(sc, _mm256_cvtepi32_ps(acc[m][h][1]), _mm256_cvtepi32_ps(_mm256_set1_epi32(a.qsum[i])), fo);
        if constexpr (NH == 1) fr[m] = fn;
        else _mm256_store_ps(f[m] + 8 * h, fn);
      }
    }
  }
  if constexpr (NH == 1)
    QUILL_UNROLL for (int m = 0; m < MT; ++m) _mm256_store_ps(f[m] + 8 * H0, fr[m]);
}

// MT tokens x one row block.  Float activations over several tokens go one half at a time: both
// halves at once keep 16 accumulators live (Dhi and Dlo per token and half) besides the codes and
// broadcasts, which spilled to the stack every chunk; the second half's pass reads the block's
// chunks from L1 / L2 (W4A16 at M = 16-128: 10-12 % faster on Zen 5; 4-bit codes with int8
// activations, which then also sum 4 chunks in int16: 3-5 %; 8-bit codes with int8 activations, which
// sum 8 chunks: +25-30 %).  Single tokens keep one pass (the second pass cost more than the spills:
// W4A8 M = 1 +30-45 %), as do 2/3/5/6-bit codes with int8 activations.  Either way each half's sums
// run in the same order: the same bits.  The 8-token tiles of 4-bit codes with short segments are
// written out (avx2_tile8.h); gz: the precomputed token side of the per-group epilogue (group_terms), or none.
template <int BITS, int PARTS, int EPI, int MT, class Acts>
void tile(const Weights& w, const Acts& a, const Out& o, int nb, int m0, bool short_segs, GroupSide gz) {
  alignas(32) float f[MT][LANES] = {};
  if constexpr (BITS == 4 && PARTS == 1 && MT == 8) {
    if (short_segs && EPI == 1) {
      tile8_i4<false>(w, a, nb, m0, 0, f);
      tile8_i4<false>(w, a, nb, m0, 1, f);
    } else if (short_segs && gz.stride == 2) {
      tile8_g_halves(w, a, gz.p, nb, m0, f);
    } else if (short_segs && a.gscale) {
      tile8_i4<true>(w, a, nb, m0, 0, f, gz);
      tile8_i4<true>(w, a, nb, m0, 1, f, gz);
    } else {
      tile_halves<BITS, PARTS, EPI, MT, 0, 1>(w, a, nb, m0, f, gz);
      tile_halves<BITS, PARTS, EPI, MT, 1, 1>(w, a, nb, m0, f, gz);
    }
  } else if constexpr ((PARTS > 1 || BITS == 4 || BITS == 8) && MT > 1) {
    tile_halves<BITS, PARTS, EPI, MT, 0, 1>(w, a, nb, m0, f, gz);
    tile_halves<BITS, PARTS, EPI, MT, 1, 1>(w, a, nb, m0, f, gz);
  } else {
    tile_halves<BITS, PARTS, EPI, MT, 0, 2>(w, a, nb, m0, f, gz);
  }
  QUILL_UNROLL for (int m = 0; m < MT; ++m) {
    if constexpr (PARTS > 1) store_float_row8(w, o, nb, m0 + m, f[m]);
    else store_int_row8(w, a, o, nb, m0 + m, f[m]);
  }
}

// The per-group epilogue's token side (group_terms [S, M, 2]) of this thread's calls: grow-only.
thread_local FloatScratch group_terms_buf;

// Row blocks [nb0, nb1) x all tokens in tiles of up to 4 tokens (8: 4-bit codes x int8 activations; 2: the 24-bit
// image of the opt-in exact float activations).
template <int BITS, int PARTS, class Acts, int EPI = 0>
void run(const Weights& w, const Acts& a, const Out& o, int nb0, int nb1) {
  const bool short_segs = BITS == 4 && PARTS == 1 && a.m >= 8 && w.short_segments;
  GroupSide gz;  // per-group scales, one zero point: the epilogue's token side (tile8_g, tile8_i4, tile_halves)
  if constexpr (PARTS == 1) {
    if (a.gscale && one_zero_point(w)) gz = {group_terms(w, a, group_terms_buf), 2};
    else if (BITS >= 4 && BITS <= 6 && a.gscale && !w.zeros) gz = {group_terms<3>(w, a, group_terms_buf), 3};
  }
  for (int nb = nb0; nb < nb1; ++nb)
    for (int m0 = 0; m0 < a.m;) {
      const int left = a.m - m0;
      if constexpr (BITS == 4 && PARTS == 1) {
        if (left >= 8) { tile<BITS, PARTS, EPI, 8>(w, a, o, nb, m0, short_segs, gz); m0 += 8; continue; }
      }
      if constexpr (PARTS != SPLIT_PARTS) {  // the opt-in 24-bit image: tiles of 1-2 tokens (fewer to compile)
        if (left >= 4) { tile<BITS, PARTS, EPI, 4>(w, a, o, nb, m0, short_segs, gz); m0 += 4; continue; }
        if (left == 3) { tile<BITS, PARTS, EPI, 3>(w, a, o, nb, m0, short_segs, gz); m0 += 3; continue; }
      }
      if (left >= 2) { tile<BITS, PARTS, EPI, 2>(w, a, o, nb, m0, short_segs, gz); m0 += 2; }
      else { tile<BITS, PARTS, EPI, 1>(w, a, o, nb, m0, short_segs, gz); m0 += 1; }
    }
}

// The epilogue's shortcuts (common.h Weights::fold_zero / fuse_t) where they occur, as on AVX-512: the zero
// point folded for every layer with one, T in int32 for 3/4-bit ones that allow it.
// Layers with offsets and no zero point (common.h offsets_only) get a variant of their own, whose epilogue has
// no zero-point terms at compile time (Q4_K M = 1: 5-15 % faster on Zen 5).
template <int BITS, int PARTS>
void run_split_epi(const Weights& w, const SplitActs& a, const Out& o, int nb0, int nb1) {
  if (offsets_only(w)) return run<BITS, PARTS, SplitActs, 3>(w, a, o, nb0, nb1);
  if (!w.fold_zero) return run<BITS, PARTS>(w, a, o, nb0, nb1);
  if constexpr (PARTS == 2) {  // the 16-bit image's T always fits int32 (common.h Weights::fuse_t)
    run<BITS, PARTS, SplitActs, 2>(w, a, o, nb0, nb1);
  } else {
    if constexpr (BITS <= 4)
      if (w.fuse_t) return run<BITS, PARTS, SplitActs, 2>(w, a, o, nb0, nb1);
    run<BITS, PARTS, SplitActs, 1>(w, a, o, nb0, nb1);
  }
}

template <int PARTS>
void gemm_split_parts(const Weights& w, const SplitActs& a, const Out& o, int nb0, int nb1) {
  switch (w.bits) {
    case 2:
      return offsets_only(w) ? run<2, PARTS, SplitActs, 3>(w, a, o, nb0, nb1) : run<2, PARTS>(w, a, o, nb0, nb1);
    case 3: return run_split_epi<3, PARTS>(w, a, o, nb0, nb1);
    case 4: return run_split_epi<4, PARTS>(w, a, o, nb0, nb1);
    case 5: return run_split_epi<5, PARTS>(w, a, o, nb0, nb1);
    case 6: return run_split_epi<6, PARTS>(w, a, o, nb0, nb1);
    default: return run_split_epi<8, PARTS>(w, a, o, nb0, nb1);
  }
}

void gemm_split(const Weights& w, const SplitActs& a, const Out& o, int nb0, int nb1) {
  if (a.parts == SPLIT_PARTS) return gemm_split_parts<SPLIT_PARTS>(w, a, o, nb0, nb1);
  gemm_split_parts<2>(w, a, o, nb0, nb1);
}

// The zero point folded (Weights::fold_zero) for layers with one and per-token scales, as on AVX-512.
template <int BITS>
void run_i8(const Weights& w, const I8Acts& a, const Out& o, int nb0, int nb1) {
  if (w.fold_zero && !a.gscale) return run<BITS, 1, I8Acts, 1>(w, a, o, nb0, nb1);
  run<BITS, 1>(w, a, o, nb0, nb1);
}

// llama.cpp's K-quant arithmetic (common.h I8Acts::gsuper; avx2_super.h)
void gemm_i8_super(const Weights& w, const I8Acts& a, const Out& o, int nb0, int nb1) {
  switch (w.bits) {
    case 2: return run_super<2>(w, a, o, nb0, nb1);
    case 3: return run_super<3>(w, a, o, nb0, nb1);
    case 4: return run_super<4>(w, a, o, nb0, nb1);
    case 5: return run_super<5>(w, a, o, nb0, nb1);
    case 6: return run_super<6>(w, a, o, nb0, nb1);
    default: return table_scalar().gemm_i8(w, a, o, nb0, nb1);  // 8-bit codes (no GGUF type): the scalar twin
  }
}

void gemm_i8(const Weights& w, const I8Acts& a, const Out& o, int nb0, int nb1) {
  if (a.gsuper) return gemm_i8_super(w, a, o, nb0, nb1);
  switch (w.bits) {
    case 2: return run<2, 1>(w, a, o, nb0, nb1);
    case 3: return run_i8<3>(w, a, o, nb0, nb1);
    case 4: return run_i8<4>(w, a, o, nb0, nb1);
    case 5: return run_i8<5>(w, a, o, nb0, nb1);
    case 6: return run_i8<6>(w, a, o, nb0, nb1);
    default: return run_i8<8>(w, a, o, nb0, nb1);
  }
}

}  // namespace

const KernelTable& table_avx2() {
  static const KernelTable t{"avx2", gemm_split, gemm_i8, avx2::quantize, avx2::quantize_split};
  return t;
}

}  // namespace quill
