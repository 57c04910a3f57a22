// Entry points of the fp8 block-scaled grouped GEMM instances (gemm_fp8_*.cu),
// free of CUTLASS headers. Every operand is e4m3, K-major (K contiguous), K a
// multiple of 128 (zero-padded by the quantization kernels, fp8_quant.h); scales
// are f32; accumulation in f32, each block's partial product scaled by
// sa * sb as CUTLASS's blockwise-scaling main loop does, one CTA per output
// tile over K in order (deterministic).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace mok::cuda::fp8_grouped {

// Rows x weight: D[r, :n] = A[r, :k] @ B_e^T for rows r of expert e.
//   A: e4m3 [R, k] (row stride k); scales sa [R, k / 128] (1x128 blocks).
//   B_e: e4m3 [n (rows, at least), k] at b + e * b_expert_stride; scales
//        [ceil(n / 128), k / 128] at sb + e * sb_expert_stride (128x128 blocks).
//   D: [R, n] (f32 or bf16), row stride n.
struct RowsOperands {
  int64_t experts;
  const int64_t* expert_begin;  // device [E + 1]
  int64_t n, k;
  const void* a;
  const float* sa;
  const void* b;
  int64_t b_expert_stride;
  const float* sb;
  int64_t sb_expert_stride;
  void* d;
};

// Weight gradients over each expert's rows (ragged K): D_e[m, n] = sum over the
// expert's padded rows p of A^T[m, p] B^T[n, p] with both operands transposed
// (fp8_quant.h's quantize_transposed_fp8): A^T [m, ld] and B^T [n, ld] with the
// expert's rows at columns padded_begin[e] .., scales [ld / 128, m] and
// [ld / 128, n] (one per 128-row block and column). D_e at d + e * m * n.
// A second problem (d2 not null) over the same rows joins the same launch.
struct WgradOperands {
  int64_t experts;
  const int64_t* padded_begin;  // device [E + 1]
  int64_t ld;                   // padded rows (a multiple of 128)
  int64_t m, n;
  const void* a;
  const float* sa;
  const void* b;
  const float* sb;
  void* d;
  int64_t m2 = 0, n2 = 0;
  const void* a2 = nullptr;
  const float* sa2 = nullptr;
  const void* b2 = nullptr;
  const float* sb2 = nullptr;
  void* d2 = nullptr;
};

size_t rows_f32_workspace_bytes(int64_t experts, int device, int sm_count);
std::string rows_f32_run(const RowsOperands& op, int device, int sm_count, void* ws,
                         size_t ws_bytes, cudaStream_t stream);
size_t rows_bf16_workspace_bytes(int64_t experts, int device, int sm_count);
std::string rows_bf16_run(const RowsOperands& op, int device, int sm_count, void* ws,
                          size_t ws_bytes, cudaStream_t stream);
// `groups`: E, or 2E with a second problem.
size_t wgrad_bf16_workspace_bytes(int64_t groups, int device, int sm_count);
std::string wgrad_bf16_run(const WgradOperands& op, int device, int sm_count, void* ws,
                           size_t ws_bytes, cudaStream_t stream);

}  // namespace mok::cuda::fp8_grouped
