// The q8 family of our linears (quant=q8): y[M, N] = x[M, K] @ W[N, K]^T with W exactly GGUF Q4_1 / Q8_0 blocks and
// each input row quantised per block of 32 to int8 (q8dp_q4_1, q8dp_q8_0): integer dot products, int32 sums, the
// scales applied once per block. The way llama.cpp multiplies its 4-bit weights on a CPU, in our batch invariant form.
//
// Why (docs/design.md, "The CPU step"; issue 34): the bf16 family expands every 4-bit weight to fp32 and rounds it to
// bf16 before a `vdpbf16ps` (two multiply-adds per lane): ~9 instructions per 32 weights for the expansion and 16 for
// the products. Here a 16-column group of a block is 4 loads and 8 nibble masks, and `vpdpbusd` (AVX512-VNNI) does
// four u8 x s8 multiply-adds per lane: 8 instructions for the 512 products, so a decode step is memory bound and a
// verify-shaped or prompt-shaped call has twice the multiply-adds per instruction.
//
// Per output element (m, n), for the blocks b in order:
//   isum = sum over the block's 32 k of q_w[n, k] * q_x[m, k]           (exact in int32, in any order)
//   acc  = fma(float(isum), d_w[n, b] * d_x[m, b], acc)
//   acc  = fma(m_w[n, b], d_x[m, b] * sum_k q_x[m, k], acc)              (Q4_1's minimum; Q8_0 has none)
// with the activations quantised per row (d_x = max|x| / 127, q_x = round-to-nearest-even(x * 127 / max|x|)). Nothing
// in that depends on M, on the row's neighbours, on the tile that computes it or on the instructions that form the
// integer sums, so the family is batch invariant by construction, and every implementation of the integer dot
// product gives the same bits: AVX512-VNNI `vpdpbusd`, AVX2 `vpmaddubsw` + `vpmaddwd` (u8 x s8 pairs cannot saturate
// int16 here: a nibble or |w| <= 128 times |q_x| <= 127), or the portable loops (tests/cpu/test_gemm_q8.py).
//
// Layout: panels of 16 output columns; per (panel, block): the 16 columns' scales as float16 (GGUF's own, exact), then
// the quants as 8 steps of 4 consecutive k, each step 16 columns x 4 bytes (one int32 lane per column, the operand
// shape of vpdpbusd). Q4_1: 4 chunks of 64 bytes, chunk p holding step p in its low nibbles and step p + 4 in its high
// nibbles (column c's 4 bytes are its GGUF bytes 4p..4p+3: GGUF stores q_l | q_{l+16} << 4), 0.625 bytes a weight;
// Q8_0: 8 steps of q + 128 as unsigned bytes (vpdpbusd's unsigned operand; the sum is corrected by 128 * sum(q_x),
// exactly), 1.0625 bytes a weight.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "sched.h"
#include "team.h"
#include "vec.h"

