#include "parallel.h"

#include <cstdlib>

namespace mok::cpu {

int cpu_threads() {
  if (const char* env = std::getenv("MOK_CPU_THREADS")) {
    const int n = std::atoi(env);
    if (n >= 1) return n;
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

}  // namespace mok::cpu
