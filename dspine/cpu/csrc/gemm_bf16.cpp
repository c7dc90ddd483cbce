// The bf16 family of our linears: y[M, N] = bf16(x)[M, K] @ bf16(W)[N, K]^T with fp32 accumulation, on
// AVX512-BF16 (`vdpbf16ps`), for the bf16 precision policy (weights rounded to bfloat16 once at load, each input
// row rounded to bfloat16 on entry, fp32 sums and outputs; norms, attention and the residual stream stay fp32).
//
// Why (docs/design.md, "The CPU step"; issue 26): prompt reading is GEMM-shaped (M = a prompt's tokens) and
// compute bound. The fp32 kernels (linear.cpp) already run at the fp32 FMA rate there, ~88 GFLOP/s on one
// Zen 4 core; `vdpbf16ps` does two multiply-adds per fp32 lane per instruction, which is where torch's own bf16
// GEMM gets ~2x that.
//
// Tiles: the weights are packed in panels of NR = 48 output columns (three 16-lane vectors); a panel is a
// sequence of K/2 steps, each holding, for every column, the bf16 pair (w[n, 2p], w[n, 2p + 1]). A register tile
// is MR = 8 rows x 48 columns: per step it loads the three weight vectors once and uses each for all 8 rows, and
// broadcasts each row's input pair once and uses it for all 48 columns (24 accumulators).
//
// Batch invariance by construction: out[m, n] lives in one lane of one accumulator, which starts at zero and
// takes the K/2 steps in order, one `vdpbf16ps` each; nothing else touches it, and no horizontal sum is needed.
// The sequence depends on K only: not on M, the row's place, the tile height that computed it (remainder tiles
// run the same step sequence), the thread count or how rows are chunked. So a row gives the same bits alone, in a
// batch, as a 1-token decode step or inside a prompt, and the decode path and the prompt path are one kernel.
//
// GGUF blocks under the same policy (`bf16dp_q4_1`, `bf16dp_q8_0`): a decode step reads every weight once, and bf16
// panels take 2 bytes a weight against the Q4_1 blocks' 0.75 (streamed and resident). These formats keep the blocks (the same bytes a weight as linear.cpp's) in a
// panel-friendly order; each work item expands its panel into the bf16 panel layout above in a thread-local
// scratch -- block to fp32 with linear.cpp's fused multiply-add (exactly the weight), then rounded to bf16
// (nearest even, as torch's .bfloat16() at pack time) -- and runs the same tile<> over it. Same bf16 values,
// same tile, same per-element step sequence: the bits are the bf16 panels' for every M (tests/cpu/test_gemm.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "sched.h"
#include "vec.h"

namespace {

constexpr int64_t NR = 48;  // output columns per panel (three 16-lane vectors)

inline int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

// W [N, K] bfloat16 -> panels: [Np / NR][Kp / 2][NR][2] bf16 (zero padded to Np = NR * k, Kp even).
at::Tensor pack_bf16dp(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "pack_bf16dp: expected a 2-D bfloat16 weight");
  auto wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), Np = round_up(N, NR), Kp = round_up(K, 2);
  auto out = at::zeros({Np * Kp * 2}, wc.options().dtype(at::kByte));
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wc.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<uint8_t>());
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t panel = n / NR, c = n % NR;
      uint16_t* base = dst + panel * Kp * NR;
      for (int64_t k = 0; k < K; ++k) base[(k / 2) * NR * 2 + c * 2 + (k % 2)] = src[n * K + k];
    }
  });
  return out;
}

constexpr int64_t QK = 32;                       // GGUF block length
constexpr int64_t GROUPS = NR / 16;              // 16-column groups per panel
constexpr int64_t Q4_GROUP = 128 + 16 * 16;      // per (block, group): d[16], m[16] (fp32), 16 steps x 16 bytes
constexpr int64_t Q8_GROUP = 64 + 16 * 32;       // per (block, group): d[16] (fp32), 16 steps x 32 bytes