namespace {

constexpr int64_t QK = 32;                // GGUF block length
constexpr int64_t NP = 16;                // output columns per panel
constexpr int64_t Q4_BYTES = 64 + 256;    // per (panel, block): d[16], m[16] float16; 4 chunks x 64 bytes
constexpr int64_t Q8_BYTES = 32 + 512;    // per (panel, block): d[16] float16; 8 steps x 64 bytes
constexpr int64_t MC = 192;               // rows per work item of a prompt-shaped call
constexpr int64_t M_STATIC = 64;          // up to this many rows: decode's static split of the panels
constexpr int64_t PF_BLOCKS = 8;          // blocks prefetched ahead

inline int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

// ---- activations: per row and block of 32, int8 quants, their scale, and the two sums the formats need ----------

struct Act {
  const int8_t* q;    // [M][K]
  const int8_t* q2;   // [M][K]: the second part (two-part activations), else null
  const float* d;     // [M][KB]: the scale of an integer sum (max|x| / 127, / 256 with two parts)
  const float* s;     // [M][KB]: d * (the sum of the block's integers)  (Q4_1's minimum term)
  const int32_t* c;   // [M][KB]: 128 * (the sum of the block's integers) (the Q8_0 offset's correction)
  int64_t K, KB;
};

// One block: quants, scale, sums. Every build computes the same numbers (max, the products and the subtraction are
// exact IEEE operations, rounding is to nearest even, the sums are integers). With two parts the block is
// x = (max|x| / 127) (q + q2 / 256): q2 = round(256 (t - q)) where t = x 127 / max|x| and q = round(t) (t - q is
// exact), i.e. ~16-bit activations. A block with a NaN or infinity gets zero quants and a NaN scale, so its rows'
// outputs are NaN, as the fp32 product would be.
inline void quantize_block(const float* x, int8_t* q, int8_t* q2, float* d, float* s, int32_t* c) {
  float amax = 0.f;
  bool finite = true;
  for (int j = 0; j < QK; ++j) {
    finite = finite && std::isfinite(x[j]);
    amax = std::max(amax, std::fabs(x[j]));
  }
  if (!finite) {
    std::memset(q, 0, QK);
    if (q2 != nullptr) std::memset(q2, 0, QK);
    *d = *s = std::numeric_limits<float>::quiet_NaN();
    *c = 0;
    return;
  }
  const float id = amax > 0.f ? 127.f / amax : 0.f;
  int32_t sum = 0;
#if defined(__AVX512F__)
  // the loop below, 16 lanes at a time (the same IEEE operations and nearest-even roundings, so the same numbers)
  for (int h = 0; h < 2; ++h) {
    const __m512 t = _mm512_mul_ps(_mm512_loadu_ps(x + 16 * h), _mm512_set1_ps(id));
    const __m512 r = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512i v = _mm512_cvtps_epi32(r);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * h), _mm512_cvtepi32_epi8(v));
    if (q2 != nullptr) {
      __m512i v2 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(t, r), _mm512_set1_ps(256.f)));
      v2 = _mm512_max_epi32(_mm512_min_epi32(v2, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q2 + 16 * h), _mm512_cvtepi32_epi8(v2));
      v = _mm512_add_epi32(_mm512_slli_epi32(v, 8), v2);
    }
    sum += _mm512_reduce_add_epi32(v);
  }
#else
  for (int j = 0; j < QK; ++j) {
    const float t = x[j] * id, r = std::nearbyint(t);
    q[j] = static_cast<int8_t>(r);
    int32_t v = static_cast<int32_t>(r);
    if (q2 != nullptr) {
      const int32_t v2 = std::clamp(static_cast<int32_t>(std::nearbyint((t - r) * 256.f)), -127, 127);
      q2[j] = static_cast<int8_t>(v2);
      v = 256 * v + v2;
    }
    sum += v;
  }
#endif
  *d = q2 != nullptr ? amax / 127.f / 256.f : amax / 127.f;
  *s = *d * static_cast<float>(sum);
  *c = 128 * sum;
}

// The activations of M rows in buf: M * K quants (twice with two parts), then M * KB scales, sums, corrections.
inline size_t act_bytes(int64_t M, int64_t K, int parts) { return parts * M * K + M * (K / QK) * 12; }
Act act_in(uint8_t* buf, int64_t M, int64_t K, int parts) {
  const int64_t KB = K / QK;
  int8_t* q = reinterpret_cast<int8_t*>(buf);
  float* d = reinterpret_cast<float*>(buf + parts * M * K);
  float* s = d + M * KB;
  return {q, parts == 2 ? q + M * K : nullptr, d, s, reinterpret_cast<int32_t*>(s + M * KB), K, KB};
}

// blocks [i0, i1) of x [M, K] (block i: row i / KB) into a's buffers
void quantize_blocks(const float* x, const Act& a, int64_t i0, int64_t i1) {
  int8_t* q = const_cast<int8_t*>(a.q);
  int8_t* q2 = const_cast<int8_t*>(a.q2);
  float* d = const_cast<float*>(a.d);
  float* s = const_cast<float*>(a.s);
  int32_t* c = const_cast<int32_t*>(a.c);
  for (int64_t i = i0; i < i1; ++i)
    quantize_block(x + i * QK, q + i * QK, q2 ? q2 + i * QK : nullptr, d + i, s + i, c + i);
}

