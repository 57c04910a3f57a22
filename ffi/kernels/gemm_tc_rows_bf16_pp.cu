// Ping-pong instance (rows @ W_e -> bf16): 128x128 tiles, one per consumer warp group.
#include "cutlass_grouped.cuh"
MOK_GROUPED_GEMM_DEFINE_SCHEDULE(rows_bf16_pp, Family::kRowsByWeight, cutlass::bfloat16_t, Schedule::kPingpong)
