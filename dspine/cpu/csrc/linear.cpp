// Decode-shaped linear layers on the CPU: y[M, N] = x[M, K] @ W[N, K]^T for a few rows M, fp32 arithmetic,
// with W stored as fp32 or, where it is exactly representable so, in GGUF's 4-bit Q4_1 or 8-bit Q8_0 blocks
// or as bfloat16 (a draft trained in bf16).
//
// Why (docs/design.md, "The CPU step"): a small model's decode step reads every weight once per token, with
// 1-32 rows of activations. MKL's sgemm/sgemv reach 5-10 GB/s on those shapes on our 2-core machines (the
// weights stream from DRAM at 20-40 GB/s): each of the ~200 small matrices of a step starts cold and the
// library's blocking is made for large M. Here the weights are repacked once at load so that each group of
// NB output rows is one contiguous stream, and every weight vector loaded is used for all M rows before the
// next one is read, so a forward costs about one pass over the weights for any M up to a few dozen rows.
//
// Quantized blocks: the embedded target *is* a Q4_1 GGUF (Q8_0 embeddings); its fp32 weights are the blocks'
// values d * q + m. dspine/cpu/kernels.py recognises such weights exactly and keeps them as blocks; a block is
// expanded to floats in registers with one fused multiply-add, which reproduces d * q + m bit for bit (d * q
// is exact in fp32). The arithmetic after that is the fp32 kernel's, so the outputs are bit-identical to the
// fp32 weights' while 4-8x fewer bytes cross the memory bus.
//
// Batch invariance: out[m, n] is accumulated in the same order whatever M, the row's position in the batch
// and the tile that computes it (VL partial sums over k in order, then a fixed horizontal reduction), so a
// row's logits do not depend on what else is in the forward.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "sched.h"
#include "team.h"
#include "vec.h"