// x [M, K] -> the activations in buf.
Act quantize_rows(const float* x, int64_t M, int64_t K, int parts, std::vector<uint8_t>& buf) {
  buf.resize(act_bytes(M, K, parts));
  const Act a = act_in(buf.data(), M, K, parts);
  at::parallel_for(0, M * a.KB, 256, [&](int64_t i0, int64_t i1) { quantize_blocks(x, a, i0, i1); });
  return a;
}

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---- integer dot products: one policy per instruction set, the same integers from each ----------------------------
// F / I: float / int32 vectors of L lanes (one output column each). dot_u: acc + sum of 4 products of u8 weights and
// the s8 activations x4 (broadcast) per lane; q8: a Q8_0 step as stored (q + 128) -> the operand dot_q8 takes.

#if !defined(__AVX2__)
struct Portable {  // plain loops over the same integers: the generic build (any CPU)
  static constexpr int L = 8, RMAX = 2;
  static constexpr bool Q8_OFFSET = false;
  static constexpr bool PAIRS16 = false;  // dot_u sums in int32
  struct F {
    float v[L];
  };
  struct I {
    int32_t v[L];
    uint8_t b[4 * L];  // the weights' bytes, for dot_u / dot_q8
  };
  static F fzero() { return F{}; }
  static F fset(float a) {
    F r;
    std::fill(r.v, r.v + L, a);
    return r;
  }
  static F fma(F a, F b, F c) {
    for (int l = 0; l < L; ++l) c.v[l] = std::fma(a.v[l], b.v[l], c.v[l]);
    return c;
  }
  static F mul(F a, F b) {
    for (int l = 0; l < L; ++l) a.v[l] *= b.v[l];
    return a;
  }
  static F cvt(I a) {
    F r;
    for (int l = 0; l < L; ++l) r.v[l] = static_cast<float>(a.v[l]);
    return r;
  }
  static float half(uint16_t h) {  // float16 bits -> float (exact)
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, e = (h >> 10) & 31u, man = h & 0x3FFu;
    float f;
    if (e == 0) {
      f = std::ldexp(static_cast<float>(man), -24);
    } else {
      const uint32_t bits = e == 31 ? 0x7F800000u | (man << 13) : ((e + 112) << 23) | (man << 13);
      std::memcpy(&f, &bits, 4);
    }
    uint32_t out;
    std::memcpy(&out, &f, 4);
    out |= sign;
    std::memcpy(&f, &out, 4);
    return f;
  }
  static F halves(const uint8_t* p) {
    F r;
    for (int l = 0; l < L; ++l) {
      uint16_t h;
      std::memcpy(&h, p + 2 * l, 2);
      r.v[l] = half(h);
    }
    return r;
  }
  static I izero() { return I{}; }
  static I add(I a, I b) {
    for (int l = 0; l < L; ++l) a.v[l] += b.v[l];
    return a;
  }
  static I sub(I a, I b) {
    for (int l = 0; l < L; ++l) a.v[l] -= b.v[l];
    return a;
  }
  static I shl8(I a) {
    for (int l = 0; l < L; ++l) a.v[l] *= 256;
    return a;
  }
  static I iset(int32_t a) {
    I r{};
    std::fill(r.v, r.v + L, a);
    return r;
  }
  static void nibbles(const uint8_t* p, I& lo, I& hi) {
    for (int i = 0; i < 4 * L; ++i) {
      lo.b[i] = p[i] & 15;
      hi.b[i] = p[i] >> 4;
    }
  }
  static I q8(const uint8_t* p) {
    I r{};
    for (int i = 0; i < 4 * L; ++i) r.b[i] = p[i] ^ 0x80;  // back to q (two's complement)
    return r;
  }
  static I dot_u(I acc, const I& w, int32_t x4) {
    int8_t x[4];
    std::memcpy(x, &x4, 4);
    for (int l = 0; l < L; ++l)
      for (int j = 0; j < 4; ++j) acc.v[l] += static_cast<int32_t>(w.b[4 * l + j]) * x[j];
    return acc;
  }
  static I dot_q8(I acc, const I& w, int32_t x4) {
    int8_t x[4];
    std::memcpy(x, &x4, 4);
    for (int l = 0; l < L; ++l)
      for (int j = 0; j < 4; ++j) acc.v[l] += static_cast<int32_t>(static_cast<int8_t>(w.b[4 * l + j])) * x[j];
    return acc;
  }
  static void store(float* p, F v, int64_t n) { std::memcpy(p, v.v, std::min<int64_t>(n, L) * sizeof(float)); }
};
#endif