// The lane order of a step's expansion: the 32 weights of step s (k = 2s, 2s + 1 of a block) for the 16 columns of a
// group are two fp32 vectors, lo (lane l: column l / 2, k = 2s + l % 2) and hi (columns 8 + l / 2), which
// _mm512_cvtne2ps_pbh(hi, lo) turns into exactly the panel's bf16 pairs [column][2].
inline int64_t lane_col(int64_t l, bool hi) { return (hi ? 8 : 0) + l / 2; }

// GGUF Q4_1 blocks (q [N, K/32, 16] bytes, byte l = q_l | q_{l+16} << 4; d, m [N, K/32]) -> panels of 48 columns:
// [Np / NR][K / 32][GROUPS] x (d[16], m[16], [16 steps][16 bytes: lo lane's q | hi lane's q << 4]).
at::Tensor pack_bf16dp_q4_1(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m) {
  TORCH_CHECK(q.dim() == 3 && q.size(2) == 16 && q.element_size() == 1, "pack_bf16dp_q4_1: bad block tensor");
  auto qc = q.contiguous();
  auto dc = d.to(at::kFloat).contiguous();
  auto mc = m.to(at::kFloat).contiguous();
  const int64_t N = qc.size(0), KB = qc.size(1), Np = round_up(N, NR);
  auto out = at::zeros({Np / NR * KB * GROUPS * Q4_GROUP}, qc.options().dtype(at::kByte));
  const uint8_t* qp = static_cast<const uint8_t*>(qc.data_ptr());
  const float* dp = dc.data_ptr<float>();
  const float* mp = mc.data_ptr<float>();
  uint8_t* op = out.data_ptr<uint8_t>();
  auto value = [&](int64_t n, int64_t b, int64_t j) -> uint8_t {  // q of column n, k = 32 b + j
    const uint8_t byte = qp[(n * KB + b) * 16 + (j % 16)];
    return j < 16 ? byte & 15 : byte >> 4;
  };
  at::parallel_for(0, Np / NR, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t b = 0; b < KB; ++b)
        for (int64_t g = 0; g < GROUPS; ++g) {
          uint8_t* grp = op + ((t * KB + b) * GROUPS + g) * Q4_GROUP;
          float* dm = reinterpret_cast<float*>(grp);
          for (int64_t c = 0; c < 16; ++c) {
            const int64_t n = t * NR + g * 16 + c;
            dm[c] = n < N ? dp[n * KB + b] : 0.f;
            dm[16 + c] = n < N ? mp[n * KB + b] : 0.f;
          }
          for (int64_t s = 0; s < 16; ++s)
            for (int64_t l = 0; l < 16; ++l) {
              const int64_t nlo = t * NR + g * 16 + lane_col(l, false), nhi = t * NR + g * 16 + lane_col(l, true);
              const int64_t j = 2 * s + l % 2;
              const uint8_t lo = nlo < N ? value(nlo, b, j) : 0, hi = nhi < N ? value(nhi, b, j) : 0;
              grp[128 + s * 16 + l] = static_cast<uint8_t>(lo | (hi << 4));
            }
        }
  });
  return out;
}