namespace {
using namespace dspine;

constexpr int NB = 4;            // output rows per tile (one contiguous weight stream)
constexpr int64_t M_CHUNK = 96;  // rows per pass over the weights (keeps the input rows in L2 for prefill)
constexpr int PREFETCH_TILES = 2;
constexpr int QK = 32;  // GGUF block length (Q4_1, Q8_0)

inline int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

// Weight formats. A tile is NB output rows; it is a sequence of blocks of BK input columns, each stored in
// BYTES bytes; w(block, s, j) is the float vector of columns [s*VL, (s+1)*VL) of the block for output j.
// BY_COLUMN: a tile runs a block column by column (all of a column's steps, then the next column) instead of step by
// step: each accumulator still takes its steps in order (the same bits), and a Q4_1 column's steps s and s + S/2 read
// the same bytes (low and high nibbles), which the compiler then zero-extends once. On AVX2 (Zen 3, one core) this
// made the decoder's 1-row Q4_1 linears ~1.55x faster (BENCHMARKS.md, issue 53); Q8_0 (a step is one widening load,
// memory bound at 1 row) and the fp32 formats gained nothing. On AVX-512 the order alone changed nothing measurable;
// it is what lets a column's two steps share their table and widened bytes (Q4_1::w).
struct F32 {  // per block: float[NB][VL]
  static constexpr bool BY_COLUMN = false;
  static constexpr int BK = VL;
  static constexpr int S = 1;
  static constexpr int BYTES = NB * VL * 4;
  static inline vec w(const uint8_t* blk, int /*s*/, int j) {
    return vload(reinterpret_cast<const float*>(blk) + j * VL);
  }
};

struct BF16 {  // per block: uint16 (bfloat16 bits)[NB][VL]
  static constexpr bool BY_COLUMN = false;
  static constexpr int BK = VL;
  static constexpr int S = 1;
  static constexpr int BYTES = NB * VL * 2;
  static inline vec w(const uint8_t* blk, int /*s*/, int j) {
    return bf16s(reinterpret_cast<const uint16_t*>(blk) + j * VL);
  }
};

struct Q4_1 {  // per block: uint8 q[NB][16] (GGUF order: byte l = q_l | q_{l+16} << 4), float d[NB], float m[NB]
  static constexpr bool BY_COLUMN = true;
  static constexpr int BK = QK;
  static constexpr int S = QK / VL;
  static constexpr int BYTES = NB * 16 + NB * 8;
  static inline vec w(const uint8_t* blk, int s, int j) {  // vec.h: per ISA (a table and a permute on AVX-512)
    const float* dm = reinterpret_cast<const float*>(blk + NB * 16);
    return q4_1_weights(blk + j * 16 + (s % (S / 2)) * VL, s >= S / 2, dm[j], dm[NB + j]);
  }
};

struct Q8_0 {  // per block: int8 q[NB][32], float d[NB]
  static constexpr bool BY_COLUMN = false;
  static constexpr int BK = QK;
  static constexpr int S = QK / VL;
  static constexpr int BYTES = NB * 32 + NB * 4;
  static inline vec w(const uint8_t* blk, int s, int j) {
    const float* d = reinterpret_cast<const float*>(blk + NB * 32);
    return vfma(vset(d[j]), sbytes(reinterpret_cast<const int8_t*>(blk) + j * 32 + s * VL), vzero());
  }
};

// out[m0 + i, n + j] for i < MB, j < NB (j clipped to N): one tile; pf = a later tile's weights to prefetch
// meanwhile (only on the first pass over a tile's rows). SAVE: also store each weight vector as it is expanded
// into ``save`` in the F32 layout ([Kp / VL][NB][VL] floats: the values W::w gives), so later row tiles read
// it from L1. JG (BY_COLUMN formats only): the columns a pass takes; the tile runs over its blocks NB / JG times, so
// MB x JG accumulators are live instead of MB x NB (8 rows x 2 columns fit the registers; 8 x 4 would not).
template <class W, int MB, bool SAVE = false, int JG = NB>
inline void tile(const float* __restrict x, int64_t Kp, const uint8_t* __restrict p, float* __restrict out,
                 int64_t N, int64_t n, int64_t m0, const uint8_t* pf, float* __restrict save = nullptr) {
  static_assert(NB % JG == 0 && (JG == NB || W::BY_COLUMN), "column groups are for the column-by-column formats");
  const int64_t blocks = Kp / W::BK;
  const int jn = N - n < NB ? static_cast<int>(N - n) : NB;
  for (int g = 0; g < NB; g += JG) {
    vec acc[MB][JG];
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < JG; ++j) acc[i][j] = vzero();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = p + b * W::BYTES;
      if (pf != nullptr && g == 0)
        for (int o = 0; o < W::BYTES; o += 64) prefetch(pf + b * W::BYTES + o);
      if constexpr (W::BY_COLUMN) {
        for (int j = 0; j < JG; ++j)
          for (int s = 0; s < W::S; ++s) {
            const vec w = W::w(blk, s, g + j);
            if constexpr (SAVE) std::memcpy(save + ((b * W::S + s) * NB + g + j) * VL, &w, sizeof(vec));
            const float* xk = x + b * W::BK + s * VL;
            for (int i = 0; i < MB; ++i) acc[i][j] = vfma(vload(xk + (m0 + i) * Kp), w, acc[i][j]);
          }
      } else {
        for (int s = 0; s < W::S; ++s) {
          const vec w0 = W::w(blk, s, 0), w1 = W::w(blk, s, 1), w2 = W::w(blk, s, 2), w3 = W::w(blk, s, 3);
          if constexpr (SAVE) {
            float* dst = save + (b * W::S + s) * NB * VL;
            std::memcpy(dst, &w0, sizeof(vec));
            std::memcpy(dst + VL, &w1, sizeof(vec));
            std::memcpy(dst + 2 * VL, &w2, sizeof(vec));
            std::memcpy(dst + 3 * VL, &w3, sizeof(vec));
          }
          const float* xk = x + b * W::BK + s * VL;
          for (int i = 0; i < MB; ++i) {
            const vec xv = vload(xk + (m0 + i) * Kp);
            acc[i][0] = vfma(xv, w0, acc[i][0]);
            acc[i][1] = vfma(xv, w1, acc[i][1]);
            acc[i][2] = vfma(xv, w2, acc[i][2]);
            acc[i][3] = vfma(xv, w3, acc[i][3]);
          }
        }
      }
    }
    int i = 0;
#ifdef DSPINE_HAS_VSUM16
    // 4 rows x 4 columns reduced together (vsum16 makes vsum's additions, so the bits do not depend on whether a
    // row took this or the single reductions below): element 4i + j of the result is acc[i][j]
    static_assert(NB == 4, "vsum16 reduces 4 x 4 accumulators");
    if constexpr (JG == NB)
      for (; jn == NB && i + 4 <= MB; i += 4) {
        const vec s = vsum16(&acc[i][0]);
        _mm_storeu_ps(out + (m0 + i) * N + n, _mm512_extractf32x4_ps(s, 0));
        _mm_storeu_ps(out + (m0 + i + 1) * N + n, _mm512_extractf32x4_ps(s, 1));
        _mm_storeu_ps(out + (m0 + i + 2) * N + n, _mm512_extractf32x4_ps(s, 2));
        _mm_storeu_ps(out + (m0 + i + 3) * N + n, _mm512_extractf32x4_ps(s, 3));
      }
#endif
    for (; i < MB; ++i)
      for (int j = 0; j < JG && g + j < jn; ++j) out[(m0 + i) * N + n + g + j] = vsum(acc[i][j]);
  }
}

