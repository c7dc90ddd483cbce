// The small per-layer operations of a decode step, fused: RMSNorm, RoPE + KV-cache store, attention over the
// cache, SiLU-gate.
//
// Why (docs/design.md, "The CPU step"): once the linears stream at memory speed (linear.cpp), what is left of
// a small model's CPU decode step is ~60 tiny torch ops per layer (norm: 8, rope: 14, masked attention: 10,
// ...), a few microseconds each, ~2,000 per step for a 30-layer model. Each op here replaces one such chain
// with one call. All are inference-only fp32 CPU functions; their results match the torch chains they
// replace to fp32 rounding (tests/cpu/test_kernels.py), and each output row depends only on its own inputs (a
// row's result does not depend on the rest of the batch).
//
// KV caches are float32 or bfloat16 (the bf16 policy stores K/V in bf16, half the memory): rope_store rotates in
// fp32 and rounds to bf16 (nearest even, as torch's .bfloat16()) only when it stores; attention loads bf16 keys
// and values into fp32 registers (exact) and runs the fp32 path's operations in the fp32 path's order, so its
// result over a bf16 cache is bit-identical to its result over that cache converted to fp32. (Where the bf16 family
// runs, dspine.cpu.kernels sends bf16 caches to attention_bf16.cpp instead: bf16 dot products, its own fixed order.)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "attend_items.h"
#include "sched.h"
#include "team.h"
#include "vec.h"

namespace {

void norm_rows(const float* xp, const float* wp, int64_t D, float e, float off, float* op, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* a = xp + r * D;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < D; ++i) ss += a[i] * a[i];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + e);
    float* o = op + r * D;
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) o[i] = a[i] * inv * (off + wp[i]);
  }
}

// x [..., D] -> x * rsqrt(mean(x^2) + eps) * (offset + w)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, double offset) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "rms_norm: float32 only");
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  const int64_t D = xc.size(-1), R = xc.numel() / std::max<int64_t>(D, 1);
  TORCH_CHECK(wc.numel() == D, "rms_norm: weight size");
  auto out = at::empty_like(xc);
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float off = static_cast<float>(offset), e = static_cast<float>(eps);
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) { norm_rows(xp, wp, D, e, off, op, r0, r1); });
  return out;
}

// Rotate-half RoPE on the first d dims of one head vector, in place: cos/sin [d] (duplicated halves).
inline void rotate(float* v, const float* c, const float* s, int64_t d) {
  const int64_t h = d / 2;
  for (int64_t i = 0; i < h; ++i) {
    const float a = v[i], b = v[i + h];
    v[i] = a * c[i] - b * s[i];
    v[i + h] = b * c[i + h] + a * s[i + h];
  }
}

// fp32 -> bfloat16 bits, round to nearest even (NaN -> 0x7FC0): the same bits as torch's .bfloat16(), so a
// cache stored here equals the fp32 computation's result rounded by torch (tests/cpu/test_kv_bf16.py).
inline uint16_t bf16_rne(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// One head vector into a cache slot of element type T (float: a copy; bf16: rounded).
inline void store_row(float* dst, const float* src, int64_t D) { std::copy(src, src + D, dst); }
inline void store_row(uint16_t* dst, const float* src, int64_t D) {
  for (int64_t i = 0; i < D; ++i) dst[i] = bf16_rne(src[i]);
}

// Token m = b * T + t at position p: its Hq query heads at q (rotated in place), its Hkv key and value heads at k / v
// (the key rotated) stored into the caches; tmp: D floats.
template <class T>
inline void rope_store_token(float* q, const float* k, const float* v, const float* c, const float* s, int64_t b,
                             int64_t p, T* kcp, T* vcp, int64_t Hq, int64_t Hkv, int64_t D, int64_t cap, int64_t d,
                             float* tmp) {
  for (int64_t h = 0; h < Hq; ++h) rotate(q + h * D, c, s, d);
  for (int64_t h = 0; h < Hkv; ++h) {
    T* kd = kcp + ((b * Hkv + h) * cap + p) * D;
    T* vd = vcp + ((b * Hkv + h) * cap + p) * D;
    std::copy(k + h * D, k + (h + 1) * D, tmp);
    rotate(tmp, c, s, d);  // in fp32 whatever the cache's type: the rounding happens once, at the store
    store_row(kd, tmp, D);
    store_row(vd, v + h * D, D);
  }
}

template <class T>
void rope_store_impl(float* qp, const float* kp, const float* vp, const float* cp, const float* sp,
                     const int64_t* pp_, T* kcp, T* vcp, int64_t B, int64_t T_, int64_t Hq, int64_t Hkv, int64_t D,
                     int64_t cap, int64_t d) {
  std::vector<float> tmp(D);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T_; ++t) {
      const int64_t m = b * T_ + t, p = pp_[m];
      TORCH_CHECK(p >= 0 && p < cap, "rope_store: position outside the cache");
      rope_store_token(qp + m * Hq * D, kp + m * Hkv * D, vp + m * Hkv * D, cp + m * d, sp + m * d, b, p, kcp, vcp, Hq,
                       Hkv, D, cap, d, tmp.data());
    }
}

