#include "gemm.h"

#include <algorithm>
#include <cstring>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define MOK_CPU_MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define MOK_CPU_MULTIVERSION
#endif

namespace mok::cpu {
namespace {

constexpr int64_t kRowBlock = 4;    // rows of C updated together (reuse of each B row)
constexpr int64_t kColBlock = 256;  // columns of C per pass (C block stays in L1)
constexpr int64_t kDepthBlock = 128;  // rows of B per pass (B block stays in L2)

}  // namespace

// Built for AVX2 and for the baseline ISA, chosen at load time. Both clones do
// the same IEEE operations per element in the same order (no FMA contraction:
// -ffp-contract=off), so they give the same bits.
MOK_CPU_MULTIVERSION
void gemm_f32(const float* a, const float* b, float* c, int64_t m, int64_t n, int64_t kd) {
  std::fill(c, c + m * n, 0.0f);
  for (int64_t j0 = 0; j0 < n; j0 += kColBlock) {
    const int64_t nb = std::min(kColBlock, n - j0);
    // Depth blocks run in ascending order and each C element keeps one running
    // f32 sum, so the reduction order is that of the plain triple loop.
    for (int64_t k0 = 0; k0 < kd; k0 += kDepthBlock) {
      const int64_t kb = std::min(kDepthBlock, kd - k0);
      int64_t i0 = 0;
      for (; i0 + kRowBlock <= m; i0 += kRowBlock) {
        float acc[kRowBlock][kColBlock];
        for (int64_t r = 0; r < kRowBlock; ++r) {
          std::memcpy(acc[r], c + (i0 + r) * n + j0, nb * sizeof(float));
        }
        for (int64_t k = k0; k < k0 + kb; ++k) {
          const float* brow = b + k * n + j0;
          for (int64_t r = 0; r < kRowBlock; ++r) {
            const float av = a[(i0 + r) * kd + k];
            float* accr = acc[r];
            for (int64_t j = 0; j < nb; ++j) accr[j] += av * brow[j];
          }
        }
        for (int64_t r = 0; r < kRowBlock; ++r) {
          std::memcpy(c + (i0 + r) * n + j0, acc[r], nb * sizeof(float));
        }
      }
      for (; i0 < m; ++i0) {
        float* crow = c + i0 * n + j0;
        for (int64_t k = k0; k < k0 + kb; ++k) {
          const float av = a[i0 * kd + k];
          const float* brow = b + k * n + j0;
          for (int64_t j = 0; j < nb; ++j) crow[j] += av * brow[j];
        }
      }
    }
  }
}

void transpose_f32(const float* in, float* out, int64_t rows, int64_t cols) {
  constexpr int64_t kTile = 32;
  for (int64_t i0 = 0; i0 < rows; i0 += kTile) {
    for (int64_t j0 = 0; j0 < cols; j0 += kTile) {
      const int64_t i1 = std::min(rows, i0 + kTile), j1 = std::min(cols, j0 + kTile);
      for (int64_t i = i0; i < i1; ++i) {
        for (int64_t j = j0; j < j1; ++j) out[j * rows + i] = in[i * cols + j];
      }
    }
  }
}

}  // namespace mok::cpu
