// The bf16 family of linears on AMX tiles (`tdpbf16ps`), for CPUs that have them (Intel Xeon since Sapphire Rapids):
// the same weights as gemm_bf16.cpp's AVX512-BF16 tiles (bf16 panels, or GGUF blocks expanded to exactly the bf16
// values those panels hold) and the same inputs (each row rounded to bf16 on entry), fp32 sums.
//
// Why (issue 53): a decode step of 8-64 rows spends most of its time in the AVX512-BF16 dot products (16 lanes x 2
// multiply-adds per instruction: a 32-row step is compute bound at ~2.5x its memory roof). One `tdpbf16ps` does a
// 16 x 16 x 32 block (8,192 multiply-adds); what is left is expanding the GGUF blocks to bf16 once per step, shared by
// every row, so steps of 1-64 rows cost about the same.
//
// Included by gemm_bf16.cpp inside its anonymous namespace (it uses Panels / Q4Panels / Q8Panels, NR, QK, GROUPS).
//
// Tiles: A = 16 input rows x one 32-wide slice of K (bf16), B = the 16 k-pairs of that slice for 16 output columns
// (the layout of one `Src::step` vector per row: [column][2]), C = 16 rows x 16 columns fp32. Up to 32 rows a pass
// holds the C tiles of all three 16-column groups of a panel, 48-96 rows those of one group (amx_panel_groups /
// _rows): either way each slice of the weights is expanded once for all the rows of a decode step or verify, and
// at least three accumulation chains are in flight. Rows are padded to a
// multiple of 16 and K to a multiple of 32 with zeros (their products are +0; every call pads the same weight the
// same way).
//
// Batch invariance by construction, as the AVX-512 tiles: out[m, n] is one element of one C tile that starts at zero
// and takes the K/32 slices in order, one `tdpbf16ps` each; the instruction computes each row of C from that row of
// A only. Neither the row count, the row's place in its tile, the path (decode: blocks expanded per slice; prompt:
// whole panels expanded once) nor the threads change that sequence. The bits differ from the AVX-512 path's (another
// summation order inside a slice), so a target on AMX says so in its kernel name (``-amx``).
#pragma once

#if defined(__AVX512F__) && defined(__linux__) && __has_include(<amxbf16intrin.h>)
#define DSPINE_HAS_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512bf16")

std::atomic<bool> amx_on{false};

// Linux gives a process the AMX tile data state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA);
// a tile instruction without it is SIGILL. Process-wide, so once is enough.
bool request_amx() {
  if (!__builtin_cpu_supports("avx512bf16")) return false;
  unsigned a, b, c, d;
  __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
  const bool tile = (d >> 24) & 1, bf16 = (d >> 22) & 1;  // CPUID.(7,0):EDX AMX-TILE, AMX-BF16
  if (!tile || !bf16) return false;
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows x 64 bytes; loaded per thread at the start of each call (the thread may have run another
// library's tiles since) and released at its end.
inline void tiles_begin() {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) cfg.colsb[i] = 64, cfg.rows[i] = 16;
  _tile_loadconfig(&cfg);
}

constexpr int64_t AMX_ROWS = 16, AMX_K = 32;
constexpr int64_t AMX_DECODE = 96;  // up to this many rows: blocks expanded tile by tile, once for all rows

// C tile t (0..5; the intrinsics take the tile number as a literal) stored at p with a row stride of `stride` bytes
inline void tile_store(int t, float* p, int64_t stride) {
  switch (t) {
    case 0: _tile_stored(0, p, stride); break;
    case 1: _tile_stored(1, p, stride); break;
    case 2: _tile_stored(2, p, stride); break;
    case 3: _tile_stored(3, p, stride); break;
    case 4: _tile_stored(4, p, stride); break;
    default: _tile_stored(5, p, stride); break;
  }
}

// C tile t at rows m.., columns n.. of out [M, N], through a buffer and row stores. Why not tilestored into out: with a
// wide output (the 49k-column head) its rows' stride is a multiple of 4 KB, and the strided tile store into lines not
// in cache ran a 64-row head 10x slower than its multiply-adds.
inline void store_c(int t, float* out, int64_t M, int64_t N, int64_t m, int64_t n) {
  alignas(64) float buf[AMX_ROWS * 16];
  tile_store(t, buf, 64);
  const int64_t cols = std::min<int64_t>(16, N - n);
  if (cols <= 0) return;
  const __mmask16 mask = cols >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cols) - 1);
  for (int64_t i = 0; i < AMX_ROWS && m + i < M; ++i)
    _mm512_mask_storeu_ps(out + (m + i) * N + n, mask, _mm512_load_ps(buf + i * 16));
}

// One B tile: 16 k-pairs x 16 columns of bf16 pairs, `stride` bytes between k-pairs.
struct TileB {
  const uint16_t* p;
  int64_t stride;
};

