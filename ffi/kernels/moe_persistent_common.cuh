// What the persistent MoE kernels (moe_persistent.cu, the forward;
// moe_persistent_backward.cu, the backward) share: one CTA per SM, a producer warp
// group that takes numbered tasks in increasing order and streams each task's K
// blocks into a ring of shared-memory stages (A rows by cp.async, tiles by TMA or
// cp.async), two consumer warp groups that run wgmma on the stages (BM x 256 per
// stage), and the counters through which tasks wait for one another (release
// increments, acquire loads). Row blocks are 64 rows (kBlockRows) unless a kernel
// asks for BM rows (both kernels' 128-row instantiations). sm_90a device code;
// included by those two files only.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "cute/arch/copy_sm80.hpp"
#include "cute/atom/mma_atom.hpp"
#include "cute/tensor.hpp"
// after cute/tensor.hpp, which declares what the TMA traits build on
#include "cute/atom/copy_traits_sm90_tma.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/fast_math.h"
#include "cutlass/numeric_types.h"
#include "cuda_check.h"
#include "mok/bf16.h"
#include "swiglu_math.cuh"

namespace mok::cuda::persistent {

using namespace cute;
using Elem = cutlass::bfloat16_t;

constexpr int kProducerThreads = 128;  // warp group 0: the loads
constexpr int kConsumerThreads = 256;  // warp groups 1 and 2: wgmma, epilogues, combine
constexpr int kThreads = kProducerThreads + kConsumerThreads;
// Registers a thread holds at launch (64K over 384 threads, in steps of 8).
constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;  // 168
// Whether a setmaxnreg split (producer, consumers) can be granted: the consumers'
// increase must come from what the producer gives back (an increase the pool
// cannot grant waits forever).
constexpr bool regs_split_fits(int producer, int consumer) {
  return producer % 8 == 0 && consumer % 8 == 0 &&
         kProducerThreads * (kLaunchRegs - producer) >= kConsumerThreads * (consumer - kLaunchRegs);
}
constexpr int kProducerRegs = 56;      // the forward's setmaxnreg split
constexpr int kConsumerRegs = 224;
static_assert(regs_split_fits(kProducerRegs, kConsumerRegs));
constexpr int kTaskSlots = 2;          // tasks handed from the producer, not yet taken
constexpr int kBlockRows = 64;        // rows per GEMM task (one wgmma M), by default
constexpr int kBlockK = 64;           // K per pipeline stage (one 128-byte swizzle row)
constexpr int kStageCols = 256;       // B columns per stage (every GEMM)
constexpr int64_t kMaxExperts = 4096;  // the row-block prefix sums live in shared memory

// Shared-memory tiles: A K-major, B (the weights, [K, N] row-major) N-major, both
// with 128-byte swizzle, as wgmma reads them.
template <int BM>
using LayoutARows = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{},
                                           Shape<Int<BM>, Int<kBlockK>>{}));
using LayoutA = LayoutARows<kBlockRows>;
// B [N, K] tiles N-major (64 N x 8 K atoms, K first: a 64-column slab is 64 K rows
// of 128 bytes) and K-major.
using LayoutB = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Elem>{},
                                       Shape<Int<kStageCols>, Int<kBlockK>>{}, Step<_2, _1>{}));
using LayoutBK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{},
                                        Shape<Int<kStageCols>, Int<kBlockK>>{}));
// A [M, K] tiles M-major (the weight gradients' row-major operands, read as A^T).
using LayoutAM = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Elem>{},
                                        Shape<Int<kBlockRows>, Int<kBlockK>>{}));
constexpr int stage_a_bytes(int bm) { return bm * kBlockK * 2; }  // 8 KB at 64 rows
constexpr int kStageABytes = stage_a_bytes(kBlockRows);
constexpr int kStageBBytes = kStageCols * kBlockK * 2;   // 32 KB
// A kernel's ring of S stages: S A tiles (of bm rows), then S B tiles.
constexpr int tile_bytes(int stages, int bm = kBlockRows) {
  return stages * (stage_a_bytes(bm) + kStageBBytes);
}
constexpr int kSmemAlign = 1024;  // the 128-byte swizzle repeats every 1024 bytes