// GGUF Q8_0 blocks (q [N, K/32, 32] int8, d [N, K/32]) -> panels: [Np / NR][K / 32][GROUPS] x (d[16],
// [16 steps][16 lo lanes' q, 16 hi lanes' q]).
at::Tensor pack_bf16dp_q8_0(const at::Tensor& q, const at::Tensor& d) {
  TORCH_CHECK(q.dim() == 3 && q.size(2) == 32 && q.element_size() == 1, "pack_bf16dp_q8_0: bad block tensor");
  auto qc = q.contiguous();
  auto dc = d.to(at::kFloat).contiguous();
  const int64_t N = qc.size(0), KB = qc.size(1), Np = round_up(N, NR);
  auto out = at::zeros({Np / NR * KB * GROUPS * Q8_GROUP}, qc.options().dtype(at::kByte));
  const int8_t* qp = static_cast<const int8_t*>(qc.data_ptr());
  const float* dp = dc.data_ptr<float>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, Np / NR, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t b = 0; b < KB; ++b)
        for (int64_t g = 0; g < GROUPS; ++g) {
          uint8_t* grp = op + ((t * KB + b) * GROUPS + g) * Q8_GROUP;
          float* dd = reinterpret_cast<float*>(grp);
          int8_t* qq = reinterpret_cast<int8_t*>(grp + 64);
          for (int64_t c = 0; c < 16; ++c) {
            const int64_t n = t * NR + g * 16 + c;
            dd[c] = n < N ? dp[n * KB + b] : 0.f;
          }
          for (int64_t s = 0; s < 16; ++s)
            for (int64_t half = 0; half < 2; ++half)
              for (int64_t l = 0; l < 16; ++l) {
                const int64_t n = t * NR + g * 16 + lane_col(l, half == 1);
                qq[s * 32 + half * 16 + l] = n < N ? qp[(n * KB + b) * 32 + 2 * s + l % 2] : 0;
              }
        }
  });
  return out;
}

#if defined(__AVX512F__)
#pragma GCC push_options
#pragma GCC target("avx512bf16")

constexpr int MR = 8;         // rows per register tile
constexpr int64_t MC = 192;   // rows per pass over a panel (their bf16 inputs stay in L2 while it is read)
constexpr int MR_SMALL = 8;   // at most this many rows: one register tile per panel, block formats via tile_blocks<>
constexpr int64_t PF_BLOCKS = 8;  // tile_blocks<> prefetches the blocks this many blocks ahead
// up to this many rows, block formats run rows_blocks<> (its accumulators, M x 192 bytes, stay in L1; past that the
// whole-panel scratch of the prompt path measured 5-10 % faster on K = 1536)
constexpr int64_t M_BLOCKWISE = 64;

// out[m0 + i, n0 + c] = acc[i][c / 16] lane c % 16, for i < R and c < min(NR, N - n0)
template <int R>
inline void store_tile(const __m512 (&acc)[R][3], float* __restrict out, int64_t N, int64_t n0, int64_t m0) {
  const int64_t cols = std::min<int64_t>(NR, N - n0);
  for (int v = 0; v < 3; ++v) {
    const int64_t left = cols - 16 * v;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    for (int i = 0; i < R; ++i) _mm512_mask_storeu_ps(out + (m0 + i) * N + n0 + 16 * v, mask, acc[i][v]);
  }
}

// out[m0 + i, n0 + c] for i < R, c < min(NR, N - n0), over all K: see the header for why the order is fixed.
template <int R>
inline void tile(const uint16_t* __restrict xb, int64_t Kp, const uint16_t* __restrict panel, float* __restrict out,
                 int64_t N, int64_t n0, int64_t m0) {
  __m512 acc[R][3];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < 3; ++v) acc[i][v] = _mm512_setzero_ps();
  const int64_t steps = Kp / 2;
  for (int64_t p = 0; p < steps; ++p) {
    const uint16_t* wp = panel + p * NR * 2;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wp + 64);
    for (int i = 0; i < R; ++i) {
      int32_t pair;
      std::memcpy(&pair, xb + (m0 + i) * Kp + 2 * p, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, w0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, w1);
      acc[i][2] = _mm512_dpbf16_ps(acc[i][2], a, w2);
    }
  }
  store_tile<R>(acc, out, N, n0, m0);
}

