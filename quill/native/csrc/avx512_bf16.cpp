// W4A16 / W8A16 on AVX-512 BF16 (vdpbf16ps).  Compiled with -mavx512f -mavx512bw
// -mavx512vl -mavx512bf16 only; called only when the CPU has all of them.
//
// One 64-byte block holds 32 code words of 16 bits (lane r owns words 2r, 2r+1),
// four nibbles each.  Nibble t of every word becomes a bf16 number through one
// vpermw (a 16-entry table, duplicated so the bit above the nibble is ignored);
// vdpbf16ps then multiplies word pair (2r, 2r+1) of lane r with the activation
// pair the stream holds for nibble t (stream.cpp) and adds both products to
// lane r.  Codes enter as exact small integers; the zero point and scale are
// applied per segment (common.h), so activations stay float (bf16 exactly, or
// float32 split into bf16 hi + lo).
#include <immintrin.h>

#include "kblock.h"
#include "simd512.h"

namespace quill {
namespace {

using v512::SegConsts;

inline __m512i nibble_table() {
  // bf16 bit patterns of 0..15, twice (vpermw indexes 32 words with 5 bits)
  return _mm512_set_epi16(0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0,
                          0x4080, 0x4040, 0x4000, 0x3F80, 0x0000, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120,
                          0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000);
}

inline __m512bh bcast_pair(const uint16_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

// MT tokens x RB row blocks x chunks [c0, c1), starting in segment s; partial
// results in/out through st[r] (kblock.h).  The row blocks share the activation
// broadcasts; NA accumulators per token and row block keep enough vdpbf16ps chains
// in flight when MT is small.  The finished-segments total f stays in memory: it
// changes once per segment.
template <int MT, bool SPLIT, int RB>
void tile(const Weights& w, const Bf16Acts& a, int nb, int m0, int c0, int c1, int s, LaneState<float>* const* st) {
  constexpr int WORDS = SPLIT ? 16 : 8;  // stream words per chunk
  constexpr int DOTS = SPLIT ? 8 : 4;    // vdpbf16ps per chunk, token and row block
  constexpr int NA = MT == 1 ? (RB == 1 ? DOTS : 4) : (MT == 2 ? 4 : (MT <= 4 ? 2 : 1));
  const __m512i lut = nibble_table();
  const uint8_t* blocks[RB];  // [KC, 64] each
  const uint16_t* xs[MT];     // [KC, WORDS] each
  __m512 acc[RB][MT][NA];
  for (int r = 0; r < RB; ++r) blocks[r] = w.codes + int64_t(nb + r) * w.kc * BLOCK_BYTES;
  for (int m = 0; m < MT; ++m) xs[m] = a.x + (m0 + m) * a.ld;
  for (int r = 0; r < RB; ++r)
    for (int m = 0; m < MT; ++m) {
      acc[r][m][0] = _mm512_load_ps(st[r][m].d);
      for (int i = 1; i < NA; ++i) acc[r][m][i] = _mm512_setzero_ps();
    }
  for (int c = c0; c < c1; ++s) {
    for (const int end = std::min(c1, w.seg_end[s]); c < end; ++c) {
      __m512bh q[RB][4];
      for (int r = 0; r < RB; ++r) {
        const uint8_t* p = blocks[r] + int64_t(c) * BLOCK_BYTES;
        _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH_BYTES), _MM_HINT_T1);
        const __m512i v = _mm512_loadu_si512(p);
        q[r][0] = (__m512bh)_mm512_permutexvar_epi16(v, lut);
        q[r][1] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), lut);
        q[r][2] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 8), lut);
        q[r][3] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 12), lut);
      }
      for (int m = 0; m < MT; ++m) {
        const uint16_t* x = xs[m] + int64_t(c) * WORDS;
        for (int d = 0; d < DOTS; ++d) {
          const __m512bh xp = bcast_pair(x + 2 * d);
          for (int r = 0; r < RB; ++r) acc[r][m][d % NA] = _mm512_dpbf16_ps(acc[r][m][d % NA], q[r][d % 4], xp);
        }
      }
    }
    if (c != w.seg_end[s]) break;  // the segment continues in the next K block
    for (int r = 0; r < RB; ++r) {
      const SegConsts sc = v512::seg_consts(w, nb + r, s);
      for (int m = 0; m < MT; ++m) {
        __m512 d = acc[r][m][0];
        for (int i = 1; i < NA; ++i) d = _mm512_add_ps(d, acc[r][m][i]);
        const __m512 x = _mm512_set1_ps(a.xsum[(m0 + m) * w.nseg + s]);
        _mm512_store_ps(st[r][m].f, v512::epilogue(sc, d, x, _mm512_load_ps(st[r][m].f)));
        for (int i = 0; i < NA; ++i) acc[r][m][i] = _mm512_setzero_ps();
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int m = 0; m < MT; ++m) {
      __m512 d = acc[r][m][0];
      for (int i = 1; i < NA; ++i) d = _mm512_add_ps(d, acc[r][m][i]);
      _mm512_store_ps(st[r][m].d, d);
    }
}