#if defined(__AVX2__)
struct Avx2 {  // vpmaddubsw + vpmaddwd: no int16 saturation for our operands (see the header)
  // RMAX: rows a tile (each a float and two integer accumulators); 4 against 2, with PAIRS16, on Zen 3 (one tile's
  // weights serve twice the rows): the Q4_1 linears 1.1-1.2x (q8) and 1.1-1.4x (q16) at 3-64 rows; 3 and 6 were slower
  static constexpr int L = 8, RMAX = 4;
  static constexpr bool Q8_OFFSET = false;  // dot_q8 forms sum(q * x) itself (|q| x sign(x, q))
  typedef __m256 F;
  typedef __m256i I;
  static F fzero() { return _mm256_setzero_ps(); }
  static F fset(float a) { return _mm256_set1_ps(a); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static F halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I izero() { return _mm256_setzero_si256(); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I shl8(I a) { return _mm256_slli_epi32(a, 8); }
  static I iset(int32_t a) { return _mm256_set1_epi32(a); }
  static void nibbles(const uint8_t* p, I& lo, I& hi) {
    const I v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), m = _mm256_set1_epi8(15);
    lo = _mm256_and_si256(v, m);
    hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
  }
  static I q8(const uint8_t* p) {
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_set1_epi8(-128));
  }
  // A Q4_1 block's products in int16 pairs (vpmaddubsw), widened to int32 once a block (vpmaddwd) instead of once a
  // step: every pair is a nibble (<= 15) times two |q_x| <= 127, so the 8 steps of a block, or 4 of each of two
  // parts, sum to at most 8 x 2 x 15 x 127 = 30,480 < 2^15 in int16 exactly, and the int32 sums are the same integers
  // (the same bits): a step is a broadcast, vpmaddubsw and an int16 add instead of also a vpmaddwd and an int32 add
  // (BENCHMARKS.md, issue 53). Q8_0's pairs reach 2 x 128 x 127 = 32,512: one step each, as dot_q8 does.
  static constexpr bool PAIRS16 = true;  // Q4_1 takes dot_u16 (no dot_u)
  static I dot_u16(I acc16, I w, int32_t x4) {
    return _mm256_add_epi16(acc16, _mm256_maddubs_epi16(w, _mm256_set1_epi32(x4)));
  }
  static I widen(I acc16) { return _mm256_madd_epi16(acc16, _mm256_set1_epi16(1)); }
  static I add16(I a, I b) { return _mm256_add_epi16(a, b); }
  static I dot_q8(I acc, I w, int32_t x4) {
    const I xs = _mm256_sign_epi8(_mm256_set1_epi32(x4), w);
    return _mm256_add_epi32(acc, widen(_mm256_maddubs_epi16(_mm256_abs_epi8(w), xs)));
  }
  static void store(float* p, F v, int64_t n) {
    if (n >= L) {
      _mm256_storeu_ps(p, v);
    } else {
      float t[L];
      _mm256_storeu_ps(t, v);
      std::memcpy(p, t, n * sizeof(float));
    }
  }
};
#endif