// q [B, T, Hq, D] (rotated in place), k/v [B, T, Hkv, D], cos/sin [B, T, d], pos [B, T]:
// rotate q and k, store k and v into kc/vc [B, Hkv, cap, D] (float32 or bfloat16) at pos. Returns q.
at::Tensor rope_store(at::Tensor q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                      const at::Tensor& sin, at::Tensor kc, at::Tensor vc, const at::Tensor& pos) {
  TORCH_CHECK(q.is_contiguous() && kc.is_contiguous() && vc.is_contiguous(), "rope_store: contiguous q and caches");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "rope_store: float32 q");
  TORCH_CHECK(kc.scalar_type() == vc.scalar_type() &&
                  (kc.scalar_type() == at::kFloat || kc.scalar_type() == at::kBFloat16),
              "rope_store: float32 or bfloat16 caches, both the same");
  auto kk = k.to(at::kFloat).contiguous();
  auto vv = v.to(at::kFloat).contiguous();
  auto cc = cos.to(at::kFloat).contiguous();
  auto ss = sin.to(at::kFloat).contiguous();
  auto pp = pos.to(at::kLong).contiguous();
  const int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3), Hkv = kk.size(2);
  const int64_t cap = kc.size(2), d = cc.size(-1);
  if (kc.scalar_type() == at::kFloat)
    rope_store_impl(q.data_ptr<float>(), kk.data_ptr<float>(), vv.data_ptr<float>(), cc.data_ptr<float>(),
                    ss.data_ptr<float>(), pp.data_ptr<int64_t>(), kc.data_ptr<float>(), vc.data_ptr<float>(), B, T,
                    Hq, Hkv, D, cap, d);
  else
    rope_store_impl(q.data_ptr<float>(), kk.data_ptr<float>(), vv.data_ptr<float>(), cc.data_ptr<float>(),
                    ss.data_ptr<float>(), pp.data_ptr<int64_t>(), reinterpret_cast<uint16_t*>(kc.data_ptr()),
                    reinterpret_cast<uint16_t*>(vc.data_ptr()), B, T, Hq, Hkv, D, cap, d);
  return q;
}

