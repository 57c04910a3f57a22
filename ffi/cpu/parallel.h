// A minimal parallel-for for the CPU path. Work items write disjoint outputs,
// so the result does not depend on the number of threads or their timing.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

namespace mok::cpu {

// IEEE subnormals (no flush to zero, no denormals-are-zero) while alive; restores
// the thread's previous mode. XLA's CPU threads flush subnormals, threads started
// here do not: every work item runs in the same mode, so results never depend on
// which thread ran an item.
class IeeeSubnormals {
 public:
#if defined(__x86_64__) || defined(_M_X64)
  IeeeSubnormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ & ~kFlushBits); }
  ~IeeeSubnormals() { _mm_setcsr(saved_); }

 private:
  static constexpr unsigned kFlushBits = 0x8040u;  // MXCSR FTZ | DAZ
  unsigned saved_;
#endif
};

// Number of worker threads: the count set_cpu_threads gave, else MOK_CPU_THREADS
// (>= 1, read once, at the first call in the process), else the hardware's.
int cpu_threads();

// Sets the worker threads of every later call in this process to n (>= 1), or
// with n = 0 to the default above; returns the previous setting (0: the default).
// The number of threads never changes a result's bits.
int set_cpu_threads(int n);

// Calls fn(item, worker) for item in [0, n) on up to cpu_threads() threads;
// worker in [0, workers) identifies per-thread scratch. Items are handed out
// dynamically (balance), which is safe because items share no output.
// Rethrows the first exception a worker raised. Items run with IEEE subnormals.
template <typename Fn>
void parallel_for(int64_t n, int workers, Fn&& fn) {
  workers = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(workers, n)));
  IeeeSubnormals ieee;  // the calling thread (worker 0); each other worker sets its own
  if (workers == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  std::atomic<int64_t> next{0};
  std::vector<std::exception_ptr> errors(workers);
  auto run = [&](int worker) {
    IeeeSubnormals worker_ieee;
    try {
      for (int64_t i = next++; i < n; i = next++) fn(i, worker);
    } catch (...) {
      errors[worker] = std::current_exception();
      next = n;
    }
  };
  std::vector<std::thread> threads;
  try {
    threads.reserve(workers - 1);
    for (int w = 1; w < workers; ++w) threads.emplace_back(run, w);
  } catch (...) {
    // A thread that cannot start (no memory for its stack, a process limit):
    // the started ones and this one take every item, and the bits are the same.
  }
  run(0);
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace mok::cpu
