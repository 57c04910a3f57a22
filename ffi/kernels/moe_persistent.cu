#include "moe_persistent.h"

#include <algorithm>
#include <atomic>

#include <cuda.h>

#include <cub/block/block_scan.cuh>

#include "band_order.h"
#include "cuda_check.h"
#include "device_info.h"
#include "cutlass/fast_math.h"
#include "moe_persistent_common.cuh"
#include "swiglu_math.cuh"
#include "workspace.h"

namespace mok::cuda {
namespace {

using namespace persistent;

constexpr int kGemm1Cols = 128;       // F columns per GEMM1 task (gate and up each)
constexpr int kSlabCols = 64;         // B columns per TMA box (one 128-byte swizzle row)
constexpr int kGemm2Cols = 256;       // H columns per GEMM2 task
constexpr int kMaxRanks = kMaxPersistentRanks;  // EP ranks of one launch
// Where the persistent forward tiles by 64 rows (streaming the weights): experts
// average at most this many rows.
constexpr int64_t kNarrowTileRowsPerExpert = 64;
// Auto mode over fewer than kAutoManyExperts experts: the persistent forward where
// experts average at most this many rows, or kAutoRowsPerExpertNoResiduals for a
// forward that writes no residuals (inference).
// At 65-128 rows its 128-row tiles beat the chain's CUTLASS GEMMs (128x256 tiles
// with warp specialisation) without the residuals' stores and are even with them;
// past 128 the chain is faster at some widths and slower at others (the inference
// forward's wider bound for small experts is below; docs/performance.md).
constexpr int64_t kAutoRowsPerExpert = kNarrowTileRowsPerExpert;
constexpr int64_t kAutoRowsPerExpertNoResiduals = 128;
// Auto mode over at least kAutoManyExperts experts: both passes persistent up to
// kAutoRowsPerExpertManyExperts rows per expert. Forward+backward with both took
// 0.94-1.00x the chain's at 16-64 rows per expert over 64 and 128 experts and
// 0.90-1.05x at 128-256 rows over 64 and 128 (b32c591's kernels; the forward alone,
// without residuals, 0.78-0.92x), but 1.15x over 8 experts of F = 14336 (64 rows
// each), and 0.97-1.09x over 8-32 experts at 2048-4096 rows (0.90-0.94x at one
// shape of 1024; 5674849's kernels, one H100), so the chain's backward runs over
// fewer than 64 experts (docs/performance.md).
constexpr int64_t kAutoManyExperts = 64;
constexpr int64_t kAutoRowsPerExpertManyExperts = 256;
// ... and up to kAutoRowsPerExpertSmallExperts rows per expert for small experts,
// H·F at most kAutoSmallExpertElements: there the chain's gathers and combines
// (bytes ∝ R·H against GEMM FLOPs ∝ R·H·F) and its SwiGLU kernels (∝ R·F) weigh
// most, and forward+backward on the persistent kernels, which have none of them, took
// 0.94-0.97x the chain's time at 512 and 1024 rows per expert over 64 and 128
// experts of H = 2048, F = 768 and 1024 (b32c591's kernels), and, queued, 0.96x at
// 2048 rows over 64, 0.97x at 2048 over 128 and 0.99x at 4096 over 64 (7a42a14's;
// one H100 each; docs/performance.md). Past 4096 it is not measured.
constexpr int64_t kAutoSmallExpertElements = int64_t(2048) * 1024;
constexpr int64_t kAutoRowsPerExpertSmallExperts = 4096;
// ... and, over fewer than kAutoManyExperts experts, the forward that writes no
// residuals (inference) up to kAutoRowsPerExpertSmallExperts rows per expert for
// small experts with H at least kAutoInferenceMinHidden: it took 0.88-0.98x the
// chain's time queued at 2048 and 4096 rows per expert over 8, 16 and 32 experts of
// H = 2048, F = 768 and 1024, but 1.05-1.08x at 4096 rows with H = 1024 (GEMM1's K
// loops, over H, are short there against its epilogues); 5674849's kernels, one
// H100 (docs/performance.md). H above 2048 and 129-2047 rows per expert are taken
// by extrapolation; below H = 2048 one shape each won (1024 rows) and lost (4096),
// too few for a bound. Forward+backward over fewer experts was 0.97-1.09x the
// chain's at 2048-4096 rows per expert (0.90-0.94x at one shape of 1024): a forward
// with residuals keeps the chain.
constexpr int64_t kAutoInferenceMinHidden = 2048;
// Past 64 rows per expert the kernel takes 128-row tiles, for E up to this:
// the row-block prefix sums (4 bytes an expert) share shared memory with four 48 KB
// stages, the staging buffers and 3 KB of static shared memory; they would fit up to
// E = 4095, 2048 keeps a margin.
constexpr int64_t kMaxExpertsWideTiles = 2048;

// B's atoms (64 N x 8 K) K first: each 64-column slab of a stage is 64 K rows of
// 128 bytes, one 8 KB TMA box. A stage is four slabs of GEMM1's gate and up
// columns f0..f0+127, ordered so that a thread's accumulators hold matching gate
// and up columns: with 64-row tiles gate, up, gate, up (each warp group's 128
// columns hold them 64 apart), with 128-row tiles gate, gate, up, up (128 apart).
using LayoutSlab = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Elem>{},
                                          Shape<Int<kSlabCols>, Int<kBlockK>>{}, Step<_2, _1>{}));

// The kernel with BM-row tiles: a stage is BM x 256 (A BM x 64, B 64 x 256).
//   BM = 64: five stages; the two consumer warp groups side by side along N,
//     64 x 128 each; epilogues store from the accumulators.
//   BM = 128: four stages; the warp groups one above the other, 64 x 256 each; the
//     epilogues go through an 8 KB staging buffer per warp group (64 x 64 bf16), so
//     that each global store is a whole 128-byte row segment.
template <int BM>
struct Tiles;
template <>
struct Tiles<64> {
  static constexpr int kStages = 5;
  static constexpr int kStagingBytes = 0;
  using Mma = decltype(make_tiled_mma(
      SM90_64x128x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::MN>{},
      Layout<Shape<_1, _2, _1>>{}));
};
template <>
struct Tiles<128> {
  static constexpr int kStages = 4;
  static constexpr int kStagingBytes = 2 * 64 * 64 * 2;
  using Mma = decltype(make_tiled_mma(
      SM90_64x256x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::MN>{},
      Layout<Shape<_2, _1, _1>>{}));
};
template <int BM>
using TaskTile = Shape<Int<BM>, Int<kStageCols>>;
template <int BM>  // a consumer thread's accumulators
using Acc = decltype(partition_fragment_C(typename Tiles<BM>::Mma{}, TaskTile<BM>{}));
template <int BM>
constexpr int smem_tile_bytes() {
  return tile_bytes(Tiles<BM>::kStages, BM) + Tiles<BM>::kStagingBytes;
}