// A kernel's dynamic shared memory, 1024-byte aligned (the swizzle's period) by its
// declaration, so that the stages' shared addresses are constants plus offsets (no
// run-time rounding of a generic pointer in every K loop); checked.
__device__ __forceinline__ char* aligned_dynamic_smem() {
  extern __shared__ __align__(kSmemAlign) char smem_raw[];
  if ((static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) & (kSmemAlign - 1)) != 0) {
    __trap();  // never: a launch error rather than misplaced swizzle atoms
  }
  return smem_raw;
}
using StageTile = Shape<Int<kBlockRows>, Int<kStageCols>>;
using Barrier = cutlass::arch::ClusterTransactionBarrier;

__device__ __forceinline__ uint32_t load_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// 16 bytes from gmem to the shared-memory address dst (zeros when !valid).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* gmem, bool valid) {
  const int bytes = valid ? 16 : 0;  // 0: the 16 bytes are zero-filled
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  cp_async_16(static_cast<uint32_t>(__cvta_generic_to_shared(smem)), gmem, valid);
}

// Two rounded values (pack_bf16x2, swiglu_math.cuh) at adjacent columns (`dst` 4-byte
// aligned) in one store.
__device__ __forceinline__ void store_pair(Elem* dst, float a, float b) {
  *reinterpret_cast<uint32_t*>(dst) = pack_bf16x2(a, b);
}

// 8 and 16 bytes to global memory at dst (aligned to the size) in one store,
// written as PTX: nvcc compiled a float2, a uint4 and a Vec<bf16, 4> assigned
// through a pointer in these kernels to two or four 4-byte stores, or four 2-byte
// ones (dgrad2's dh, the combines' rows, the SwiGLU backward's rows), each warp
// store then writing pieces of twice or four times as many sectors.
// tests/test_ptx.py checks the kernels' global stores.
__device__ __forceinline__ void store_global_8(void* dst, uint32_t a, uint32_t b) {
  asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(dst), "r"(a), "r"(b) : "memory");
}
__device__ __forceinline__ void store_global_16(void* dst, const uint4& v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

// Four 8 x 8 matrices of 16-bit values into shared memory (stmatrix.x4): register i of
// lane l holds two values of row l / 4 of matrix i (columns 2 (l % 4) and + 1), the
// layout of a quad's packed pair in wgmma's accumulators; lane l gives the shared
// address (16-byte aligned) of row l % 8 of matrix l / 8.
__device__ __forceinline__ void stmatrix_x4(uint32_t at, uint32_t r0, uint32_t r1, uint32_t r2,
                                            uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(at),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// Roles: warp group 0 loads (the producer), warp groups 1 and 2 compute (the
// consumers). Named barriers (0 is __syncthreads; consumer warp group g's own is
// kWarpGroupSync + g):
enum : uint32_t { kConsumerSync = 1, kProducerSync = 2, kWarpGroupSync = 3 };
__device__ __forceinline__ void consumer_sync() {
  cutlass::arch::NamedBarrier::sync(kConsumerThreads, kConsumerSync);
}
__device__ __forceinline__ void producer_sync() {
  cutlass::arch::NamedBarrier::sync(kProducerThreads, kProducerSync);
}

// A position in a ring of barriers: slot and the parity to wait for.
template <int N>
struct Ring {
  int slot;
  uint32_t phase;
  __device__ void advance() {
    if (++slot == N) {
      slot = 0;
      phase ^= 1u;
    }
  }
};

// Row block `block` (of all experts' BM-row blocks, in expert order): its expert,
// first row, the expert's end row and the block's rows (an expert's rows past the
// block's BM are its next block's).
struct RowBlock {
  int64_t expert, row0, row_end, n;
  __device__ int64_t rows() const { return n; }
};

template <int BM = kBlockRows>
__device__ __forceinline__ RowBlock find_block(const int32_t* block_begin, int64_t experts,
                                               const int64_t* expert_begin, int64_t block) {
  int64_t lo = 0, hi = experts;  // the last e with block_begin[e] <= block
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (block_begin[mid] <= block) lo = mid; else hi = mid;
  }
  const int64_t begin = expert_begin[lo];
  const int64_t row0 = begin + (block - block_begin[lo]) * BM;
  const int64_t row_end = expert_begin[lo + 1];
  return {lo, row0, row_end, min(row_end - row0, int64_t(BM))};
}

template <int BM = kBlockRows>
__device__ __forceinline__ Elem* stage_a(char* tiles, int stage) {
  return reinterpret_cast<Elem*>(tiles + stage * stage_a_bytes(BM));
}
template <int S, int BM = kBlockRows>
__device__ __forceinline__ Elem* stage_b(char* tiles, int stage) {
  return reinterpret_cast<Elem*>(tiles + S * stage_a_bytes(BM) + stage * kStageBBytes);
}

// Byte offset, in a tile with the 128-byte swizzle (LayoutARows: row m's 16-byte
// chunk c at byte m * 128 + (c ^ m % 8) * 16), of chunk t % 8 of row t / 8.
__device__ __forceinline__ uint32_t sw128_chunk_offset(int t) {
  const int m = t >> 3;
  return static_cast<uint32_t>(m * 128 + (((t & 7) ^ (m & 7)) * 16));
}

// The A rows of a row block one producer thread loads: 16-byte chunks ptid + 128 j
// (j < BM / 16) of a K block's BM rows x 8 chunks, that is column chunk ptid % 8 of
// rows ptid / 8 + 16 j. In the 128-byte swizzle (LayoutARows: row m's chunk c at
// byte m * 128 + (c ^ m % 8) * 16) those rows share m % 8, so a thread's chunks lie
// at one offset plus j * 2048 bytes: the K loop computes no layout, and the row
// pointers (with the thread's column chunk added) are set once per task.
template <int BM = kBlockRows>
struct ARowsOf {
  static constexpr int kChunks = BM * 8 / kProducerThreads;
  static_assert((kProducerThreads / 8) % 8 == 0, "rows 16 apart share their swizzle");
  const Elem* src[kChunks];  // row ptid / 8 + 16 j at the thread's column chunk
  uint32_t valid;            // bit j: row ptid / 8 + 16 j is one of the block's
  int kc;                    // the thread's column chunk (elements)
  uint32_t dst;              // byte offset of chunk j = 0 in a stage's A tile
  template <class RowStart>
  __device__ ARowsOf(int ptid, const RowBlock& rb, const Elem* base, RowStart row_start) {
    const int m0 = ptid >> 3;
    kc = (ptid & 7) * 8;
    dst = sw128_chunk_offset(ptid);
    valid = 0;
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const int m = m0 + 16 * j;
      const bool v = m < rb.row_end - rb.row0;  // m < BM
      valid |= uint32_t(v) << j;
      src[j] = (v ? row_start(m) : base) + kc;
    }
  }
  // cp.async of the K block at column k0 into the stage tile (zeros past the rows or K).
  __device__ void load(int ptid, Elem* tile, int64_t k0, int64_t K, const Elem* base) const {
    const uint32_t t = static_cast<uint32_t>(__cvta_generic_to_shared(tile)) + dst;
    const bool in_k = k0 + kc < K;
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const bool ok = in_k && ((valid >> j) & 1u);
      cp_async_16(t + j * 2048, ok ? src[j] + k0 : base, ok);
    }
  }
};
using ARows = ARowsOf<>;