// Slice b, column group g of a panel in the bf16 panel layout ([Kp/2][NR][2]: the packed panels or an expanded
// scratch) whose steps end at `steps`: in place, or copied to group g's KB of `pad` with zero pairs past the end (the last
// slice of a K that is no multiple of 32).
inline TileB panel_tile(const uint16_t* panel, int64_t steps, int64_t b, int g, uint16_t* pad) {
  const int64_t s0 = b * 16;
  if (s0 + 16 <= steps) return {panel + (s0 * NR + g * 16) * 2, NR * 2 * 2};
  pad += g * 16 * 32;
  for (int64_t s = 0; s < 16; ++s) {
    if (s0 + s < steps) std::memcpy(pad + s * 32, panel + ((s0 + s) * NR + g * 16) * 2, 64);
    else std::memset(pad + s * 32, 0, 64);
  }
  return {pad, 64};
}

// Slice b, column group g of a panel's GGUF blocks expanded into group g's KB of wb: the values expand<> writes.
template <class Src>
inline TileB block_tile(const uint8_t* blocks, int64_t b, int g, uint16_t* wb) {
  wb += g * 16 * 32;
  const uint8_t* grp = blocks + (b * GROUPS + g) * Src::GROUP;
  for (int64_t o = 0; o < Src::GROUP; o += 64) dspine::prefetch(grp + PF_BLOCKS * GROUPS * Src::GROUP + o);
  const typename Src::Scales sc = Src::scales(grp);
  for (int64_t s = 0; s < 16; ++s) _mm512_store_si512(wb + s * 32, (__m512i)Src::step(grp, sc, s));
  return {wb, 64};
}

constexpr int RT_MAX = 6;  // row tiles per pass: C tiles 0..5, A tile 6, B tile 7

// One or two 16-row tiles (rows m0 .. m0 + 16 RT of the padded input xb [Mp][Kq]) times one panel, the three
// 16-column groups at once: per slice the groups' B tiles (tile(b, g)) are made once, and C tiles 0..3 RT - 1 stay
// resident -- three or six independent accumulation chains, which keeps the tile unit busy at 1-32 rows.
template <int RT, class Tile>
inline void amx_panel_groups(const uint16_t* xb, int64_t Kq, int64_t KB, const Tile& tile, float* out, int64_t M,
                             int64_t N, int64_t n0, int64_t m0) {
  const int64_t lda = Kq * 2;
  const uint16_t* a = xb + m0 * Kq;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  if constexpr (RT == 2) {
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
  }
  for (int64_t b = 0; b < KB; ++b) {
    const TileB w0 = tile(b, 0), w1 = tile(b, 1), w2 = tile(b, 2);
    // one row tile r: its A slice into tile 6, then each group's B into tile 7 and onto C tiles 3r .. 3r + 2 (the
    // intrinsics take tile numbers as literals)
#define DSPINE_ROW_TILE(r, c0, c1, c2)                          \
  _tile_loadd(6, a + (r) * AMX_ROWS * Kq + b * AMX_K, lda);     \
  _tile_loadd(7, w0.p, w0.stride);                              \
  _tile_dpbf16ps(c0, 6, 7);                                     \
  _tile_loadd(7, w1.p, w1.stride);                              \
  _tile_dpbf16ps(c1, 6, 7);                                     \
  _tile_loadd(7, w2.p, w2.stride);                              \
  _tile_dpbf16ps(c2, 6, 7);
    DSPINE_ROW_TILE(0, 0, 1, 2)
    if constexpr (RT == 2) {
      DSPINE_ROW_TILE(1, 3, 4, 5)
    }
#undef DSPINE_ROW_TILE
  }
  for (int r = 0; r < RT; ++r)
    for (int g = 0; g < GROUPS; ++g) store_c(3 * r + g, out, M, N, m0 + r * AMX_ROWS, n0 + 16 * g);
}

// RT (3..6) 16-row tiles times one panel, a 16-column group at a time: each group's slices are made (tile(b, g)) once
// and used by every row tile, C tiles 0..RT-1 resident (RT independent chains).
template <int RT, class Tile>
inline void amx_panel_rows(const uint16_t* xb, int64_t Kq, int64_t KB, const Tile& tile, float* out, int64_t M,
                           int64_t N, int64_t n0, int64_t m0) {
  const int64_t lda = Kq * 2;
  const uint16_t* a = xb + m0 * Kq;
  for (int g = 0; g < GROUPS; ++g) {
    if (n0 + 16 * g >= N) break;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    if constexpr (RT > 3) _tile_zero(3);
    if constexpr (RT > 4) _tile_zero(4);
    if constexpr (RT > 5) _tile_zero(5);
    for (int64_t b = 0; b < KB; ++b) {
      const TileB w = tile(b, g);
      _tile_loadd(7, w.p, w.stride);
      const uint16_t* ab = a + b * AMX_K;
      _tile_loadd(6, ab, lda);
      _tile_dpbf16ps(0, 6, 7);
      _tile_loadd(6, ab + AMX_ROWS * Kq, lda);
      _tile_dpbf16ps(1, 6, 7);
      _tile_loadd(6, ab + 2 * AMX_ROWS * Kq, lda);
      _tile_dpbf16ps(2, 6, 7);
      if constexpr (RT > 3) {
        _tile_loadd(6, ab + 3 * AMX_ROWS * Kq, lda);
        _tile_dpbf16ps(3, 6, 7);
      }
      if constexpr (RT > 4) {
        _tile_loadd(6, ab + 4 * AMX_ROWS * Kq, lda);
        _tile_dpbf16ps(4, 6, 7);
      }
      if constexpr (RT > 5) {
        _tile_loadd(6, ab + 5 * AMX_ROWS * Kq, lda);
        _tile_dpbf16ps(5, 6, 7);
      }
    }
    for (int r = 0; r < RT; ++r) store_c(r, out, M, N, m0 + r * AMX_ROWS, n0 + 16 * g);
  }
}