// The weights as the TMA loads see them. W_gate_up[e] is [H, 2F] row-major, viewed
// as (F, H, 2, E): gate (2-mode 0) and up (1) are each bounded by F, so a tile
// past column F reads zeros, not the other half. W_down[e] is [F, H]: (H, F, E).
template <class Ptr>
CUTE_HOST_DEVICE auto gate_up_view(Ptr w, int64_t H, int64_t F, int64_t E) {
  return make_tensor(w, make_layout(make_shape(F, H, int64_t(2), E),
                                    make_stride(Int<1>{}, 2 * F, F, 2 * F * H)));
}
template <class Ptr>
CUTE_HOST_DEVICE auto down_view(Ptr w, int64_t H, int64_t F, int64_t E) {
  return make_tensor(w, make_layout(make_shape(H, F, E), make_stride(Int<1>{}, H, F * H)));
}
using Tile1 = Shape<Int<kSlabCols>, Int<kBlockK>>;  // GEMM1: one slab per copy
using Tile2 = Shape<Int<kGemm2Cols>, Int<kBlockK>>;
auto make_tma1(const Elem* w, int64_t H, int64_t F, int64_t E) {
  return make_tma_atom(SM90_TMA_LOAD{}, gate_up_view(make_gmem_ptr(w), H, F, E), LayoutSlab{},
                       Tile1{});
}
auto make_tma2(const Elem* w, int64_t H, int64_t F, int64_t E) {
  return make_tma_atom(SM90_TMA_LOAD{}, down_view(make_gmem_ptr(w), H, F, E), LayoutB{},
                       Tile2{});
}
using Tma1 = decltype(make_tma1(nullptr, 0, 0, 0));
using Tma2 = decltype(make_tma2(nullptr, 0, 0, 0));

struct Params {
  Tma1 tma1;  // the weight tiles, by TMA into the B stages
  Tma2 tma2;
  // 128-row tiles: the epilogues' TMA stores of 64-row x 64-column tiles from the
  // staging buffers: h [R, F], the residual (gate, up) viewed as (F, 2, R), and the
  // expert-output rows in row order [R, H] (one rank).
  TmaDescriptor h_store, gate_up_store, out_store;
  int64_t tokens, top_k, experts, hidden, ffn;
  int32_t combine_tokens;  // tokens per combine task (combine_tokens_per_task)
  // EP ranks: rank o holds tokens [o T/P, (o+1) T/P) and experts [o E/P, (o+1) E/P);
  // its windows are reached through these pointer tables only.
  int32_t ranks;                  // P (1: the one-device forward)
  int32_t rank_tokens;            // T / P
  int32_t rank_experts;           // E / P
  cutlass::FastDivmod by_rank_tokens;  // t -> (t / (T/P), t % (T/P))
  const Elem* x_win[kMaxRanks];   // rank o's x rows [T/P, H]
  Elem* y_win[kMaxRanks];         // rank o's y rows [T/P, H]
  Elem* recv_win[kMaxRanks];      // rank o's expert-output rows by its pairs [T/P * K, H]
                                  // (P = 1: all rows in row order [R, H])
  const void* weights;
  const int64_t* expert_begin;
  const int32_t* row_pair;
  const int32_t* pair_row;
  Elem* x_rows_out;
  Elem* gate_up_out;
  Elem* h;              // [R, F] scratch
  uint32_t* h_ready;    // [max row blocks]
  uint32_t* gemm2_done; // GEMM2 tasks done, every rank's
  uint32_t* ticket;     // [P]
};

// The ranks' window tables, copied to shared memory at start (indexing the kernel
// parameters by a run-time rank would copy them to local memory).
struct Windows {
  const Elem* x[kMaxRanks];
  Elem* y[kMaxRanks];
  Elem* recv[kMaxRanks];
};

// Token t's x row, read from the window of the rank that holds t.
__device__ __forceinline__ const Elem* x_row(const Params& p, const Windows& w, int64_t token) {
  const RankPlace q = token_place(p.by_rank_tokens, static_cast<int32_t>(token));
  return w.x[q.rank] + q.local * p.hidden;
}

// Where pair `pair`'s expert-output row goes: the receive window of the rank
// that holds its token, at the pair's place among that rank's pairs.
__device__ __forceinline__ Elem* recv_row(const Params& p, const Windows& w, int32_t pair) {
  const RankPlace q = pair_place(p.by_rank_tokens, p.top_k, pair);
  return w.recv[q.rank] + q.local * p.hidden;
}

// Where row `row`'s expert output goes. One rank: the expert-output rows in row
// order (the combine finds a pair's row through pair_row). P ranks: the receive
// window of the rank that holds its token, at the pair's place among its pairs.
__device__ __forceinline__ Elem* out_row(const Params& p, const Windows& w, int64_t row) {
  return p.ranks == 1 ? w.recv[0] + row * p.hidden : recv_row(p, w, p.row_pair[row]);
}

// A task as the producer hands it to the consumers.
enum class Kind : int32_t { kGemm1, kGemm2, kCombine, kEnd };
struct Task {
  Kind kind;
  int32_t tile;   // column tile (GEMM tasks), or combine task number
  int64_t block;  // row block (GEMM tasks)
  RowBlock rb;
};

template <int BM>  // stage barriers, mailbox
using Control = persistent::Control<Task, Tiles<BM>::kStages>;

// Rank o's row blocks: [block_begin[o E/P], block_begin[(o + 1) E/P]).
__device__ __forceinline__ int64_t rank_blocks(const Params& p, const int32_t* block_begin,
                                               int o) {
  return block_begin[(o + 1) * p.rank_experts] - block_begin[o * p.rank_experts];
}

