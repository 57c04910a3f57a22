#include "parallel.h"

#include <atomic>
#include <cstdlib>

namespace mok::cpu {

namespace {

// The count set_cpu_threads gave; 0: default_threads().
std::atomic<int> g_threads{0};

// MOK_CPU_THREADS (>= 1) as the process has it at the first call, else the
// hardware's threads. Read once: the CPU handlers ask at every call.
int default_threads() {
  static const int n = [] {
    if (const char* env = std::getenv("MOK_CPU_THREADS")) {
      const int v = std::atoi(env);
      if (v >= 1) return v;
    }
    const unsigned hw = std::thread::hardware_concurrency();
    return hw == 0 ? 1 : static_cast<int>(hw);
  }();
  return n;
}

}  // namespace

int cpu_threads() {
  const int n = g_threads.load(std::memory_order_relaxed);
  return n >= 1 ? n : default_threads();
}

int set_cpu_threads(int n) {
  return g_threads.exchange(n < 1 ? 0 : n, std::memory_order_relaxed);
}

}  // namespace mok::cpu