// x [M, K] float -> bf16 [M, Kp] (round to nearest even, K padded with zeros to Kp)
void to_bf16(const float* x, int64_t M, int64_t K, int64_t Kp, uint16_t* xb) {
  at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* s = x + m * K;
      uint16_t* d = xb + m * Kp;
      int64_t k = 0;
      for (; k + 16 <= K; k += 16) {
        const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(s + k));
        std::memcpy(d + k, &h, 32);
      }
      if (k < K) {
        const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1);
        const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, s + k));
        uint16_t tmp[16];
        std::memcpy(tmp, &h, 32);
        std::memcpy(d + k, tmp, (K - k) * 2);
      }
      for (k = K; k < Kp; ++k) d[k] = 0;
    }
  });
}

// Where a work item's panel comes from: the packed bf16 panels themselves, or GGUF blocks expanded into a
// thread-local scratch in the same layout (see the header).
struct Panels {
  const uint16_t* pp;
  int64_t K;
  static int64_t bytes(int64_t Np, int64_t Kp) { return Np * Kp * 2; }
  const uint16_t* operator()(int64_t t, uint16_t*) const { return pp + t * round_up(K, 2) * NR; }
};

inline __m512i pair_index(bool hi) {  // lane l -> l / 2 (+ 8): each column's scale for its two k of a step
  return hi ? _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8)
            : _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
}

// The block formats give, per (block b, 16-column group g), the scales in lane order (Scales) and, per step s, the
// 16 columns' bf16 pairs of k = 32 b + 2 s, 2 s + 1 as one vector (step): the values the panel scratch holds.
// expand() writes them into that scratch; tile_blocks<> (decode-shaped calls) feeds them straight to the tile.
template <class Src>
const uint16_t* expand(const uint8_t* src, int64_t K, uint16_t* dst);

struct Q4Panels {
  static constexpr int64_t GROUP = Q4_GROUP;
  const uint8_t* pp;
  int64_t K;
  static int64_t bytes(int64_t Np, int64_t Kp) { return Np / NR * Kp / QK * GROUPS * Q4_GROUP; }
  const uint8_t* blocks(int64_t t) const { return pp + t * (K / QK) * GROUPS * Q4_GROUP; }
  struct Scales {
    __m512 dlo, dhi, mlo, mhi;
  };
  static inline Scales scales(const uint8_t* grp) {
    const __m512i ilo = pair_index(false), ihi = pair_index(true);
    const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(grp));
    const __m512 m = _mm512_loadu_ps(reinterpret_cast<const float*>(grp) + 16);
    return {_mm512_permutexvar_ps(ilo, d), _mm512_permutexvar_ps(ihi, d), _mm512_permutexvar_ps(ilo, m),
            _mm512_permutexvar_ps(ihi, m)};
  }
  static inline __m512bh step(const uint8_t* grp, const Scales& sc, int64_t s) {
    const __m512i low4 = _mm512_set1_epi32(15);
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(grp + 128 + s * 16)));
    // d * q + m in one fused multiply-add, as linear.cpp's Q4_1 (d * q is exact): the fp32 weight itself
    const __m512 lo = _mm512_fmadd_ps(sc.dlo, _mm512_cvtepi32_ps(_mm512_and_si512(v, low4)), sc.mlo);
    const __m512 hi = _mm512_fmadd_ps(sc.dhi, _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), sc.mhi);
    return _mm512_cvtne2ps_pbh(hi, lo);
  }
  const uint16_t* operator()(int64_t t, uint16_t* dst) const { return expand<Q4Panels>(blocks(t), K, dst); }
};