template <class W, int MB>
inline void rows_tile(const float* x, int64_t Kp, const uint8_t* p, float* out, int64_t N, int64_t n, int64_t m0,
                      int64_t m1, const uint8_t* pf) {
  int64_t m = m0;
  for (; m + MB <= m1; m += MB, pf = nullptr) tile<W, MB>(x, Kp, p, out, N, n, m, pf);
  switch (m1 - m) {  // the remainder, in one tile of its own height (same per-element order)
#define DSPINE_REST(r)                                             \
  case r:                                                          \
    if constexpr (r < MB) tile<W, r>(x, Kp, p, out, N, n, m, pf); \
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

// Rows [c0, c1) (at most M_CHUNK) of tile t: out[c0..c1, t*NB .. t*NB+NB) from x [M, Kp] and the tile's weights p;
// pf: a later tile's weights to prefetch meanwhile. scratch: the calling thread's L1-sized buffer.
template <class W>
void tile_item(const float* xp, int64_t Kp, const uint8_t* p, float* op, int64_t N, int64_t t, int64_t c0,
               int64_t c1, std::vector<float>& scratch, const uint8_t* pf) {
  constexpr bool PAIRS = W::BY_COLUMN && PAIR_TILES;  // one tile for 7-8 rows, two columns a pass (vec.h)
  // More rows than one register tile: a compact tile is expanded once into fp32 (an L1-sized scratch) and
  // every row tile reads that, instead of expanding the blocks again for each (same values, same order).
  // The first MB_MAX rows are computed from the blocks while they are expanded (the tile stores each weight
  // vector it makes), so the expansion overlaps their multiply-adds instead of running alone first (issue 53).
  // Row tiles over fp32 weights are MB_F32 high (vec.h), those over the blocks MB_MAX: neither changes an
  // element's order, so the bits are the same.
  if constexpr (std::is_same_v<W, F32>) {
    rows_tile<F32, MB_F32>(xp, Kp, p, op, N, t * NB, c0, c1, pf);
  } else if (PAIRS && c1 - c0 >= 7 && c1 - c0 <= 8) {
    // 7 or 8 rows of a column-by-column format (Q4_1) on AVX-512: one tile from the blocks, two columns a pass,
    // instead of MB_MAX rows storing the expanded weights and the rest reading them back: 1.05x / 1.12x the
    // whole 7- / 8-row step (BENCHMARKS.md, issue 53). From 9 rows on the expansion shared through L1 wins.
    if constexpr (PAIRS) {
      if (c1 - c0 == 8) tile<W, 8, false, 2>(xp, Kp, p, op, N, t * NB, c0, pf);
      else tile<W, 7, false, 2>(xp, Kp, p, op, N, t * NB, c0, pf);
    }
  } else if (c1 - c0 > MB_MAX) {
    scratch.resize(NB * Kp);
    float* sp = scratch.data();
    tile<W, MB_MAX, true>(xp, Kp, p, op, N, t * NB, c0, pf, sp);
    const uint8_t* expanded = reinterpret_cast<const uint8_t*>(sp);
    rows_tile<F32, MB_F32>(xp, Kp, expanded, op, N, t * NB, c0 + MB_MAX, c1, nullptr);
  } else {
    rows_tile<W, MB_MAX>(xp, Kp, p, op, N, t * NB, c0, c1, pf);
  }
}

// Tiles [t0, t1) of a forward of at most M_CHUNK rows (a decode step or a verify): one stream front to back, each
// tile prefetching the one PREFETCH_TILES ahead within the range.
template <class W>
void decode_tiles(const float* xp, int64_t M, int64_t Kp, const uint8_t* pp, float* op, int64_t N, int64_t t0,
                  int64_t t1) {
  const int64_t tile_bytes = Kp / W::BK * W::BYTES;
  std::vector<float> scratch;
  for (int64_t t = t0; t < t1; ++t)
    tile_item<W>(xp, Kp, pp + t * tile_bytes, op, N, t, 0, M,
                 scratch, t + PREFETCH_TILES < t1 ? pp + (t + PREFETCH_TILES) * tile_bytes : nullptr);
}

// x [M, K] float -> [M, N], with the weights packed in format W (K padded to W::BK, N to NB).
template <class W>
at::Tensor run(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "linear: expected a 2-D float32 input");
  const int64_t M = x.size(0), K = x.size(1), Kp = round_up(K, W::BK), Np = round_up(N, NB);
  const int64_t tile_bytes = Kp / W::BK * W::BYTES;
  TORCH_CHECK(packed.nbytes() == static_cast<size_t>(Np / NB * tile_bytes), "linear: packed weight does not match N, K");
  at::Tensor xc = x.contiguous();
  if (Kp != K) xc = at::constant_pad_nd(xc, {0, Kp - K}, 0.0);
  auto out = at::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return out;
  const float* xp = xc.data_ptr<float>();
  const uint8_t* pp = static_cast<const uint8_t*>(packed.data_ptr());
  float* op = out.data_ptr<float>();
  const int64_t tiles = Np / NB;
  const int64_t grain = std::max<int64_t>(1, 32768 / tile_bytes);  // ~32 KB of weights per task at least
  // One pass over the tiles per chunk of M_CHUNK rows. Decode (one chunk): the tiles split statically between
  // the threads, each streaming its share once. A prompt: work items (row chunk, tile), pulled one at a time
  // (sched.h), in one parallel region (one region per chunk, 15 barriers for 1,390 rows, ran 4x slower than
  // torch's GEMM beside one busy process). The schedule never touches the per-element order: the same bits.
  const int64_t chunks = (M + M_CHUNK - 1) / M_CHUNK;
  if (chunks == 1) {
    at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) { decode_tiles<W>(xp, M, Kp, pp, op, N, t0, t1); });
  } else {
    parallel_pull(chunks * tiles, [&](auto& pull) {
      std::vector<float> scratch;
      for (int64_t i; (i = pull()) < chunks * tiles;) {
        const int64_t c = i / tiles, t = i % tiles;
        tile_item<W>(xp, Kp, pp + t * tile_bytes, op, N, t, c * M_CHUNK, std::min(M, (c + 1) * M_CHUNK), scratch,
                     t + PREFETCH_TILES < tiles ? pp + (t + PREFETCH_TILES) * tile_bytes : nullptr);
      }
    });
  }
  return out;
}

