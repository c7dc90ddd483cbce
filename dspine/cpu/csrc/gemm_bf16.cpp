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

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

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

#if defined(__AVX512F__)
#pragma GCC push_options
#pragma GCC target("avx512bf16")

constexpr int MR = 8;         // rows per register tile
constexpr int64_t MC = 192;   // rows per pass over a panel (their bf16 inputs stay in L2 while it is read)

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
  const int64_t cols = std::min<int64_t>(NR, N - n0);
  for (int v = 0; v < 3; ++v) {
    const int64_t left = cols - 16 * v;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    for (int i = 0; i < R; ++i) _mm512_mask_storeu_ps(out + (m0 + i) * N + n0 + 16 * v, mask, acc[i][v]);
  }
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

at::Tensor linear_bf16dp(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "linear_bf16dp: expected a 2-D float32 input");
  const int64_t M = x.size(0), K = x.size(1), Kp = round_up(K, 2), Np = round_up(N, NR);
  TORCH_CHECK(packed.nbytes() == static_cast<size_t>(Np * Kp * 2), "linear_bf16dp: packed weight does not match N, K");
  auto xc = x.contiguous();
  auto out = at::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return out;
  auto xb = at::empty({M * Kp}, xc.options().dtype(at::kBFloat16));
  uint16_t* xbp = reinterpret_cast<uint16_t*>(xb.data_ptr());
  to_bf16(xc.data_ptr<float>(), M, K, Kp, xbp);
  const uint16_t* pp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  float* op = out.data_ptr<float>();
  const int64_t panels = Np / NR, panel_elems = Kp * NR;
  // Work items are (row chunk, panel) with the panel index fastest, pulled one at a time by the threads
  // (sched.h): for a few rows (decode) the threads share the panels, for a prompt a thread's consecutive items
  // reuse a row chunk's inputs from its L2. Which thread runs an item never changes its bits.
  const int64_t chunks = (M + MC - 1) / MC, items = chunks * panels;
  dspine::parallel_pull(items, [&](auto& pull) {
    for (int64_t item; (item = pull()) < items;) {
      const int64_t c = item / panels, t = item % panels;
      const int64_t m1 = std::min(M, (c + 1) * MC);
      const uint16_t* panel = pp + t * panel_elems;
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
#pragma GCC pop_options

bool has_bf16dp() { return __builtin_cpu_supports("avx512bf16"); }
#else
at::Tensor linear_bf16dp(const at::Tensor&, const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "linear_bf16dp: this build (" DSPINE_ISA ") has no AVX512-BF16 kernels");
}
bool has_bf16dp() { return false; }
#endif
}  // namespace

TORCH_LIBRARY_FRAGMENT(dspine_cpu, m) {
  m.def("pack_bf16dp(Tensor w) -> Tensor");
  m.def("linear_bf16dp(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("has_bf16dp() -> bool", &has_bf16dp);
}

TORCH_LIBRARY_IMPL(dspine_cpu, CPU, m) {
  m.impl("pack_bf16dp", &pack_bf16dp);
  m.impl("linear_bf16dp", &linear_bf16dp);
}
