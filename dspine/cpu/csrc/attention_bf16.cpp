// Attention over a bf16 KV cache with bf16 dot products (AVX512-BF16 `vdpbf16ps`): the bf16 policy's attention.
//
// Why (issue 26): with the linears at torch's bf16 GEMM rate, attention over the cache was ~45 % of a 1,400-token
// prompt. attend_cache (ops.cpp) widens every bf16 key and value to fp32 and runs the fp32 path's FMAs: 4 FMAs a
// key and query head for the scores and 4 for the weighted sum (head_dim 64), plus the conversions. Here the
// products are bf16 x bf16 (exact in fp32) summed in fp32 by `vdpbf16ps`, two per lane and instruction, and the
// keys and values are read as they are stored.
//
// Precision: the query is split into two bf16 parts, hi = bf16(q) and lo = bf16(q - hi) (q = hi + lo to ~2^-17),
// both dotted with each key, so the scores are as good as fp32's over the same bf16 keys; the softmax weights
// p_j = exp(s_j - max) / sum are rounded to bf16 once (after the fp32 normalisation). Max, exp, the sum and every
// accumulation stay fp32. Measured against fp32 (scripts/bench/bench_precision.py, BENCHMARKS.md "Precision"): the
// same next-token agreement and KL as the fp32-order attention over the bf16 cache; rounding the query too (one
// part) raised the KL ~10 %, splitting the weights as well cost 35 % of the speed for no measurable gain.
// dtype=float32 never comes here.
//
// Batch invariance by construction: a query's result is a function of its own q, its position and the cache rows
// it sees, computed in an order fixed by head_dim and by its key count n alone:
//   - score of key j: one accumulator of 16 lanes, per 32 dims `vdpbf16ps` with hi then with lo, in order, then the
//     vsum tree (vsum16 makes vsum's additions for 16 keys at once, bit for bit);
//   - max, exp and their sum as ops.cpp's (exp_shifted's order: 16-key blocks, then the tail);
//   - output lane d: one accumulator over key pairs (lo, lo + 1), (lo + 2, lo + 3), ... in order, one
//     `vdpbf16ps` each (an odd last key pairs with a zero weight and a zero row).
// Nothing depends on how many queries share the call, their order, the work item or thread that computes them,
// so a row gives the same bits alone, batched, chunked, after a prefix-cache hit, as a decode step or in a verify.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "attend_items.h"
#include "vec.h"

namespace {

#if defined(__AVX512F__)
#pragma GCC push_options
#pragma GCC target("avx512bf16")

// 16 bf16 -> fp32 (exact)
inline __m512 widen16(__m256bh h) {
  __m256i bits;
  std::memcpy(&bits, &h, 32);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// q [D] fp32 -> its bf16 rounding hi and the rounding of what that leaves, lo (q = hi + lo to ~2^-17): DB vectors
// of 32 bf16 each (element e of vector x is for q[32 x + e], as a key row's 32 values are)
template <int DB>
inline void query_bf16(const float* q, __m512bh* hi, __m512bh* lo) {
  for (int x = 0; x < DB; ++x) {
    const __m512 a = _mm512_loadu_ps(q + 32 * x), b = _mm512_loadu_ps(q + 32 * x + 16);
    hi[x] = _mm512_cvtne2ps_pbh(b, a);
    const __m512 ah = widen16(_mm512_cvtneps_pbh(a)), bh = widen16(_mm512_cvtneps_pbh(b));  // hi's values in fp32
    lo[x] = _mm512_cvtne2ps_pbh(_mm512_sub_ps(b, bh), _mm512_sub_ps(a, ah));  // a - ah: exact
  }
}

// w[j] = sc * (q . K[lo + j]) for j < n: per key one 16-lane accumulator, DB dot-product steps, the vsum tree.
template <int DB>
inline void scores(const __m512bh* qh, const __m512bh* ql, const uint16_t* K, int64_t lo, int64_t n, float sc,
                   float* w) {
  constexpr int D = 32 * DB;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const uint16_t* kr = K + (lo + j) * D;
    dspine::vec acc[16];
    for (int jj = 0; jj < 16; ++jj) {
      acc[jj] = _mm512_setzero_ps();
      for (int x = 0; x < DB; ++x) {
        const __m512bh k = (__m512bh)_mm512_loadu_si512(kr + jj * D + 32 * x);
        acc[jj] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[jj], qh[x], k), ql[x], k);
      }
    }
    const dspine::vec s = _mm512_mul_ps(dspine::vsum16(acc), _mm512_set1_ps(sc));
    std::memcpy(w + j, &s, sizeof(s));
  }
  for (; j < n; ++j) {
    const uint16_t* kr = K + (lo + j) * D;
    dspine::vec acc = _mm512_setzero_ps();
    for (int x = 0; x < DB; ++x) {
      const __m512bh k = (__m512bh)_mm512_loadu_si512(kr + 32 * x);
      acc = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc, qh[x], k), ql[x], k);
    }
    w[j] = dspine::vsum(acc) * sc;
  }
}

