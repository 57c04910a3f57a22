#include "moe_persistent.h"

#include <atomic>

#include <cub/block/block_scan.cuh>

#include "cuda_check.h"
#include "cute/arch/copy_sm80.hpp"
#include "cute/atom/mma_atom.hpp"
#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/numeric_types.h"
#include "mok/bf16.h"
#include "workspace.h"

namespace mok::cuda {
namespace {

using namespace cute;
using Elem = cutlass::bfloat16_t;

constexpr int kThreads = 256;         // two warp groups
constexpr int kBlockRows = 64;        // rows per GEMM task (one wgmma M)
constexpr int kBlockK = 64;           // K per pipeline stage (one 128-byte swizzle row)
constexpr int kStages = 5;
constexpr int kGemm1Cols = 128;       // F columns per GEMM1 task (gate and up each)
constexpr int kGemm2Cols = 256;       // H columns per GEMM2 task
constexpr int kStageCols = 256;       // B columns per stage in both GEMMs
constexpr int kCombineTokens = 32;    // tokens per combine task (4 per warp)
constexpr int64_t kMaxExperts = 4096;  // the row-block prefix sums live in shared memory
// Auto mode: the persistent kernel where experts average at most this many rows
// (its 64-row tiles stream the weights; with more rows the chain's CUTLASS GEMMs,
// 128x256 tiles with TMA and warp specialisation, are faster).
constexpr int64_t kAutoRowsPerExpert = 32;

// Shared-memory tiles: A K-major, B (the weights, [K, N] row-major) N-major, both
// with 128-byte swizzle, as wgmma reads them.
using LayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{},
                                       Shape<Int<kBlockRows>, Int<kBlockK>>{}));
using LayoutB1 = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Elem>{},
                                        Shape<Int<kGemm1Cols>, Int<kBlockK>>{}));
using LayoutB2 = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Elem>{},
                                        Shape<Int<kGemm2Cols>, Int<kBlockK>>{}));
constexpr int kStageABytes = kBlockRows * kBlockK * 2;   // 8 KB
constexpr int kStageBBytes = kStageCols * kBlockK * 2;   // 32 KB
constexpr int kTileBytes = kStages * (kStageABytes + kStageBBytes);
constexpr int kSmemAlign = 1024;  // the 128-byte swizzle repeats every 1024 bytes

// Two warp groups side by side along N: GEMM1 64 x 128 (each 64 gate and 64 up
// columns), GEMM2 64 x 256.
using Mma1 = decltype(make_tiled_mma(
    SM90_64x64x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::MN>{}, Layout<Shape<_1, _2, _1>>{}));
using Mma2 = decltype(make_tiled_mma(
    SM90_64x128x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::MN>{}, Layout<Shape<_1, _2, _1>>{}));

struct Params {
  int64_t tokens, top_k, experts, hidden, ffn;
  const Elem* x;
  const void* weights;
  const Elem* w_gate_up;
  const Elem* w_down;
  const int64_t* expert_begin;
  const int32_t* row_pair;
  const int32_t* pair_row;
  Elem* x_rows_out;
  Elem* gate_up_out;
  Elem* y;
  Elem* h;           // [R, F] scratch
  Elem* out_rows;    // [R, H] scratch
  uint32_t* h_ready; // [max row blocks]
  uint32_t* gemm2_done;
  uint32_t* ticket;
};

__device__ __forceinline__ uint32_t load_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Every thread's global writes of the task done, then one release increment.
__device__ __forceinline__ void signal(uint32_t* counter) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
  }
}

// Returns when *counter >= target, for every thread of the CTA.
__device__ __forceinline__ void wait_for(const uint32_t* counter, uint32_t target) {
  if (threadIdx.x == 0) {
    while (load_acquire(counter) < target) __nanosleep(64);
    __threadfence();
  }
  __syncthreads();
}

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int bytes = valid ? 16 : 0;  // 0: the 16 bytes are zero-filled
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