// W [N, K] (float) -> F32 tiles (zero padded).
at::Tensor pack_f32(const at::Tensor& w) {
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

// W [N, K] (bfloat16) -> BF16 tiles (zero padded).
at::Tensor pack_bf16(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "pack: expected a 2-D bfloat16 weight");
  auto wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1);
  const int64_t Np = round_up(N, NB), Kp = round_up(K, VL), KV = Kp / VL;
  auto out = at::zeros({Np * Kp * 2}, wc.options().dtype(at::kByte));
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wc.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<uint8_t>());
  for (int64_t n = 0; n < N; ++n) {
    const int64_t t = n / NB, j = n % NB;
    for (int64_t k = 0; k < K; ++k) dst[((t * KV + k / VL) * NB + j) * VL + k % VL] = src[n * K + k];
  }
  return out;
}

// GGUF blocks (q [N, K/32, QBYTES] uint8/int8, d and m [N, K/32] float) -> tiles of the matching format.
template <int QBYTES, bool HAS_M>
at::Tensor pack_blocks(const at::Tensor& q, const at::Tensor& d, const at::Tensor* m) {
  TORCH_CHECK(q.dim() == 3 && q.size(2) == QBYTES && q.element_size() == 1, "pack: bad block tensor");
  auto qc = q.contiguous();
  auto dc = d.to(at::kFloat).contiguous();
  at::Tensor mc = HAS_M ? m->to(at::kFloat).contiguous() : at::Tensor();
  const int64_t N = qc.size(0), KB = qc.size(1), Np = round_up(N, NB);
  constexpr int BYTES = NB * QBYTES + NB * 4 * (HAS_M ? 2 : 1);
  auto out = at::zeros({Np / NB * KB * BYTES}, qc.options().dtype(at::kByte));
  const uint8_t* qp = static_cast<const uint8_t*>(qc.data_ptr());
  const float* dp = dc.data_ptr<float>();
  const float* mp = HAS_M ? mc.data_ptr<float>() : nullptr;
  uint8_t* op = out.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t t = n / NB, j = n % NB;
    for (int64_t b = 0; b < KB; ++b) {
      uint8_t* blk = op + (t * KB + b) * BYTES;
      std::memcpy(blk + j * QBYTES, qp + (n * KB + b) * QBYTES, QBYTES);
      float* scales = reinterpret_cast<float*>(blk + NB * QBYTES);
      scales[j] = dp[n * KB + b];
      if (HAS_M) scales[NB + j] = mp[n * KB + b];
    }
  }
  return out;
}

