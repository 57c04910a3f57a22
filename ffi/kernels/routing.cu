#include "routing.h"

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "cuda_check.h"
#include "workspace.h"

namespace mok::cuda {
namespace {

__device__ __forceinline__ bool valid_expert(int32_t e, int64_t experts) {
  return e >= 0 && e < experts;
}

// 1. Histogram of each chunk's valid pairs per expert (shared-memory counts).
__global__ void chunk_histogram(const int32_t* __restrict__ ids, int64_t pairs, int64_t experts,
                                int32_t* __restrict__ chunk_hist,
                                int32_t* __restrict__ chunk_invalid) {
  extern __shared__ int32_t hist[];
  __shared__ int32_t invalid;
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) hist[e] = 0;
  if (threadIdx.x == 0) invalid = 0;
  __syncthreads();
  const int64_t begin = int64_t(blockIdx.x) * kRoutingChunk;
  const int64_t end = min(pairs, begin + kRoutingChunk);
  for (int64_t p = begin + threadIdx.x; p < end; p += blockDim.x) {
    const int32_t e = ids[p];
    if (valid_expert(e, experts)) {
      atomicAdd(&hist[e], 1);  // a count: the order of increments does not matter
    } else {
      atomicAdd(&invalid, 1);
    }
  }
  __syncthreads();
  int32_t* out = chunk_hist + int64_t(blockIdx.x) * experts;
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) out[e] = hist[e];
  if (threadIdx.x == 0) chunk_invalid[blockIdx.x] = invalid;
}

constexpr int kScanThreads = 512;
constexpr int kMaxExpertsPerThread = 16;
static_assert(kMaxRoutedExperts <= kScanThreads * kMaxExpertsPerThread,
              "scan_plan keeps each thread's experts in registers");

// Replaces expert e's counts over chunks [c0, c1) (column e of chunk_hist) by their
// exclusive prefix sums, starting at `running`; returns the sum after the last.
// Loads go out kBatch at a time before the stores that follow them.
__device__ __forceinline__ int64_t scan_chunk_counts(int32_t* chunk_hist, int64_t experts,
                                                     int64_t e, int64_t c0, int64_t c1,
                                                     int64_t running) {
  constexpr int kBatch = 8;
  for (int64_t c = c0; c < c1; c += kBatch) {
    int32_t v[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) v[j] = c + j < c1 ? chunk_hist[(c + j) * experts + e] : 0;
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (c + j < c1) chunk_hist[(c + j) * experts + e] = static_cast<int32_t>(running);
      running += v[j];
    }
  }
  return running;
}