// A cache row's values as fp32 (exact for bf16: a bfloat16 is the top half of a float).
inline dspine::vec kv_load(const float* p) { return dspine::vload(p); }
inline dspine::vec kv_load(const uint16_t* p) { return dspine::bf16s(p); }
inline float kv_at(const float* p, int64_t i) { return p[i]; }
inline float kv_at(const uint16_t* p, int64_t i) {
  const uint32_t b = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

template <class T>
inline float dot(const float* a, const T* b, int64_t D) {
  using namespace dspine;
  if (D % VL == 0) {
    vec acc = vzero();
    for (int64_t x = 0; x < D; x += VL) acc = vfma(vload(a + x), kv_load(b + x), acc);
    return vsum(acc);
  }
  float acc = 0.f;
  for (int64_t x = 0; x < D; ++x) acc += a[x] * kv_at(b, x);
  return acc;
}

// o[0..D) += a * v
template <class T>
inline void axpy(float* o, float a, const T* v, int64_t D) {
  using namespace dspine;
  if (D % VL == 0) {
    const vec av = vset(a);
    for (int64_t x = 0; x < D; x += VL) {
      vec r = vfma(av, kv_load(v + x), vload(o + x));
      std::memcpy(o + x, &r, sizeof(r));
    }
    return;
  }
  for (int64_t x = 0; x < D; ++x) o[x] += a * kv_at(v, x);
}

// float32 caches: T = float; bfloat16 caches: T = uint16_t (the bits), loaded into fp32 as they are read.
inline void check_caches(const at::Tensor& kc, const at::Tensor& vc) {
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous(), "attend_cache: contiguous caches");
  TORCH_CHECK(kc.scalar_type() == vc.scalar_type() &&
                  (kc.scalar_type() == at::kFloat || kc.scalar_type() == at::kBFloat16),
              "attend_cache: float32 or bfloat16 caches, both the same");
}

// The one-query-at-a-time loop attend_cache replaced, kept as the reference its tests compare against bit for
// bit: it defines the per-query order of operations (a dot per key, max, exp_shifted, then an axpy per key in
// key order).
template <class T>
at::Tensor attend_cache_ref_impl(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                                 const at::Tensor& pos, int64_t window, double scale) {
  auto qc = q.contiguous();
  auto pp = pos.to(at::kLong).contiguous();
  const int64_t B = qc.size(0), T_ = qc.size(1), Hq = qc.size(2), D = qc.size(3);
  const int64_t Hkv = kc.size(1), cap = kc.size(2), rep = Hq / Hkv;
  auto out = at::empty({B, T_, Hq * D}, qc.options());
  const float* qp = qc.data_ptr<float>();
  const T* kp = reinterpret_cast<const T*>(kc.data_ptr());
  const T* vp = reinterpret_cast<const T*>(vc.data_ptr());
  const int64_t* pos_ = pp.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * T_ * Hq, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> w;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t h = i % Hq, bt = i / Hq, b = bt / T_;
      const int64_t p = pos_[bt];
      const int64_t hi = std::min(p, cap - 1);
      const int64_t lo = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
      const float* qv = qp + i * D;
      const T* K = kp + (b * Hkv + h / rep) * cap * D;
      const T* V = vp + (b * Hkv + h / rep) * cap * D;
      float* o = op + i * D;
      std::fill(o, o + D, 0.f);
      if (hi < lo) continue;
      const int64_t n = hi - lo + 1;
      w.resize(n);
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        w[j] = dot(qv, K + (lo + j) * D, D) * sc;
        mx = std::max(mx, w[j]);
      }
      const float inv = 1.f / dspine::exp_shifted(w.data(), n, mx);
      for (int64_t j = 0; j < n; ++j) axpy(o, w[j] * inv, V + (lo + j) * D, D);
    }
  });
  return out;
}

at::Tensor attend_cache_ref(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& pos,
                            int64_t window, double scale) {
  check_caches(kc, vc);
  TORCH_CHECK(q.scalar_type() == at::kFloat, "attend_cache: float32 queries");
  if (kc.scalar_type() == at::kBFloat16) return attend_cache_ref_impl<uint16_t>(q, kc, vc, pos, window, scale);
  return attend_cache_ref_impl<float>(q, kc, vc, pos, window, scale);
}