#if defined(__AVX512F__)
#pragma GCC push_options
#pragma GCC target("avx512vnni")
struct Vnni512 {  // vpdpbusd: four u8 x s8 products per int32 lane in one instruction
  static constexpr int L = 16, RMAX = 8;
  static constexpr bool Q8_OFFSET = true;  // dot_q8 sums (q + 128) * x: the caller subtracts 128 * sum(x)
  static constexpr bool PAIRS16 = false;   // vpdpbusd sums in int32
  typedef __m512 F;
  typedef __m512i I;
  static F fzero() { return _mm512_setzero_ps(); }
  static F fset(float a) { return _mm512_set1_ps(a); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static I izero() { return _mm512_setzero_si512(); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I shl8(I a) { return _mm512_slli_epi32(a, 8); }
  static I iset(int32_t a) { return _mm512_set1_epi32(a); }
  static void nibbles(const uint8_t* p, I& lo, I& hi) {
    const I v = _mm512_loadu_si512(p), m = _mm512_set1_epi8(15);
    lo = _mm512_and_si512(v, m);
    hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m);
  }
  static I q8(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I dot_u(I acc, I w, int32_t x4) { return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x4)); }
  static I dot_q8(I acc, I w, int32_t x4) { return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x4)); }
  static void store(float* p, F v, int64_t n) {
    _mm512_mask_storeu_ps(p, n >= L ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1), v);
  }
};
#endif

// ---- the tile: rows [m0, m0 + R) of one panel, every block, in the order of the header --------------------------

template <class P, bool Q4>
inline typename P::I dot(typename P::I acc, const typename P::I& w, int32_t x4) {
  if constexpr (Q4 && P::PAIRS16)  // a step's int16 pairs; the tile widens them at the block's end (Avx2::PAIRS16)
    return P::dot_u16(acc, w, x4);
  else if constexpr (Q4)
    return P::dot_u(acc, w, x4);
  else
    return P::dot_q8(acc, w, x4);
}

template <class P, bool Q4, int PARTS, int R>
inline void tile(const Act& a, int64_t m0, const uint8_t* __restrict panel, float* __restrict out, int64_t N,
                 int64_t n0, bool pf) {
  constexpr int64_t BYTES = Q4 ? Q4_BYTES : Q8_BYTES;
  constexpr int64_t HEAD = Q4 ? 64 : 32;  // the scales before the quants
  for (int h = 0; h < NP / P::L; ++h) {  // lanes [h L, h L + L) of the panel
    const int64_t cols = std::min<int64_t>(P::L, N - n0 - h * P::L);
    if (cols <= 0) break;
    typename P::F acc[R];
    for (int i = 0; i < R; ++i) acc[i] = P::fzero();
    for (int64_t b = 0; b < a.KB; ++b) {
      const uint8_t* blk = panel + b * BYTES;
      if (pf && h == 0)
        for (int64_t o = 0; o < BYTES; o += 64) dspine::prefetch(blk + PF_BLOCKS * BYTES + o);
      const typename P::F d = P::halves(blk + h * P::L * 2);
      const uint8_t* qd = blk + HEAD + h * P::L * 4;
      // two integer sums per row: the halves of the block's steps (shorter dependency chains), or the two parts of
      // the activations (the first weighs 256 times the second); combined exactly
      typename P::I lo[R], hi[R];
      for (int i = 0; i < R; ++i) lo[i] = hi[i] = P::izero();
      for (int p = 0; p < 4; ++p) {
        typename P::I wlo, whi;
        if constexpr (Q4) {
          P::nibbles(qd + p * 64, wlo, whi);
        } else {
          wlo = P::q8(qd + p * 64);
          whi = P::q8(qd + (p + 4) * 64);
        }
        for (int i = 0; i < R; ++i) {
          const int64_t at = (m0 + i) * a.K + b * QK + 4 * p;
          if constexpr (PARTS == 1) {
            lo[i] = dot<P, Q4>(lo[i], wlo, load4(a.q + at));
            hi[i] = dot<P, Q4>(hi[i], whi, load4(a.q + at + 16));
          } else {
            lo[i] = dot<P, Q4>(dot<P, Q4>(lo[i], wlo, load4(a.q + at)), whi, load4(a.q + at + 16));
            hi[i] = dot<P, Q4>(dot<P, Q4>(hi[i], wlo, load4(a.q2 + at)), whi, load4(a.q2 + at + 16));
          }
        }
      }
      typename P::F mn;
      if constexpr (Q4) mn = P::halves(blk + 32 + h * P::L * 2);
      for (int i = 0; i < R; ++i) {
        const int64_t rb = (m0 + i) * a.KB + b;
        typename P::I sum;
        if constexpr (Q4 && P::PAIRS16)  // int16 pairs -> int32 (PARTS 1: lo + hi is one block's 8 steps)
          sum = PARTS == 1 ? P::widen(P::add16(lo[i], hi[i])) : P::add(P::shl8(P::widen(lo[i])), P::widen(hi[i]));
        else
          sum = P::add(PARTS == 1 ? lo[i] : P::shl8(lo[i]), hi[i]);
        if constexpr (!Q4 && P::Q8_OFFSET) sum = P::sub(sum, P::iset(a.c[rb]));
        acc[i] = P::fma(P::cvt(sum), P::mul(d, P::fset(a.d[rb])), acc[i]);
        if constexpr (Q4) acc[i] = P::fma(mn, P::fset(a.s[rb]), acc[i]);
      }
    }
    for (int i = 0; i < R; ++i) P::store(out + (m0 + i) * N + n0 + h * P::L, acc[i], cols);
  }
}