// A rank's numbered task list (every CTA of the rank computes the same): the
// GEMM1 tasks of its experts' row blocks [block0, block0 + row blocks), their
// GEMM2 tasks (numbers up to gemm12), then the combine tasks of its tokens.
// gemm2_all: every rank's GEMM2 tasks. Task numbers are below 2^32
// (persistent_forward checks).
struct TaskList {
  uint32_t* ticket;  // the rank's
  int32_t block0;
  uint32_t n1, n2, gemm1, gemm12, gemm2_all, total;
  __device__ TaskList(const Params& p, int32_t rank, const int32_t* block_begin) {
    ticket = p.ticket + rank;
    n1 = static_cast<uint32_t>((p.ffn + kGemm1Cols - 1) / kGemm1Cols);
    n2 = static_cast<uint32_t>((p.hidden + kGemm2Cols - 1) / kGemm2Cols);
    block0 = block_begin[rank * p.rank_experts];
    const uint32_t row_blocks = static_cast<uint32_t>(rank_blocks(p, block_begin, rank));
    gemm1 = row_blocks * n1;
    gemm12 = gemm1 + row_blocks * n2;
    gemm2_all = static_cast<uint32_t>(block_begin[p.experts]) * n2;
    total = gemm12 + static_cast<uint32_t>((int64_t(p.rank_tokens) + p.combine_tokens - 1) /
                                           p.combine_tokens);  // T / P up to 2^31 - 1
  }
};

// ---- Producer: takes tasks in number order (claimed from the rank's ticket, or
// dealt round robin with 128-row tiles), waits for what each needs, hands it
// to the consumers, then streams its K blocks through the stages (A rows by
// cp.async from every producer thread, the weight tile by TMA from thread 0),
// running ahead across task boundaries as far as the free stages allow.

template <int BM>
__device__ void produce(const Params& p, const Windows& win, Control<BM>& ctl, char* tiles,
                        const int32_t* block_begin,
                        const TaskList& list) {
  const int ptid = threadIdx.x;  // 0..127
  Ring<Tiles<BM>::kStages> st{0, 1u};  // the empty barriers: the first lap passes at once
  Ring<kTaskSlots> mail{0, 1u};
  Tensor mW1 = p.tma1.get_tma_tensor(make_shape(p.ffn, p.hidden, int64_t(2), p.experts));
  Tensor mW2 = p.tma2.get_tma_tensor(make_shape(p.hidden, p.ffn, p.experts));
  // 128-row tiles: tasks dealt round robin over the rank's CTAs, without the
  // ticket's atomic round trip at each task boundary (0-5 % faster at 128 to 4096
  // rows per expert: docs/measurements.md).
  const int32_t rank = static_cast<int32_t>(int64_t(blockIdx.x) * p.ranks / gridDim.x);
  const uint32_t first_cta = (uint32_t(rank) * gridDim.x + p.ranks - 1) / p.ranks;
  const uint32_t ctas = (uint32_t(rank + 1) * gridDim.x + p.ranks - 1) / p.ranks - first_cta;
  for (int claim = 0;; ++claim) {
    const uint32_t t = BM == 128 ? blockIdx.x - first_cta + uint32_t(claim) * ctas
                                 : claim_task(ptid, ctl, list.ticket, claim);
    Task task{};
    if (t < list.gemm1) {
      task.kind = Kind::kGemm1;
      band_order(block_begin, p.experts, list.block0, t, list.n1, &task.tile, &task.block);
    } else if (t < list.gemm12) {
      task.kind = Kind::kGemm2;
      band_order(block_begin, p.experts, list.block0, t - list.gemm1, list.n2, &task.tile,
                 &task.block);
    } else if (t < list.total) {
      task = {Kind::kCombine, int32_t(t - list.gemm12), 0, {}};  // the consumers wait
    } else {
      task.kind = Kind::kEnd;
    }
    if (task.kind == Kind::kGemm1 || task.kind == Kind::kGemm2) {
      task.rb = find_block<BM>(block_begin, p.experts, p.expert_begin, task.block);
    }
    // Handed over before the task's wait: the consumers signal their last task when
    // they see the next (consume), and this wait may be for that signal.
    hand_over(ptid, ctl, mail, task);
    if (task.kind == Kind::kEnd) break;
    if (task.kind == Kind::kCombine) continue;
    if (task.kind == Kind::kGemm2) producer_wait_for(ptid, p.h_ready + task.block, list.n1);

    const RowBlock& rb = task.rb;
    const bool first = task.kind == Kind::kGemm1;
    const int64_t K = first ? p.hidden : p.ffn;
    const Elem* base = first ? win.x[0] : p.h;
    using A = ARowsOf<BM>;
    const A a = first ? A(ptid, rb, base, [&](int m) {
                          return x_row(p, win, p.row_pair[rb.row0 + m] / p.top_k);
                        })
                      : A(ptid, rb, base, [&](int m) { return p.h + (rb.row0 + m) * p.ffn; });
    stream_k_blocks(ptid, ctl, tiles, st, a, K, base, [&](Elem* b, uint64_t& full, int kb) {
      if (first) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // slab j: a half (gate 0, up 1) and a column block
          const int half = BM == 64 ? j % 2 : j / 2, block = BM == 64 ? j / 2 : j % 2;
          Tensor g = local_tile(mW1(_, _, half, rb.expert), Tile1{},
                                make_coord(task.tile * 2 + block, kb));
          Tensor sj = make_tensor(make_smem_ptr(b + j * kSlabCols * kBlockK), LayoutSlab{});
          auto [tg, ts] = tma_partition(p.tma1, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sj),
                                        group_modes<0, 2>(g));
          copy(p.tma1.with(full), tg, ts);
        }
      } else {
        Tensor g = local_tile(mW2(_, _, rb.expert), Tile2{}, make_coord(task.tile, kb));
        Tensor sb = make_tensor(make_smem_ptr(b), LayoutB{});
        auto [tg, ts] = tma_partition(p.tma2, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sb),
                                      group_modes<0, 2>(g));
        copy(p.tma2.with(full), tg, ts);
      }
    });
  }
  producer_drain(ctl, st);
}

// ---- Consumers: the two warp groups' wgmma on the stages, the epilogues from
// their accumulators, and the combine.