// o[r] = sum over keys j of (p[r * n + j] * inv[r]) * V[lo + j], in key order, for RN query heads. RN and DV are
// compile-time so the RN x DV accumulators stay in registers (with a runtime head count the compiler kept them on
// the stack: a load and a store around every FMA, most of a prompt's attention time).
template <int DV, int RN, class T>
inline void weighted_values(const float* p, int64_t n, const float* inv, const T* V, int64_t lo, float* const* o) {
  using namespace dspine;
  constexpr int D = DV * VL;
  vec acc[RN][DV];
  for (int r = 0; r < RN; ++r)
    for (int x = 0; x < DV; ++x) acc[r][x] = vzero();
  for (int64_t j = 0; j < n; ++j) {
    const T* vr = V + (lo + j) * D;
    vec v[DV];
    for (int x = 0; x < DV; ++x) v[x] = kv_load(vr + x * VL);
    for (int r = 0; r < RN; ++r) {
      const vec a = vset(p[r * n + j] * inv[r]);
      for (int x = 0; x < DV; ++x) acc[r][x] = vfma(a, v[x], acc[r][x]);
    }
  }
  for (int r = 0; r < RN; ++r)
    for (int x = 0; x < DV; ++x) {
      const vec out = acc[r][x];  // a copy's address, not acc's: acc stays in registers
      std::memcpy(o[r] + x * VL, &out, sizeof(out));
    }
}

// Attention of the rep query heads sharing one KV head, for head_dim D = DV * VL, with the same operations in
// the same order per query as attend_cache_ref (so the bits are the same): each key and value row is loaded
// once for the rep queries instead of once per query, the rep outputs stay in registers over all keys instead
// of being loaded and stored per key, and the dots of consecutive keys are independent, so their FMA chains
// overlap. Why: on a 1,390-token prompt attention was ~20 % of prefill with the per-query loop.
template <int DV, class T>
void attend_group(const float* const* qv, float* const* o, int64_t rep, const T* K, const T* V, int64_t lo,
                  int64_t n, float sc, std::vector<float>& w) {
  using namespace dspine;
  constexpr int D = DV * VL;
  w.resize(rep * n);
  int64_t j = 0;
#ifdef DSPINE_HAS_VSUM16
  // 16 keys at a time: their 16 dot accumulators reduced together (vsum16: vsum's additions, bit for bit)
  for (; j + 16 <= n; j += 16) {
    const T* kr = K + (lo + j) * D;
    for (int64_t r = 0; r < rep; ++r) {
      vec q[DV], acc[16];
      for (int x = 0; x < DV; ++x) q[x] = vload(qv[r] + x * VL);
      for (int jj = 0; jj < 16; ++jj) {
        acc[jj] = vzero();
        for (int x = 0; x < DV; ++x) acc[jj] = vfma(q[x], kv_load(kr + jj * D + x * VL), acc[jj]);
      }
      const vec s = vsum16(acc) * vset(sc);
      std::memcpy(w.data() + r * n + j, &s, sizeof(s));
    }
  }
#endif
  for (; j < n; ++j) {
    const T* kr = K + (lo + j) * D;
    vec k[DV];
    for (int x = 0; x < DV; ++x) k[x] = kv_load(kr + x * VL);
    for (int64_t r = 0; r < rep; ++r) {
      vec acc = vzero();
      for (int x = 0; x < DV; ++x) acc = vfma(vload(qv[r] + x * VL), k[x], acc);
      w[r * n + j] = vsum(acc) * sc;
    }
  }
  // query heads whose outputs are held in registers at once (RMAX x DV accumulators)
  constexpr int RMAX = DV >= 16 ? 1 : DV >= 8 ? 2 : 4;
  for (int64_t r0 = 0; r0 < rep; r0 += RMAX) {
    const int64_t rn = std::min<int64_t>(RMAX, rep - r0);
    float inv[RMAX];
    for (int64_t r = 0; r < rn; ++r) {
      float* wr = w.data() + (r0 + r) * n;
      inv[r] = 1.f / dspine::exp_shifted(wr, n, dspine::max_of(wr, n));
    }
    const float* p = w.data() + r0 * n;
    switch (rn) {
      case 1: weighted_values<DV, 1>(p, n, inv, V, lo, o + r0); break;
      case 2: if constexpr (RMAX >= 2) weighted_values<DV, 2>(p, n, inv, V, lo, o + r0); break;
      case 3: if constexpr (RMAX >= 3) weighted_values<DV, 3>(p, n, inv, V, lo, o + r0); break;
      default: if constexpr (RMAX >= 4) weighted_values<DV, 4>(p, n, inv, V, lo, o + r0); break;
    }
  }
}

