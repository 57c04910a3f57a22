// Row-major f32 GEMM for the CPU path: C[M, N] = A[M, Kd] @ B[Kd, N].
//
// Every C element is accumulated over Kd in ascending order in one f32 value,
// whatever the blocking, so results do not depend on M, on where a row sits in
// A, or on the cache blocking: the property that makes the CPU path
// deterministic and expert-parallel invariant.
#pragma once

#include <cstdint>

namespace mok::cpu {

void gemm_f32(const float* a, const float* b, float* c, int64_t m, int64_t n, int64_t kd);

// out[cols, rows] = in[rows, cols]^T
void transpose_f32(const float* in, float* out, int64_t rows, int64_t cols);

}  // namespace mok::cpu