// The backward's gathered x rows (when it keeps them), copied from GEMM1's A stages
// while each K block's wgmmas run: the row block's GEMM1 tasks split its K blocks
// (task `tile` of `col_tiles` takes [k_blocks tile / col_tiles, k_blocks (tile + 1) /
// col_tiles)), and of each such stage consumer thread c copies 16-byte chunk c % 8 of
// rows c / 8 + 32 i. Those rows share their swizzle (row m's chunk at byte m * 128 +
// (chunk ^ m % 8) * 16), so the chunks lie 4096 bytes apart; eight consecutive threads
// store a row's whole 128-byte segment.
template <int BM>
struct XRowsCopy {
  static constexpr int kRows = BM / 32;  // rows a thread copies per stage
  Elem* dst;       // the thread's first row of the block, at its chunk (nullptr: none)
  int32_t lo, hi;  // the task's K blocks
  int32_t col;     // the thread's chunk's column in a K block
  uint32_t valid;  // bit i: row c / 8 + 32 i is one of the block's
  // copy: a GEMM1 task of a forward that keeps the x rows.
  __device__ XRowsCopy(const Params& p, const Task& task, uint32_t col_tiles, bool copy) {
    const int ctid = threadIdx.x - kProducerThreads;
    const int m0 = ctid >> 3;
    col = (ctid & 7) * 8;
    const int64_t k_blocks = (p.hidden + kBlockK - 1) / kBlockK;
    lo = static_cast<int32_t>(k_blocks * task.tile / col_tiles);
    hi = static_cast<int32_t>(k_blocks * (task.tile + 1) / col_tiles);
    dst = copy ? p.x_rows_out + (task.rb.row0 + m0) * p.hidden + col : nullptr;
    valid = 0;
#pragma unroll
    for (int i = 0; i < kRows; ++i) valid |= uint32_t(m0 + 32 * i < task.rb.rows()) << i;
  }
  __device__ __forceinline__ void operator()(const Params& p, int kb, const Elem* a) const {
    if (dst == nullptr || kb < lo || kb >= hi || int64_t(kb) * kBlockK + col >= p.hidden) return;
    const uint32_t src = static_cast<uint32_t>(__cvta_generic_to_shared(a)) +
                         sw128_chunk_offset(threadIdx.x - kProducerThreads);
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      if ((valid >> i) & 1u) {
        uint4 v;
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "r"(src + i * 4096));
        *reinterpret_cast<uint4*>(dst + int64_t(32 * i) * p.hidden + int64_t(kb) * kBlockK) = v;
      }
    }
  }
};

// 64-row tiles: a thread's accumulators are (2 x 2 x 16) of its warp group's
// 64 x 128: values 0..31 the 64 gate columns, values 32..63 the up columns 64 to
// their right; values 2j and 2j + 1 are adjacent columns of one row, the first even
// (so with F a multiple of 8, f < F implies f + 1 < F).
__device__ void gemm1_epilogue(const Params& p, const Task& task, const Acc<64>& acc) {
  const int ctid = threadIdx.x - kProducerThreads;
  const RowBlock& rb = task.rb;
  const int64_t F = p.ffn;
  const int64_t rows = rb.rows();
  // SwiGLU on the f32 accumulators: h = round(silu(g) u); the residual round(g, u).
  static_assert(decltype(size(acc))::value == 64);
  typename Tiles<64>::Mma mma;
  auto thr = mma.get_thread_slice(ctid);
  Tensor coord = thr.partition_C(make_identity_tensor(TaskTile<64>{}));
  const int64_t f0 = int64_t(task.tile) * kGemm1Cols;
#pragma unroll
  for (int i = 0; i < 32; i += 2) {
    const int m = get<0>(coord(i));
    const int n = get<1>(coord(i));  // in [0, 64) or [128, 192): a gate column
    const int64_t f = f0 + (n / 128) * kSlabCols + n % kSlabCols;
    if (m >= rows || f >= F) continue;
    const int64_t r = rb.row0 + m;
    const float g0 = acc(i), u0 = acc(i + 32), g1 = acc(i + 1), u1 = acc(i + 33);
    store_pair(p.h + r * F + f, g0 * sigmoid(g0) * u0, g1 * sigmoid(g1) * u1);
    if (p.gate_up_out != nullptr) {
      store_pair(p.gate_up_out + r * 2 * F + f, g0, g1);
      store_pair(p.gate_up_out + r * 2 * F + F + f, u0, u1);
    }
  }
}

__device__ void gemm2_epilogue(const Params& p, const Windows& win, const Task& task,
                               const Acc<64>& acc) {
  const int ctid = threadIdx.x - kProducerThreads;
  const RowBlock& rb = task.rb;
  const int64_t H = p.hidden;
  const int64_t rows = rb.rows();
  typename Tiles<64>::Mma mma;
  auto thr = mma.get_thread_slice(ctid);
  Tensor coord = thr.partition_C(make_identity_tensor(TaskTile<64>{}));
  const int64_t n0 = int64_t(task.tile) * kGemm2Cols;
  // A thread's accumulators lie in two rows, m0 and m0 + 8 (the wgmma C layout);
  // each row goes to its place (out_row).
  const int m0 = get<0>(coord(0));
  Elem* dst[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int m = m0 + 8 * j;
    dst[j] = m < rows ? out_row(p, win, rb.row0 + m) : nullptr;
  }
#pragma unroll
  for (int i = 0; i < size(acc); i += 2) {  // adjacent column pairs (gemm1_epilogue)
    const int m = get<0>(coord(i));
    const int64_t n = n0 + get<1>(coord(i));
    if (m < rows && n < H) store_pair(dst[(m - m0) >> 3] + n, acc(i), acc(i + 1));
  }
}

// 128-row tiles: warp group g holds the task's rows 64 g .. 64 g + 63, all 256
// columns; consumer thread c (lane l, q = l % 4) holds rows r = 16 (c % 128 / 32) +
// l / 4 and r + 8 of its group's, and its value 4j + v is column 8j + 2q + v % 2 of
// row r + 8 (v / 2) (tests/wgmma_c_layout.cu checks this with CuTe).

// The rows one thread of a warp group stores in a staged pass: rows t / 8 + 16 i
// (i < 4) of the group's 64, 16-byte chunk t % 8 of the pass's 64 columns.
struct StagedRows {
  Elem* row[4];  // the row's destination at the tile's column 0, or nullptr
};

// Where a staged pass's tile goes by TMA (a pass whose 64 rows are all the block's):
// `map` at (col, row), or at (col, half, row) of a 3-D map when half >= 0.
struct TileStore {
  const TmaDescriptor* map;  // nullptr: 16-byte stores to the StagedRows
  int32_t col, half, row;
};

