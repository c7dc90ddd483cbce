// How the prompt-shaped kernels share work between torch's intra-op threads.
//
// Why: at::parallel_for splits a range statically, one contiguous share per thread, and waits for all of them.
// On the shared machines this project runs on, another process often holds one of our two cores; the thread
// that shares it finishes its half much later and the call waits for it (a 1,390-row linear ran at a quarter of
// its speed beside one busy process). Here each thread pulls the next work item from a shared counter, so a
// descheduled thread holds up at most the one item it is on. Items write disjoint outputs and each computes its
// elements in a fixed order, so which thread runs which item never changes a bit.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace dspine {
// worker(pull) runs once per thread; pull() returns the next item index (>= n when none is left).
template <class Worker>
void parallel_pull(int64_t n, const Worker& worker) {
  std::atomic<int64_t> next{0};
  auto pull = [&next]() { return next.fetch_add(1, std::memory_order_relaxed); };
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { worker(pull); });
}
}  // namespace dspine
