// Device helpers shared by the transport's copy kernels: a warp per row, every
// lane moving 16-byte vectors, kRowUnroll of them in flight before their stores.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace mok::comm {

constexpr int kRowUnroll = 4;

// This thread's lane, its warp's index in the grid and the grid's warp count.
struct WarpSlot {
  int lane;
  int64_t warp;
  int64_t warps;
};

__device__ __forceinline__ WarpSlot warp_slot() {
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  return {static_cast<int>(threadIdx.x & 31), thread >> 5,
          (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5};
}

// kPeer: the source is another rank's memory that changes between launches
// (ld.global.cg: cached in L2 only); else read-only local memory (ld.global.nc).
template <bool kPeer>
__device__ __forceinline__ int4 load_vec16(const int4* p) {
  if constexpr (kPeer) {
    return __ldcg(p);
  } else {
    return __ldg(p);
  }
}

// One warp copies a row of `nvec` 16-byte vectors from `from` to `to`.
template <bool kPeer>
__device__ __forceinline__ void copy_row(const int4* from, int4* to, size_t nvec, int lane) {
  size_t v = lane;
  for (; v + 32 * (kRowUnroll - 1) < nvec; v += 32 * kRowUnroll) {
    int4 t[kRowUnroll];
#pragma unroll
    for (int i = 0; i < kRowUnroll; ++i) t[i] = load_vec16<kPeer>(from + v + 32 * i);
#pragma unroll
    for (int i = 0; i < kRowUnroll; ++i) to[v + 32 * i] = t[i];
  }
  for (; v < nvec; v += 32) to[v] = load_vec16<kPeer>(from + v);
}

}  // namespace mok::comm