// The softmax weights of scores w[0..n), rounded to bf16: pb[j] = bf16(exp(w[j] - max) / sum); pb[n] = 0 when n is
// odd (the weighted sum reads keys in pairs). w is overwritten with the exponentials.
inline void weights_bf16(float* w, int64_t n, uint16_t* pb) {
  const float mx = dspine::max_of(w, n);
  const float inv = 1.f / dspine::exp_shifted(w, n, mx);
  const __m512 iv = _mm512_set1_ps(inv);
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m512bh p = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(w + j + 16), iv),
                                           _mm512_mul_ps(_mm512_loadu_ps(w + j), iv));
    _mm512_storeu_si512(pb + j, (__m512i)p);
  }
  for (; j < n; ++j) {  // the same rounding one at a time (nearest even, as _mm512_cvtne2ps_pbh)
    const __m512 v = _mm512_set1_ps(w[j] * inv);
    const __m256bh h = _mm512_cvtneps_pbh(v);
    uint16_t tmp[16];
    std::memcpy(tmp, &h, 32);
    pb[j] = tmp[0];
  }
  if (n % 2) pb[n] = 0;
}

// o[r][d] = sum over key pairs of (p_j V[lo + j][d] + p_{j+1} V[lo + j + 1][d]) for RN heads, head r's weights at
// pb + r * stride: the two rows of a pair interleaved into (V[j][d], V[j+1][d]) lanes once, used by every head;
// outputs in registers.
template <int DB, int RN>
inline void weighted_values(const uint16_t* pb, int64_t stride, int64_t n, const uint16_t* V, int64_t lo,
                            float* const* o) {
  constexpr int D = 32 * DB, DO = 2 * DB;  // DO output vectors of 16 lanes
  // word 2l <- a[l], word 2l + 1 <- b[l]: lanes 0-15 of the first 16 d (lo) or of d 16-31 (hi)
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                  24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i il = _mm512_load_si512(lo_idx), ih = _mm512_load_si512(hi_idx);
  __m512 acc[RN][DO];
  for (int r = 0; r < RN; ++r)
    for (int y = 0; y < DO; ++y) acc[r][y] = _mm512_setzero_ps();
  auto pair = [&](const uint16_t* a, const uint16_t* b, int64_t j) {
    __m512bh v[DO];
    for (int x = 0; x < DB; ++x) {
      const __m512i A = _mm512_loadu_si512(a + 32 * x);
      const __m512i B = b != nullptr ? _mm512_loadu_si512(b + 32 * x) : _mm512_setzero_si512();
      v[2 * x] = (__m512bh)_mm512_permutex2var_epi16(A, il, B);
      v[2 * x + 1] = (__m512bh)_mm512_permutex2var_epi16(A, ih, B);
    }
    for (int r = 0; r < RN; ++r) {
      int32_t w2;
      std::memcpy(&w2, pb + r * stride + j, 4);
      const __m512bh p = (__m512bh)_mm512_set1_epi32(w2);
      for (int y = 0; y < DO; ++y) acc[r][y] = _mm512_dpbf16_ps(acc[r][y], p, v[y]);
    }
  };
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) pair(V + (lo + j) * D, V + (lo + j + 1) * D, j);
  if (j < n) pair(V + (lo + j) * D, nullptr, j);  // the odd last key: a zero row beside it, weight pb[n] = 0
  for (int r = 0; r < RN; ++r)
    for (int y = 0; y < DO; ++y) {
      const __m512 out = acc[r][y];
      std::memcpy(o[r] + 16 * y, &out, sizeof(out));
    }
}

