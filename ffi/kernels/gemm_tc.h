// Entry points of the tensor-core grouped GEMM instances (gemm_tc_*.cu), kept
// free of CUTLASS headers so the dispatcher compiles quickly.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace mok::cuda::cutlass_grouped {

// Operands of one grouped call, in the MoE layer's terms (see grouped_gemm.h).
struct Operands {
  int64_t experts;
  const int64_t* expert_begin;  // device [E + 1]
  int64_t n;                    // N of every group
  int64_t k_or_m;               // K (row families) or M (weight gradient)
  const void* a;
  const void* b;
  void* d;
  // Weight gradient only: a second problem over the same experts' rows, whose E
  // groups follow the first's in the same launch (d2 null: none). One launch
  // deals both problems' tiles over the SMs: under uneven routing, the long K of
  // the busiest expert's tiles spreads over more SMs than in two launches.
  int64_t n2 = 0, m2 = 0;
  const void* a2 = nullptr;
  const void* b2 = nullptr;
  void* d2 = nullptr;
};

#define MOK_GROUPED_GEMM_DECLARE(NAME)                                                   \
  size_t NAME##_workspace_bytes(int64_t experts, int device, int sm_count);               \
  std::string NAME##_run(const Operands& op, int device, int sm_count, void* ws,          \
                         size_t ws_bytes, cudaStream_t stream);

MOK_GROUPED_GEMM_DECLARE(rows_bf16)    // rows @ W_e            -> bf16 (forward GEMM2)
MOK_GROUPED_GEMM_DECLARE(rows_f32)     // rows @ W_e            -> f32  (forward GEMM1: SwiGLU
                                       //                          reads the f32 accumulators)
MOK_GROUPED_GEMM_DECLARE(rows_t_bf16)  // rows @ W_e^T          -> bf16 (dgrad of GEMM1)
MOK_GROUPED_GEMM_DECLARE(rows_t_f32)   // rows @ W_e^T          -> f32  (dgrad of GEMM2)
MOK_GROUPED_GEMM_DECLARE(wgrad_bf16)   // A_e^T @ B_e, ragged K -> bf16 (weight gradients;
                                       // groups longest first, see setup_groups)

#undef MOK_GROUPED_GEMM_DECLARE

// Forward GEMM1 with SwiGLU in the epilogue (swiglu_epilogue.cuh): rows [M, k] @
// W'_e [k, 2F], W' the block-interleaved gate/up weight (interleave_gate_up).
struct SwigluOperands {
  int64_t experts;
  const int64_t* expert_begin;  // device [E + 1]
  int64_t k;                    // H
  int64_t ffn;                  // F, a multiple of 128
  const void* a;                // x rows [R, H] bf16
  const void* b_interleaved;    // [E, H, 2F] bf16
  void* h;                      // [R, F] bf16
  void* gate_up;                // [R, 2F] bf16 or null
};
size_t rows_swiglu_workspace_bytes(int64_t experts, int device, int sm_count);
std::string rows_swiglu_run(const SwigluOperands& op, int device, int sm_count, void* ws,
                            size_t ws_bytes, cudaStream_t stream);

}  // namespace mok::cuda::cutlass_grouped