struct Q8Panels {
  static constexpr int64_t GROUP = Q8_GROUP;
  const uint8_t* pp;
  int64_t K;
  static int64_t bytes(int64_t Np, int64_t Kp) { return Np / NR * Kp / QK * GROUPS * Q8_GROUP; }
  const uint8_t* blocks(int64_t t) const { return pp + t * (K / QK) * GROUPS * Q8_GROUP; }
  struct Scales {
    __m512 dlo, dhi;
  };
  static inline Scales scales(const uint8_t* grp) {
    const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(grp));
    return {_mm512_permutexvar_ps(pair_index(false), d), _mm512_permutexvar_ps(pair_index(true), d)};
  }
  static inline __m512bh step(const uint8_t* grp, const Scales& sc, int64_t s) {
    const __m128i* q = reinterpret_cast<const __m128i*>(grp + 64 + s * 32);
    // fma(d, q, 0) as linear.cpp's Q8_0 (d * q is exact): the fp32 weight itself
    const __m512 lo =
        _mm512_fmadd_ps(sc.dlo, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), _mm512_setzero_ps());
    const __m512 hi = _mm512_fmadd_ps(sc.dhi, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))),
                                      _mm512_setzero_ps());
    return _mm512_cvtne2ps_pbh(hi, lo);
  }
  const uint16_t* operator()(int64_t t, uint16_t* dst) const { return expand<Q8Panels>(blocks(t), K, dst); }
};

// One panel's blocks -> the bf16 panel layout in dst (a thread-local scratch): for calls with many rows, which
// then read each expanded step once per 8-row tile.
template <class Src>
const uint16_t* expand(const uint8_t* src, int64_t K, uint16_t* dst) {
  for (int64_t b = 0; b < K / QK; ++b)
    for (int64_t g = 0; g < GROUPS; ++g) {
      const uint8_t* grp = src + (b * GROUPS + g) * Src::GROUP;
      const typename Src::Scales sc = Src::scales(grp);
      for (int64_t s = 0; s < 16; ++s)
        _mm512_storeu_si512(dst + ((b * 16 + s) * NR + g * 16) * 2, (__m512i)Src::step(grp, sc, s));
    }
  return dst;
}

// Decode-shaped calls (R <= MR_SMALL rows): the tile of one panel straight from its blocks, each step's weights
// expanded in registers and used at once -- no scratch written and read back, and the 3 groups' expansions give
// the out-of-order core independent work beside the R x 3 accumulator chains (a 1-row tile over the scratch waited
// on 3 chains of K/2 dependent vdpbf16ps; with the expansion that made a 1-token step 1.4x fp32's). Per element:
// the same weights (Src::step is what expand() stores), the same K/2 steps in the same order: tile<>'s bits.
template <class Src, int R>
inline void tile_blocks(const uint16_t* __restrict xb, int64_t Kp, const uint8_t* __restrict src, float* __restrict out,
                        int64_t N, int64_t n0, int64_t m0) {
  __m512 acc[R][GROUPS];
  for (int i = 0; i < R; ++i)
    for (int g = 0; g < GROUPS; ++g) acc[i][g] = _mm512_setzero_ps();
  const int64_t KB = Kp / QK;
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* blk = src + b * GROUPS * Src::GROUP;
    for (int64_t o = 0; o < GROUPS * Src::GROUP; o += 64) dspine::prefetch(blk + PF_BLOCKS * GROUPS * Src::GROUP + o);
    typename Src::Scales sc[GROUPS];
    for (int g = 0; g < GROUPS; ++g) sc[g] = Src::scales(blk + g * Src::GROUP);
    for (int64_t s = 0; s < 16; ++s) {
      __m512bh a[R];
      for (int i = 0; i < R; ++i) {
        int32_t pair;
        std::memcpy(&pair, xb + (m0 + i) * Kp + b * QK + 2 * s, 4);
        a[i] = (__m512bh)_mm512_set1_epi32(pair);
      }
      for (int g = 0; g < GROUPS; ++g) {
        const __m512bh w = Src::step(blk + g * Src::GROUP, sc[g], s);
        for (int i = 0; i < R; ++i) acc[i][g] = _mm512_dpbf16_ps(acc[i][g], a[i], w);
      }
    }
  }
  store_tile<R>(acc, out, N, n0, m0);
}

