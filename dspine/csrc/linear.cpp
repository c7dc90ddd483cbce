// Decode-shaped fp32 linear layers on the CPU: y[M, N] = x[M, K] @ W[N, K]^T for a few rows M.
//
// Why (docs/design.md, "The CPU step"): a small model's decode step reads every weight once per token, with
// 1-32 rows of activations. MKL's sgemm/sgemv reach 5-10 GB/s on those shapes on our 2-core machines (the
// weights stream from DRAM at 20-40 GB/s): each of the ~200 small matrices of a step starts cold and the
// library's blocking is made for large M. Here the weights are repacked once at load so that each group of
// NB output rows is one contiguous stream ([N/NB][K/VL][NB][VL]), and every weight vector loaded is used for
// all M rows before the next one is read, so the step costs about one pass over the weights for any M up to
// a few dozen rows.
//
// Batch invariance: out[m, n] is accumulated in the same order whatever M, the row's position in the batch
// and the tile that computes it (VL partial sums over k, then a fixed horizontal reduction), so a row's
// logits do not depend on what else is in the forward. A 1-row decode step and a 4-row verify produce
// bit-identical values for the same inputs.
//
// ISA: AVX-512F (VL 16), AVX2+FMA (VL 8) or portable C++ (VL 8), chosen by the compiler flags the Python side
// builds with (dspine/kernels.py), never by -march=native, so a build runs on every CPU with that ISA.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#define DSPINE_ISA "avx512"
namespace {
constexpr int VL = 16;
constexpr int MB_MAX = 6;  // 24 accumulators + 4 weight vectors + 1 input vector of 32 zmm registers
typedef __m512 vec;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vec v) {
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
}  // namespace
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DSPINE_ISA "avx2"
namespace {
constexpr int VL = 8;
constexpr int MB_MAX = 2;  // 8 accumulators + 4 weight vectors + 1 input vector of 16 ymm registers
typedef __m256 vec;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vec v) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
}  // namespace
#else
#define DSPINE_ISA "generic"
namespace {
constexpr int VL = 8;
constexpr int MB_MAX = 2;
typedef float vec __attribute__((vector_size(VL * sizeof(float))));
inline vec vzero() { return vec{}; }
inline vec vload(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline vec vfma(vec a, vec b, vec c) { return a * b + c; }
inline float vsum(vec v) {
  float t[VL];
  std::memcpy(t, &v, sizeof(v));
  for (int w = VL / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) t[i] += t[i + w];
  return t[0];
}
inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }
}  // namespace
#endif

namespace {
constexpr int NB = 4;          // output rows per tile (one contiguous weight stream)
constexpr int64_t M_CHUNK = 96;  // rows per pass over the weights (keeps the input rows in L2 for prefill)
constexpr int PREFETCH_TILES = 4;

inline int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

// W [N, K] (float) -> packed [round_up(N, NB) * round_up(K, VL)] (zero padded).
at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "pack: expected a 2-D float32 weight");
  auto wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1);
  const int64_t Np = round_up(N, NB), Kp = round_up(K, VL), KV = Kp / VL;
  auto out = at::zeros({Np * Kp}, wc.options());
  const float* src = wc.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t t = n / NB, j = n % NB;
      for (int64_t k = 0; k < K; ++k) dst[((t * KV + k / VL) * NB + j) * VL + k % VL] = src[n * K + k];
    }
  });
  return out;
}

// out[m0 + i, n + j] for i < MB, j < NB (j clipped to N): one tile; pf = the weights of a later tile to
// prefetch while this one computes (only on the first pass over a tile's rows).
template <int MB>
inline void tile(const float* __restrict x, int64_t Kp, const float* __restrict p, float* __restrict out,
                 int64_t N, int64_t n, int64_t m0, const float* pf) {
  vec acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = vzero();
  const int64_t KV = Kp / VL;
  for (int64_t kk = 0; kk < KV; ++kk) {
    const float* wk = p + kk * NB * VL;
    const vec w0 = vload(wk), w1 = vload(wk + VL), w2 = vload(wk + 2 * VL), w3 = vload(wk + 3 * VL);
    if (pf != nullptr) {
      const char* q = reinterpret_cast<const char*>(pf + kk * NB * VL);
      for (int b = 0; b < NB * VL * 4; b += 64) prefetch(q + b);
    }
    for (int i = 0; i < MB; ++i) {
      const vec xv = vload(x + (m0 + i) * Kp + kk * VL);
      acc[i][0] = vfma(xv, w0, acc[i][0]);
      acc[i][1] = vfma(xv, w1, acc[i][1]);
      acc[i][2] = vfma(xv, w2, acc[i][2]);
      acc[i][3] = vfma(xv, w3, acc[i][3]);
    }
  }
  const int jn = N - n < NB ? static_cast<int>(N - n) : NB;
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < jn; ++j) out[(m0 + i) * N + n + j] = vsum(acc[i][j]);
}

template <int MB>
inline void rows_tile(const float* x, int64_t Kp, const float* p, float* out, int64_t N, int64_t n, int64_t m0,
                      int64_t m1, const float* pf) {
  int64_t m = m0;
  for (; m + MB <= m1; m += MB, pf = nullptr) tile<MB>(x, Kp, p, out, N, n, m, pf);
  switch (m1 - m) {  // the remainder, in one tile of its own height (same per-element order)
#define DSPINE_REST(r) \
  case r:              \
    if constexpr (r < MB) tile<r>(x, Kp, p, out, N, n, m, pf); \
    break;
    DSPINE_REST(1)
    DSPINE_REST(2)
    DSPINE_REST(3)
    DSPINE_REST(4)
    DSPINE_REST(5)
#undef DSPINE_REST
    default:
      break;
  }
}

// x [M, K] float, packed from pack(W [N, K]) -> [M, N]
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "linear: expected a 2-D float32 input");
  const int64_t M = x.size(0), K = x.size(1), Kp = round_up(K, VL), Np = round_up(N, NB);
  TORCH_CHECK(packed.numel() == Np * Kp, "linear: packed weight does not match N and K");
  at::Tensor xc = x.contiguous();
  if (Kp != K) xc = at::constant_pad_nd(xc, {0, Kp - K}, 0.0);
  auto out = at::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return out;
  const float* xp = xc.data_ptr<float>();
  const float* pp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t tiles = Np / NB;
  const int64_t grain = std::max<int64_t>(1, 8192 / Kp);  // ~32 KB of weights per task at least
  for (int64_t c0 = 0; c0 < M; c0 += M_CHUNK) {
    const int64_t c1 = std::min(M, c0 + M_CHUNK);
    at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const float* p = pp + t * NB * Kp;
        const float* pf = t + PREFETCH_TILES < t1 ? p + PREFETCH_TILES * NB * Kp : nullptr;
        rows_tile<MB_MAX>(xp, Kp, p, op, N, t * NB, c0, c1, pf);
      }
    });
  }
  return out;
}

std::string isa() { return DSPINE_ISA; }
}  // namespace

TORCH_LIBRARY(dspine_cpu, m) {
  m.def("pack_linear(Tensor w) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("isa() -> str", &isa);
}

TORCH_LIBRARY_IMPL(dspine_cpu, CPU, m) {
  m.impl("pack_linear", &pack);
  m.impl("linear", &linear);
}
