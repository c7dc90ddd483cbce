// The vector type our CPU kernels are written in, for the ISA the build was compiled for (dspine/cpu/kernels.py
// passes -mavx512* / -mavx2 -mfma / nothing, never -march=native): AVX-512F (16 lanes), AVX2+FMA (8 lanes) or
// portable C++ vectors (8 lanes). Each provides load, fused multiply-add, a fixed-order horizontal sum,
// prefetch and the int8/bfloat16 -> float conversions and the Q4_1 expansion the compact weight formats need.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#define DSPINE_ISA "avx512"
namespace dspine {
constexpr int VL = 16;
constexpr int MB_MAX = 6;  // row tile: 24 accumulators + 4 weight vectors + 1 input vector of 32 registers
constexpr int MB_F32 = MB_MAX;  // row tile over fp32 weights (linear.cpp): the same
// column-pair tiles (linear.cpp, the column-by-column formats: 7-8 rows in one tile, 8 x 2 accumulators, a table, the
// widened bytes, a weight and an input vector of 32 registers)
constexpr bool PAIR_TILES = true;
typedef __m512 vec;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vset(float a) { return _mm512_set1_ps(a); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vec v) {
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));  // AVX512DQ
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
// out[i] = vsum(a[i]) for 16 vectors at once, bit for bit: the same pairwise additions as vsum (lane i + i+8,
// then i + i+4, then (0 + 2) + (1 + 3)), done for several vectors per instruction by shuffling their halves
// side by side, ~3x fewer instructions than 16 vsum. Lane bookkeeping: after the four levels, element 4l + c holds
// the sum of the vector passed at position 4c + l, so the vectors are passed in that (self-inverse) order.
inline vec vsum16(const vec* a) {
  __m512 p[8], q[4];
  for (int k = 0; k < 8; ++k) {
    const __m512 x = a[(2 * k) % 4 * 4 + (2 * k) / 4], y = a[(2 * k + 1) % 4 * 4 + (2 * k + 1) / 4];
    p[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
  }
  for (int m = 0; m < 4; ++m)
    q[m] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * m], p[2 * m + 1], 0x88),
                         _mm512_shuffle_f32x4(p[2 * m], p[2 * m + 1], 0xDD));
  const __m512 r0 = _mm512_add_ps(_mm512_shuffle_ps(q[0], q[1], 0x44), _mm512_shuffle_ps(q[0], q[1], 0xEE));
  const __m512 r1 = _mm512_add_ps(_mm512_shuffle_ps(q[2], q[3], 0x44), _mm512_shuffle_ps(q[2], q[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(r0, r1, 0x88), _mm512_shuffle_ps(r0, r1, 0xDD));
}
#define DSPINE_HAS_VSUM16 1
// GGUF Q4_1 weights d * q + m for the low (hi = false) or high (hi = true) nibbles of the 16 bytes at q. The block's 16
// possible weights (q = 0..15) are made by the same fused multiply-add as the other ISAs' expansion, and each weight is
// picked from them by its nibble (vpermps reads an index's low 4 bits, so a low nibble needs no mask): per 16 weights a
// widening load, a shift for the high nibbles and a permute, where a conversion takes a mask or shift, a conversion
// and a multiply-add. linear.cpp runs a column's low and high steps side by side (Q4_1::BY_COLUMN), so the compiler
// makes the table and the widened bytes once for both. The same values: the same bits.
inline vec q4_1_weights(const uint8_t* q, bool hi, float d, float m) {
  const vec table = vfma(vset(d), _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), vset(m));
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  return _mm512_permutexvar_ps(hi ? _mm512_srli_epi32(b, 4) : b, table);
}
// 16 signed bytes -> floats
inline vec sbytes(const int8_t* q) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
}
// 16 bfloat16 -> floats (exact: a bfloat16 is the top half of a float)
inline vec bf16s(const uint16_t* p) {
  const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
}  // namespace dspine
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DSPINE_ISA "avx2"
namespace dspine {
constexpr int VL = 8;
constexpr int MB_MAX = 2;  // 8 accumulators + 4 weight vectors + 1 input vector of 16 registers
// Row tile over fp32 weights (linear.cpp: fp32 panels, or compact blocks expanded into an L1 scratch): 12
// accumulators + 4 weight vectors, each input vector an FMA memory operand. 2 x 4 keeps only 8 FMAs in flight
// against Zen 3's 2 pipes x 4 cycles of latency (~24 GMAC/s a core at 2.45 GHz); 3 x 4 runs at ~37 (the peak is
// 39). The compact formats' own tile (blocks expanded in registers) stays at MB_MAX rows: it needs the registers.
constexpr int MB_F32 = 3;
constexpr bool PAIR_TILES = false;  // 16 registers: 8 x 2 accumulators would spill
typedef __m256 vec;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vset(float a) { return _mm256_set1_ps(a); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vec v) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
// 8 bytes -> their low or high nibbles as floats
inline vec nibbles(const uint8_t* q, bool hi) {
  __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  v = hi ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(15));
  return _mm256_cvtepi32_ps(v);
}
// GGUF Q4_1 weights d * q + m for the low (hi = false) or high nibbles of the 8 bytes at q (d * q is exact in fp32)
inline vec q4_1_weights(const uint8_t* q, bool hi, float d, float m) { return vfma(vset(d), nibbles(q, hi), vset(m)); }
// 8 signed bytes -> floats
inline vec sbytes(const int8_t* q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
}
// 8 bfloat16 -> floats
inline vec bf16s(const uint16_t* p) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
}  // namespace dspine
#else
#define DSPINE_ISA "generic"
namespace dspine {
constexpr int VL = 8;
constexpr int MB_MAX = 2;
constexpr int MB_F32 = MB_MAX;
constexpr bool PAIR_TILES = false;
typedef float vec __attribute__((vector_size(VL * sizeof(float))));
inline vec vzero() { return vec{}; }
inline vec vset(float a) { return vec{} + a; }
inline vec vload(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline vec vfma(vec a, vec b, vec c) { return a * b + c; }
inline float vsum(vec v) {
  float t[VL];
  std::memcpy(t, &v, sizeof(v));
  float a = (t[0] + t[4]) + (t[2] + t[6]), b = (t[1] + t[5]) + (t[3] + t[7]);
  return a + b;
}
inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 2); }
inline vec nibbles(const uint8_t* q, bool hi) {
  vec v;
  for (int i = 0; i < VL; ++i) v[i] = static_cast<float>(hi ? q[i] >> 4 : q[i] & 15);
  return v;
}
inline vec q4_1_weights(const uint8_t* q, bool hi, float d, float m) { return vfma(vset(d), nibbles(q, hi), vset(m)); }
inline vec sbytes(const int8_t* q) {
  vec v;
  for (int i = 0; i < VL; ++i) v[i] = static_cast<float>(q[i]);
  return v;
}
inline vec bf16s(const uint16_t* p) {
  vec v;
  for (int i = 0; i < VL; ++i) {
    const uint32_t b = static_cast<uint32_t>(p[i]) << 16;
    float f;
    std::memcpy(&f, &b, 4);
    v[i] = f;
  }
  return v;
}
}  // namespace dspine
#endif