// 2. One block: per-expert exclusive offsets over chunks, capacity, prefix sums.
__global__ void __launch_bounds__(kScanThreads)
scan_plan(int64_t chunks, int64_t experts, int64_t capacity, int32_t* __restrict__ chunk_hist,
          const int32_t* __restrict__ chunk_invalid, int64_t* __restrict__ expert_begin,
          int64_t* __restrict__ tile_begin, int32_t* __restrict__ tokens_per_expert,
          int32_t* __restrict__ dropped, int32_t* __restrict__ invalid) {
  using Scan = cub::BlockScan<int64_t, kScanThreads>;
  using Reduce = cub::BlockReduce<int64_t, kScanThreads>;
  __shared__ union {
    typename Scan::TempStorage scan[2];
    typename Reduce::TempStorage reduce;
  } tmp;
  __shared__ int64_t carry_rows, carry_tiles;

  // Which experts' counts this thread scans over the chunks, and which experts it
  // then owns (in thread order = expert order, for the block scans below). With
  // few experts, `lanes` consecutive threads of a warp (a power of two) share one
  // expert: each scans a contiguous run of chunks and a shuffle scan orders the
  // runs; the last of them owns the expert. Otherwise each thread scans and owns a
  // contiguous run of at most kMaxExpertsPerThread experts (their counts are this
  // thread's alone: no other thread reads or writes them before the scan).
  int lanes = 1;
  while (lanes < 32 && experts * lanes * 2 <= kScanThreads) lanes *= 2;
  int64_t e0, e1, total = 0;
  if (lanes > 1) {
    const int lane = threadIdx.x % lanes;
    const int64_t e = threadIdx.x / lanes;  // lanes divides 32: an expert's threads share a warp
    const bool scans = e < experts;
    const int64_t per = (chunks + lanes - 1) / lanes;
    const int64_t c0 = min(chunks, lane * per), c1 = min(chunks, c0 + per);
    int64_t sum = 0;
    if (scans) {
      for (int64_t c = c0; c < c1; ++c) sum += chunk_hist[c * experts + e];
    }
    int64_t inclusive = sum;  // over this expert's runs up to this one (every thread takes part)
    for (int d = 1; d < lanes; d *= 2) {
      const int64_t before = __shfl_up_sync(0xffffffffu, inclusive, d, lanes);
      if (lane >= d) inclusive += before;
    }
    if (scans) scan_chunk_counts(chunk_hist, experts, e, c0, c1, inclusive - sum);
    const bool owns = scans && lane == lanes - 1;
    e0 = owns ? e : experts;
    e1 = owns ? e + 1 : experts;
    total = inclusive;
  } else {
    const int64_t per_thread = (experts + kScanThreads - 1) / kScanThreads;
    e0 = min(experts, int64_t(threadIdx.x) * per_thread);
    e1 = min(experts, e0 + per_thread);
  }
  int64_t kept_of[kMaxExpertsPerThread], tiles_of[kMaxExpertsPerThread];
  int64_t kept_sum = 0, tiles_sum = 0, dropped_sum = 0;
  for (int64_t e = e0; e < e1; ++e) {
    const int64_t running =
        lanes > 1 ? total : scan_chunk_counts(chunk_hist, experts, e, 0, chunks, 0);
    const int64_t kept = capacity < 0 ? running : min(running, capacity);
    if (tokens_per_expert != nullptr) tokens_per_expert[e] = static_cast<int32_t>(running);
    dropped_sum += running - kept;
    kept_sum += kept;
    kept_of[e - e0] = kept;
    tiles_of[e - e0] = (kept + kSimtTileRows - 1) / kSimtTileRows;
    tiles_sum += tiles_of[e - e0];
  }
  int64_t rows_before, tiles_before;
  Scan(tmp.scan[0]).ExclusiveSum(kept_sum, rows_before);
  Scan(tmp.scan[1]).ExclusiveSum(tiles_sum, tiles_before);
  for (int64_t e = e0; e < e1; ++e) {
    expert_begin[e] = rows_before;
    tile_begin[e] = tiles_before;
    rows_before += kept_of[e - e0];
    tiles_before += tiles_of[e - e0];
  }
  if (threadIdx.x == kScanThreads - 1) {
    carry_rows = rows_before;
    carry_tiles = tiles_before;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    expert_begin[experts] = carry_rows;
    tile_begin[experts] = carry_tiles;
  }
  const int64_t total_dropped = Reduce(tmp.reduce).Sum(dropped_sum);
  __syncthreads();
  int64_t invalid_sum = 0;
  for (int64_t c = threadIdx.x; c < chunks; c += kScanThreads) invalid_sum += chunk_invalid[c];
  const int64_t total_invalid = Reduce(tmp.reduce).Sum(invalid_sum);
  if (threadIdx.x == 0) {
    if (dropped != nullptr) *dropped = static_cast<int32_t>(total_dropped);
    if (invalid != nullptr) *invalid = static_cast<int32_t>(total_invalid);
  }
}

// 3. One warp per chunk walks its pairs in order, 32 at a time. The pairs' expert
// ids and their experts' offsets are loaded first, kPlaceBatch steps at a time,
// so that the ordered walk waits on shared memory only.
constexpr int kPlaceBatch = 16;
static_assert(kRoutingChunk % (32 * kPlaceBatch) == 0, "whole batches of steps per chunk");

