// Weight-gradient instance on 128x128 tiles (twice the tiles of gemm_tc_wgrad_bf16.cu):
// A_e^T @ B_e over the expert rows (ragged K) -> bf16. Chosen by
// MOK_JAX_GEMM_WGRAD_TILE=128x128 (grouped_gemm.cu).
#include "cutlass_grouped.cuh"
MOK_GROUPED_GEMM_DEFINE_SCHEDULE(wgrad_bf16_narrow, Family::kWeightGrad, cutlass::bfloat16_t,
                                 Schedule::kCooperativeNarrow)
