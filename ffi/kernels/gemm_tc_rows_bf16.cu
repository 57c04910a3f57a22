// Forward grouped GEMM instance: rows [M, K] @ W_e [K, N] -> bf16.
#include "cutlass_grouped.cuh"
MOK_GROUPED_GEMM_DEFINE(rows_bf16, Family::kRowsByWeight, cutlass::bfloat16_t)