__device__ __forceinline__ Elem to_elem(float f) {
  return Elem::bitcast(float_to_bf16(f).bits);
}

// The stage tiles of the shared-memory buffer.
struct Tiles {
  char* base;
  __device__ Elem* a(int stage) const {
    return reinterpret_cast<Elem*>(base + stage * kStageABytes);
  }
  __device__ Elem* b(int stage) const {
    return reinterpret_cast<Elem*>(base + kStages * kStageABytes + stage * kStageBBytes);
  }
};

// The K loop of one task: kStages - 1 stages in flight ahead of the wgmma that
// reads the oldest. load(stage, kb) issues the cp.async of K block kb (every
// thread its share); mma(stage, first) issues and waits for one K block's wgmmas.
template <class Load, class Mma>
__device__ __forceinline__ void k_loop(int k_blocks, Load&& load, Mma&& mma) {
#pragma unroll 1
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_blocks) load(s, s);
    cp_async_commit();
  }
#pragma unroll 1
  for (int kb = 0; kb < k_blocks; ++kb) {
    cp_async_wait<kStages - 2>();
    cutlass::arch::fence_view_async_shared();  // cp.async writes -> wgmma reads
    __syncthreads();  // every thread's stage kb landed; stage kb - 1 is free
    const int next = kb + kStages - 1;
    if (next < k_blocks) load(next % kStages, next);
    cp_async_commit();
    mma(kb % kStages, kb == 0);
  }
  cp_async_wait<0>();
  __syncthreads();
}

// Row block `block` (of all experts' 64-row blocks, in expert order): its expert,
// first row and end row.
struct RowBlock {
  int64_t expert, row0, row_end;
};

__device__ __forceinline__ RowBlock find_block(const int32_t* block_begin, int64_t experts,
                                               const int64_t* expert_begin, int64_t block) {
  int64_t lo = 0, hi = experts;  // the last e with block_begin[e] <= block
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (block_begin[mid] <= block) lo = mid; else hi = mid;
  }
  const int64_t begin = expert_begin[lo];
  return {lo, begin + (block - block_begin[lo]) * kBlockRows, expert_begin[lo + 1]};
}