// One pass of a warp group's staged epilogue: 64 of its columns, [8 j0, 8 j0 + 64),
// from the accumulators (pack(j, v): the packed pair of values 4j + v and 4j + v + 1,
// v in {0, 2}) into the group's 8 KB staging buffer (16-byte chunks XOR-swizzled by
// row: no bank conflicts either way, and the TMA's 128-byte swizzle), then out:
// with tile.map, one TMA store of the 64 x 64 tile from the group's thread 0 (the
// next pass's writes wait until it has read the buffer); else as 16-byte stores,
// eight threads a 128-byte row segment, to dst.row[i] + col for the chunks below
// `cols`.
template <int J0, class Pack>
__device__ __forceinline__ void staged_pass(Elem* buf, Pack pack, const TileStore& tile,
                                            const StagedRows& dst, int64_t col, int64_t cols) {
  const int t = threadIdx.x % 128, lane = t & 31, i = lane >> 3;
  const int g = (threadIdx.x - kProducerThreads) / 128;
  if (t == 0) tma_store_wait<0>();  // the group's last TMA store has read the buffer
  cutlass::arch::NamedBarrier::sync(128, kWarpGroupSync + g);  // the last pass's reads done
  // By stmatrix: a quad's packed pairs of column group j are the rows of an 8 x 8
  // matrix as stmatrix takes them (wgmma's C layout: lane l holds columns
  // 8j + 2 (l % 4) + {0, 1} of rows l / 4 and l / 4 + 8 of its warp's 16), so one
  // stmatrix.x4 stores groups j and j + 1 of both rows; lane l gives the address of
  // row l % 8 of matrix l / 8 (matrices: group j top, bottom, group j + 1 top, bottom).
  const int m = 16 * (t / 32) + 8 * (i & 1) + (lane & 7);
  const uint32_t row = static_cast<uint32_t>(__cvta_generic_to_shared(buf)) + 128 * m;
#pragma unroll
  for (int jj = 0; jj < 8; jj += 2) {
    const int c = jj + (i >> 1);
    stmatrix_x4(row + ((c ^ (m & 7)) << 4), pack(J0 + jj, 0), pack(J0 + jj, 2),
                pack(J0 + jj + 1, 0), pack(J0 + jj + 1, 2));
  }
  if (tile.map != nullptr) {
    tma_store_fence();  // the writes, then the TMA's reads
    cutlass::arch::NamedBarrier::sync(128, kWarpGroupSync + g);
    if (t == 0) {
      if (tile.half < 0) {
        SM90_TMA_STORE_2D::copy(tile.map, buf, tile.col + 8 * J0, tile.row);
      } else {
        SM90_TMA_STORE_3D::copy(tile.map, buf, tile.col + 8 * J0, tile.half, tile.row);
      }
      tma_store_arrive();
    }
    return;
  }
  cutlass::arch::NamedBarrier::sync(128, kWarpGroupSync + g);
  const int c = t & 7;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int m = t / 8 + 16 * i;
    const uint4 v = *reinterpret_cast<const uint4*>(buf + m * 64 + ((c ^ (m & 7)) * 8));
    if (dst.row[i] != nullptr && 8 * c < cols) {
      *reinterpret_cast<uint4*>(dst.row[i] + col + 8 * c) = v;
    }
  }
}

// The first of the thread's warp group's 64 rows in the block, and whether all 64
// are the block's (whole-tile stores).
__device__ __forceinline__ int32_t group_row0(const RowBlock& rb) {
  return static_cast<int32_t>(rb.row0 + 64 * ((threadIdx.x - kProducerThreads) / 128));
}
__device__ __forceinline__ bool group_rows_full(const RowBlock& rb) {
  return 64 * ((threadIdx.x - kProducerThreads) / 128) + 64 <= rb.rows();
}

// Before a task's signal: the group's TMA stores written, and ordered before the
// generic-proxy release that other CTAs acquire.
__device__ __forceinline__ void tma_stores_done() {
  if (threadIdx.x % 128 == 0) {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.global;" ::: "memory");
  }
}

// The thread's staged rows of its warp group's part of a row block: row(r) for the
// task's row r (of the block) below its rows, else nullptr.
template <class Row>
__device__ __forceinline__ StagedRows staged_rows(const RowBlock& rb, Row row) {
  const int t = threadIdx.x % 128;
  const int g = (threadIdx.x - kProducerThreads) / 128;
  StagedRows d;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t m = 64 * g + t / 8 + 16 * i;
    d.row[i] = m < rb.rows() ? row(m) : nullptr;
  }
  return d;
}

// Values 0..63 (j < 16) are the gate columns f0 .. f0 + 127, values 64..127 the up
// columns 128 to their right (the slab order gate, gate, up, up).
__device__ void gemm1_epilogue(const Params& p, const Task& task, const Acc<128>& acc,
                               Elem* buf) {
  static_assert(decltype(size(acc))::value == 128);
  const RowBlock& rb = task.rb;
  const int64_t F = p.ffn;
  const int64_t f0 = int64_t(task.tile) * kGemm1Cols;
  auto silu_pair = [&](int j, int v) {
    const float g0 = acc(4 * j + v), g1 = acc(4 * j + v + 1);
    const float u0 = acc(4 * (j + 16) + v), u1 = acc(4 * (j + 16) + v + 1);
    return pack_bf16x2(g0 * sigmoid(g0) * u0, g1 * sigmoid(g1) * u1);
  };
  auto gate_pair = [&](int j, int v) { return pack_bf16x2(acc(4 * j + v), acc(4 * j + v + 1)); };
  auto up_pair = [&](int j, int v) {
    return pack_bf16x2(acc(4 * (j + 16) + v), acc(4 * (j + 16) + v + 1));
  };
  // Whole 64-row tiles by TMA (a column past F is not written: the maps end at F).
  const bool tma = group_rows_full(rb);
  const int32_t row = group_row0(rb);
  const int32_t c0 = static_cast<int32_t>(f0);
  const TileStore h_tile{tma ? &p.h_store : nullptr, c0, -1, row};
  const StagedRows h = staged_rows(rb, [&](int64_t m) { return p.h + (rb.row0 + m) * F + f0; });
  staged_pass<0>(buf, silu_pair, h_tile, h, 0, F - f0);
  if (f0 + 64 < F) staged_pass<8>(buf, silu_pair, h_tile, h, 64, F - f0 - 64);
  if (p.gate_up_out != nullptr) {
    const StagedRows gu = staged_rows(
        rb, [&](int64_t m) { return p.gate_up_out + (rb.row0 + m) * 2 * F + f0; });
    const TileStore g_tile{tma ? &p.gate_up_store : nullptr, c0, 0, row};
    const TileStore u_tile{tma ? &p.gate_up_store : nullptr, c0, 1, row};
    staged_pass<0>(buf, gate_pair, g_tile, gu, 0, F - f0);
    if (f0 + 64 < F) staged_pass<8>(buf, gate_pair, g_tile, gu, 64, F - f0 - 64);
    staged_pass<0>(buf, up_pair, u_tile, gu, F, F - f0);
    if (f0 + 64 < F) staged_pass<8>(buf, up_pair, u_tile, gu, F + 64, F - f0 - 64);
  }
}

