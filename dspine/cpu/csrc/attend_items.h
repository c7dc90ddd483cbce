// How an attention call over a KV cache is cut into work (ops.cpp's attend_cache, attention_bf16.cpp's bf16 one):
// every query (row b, position t) with its KV head's rep query heads, its key range, and its output.
//
// Work items are QB consecutive queries of one (row, KV head), the KV head outer, so consecutive items read the
// same keys and values (~0.7 MB for a 1,390-token SmolLM2 layer in fp32: they stay in L2; with the heads
// interleaved every query streamed all three heads' from L3), pulled one at a time (sched.h): later queries see
// more keys, so a static split of the items would leave one thread with most of the work. Which item or thread
// computes a query never changes its bits: the kernels compute each query from its own inputs alone.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

#include "sched.h"

namespace dspine {
// The items of one call, pulled with pull() (>= the item count when none is left) by each thread that runs this:
// q rows of q_stride floats (one per (row b, position t); its Hq heads first), caches [B, Hkv, cap, D] of element
// type T, pos [B * T], out [B * T, Hq * D]. query(qv, o, rep, K, V, lo, n) computes the rep heads' outputs o[r] from
// qv[r] over keys lo .. lo + n - 1 of that KV head's rows K, V ([cap, D]); queries that see no key get zeros.
constexpr int64_t QB = 8;
inline int64_t query_items(int64_t B, int64_t T_, int64_t Hkv) { return B * Hkv * ((T_ + QB - 1) / QB); }

template <class T, class Query, class Pull>
void run_query_items(const float* qp, int64_t q_stride, const T* kp, const T* vp, const int64_t* pos_, int64_t B,
                     int64_t T_, int64_t Hq, int64_t Hkv, int64_t D, int64_t cap, int64_t window, float* op,
                     Pull& pull, const Query& query) {
  const int64_t rep = Hq / Hkv, tblocks = (T_ + QB - 1) / QB, items = query_items(B, T_, Hkv);
  std::vector<const float*> qv(rep);
  std::vector<float*> o(rep);
  for (int64_t item; (item = pull()) < items;) {
    const int64_t tb = item % tblocks, g = item / tblocks % Hkv, b = item / tblocks / Hkv;
    const T* K = kp + (b * Hkv + g) * cap * D;
    const T* V = vp + (b * Hkv + g) * cap * D;
    for (int64_t t = tb * QB; t < std::min(T_, (tb + 1) * QB); ++t) {
      const int64_t bt = b * T_ + t, p = pos_[bt];
      const int64_t hi = std::min(p, cap - 1), lo = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
      for (int64_t r = 0; r < rep; ++r) {
        qv[r] = qp + bt * q_stride + (g * rep + r) * D;
        o[r] = op + (bt * Hq + g * rep + r) * D;
      }
      if (hi < lo) {
        for (int64_t r = 0; r < rep; ++r) std::fill(o[r], o[r] + D, 0.f);
        continue;
      }
      query(qv.data(), o.data(), rep, K, V, lo, hi - lo + 1);
    }
  }
}

// q [B, T, Hq, D] fp32 (contiguous), caches [B, Hkv, cap, D] of element type T, pos [B, T] int64, out [B, T, Hq * D]:
// the items above, pulled by torch's threads. query runs on several threads at once.
template <class T, class Query>
void for_each_query(const at::Tensor& qc, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& pos,
                    int64_t window, at::Tensor& out, const Query& query) {
  const int64_t B = qc.size(0), T_ = qc.size(1), Hq = qc.size(2), D = qc.size(3);
  const int64_t Hkv = kc.size(1), cap = kc.size(2);
  const T* kp = reinterpret_cast<const T*>(kc.data_ptr());
  const T* vp = reinterpret_cast<const T*>(vc.data_ptr());
  parallel_pull(query_items(B, T_, Hkv), [&](auto& pull) {
    run_query_items<T>(qc.data_ptr<float>(), Hq * D, kp, vp, pos.data_ptr<int64_t>(), B, T_, Hq, Hkv, D, cap, window,
                       out.data_ptr<float>(), pull, query);
  });
}
}  // namespace dspine
