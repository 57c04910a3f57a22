// The fused EP transport's device side: see ep_kernels.cuh.
#include "ep_kernels.cuh"

#include <cuda/atomic>
#include <nccl_device.h>

#include <algorithm>

#include "comm_check.h"
#include "row_copy.cuh"

namespace mok::comm {

namespace {

size_t align_up(size_t v) { return (v + kRegionAlign - 1) / kRegionAlign * kRegionAlign; }

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void* peer_ptr(ncclWindow_t w, size_t offset, int peer) {
  return ncclGetLsaPointer(w, offset, peer);
}

__device__ void record_error(ErrorRecord* e, int32_t code, const BarrierArgs& a, int peer,
                             uint32_t peer_sig, uint32_t epoch, uint64_t waited_ns) {
  if (e != nullptr && e->code == 0) {
    e->phase = a.phase;
    e->rank = a.rank;
    e->peer = peer;
    e->signature = a.signature;
    e->peer_signature = peer_sig;
    e->epoch = epoch;
    e->waited_ms = static_cast<uint32_t>(waited_ns / 1000000ull);
    __threadfence_system();
    e->code = code;  // last: the host reads the fields once code != 0
    __threadfence_system();
  }
}

constexpr int kBarrierThreads = 128;

__global__ void __launch_bounds__(kBarrierThreads) barrier_kernel(const BarrierArgs a) {
  const uint32_t epoch = static_cast<uint32_t>(*a.epoch + 1);
  const uint64_t word = (static_cast<uint64_t>(epoch) << 32) | a.signature;
  // Everything this rank wrote before -- earlier kernels on this stream (their
  // stores into peers' windows included) and copies into its own window -- must
  // be visible system-wide before any peer can see the arrival: a system-scope
  // fence by every thread, then the release stores.
  __threadfence_system();
  __syncthreads();
  // Arrive: word [rank] of every window (mine included).
  for (int p = threadIdx.x; p < a.nranks; p += blockDim.x) {
    auto* w = static_cast<uint64_t*>(peer_ptr(a.window, static_cast<size_t>(a.rank) * 8, p));
    cuda::atomic_ref<uint64_t, cuda::thread_scope_system>(*w).store(word,
                                                                    cuda::memory_order_release);
  }
  // Wait for every rank's word in my window to reach this epoch.
  auto* mine = static_cast<uint64_t*>(peer_ptr(a.window, 0, a.rank));
  const uint64_t start = global_timer_ns();
  for (int p = threadIdx.x; p < a.nranks; p += blockDim.x) {
    cuda::atomic_ref<uint64_t, cuda::thread_scope_system> flag(mine[p]);
    uint32_t spins = 0;
    while (true) {
      const uint64_t v = flag.load(cuda::memory_order_acquire);
      const int32_t ahead = static_cast<int32_t>(static_cast<uint32_t>(v >> 32) - epoch);
      if (ahead >= 0) {
        // A peer one epoch ahead has already checked our signature against its own.
        if (ahead == 0 && static_cast<uint32_t>(v) != a.signature) {
          record_error(a.error, 2, a, p, static_cast<uint32_t>(v), epoch,
                       global_timer_ns() - start);
          __trap();
        }
        break;
      }
      if ((++spins & 255u) == 0) {
        const uint64_t waited = global_timer_ns() - start;
        if (waited > a.timeout_ns) {
          record_error(a.error, 1, a, p, 0, epoch, waited);
          __trap();
        }
      }
      if (spins > 64) __nanosleep(64);
    }
  }
  // Acquire for the whole CTA (and the kernels after this one on the stream).
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) *a.epoch = epoch;
}

constexpr int kCopyThreads = 512;

__device__ __forceinline__ void copy_scalar(void* dst, const void* src, size_t bytes) {
  if (bytes == 4) {
    *static_cast<uint32_t*>(dst) = *static_cast<const volatile uint32_t*>(src);
  } else {
    *static_cast<uint16_t*>(dst) = *static_cast<const volatile uint16_t*>(src);
  }
}

// One read of the source row, a store to each of its destination rows.
__global__ void __launch_bounds__(kCopyThreads) pull_kernel(const PullArgs a) {
  const WarpSlot w = warp_slot();
  const int lane = w.lane;
  const size_t nvec = a.row_bytes / 16;
  for (int64_t u = w.warp; u < a.n_entries; u += w.warps) {
    const int32_t entry = a.entries[u];
    if (entry < 0) continue;
    const int src = static_cast<int>(entry / a.tokens);
    const int64_t token = entry % a.tokens;
    if (src >= a.nranks) continue;  // routes come from mok_jax's plan; never out of range
    const int32_t* dest = a.dest + u * a.top_k;
    const int4* from = static_cast<const int4*>(
        peer_ptr(a.window, a.layout.tokens_offset + static_cast<size_t>(token) * a.row_bytes, src));
    size_t v = lane;
    for (; v + 32 * (kRowUnroll - 1) < nvec; v += 32 * kRowUnroll) {
      int4 t[kRowUnroll];
#pragma unroll
      for (int i = 0; i < kRowUnroll; ++i) t[i] = load_vec16<true>(from + v + 32 * i);
      for (int64_t k = 0; k < a.top_k; ++k) {
        const int32_t row = dest[k];
        if (row < 0 || row >= a.out_rows) continue;
        int4* to = reinterpret_cast<int4*>(static_cast<char*>(a.out) + row * a.row_bytes);
#pragma unroll
        for (int i = 0; i < kRowUnroll; ++i) to[v + 32 * i] = t[i];
      }
    }
    for (; v < nvec; v += 32) {
      const int4 t = load_vec16<true>(from + v);
      for (int64_t k = 0; k < a.top_k; ++k) {
        const int32_t row = dest[k];
        if (row < 0 || row >= a.out_rows) continue;
        reinterpret_cast<int4*>(static_cast<char*>(a.out) + row * a.row_bytes)[v] = t;
      }
    }
    if (a.out_scalars != nullptr) {
      for (int64_t k = lane; k < a.top_k; k += 32) {
        const int32_t row = dest[k];
        if (row < 0 || row >= a.out_rows) continue;
        const void* s = peer_ptr(a.window,
                                 a.layout.pair_scalars_offset +
                                     static_cast<size_t>(token * a.top_k + k) * a.scalar_bytes,
                                 src);
        copy_scalar(static_cast<char*>(a.out_scalars) + row * a.scalar_bytes, s, a.scalar_bytes);
      }
    }
  }
}

__global__ void __launch_bounds__(kCopyThreads) push_kernel(const PushArgs a) {
  const WarpSlot w = warp_slot();
  const size_t nvec = a.row_bytes / 16;
  for (int64_t j = w.warp; j < a.n_rows; j += w.warps) {
    const int32_t d = a.dest[j];
    if (d < 0) continue;
    const int owner = static_cast<int>(d / a.pairs);
    const int64_t pair = d % a.pairs;
    if (owner >= a.nranks) continue;
    const int4* from = reinterpret_cast<const int4*>(static_cast<const char*>(a.rows) +
                                                     j * a.row_bytes);
    int4* to = static_cast<int4*>(
        peer_ptr(a.window, a.layout.slots_offset + static_cast<size_t>(pair) * a.row_bytes, owner));
    copy_row<false>(from, to, nvec, w.lane);  // local XLA buffer -> the owner's window
    if (a.row_scalars != nullptr && w.lane == 0) {
      void* s = peer_ptr(a.window,
                         a.layout.slot_scalars_offset + static_cast<size_t>(pair) * a.scalar_bytes,
                         owner);
      copy_scalar(s, static_cast<const char*>(a.row_scalars) + j * a.scalar_bytes, a.scalar_bytes);
    }
  }
}

}  // namespace