// One query's heads over their keys (for_each_query's query): attend_group at the head size's vector count.
template <class T>
struct Attend {
  int64_t D;
  float sc;
  void operator()(const float* const* qv, float* const* o, int64_t rep, const T* K, const T* V, int64_t lo,
                  int64_t n) const {
    thread_local std::vector<float> w;
    switch (D / dspine::VL) {
      case 2: attend_group<2>(qv, o, rep, K, V, lo, n, sc, w); break;
      case 4: attend_group<4>(qv, o, rep, K, V, lo, n, sc, w); break;
      case 8: attend_group<8>(qv, o, rep, K, V, lo, n, sc, w); break;
      default: attend_group<16>(qv, o, rep, K, V, lo, n, sc, w); break;
    }
  }
};

template <class T>
at::Tensor attend_cache_impl(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& pos,
                             int64_t window, double scale) {
  auto qc = q.contiguous();
  auto pp = pos.to(at::kLong).contiguous();
  const int64_t D = qc.size(3);
  auto out = at::empty({qc.size(0), qc.size(1), qc.size(2) * D}, qc.options());
  dspine::for_each_query<T>(qc, kc, vc, pp, window, out, Attend<T>{D, static_cast<float>(scale)});
  return out;
}

// q [B, T, Hq, D], kc/vc [B, Hkv, cap, D] (float32 or bfloat16), pos [B, T]: query (b, t) sees cache slots
// j <= pos[b, t] (and j > pos - window when window > 0). -> [B, T, Hq * D]. Each query's result depends on its
// own position and the cache only, never on the other queries of the call (the prefix cache and chunked prompts
// rely on it).
at::Tensor attend_cache(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& pos,
                        int64_t window, double scale) {
  using namespace dspine;
  check_caches(kc, vc);
  TORCH_CHECK(q.scalar_type() == at::kFloat, "attend_cache: float32 queries");
  const int64_t D = q.size(3);
  if (!dspine::team::attention_supported(D)) return attend_cache_ref(q, kc, vc, pos, window, scale);
  if (kc.scalar_type() == at::kBFloat16) return attend_cache_impl<uint16_t>(q, kc, vc, pos, window, scale);
  return attend_cache_impl<float>(q, kc, vc, pos, window, scale);
}

// The gate activations of ``act_mul``: a vector and a scalar form of one function. SiLU is x * sigmoid(x); GELU's
// tanh form is x * sigmoid(z) with z = 2 sqrt(2/pi) (x + 0.044715 x^3) (0.5 (1 + tanh(u)) = sigmoid(2u)), so both
// ride on the same exp.
struct Silu {
  static dspine::vec v(dspine::vec x) {
    using namespace dspine;
    return x / (vset(1.f) + vexp(vzero() - x));
  }
  static float s(float x) { return x / (1.f + std::exp(-x)); }
};
struct GeluTanh {
  static constexpr float c = 1.5957691216057308f, k = 0.044715f;  // 2 sqrt(2 / pi)
  static dspine::vec v(dspine::vec x) {
    using namespace dspine;
    const vec z = vset(c) * (x + vset(k) * x * x * x);
    return x / (vset(1.f) + vexp(vzero() - z));
  }
  static float s(float x) { return x / (1.f + std::exp(-(c * (x + k * x * x * x)))); }
};

