// Data-gradient instance with an f32 result (dh before SwiGLU backward).
#include "cutlass_grouped.cuh"
MOK_GROUPED_GEMM_DEFINE(rows_t_f32, Family::kRowsByWeightT, float)