// Streams a row-block task's K blocks into the stages: for each, a free stage, the
// A rows by cp.async from every producer thread, then (thread 0) the whole B tile's
// bytes expected (out-of-bounds parts included: TMA writes them as zeros) and
// issue_b(B stage, full barrier, K block) starting its TMA copies. kSlotRows: the
// rows the stages' A regions are laid out for (0: the task's BM).
template <int kSlotRows = 0, class Ctl, int S, class IssueB, int BM>
__device__ __forceinline__ void stream_k_blocks(int ptid, Ctl& ctl, char* tiles,
                                                Ring<S>& st, const ARowsOf<BM>& a, int64_t K,
                                                const Elem* base, IssueB issue_b) {
  constexpr int kSlot = kSlotRows ? kSlotRows : BM;
  const int k_blocks = static_cast<int>((K + kBlockK - 1) / kBlockK);
#pragma unroll 1
  for (int kb = 0; kb < k_blocks; ++kb) {
    Barrier::wait(&ctl.empty[st.slot], st.phase);
    a.load(ptid, stage_a<kSlot>(tiles, st.slot), int64_t(kb) * kBlockK, K, base);
    cutlass::arch::cpasync_barrier_arrive_noinc(&ctl.full[st.slot]);
    if (ptid == 0) {
      Barrier::arrive_and_expect_tx(&ctl.full[st.slot], kStageBBytes);
      issue_b(stage_b<S, kSlot>(tiles, st.slot), ctl.full[st.slot], kb);
    }
    st.advance();
  }
}