std::string copy_blocks(int device, int64_t items, int* blocks) {
  int sms = 0;
  MOK_COMM_CUDA_RETURN(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t warps_per_cta = kCopyThreads / 32;
  const int64_t want = (items + warps_per_cta - 1) / warps_per_cta;
  // Up to four CTAs of 16 warps per SM (full occupancy): a warp keeps 2 KiB of
  // loads in flight, so NVLink's latency is hidden many times over.
  *blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, 4 * int64_t(sms))));
  return "";
}

WindowLayout window_layout(int64_t tokens, int64_t top_k, size_t row_bytes, size_t scalar_bytes) {
  WindowLayout l;
  const size_t pairs = static_cast<size_t>(tokens) * static_cast<size_t>(top_k);
  size_t at = kBarrierBytes;
  l.tokens_offset = at;
  at += align_up(static_cast<size_t>(tokens) * row_bytes);
  l.pair_scalars_offset = at;
  at += align_up(pairs * scalar_bytes);
  l.slots_offset = at;
  at += align_up(pairs * row_bytes);
  l.slot_scalars_offset = at;
  at += align_up(pairs * scalar_bytes);
  l.total = at;
  return l;
}

const char* phase_name(int32_t phase) {
  switch (static_cast<Phase>(phase)) {
    case Phase::kDispatchBegin: return "dispatch (waiting for every rank's token rows)";
    case Phase::kDispatchEnd: return "dispatch (waiting for every rank to finish pulling)";
    case Phase::kCombineBegin: return "combine (waiting for every rank to free its slots)";
    case Phase::kCombineEnd: return "combine (waiting for every rank's pushed rows)";
  }
  return "unknown phase";
}

