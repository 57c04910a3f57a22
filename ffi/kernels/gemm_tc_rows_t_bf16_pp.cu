// Ping-pong instance (rows @ W_e^T -> bf16): 128x128 tiles, one per consumer warp group.
#include "cutlass_grouped.cuh"
MOK_GROUPED_GEMM_DEFINE_SCHEDULE(rows_t_bf16_pp, Family::kRowsByWeightT, cutlass::bfloat16_t, Schedule::kPingpong)