at::Tensor pack_q4_1(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m) {
  return pack_blocks<16, true>(q, d, &m);
}
at::Tensor pack_q8_0(const at::Tensor& q, const at::Tensor& d) { return pack_blocks<32, false>(q, d, nullptr); }

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& packed, int64_t n) { return run<F32>(x, packed, n); }
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n) { return run<BF16>(x, packed, n); }
at::Tensor linear_q4_1(const at::Tensor& x, const at::Tensor& packed, int64_t n) { return run<Q4_1>(x, packed, n); }
at::Tensor linear_q8_0(const at::Tensor& x, const at::Tensor& packed, int64_t n) { return run<Q8_0>(x, packed, n); }

std::string isa() { return DSPINE_ISA; }
}  // namespace

namespace dspine::team {
int64_t block(Format f) { return f == Format::Q4_1 || f == Format::Q8_0 ? QK : VL; }
int64_t tiles(int64_t N) { return round_up(N, NB) / NB; }
int64_t max_rows() { return M_CHUNK; }
bool packed_matches(Format f, const at::Tensor& packed, int64_t N, int64_t K) {
  const int64_t bytes = f == Format::F32 ? F32::BYTES : f == Format::BF16 ? BF16::BYTES
                        : f == Format::Q4_1 ? Q4_1::BYTES : Q8_0::BYTES;
  return K % block(f) == 0 && packed.is_contiguous() &&
         packed.nbytes() == static_cast<size_t>(tiles(N) * (K / block(f)) * bytes);
}
void linear_tiles(Format f, const float* x, int64_t M, int64_t K, const uint8_t* packed, float* out, int64_t N,
                  int64_t t0, int64_t t1) {
  switch (f) {
    case Format::F32: decode_tiles<F32>(x, M, K, packed, out, N, t0, t1); break;
    case Format::BF16: decode_tiles<BF16>(x, M, K, packed, out, N, t0, t1); break;
    case Format::Q4_1: decode_tiles<Q4_1>(x, M, K, packed, out, N, t0, t1); break;
    case Format::Q8_0: decode_tiles<Q8_0>(x, M, K, packed, out, N, t0, t1); break;
    default: break;  // the integer family: gemm_q8.cpp's q8_panels_of
  }
}
}  // namespace dspine::team

TORCH_LIBRARY(dspine_cpu, m) {
  m.def("pack_linear(Tensor w) -> Tensor");
  m.def("pack_bf16(Tensor w) -> Tensor");
  m.def("pack_q4_1(Tensor q, Tensor d, Tensor m) -> Tensor");
  m.def("pack_q8_0(Tensor q, Tensor d) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("linear_q4_1(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("linear_q8_0(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("isa() -> str", &isa);
}

TORCH_LIBRARY_IMPL(dspine_cpu, CPU, m) {
  m.impl("pack_linear", &pack_f32);
  m.impl("pack_bf16", &pack_bf16);
  m.impl("pack_q4_1", &pack_q4_1);
  m.impl("pack_q8_0", &pack_q8_0);
  m.impl("linear", &linear_f32);
  m.impl("linear_bf16", &linear_bf16);
  m.impl("linear_q4_1", &linear_q4_1);
  m.impl("linear_q8_0", &linear_q8_0);
}
