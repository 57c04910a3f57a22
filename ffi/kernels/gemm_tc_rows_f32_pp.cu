// Ping-pong instance (rows @ W_e -> f32): 128x128 tiles, one per consumer warp group.
#include "cutlass_grouped.cuh"
MOK_GROUPED_GEMM_DEFINE_SCHEDULE(rows_f32_pp, Family::kRowsByWeight, float, Schedule::kPingpong)