__device__ void gemm2_epilogue(const Params& p, const Windows& win, const Task& task,
                               const Acc<128>& acc, Elem* buf) {
  static_assert(decltype(size(acc))::value == 128);
  const RowBlock& rb = task.rb;
  const int64_t H = p.hidden;
  const int64_t n0 = int64_t(task.tile) * kGemm2Cols;
  auto pair = [&](int j, int v) { return pack_bf16x2(acc(4 * j + v), acc(4 * j + v + 1)); };
  // One rank, whole 64-row tiles: by TMA into the row-ordered expert-output rows.
  const bool tma = p.ranks == 1 && group_rows_full(rb);
  const int32_t row = group_row0(rb);
  const TileStore tile{tma ? &p.out_store : nullptr, static_cast<int32_t>(n0), -1, row};
  const StagedRows y = staged_rows(rb, [&](int64_t m) { return out_row(p, win, rb.row0 + m) + n0; });
  staged_pass<0>(buf, pair, tile, y, 0, H - n0);
  if (n0 + 64 < H) staged_pass<8>(buf, pair, tile, y, 64, H - n0 - 64);
  if (n0 + 128 < H) staged_pass<16>(buf, pair, tile, y, 128, H - n0 - 128);
  if (n0 + 192 < H) staged_pass<24>(buf, pair, tile, y, 192, H - n0 - 192);
}

// Rank `rank`'s combine task: y for p.combine_tokens of its tokens (combine_tokens);
// per column the token's K rows times their weights, k ascending, summed in f32 and
// rounded once (combine_rows' arithmetic, sum_pair_rows). Its rows: one rank's from
// the row-ordered expert-output rows by pair_row, P ranks' from the rank's receive
// window at the pairs' places; y into the rank's y window.
template <typename W>
__device__ void combine_task(const Params& p, const Windows& win, int32_t rank, int64_t task) {
  combine_tokens<W>(threadIdx.x - kProducerThreads, p.combine_tokens, p.pair_row,
                    static_cast<const W*>(p.weights), task * p.combine_tokens, p.rank_tokens,
                    int64_t(rank) * p.rank_tokens, p.top_k, p.ranks == 1, win.recv[0],
                    win.recv[rank], win.y[rank], p.hidden);
}

// A GEMM task's outputs are signalled (its counter raised) one task late: the
// wait for its stores to land runs under the next task's first wgmmas, not with
// the tensor cores idle. Unless the next task may wait for the signal: a GEMM1
// task waits for nothing and a GEMM2 task for GEMM1 tasks only, so the signal is
// given first when a GEMM2 task follows a GEMM1 task, and before a combine task
// (which waits for every GEMM2 task) or the end.
template <typename W, int BM>
__device__ void consume(const Params& p, const Windows& win, Control<BM>& ctl, char* tiles,
                        Elem* staging, int32_t rank, const TaskList& list) {
  Ring<Tiles<BM>::kStages> st{0, 0u};
  Ring<kTaskSlots> mail{0, 0u};
  // The warp group's 8 KB staging buffer (128-row tiles).
  Elem* buf = staging + (threadIdx.x - kProducerThreads) / 128 * (64 * 64);
  uint32_t* unsignalled = nullptr;  // the last GEMM task's counter (the same in every thread)
  auto signal = [&] {
    if (unsignalled == nullptr) return;
    if constexpr (BM == 128) tma_stores_done();
    consumer_signal(unsignalled);
    unsignalled = nullptr;
  };
  bool gemm2_all_done = false;
  for (;;) {
    const Task task = take_task(ctl, mail);
    if (task.kind == Kind::kEnd) {
      signal();
      return;
    }
    if (task.kind == Kind::kCombine) {
      signal();
      if (!gemm2_all_done) {  // a rank's tokens have rows at every rank's experts
        consumer_wait_for(p.gemm2_done, list.gemm2_all);
        gemm2_all_done = true;
      }
      combine_task<W>(p, win, rank, task.tile);
      continue;
    }
    const bool first = task.kind == Kind::kGemm1;
    if (!first && unsignalled != p.gemm2_done) signal();
    const int64_t K = first ? p.hidden : p.ffn;
    // Declared per task, so that the accumulators are dead across the combine and
    // between tasks: live across them, ptxas keeps part of them outside the wgmma's
    // registers and moves them in and out around every K block (138-142 moves in
    // the 128-row loop; scripts/sass_k_loops.py checks the loops).
    Acc<BM> acc;
    const XRowsCopy<BM> x_rows(p, task, list.n1, first && p.x_rows_out != nullptr);
    auto copy_x = [&](int kb, const Elem* a) { x_rows(p, kb, a); };
    mma_k_loop<typename Tiles<BM>::Mma, LayoutARows<BM>, LayoutB>(
        ctl, tiles, st, static_cast<int>((K + kBlockK - 1) / kBlockK), acc, signal, copy_x);
    signal();  // (done already in the K loop, but for an empty one)
    if (first) {
      if constexpr (BM == 64) {
        gemm1_epilogue(p, task, acc);
      } else {
        gemm1_epilogue(p, task, acc, buf);
      }
      unsignalled = p.h_ready + task.block;
    } else {
      if constexpr (BM == 64) {
        gemm2_epilogue(p, win, task, acc);
      } else {
        gemm2_epilogue(p, win, task, acc, buf);
      }
      unsignalled = p.gemm2_done;
    }
  }
}