__global__ void __launch_bounds__(32)
place_rows(const int32_t* __restrict__ ids, int64_t pairs, int64_t experts,
           const int32_t* __restrict__ chunk_offset, const int64_t* __restrict__ expert_begin,
           int32_t* __restrict__ pair_row, int32_t* __restrict__ row_pair) {
  extern __shared__ int32_t seen[];  // pairs of each expert placed so far in this chunk
  const int lane = threadIdx.x;
  for (int64_t e = lane; e < experts; e += 32) seen[e] = 0;
  __syncwarp();
  const int64_t begin = int64_t(blockIdx.x) * kRoutingChunk;
  const int64_t end = min(pairs, begin + kRoutingChunk);
  const int32_t* offset = chunk_offset + int64_t(blockIdx.x) * experts;
  const unsigned lanes_below = (1u << lane) - 1u;
  for (int64_t base = begin; base < end; base += 32 * kPlaceBatch) {
    int32_t e_of[kPlaceBatch];
    int64_t first_of[kPlaceBatch], stop_of[kPlaceBatch];
#pragma unroll
    for (int s = 0; s < kPlaceBatch; ++s) {
      const int64_t p = base + s * 32 + lane;
      e_of[s] = p < end ? ids[p] : -1;
    }
#pragma unroll
    for (int s = 0; s < kPlaceBatch; ++s) {
      // The expert's first row for this chunk and its end; -1 past the end or invalid.
      const int32_t e = e_of[s];
      const bool valid = base + s * 32 + lane < end && valid_expert(e, experts);
      e_of[s] = valid ? e : -1;
      first_of[s] = valid ? expert_begin[e] + offset[e] : 0;
      stop_of[s] = valid ? expert_begin[e + 1] : 0;
    }
#pragma unroll
    for (int s = 0; s < kPlaceBatch; ++s) {
      const int64_t p = base + s * 32 + lane;
      const int32_t e = e_of[s];
      const bool valid = e >= 0;
      // Lanes with the same valid expert; invalid lanes and lanes past the end form
      // their own groups and are ignored.
      const unsigned peers = __match_any_sync(0xffffffffu, valid ? e : -1 - lane);
      int32_t local = 0;
      if (valid) local = seen[e] + __popc(peers & lanes_below);
      __syncwarp();
      if (valid && (peers & lanes_below) == 0) seen[e] += __popc(peers);
      __syncwarp();
      if (p >= end) continue;
      int32_t row = -1;
      if (valid && first_of[s] + local < stop_of[s]) {
        row = static_cast<int32_t>(first_of[s] + local);
        row_pair[row] = static_cast<int32_t>(p);
      }
      pair_row[p] = row;
    }
  }
}

RoutingPlanDevice carve_routing_plan_into(Carver& c, int64_t pairs, int64_t experts) {
  const int64_t chunks = routing_chunks(pairs);
  RoutingPlanDevice plan;
  plan.expert_begin = static_cast<int64_t*>(c.take((experts + 1) * sizeof(int64_t)));
  plan.tile_begin = static_cast<int64_t*>(c.take((experts + 1) * sizeof(int64_t)));
  plan.pair_row = static_cast<int32_t*>(c.take(pairs * sizeof(int32_t)));
  plan.row_pair = static_cast<int32_t*>(c.take(pairs * sizeof(int32_t)));
  plan.chunk_hist = static_cast<int32_t*>(c.take(chunks * experts * sizeof(int32_t)));
  plan.chunk_invalid = static_cast<int32_t*>(c.take(chunks * sizeof(int32_t)));
  return plan;
}

}  // namespace

size_t routing_plan_bytes(int64_t pairs, int64_t experts) {
  const int64_t chunks = routing_chunks(pairs);
  Carver c(nullptr);
  carve_routing_plan_into(c, pairs, experts);
  return c.used();
}

RoutingPlanDevice carve_routing_plan(void* scratch, int64_t pairs, int64_t experts) {
  Carver c(scratch);
  return carve_routing_plan_into(c, pairs, experts);
}

std::string build_routing_plan(const int32_t* ids, int64_t pairs, int64_t experts,
                               int64_t capacity, const RoutingPlanDevice& plan,
                               int32_t* tokens_per_expert, int32_t* dropped, int32_t* invalid,
                               cudaStream_t stream) {
  if (experts > kMaxRoutedExperts) {
    return "the CUDA routing plan supports at most 8192 experts";
  }
  const int64_t chunks = routing_chunks(pairs);
  const size_t hist_smem = experts * sizeof(int32_t);
  if (chunks > 0) {
    chunk_histogram<<<chunks, 256, hist_smem, stream>>>(ids, pairs, experts, plan.chunk_hist,
                                                        plan.chunk_invalid);
    MOK_CUDA_RETURN_IF_LAUNCH_FAILED("chunk_histogram");
  }
  scan_plan<<<1, kScanThreads, 0, stream>>>(chunks, experts, capacity, plan.chunk_hist,
                                            plan.chunk_invalid, plan.expert_begin,
                                            plan.tile_begin, tokens_per_expert, dropped, invalid);
  MOK_CUDA_RETURN_IF_LAUNCH_FAILED("scan_plan");
  if (chunks > 0) {
    place_rows<<<chunks, 32, hist_smem, stream>>>(ids, pairs, experts, plan.chunk_hist,
                                                  plan.expert_begin, plan.pair_row,
                                                  plan.row_pair);
    MOK_CUDA_RETURN_IF_LAUNCH_FAILED("place_rows");
  }
  return {};
}

}  // namespace mok::cuda
