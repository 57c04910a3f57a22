// Data-gradient instance: rows [M, K] @ W_e^T (W_e stored [N, K]) -> bf16.
#include "cutlass_grouped.cuh"
MOK_GROUPED_GEMM_DEFINE(rows_t_bf16, Family::kRowsByWeightT, cutlass::bfloat16_t)