// Spins (one thread, the leader) until *counter >= target; after the group's barrier
// `sync`, every thread of the group may read what the counted tasks wrote.
template <class Sync>
__device__ __forceinline__ void wait_for(bool leader, const uint32_t* counter, uint32_t target,
                                         Sync sync) {
  if (leader) {
    while (load_acquire(counter) < target) __nanosleep(64);
    __threadfence();
  }
  sync();
}
__device__ __forceinline__ void producer_wait_for(int ptid, const uint32_t* counter,
                                                  uint32_t target) {
  wait_for(ptid == 0, counter, target, producer_sync);
}
__device__ __forceinline__ void consumer_wait_for(const uint32_t* counter, uint32_t target) {
  wait_for(threadIdx.x == kProducerThreads, counter, target, consumer_sync);
}

// Shared-memory control of a persistent kernel with S stages: the stage barriers
// (full: every producer thread's cp.async chunks and the TMA bytes, or thread 0's
// plain arrival, landed; empty: every consumer warp is done reading), the task
// mailbox, and the producer's claimed task numbers by claim parity.
template <class Task, int S>
struct Control {
  uint64_t full[S], empty[S];
  uint64_t task_full[kTaskSlots], task_empty[kTaskSlots];
  Task task[kTaskSlots];
  uint32_t ticket[2];
};

// The barriers' initial counts (one thread; every thread must wait at a CTA barrier
// before using them).
template <class Task, int S>
__device__ __forceinline__ void init_control(Control<Task, S>& ctl) {
  for (int s = 0; s < S; ++s) {
    Barrier::init(&ctl.full[s], kProducerThreads + 1);  // cp.async arrivals + thread 0's
    Barrier::init(&ctl.empty[s], kConsumerThreads / 32);
  }
  for (int s = 0; s < kTaskSlots; ++s) {
    Barrier::init(&ctl.task_full[s], 1);
    Barrier::init(&ctl.task_empty[s], kConsumerThreads / 32);
  }
  cutlass::arch::fence_barrier_init();
}

// The producer's next task number from the ticket counter, shared with its warp
// group (claims alternate between two slots, so a slow reader of one never sees
// the next claim's value).
template <class Task, int S>
__device__ __forceinline__ uint32_t claim_task(int ptid, Control<Task, S>& ctl, uint32_t* ticket,
                                               int claim) {
  if (ptid == 0) ctl.ticket[claim & 1] = atomicAdd(ticket, 1u);
  producer_sync();
  return ctl.ticket[claim & 1];
}

// The producer hands a task to the consumers through the mailbox (thread 0 waits
// for a free slot).
template <class Task, int S>
__device__ __forceinline__ void hand_over(int ptid, Control<Task, S>& ctl, Ring<kTaskSlots>& mail,
                                          const Task& task) {
  if (ptid == 0) {
    Barrier::wait(&ctl.task_empty[mail.slot], mail.phase);
    ctl.task[mail.slot] = task;
    Barrier::arrive(&ctl.task_full[mail.slot]);
  }
  mail.advance();
}

// A consumer warp takes the next task from the mailbox and frees its slot.
template <class Task, int S>
__device__ __forceinline__ Task take_task(Control<Task, S>& ctl, Ring<kTaskSlots>& mail) {
  Barrier::wait(&ctl.task_full[mail.slot], mail.phase);
  const Task task = ctl.task[mail.slot];
  __syncwarp();
  if ((threadIdx.x & 31) == 0) Barrier::arrive(&ctl.task_empty[mail.slot]);
  mail.advance();
  return task;
}

// The producer's tail: no producer thread exits while a copy it issued may still
// be landing. Its own cp.asyncs, then the consumers' release of every stage (which
// follows each stage's full barrier, so the TMA bytes have landed too).
template <class Task, int S>
__device__ __forceinline__ void producer_drain(Control<Task, S>& ctl, Ring<S>& st) {
  cp_async_wait<0>();
#pragma unroll 1
  for (int s = 0; s < S; ++s) {
    Barrier::wait(&ctl.empty[st.slot], st.phase);
    st.advance();
  }
}