template <typename W, int BM>
__global__ void __launch_bounds__(kThreads, 1)
    moe_forward_persistent(const __grid_constant__ Params p) {
  char* tiles = aligned_dynamic_smem();
  Elem* staging = reinterpret_cast<Elem*>(tiles + tile_bytes(Tiles<BM>::kStages, BM));
  int32_t* block_begin = reinterpret_cast<int32_t*>(tiles + smem_tile_bytes<BM>());  // [E + 1]
  __shared__ Control<BM> ctl;
  __shared__ Windows win;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int o = 0; o < kMaxRanks; ++o) {  // constant indices: read from the parameters
      win.x[o] = p.x_win[o];
      win.y[o] = p.y_win[o];
      win.recv[o] = p.recv_win[o];
    }
    prefetch_tma_descriptor(p.tma1.get_tma_descriptor());
    prefetch_tma_descriptor(p.tma2.get_tma_descriptor());
    if constexpr (BM == 128) {
      prefetch_tma_descriptor(&p.h_store);
      if (p.ranks == 1) prefetch_tma_descriptor(&p.out_store);
      if (p.gate_up_out != nullptr) prefetch_tma_descriptor(&p.gate_up_store);
    }
    init_control(ctl);
  }

  // Row blocks per expert, prefix-summed (every CTA the same, from the plan).
  using Scan = cub::BlockScan<int32_t, kThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  scan_row_blocks<kThreads, Scan, BM>(p.expert_begin, p.experts, block_begin, scan_tmp);

  // This CTA's rank: the CTAs in P contiguous groups of (nearly) equal size.
  const int32_t rank = static_cast<int32_t>(int64_t(blockIdx.x) * p.ranks / gridDim.x);
  const TaskList list(p, rank, block_begin);
  if (threadIdx.x < kProducerThreads) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    produce<BM>(p, win, ctl, tiles, block_begin, list);
  } else {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
    consume<W, BM>(p, win, ctl, tiles, staging, rank, list);
  }
}

size_t elem_count_bytes(int64_t n) { return static_cast<size_t>(n) * sizeof(Elem); }

int64_t max_row_blocks(const MoeShape& s) {
  return persistent::max_row_blocks(s.tokens * s.top_k, s.experts);
}

struct Scratch {
  Elem* h;
  Elem* recv[kMaxRanks];  // each rank's receive window, its own allocation
  uint32_t* counters;     // h_ready[max_row_blocks], gemm2_done, ticket[kMaxRanks]
  size_t counter_bytes;
};

Scratch carve(void* ws, const MoeShape& s, int ranks, size_t* total) {
  // The launchers reject ranks outside [1, kMaxRanks] (persistent_ranks_error); the
  // sizes asked for them are those of the nearest valid count.
  ranks = std::clamp(ranks, 1, kMaxRanks);
  const int64_t rows = s.tokens * s.top_k;
  Carver c(ws);
  Scratch b{};
  b.counter_bytes = (max_row_blocks(s) + 1 + kMaxRanks) * sizeof(uint32_t);
  b.counters = static_cast<uint32_t*>(c.take(b.counter_bytes));
  b.h = static_cast<Elem*>(c.take(elem_count_bytes(rows * s.ffn)));
  for (int o = 0; o < ranks; ++o) {
    b.recv[o] = static_cast<Elem*>(c.take(elem_count_bytes(rows / ranks * s.hidden)));
  }
  *total = c.used();
  return b;
}


// The 128-row epilogues' TMA stores: 64 x 64 boxes in the staging buffers' 128-byte
// swizzle, over h [R, F], the expert-output rows [R, H] (one rank: `out` null
// otherwise, when the rows go to the ranks' receive windows by 16-byte stores) and
// the residual (gate, up) [R, 2F] viewed as (F, 2, R), so that a box never runs
// from gate into up.
std::string encode_epilogue_stores(Params* p, const MoeShape& s, void* h, void* out,
                                   void* gate_up) {
  auto encode = [](TmaDescriptor* d, void* base, cuuint32_t rank, const cuuint64_t* dims,
                   const cuuint64_t* strides, const cuuint32_t* box) {
    const cuuint32_t unit[3] = {1, 1, 1};
    return CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
               d, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, base, dims, strides, box, unit,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
               CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) ==
           CUDA_SUCCESS;
  };
  const cuuint64_t R = cuuint64_t(s.tokens * s.top_k), H = cuuint64_t(s.hidden),
                   F = cuuint64_t(s.ffn);
  const cuuint32_t box2[2] = {64, 64}, box3[3] = {64, 1, 64};
  const cuuint64_t h_dims[2] = {F, R}, h_strides[1] = {F * 2};
  const cuuint64_t out_dims[2] = {H, R}, out_strides[1] = {H * 2};
  const cuuint64_t gu_dims[3] = {F, 2, R}, gu_strides[2] = {F * 2, F * 4};
  if (!encode(&p->h_store, h, 2, h_dims, h_strides, box2) ||
      (out != nullptr && !encode(&p->out_store, out, 2, out_dims, out_strides, box2)) ||
      (gate_up != nullptr &&
       !encode(&p->gate_up_store, gate_up, 3, gu_dims, gu_strides, box3))) {
    return "persistent MoE forward: cuTensorMapEncodeTiled failed for the epilogue stores";
  }
  return {};
}

std::atomic<int> persistent_mode{static_cast<int>(PersistentMode::kAuto)};

}  // namespace

PersistentMode set_persistent_kernels(PersistentMode mode) {
  return static_cast<PersistentMode>(persistent_mode.exchange(static_cast<int>(mode)));
}

// The shapes whose chain runs both GEMMs on the tensor cores (grouped_gemm.cu:
// bf16, 16-byte rows), on a device of compute capability 9.0 (the sm_90a code).
bool persistent_can_run(const MoeShape& s, Recipe recipe, DType x_dtype) {
  if (recipe != Recipe::kNative || x_dtype != DType::kBF16 || s.hidden <= 0 || s.ffn <= 0 ||
      s.hidden % 8 != 0 || s.ffn % 8 != 0 || s.experts <= 0 || s.experts > kMaxExperts ||
      s.tokens * s.top_k >= (int64_t(1) << 31)) {
    return false;
  }
  DeviceInfo info;
  if (!current_device_info(&info).empty()) return false;  // the caller reports the error
  return info.cc == 90;
}

namespace {

// AUTO's bound on both passes' rows per expert over kAutoManyExperts or more
// experts (0 below them).
int64_t auto_rows_per_expert_many_experts(const MoeShape& s) {
  if (s.experts < kAutoManyExperts) return 0;
  return s.hidden * s.ffn <= kAutoSmallExpertElements ? kAutoRowsPerExpertSmallExperts
                                                      : kAutoRowsPerExpertManyExperts;
}

// AUTO's bound on the rows per expert of a forward that writes no residuals, over
// any number of experts (the larger bound over kAutoManyExperts or more is
// auto_rows_per_expert_many_experts').
int64_t auto_rows_per_expert_no_residuals(const MoeShape& s) {
  return s.hidden >= kAutoInferenceMinHidden && s.hidden * s.ffn <= kAutoSmallExpertElements
             ? kAutoRowsPerExpertSmallExperts
             : kAutoRowsPerExpertNoResiduals;
}

}  // namespace