__device__ void gemm1_task(const Params& p, const Tiles& t, const RowBlock& rb, int64_t col_tile) {
  const int tid = threadIdx.x;
  const int64_t H = p.hidden, F = p.ffn;
  const int64_t f0 = col_tile * kGemm1Cols;
  const int64_t valid_rows = rb.row_end - rb.row0;  // may exceed 64: rows past 64 are the next block's

  // The two A rows this thread loads (chunks tid and tid + 256 of 64 rows x 8).
  const Elem* a_src[2];
  bool a_valid[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int m = (tid + j * kThreads) >> 3;
    a_valid[j] = m < valid_rows;
    a_src[j] = a_valid[j] ? p.x + (p.row_pair[rb.row0 + m] / p.top_k) * H : p.x;
  }
  // The backward's gathered x rows, written once per row block.
  if (p.x_rows_out != nullptr && col_tile == 0) {
    const int64_t rows = valid_rows < kBlockRows ? valid_rows : kBlockRows;
    const int64_t chunks_per_row = H / 8;
    for (int64_t c = tid; c < rows * chunks_per_row; c += kThreads) {
      const int64_t m = c / chunks_per_row, k = (c % chunks_per_row) * 8;
      const int64_t token = p.row_pair[rb.row0 + m] / p.top_k;
      *reinterpret_cast<uint4*>(p.x_rows_out + (rb.row0 + m) * H + k) =
          *reinterpret_cast<const uint4*>(p.x + token * H + k);
    }
  }

  const Elem* w = p.w_gate_up + rb.expert * H * 2 * F;
  auto load = [&](int stage, int kb) {
    const int64_t k0 = int64_t(kb) * kBlockK;
    Tensor sA = make_tensor(make_smem_ptr(t.a(stage)), LayoutA{});
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int c = tid + j * kThreads;
      const int m = c >> 3, kc = (c & 7) * 8;
      const bool ok = a_valid[j] && k0 + kc < H;
      cp_async_16(&sA(m, kc), ok ? a_src[j] + k0 + kc : p.x, ok);
    }
    Tensor sG = make_tensor(make_smem_ptr(t.b(stage)), LayoutB1{});
    Tensor sU = make_tensor(make_smem_ptr(t.b(stage) + kGemm1Cols * kBlockK), LayoutB1{});
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int c = tid + j * kThreads;
      const int k = c >> 5, n = (c & 31) * 8;  // n < 128: gate, else up
      const int nn = n & (kGemm1Cols - 1);
      const bool ok = k0 + k < H && f0 + nn < F;
      const int64_t col = (n < kGemm1Cols ? 0 : F) + f0 + nn;
      const Elem* src = ok ? w + (k0 + k) * 2 * F + col : p.w_gate_up;
      cp_async_16(n < kGemm1Cols ? &sG(nn, k) : &sU(nn, k), src, ok);
    }
  };

  Mma1 mma;
  auto thr = mma.get_thread_slice(tid);
  Tensor acc_g = partition_fragment_C(mma, Shape<Int<kBlockRows>, Int<kGemm1Cols>>{});
  Tensor acc_u = partition_fragment_C(mma, Shape<Int<kBlockRows>, Int<kGemm1Cols>>{});
  auto step = [&](int stage, bool first) {
    Tensor sA = make_tensor(make_smem_ptr(t.a(stage)), LayoutA{});
    Tensor sG = make_tensor(make_smem_ptr(t.b(stage)), LayoutB1{});
    Tensor sU = make_tensor(make_smem_ptr(t.b(stage) + kGemm1Cols * kBlockK), LayoutB1{});
    Tensor rA = thr.make_fragment_A(thr.partition_A(sA));
    Tensor rG = thr.make_fragment_B(thr.partition_B(sG));
    Tensor rU = thr.make_fragment_B(thr.partition_B(sU));
    warpgroup_fence_operand(acc_g);
    warpgroup_fence_operand(acc_u);
    warpgroup_arrive();
    mma.accumulate_ = first ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
#pragma unroll
    for (int k = 0; k < size<2>(rA); ++k) {
      cute::gemm(mma, rA(_, _, k), rG(_, _, k), acc_g);
      cute::gemm(mma, rA(_, _, k), rU(_, _, k), acc_u);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_g);
    warpgroup_fence_operand(acc_u);
  };
  k_loop(static_cast<int>((H + kBlockK - 1) / kBlockK), load, step);

  // SwiGLU on the f32 accumulators: h = round(silu(g) u); the residual round(g, u).
  Tensor coord = thr.partition_C(make_identity_tensor(Shape<Int<kBlockRows>, Int<kGemm1Cols>>{}));
  const int64_t rows = valid_rows < kBlockRows ? valid_rows : kBlockRows;
#pragma unroll
  for (int i = 0; i < size(acc_g); ++i) {
    const int m = get<0>(coord(i));
    const int64_t f = f0 + get<1>(coord(i));
    if (m >= rows || f >= F) continue;
    const int64_t r = rb.row0 + m;
    const float g = acc_g(i), u = acc_u(i);
    p.h[r * F + f] = to_elem(g * sigmoid(g) * u);
    if (p.gate_up_out != nullptr) {
      p.gate_up_out[r * 2 * F + f] = to_elem(g);
      p.gate_up_out[r * 2 * F + F + f] = to_elem(u);
    }
  }
}