// rows [m0, m1) of panel t: tiles of at most RMAX rows, heights balanced (a row's bits do not depend on its tile)
template <class P, bool Q4, int PARTS>
void rows(const Act& a, int64_t m0, int64_t m1, const uint8_t* panel, float* out, int64_t N, int64_t n0) {
  const int64_t n = m1 - m0, tiles = (n + P::RMAX - 1) / P::RMAX;
  for (int64_t i = 0; i < tiles; ++i) {
    const int64_t r0 = m0 + n * i / tiles, r1 = m0 + n * (i + 1) / tiles;
    switch (r1 - r0) {
#define DSPINE_Q8_TILE(r)                                                         \
  case r:                                                                         \
    if constexpr (r <= P::RMAX) tile<P, Q4, PARTS, r>(a, r0, panel, out, N, n0, i == 0); \
    break;
      DSPINE_Q8_TILE(1)
      DSPINE_Q8_TILE(2)
      DSPINE_Q8_TILE(3)
      DSPINE_Q8_TILE(4)
      DSPINE_Q8_TILE(5)
      DSPINE_Q8_TILE(6)
      DSPINE_Q8_TILE(7)
      DSPINE_Q8_TILE(8)
#undef DSPINE_Q8_TILE
      default:
        break;
    }
  }
}

template <class P, bool Q4, int PARTS>
void run(const Act& a, int64_t M, const uint8_t* pp, float* op, int64_t N) {
  constexpr int64_t BYTES = Q4 ? Q4_BYTES : Q8_BYTES;
  const int64_t panels = round_up(N, NP) / NP, panel_bytes = a.KB * BYTES;
  if (M <= M_STATIC) {  // decode / verify: each thread one contiguous share of the panels (one stream to prefetch)
    at::parallel_for(0, panels, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) rows<P, Q4, PARTS>(a, 0, M, pp + t * panel_bytes, op, N, t * NP);
    });
    return;
  }
  const int64_t chunks = (M + MC - 1) / MC, items = chunks * panels;
  dspine::parallel_pull(items, [&](auto& pull) {  // prompts: (row chunk, panel) items pulled one at a time (sched.h)
    for (int64_t i; (i = pull()) < items;) {
      const int64_t c = i / panels, t = i % panels;
      rows<P, Q4, PARTS>(a, c * MC, std::min(M, (c + 1) * MC), pp + t * panel_bytes, op, N, t * NP);
    }
  });
}
#if defined(__AVX512F__)
#pragma GCC pop_options
#endif

// Which integer dot product this CPU gets: "vnni512" (the avx512 build on a CPU with AVX512-VNNI), "avx2" (an AVX2
// build, or the avx512 build without VNNI; DSPINE_Q8_DOT=avx2 asks for it on a VNNI CPU: the tests compare the bits),
// "portable" (the generic build).
std::string q8_dot() {
#if defined(__AVX512F__)
  static const bool vnni = __builtin_cpu_supports("avx512vnni") &&
                           std::string(std::getenv("DSPINE_Q8_DOT") ? std::getenv("DSPINE_Q8_DOT") : "") != "avx2";
  return vnni ? "vnni512" : "avx2";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "portable";
#endif
}