bool persistent_supported(const MoeShape& s, Recipe recipe, DType x_dtype, bool residuals) {
  const auto mode = static_cast<PersistentMode>(persistent_mode.load(std::memory_order_relaxed));
  if (mode == PersistentMode::kOff) return false;
  const int64_t auto_rows =
      std::max(residuals ? kAutoRowsPerExpert : auto_rows_per_expert_no_residuals(s),
               auto_rows_per_expert_many_experts(s));
  if (mode == PersistentMode::kAuto && s.tokens * s.top_k > auto_rows * s.experts) return false;
  return persistent_can_run(s, recipe, x_dtype);
}

int persistent_forward_tile_rows(const MoeShape& s) {
  return s.tokens * s.top_k > kNarrowTileRowsPerExpert * s.experts &&
                 s.experts <= kMaxExpertsWideTiles
             ? 128
             : 64;
}

bool persistent_backward_supported(const MoeShape& s, Recipe recipe, DType x_dtype) {
  const auto mode = static_cast<PersistentMode>(persistent_mode.load(std::memory_order_relaxed));
  if (mode == PersistentMode::kOff) return false;
  if (mode == PersistentMode::kAuto &&
      (s.tokens * s.top_k > auto_rows_per_expert_many_experts(s) * s.experts ||
       s.experts < kAutoManyExperts)) {
    return false;
  }
  return persistent_can_run(s, recipe, x_dtype);
}

size_t persistent_forward_workspace_bytes(const MoeShape& s, int ranks) {
  size_t total = 0;
  carve(nullptr, s, ranks, &total);
  return total;
}

std::string persistent_forward_prepare(const MoeShape& s, void* workspace, size_t workspace_bytes,
                                       cudaStream_t stream, int ranks) {
  MOK_RETURN_IF_MESSAGE(persistent_ranks_error(s, ranks));
  size_t need = 0;
  const Scratch b = carve(workspace, s, ranks, &need);
  if (need > workspace_bytes) return "persistent MoE forward: workspace too small";
  MOK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(b.counters, 0, b.counter_bytes, stream));
  return {};
}

std::string persistent_forward(const PersistentForwardArgs& a, void* workspace,
                               size_t workspace_bytes, cudaStream_t stream) {
  const MoeShape& s = a.shape;
  if (s.tokens == 0) return {};
  MOK_RETURN_IF_MESSAGE(persistent_ranks_error(s, a.ranks));
  size_t need = 0;
  const Scratch b = carve(workspace, s, a.ranks, &need);
  if (need > workspace_bytes) return "persistent MoE forward: workspace too small";
  Params p{};
  p.tokens = s.tokens;
  p.top_k = s.top_k;
  p.experts = s.experts;
  p.hidden = s.hidden;
  p.ffn = s.ffn;
  // The TMA descriptors need 16-byte aligned bases and 16-byte strides (H and F are
  // multiples of 8: persistent_supported).
  if (!aligned16(a.w_gate_up) || !aligned16(a.w_down)) {
    return "persistent MoE forward: the expert weights are not 16-byte aligned";
  }
  if (!aligned16(a.y)) {  // the combine's 16-byte stores
    return "persistent MoE forward: y is not 16-byte aligned";
  }
  p.tma1 = make_tma1(static_cast<const Elem*>(a.w_gate_up), s.hidden, s.ffn, s.experts);
  p.tma2 = make_tma2(static_cast<const Elem*>(a.w_down), s.hidden, s.ffn, s.experts);
  if (!encoded(p.tma1) || !encoded(p.tma2)) {
    return "persistent MoE forward: cuTensorMapEncodeTiled failed for the expert weights";
  }
  // Rank o's windows: its slices of x and y, and its receive window in the scratch.
  p.ranks = a.ranks;
  p.rank_tokens = static_cast<int32_t>(s.tokens / a.ranks);
  p.rank_experts = static_cast<int32_t>(s.experts / a.ranks);
  p.by_rank_tokens = cutlass::FastDivmod(p.rank_tokens);
  for (int o = 0; o < a.ranks; ++o) {
    p.x_win[o] = static_cast<const Elem*>(a.x) + int64_t(o) * p.rank_tokens * s.hidden;
    p.y_win[o] = static_cast<Elem*>(a.y) + int64_t(o) * p.rank_tokens * s.hidden;
    p.recv_win[o] = b.recv[o];
  }
  p.weights = a.expert_weights;
  p.expert_begin = a.expert_begin;
  p.row_pair = a.row_pair;
  p.pair_row = a.pair_row;
  p.x_rows_out = static_cast<Elem*>(a.x_rows_out);
  p.gate_up_out = static_cast<Elem*>(a.gate_up_out);
  p.h = b.h;
  p.h_ready = b.counters;
  p.gemm2_done = b.counters + max_row_blocks(s);
  p.ticket = p.gemm2_done + 1;

  DeviceInfo info;
  MOK_RETURN_IF_MESSAGE(current_device_info(&info));
  if (a.ranks > info.sm_count) return "persistent MoE forward: more ranks than SMs";
  p.combine_tokens = combine_tokens_per_task(p.rank_tokens, info.sm_count / a.ranks);
  const int64_t tasks = max_row_blocks(s) * ((s.ffn + kGemm1Cols - 1) / kGemm1Cols +
                                             (s.hidden + kGemm2Cols - 1) / kGemm2Cols) +
                        s.tokens / kCombineSlots + 1;
  // Every CTA claims one ticket past the last task: no claim may wrap around 2^32.
  if (tasks + info.sm_count >= (int64_t(1) << 32)) {
    return "persistent MoE forward: 2^32 tasks or more";
  }
  const bool f32_weights = a.weight_dtype == DType::kF32;
  if (persistent_forward_tile_rows(s) == 128) {
    MOK_RETURN_IF_MESSAGE(encode_epilogue_stores(&p, s, b.h, a.ranks == 1 ? b.recv[0] : nullptr,
                                                 a.gate_up_out));
    auto kernel = f32_weights ? moe_forward_persistent<float, 128>
                              : moe_forward_persistent<bf16, 128>;
    return launch_one_cta_per_sm(kernel, p, dynamic_smem_bytes(smem_tile_bytes<128>(), s.experts),
                                 info.sm_count, stream);
  }
  auto kernel = f32_weights ? moe_forward_persistent<float, 64> : moe_forward_persistent<bf16, 64>;
  return launch_one_cta_per_sm(kernel, p, dynamic_smem_bytes(smem_tile_bytes<64>(), s.experts),
                               info.sm_count, stream);
}

}  // namespace mok::cuda