__device__ void gemm2_task(const Params& p, const Tiles& t, const RowBlock& rb, int64_t col_tile) {
  const int tid = threadIdx.x;
  const int64_t H = p.hidden, F = p.ffn;
  const int64_t n0 = col_tile * kGemm2Cols;
  const int64_t valid_rows = rb.row_end - rb.row0;
  const Elem* a_src[2];
  bool a_valid[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int m = (tid + j * kThreads) >> 3;
    a_valid[j] = m < valid_rows;
    a_src[j] = p.h + (a_valid[j] ? (rb.row0 + m) * F : 0);
  }
  const Elem* w = p.w_down + rb.expert * F * H;
  auto load = [&](int stage, int kb) {
    const int64_t k0 = int64_t(kb) * kBlockK;
    Tensor sA = make_tensor(make_smem_ptr(t.a(stage)), LayoutA{});
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int c = tid + j * kThreads;
      const int m = c >> 3, kc = (c & 7) * 8;
      const bool ok = a_valid[j] && k0 + kc < F;
      cp_async_16(&sA(m, kc), ok ? a_src[j] + k0 + kc : p.h, ok);
    }
    Tensor sB = make_tensor(make_smem_ptr(t.b(stage)), LayoutB2{});
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int c = tid + j * kThreads;
      const int k = c >> 5, n = (c & 31) * 8;
      const bool ok = k0 + k < F && n0 + n < H;
      cp_async_16(&sB(n, k), ok ? w + (k0 + k) * H + n0 + n : p.w_down, ok);
    }
  };
  Mma2 mma;
  auto thr = mma.get_thread_slice(tid);
  Tensor acc = partition_fragment_C(mma, Shape<Int<kBlockRows>, Int<kGemm2Cols>>{});
  auto step = [&](int stage, bool first) {
    Tensor sA = make_tensor(make_smem_ptr(t.a(stage)), LayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(t.b(stage)), LayoutB2{});
    Tensor rA = thr.make_fragment_A(thr.partition_A(sA));
    Tensor rB = thr.make_fragment_B(thr.partition_B(sB));
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    mma.accumulate_ = first ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
#pragma unroll
    for (int k = 0; k < size<2>(rA); ++k) {
      cute::gemm(mma, rA(_, _, k), rB(_, _, k), acc);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc);
  };
  k_loop(static_cast<int>((F + kBlockK - 1) / kBlockK), load, step);

  Tensor coord = thr.partition_C(make_identity_tensor(Shape<Int<kBlockRows>, Int<kGemm2Cols>>{}));
  const int64_t rows = valid_rows < kBlockRows ? valid_rows : kBlockRows;
#pragma unroll
  for (int i = 0; i < size(acc); ++i) {
    const int m = get<0>(coord(i));
    const int64_t n = n0 + get<1>(coord(i));
    if (m < rows && n < H) p.out_rows[(rb.row0 + m) * H + n] = to_elem(acc(i));
  }
}

// One warp per token, k ascending, f32 sum rounded once (combine_rows' arithmetic).
template <typename W>
__device__ void combine_task(const Params& p, int64_t task) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const W* weights = static_cast<const W*>(p.weights);
  const int64_t H = p.hidden;
  const int64_t t_end = min(p.tokens, (task + 1) * kCombineTokens);
  for (int64_t t = task * kCombineTokens + warp; t < t_end; t += kThreads / 32) {
    for (int64_t c = int64_t(lane) * 8; c < H; c += 32 * 8) {
      float acc[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
      for (int64_t k = 0; k < p.top_k; ++k) {
        const int64_t pair = t * p.top_k + k;
        const int32_t r = p.pair_row[pair];
        if (r < 0) continue;
        const float wk = to_float(weights[pair]);
        const uint4 v = __ldcg(reinterpret_cast<const uint4*>(p.out_rows + int64_t(r) * H + c));
        const bf16* e = reinterpret_cast<const bf16*>(&v);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] += wk * to_float(e[i]);
      }
      uint4 o;
      bf16* oe = reinterpret_cast<bf16*>(&o);
#pragma unroll
      for (int i = 0; i < 8; ++i) oe[i] = float_to_bf16(acc[i]);
      *reinterpret_cast<uint4*>(p.y + t * H + c) = o;
    }
  }
}

