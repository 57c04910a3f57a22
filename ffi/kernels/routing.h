// The routing plan on the GPU: the same rows as ffi/cpu/routing.cc.
//
// Three kernels, no atomics that decide a position:
//  1. per-chunk expert histograms (integer counts);
//  2. one block scans them: per-(chunk, expert) offsets, kept counts under the
//     capacity, expert_begin (exclusive prefix sums), tile_begin for the SIMT
//     GEMM's M tiles, and the statistics;
//  3. per chunk, one warp walks its pairs in order and ranks equal experts
//     with __match_any_sync, so the n-th pair of expert e gets row begin[e] + n.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace mok::cuda {

constexpr int64_t kRoutingChunk = 1024;       // pairs per chunk
constexpr int64_t kMaxRoutedExperts = 8192;   // histogram lives in shared memory
constexpr int64_t kSimtTileRows = 32;         // M tile of the SIMT fallback GEMM

struct RoutingPlanDevice {
  int64_t* expert_begin;       // [E + 1] first row of each expert
  int64_t* tile_begin;         // [E + 1] first SIMT M-tile of each expert
  int32_t* pair_row;           // [T * K] row of each pair, -1 if dropped or invalid
  int32_t* row_pair;           // [T * K] pair of each row (rows < expert_begin[E])
  int32_t* chunk_hist;         // [chunks, E] scratch
  int32_t* chunk_invalid;      // [chunks] scratch
};

inline int64_t routing_chunks(int64_t pairs) {
  return (pairs + kRoutingChunk - 1) / kRoutingChunk;
}

// Bytes of device scratch for a plan (all arrays above, 256-byte aligned).
size_t routing_plan_bytes(int64_t pairs, int64_t experts);
// Carves the arrays out of `scratch`.
RoutingPlanDevice carve_routing_plan(void* scratch, int64_t pairs, int64_t experts);

// ids: [T * K] device. capacity < 0 keeps all. Stats pointers may be null.
std::string build_routing_plan(const int32_t* ids, int64_t pairs, int64_t experts,
                               int64_t capacity, const RoutingPlanDevice& plan,
                               int32_t* tokens_per_expert, int32_t* dropped,
                               int32_t* invalid, cudaStream_t stream);

}  // namespace mok::cuda