// f(P{}, std::integral_constant<int, PARTS>{}) with this build's dot product policy P (q8_dot) and the call's parts
template <class F>
void with_policy(int64_t parts, const F& f) {
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
#if defined(__AVX512F__)
  static const bool vnni = q8_dot() == "vnni512";
  if (vnni) parts == 2 ? f(Vnni512{}, Two{}) : f(Vnni512{}, One{});
  else parts == 2 ? f(Avx2{}, Two{}) : f(Avx2{}, One{});
#elif defined(__AVX2__)
  parts == 2 ? f(Avx2{}, Two{}) : f(Avx2{}, One{});
#else
  parts == 2 ? f(Portable{}, Two{}) : f(Portable{}, One{});
#endif
}

template <bool Q4>
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t parts) {
  TORCH_CHECK(parts == 1 || parts == 2, "linear_q8dp: parts is 1 (int8 activations) or 2 (two int8 parts)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "linear_q8dp: expected a 2-D float32 input");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % QK == 0, "linear_q8dp: K must be a multiple of 32");
  TORCH_CHECK(packed.nbytes() == static_cast<size_t>(round_up(N, NP) / NP * (K / QK) * (Q4 ? Q4_BYTES : Q8_BYTES)),
              "linear_q8dp: packed weight does not match N, K");
  auto xc = x.contiguous();
  auto out = at::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return out;
  thread_local std::vector<uint8_t> buf;
  const Act a = quantize_rows(xc.data_ptr<float>(), M, K, parts, buf);
  const uint8_t* pp = static_cast<const uint8_t*>(packed.data_ptr());
  float* op = out.data_ptr<float>();
  with_policy(parts, [&](auto policy, auto n_parts) { run<decltype(policy), Q4, n_parts.value>(a, M, pp, op, N); });
  return out;
}

// panels [t0, t1) of a decode-shaped call (the static split's work of one thread), on this build's dot product
template <bool Q4>
void panels(const Act& a, int parts, int64_t M, const uint8_t* pp, float* op, int64_t N, int64_t t0, int64_t t1) {
  const int64_t panel_bytes = a.KB * (Q4 ? Q4_BYTES : Q8_BYTES);
  with_policy(parts, [&](auto policy, auto n_parts) {
    for (int64_t t = t0; t < t1; ++t)
      rows<decltype(policy), Q4, n_parts.value>(a, 0, M, pp + t * panel_bytes, op, N, t * NP);
  });
}

at::Tensor linear_q8dp_q4_1(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t parts) {
  return linear<true>(x, packed, n, parts);
}
at::Tensor linear_q8dp_q8_0(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t parts) {
  return linear<false>(x, packed, n, parts);
}

// GGUF blocks -> panels. q [N, K/32, 16] bytes (Q4_1, byte l = q_l | q_{l+16} << 4) or [N, K/32, 32] int8 (Q8_0);
// d (and m) [N, K/32], float values that are float16 numbers (GGUF's own scales).
template <bool Q4>
at::Tensor pack(const at::Tensor& q, const at::Tensor& d, const at::Tensor* m) {
  constexpr int64_t QB = Q4 ? 16 : 32, BYTES = Q4 ? Q4_BYTES : Q8_BYTES, HEAD = Q4 ? 64 : 32;
  TORCH_CHECK(q.dim() == 3 && q.size(2) == QB && q.element_size() == 1, "pack_q8dp: bad block tensor");
  auto qc = q.contiguous();
  auto dh = d.to(at::kHalf).contiguous();
  TORCH_CHECK(at::equal(dh.to(at::kFloat), d.to(at::kFloat)), "pack_q8dp: scales must be float16 numbers");
  at::Tensor mh;
  if (Q4) {
    mh = m->to(at::kHalf).contiguous();
    TORCH_CHECK(at::equal(mh.to(at::kFloat), m->to(at::kFloat)), "pack_q8dp: minimums must be float16 numbers");
  }
  const int64_t N = qc.size(0), KB = qc.size(1), panels = round_up(N, NP) / NP;
  auto out = at::zeros({panels * KB * BYTES}, qc.options().dtype(at::kByte));
  const uint8_t* qp = static_cast<const uint8_t*>(qc.data_ptr());
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(dh.data_ptr());
  const uint16_t* mp = Q4 ? reinterpret_cast<const uint16_t*>(mh.data_ptr()) : nullptr;
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t b = 0; b < KB; ++b) {
        uint8_t* blk = op + (t * KB + b) * BYTES;
        for (int64_t c = 0; c < NP; ++c) {
          const int64_t n = t * NP + c;
          uint8_t* quants = blk + HEAD;
          if (n >= N) {  // padding: zero weights (Q8_0 stores q + 128)
            if (!Q4)
              for (int64_t s = 0; s < 8; ++s) std::memset(quants + s * 64 + c * 4, 0x80, 4);
            continue;
          }
          std::memcpy(blk + 2 * c, dp + n * KB + b, 2);
          if (Q4) std::memcpy(blk + 32 + 2 * c, mp + n * KB + b, 2);
          const uint8_t* src = qp + (n * KB + b) * QB;
          for (int64_t s = 0; s < (Q4 ? 4 : 8); ++s)
            for (int64_t j = 0; j < 4; ++j)
              quants[s * 64 + c * 4 + j] = Q4 ? src[4 * s + j] : static_cast<uint8_t>(src[4 * s + j] ^ 0x80);
        }
      }
  });
  return out;
}