// One block's R-row tile over its 16 expanded steps (wb: [16][NR][2] bf16 in L1), its accumulators carried from block
// to block in acc (R x NR floats: a store and a load give an fp32 back unchanged) and written to out after the last
// block. Per element: the panel's weights and the K/2 steps in order, each one vdpbf16ps: tile<>'s bits.
template <int R>
inline void block_tile(const uint16_t* __restrict xb, int64_t Kp, const uint16_t* __restrict wb, int64_t b,
                       float* __restrict acc_mem, bool first, bool last, float* __restrict out, int64_t N, int64_t n0,
                       int64_t m0) {
  __m512 acc[R][GROUPS];
  for (int i = 0; i < R; ++i)
    for (int g = 0; g < GROUPS; ++g)
      acc[i][g] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_mem + i * NR + 16 * g);
  for (int64_t s = 0; s < 16; ++s) {
    const uint16_t* wp = wb + s * NR * 2;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wp + 64);
    for (int i = 0; i < R; ++i) {
      int32_t pair;
      std::memcpy(&pair, xb + (m0 + i) * Kp + b * QK + 2 * s, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, w0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, w1);
      acc[i][2] = _mm512_dpbf16_ps(acc[i][2], a, w2);
    }
  }
  if (!last) {
    for (int i = 0; i < R; ++i)
      for (int g = 0; g < GROUPS; ++g) _mm512_storeu_ps(acc_mem + i * NR + 16 * g, acc[i][g]);
    return;
  }
  store_tile<R>(acc, out, N, n0, m0);
}

// Rows [m0, m1) (more than one register tile) of one panel straight from its blocks: each block's 16 steps are
// expanded once into a 3 KB buffer (L1) and every row tile runs them from there, its accumulators kept in an L1/L2
// array between blocks. Why (the verify-shaped M = 9-64 calls): expanding the whole panel into an L2 scratch and
// reading it back per tile, with a 1-row remainder tile waiting on 3 chains of K/2 dependent vdpbf16ps, made a
// 9-row call 2x an 8-row one; here the blocks are expanded once for all rows, the tiles are balanced (heights
// MR/2..MR) and the weights never leave L1. Same weights and steps per element as tile<>: the same bits.
template <class Src>
void rows_blocks(const uint16_t* xb, int64_t Kp, const uint8_t* src, float* out, int64_t N, int64_t n0, int64_t m0,
                 int64_t m1, std::vector<float>& acc_mem) {
  alignas(64) uint16_t wb[16 * NR * 2];
  const int64_t rows = m1 - m0, tiles = (rows + MR - 1) / MR, KB = Kp / QK;
  if (acc_mem.size() < static_cast<size_t>(rows * NR)) acc_mem.resize(rows * NR);
  for (int64_t b = 0; b < KB; ++b) {
    const uint8_t* blk = src + b * GROUPS * Src::GROUP;
    for (int64_t o = 0; o < GROUPS * Src::GROUP; o += 64) dspine::prefetch(blk + PF_BLOCKS * GROUPS * Src::GROUP + o);
    for (int64_t g = 0; g < GROUPS; ++g) {
      const uint8_t* grp = blk + g * Src::GROUP;
      const typename Src::Scales sc = Src::scales(grp);
      for (int64_t s = 0; s < 16; ++s) _mm512_store_si512(wb + (s * NR + g * 16) * 2, (__m512i)Src::step(grp, sc, s));
    }
    for (int64_t i = 0; i < tiles; ++i) {
      const int64_t r0 = rows * i / tiles, r1 = rows * (i + 1) / tiles;
      float* am = acc_mem.data() + r0 * NR;
      switch (r1 - r0) {
#define DSPINE_TILE(r)                                                                      \
  case r:                                                                                   \
    block_tile<r>(xb, Kp, wb, b, am, b == 0, b == KB - 1, out, N, n0, m0 + r0);             \
    break;
        DSPINE_TILE(1)
        DSPINE_TILE(2)
        DSPINE_TILE(3)
        DSPINE_TILE(4)
        DSPINE_TILE(5)
        DSPINE_TILE(6)
        DSPINE_TILE(7)
        DSPINE_TILE(8)
#undef DSPINE_TILE
        default:
          break;
      }
    }
  }
}

