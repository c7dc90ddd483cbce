// The pieces of a decode step that layer.cpp's team stack runs on raw buffers inside one parallel region (issue 53):
// each takes a range of the work (a thread's share: tiles of a linear, rows of a norm) and the threads meet at a
// barrier between pieces. They are the same functions the tensor ops of linear.cpp and ops.cpp run on their own
// shares, so every element is computed by the same code in the same order: the same bits.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>

namespace dspine::team {
// The linears a team stack runs: linear.cpp's fp32 family (the ops linear, linear_bf16, linear_q4_1, linear_q8_0) and
// gemm_q8.cpp's integer family (linear_q8dp_q4_1, linear_q8dp_q8_0)
enum class Format { F32, BF16, Q4_1, Q8_0, Q8DP_Q4_1, Q8DP_Q8_0 };
inline bool integer(Format f) { return f == Format::Q8DP_Q4_1 || f == Format::Q8DP_Q8_0; }
int64_t block(Format f);   // K of a team linear is a multiple of this (no padding)
int64_t tiles(int64_t N);  // output tiles of N outputs
int64_t max_rows();        // rows of one pass over the weights (more: the prompt path, not the team's)
bool packed_matches(Format f, const at::Tensor& packed, int64_t N, int64_t K);
// out[M, N] (rows of N floats) for tiles [t0, t1) from x [M, K] and the packed weights
void linear_tiles(Format f, const float* x, int64_t M, int64_t K, const uint8_t* packed, float* out, int64_t N,
                  int64_t t0, int64_t t1);

// gemm_q8.cpp: the integer family (the ops linear_q8dp_q4_1 / _q8_0 with `parts` 1 or 2): a forward's input rows are
// quantized into a buffer of q8_act_bytes (rows [r0, r1) at a time), then panels [t0, t1) of the outputs read it
int64_t q8_panels(int64_t N);
size_t q8_act_bytes(int64_t M, int64_t K, int parts);
bool q8_packed_matches(bool q4, const at::Tensor& packed, int64_t N, int64_t K);
void q8_quantize_rows(const float* x, int64_t M, int64_t K, int parts, uint8_t* buf, int64_t r0, int64_t r1);
void q8_panels_of(bool q4, int parts, uint8_t* buf, int64_t M, int64_t K, const uint8_t* packed, float* out,
                  int64_t N, int64_t t0, int64_t t1);

// ops.cpp: rows [r0, r1) of x [R, D]: out = rms_norm(x) * (offset + w)
void rms_norm_rows(const float* x, const float* w, int64_t D, float eps, float offset, float* out, int64_t r0,
                   int64_t r1);
// rows [r0, r1) of gu [R, 2I] -> silu(gate) * up [R, I]
void silu_rows(const float* gu, int64_t I, float* out, int64_t r0, int64_t r1);
// tokens [m0, m1) (m = b * T + t) of qkv [B * T, (Hq + 2 Hkv) D]: q rotated in place, k rotated and stored with v
// into the caches [B, Hkv, cap, D] (fp32, or bf16 rounded at the store as rope_store does) at pos; cos / sin [B * T, d]. Positions checked by the caller.
void rope_store_rows(float* qkv, const float* cos, const float* sin, const int64_t* pos, float* kc, float* vc,
                     int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t cap, int64_t d, int64_t m0, int64_t m1);
void rope_store_rows(float* qkv, const float* cos, const float* sin, const int64_t* pos, uint16_t* kc, uint16_t* vc,
                     int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t cap, int64_t d, int64_t m0, int64_t m1);
// attention of the queries in qkv (row stride (Hq + 2 Hkv) D) over the caches (bf16 ones read into fp32: the fp32 path) -> out [B * T, Hq * D]; work
// items pulled from `next` (zero before the first thread starts) by every thread of the team
bool attention_supported(int64_t D);
void attend_rows(const float* qkv, const float* kc, const float* vc, const int64_t* pos, int64_t B, int64_t T,
                 int64_t Hq, int64_t Hkv, int64_t D, int64_t cap, int64_t window, float scale, float* out,
                 std::atomic<int64_t>& next);
void attend_rows(const float* qkv, const uint16_t* kc, const uint16_t* vc, const int64_t* pos, int64_t B, int64_t T,
                 int64_t Hq, int64_t Hkv, int64_t D, int64_t cap, int64_t window, float scale, float* out,
                 std::atomic<int64_t>& next);
}  // namespace dspine::team
