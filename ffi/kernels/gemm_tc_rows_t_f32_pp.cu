// Ping-pong instance (rows @ W_e^T -> f32): 128x128 tiles, one per consumer warp group.
#include "cutlass_grouped.cuh"
MOK_GROUPED_GEMM_DEFINE_SCHEDULE(rows_t_f32_pp, Family::kRowsByWeightT, float, Schedule::kPingpong)