template <int RB, bool SPLIT>
void tile_rb(int mt, const Weights& w, const Bf16Acts& a, int nb, int m0, int c0, int c1, int s,
             LaneState<float>* const* st) {
  switch (mt) {
    case 1: return tile<1, SPLIT, RB>(w, a, nb, m0, c0, c1, s, st);
    case 2: return tile<2, SPLIT, RB>(w, a, nb, m0, c0, c1, s, st);
    case 3: return tile<3, SPLIT, RB>(w, a, nb, m0, c0, c1, s, st);
    case 4: return tile<4, SPLIT, RB>(w, a, nb, m0, c0, c1, s, st);
    case 5: return tile<5, SPLIT, RB>(w, a, nb, m0, c0, c1, s, st);
    default: return tile<6, SPLIT, RB>(w, a, nb, m0, c0, c1, s, st);
  }
}

template <bool SPLIT>
void run(const Weights& w, const Bf16Acts& a, const Out& o, int nb0, int nb1) {
  auto tiles = [&](int mt, int rb, int nb, int m0, int c0, int c1, int s, LaneState<float>* st0,
                   LaneState<float>* st1) {
    LaneState<float>* const st[2] = {st0, st1};
    if (rb == 2)
      tile_rb<2, SPLIT>(mt, w, a, nb, m0, c0, c1, s, st);
    else
      tile_rb<1, SPLIT>(mt, w, a, nb, m0, c0, c1, s, st);
  };
  auto finish = [&](int nb, int m, const LaneState<float>& st) { v512::store_float(w, o, nb, m, _mm512_load_ps(st.f)); };
  run_kblocked<float, 2>(w, a.m, nb0, nb1, tiles, finish);
}

// ---- the bf16 activation stream (stream.cpp's build_bf16_stream, vectorised) ----

// float32 -> bf16 bits (round to nearest even, NaN kept quiet) in the low half of each 32-bit lane.
inline __m512i bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  const __m512i nan = _mm512_or_si512(u, _mm512_set1_epi32(0x400000));
  return _mm512_srli_epi32(_mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, nan), 16);
}

inline __m512 bits_to_f32(__m512i b) { return _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)); }

// Two vectors of 16 bf16 bits (one per 32-bit lane) -> 32 words.
inline __m512i pack_words(__m512i a, __m512i b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(a)), _mm512_cvtepi32_epi16(b), 1);
}

inline __m512 load_f32(const RawX& in, int64_t m, int64_t i) {
  if (in.dtype == DType::F32) return _mm512_loadu_ps(static_cast<const float*>(in.x) + m * in.k + i);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(in.x) + m * in.k + i));
  return in.dtype == DType::F16 ? _mm512_cvtph_ps(h) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// vpermt2w indices: output word j of a step takes source word idx[j] (0-31: first source, 32-63: second).
struct StreamPerm {
  alignas(64) uint16_t idx[2][32];
};

StreamPerm make_perm(int bits, bool split) {
  static constexpr int W4[8] = {0, 2, 4, 6, 1, 3, 5, 7};           // position of word e in a chunk
  static constexpr int W8[8][2] = {{0, 0}, {2, 0}, {0, 1}, {2, 1}, {1, 0}, {3, 0}, {1, 1}, {3, 1}};  // (position, x16)
  StreamPerm p{};
  const int words = split ? 16 : 8, chunk = chunk_k(bits);
  for (int j = 0; j < 64; ++j) {
    const int c = j / words, e = j % words, part = e / 8;  // part 1: the lo words (second source)
    const int src = bits == 4 ? chunk * c + W4[e % 8] : chunk * c + W8[e % 8][0] + 16 * W8[e % 8][1];
    p.idx[j / 32][j % 32] = uint16_t(src + 32 * part);
  }
  return p;
}