// BM-row blocks per expert, prefix-summed into block_begin[0..E] (shared memory), by
// every thread of the CTA (each CTA computes the same from the plan).
template <int kThreadsInCta, class Scan, int BM = kBlockRows>
__device__ __forceinline__ void scan_row_blocks(const int64_t* expert_begin, int64_t E,
                                                int32_t* block_begin,
                                                typename Scan::TempStorage& tmp) {
  const int64_t per = (E + kThreadsInCta - 1) / kThreadsInCta;
  const int64_t e0 = threadIdx.x * per, e1 = min(E, e0 + per);
  int32_t mine = 0;
  for (int64_t e = e0; e < e1; ++e) {
    mine += static_cast<int32_t>((expert_begin[e + 1] - expert_begin[e] + BM - 1) / BM);
  }
  int32_t before = 0, total_blocks = 0;
  Scan(tmp).ExclusiveSum(mine, before, total_blocks);
  for (int64_t e = e0; e < e1; ++e) {
    block_begin[e] = before;
    before += static_cast<int32_t>((expert_begin[e + 1] - expert_begin[e] + BM - 1) / BM);
  }
  if (threadIdx.x == 0) block_begin[E] = total_blocks;
  __syncthreads();
}

// One K loop over the stages the producer fills, in the producer's order: the
// tiled MMA `Mma` on stage tiles laid out as SmemA (its rows: the stage's) and SmemB.
// Each stage is released when its wgmmas are done (keeping one K block's wgmmas in
// flight across the next block's wait made the 128-row forward 11-19 % slower:
// docs/measurements.md). `issued` runs once, while the first K block's wgmmas are in
// flight (work that can overlap them; it must not touch the accumulators).
// `each(kb, a)` runs at every K block while its wgmmas are in flight, with the
// stage's A tile `a` (it may read the tile, not write it).
// BM: the rows of the stages' A tiles as laid out (those of SmemA unless a kernel
// puts another A tile of the same bytes there).
struct NothingWhileIssued {
  __device__ void operator()() const {}
};
struct NothingEachBlock {
  __device__ void operator()(int, const Elem*) const {}
};
template <class Mma, class SmemA, class SmemB, int BM = decltype(size<0>(SmemA{}))::value,
          class Ctl, int S, class Acc, class Issued = NothingWhileIssued,
          class Each = NothingEachBlock>
__device__ __forceinline__ void mma_k_loop(Ctl& ctl, char* tiles, Ring<S>& st,
                                           int k_blocks, Acc& acc, Issued issued = {},
                                           Each each = {}) {
  const int ctid = threadIdx.x - kProducerThreads;
  Mma mma;
  auto thr = mma.get_thread_slice(ctid);
#pragma unroll 1
  for (int kb = 0; kb < k_blocks; ++kb) {
    Barrier::wait(&ctl.full[st.slot], st.phase);
    cutlass::arch::fence_view_async_shared();  // cp.async writes -> wgmma reads
    Tensor sA = make_tensor(make_smem_ptr(stage_a<BM>(tiles, st.slot)), SmemA{});
    Tensor sB = make_tensor(make_smem_ptr(stage_b<S, BM>(tiles, st.slot)), SmemB{});
    Tensor rA = thr.make_fragment_A(thr.partition_A(sA));
    Tensor rB = thr.make_fragment_B(thr.partition_B(sB));
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    mma.accumulate_ = kb == 0 ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
#pragma unroll
    for (int k = 0; k < size<2>(rA); ++k) {
      cute::gemm(mma, rA(_, _, k), rB(_, _, k), acc);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    if (kb == 0) issued();
    each(kb, stage_a<BM>(tiles, st.slot));
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc);
    __syncwarp();
    if ((threadIdx.x & 31) == 0) Barrier::arrive(&ctl.empty[st.slot]);
    st.advance();
  }
}

// Every consumer thread's global writes of the task done, then one release increment.
__device__ __forceinline__ void consumer_signal(uint32_t* counter) {
  consumer_sync();
  if (threadIdx.x == kProducerThreads) {
    __threadfence();
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
  }
}

// Whether the driver wrote the descriptor: CuTe leaves it zero when
// cuTensorMapEncodeTiled fails (and release builds do not stop there).
template <class Tma>
bool encoded(const Tma& tma) {
  const auto* words = reinterpret_cast<const uint64_t*>(tma.get_tma_descriptor());
  for (size_t i = 0; i < sizeof(TmaDescriptor) / sizeof(uint64_t); ++i) {
    if (words[i] != 0) return true;
  }
  return false;
}

// Dynamic shared memory of a persistent kernel: `tiles` bytes (the stages and any
// epilogue tiles; the kernels declare the array 1024-byte aligned, the swizzle's
// period, and check it), then the row-block prefix sums of E experts.
inline size_t dynamic_smem_bytes(int tiles, int64_t experts) {
  return tiles + (experts + 1) * sizeof(int32_t);
}