at::Tensor pack_q8dp_q4_1(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m) { return pack<true>(q, d, &m); }
at::Tensor pack_q8dp_q8_0(const at::Tensor& q, const at::Tensor& d) { return pack<false>(q, d, nullptr); }
}  // namespace

namespace dspine::team {
int64_t q8_panels(int64_t N) { return round_up(N, NP) / NP; }
size_t q8_act_bytes(int64_t M, int64_t K, int parts) { return act_bytes(M, K, parts); }
bool q8_packed_matches(bool q4, const at::Tensor& packed, int64_t N, int64_t K) {
  return K % QK == 0 && packed.is_contiguous() &&
         packed.nbytes() == static_cast<size_t>(q8_panels(N) * (K / QK) * (q4 ? Q4_BYTES : Q8_BYTES));
}
void q8_quantize_rows(const float* x, int64_t M, int64_t K, int parts, uint8_t* buf, int64_t r0, int64_t r1) {
  const Act a = act_in(buf, M, K, parts);
  quantize_blocks(x, a, r0 * a.KB, r1 * a.KB);
}
void q8_panels_of(bool q4, int parts, uint8_t* buf, int64_t M, int64_t K, const uint8_t* packed, float* out,
                  int64_t N, int64_t t0, int64_t t1) {
  const Act a = act_in(buf, M, K, parts);
  if (q4) panels<true>(a, parts, M, packed, out, N, t0, t1);
  else panels<false>(a, parts, M, packed, out, N, t0, t1);
}
}  // namespace dspine::team

TORCH_LIBRARY_FRAGMENT(dspine_cpu, m) {
  m.def("pack_q8dp_q4_1(Tensor q, Tensor d, Tensor m) -> Tensor");
  m.def("pack_q8dp_q8_0(Tensor q, Tensor d) -> Tensor");
  m.def("linear_q8dp_q4_1(Tensor x, Tensor packed, int n, int parts=1) -> Tensor");
  m.def("linear_q8dp_q8_0(Tensor x, Tensor packed, int n, int parts=1) -> Tensor");
  m.def("q8_dot() -> str", &q8_dot);
}

TORCH_LIBRARY_IMPL(dspine_cpu, CPU, m) {
  m.impl("pack_q8dp_q4_1", &pack_q8dp_q4_1);
  m.impl("pack_q8dp_q8_0", &pack_q8dp_q8_0);
  m.impl("linear_q8dp_q4_1", &linear_q8dp_q4_1);
  m.impl("linear_q8dp_q8_0", &linear_q8dp_q8_0);
}