#include "amx_bf16.h"

template <class Src>
at::Tensor run(const at::Tensor& x, const at::Tensor& packed, int64_t N, bool blocks) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "linear_bf16dp: expected a 2-D float32 input");
  const int64_t M = x.size(0), K = x.size(1), Kp = round_up(K, 2), Np = round_up(N, NR);
  TORCH_CHECK(!blocks || K % QK == 0, "linear_bf16dp: GGUF blocks need K % 32 == 0");
  TORCH_CHECK(packed.nbytes() == static_cast<size_t>(Src::bytes(Np, Kp)),
              "linear_bf16dp: packed weight does not match N, K");
  auto xc = x.contiguous();
  if (M == 0 || N == 0) return at::empty({M, N}, xc.options());
#ifdef DSPINE_HAS_AMX
  if (amx_on.load(std::memory_order_relaxed))
    return run_amx<Src>(xc, Src{reinterpret_cast<decltype(Src::pp)>(packed.data_ptr()), K}, N);
#endif
  auto out = at::empty({M, N}, xc.options());
  auto xb = at::empty({M * Kp}, xc.options().dtype(at::kBFloat16));
  uint16_t* xbp = reinterpret_cast<uint16_t*>(xb.data_ptr());
  to_bf16(xc.data_ptr<float>(), M, K, Kp, xbp);
  const Src src{reinterpret_cast<decltype(Src::pp)>(packed.data_ptr()), K};
  float* op = out.data_ptr<float>();
  const int64_t panels = Np / NR;
  // Work items are (row chunk, panel) with the panel index fastest, pulled one at a time by the threads
  // (sched.h): for a few rows (decode) the threads share the panels, for a prompt a thread's consecutive items
  // reuse a row chunk's inputs from its L2. Which thread runs an item never changes its bits.
  if (M <= MR_SMALL) {
    // Decode-shaped: each thread takes one contiguous share of the panels, as linear.cpp's decode does (one
    // stream per thread that the hardware prefetcher follows; panels pulled one at a time ran a 1-row step 15-25 %
    // slower). Block formats run tile_blocks<> straight from the blocks, bf16 panels tile<>.
    at::parallel_for(0, panels, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        switch (M) {
#define DSPINE_SMALL(r)                                                  \
  case r:                                                                \
    if constexpr (std::is_same_v<Src, Panels>)                           \
      tile<r>(xbp, Kp, src(t, nullptr), op, N, t * NR, 0);               \
    else                                                                 \
      tile_blocks<Src, r>(xbp, Kp, src.blocks(t), op, N, t * NR, 0);     \
    break;
          DSPINE_SMALL(1)
          DSPINE_SMALL(2)
          DSPINE_SMALL(3)
          DSPINE_SMALL(4)
          DSPINE_SMALL(5)
          DSPINE_SMALL(6)
          DSPINE_SMALL(7)
          DSPINE_SMALL(8)
#undef DSPINE_SMALL
          default:
            break;
        }
      }
    });
    return out;
  }
  const int64_t chunks = (M + MC - 1) / MC, items = chunks * panels;
  if constexpr (!std::is_same_v<Src, Panels>) {
    if (M <= M_BLOCKWISE) {  // verify-shaped: blockwise expansion (rows_blocks<>), decode's static split of the panels
      at::parallel_for(0, panels, 1, [&](int64_t t0, int64_t t1) {
        std::vector<float> acc;
        for (int64_t t = t0; t < t1; ++t) rows_blocks<Src>(xbp, Kp, src.blocks(t), op, N, t * NR, 0, M, acc);
      });
      return out;
    }
  }
  dspine::parallel_pull(items, [&](auto& pull) {
    // one expanded panel (K * 96 bytes: L2), kept per thread across calls (no allocation or clearing per call)
    thread_local std::vector<uint16_t> scratch;
    if (blocks && scratch.size() < static_cast<size_t>(Kp * NR)) scratch.resize(Kp * NR);
    for (int64_t item; (item = pull()) < items;) {
      const int64_t c = item / panels, t = item % panels;
      const int64_t m1 = std::min(M, (c + 1) * MC);
      const uint16_t* panel = src(t, scratch.data());
      int64_t m = c * MC;
      for (; m + MR <= m1; m += MR) tile<MR>(xbp, Kp, panel, op, N, t * NR, m);
      switch (m1 - m) {  // the remainder rows: a shorter tile, the same per-element step sequence
#define DSPINE_REST(r) \
  case r:              \
    tile<r>(xbp, Kp, panel, op, N, t * NR, m); \
    break;
        DSPINE_REST(1)
        DSPINE_REST(2)
        DSPINE_REST(3)
        DSPINE_REST(4)
        DSPINE_REST(5)
        DSPINE_REST(6)
        DSPINE_REST(7)
#undef DSPINE_REST
        default:
          break;
      }
    }
  });
  return out;
}