std::string launch_barrier(const BarrierArgs& args, cudaStream_t stream) {
  if (args.window == nullptr || args.epoch == nullptr) return "barrier: window or epoch is null";
  if (args.nranks < 1 || args.nranks > kMaxRanks || args.rank < 0 || args.rank >= args.nranks)
    return "barrier: rank " + std::to_string(args.rank) + " of " + std::to_string(args.nranks);
  barrier_kernel<<<1, kBarrierThreads, 0, stream>>>(args);
  MOK_COMM_CUDA_RETURN(cudaGetLastError());
  return "";
}

// What both copies need: rows of 16-byte vectors, 2- or 4-byte scalars (when
// any), and the local row buffer 16-byte aligned.
static std::string check_rows(const char* what, size_t row_bytes, bool scalars, size_t scalar_bytes,
                              const void* local_rows) {
  if (row_bytes == 0 || row_bytes % 16 != 0)
    return std::string(what) + ": row bytes " + std::to_string(row_bytes) +
           " is not a positive multiple of 16";
  if (scalars && scalar_bytes != 2 && scalar_bytes != 4)
    return std::string(what) + ": scalars must be 2 or 4 bytes";
  if (reinterpret_cast<uintptr_t>(local_rows) % 16 != 0)
    return std::string(what) + ": the local rows are not 16-byte aligned";
  return "";
}

std::string check_pull(const PullArgs& a) {
  if (a.n_entries == 0) return "";
  if (a.tokens < 1 || a.top_k < 1) return "pull: empty shapes";
  return check_rows("pull", a.row_bytes, a.out_scalars != nullptr, a.scalar_bytes, a.out);
}

std::string launch_pull(const PullArgs& a, int blocks, cudaStream_t stream) {
  MOK_COMM_RETURN_IF_MESSAGE(check_pull(a));
  if (a.n_entries == 0) return "";
  if (blocks < 1) return "pull: " + std::to_string(blocks) + " blocks";
  pull_kernel<<<blocks, kCopyThreads, 0, stream>>>(a);
  MOK_COMM_CUDA_RETURN(cudaGetLastError());
  return "";
}

std::string check_push(const PushArgs& a) {
  if (a.n_rows == 0) return "";
  if (a.pairs < 1) return "push: no pairs";
  return check_rows("push", a.row_bytes, a.row_scalars != nullptr, a.scalar_bytes, a.rows);
}

std::string launch_push(const PushArgs& a, int blocks, cudaStream_t stream) {
  MOK_COMM_RETURN_IF_MESSAGE(check_push(a));
  if (a.n_rows == 0) return "";
  if (blocks < 1) return "push: " + std::to_string(blocks) + " blocks";
  push_kernel<<<blocks, kCopyThreads, 0, stream>>>(a);
  MOK_COMM_CUDA_RETURN(cudaGetLastError());
  return "";
}

std::string load_ep_kernels() {
  cudaFuncAttributes attr;
  MOK_COMM_CUDA_RETURN(cudaFuncGetAttributes(&attr, barrier_kernel));
  MOK_COMM_CUDA_RETURN(cudaFuncGetAttributes(&attr, pull_kernel));
  MOK_COMM_CUDA_RETURN(cudaFuncGetAttributes(&attr, push_kernel));
  return "";
}

}  // namespace mok::comm