// gu [..., 2I] = [gate, up] -> act(gate) * up [..., I]. Each position of a row takes one code path (vectors, then a
// scalar tail per row), so a token's bits do not depend on its batch: torch's elementwise loop computes a tensor's
// last elements, and each thread's, on a scalar path whose tanh rounds differently.
template <class Act>
void act_rows(const float* gp, int64_t I, float* op, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* a = gp + r * 2 * I;
    const float* u = a + I;
    float* o = op + r * I;
    int64_t i = 0;
    for (; i + dspine::VL <= I; i += dspine::VL) {
      const dspine::vec res = Act::v(dspine::vload(a + i)) * dspine::vload(u + i);
      std::memcpy(o + i, &res, sizeof(res));
    }
    for (; i < I; ++i) o[i] = Act::s(a[i]) * u[i];
  }
}

template <class Act>
at::Tensor act_mul(const at::Tensor& gu) {
  auto g = gu.contiguous();
  const int64_t I2 = g.size(-1), I = I2 / 2, R = g.numel() / std::max<int64_t>(I2, 1);
  auto sizes = g.sizes().vec();
  sizes.back() = I;
  auto out = at::empty(sizes, g.options());
  const float* gp = g.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) { act_rows<Act>(gp, I, op, r0, r1); });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gu) { return act_mul<Silu>(gu); }
at::Tensor gelu_tanh_mul(const at::Tensor& gu) { return act_mul<GeluTanh>(gu); }

// x [R, V] fp32 -> [R] int64, torch.argmax(x, -1)'s answer: the first NaN of a row that has one, else the first of
// its maxima (-0.0 and 0.0 equal). Why ours (issue 53): greedy rows take the argmax of every slot's logits, and
// torch's reduction runs at ~1.9 G floats/s on two AVX2 cores (0.21 ms a step at 8 rows x 49,152, 0.84 ms at 32:
// ~1 % of the step); two vector passes over a row (its maximum, then where it first occurs) take a sixth to an
// eighth of that (BENCHMARKS.md, issue 53, ninth session).
int64_t argmax_row(const float* a, int64_t V) {
  int64_t i = 0;
  bool nan = false;
#if defined(__AVX2__)
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 unordered = _mm256_setzero_ps();
  for (; i + 8 <= V; i += 8) {
    const __m256 v = _mm256_loadu_ps(a + i);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    m = _mm256_max_ps(v, m);  // the second operand where either is NaN: NaNs never enter m
  }
  nan = _mm256_movemask_ps(unordered) != 0;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float mx = lanes[0];
  for (int l = 1; l < 8; ++l) mx = lanes[l] > mx ? lanes[l] : mx;
#else
  float mx = -std::numeric_limits<float>::infinity();
#endif
  for (; i < V; ++i) {
    nan = nan || std::isnan(a[i]);
    mx = a[i] > mx ? a[i] : mx;
  }
  if (nan) {
    for (int64_t j = 0; j < V; ++j)
      if (std::isnan(a[j])) return j;
  }
  int64_t j = 0;
#if defined(__AVX2__)
  const __m256 target = _mm256_set1_ps(mx);
  for (; j + 8 <= V; j += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(a + j), target, _CMP_EQ_OQ));
    if (hit != 0) return j + __builtin_ctz(static_cast<unsigned>(hit));
  }
#endif
  for (; j < V; ++j)
    if (a[j] == mx) return j;
  return 0;  // a row of -inf only: its first
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0, "argmax_rows: a 2-D float32 input "
              "with at least one column");
  const auto xc = x.contiguous();
  const int64_t R = xc.size(0), V = xc.size(1);
  auto out = at::empty({R}, xc.options().dtype(at::kLong));
  const float* xp = xc.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row(xp + r * V, V);
  });
  return out;
}

}  // namespace