// Tokens [m0, m1) when the stream is the identity order and segments span whole steps.
template <int BITS, bool SPLIT>
void stream_simd(const RawX& in, uint16_t* out, float* xsum, int m0, int m1) {
  constexpr int STEP = BITS == 4 ? 32 : 16;           // positions per step
  constexpr int OUT = SPLIT ? 64 : 32;                // words written per step
  static const StreamPerm perm = make_perm(BITS, SPLIT);
  const __m512i i0 = _mm512_load_si512(perm.idx[0]), i1 = _mm512_load_si512(perm.idx[1]);
  for (int m = m0; m < m1; ++m) {
    uint16_t* o = out + m * (in.kp / chunk_k(BITS)) * (SPLIT ? 16 : 8);
    int64_t p = 0;
    for (int s = 0; s < in.nseg; ++s) {
      __m512 acc = _mm512_setzero_ps();
      for (const int64_t end = int64_t(in.seg_end[s]) * chunk_k(BITS); p < end; p += STEP, o += OUT) {
        __m512i hi[2], lo[2];
        for (int h = 0; h < STEP / 16; ++h) {
          const int64_t i = p + 16 * h;
          __m512 v = _mm512_setzero_ps();
          if (i + 16 <= in.k) v = load_f32(in, m, i);
          else if (i < in.k) {  // the padded end
            alignas(64) float t[16] = {};
            for (int64_t j = i; j < in.k; ++j) t[j - i] = to_float(in.x, in.dtype, m * in.k + j);
            v = _mm512_load_ps(t);
          }
          hi[h] = bf16_bits(v);
          const __m512 hf = bits_to_f32(hi[h]);
          lo[h] = SPLIT ? bf16_bits(_mm512_sub_ps(v, hf)) : _mm512_setzero_si512();
          acc = _mm512_add_ps(acc, SPLIT ? _mm512_add_ps(hf, bits_to_f32(lo[h])) : hf);
        }
        __m512i a, b;
        if (BITS == 4) {
          a = pack_words(hi[0], hi[1]);
          b = pack_words(lo[0], lo[1]);
        } else {  // x and 16 x (exact) side by side
          const __m512 sixteen = _mm512_set1_ps(16.0f);
          a = pack_words(hi[0], bf16_bits(_mm512_mul_ps(bits_to_f32(hi[0]), sixteen)));
          b = pack_words(lo[0], bf16_bits(_mm512_mul_ps(bits_to_f32(lo[0]), sixteen)));
        }
        _mm512_storeu_si512(o, _mm512_permutex2var_epi16(a, i0, b));
        if (SPLIT) _mm512_storeu_si512(o + 32, _mm512_permutex2var_epi16(a, i1, b));
      }
      xsum[m * in.nseg + s] = _mm512_reduce_add_ps(acc);
    }
  }
}

}  // namespace

// True when the vectorised stream builder applies (identity order, segments of whole steps).
bool bf16_stream_simd_ok(const RawX& in, int bits) {
  (void)bits;  // a step is 4 chunks for both widths
  if (in.src) return false;
  for (int s = 0; s < in.nseg; ++s)
    if (in.seg_end[s] % 4) return false;
  return true;
}

void build_bf16_stream_avx512(const RawX& in, int bits, bool split, uint16_t* out, float* xsum, int m0, int m1) {
  if (bits == 4)
    split ? stream_simd<4, true>(in, out, xsum, m0, m1) : stream_simd<4, false>(in, out, xsum, m0, m1);
  else
    split ? stream_simd<8, true>(in, out, xsum, m0, m1) : stream_simd<8, false>(in, out, xsum, m0, m1);
}

void gemm_bf16_avx512(const Weights& w, const Bf16Acts& a, const Out& o, int nb0, int nb1) {
  if (a.split)
    run<true>(w, a, o, nb0, nb1);
  else
    run<false>(w, a, o, nb0, nb1);
}

}  // namespace quill