// Launches kernel(p) with one CTA of kThreads per SM, every CTA resident at once:
// a cooperative launch, because tasks wait for other CTAs' tasks (a partial start
// would hang; this launch fails instead).
template <class P>
std::string launch_one_cta_per_sm(void (*kernel)(P), const P& p, size_t smem, int sm_count,
                                  cudaStream_t stream) {
  MOK_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(sm_count));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  MOK_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&config, kernel, p));
  return {};
}

// Upper bound of the bm-row blocks of R = T K rows over E experts.
inline int64_t max_row_blocks(int64_t rows, int64_t experts, int64_t bm = kBlockRows) {
  return (rows + bm - 1) / bm + experts;
}

// EP ranks on one launch (virtual ranks): token t's rank and its place among the
// rank's tokens (by_rank_tokens divides by T / P), and pair (t, k)'s rank (its
// token's) and its place among that rank's pairs (local token * K + k).
struct RankPlace {
  int rank;
  int64_t local;
};
__device__ __forceinline__ RankPlace token_place(const cutlass::FastDivmod& by_rank_tokens,
                                                 int32_t t) {
  int rank, local;
  by_rank_tokens(rank, local, t);
  return {rank, local};
}
__device__ __forceinline__ RankPlace pair_place(const cutlass::FastDivmod& by_rank_tokens,
                                                int64_t top_k, int32_t pair) {
  const int32_t t = pair / static_cast<int32_t>(top_k);
  const int32_t k = pair - t * static_cast<int32_t>(top_k);
  const RankPlace q = token_place(by_rank_tokens, t);
  return {q.rank, q.local * top_k + k};
}

