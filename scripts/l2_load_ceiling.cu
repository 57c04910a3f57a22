// How fast shared-memory stages can be filled from L2, against from DRAM: the
// headroom a GEMM stage that reloads its operands more often (smaller tiles per
// warp group) would have. One CTA per SM (132), a producer thread filling four
// 48 KB stages (the persistent forward's 128-row stage: A 128 x 64 and B 256 x 64
// bf16) by three 16 KB bulk copies each, a consumer thread releasing them; every
// CTA streams `stages` stages from 16 KB chunks of a buffer at scattered offsets.
//   buffer 16 MB or 40 MB: L2-resident after the first pass (H200: 50 MB of L2);
//   buffer 2 GB: DRAM.
// Build: nvcc -O3 -std=c++20 -arch=sm_90a --expt-relaxed-constexpr
//        -isystem <CUTLASS include dir> scripts/l2_load_ceiling.cu -o l2_ceiling
// (the CUTLASS headers of the nvidia-cutlass package). Prints the best and mean of
// 20 runs of each buffer size, in TB/s of bytes landed in shared memory.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
#include "check_cuda.h"
#include "cutlass/arch/barrier.h"
constexpr int kStages = 4, kChunk = 16384, kChunksPerStage = 3;
constexpr int kStageBytes = kChunk * kChunksPerStage;
using B = cutlass::arch::ClusterTransactionBarrier;
__global__ void __launch_bounds__(64, 1) fill(const char* buf, int64_t chunks, int stages) {
  extern __shared__ char dyn[];
  char* tiles = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(dyn) + 1023) & ~uintptr_t(1023));
  __shared__ alignas(8) uint64_t full[kStages], empty[kStages];
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) { B::init(&full[s], 1); B::init(&empty[s], 1); }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // producer
    int slot = 0;
    uint32_t ph = 1;
    uint64_t at = uint64_t(blockIdx.x) * 7919u;
    for (int i = 0; i < stages; ++i) {
      B::wait(&empty[slot], ph);
      B::arrive_and_expect_tx(&full[slot], kStageBytes);
      const uint32_t bar = static_cast<uint32_t>(__cvta_generic_to_shared(&full[slot]));
      for (int j = 0; j < kChunksPerStage; ++j) {
        at = (at + 104729u) % uint64_t(chunks);
        const char* src = buf + at * kChunk;
        const uint32_t dst =
            static_cast<uint32_t>(__cvta_generic_to_shared(tiles + slot * kStageBytes + j * kChunk));
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
            ::"r"(dst), "l"(src), "r"(kChunk), "r"(bar) : "memory");
      }
      if (++slot == kStages) { slot = 0; ph ^= 1; }
    }
  } else if (threadIdx.x == 32) {  // consumer
    int slot = 0;
    uint32_t ph = 0;
    for (int i = 0; i < stages; ++i) {
      B::wait(&full[slot], ph);
      B::arrive(&empty[slot]);
      if (++slot == kStages) { slot = 0; ph ^= 1; }
    }
  }
}
int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int stages = 2048;  // per CTA: 132 x 2048 x 48 KB = 13.3 GB a run
  const int smem = kStages * kStageBytes + 1024;
  CHECK(cudaFuncSetAttribute(fill, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  const size_t sizes[] = {size_t(16) << 20, size_t(40) << 20, size_t(2) << 30};
  for (size_t bytes : sizes) {
    char* buf;
    CHECK(cudaMalloc(&buf, bytes));
    CHECK(cudaMemset(buf, 1, bytes));
    const double moved = double(sms) * stages * kStageBytes;
    float best = 1e9f, tot = 0;
    const int reps = 20;
    for (int r = 0; r < reps + 3; ++r) {
      CHECK(cudaEventRecord(a));
      fill<<<sms, 64, smem>>>(buf, int64_t(bytes / kChunk), stages);
      CHECK(cudaGetLastError());
      CHECK(cudaEventRecord(b));
      CHECK(cudaEventSynchronize(b));
      float ms;
      CHECK(cudaEventElapsedTime(&ms, a, b));
      if (r >= 3) { best = ms < best ? ms : best; tot += ms; }
    }
    std::printf("buffer %5zu MB: %.2f GB in best %.3f ms (%.2f TB/s), mean %.3f ms (%.2f TB/s)\n",
                bytes >> 20, moved / 1e9, best, moved / best / 1e9, tot / reps,
                moved / (tot / reps) / 1e9);
    CHECK(cudaFree(buf));
  }
  return 0;
}