template <typename W>
__global__ void __launch_bounds__(kThreads, 1) moe_forward_persistent(Params p) {
  extern __shared__ char smem_raw[];
  char* smem = reinterpret_cast<char*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + kSmemAlign - 1) & ~uintptr_t(kSmemAlign - 1));
  const Tiles tiles{smem};
  int32_t* block_begin = reinterpret_cast<int32_t*>(smem + kTileBytes);  // [E + 1]
  __shared__ int64_t task_slot;

  // Row blocks per expert, prefix-summed (every CTA the same, from the plan).
  using Scan = cub::BlockScan<int32_t, kThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  const int64_t E = p.experts;
  const int64_t per = (E + kThreads - 1) / kThreads;
  const int64_t e0 = threadIdx.x * per, e1 = min(E, e0 + per);
  int32_t mine = 0;
  for (int64_t e = e0; e < e1; ++e) {
    mine += static_cast<int32_t>((p.expert_begin[e + 1] - p.expert_begin[e] + kBlockRows - 1) /
                                 kBlockRows);
  }
  int32_t before = 0, total_blocks = 0;
  Scan(scan_tmp).ExclusiveSum(mine, before, total_blocks);
  for (int64_t e = e0; e < e1; ++e) {
    block_begin[e] = before;
    before += static_cast<int32_t>(
        (p.expert_begin[e + 1] - p.expert_begin[e] + kBlockRows - 1) / kBlockRows);
  }
  if (threadIdx.x == 0) block_begin[E] = total_blocks;
  __syncthreads();

  const int64_t n1 = (p.ffn + kGemm1Cols - 1) / kGemm1Cols;
  const int64_t n2 = (p.hidden + kGemm2Cols - 1) / kGemm2Cols;
  const int64_t gemm1_tasks = int64_t(total_blocks) * n1;
  const int64_t gemm2_tasks = int64_t(total_blocks) * n2;
  const int64_t combine_tasks = (p.tokens + kCombineTokens - 1) / kCombineTokens;
  const int64_t tasks = gemm1_tasks + gemm2_tasks + combine_tasks;

  for (;;) {
    if (threadIdx.x == 0) task_slot = atomicAdd(p.ticket, 1u);
    __syncthreads();
    const int64_t task = task_slot;
    __syncthreads();  // task_slot is rewritten next round
    if (task >= tasks) break;
    if (task < gemm1_tasks) {
      const int64_t block = task / n1;
      gemm1_task(p, tiles, find_block(block_begin, E, p.expert_begin, block), task % n1);
      signal(p.h_ready + block);
    } else if (task < gemm1_tasks + gemm2_tasks) {
      const int64_t i = task - gemm1_tasks;
      const int64_t block = i / n2;
      wait_for(p.h_ready + block, static_cast<uint32_t>(n1));
      gemm2_task(p, tiles, find_block(block_begin, E, p.expert_begin, block), i % n2);
      signal(p.gemm2_done);
    } else {
      wait_for(p.gemm2_done, static_cast<uint32_t>(gemm2_tasks));
      combine_task<W>(p, task - gemm1_tasks - gemm2_tasks);
    }
  }
}

size_t elem_count_bytes(int64_t n) { return static_cast<size_t>(n) * sizeof(Elem); }

int64_t max_row_blocks(const MoeShape& s) {
  return (s.tokens * s.top_k + kBlockRows - 1) / kBlockRows + s.experts;
}

struct Scratch {
  Elem* h;
  Elem* out_rows;
  uint32_t* counters;  // h_ready[max_row_blocks], gemm2_done, ticket
  size_t counter_bytes;
};

Scratch carve(void* ws, const MoeShape& s, size_t* total) {
  const int64_t rows = s.tokens * s.top_k;
  Carver c(ws);
  Scratch b{};
  b.counter_bytes = (max_row_blocks(s) + 2) * sizeof(uint32_t);
  b.counters = static_cast<uint32_t*>(c.take(b.counter_bytes));
  b.h = static_cast<Elem*>(c.take(elem_count_bytes(rows * s.ffn)));
  b.out_rows = static_cast<Elem*>(c.take(elem_count_bytes(rows * s.hidden)));
  *total = c.used();
  return b;
}

