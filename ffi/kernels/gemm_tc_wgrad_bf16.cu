// Weight-gradient instance: A_e^T @ B_e over the expert rows (ragged K) -> bf16.
#include "cutlass_grouped.cuh"
MOK_GROUPED_GEMM_DEFINE(wgrad_bf16, Family::kWeightGrad, cutlass::bfloat16_t)