namespace dspine {
// exp(x) on a vector (Cephes-style: 2^n * polynomial; about 1 ulp in float32 over the clamped range). Written
// with GCC vector extensions on top of ``vec``, so the same code serves every ISA.
typedef int32_t ivec __attribute__((vector_size(VL * 4)));
typedef float fvec __attribute__((vector_size(VL * 4)));
inline vec vexp(vec xin) {
  const fvec one = fvec{} + 1.0f;
  fvec x = reinterpret_cast<fvec&>(xin);
  const fvec hi = one * 88.3762626647949f, lo = one * -87.3365447505531f;
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  fvec fx = x * 1.44269504088896341f + 0.5f;
  fvec fl = __builtin_convertvector(__builtin_convertvector(fx, ivec), fvec);
  fl = fl > fx ? fl - one : fl;  // floor
  fvec r = x - fl * 0.693359375f - fl * -2.12194440e-4f;
  fvec r2 = r * r;
  fvec y = one * 1.9875691500E-4f;
  y = y * r + 1.3981999507E-3f;
  y = y * r + 8.3334519073E-3f;
  y = y * r + 4.1665795894E-2f;
  y = y * r + 1.6666665459E-1f;
  y = y * r + 5.0000001201E-1f;
  y = y * r2 + r + one;
  ivec e = (__builtin_convertvector(fl, ivec) + 127) << 23;
  fvec out = y * reinterpret_cast<fvec&>(e);
  return reinterpret_cast<vec&>(out);
}

// The softmax pieces attention needs (ops.cpp, attention_bf16.cpp): one definition, so both kernels share the
// order of operations they document.
// w[0..n) = exp(w - mx); returns their sum
inline float exp_shifted(float* w, int64_t n, float mx) {
  float sum = 0.f;
  int64_t j = 0;
  const vec m = vset(mx);
  for (; j + VL <= n; j += VL) {
    vec e = vexp(vload(w + j) - m);
    std::memcpy(w + j, &e, sizeof(e));
    sum += vsum(e);
  }
  for (; j < n; ++j) {
    w[j] = std::exp(w[j] - mx);
    sum += w[j];
  }
  return sum;
}

// max(w[0..n)), -inf for n = 0. A max is exact in any order, so eight lanes (vectorised) instead of one scalar
// dependency chain: the same value std::max over the row gives (NaN scores are skipped alike).
inline float max_of(const float* w, int64_t n) {
  float m[8];
  std::fill(m, m + 8, -std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) m[l] = m[l] < w[i + l] ? w[i + l] : m[l];
  for (; i < n; ++i) m[0] = m[0] < w[i] ? w[i] : m[0];
  float r = m[0];
  for (int l = 1; l < 8; ++l) r = r < m[l] ? m[l] : r;
  return r;
}
}  // namespace dspine