size_t dynamic_smem_bytes(int64_t experts) {
  return kTileBytes + kSmemAlign + (experts + 1) * sizeof(int32_t);
}

std::atomic<int> persistent_mode{static_cast<int>(PersistentMode::kAuto)};

}  // namespace

PersistentMode set_persistent_forward(PersistentMode mode) {
  return static_cast<PersistentMode>(persistent_mode.exchange(static_cast<int>(mode)));
}

// The shapes whose chain runs both GEMMs on the tensor cores (grouped_gemm.cu:
// bf16, 16-byte rows), on a device of compute capability 9.0 (the sm_90a code).
bool persistent_forward_supported(const MoeShape& s, Recipe recipe, DType x_dtype) {
  const auto mode = static_cast<PersistentMode>(persistent_mode.load(std::memory_order_relaxed));
  if (mode == PersistentMode::kOff || recipe != Recipe::kNative || x_dtype != DType::kBF16 ||
      s.hidden <= 0 || s.ffn <= 0 || s.hidden % 8 != 0 || s.ffn % 8 != 0 || s.experts <= 0 ||
      s.experts > kMaxExperts || s.tokens * s.top_k >= (int64_t(1) << 31)) {
    return false;
  }
  if (mode == PersistentMode::kAuto && s.tokens * s.top_k > kAutoRowsPerExpert * s.experts) {
    return false;
  }
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    return false;  // the chain reports the error
  }
  return major == 9 && minor == 0;
}

size_t persistent_forward_workspace_bytes(const MoeShape& s) {
  size_t total = 0;
  carve(nullptr, s, &total);
  return total;
}

std::string persistent_forward_prepare(const MoeShape& s, void* workspace, size_t workspace_bytes,
                                       cudaStream_t stream) {
  size_t need = 0;
  const Scratch b = carve(workspace, s, &need);
  if (need > workspace_bytes) return "persistent MoE forward: workspace too small";
  MOK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(b.counters, 0, b.counter_bytes, stream));
  return {};
}

std::string persistent_forward(const PersistentForwardArgs& a, void* workspace,
                               size_t workspace_bytes, cudaStream_t stream) {
  const MoeShape& s = a.shape;
  if (s.tokens == 0) return {};
  size_t need = 0;
  const Scratch b = carve(workspace, s, &need);
  if (need > workspace_bytes) return "persistent MoE forward: workspace too small";
  Params p{};
  p.tokens = s.tokens;
  p.top_k = s.top_k;
  p.experts = s.experts;
  p.hidden = s.hidden;
  p.ffn = s.ffn;
  p.x = static_cast<const Elem*>(a.x);
  p.weights = a.expert_weights;
  p.w_gate_up = static_cast<const Elem*>(a.w_gate_up);
  p.w_down = static_cast<const Elem*>(a.w_down);
  p.expert_begin = a.expert_begin;
  p.row_pair = a.row_pair;
  p.pair_row = a.pair_row;
  p.x_rows_out = static_cast<Elem*>(a.x_rows_out);
  p.gate_up_out = static_cast<Elem*>(a.gate_up_out);
  p.y = static_cast<Elem*>(a.y);
  p.h = b.h;
  p.out_rows = b.out_rows;
  p.h_ready = b.counters;
  p.gemm2_done = b.counters + max_row_blocks(s);
  p.ticket = p.gemm2_done + 1;

  int device = 0, sms = 0;
  MOK_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  MOK_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const size_t smem = dynamic_smem_bytes(s.experts);
  auto kernel = a.weight_dtype == DType::kF32 ? moe_forward_persistent<float>
                                              : moe_forward_persistent<bf16>;
  MOK_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(sms));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  // Cooperative: every CTA resident at once (tasks wait for other CTAs' tasks),
  // or the launch fails rather than hangs.
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  MOK_CUDA_RETURN_IF_ERROR(cudaLaunchKernelEx(&config, kernel, p));
  return {};
}

}  // namespace mok::cuda