// The rep query heads of one KV head for one query (keys lo .. lo + n - 1).
template <int DB>
void attend_query(const float* const* qv, float* const* o, int64_t rep, const uint16_t* K, const uint16_t* V,
                  int64_t lo, int64_t n, float sc, std::vector<float>& w, std::vector<uint16_t>& pb) {
  constexpr int RMAX = DB >= 4 ? 2 : 4;  // RMAX x 2 DB accumulators in registers
  const int64_t stride = n + 1;  // head r's weights at pb[r * stride]: n, and a zero after an odd n
  w.resize(n);
  pb.resize(rep * stride);
  for (int64_t r = 0; r < rep; ++r) {
    __m512bh qh[DB], ql[DB];
    query_bf16<DB>(qv[r], qh, ql);
    scores<DB>(qh, ql, K, lo, n, sc, w.data());
    weights_bf16(w.data(), n, pb.data() + r * stride);
  }
  for (int64_t r0 = 0; r0 < rep; r0 += RMAX) {
    const int64_t rn = std::min<int64_t>(RMAX, rep - r0);
    const uint16_t* p = pb.data() + r0 * stride;
    switch (rn) {
      case 1: weighted_values<DB, 1>(p, stride, n, V, lo, o + r0); break;
      case 2: weighted_values<DB, 2>(p, stride, n, V, lo, o + r0); break;
      case 3: if constexpr (RMAX >= 3) weighted_values<DB, 3>(p, stride, n, V, lo, o + r0); break;
      default: if constexpr (RMAX >= 4) weighted_values<DB, 4>(p, stride, n, V, lo, o + r0); break;
    }
  }
}

// q [B, T, Hq, D] fp32, kc/vc [B, Hkv, cap, D] bf16, pos [B, T]: as attend_cache (ops.cpp), for D = 32, 64 or 128.
at::Tensor attend_cache_bf16dp(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& pos,
                               int64_t window, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat, "attend_cache_bf16dp: float32 queries");
  TORCH_CHECK(kc.scalar_type() == at::kBFloat16 && vc.scalar_type() == at::kBFloat16 && kc.is_contiguous() &&
                  vc.is_contiguous(),
              "attend_cache_bf16dp: contiguous bfloat16 caches");
  const int64_t D = q.size(3);
  TORCH_CHECK(D == 32 || D == 64 || D == 128, "attend_cache_bf16dp: head_dim 32, 64 or 128");
  auto qc = q.contiguous();
  auto pp = pos.to(at::kLong).contiguous();
  auto out = at::empty({qc.size(0), qc.size(1), qc.size(2) * D}, qc.options());
  const float sc = static_cast<float>(scale);
  dspine::for_each_query<uint16_t>(qc, kc, vc, pp, window, out,
                                   [&](const float* const* qv, float* const* o, int64_t rep, const uint16_t* K,
                                       const uint16_t* V, int64_t lo, int64_t n) {
                                     thread_local std::vector<float> w;
                                     thread_local std::vector<uint16_t> pb;
                                     switch (D) {
                                       case 32: attend_query<1>(qv, o, rep, K, V, lo, n, sc, w, pb); break;
                                       case 64: attend_query<2>(qv, o, rep, K, V, lo, n, sc, w, pb); break;
                                       default: attend_query<4>(qv, o, rep, K, V, lo, n, sc, w, pb); break;
                                     }
                                   });
  return out;
}
#pragma GCC pop_options
#else
at::Tensor attend_cache_bf16dp(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                               double) {
  TORCH_CHECK(false, "attend_cache_bf16dp: this build (" DSPINE_ISA ") has no AVX512-BF16 kernels");
}
#endif
}  // namespace

TORCH_LIBRARY_FRAGMENT(dspine_cpu, m) {
  m.def("attend_cache_bf16dp(Tensor q, Tensor kc, Tensor vc, Tensor pos, int window, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(dspine_cpu, CPU, m) { m.impl("attend_cache_bf16dp", &attend_cache_bf16dp); }