// Rows [m0, m1) of the padded input (m1 - m0 a multiple of 16) times one panel, up to 96 rows a pass.
template <class Tile>
inline void amx_rows(const uint16_t* xb, int64_t Kq, int64_t KB, const Tile& tile, float* out, int64_t M, int64_t N,
                     int64_t n0, int64_t m0, int64_t m1) {
  for (int64_t m = m0; m < m1; m += RT_MAX * AMX_ROWS) {
    switch (std::min<int64_t>(RT_MAX, (m1 - m) / AMX_ROWS)) {
      case 1: amx_panel_groups<1>(xb, Kq, KB, tile, out, M, N, n0, m); break;
      case 2: amx_panel_groups<2>(xb, Kq, KB, tile, out, M, N, n0, m); break;
      case 3: amx_panel_rows<3>(xb, Kq, KB, tile, out, M, N, n0, m); break;
      case 4: amx_panel_rows<4>(xb, Kq, KB, tile, out, M, N, n0, m); break;
      case 5: amx_panel_rows<5>(xb, Kq, KB, tile, out, M, N, n0, m); break;
      default: amx_panel_rows<6>(xb, Kq, KB, tile, out, M, N, n0, m); break;
    }
  }
}

template <class Src>
at::Tensor run_amx(const at::Tensor& xc, const Src& src, int64_t N) {
  constexpr bool blocks = !std::is_same_v<Src, Panels>;
  const int64_t M = xc.size(0), K = xc.size(1), Kp = round_up(K, 2), Kq = round_up(K, AMX_K);
  const int64_t Mp = round_up(M, AMX_ROWS), KB = Kq / AMX_K, steps = Kp / 2, panels = round_up(N, NR) / NR;
  auto out = at::empty({M, N}, xc.options());
  // bf16 inputs [Mp][Kq]: rows and K padded with zeros
  auto xb = at::empty({Mp * Kq}, xc.options().dtype(at::kBFloat16));
  uint16_t* xbp = reinterpret_cast<uint16_t*>(xb.data_ptr());
  to_bf16(xc.data_ptr<float>(), M, K, Kq, xbp);
  if (Mp > M) std::memset(xbp + M * Kq, 0, (Mp - M) * Kq * 2);
  float* op = out.data_ptr<float>();
  if (Mp <= AMX_DECODE) {
    // decode / verify shaped: each thread takes one contiguous share of the panels (one stream the prefetcher
    // follows, as the AVX-512 decode path); a panel's slices expanded one at a time into L1 and used by every row
    at::parallel_for(0, panels, 1, [&](int64_t t0, int64_t t1) {
      tiles_begin();
      alignas(64) uint16_t wb[GROUPS * 16 * 32];
      for (int64_t t = t0; t < t1; ++t) {
        if constexpr (blocks) {
          const uint8_t* blk = src.blocks(t);
          const auto tile = [&](int64_t b, int g) { return block_tile<Src>(blk, b, g, wb); };
          amx_rows(xbp, Kq, KB, tile, op, M, N, t * NR, 0, Mp);
        } else {
          const uint16_t* panel = src(t, nullptr);
          const auto tile = [&](int64_t b, int g) { return panel_tile(panel, steps, b, g, wb); };
          amx_rows(xbp, Kq, KB, tile, op, M, N, t * NR, 0, Mp);
        }
      }
      _tile_release();
    });
    return out;
  }
  // prompt shaped: (row chunk, panel) items pulled by the threads (sched.h); a block panel expanded once per item
  // into a thread-local scratch in the bf16 panel layout, every 32-row tile of the chunk reading it from L2
  const int64_t chunks = (Mp + MC - 1) / MC, items = chunks * panels;
  dspine::parallel_pull(items, [&](auto& pull) {
    tiles_begin();
    thread_local std::vector<uint16_t> scratch;
    if (blocks && scratch.size() < static_cast<size_t>(Kp * NR)) scratch.resize(Kp * NR);
    alignas(64) uint16_t pad[GROUPS * 16 * 32];
    for (int64_t item; (item = pull()) < items;) {
      const int64_t c = item / panels, t = item % panels;
      const uint16_t* panel = src(t, scratch.data());
      const auto tile = [&](int64_t b, int g) { return panel_tile(panel, steps, b, g, pad); };
      amx_rows(xbp, Kq, KB, tile, op, M, N, t * NR, c * MC, std::min(Mp, (c + 1) * MC));
    }
    _tile_release();
  });
  return out;
}

#pragma GCC pop_options
#endif