at::Tensor linear_bf16dp(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  return run<Panels>(x, packed, N, false);
}
at::Tensor linear_bf16dp_q4_1(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  return run<Q4Panels>(x, packed, N, true);
}
at::Tensor linear_bf16dp_q8_0(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  return run<Q8Panels>(x, packed, N, true);
}
#pragma GCC pop_options

bool has_bf16dp() { return __builtin_cpu_supports("avx512bf16"); }
#else
at::Tensor linear_bf16dp(const at::Tensor&, const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "linear_bf16dp: this build (" DSPINE_ISA ") has no AVX512-BF16 kernels");
}
at::Tensor linear_bf16dp_q4_1(const at::Tensor& x, const at::Tensor& p, int64_t n) { return linear_bf16dp(x, p, n); }
at::Tensor linear_bf16dp_q8_0(const at::Tensor& x, const at::Tensor& p, int64_t n) { return linear_bf16dp(x, p, n); }
bool has_bf16dp() { return false; }
#endif
// bf16_amx(want): the bf16 family on AMX tiles (amx_bf16.h) from now on when `want` and this process may use them
// (the CPU has AMX-BF16 and Linux granted the tile state), else on AVX512-BF16; returns which one runs.
bool bf16_amx(bool want) {
#ifdef DSPINE_HAS_AMX
  static const bool granted = request_amx();
  amx_on.store(want && granted);
  return amx_on.load();
#else
  (void)want;
  return false;
#endif
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(dspine_cpu, m) {
  m.def("pack_bf16dp(Tensor w) -> Tensor");
  m.def("linear_bf16dp(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("pack_bf16dp_q4_1(Tensor q, Tensor d, Tensor m) -> Tensor");
  m.def("pack_bf16dp_q8_0(Tensor q, Tensor d) -> Tensor");
  m.def("linear_bf16dp_q4_1(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("linear_bf16dp_q8_0(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("has_bf16dp() -> bool", &has_bf16dp);
  m.def("bf16_amx(bool want) -> bool", &bf16_amx);
}

TORCH_LIBRARY_IMPL(dspine_cpu, CPU, m) {
  m.impl("pack_bf16dp", &pack_bf16dp);
  m.impl("linear_bf16dp", &linear_bf16dp);
  m.impl("pack_bf16dp_q4_1", &pack_bf16dp_q4_1);
  m.impl("pack_bf16dp_q8_0", &pack_bf16dp_q8_0);
  m.impl("linear_bf16dp_q4_1", &linear_bf16dp_q4_1);
  m.impl("linear_bf16dp_q8_0", &linear_bf16dp_q8_0);
}