// The combines' sum (both kernels), for kUnits (token, column) units of one thread
// at once: unit u is the 8 columns [c[u], c[u] + 8) of token t[u]'s K rows, k
// ascending, in f32, rounded once into out[u] (t[u] < 0: no unit; out[u] is not
// written); an unrouted or dropped pair (pair_row < 0) adds nothing (not even a
// zero). One rank: pair (t, k)'s row is row pair_row of `by_row`; P ranks: row k of
// by_k[u] (the token's rows at its pairs' places). Weighted (W not void): each row
// times its pair's weight, weights[t K + k]. A batch of kBatch pairs of every unit
// loads its pairs and weights first, then all its rows, before any is summed:
// ptxas does not move a load above the rows' strong (`ld.global.cg`) loads, so with
// each pair's loads next to its row's the pairs would wait for one another, and
// with one unit at a time a combine task would wait two load latencies per unit
// instead of two per batch.
template <class W, int kUnits, int kBatch = 4>
__device__ __forceinline__ void sum_pair_rows(const int32_t* pair_row, const W* weights,
                                              const int64_t (&t)[kUnits],
                                              const int64_t (&c)[kUnits], int64_t K,
                                              bool one_rank, const Elem* by_row,
                                              const Elem* const (&by_k)[kUnits], int64_t H,
                                              uint4 (&out)[kUnits]) {
  constexpr bool kWeighted = !std::is_void_v<W>;
  float acc[kUnits][8];
#pragma unroll
  for (int u = 0; u < kUnits; ++u) {
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[u][i] = 0.0f;
  }
  for (int64_t k0 = 0; k0 < K; k0 += kBatch) {
    int32_t r[kUnits][kBatch];
    float wk[kUnits][kBatch];
#pragma unroll
    for (int u = 0; u < kUnits; ++u) {
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int64_t k = k0 + j;
        const bool in = t[u] >= 0 && k < K;  // else not read
        r[u][j] = in ? pair_row[t[u] * K + k] : -1;
        if constexpr (kWeighted) wk[u][j] = in ? to_float(weights[t[u] * K + k]) : 0.0f;
      }
    }
    uint4 v[kUnits][kBatch];
#pragma unroll
    for (int u = 0; u < kUnits; ++u) {
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const Elem* row = one_rank ? by_row + int64_t(r[u][j]) * H : by_k[u] + (k0 + j) * H;
        v[u][j] = r[u][j] >= 0 ? __ldcg(reinterpret_cast<const uint4*>(row + c[u]))
                               : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnits; ++u) {
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        if (r[u][j] < 0) continue;
        const bf16* e = reinterpret_cast<const bf16*>(&v[u][j]);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          if constexpr (kWeighted) {
            acc[u][i] += wk[u][j] * to_float(e[i]);
          } else {
            acc[u][i] += to_float(e[i]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int u = 0; u < kUnits; ++u) {
    bf16* oe = reinterpret_cast<bf16*>(&out[u]);
#pragma unroll
    for (int i = 0; i < 8; ++i) oe[i] = float_to_bf16(acc[u][i]);
  }
}

// A combine task (both kernels): the rank's tokens [local0, local0 + tokens) below
// rank_tokens (`tokens` a multiple of two: combine_tokens_per_task), each by
// kCombineWarps warps side by side along H, two tokens at a time over the
// consumers' eight warps; a thread sums kCombineUnits of its (token, column) units
// at once (sum_pair_rows), so that their loads are in flight together. Token
// `local` is token token0 + local; its rows: one rank's by pair_row from `by_row`,
// P ranks' from `recv` at local K; its sum into row `local` of `out`.
constexpr int kCombineWarps = 4;
constexpr int kCombineUnits = 4;
constexpr int kCombineSlots = kConsumerThreads / 32 / kCombineWarps;  // tokens side by side

// Tokens per combine task: eight (four per token slot, a thread's kCombineUnits
// units at H <= 1024) where each of a rank's `ctas` CTAs gets at least four such
// tasks, else two (at few tokens, eight a task would leave most CTAs without one;
// a thread then sums its units one at a time, each's pairs in batches of eight).
MOK_HOST_DEVICE constexpr int32_t combine_tokens_per_task(int64_t rank_tokens, int64_t ctas) {
  return rank_tokens >= int64_t(8) * 4 * ctas ? 8 : kCombineSlots;
}

template <class W>
__device__ __forceinline__ void combine_tokens(int ctid, int32_t tokens, const int32_t* pair_row,
                                               const W* weights, int64_t local0,
                                               int64_t rank_tokens, int64_t token0, int64_t K,
                                               bool one_rank, const Elem* by_row,
                                               const Elem* recv, Elem* out, int64_t H) {
  const int32_t rounds = tokens / kCombineSlots;
  constexpr int64_t kStep = kCombineWarps * 32 * 8;
  const int warp = ctid >> 5, lane = ctid & 31;
  const int slot = warp / kCombineWarps;
  const int64_t c0 = (warp % kCombineWarps) * 256 + int64_t(lane) * 8;
  if (rounds == 1) {
    // Two tokens a task (few tokens): a thread's units one at a time, its pairs in
    // batches of eight (two latencies per unit at K <= 8, not four).
    const int64_t local1[1] = {local0 + slot};
    if (local1[0] >= rank_tokens) return;
    const int64_t t1[1] = {token0 + local1[0]};
    const Elem* const by_k1[1] = {recv + local1[0] * K * H};
    for (int64_t c = c0; c < H; c += kStep) {
      const int64_t c1[1] = {c};
      uint4 o[1];
      sum_pair_rows<W, 1, 8>(pair_row, weights, t1, c1, K, one_rank, by_row, by_k1, H, o);
      store_global_16(out + local1[0] * H + c, o[0]);
    }
    return;
  }
  const int32_t units = static_cast<int32_t>(c0 < H ? (H - c0 + kStep - 1) / kStep : 0) * rounds;
  for (int32_t u0 = 0; u0 < units; u0 += kCombineUnits) {
    int64_t t[kCombineUnits], c[kCombineUnits], local[kCombineUnits];
    const Elem* by_k[kCombineUnits];
#pragma unroll
    for (int u = 0; u < kCombineUnits; ++u) {
      const int32_t i = u0 + u;  // round i % rounds, column step i / rounds
      local[u] = local0 + (i % rounds) * kCombineSlots + slot;
      t[u] = i < units && local[u] < rank_tokens ? token0 + local[u] : -1;
      c[u] = c0 + int64_t(i / rounds) * kStep;
      by_k[u] = recv + local[u] * K * H;
    }
    uint4 o[kCombineUnits];
    sum_pair_rows<W, kCombineUnits>(pair_row, weights, t, c, K, one_rank, by_row, by_k, H, o);
#pragma unroll
    for (int u = 0; u < kCombineUnits; ++u) {
      if (t[u] >= 0) store_global_16(out + local[u] * H + c[u], o[u]);
    }
  }
}

}  // namespace mok::cuda::persistent
