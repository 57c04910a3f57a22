// Forward GEMM1 instance: rows [M, K] @ W_e [K, N] -> f32 (SwiGLU reads the f32
// accumulators, as the contract says; the bf16 gate_up residual is written after).
#include "cutlass_grouped.cuh"
MOK_GROUPED_GEMM_DEFINE(rows_f32, Family::kRowsByWeight, float)