namespace dspine::team {
void rms_norm_rows(const float* x, const float* w, int64_t D, float eps, float offset, float* out, int64_t r0,
                   int64_t r1) {
  norm_rows(x, w, D, eps, offset, out, r0, r1);
}
void silu_rows(const float* gu, int64_t I, float* out, int64_t r0, int64_t r1) { act_rows<Silu>(gu, I, out, r0, r1); }
template <class T>
void rope_rows(float* qkv, const float* cos, const float* sin, const int64_t* pos, T* kc, T* vc, int64_t T_,
               int64_t Hq, int64_t Hkv, int64_t D, int64_t cap, int64_t d, int64_t m0, int64_t m1) {
  const int64_t stride = (Hq + 2 * Hkv) * D;
  std::vector<float> tmp(D);
  for (int64_t m = m0; m < m1; ++m) {
    float* q = qkv + m * stride;
    rope_store_token(q, q + Hq * D, q + (Hq + Hkv) * D, cos + m * d, sin + m * d, m / T_, pos[m], kc, vc, Hq, Hkv,
                     D, cap, d, tmp.data());
  }
}
void rope_store_rows(float* qkv, const float* cos, const float* sin, const int64_t* pos, float* kc, float* vc,
                     int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t cap, int64_t d, int64_t m0, int64_t m1) {
  rope_rows(qkv, cos, sin, pos, kc, vc, T, Hq, Hkv, D, cap, d, m0, m1);
}
void rope_store_rows(float* qkv, const float* cos, const float* sin, const int64_t* pos, uint16_t* kc, uint16_t* vc,
                     int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t cap, int64_t d, int64_t m0, int64_t m1) {
  rope_rows(qkv, cos, sin, pos, kc, vc, T, Hq, Hkv, D, cap, d, m0, m1);
}
bool attention_supported(int64_t D) {  // Attend's head sizes (attend_cache: the reference loop for others)
  return D % dspine::VL == 0 && (D / dspine::VL == 2 || D / dspine::VL == 4 || D / dspine::VL == 8 ||
                                 D / dspine::VL == 16);
}
template <class C>
void attend_items(const float* qkv, const C* kc, const C* vc, const int64_t* pos, int64_t B, int64_t T, int64_t Hq,
                  int64_t Hkv, int64_t D, int64_t cap, int64_t window, float scale, float* out,
                  std::atomic<int64_t>& next) {
  auto pull = [&next]() { return next.fetch_add(1, std::memory_order_relaxed); };
  dspine::run_query_items<C>(qkv, (Hq + 2 * Hkv) * D, kc, vc, pos, B, T, Hq, Hkv, D, cap, window, out, pull,
                             Attend<C>{D, scale});
}
void attend_rows(const float* qkv, const float* kc, const float* vc, const int64_t* pos, int64_t B, int64_t T,
                 int64_t Hq, int64_t Hkv, int64_t D, int64_t cap, int64_t window, float scale, float* out,
                 std::atomic<int64_t>& next) {
  attend_items(qkv, kc, vc, pos, B, T, Hq, Hkv, D, cap, window, scale, out, next);
}
void attend_rows(const float* qkv, const uint16_t* kc, const uint16_t* vc, const int64_t* pos, int64_t B, int64_t T,
                 int64_t Hq, int64_t Hkv, int64_t D, int64_t cap, int64_t window, float scale, float* out,
                 std::atomic<int64_t>& next) {
  attend_items(qkv, kc, vc, pos, B, T, Hq, Hkv, D, cap, window, scale, out, next);
}
}  // namespace dspine::team

TORCH_LIBRARY_FRAGMENT(dspine_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps, float offset) -> Tensor");
  m.def("rope_store(Tensor(a!) q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(b!) kc, Tensor(c!) vc, "
        "Tensor pos) -> Tensor(a!)");
  m.def("attend_cache(Tensor q, Tensor kc, Tensor vc, Tensor pos, int window, float scale) -> Tensor");
  m.def("attend_cache_ref(Tensor q, Tensor kc, Tensor vc, Tensor pos, int window, float scale) -> Tensor");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("gelu_tanh_mul(Tensor gu) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(dspine_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_store", &rope_store);
  m.impl("attend_cache", &attend_cache);
  m.impl("attend_cache_ref", &attend_cache_ref);
  m.impl("silu_mul", &silu_mul);
  m.impl("gelu_tanh_mul", &gelu_tanh_mul);
  m.impl("argmax_rows", &argmax_rows);
}
