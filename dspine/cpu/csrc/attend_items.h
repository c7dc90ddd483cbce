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
// q [B, T, Hq, D] fp32 (contiguous), caches [B, Hkv, cap, D] of element type T, pos [B, T] int64, out [B, T, Hq * D].
// query(qv, o, rep, K, V, lo, n) computes the rep heads' outputs o[r] from qv[r] over keys lo .. lo + n - 1 of that
// KV head's rows K, V ([cap, D]); queries that see no key get zeros. query runs on several threads at once.
template <class T, class Query>
void for_each_query(const at::Tensor& qc, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& pos,
                    int64_t window, at::Tensor& out, const Query& query) {
  constexpr int64_t QB = 8;
  const int64_t B = qc.size(0), T_ = qc.size(1), Hq = qc.size(2), D = qc.size(3);
  const int64_t Hkv = kc.size(1), cap = kc.size(2), rep = Hq / Hkv;
  const float* qp = qc.data_ptr<float>();
  const T* kp = reinterpret_cast<const T*>(kc.data_ptr());
  const T* vp = reinterpret_cast<const T*>(vc.data_ptr());
  const int64_t* pos_ = pos.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t tblocks = (T_ + QB - 1) / QB, items = B * Hkv * tblocks;
  parallel_pull(items, [&](auto& pull) {
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
          qv[r] = qp + (bt * Hq + g * rep + r) * D;
          o[r] = op + (bt * Hq + g * rep + r) * D;
        }
        if (hi < lo) {
          for (int64_t r = 0; r < rep; ++r) std::fill(o[r], o[r] + D, 0.f);
          continue;
        }
        query(qv.data(), o.data(), rep, K, V, lo, hi - lo + 1);
      }
    }
  });
}
}  // namespace dspine
