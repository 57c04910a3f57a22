// The bandwidth ceiling of the persistent forward's weight stream, without its
// GEMMs: one CTA per SM (132), tasks claimed by ticket, each streaming 32 stages of
// 32 KB through five shared-memory stages (a producer thread fills by TMA, a
// consumer thread releases), over a [128, 2048, 1536] bf16 gate/up weight (805 MB).
//   mode 0: the kernel's GEMM1 pattern: four 64x64 128-byte-swizzled TMA boxes per
//           stage (gate f0, up f0, gate f0+64, up f0+64 of one expert's K block)
//   mode 1: one contiguous 32 KB bulk copy per stage
// Build: nvcc -O3 -std=c++20 -arch=sm_90a --expt-relaxed-constexpr
//        -isystem <CUTLASS include dir> scripts/weight_stream_ceiling.cu -o stream_ceiling
// (the CUTLASS headers of the nvidia-cutlass package; a build of the tree copies
// them to build/<wheel tag>/deps/cutlass). Prints the best and mean of 20 runs.
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
#include "check_cuda.h"
#include "cute/tensor.hpp"
#include "cute/atom/copy_traits_sm90_tma.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/numeric_types.h"
using namespace cute;
using Elem = cutlass::bfloat16_t;
constexpr int kStages = 5, kStageBytes = 32768;
using SL = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Elem>{}, Shape<_64, _64>{}, Step<_2, _1>{}));
auto view(const Elem* w, int64_t H, int64_t F, int64_t E) {
  return make_tensor(make_gmem_ptr(w), make_layout(make_shape(F, H, int64_t(2), E), make_stride(_1{}, 2 * F, F, 2 * F * H)));
}
auto make_t(const Elem* w, int64_t H, int64_t F, int64_t E) {
  return make_tma_atom(SM90_TMA_LOAD{}, view(w, H, F, E), SL{}, Shape<_64, _64>{});
}
using Tma = decltype(make_t(nullptr, 0, 0, 0));
struct P { Tma tma; const Elem* w; int64_t H, F, E; int mode; unsigned* ticket; };
using B = cutlass::arch::ClusterTransactionBarrier;
__global__ void __launch_bounds__(64, 1) bw(const __grid_constant__ P p) {
  extern __shared__ char dyn[];
  char* tiles = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(dyn) + 1023) & ~uintptr_t(1023));
  __shared__ alignas(8) uint64_t full[kStages], empty[kStages];
  __shared__ long long tk;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) { B::init(&full[s], 1); B::init(&empty[s], 1); }
    cutlass::arch::fence_barrier_init();
  }
  if (threadIdx.x == 0) tk = 0;
  __syncthreads();
  const int64_t n1 = p.F / 128, kbs = p.H / 64;
  const int64_t tasks = p.E * n1;
  if (threadIdx.x == 0) {  // producer
    Tensor mW = p.tma.get_tma_tensor(make_shape(p.F, p.H, int64_t(2), p.E));
    int slot = 0; uint32_t ph = 1;
    long long issued = 0;
    for (;;) {
      long long t = atomicAdd(p.ticket, 1u);
      if (t >= tasks) { *(volatile long long*)&tk = -issued - 1; break; }
      const int64_t e = t / n1, tile = t % n1;
      for (int kb = 0; kb < kbs; ++kb) {
        B::wait(&empty[slot], ph);
        B::arrive_and_expect_tx(&full[slot], kStageBytes);
        Elem* b = reinterpret_cast<Elem*>(tiles + slot * kStageBytes);
        if (p.mode == 0) {
          for (int j = 0; j < 4; ++j) {
            Tensor g = local_tile(mW(_, _, j % 2, e), Shape<_64, _64>{}, make_coord(tile * 2 + j / 2, kb));
            Tensor sj = make_tensor(make_smem_ptr(b + j * 4096), SL{});
            auto [tg, ts] = tma_partition(p.tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sj), group_modes<0, 2>(g));
            copy(p.tma.with(full[slot]), tg, ts);
          }
        } else {
          const char* src = reinterpret_cast<const char*>(p.w) + (t * kbs + kb) * int64_t(kStageBytes);
          uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(b));
          uint32_t bar = static_cast<uint32_t>(__cvta_generic_to_shared(&full[slot]));
          asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                       :: "r"(dst), "l"(src), "r"(kStageBytes), "r"(bar) : "memory");
        }
        ++issued;
        if (++slot == kStages) { slot = 0; ph ^= 1; }
      }
    }
  } else if (threadIdx.x == 32) {  // consumer
    int slot = 0; uint32_t ph = 0;
    long long consumed = 0;
    for (;;) {
      while (!B::try_wait(&full[slot], ph)) {
        const long long n = *(volatile long long*)&tk;
        if (n < 0 && consumed == -n - 1) return;
      }
      B::arrive(&empty[slot]);
      ++consumed;
      if (++slot == kStages) { slot = 0; ph ^= 1; }
    }
  }
}
int main(int argc, char** argv) {
  const int64_t E = 128, H = 2048, F = 768;
  const size_t bytes = size_t(E) * H * 2 * F * 2;
  Elem* w; unsigned* ticket;
  CHECK(cudaMalloc(&w, bytes)); CHECK(cudaMemset(w, 0, bytes));
  CHECK(cudaMalloc(&ticket, 4));
  int smem = kStages * kStageBytes + 1024;
  CHECK(cudaFuncSetAttribute(bw, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaEvent_t a, b; CHECK(cudaEventCreate(&a)); CHECK(cudaEventCreate(&b));
  for (int mode = 0; mode < 2; ++mode) {
    P p{make_t(w, H, F, E), w, H, F, E, mode, ticket};
    float best = 1e9, tot = 0; const int reps = 20;
    for (int r = 0; r < reps + 3; ++r) {
      CHECK(cudaMemsetAsync(ticket, 0, 4));
      CHECK(cudaEventRecord(a));
      bw<<<132, 64, smem>>>(p);
      CHECK(cudaGetLastError());
      CHECK(cudaEventRecord(b));
      CHECK(cudaEventSynchronize(b));
      float ms; CHECK(cudaEventElapsedTime(&ms, a, b));
      if (r >= 3) { best = ms < best ? ms : best; tot += ms; }
    }
    cudaError_t e = cudaGetLastError();
    printf("mode %d: %s  best %.3f ms (%.2f TB/s)  mean %.3f ms\n", mode, cudaGetErrorString(e), best, bytes / best / 1e9, tot / reps);
  }
  return 0;
}
