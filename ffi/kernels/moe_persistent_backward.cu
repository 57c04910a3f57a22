// The MoE backward after the routing plan as one persistent kernel (moe_persistent.h).
#include <cub/block/block_scan.cuh>

#include <algorithm>

#include "cuda_check.h"
#include "device_info.h"
#include "moe_persistent.h"
#include "moe_persistent_backward_tasks.h"
#include "moe_persistent_common.cuh"
#include "swiglu_math.cuh"
#include "workspace.h"

namespace mok::cuda {
namespace {

using namespace persistent;
using backward_tasks::Counter;
using backward_tasks::Kind;
using backward_tasks::kWideRows;
using backward_tasks::TaskId;
using backward_tasks::TaskList;
using backward_tasks::tiles_of;
static_assert(backward_tasks::kTileCols == kStageCols &&
              backward_tasks::kTileRows == kBlockRows);

// The kernel comes in two instantiations by its row blocks' height, kSlot (also the
// weight gradients' M tile and the rows of a stage slot's A region):
//   kSlot = 64: four 40 KB stages and two 8 KB store buffers per consumer warp group;
//   kSlot = 128: four 48 KB stages and one 8 KB store buffer per group.
// Each group rounds its weight-gradient tile 64 x 64 at a time into its buffers, and
// a TMA store writes each part out while the group goes on.
constexpr int kStages = 4;
constexpr int kMaxRanks = kMaxPersistentRanks;  // EP ranks of one launch
using PartTile = Shape<Int<kBlockRows>, Int<kBlockK>>;  // a 64 x 64 store part
using LayoutC = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{}, PartTile{}));
constexpr int kPartBytes = kBlockRows * kBlockK * 2;  // 8 KB
constexpr int group_parts(int slot) { return slot == kBlockRows ? 2 : 1; }
constexpr int tiles_bytes(int slot) {
  return tile_bytes(kStages, slot) + 2 * group_parts(slot) * kPartBytes;
}
static_assert(tiles_bytes(kBlockRows) == tile_bytes(kStages) + 32 * 1024 &&
              tiles_bytes(kWideRows) == tile_bytes(kStages, kWideRows) + 16 * 1024);
// setmaxnreg: the producer's task decoding and weight-gradient loads need more than
// the forward's 56 registers (it spilled there).
constexpr int kBwdProducerRegs = 88;
constexpr int kBwdConsumerRegs = 208;
static_assert(regs_split_fits(kBwdProducerRegs, kBwdConsumerRegs));

// The dgrads read the weights as B [N, K] K-major tiles; the weight gradients read
// both operands from rows ([rows, M] and [rows, N]: M- and N-major tiles).
using MmaKK = decltype(make_tiled_mma(
    SM90_64x128x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>{}, Layout<Shape<_1, _2, _1>>{}));
using MmaMN = decltype(make_tiled_mma(
    SM90_64x128x16_F32BF16BF16_SS<GMMA::Major::MN, GMMA::Major::MN>{},
    Layout<Shape<_1, _2, _1>>{}));
using AccKK = decltype(partition_fragment_C(MmaKK{}, StageTile{}));
using AccMN = decltype(partition_fragment_C(MmaMN{}, StageTile{}));
// The dgrads of 128-row blocks (kSlot = 128): the warp groups one above the other,
// 64 x 256 each, over A [128 rows, 64] and B [256, 64] stages, as the weight
// gradients' 128-row tiles.
using WideTile = Shape<Int<kWideRows>, Int<kStageCols>>;
using MmaKKW = decltype(make_tiled_mma(
    SM90_64x256x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>{},
    Layout<Shape<_2, _1, _1>>{}));
using AccKKW = decltype(partition_fragment_C(MmaKKW{}, WideTile{}));
// A dgrad task's MMA, tile and accumulators for row blocks of kRows.
template <int kRows>
struct Dgrad {
  using Mma = MmaKK;
  using Tile = StageTile;
  using Acc = AccKK;
};
template <>
struct Dgrad<kWideRows> {
  using Mma = MmaKKW;
  using Tile = WideTile;
  using Acc = AccKKW;
};

// The weight gradients past 128 rows per expert: 128 x 256 tiles (the warp groups
// one above the other, 64 x 256 each) over 64-row K blocks. A stage then holds A
// [128 M, 64 rows] (the slot's whole A region) and B [256 N, 64 rows]: 4.2 MFLOP
// for 48 KB of loads, twice a 64-row task's work per stage in flight (85 FLOP a
// byte, against 51).
using LayoutAW = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Elem>{},
                                        Shape<Int<kWideRows>, Int<kBlockK>>{}, Step<_2, _1>{}));
static_assert(cosize(LayoutAW{}) * sizeof(Elem) == stage_a_bytes(kWideRows));
using MmaMNW = decltype(make_tiled_mma(
    SM90_64x256x16_F32BF16BF16_SS<GMMA::Major::MN, GMMA::Major::MN>{},
    Layout<Shape<_2, _1, _1>>{}));
using AccMNW = decltype(partition_fragment_C(MmaMNW{}, Shape<Int<kWideRows>, Int<kStageCols>>{}));

// A weight gradient's K blocks over an expert's `rows` rows: 64-row blocks, zero-padded
// as in the chain's weight-gradient GEMM, whose k16 steps (zeros included: -0 + 0 is
// +0) the kernel's must match for its bits.
__host__ __device__ constexpr int wgrad_k_blocks(int64_t rows) {
  return static_cast<int>((rows + kBlockRows - 1) / kBlockRows);
}

// A stage slot's A and B tiles.
template <int kSlot>
__device__ __forceinline__ Elem* slot_a(char* tiles, int slot) {
  return stage_a<kSlot>(tiles, slot);
}
template <int kSlot>
__device__ __forceinline__ Elem* slot_b(char* tiles, int slot) {
  return stage_b<kStages, kSlot>(tiles, slot);
}

// A weight as the TMA loads see it, (N, K, E) with K contiguous: W_down[e] [F, H] is
// dgrad2's B (N = F, K = H), W_gate_up[e] [H, 2F] dgrad1's (N = H, K = 2F).
template <class Ptr>
CUTE_HOST_DEVICE auto k_major_view(Ptr w, int64_t N, int64_t K, int64_t E) {
  return make_tensor(w, make_layout(make_shape(N, K, E), make_stride(K, Int<1>{}, N * K)));
}
using TileBK = Shape<Int<kStageCols>, Int<kBlockK>>;
auto make_tma_k(const Elem* w, int64_t N, int64_t K, int64_t E) {
  return make_tma_atom(SM90_TMA_LOAD{}, k_major_view(make_gmem_ptr(w), N, K, E), LayoutBK{},
                       TileBK{});
}
using TmaK = decltype(make_tma_k(nullptr, 0, 0, 0));

// A weight gradient [E, M, N] (N contiguous) as the TMA stores see it: (M, N, E),
// written 64 x 64 at a time (clipped at M and N).
auto make_tma_store(Elem* d, int64_t M, int64_t N, int64_t E) {
  auto view = make_tensor(make_gmem_ptr(d),
                          make_layout(make_shape(M, N, E), make_stride(N, Int<1>{}, M * N)));
  return make_tma_atom(SM90_TMA_STORE{}, view, LayoutC{}, PartTile{});
}
using TmaStore = decltype(make_tma_store(nullptr, 0, 0, 0));

// Rows [R, C] (C contiguous: wh, the dy rows, the x rows, d gate_up) as the weight
// gradients' TMA loads see them, (C, R): a K block is 64 rows of 64 columns (the A
// tile, M-major) or 256 (the B tile, N-major), from any first row.
template <class Ptr>
CUTE_HOST_DEVICE auto rows_view(Ptr rows, int64_t C, int64_t R) {
  return make_tensor(rows, make_layout(make_shape(C, R), make_stride(Int<1>{}, C)));
}
using TileAM = Shape<Int<kBlockRows>, Int<kBlockK>>;
using TileBN = Shape<Int<kStageCols>, Int<kBlockK>>;
auto make_tma_rows_a(const Elem* rows, int64_t C, int64_t R) {
  return make_tma_atom(SM90_TMA_LOAD{}, rows_view(make_gmem_ptr(rows), C, R), LayoutAM{},
                       TileAM{});
}
auto make_tma_rows_b(const Elem* rows, int64_t C, int64_t R) {
  return make_tma_atom(SM90_TMA_LOAD{}, rows_view(make_gmem_ptr(rows), C, R), LayoutB{},
                       TileBN{});
}
using TmaRowsA = decltype(make_tma_rows_a(nullptr, 0, 0));
using TmaRowsB = decltype(make_tma_rows_b(nullptr, 0, 0));
// The wide weight gradients' A blocks: 64 rows of 128 columns.
using TileAW = Shape<Int<kWideRows>, Int<kBlockK>>;
auto make_tma_rows_aw(const Elem* rows, int64_t C, int64_t R) {
  return make_tma_atom(SM90_TMA_LOAD{}, rows_view(make_gmem_ptr(rows), C, R), LayoutAW{},
                       TileAW{});
}
using TmaRowsAW = decltype(make_tma_rows_aw(nullptr, 0, 0));

// SwiGLU's backward streams its row block through the stages kSwRows rows at a
// time: 256 columns of gate, of up (bf16) and of dh (f32) by TMA into the B tile's
// 32 KB (rows [kSwRows, 256], row-major, unswizzled: a warp reads a row's 256
// columns across its lanes), and the dy rows of whole weight-gradient K blocks by
// cp.async, 256 columns in the A tile beside a SwiGLU chunk, or kDyPerB chunks in
// the B tile once the row's SwiGLU chunks are done (H > F).
constexpr int kSwRows = 16;
constexpr int kSwBf16Bytes = kSwRows * kStageCols * 2;            // 8 KB
constexpr int kSwStageBytes = 2 * kSwBf16Bytes + kSwRows * kStageCols * 4;  // gate, up, dh
static_assert(kSwStageBytes <= kStageBBytes && kSwBf16Bytes <= kStageABytes);
using TileSw = Shape<Int<kStageCols>, Int<kSwRows>>;
using LayoutSw = Layout<TileSw, Stride<_1, Int<kStageCols>>>;
template <class T>
auto make_tma_rows_sw(const T* rows, int64_t C, int64_t R) {
  return make_tma_atom(SM90_TMA_LOAD{}, rows_view(make_gmem_ptr(rows), C, R), LayoutSw{},
                       TileSw{});
}
using TmaSwBf16 = decltype(make_tma_rows_sw<Elem>(nullptr, 0, 0));
using TmaSwF32 = decltype(make_tma_rows_sw<float>(nullptr, 0, 0));

// A SwiGLU task's stages for one group of kSwRows rows: nf with a SwiGLU chunk each
// (256 columns of F; with dy chunk s in the A tile while s < nh), then, when the
// group copies dy, its remaining chunks kDyPerB a stage in the B tile. Producer and
// consumers walk the same list.
struct SwigluStages {
  static constexpr int kDyPerB = kStageBBytes / kSwBf16Bytes;  // 4
  int nf, nh;
  struct Stage {
    int sw;      // SwiGLU chunk, or -1
    int d0, dn;  // dy chunks [d0, d0 + dn)
    bool dy_in_b;
  };
  __device__ int count(bool dy) const {
    return nf + (dy && nh > nf ? (nh - nf + kDyPerB - 1) / kDyPerB : 0);
  }
  __device__ Stage at(int s, bool dy) const {
    if (s < nf) return {s, s, dy && s < nh ? 1 : 0, false};
    const int d0 = nf + (s - nf) * kDyPerB;
    return {-1, d0, min(kDyPerB, nh - d0), true};
  }
};

// Whether group q of a row block copies its dy rows: its rows' 64-row K block of the
// weight gradients (those of the expert from rb.row0 on) is whole (a group lies in
// one such block).
__device__ __forceinline__ bool swiglu_group_dy(const RowBlock& rb, int q) {
  return rb.row0 + (int64_t(q) * kSwRows / kBlockRows + 1) * kBlockRows <= rb.row_end;
}

struct Params {
  TmaK tma_down;     // W_down as (F, H, E)
  TmaK tma_gate_up;  // W_gate_up as (H, 2F, E)
  TmaStore tma_d_down;     // d W_down as (F, H, E)
  TmaStore tma_d_gate_up;  // d W_gate_up as (H, 2F, E)
  // The weight gradients' whole K blocks: dW_down's A (wh as (F, R)) and B (dy rows
  // as (H, R)), dW_gate_up's A (x rows as (H, R)) and B (d gate_up as (2F, R)).
  TmaRowsA tma_wh, tma_x_rows;
  TmaRowsB tma_dy_rows, tma_dgu;
  TmaRowsAW tma_wh_w, tma_x_rows_w;  // the A blocks of 128-row M tiles (kSlot = 128)
  TmaSwBf16 tma_gate_up_sw;          // SwiGLU's stages: the forward's gate_up as (2F, R)
  TmaSwF32 tma_dh_sw;                // and dh as (F, R)
  uint32_t wgrad_n;                  // N tiles per weight-gradient task (TaskList::wgrad_n)
  int64_t tokens, top_k, experts, hidden, ffn;
  // EP ranks: rank o holds tokens [o T/P, (o+1) T/P) (their dy, dx, weights and
  // d weights are its windows, reached through these pointer tables only) and
  // experts [o E/P, (o+1) E/P) (their rows' residuals and scratch, and their weight
  // gradients). P = 1: the one-device backward.
  int32_t ranks;
  int32_t rank_tokens;                 // T / P
  int32_t combine_tokens;              // tokens per combine task (combine_tokens_per_task)
  int32_t rank_experts;                // E / P
  cutlass::FastDivmod by_rank_tokens;  // t -> (t / (T/P), t % (T/P))
  const Elem* dy_win[kMaxRanks];       // rank o's dy rows [T/P, H]
  Elem* dx_win[kMaxRanks];             // rank o's dx rows [T/P, H]
  const void* w_win[kMaxRanks];        // rank o's expert_weights [T/P, K]
  void* dw_win[kMaxRanks];             // rank o's d expert_weights [T/P, K]
  Elem* recv_win[kMaxRanks];           // rank o's dx rows by its pairs [T/P * K, H]
                                       // (P = 1: all rows in row order [R, H])
  const Elem* x_rows;    // [R, H] the forward's gathered x rows
  const int64_t* expert_begin;
  const int32_t* row_pair;
  const int32_t* pair_row;
  float* dh;             // [R, F] scratch: dy rows @ W_down^T, f32
  Elem* wh;              // [R, F] scratch: round(w h), dW_down's A
  Elem* dgu;             // [R, 2F] scratch: d gate_up
  Elem* dy_rows;         // [R, H] scratch: the dy rows of whole 64-row K blocks, in row order
  uint32_t* block_ready;   // [row blocks]: dgrad2 tiles done, + 1 once SwiGLU's backward is
  uint32_t* expert_ready;  // [E]: the expert's row blocks through SwiGLU's backward
  uint32_t* dgrad1_done;   // dgrad1 tasks done, every rank's
  uint32_t* ticket;        // [P]
};

// The ranks' window tables, copied to shared memory at start (indexing the kernel
// parameters by a run-time rank would copy them to local memory).
struct Windows {
  const Elem* dy[kMaxRanks];
  Elem* dx[kMaxRanks];
  const void* w[kMaxRanks];
  void* dw[kMaxRanks];
  Elem* recv[kMaxRanks];
};

// Token t's dy row, read from the window of the rank that holds t.
__device__ __forceinline__ const Elem* dy_row(const Params& p, const Windows& w, int32_t token) {
  const RankPlace q = token_place(p.by_rank_tokens, token);
  return w.dy[q.rank] + q.local * p.hidden;
}

// Row `row`'s dy row: its pair's token's.
__device__ __forceinline__ const Elem* dy_of_row(const Params& p, const Windows& w, int64_t row) {
  return dy_row(p, w, p.row_pair[row] / static_cast<int32_t>(p.top_k));
}

// Where row `row`'s dx row goes. One rank: the dx rows in row order (the combine
// finds a pair's row through pair_row). P ranks: the receive window of the rank
// that holds its token, at the pair's place among its pairs.
__device__ __forceinline__ Elem* dx_row_out(const Params& p, const Windows& w, int64_t row) {
  if (p.ranks == 1) return w.recv[0] + row * p.hidden;
  const RankPlace q = pair_place(p.by_rank_tokens, p.top_k, p.row_pair[row]);
  return w.recv[q.rank] + q.local * p.hidden;
}

struct Task {
  Kind kind;
  int32_t tile;   // N tile (dgrad tasks; a weight gradient's first) or combine task number
  int32_t mtile;  // M tile (weight-gradient tasks)
  int64_t block;  // row block (dgrad and SwiGLU tasks) or expert (weight gradients)
  RowBlock rb;    // its rows (a weight gradient's: all of the expert's rows)
};

using Control = persistent::Control<Task, kStages>;  // stage barriers, mailbox

// The weight gradients' M tile (the kernel's kSlot): 128 rows past 128 rows per
// expert, else 64 (at fewer rows a task's epilogues outweigh its K loop, and 64-row
// tiles make twice the tasks); 64 past kMaxExpertsWideWgrad experts, whose row-block
// prefix sums would not fit beside the 48 KB stages.
constexpr int64_t kMaxExpertsWideWgrad = 2048;
int backward_wgrad_rows(const MoeShape& s) {
  return s.tokens * s.top_k > int64_t(kWideRows) * s.experts &&
                 s.experts <= kMaxExpertsWideWgrad
             ? kWideRows
             : kBlockRows;
}

// The host's bound on the task count (persistent_backward checks it is below 2^32).
int64_t max_tasks(const MoeShape& s) {
  const int64_t blocks = max_row_blocks(s.tokens * s.top_k, s.experts);
  return blocks * (tiles_of(s.ffn, kStageCols) + 1 + tiles_of(s.hidden, kStageCols)) +
         s.experts * (int64_t(tiles_of(s.ffn, kBlockRows)) * tiles_of(s.hidden, kStageCols) +
                      int64_t(tiles_of(s.hidden, kBlockRows)) * tiles_of(2 * s.ffn, kStageCols)) +
         tiles_of(s.tokens, kCombineSlots) + 1;
}

// ---- Producer

// One K block of a weight-gradient tile by cp.async (an expert's last block, with
// fewer than 64 rows; whole blocks go by TMA): A [kM M, 64 rows] M-major (SA) from the
// A rows, B [256 N, 64 rows] N-major (LayoutB) from the B rows, zeros past the rows,
// M or N. Eight threads a row, 16-byte chunk ptid % 8 of every 128 bytes of it, rows
// ptid / 8 + 16 i: a warp's copy reads four whole 128-byte lines (and writes each
// into shared memory in one wavefront), where two threads a row read 32 bytes of
// each of 16 rows.
template <int kSlot, int kM, class SA, class ARow, class BRow>
__device__ __forceinline__ void load_wgrad_block(int ptid, char* tiles, int slot, int64_t r0,
                                                 int64_t rows, int64_t m0, int64_t M, int64_t n0,
                                                 int64_t N, const Elem* base, ARow a_row,
                                                 BRow b_row) {
  constexpr int kRowsAtOnce = kProducerThreads / 8;
  const int c0 = ptid % 8;
  Tensor sA = make_tensor(make_smem_ptr(slot_a<kSlot>(tiles, slot)), SA{});
  Tensor sB = make_tensor(make_smem_ptr(slot_b<kSlot>(tiles, slot)), LayoutB{});
#pragma unroll 1
  for (int r = ptid / 8; r < kBlockRows; r += kRowsAtOnce) {
    const bool valid = r < rows;
    const Elem* a = valid ? a_row(r0 + r) + m0 : base;
    const Elem* b = valid ? b_row(r0 + r) + n0 : base;
#pragma unroll
    for (int c = c0; c < kM / 8; c += 8) {
      const bool ok = valid && m0 + 8 * c < M;
      cp_async_16(&sA(8 * c, r), ok ? a + 8 * c : base, ok);
    }
#pragma unroll
    for (int c = c0; c < kStageCols / 8; c += 8) {
      const bool ok = valid && n0 + 8 * c < N;
      cp_async_16(&sB(8 * c, r), ok ? b + 8 * c : base, ok);
    }
  }
}

// Columns [c0 + C col_tile, c0 + C (col_tile + 1)) of rows [r0, r0 + K) of a [R, cols]
// array by `tma` (a (C, K) `tile` of rows_view) into `smem` laid out as `layout`, its
// bytes counted on `full` (past cols or R: zeros).
template <class Tma, class Tile, class SmemLayout, class T>
__device__ __forceinline__ void load_rows_tile(const Tma& tma, uint64_t& full, int64_t cols,
                                               int64_t R, int64_t c0, int64_t r0, Tile tile,
                                               SmemLayout layout, T* smem, int32_t col_tile) {
  Tensor sm = make_tensor(make_smem_ptr(smem), layout);
  Tensor rows_t = tma.get_tma_tensor(make_shape(cols, R));
  Tensor g = local_tile(domain_offset(make_coord(c0, r0), rows_t), tile, make_coord(col_tile, 0));
  auto [tg, ts] =
      tma_partition(tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sm), group_modes<0, 2>(g));
  copy(tma.with(full), tg, ts);
}

// A SwiGLU task's stages (SwigluStages): thread 0 loads the gate, up and dh chunks
// by TMA; the dy chunks of a group that copies them come by cp.async, eight threads
// a row, 16 bytes at a time, from the row's token's dy row.
template <int kSlot>
__device__ void stream_swiglu(int ptid, const Params& p, const Windows& win, Control& ctl,
                              char* tiles, Ring<kStages>& st, const RowBlock& rb) {
  const int64_t R = p.tokens * p.top_k, F = p.ffn, H = p.hidden;
  const SwigluStages plan{static_cast<int>(tiles_of(F, kStageCols)),
                          static_cast<int>(tiles_of(H, kStageCols))};
  const int rho = ptid / 8, part = ptid % 8;  // this thread's row of a group, first piece
  for (int q = 0; int64_t(q) * kSwRows < rb.rows(); ++q) {
    const int64_t r0 = rb.row0 + int64_t(q) * kSwRows;
    const bool dy = swiglu_group_dy(rb, q);
    const bool mine = dy && int64_t(q) * kSwRows + rho < rb.rows();
    const Elem* dy_src = mine ? dy_of_row(p, win, r0 + rho) : nullptr;
    const int n = plan.count(dy);
#pragma unroll 1
    for (int s = 0; s < n; ++s) {
      const SwigluStages::Stage sg = plan.at(s, dy);
      Barrier::wait(&ctl.empty[st.slot], st.phase);
      char* b = reinterpret_cast<char*>(slot_b<kSlot>(tiles, st.slot));
      if (mine) {
        Elem* d = sg.dy_in_b ? reinterpret_cast<Elem*>(b) : slot_a<kSlot>(tiles, st.slot);
#pragma unroll 1
        for (int i = 0; i < sg.dn; ++i) {
          const int64_t c0 = int64_t(sg.d0 + i) * kStageCols;
          Elem* row = d + (i * kSwRows + rho) * kStageCols;
#pragma unroll
          for (int k = part; k < kStageCols / 8; k += 8) {
            if (c0 + 8 * k < H) cp_async_16(row + 8 * k, dy_src + c0 + 8 * k, true);
          }
        }
      }
      cutlass::arch::cpasync_barrier_arrive_noinc(&ctl.full[st.slot]);
      if (ptid == 0) {
        uint64_t& full = ctl.full[st.slot];
        if (sg.sw >= 0) {
          Barrier::arrive_and_expect_tx(&full, kSwStageBytes);
          // 256 columns sw of gate, up and dh for the group's rows (gate's may run
          // into up's columns, and a block's last group into the next block's rows,
          // which other CTAs may be writing: the consumers take neither).
          auto load = [&](const auto& tma, int64_t cols, int64_t c0, auto* smem) {
            load_rows_tile(tma, full, cols, R, c0, r0, TileSw{}, LayoutSw{}, smem, sg.sw);
          };
          load(p.tma_gate_up_sw, 2 * F, 0, reinterpret_cast<Elem*>(b));
          load(p.tma_gate_up_sw, 2 * F, F, reinterpret_cast<Elem*>(b + kSwBf16Bytes));
          load(p.tma_dh_sw, F, 0, reinterpret_cast<float*>(b + 2 * kSwBf16Bytes));
        } else {
          Barrier::arrive(&full);  // no TMA bytes in this stage
        }
      }
      st.advance();
    }
  }
}

template <int kSlot>
__device__ void produce(const Params& p, const Windows& win, Control& ctl, char* tiles,
                        const int32_t* block_begin, const TaskList& list, uint32_t* ticket) {
  const int ptid = threadIdx.x;  // 0..127
  const int64_t H = p.hidden, F = p.ffn;
  Ring<kStages> st{0, 1u};
  Ring<kTaskSlots> mail{0, 1u};
  Tensor mDown = p.tma_down.get_tma_tensor(make_shape(F, H, p.experts));
  Tensor mGateUp = p.tma_gate_up.get_tma_tensor(make_shape(H, 2 * F, p.experts));
  const int64_t R = p.tokens * p.top_k;
  constexpr bool wide = kSlot == kWideRows;
  for (int claim = 0;; ++claim) {
    const uint32_t t = claim_task(ptid, ctl, ticket, claim);
    const TaskId id = list.at(t, block_begin);
    Task task{id.kind, id.tile, id.mtile, id.block, {}};
    switch (id.wait) {
      case Counter::kBlockReady:
        producer_wait_for(ptid, p.block_ready + id.wait_index, id.wait_target);
        break;
      case Counter::kExpertReady:
        producer_wait_for(ptid, p.expert_ready + id.wait_index, id.wait_target);
        break;
      case Counter::kDgrad1Done:
        producer_wait_for(ptid, p.dgrad1_done, id.wait_target);
        break;
      case Counter::kNone:
        break;
    }
    if (task.kind == Kind::kWgradDown || task.kind == Kind::kWgradGateUp) {
      // The expert's SwiGLU tasks wrote the rows its TMA loads read (wh, d gate_up,
      // dy rows) with generic stores: after the acquire, order them before the async
      // proxy's reads.
      if (ptid == 0) asm volatile("fence.proxy.async.global;" ::: "memory");
      const int64_t e = task.block;
      const int64_t begin = p.expert_begin[e], end = p.expert_begin[e + 1];
      task.rb = {e, begin, end, min(end - begin, int64_t(kBlockRows))};
    }
    if (task.kind == Kind::kDgrad2 || task.kind == Kind::kSwiglu || task.kind == Kind::kDgrad1) {
      task.rb = find_block<kSlot>(block_begin, p.experts, p.expert_begin, task.block);
    }
    hand_over(ptid, ctl, mail, task);
    if (task.kind == Kind::kEnd) break;
    if (task.kind == Kind::kCombine) continue;
    if (task.kind == Kind::kSwiglu) {
      // The block's dgrad2 tasks wrote dh with generic stores: after the acquire,
      // order them before the TMA loads.
      if (ptid == 0) asm volatile("fence.proxy.async.global;" ::: "memory");
      stream_swiglu<kSlot>(ptid, p, win, ctl, tiles, st, task.rb);
      continue;
    }

    const RowBlock& rb = task.rb;
    if (task.kind == Kind::kDgrad2 || task.kind == Kind::kDgrad1) {
      const bool second = task.kind == Kind::kDgrad2;
      const int64_t K = second ? H : 2 * F;
      const Elem* base = second ? win.dy[0] : p.dgu;
      using Rows = ARowsOf<kSlot>;  // the row block's rows
      const Rows a = second ? Rows(ptid, rb, base, [&](int m) {
                                 return dy_of_row(p, win, rb.row0 + m);
                               })
                            : Rows(ptid, rb, base, [&](int m) {
                                 return p.dgu + (rb.row0 + m) * 2 * F;
                               });
      auto issue_b = [&](Elem* b, uint64_t& full, int kb) {
        Tensor sb = make_tensor(make_smem_ptr(b), LayoutBK{});
        auto issue = [&](const TmaK& tma, auto& mW) {
          Tensor g = local_tile(mW(_, _, rb.expert), TileBK{}, make_coord(task.tile, kb));
          auto [tg, ts] = tma_partition(tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sb),
                                        group_modes<0, 2>(g));
          copy(tma.with(full), tg, ts);
        };
        if (second) {
          issue(p.tma_down, mDown);
        } else {
          issue(p.tma_gate_up, mGateUp);
        }
      };
      stream_k_blocks<kSlot>(ptid, ctl, tiles, st, a, K, base, issue_b);
      continue;
    }
    // A weight gradient (M tiles of 64, or 128 when wide): for each of the task's N
    // tiles, the expert's rows in ascending 64-row K blocks. A whole block by TMA (wh
    // and the dy rows the SwiGLU tasks copied; the x rows and d gate_up); an expert's
    // last, partial block by cp.async (the rows past it are the next expert's: zeros
    // instead).
    const bool down = task.kind == Kind::kWgradDown;
    const int64_t M = down ? F : H, N = down ? H : 2 * F;
    const int64_t m0 = int64_t(task.mtile) * kSlot;
    const int64_t rows = rb.row_end - rb.row0;
    const int k_blocks = wgrad_k_blocks(rows);
    // The task's N tiles: [task.tile, task.tile + n_tiles).
    const int n_tiles =
        min(static_cast<int>(tiles_of(N, kStageCols)) - task.tile, static_cast<int>(p.wgrad_n));
    const Elem* a_rows = down ? p.wh : p.x_rows;  // [R, M]
    auto a_row = [&](int64_t r) { return a_rows + r * M; };
    auto b_row = [&](int64_t r) { return down ? dy_of_row(p, win, r) : p.dgu + r * N; };
#pragma unroll 1
    for (int step = 0; step < n_tiles * k_blocks; ++step) {
      const int kb = step % k_blocks;
      const int32_t nt = task.tile + step / k_blocks;
      const int64_t n0 = int64_t(nt) * kStageCols;
      Barrier::wait(&ctl.empty[st.slot], st.phase);
      const int64_t r0 = rb.row0 + int64_t(kb) * kBlockRows;
      const int64_t n_rows = min(int64_t(kBlockRows), rb.row_end - r0);  // <= 0: zeros
      if (n_rows < kBlockRows) {
        if constexpr (wide) {
          load_wgrad_block<kSlot, kWideRows, LayoutAW>(
              ptid, tiles, st.slot, r0, n_rows, m0, M, n0, N, p.dgu, a_row, b_row);
        } else {
          load_wgrad_block<kSlot, kBlockRows, LayoutAM>(
              ptid, tiles, st.slot, r0, n_rows, m0, M, n0, N, p.dgu, a_row, b_row);
        }
        cutlass::arch::cpasync_barrier_arrive_noinc(&ctl.full[st.slot]);
        if (ptid == 0) Barrier::arrive(&ctl.full[st.slot]);  // no TMA bytes in this stage
      } else {
        cutlass::arch::cpasync_barrier_arrive_noinc(&ctl.full[st.slot]);
        if (ptid == 0) {
          uint64_t& full = ctl.full[st.slot];
          auto load = [&](const auto& tma, int64_t cols, auto tile, auto layout, Elem* smem,
                          int32_t col_tile) {
            load_rows_tile(tma, full, cols, R, 0, r0, tile, layout, smem, col_tile);
          };
          Elem* sa = slot_a<kSlot>(tiles, st.slot);
          Elem* sb = slot_b<kSlot>(tiles, st.slot);
          if constexpr (wide) {
            Barrier::arrive_and_expect_tx(&full, stage_a_bytes(kWideRows) + kStageBBytes);
            load(down ? p.tma_wh_w : p.tma_x_rows_w, M, TileAW{}, LayoutAW{}, sa, task.mtile);
            load(down ? p.tma_dy_rows : p.tma_dgu, N, TileBN{}, LayoutB{}, sb, nt);
          } else {
            Barrier::arrive_and_expect_tx(&full, kStageABytes + kStageBBytes);
            load(down ? p.tma_wh : p.tma_x_rows, M, TileAM{}, LayoutAM{}, sa, task.mtile);
            load(down ? p.tma_dy_rows : p.tma_dgu, N, TileBN{}, LayoutB{}, sb, nt);
          }
        }
      }
      st.advance();
    }
  }
  producer_drain(ctl, st);
}

// ---- Consumers

// Calls store(m, n, v0, v1) for each pair of adjacent accumulators (columns n and
// n + 1 of row m; n even) of this thread's part of the Tile (64 x 256 or 128 x 256).
template <class Mma, class Tile = StageTile, class Acc, class Store>
__device__ __forceinline__ void for_each_pair(const Acc& acc, Store store) {
  const int ctid = threadIdx.x - kProducerThreads;
  Mma mma;
  auto thr = mma.get_thread_slice(ctid);
  Tensor coord = thr.partition_C(make_identity_tensor(Tile{}));
#pragma unroll
  for (int i = 0; i < size(acc); i += 2) {
    store(get<0>(coord(i)), get<1>(coord(i)), acc(i), acc(i + 1));
  }
}

// The warp's 16 rows x 64 columns of a tile's accumulators (this thread's values
// kV .. kV + 31) rounded to bf16 (pack_bf16x2, the hardware's conversion: these are
// accumulators) into 16 rows of 128 bytes of shared memory from `rows` on, 16-byte
// chunk c of row mm at 128 mm + 16 (c ^ mm % 8) (the 128-byte swizzle), by four
// stmatrix.x4 a thread. wgmma's C layout (checked on the host for every MMA here,
// tests/wgmma_c_layout.cu): consumer thread c (lane l, quad position q = l % 4)
// holds rows r = 16 (c % 128 / 32) + l / 4 and r + 8 of its warp group's 64 (64 x
// 256 tiles: columns from 128 (c / 128) on; 128 x 256: rows from 64 (c / 128) on),
// its values 4j + {0, 1} at columns 8j + 2q + {0, 1} of row r and 4j + {2, 3} the
// same of row r + 8. So a quad's packed pairs of a column group j are the rows of an
// 8 x 8 matrix as stmatrix takes them: one instruction stores four (groups j and
// j + 1, rows r and r + 8), with no exchange between lanes; lane l gives the address
// of row l % 8 of matrix l / 8. Each matrix's eight rows fill the 32 banks once.
template <int kV, class Acc>
__device__ __forceinline__ void stmatrix_slice(const Acc& acc, uint32_t rows) {
  static_assert(kV % 32 == 0 && kV + 32 <= decltype(size(acc))::value);
  const int lane = (threadIdx.x - kProducerThreads) & 31, i = lane >> 3;
  const uint32_t row = rows + 128 * (8 * (i & 1) + (lane & 7));
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    const int c = 2 * t + (i >> 1);  // the chunk (column group) of this lane's matrix
    stmatrix_x4(row + ((c ^ (lane & 7)) << 4), pack_bf16x2(acc(kV + 8 * t), acc(kV + 8 * t + 1)),
                pack_bf16x2(acc(kV + 8 * t + 2), acc(kV + 8 * t + 3)),
                pack_bf16x2(acc(kV + 8 * t + 4), acc(kV + 8 * t + 5)),
                pack_bf16x2(acc(kV + 8 * t + 6), acc(kV + 8 * t + 7)));
  }
}

// A weight-gradient store part: the warp group's 64 rows x the 64 columns of values
// kV .. kV + 31 into `part`, 64 x 64 laid out as LayoutC (row m's chunk c at byte
// 128 m + 16 (c ^ m % 8); tests/wgmma_c_layout.cu checks it), each warp its 16 rows.
template <int kV, class Acc>
__device__ __forceinline__ void stage_part(const Acc& acc, Elem* part) {
  const int warp = (threadIdx.x - kProducerThreads) / 32 % 4;
  stmatrix_slice<kV>(acc, static_cast<uint32_t>(__cvta_generic_to_shared(part)) +
                              warp * (kPartBytes / 4));
}

// The warp's 16 rows x the 64 columns of values kV .. kV + 31 through the warp's
// 2 KB of shared memory `stage`, read back 16 bytes a lane, eight lanes a row:
// put(mm, c, v) for row mm (0-15) and 8-column chunk c (0-7) of the warp's slice.
// Only the warp touches `stage`; the caller makes sure no earlier reader (a TMA
// store) still needs it.
template <int kV, class Acc, class Put>
__device__ __forceinline__ void warp_part_out(const Acc& acc, Elem* stage, Put put) {
  const int lane = (threadIdx.x - kProducerThreads) & 31;
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(stage));
  stmatrix_slice<kV>(acc, base);
  __syncwarp();
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int mm = 4 * u + (lane >> 3), c = lane & 7;
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(base + 128 * mm + ((c ^ (mm & 7)) << 4))
                 : "memory");
    put(mm, c, v);
  }
  __syncwarp();
}

// Every consumer thread's writes done, then release increments of both counters.
__device__ __forceinline__ void consumer_signal2(uint32_t* a, uint32_t* b) {
  consumer_sync();
  if (threadIdx.x == kProducerThreads) {
    __threadfence();
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(a) : "memory");
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(b) : "memory");
  }
}

// Four bf16 values (dst 8-byte aligned: F % 8 == 0) in one store.
__device__ __forceinline__ void store_bf16x4(bf16* dst, const Vec<bf16, 4>& v) {
  uint2 w;
  memcpy(&w, &v, sizeof(w));
  store_global_8(dst, w.x, w.y);
}

// SwiGLU's backward over a row block, from the stages stream_swiglu fills: each
// warp takes two rows of a group and computes swiglu_backward_vec on each lane's
// columns in the order swiglu_backward_row gives them (256 columns a stage: lane l's
// 4 l + 128 j, j = 0, 1), so the bits (d expert_weights' lane sums and xor tree
// included) are the chain's. It writes wh, d gate_up and d expert_weights, and a
// group in a whole weight-gradient K block copies its dy rows from the stages to
// dy_rows in row order, where dW_down's TMA loads read them.
// A pair's combine weight and d weight live in the window of its token's rank.
template <typename W, int kSlot>
__device__ void swiglu_task(const Params& p, const Windows& win, Control& ctl, char* tiles,
                            Ring<kStages>& st, const RowBlock& rb) {
  constexpr int kRowsPerWarp = kSwRows / (kConsumerThreads / 32);
  const int ctid = threadIdx.x - kProducerThreads;
  const int warp = ctid >> 5, lane = ctid & 31;
  const int64_t F = p.ffn, H = p.hidden;
  const SwigluStages plan{static_cast<int>(tiles_of(F, kStageCols)),
                          static_cast<int>(tiles_of(H, kStageCols))};
  for (int q = 0; int64_t(q) * kSwRows < rb.rows(); ++q) {
    const bool dy = swiglu_group_dy(rb, q);
    bool ok[kRowsPerWarp];
    float w[kRowsPerWarp], dw[kRowsPerWarp];
    RankPlace place[kRowsPerWarp];
#pragma unroll
    for (int j = 0; j < kRowsPerWarp; ++j) {
      const int64_t m = int64_t(q) * kSwRows + warp * kRowsPerWarp + j;
      ok[j] = m < rb.rows();
      dw[j] = 0.0f, w[j] = 0.0f, place[j] = {};
      if (ok[j]) {
        place[j] = pair_place(p.by_rank_tokens, p.top_k, p.row_pair[rb.row0 + m]);
        w[j] = to_float(static_cast<const W*>(win.w[place[j].rank])[place[j].local]);
      }
    }
    const int n = plan.count(dy);
#pragma unroll 1
    for (int s = 0; s < n; ++s) {
      const SwigluStages::Stage sg = plan.at(s, dy);
      Barrier::wait(&ctl.full[st.slot], st.phase);
      const char* b = reinterpret_cast<const char*>(slot_b<kSlot>(tiles, st.slot));
#pragma unroll
      for (int j = 0; j < kRowsPerWarp; ++j) {
        if (!ok[j]) continue;
        const int rho = warp * kRowsPerWarp + j;
        const int64_t r = rb.row0 + int64_t(q) * kSwRows + rho;
        if (sg.sw >= 0) {
          const bf16* gs = reinterpret_cast<const bf16*>(b) + rho * kStageCols;
          const bf16* us = reinterpret_cast<const bf16*>(b + kSwBf16Bytes) + rho * kStageCols;
          const float* ds =
              reinterpret_cast<const float*>(b + 2 * kSwBf16Bytes) + rho * kStageCols;
          bf16* wh = reinterpret_cast<bf16*>(p.wh + r * F);
          bf16* dg = reinterpret_cast<bf16*>(p.dgu + r * 2 * F);
#pragma unroll
          for (int k = 0; k < 2; ++k) {
            const int c = 4 * lane + 128 * k;
            const int64_t f = int64_t(sg.sw) * kStageCols + c;
            if (f >= F) continue;
            const Vec<bf16, 4> gv = load_vec<bf16, 4>(gs + c), uv = load_vec<bf16, 4>(us + c);
            const float4 d4 = *reinterpret_cast<const float4*>(ds + c);
            const Vec<float, 4> dv{{d4.x, d4.y, d4.z, d4.w}};
            Vec<bf16, 4> hv, dgv, duv;
            swiglu_backward_vec<bf16, 4>(gv, uv, dv, w[j], dw[j], hv, dgv, duv);
            store_bf16x4(wh + f, hv);
            store_bf16x4(dg + f, dgv);
            store_bf16x4(dg + F + f, duv);
          }
        }
        if (dy) {  // H % 8 == 0: 16-byte chunks
          const Elem* d = sg.dy_in_b ? reinterpret_cast<const Elem*>(b)
                                     : slot_a<kSlot>(tiles, st.slot);
#pragma unroll 1
          for (int i = 0; i < sg.dn; ++i) {
            const int64_t c = int64_t(sg.d0 + i) * kStageCols + 8 * lane;
            if (c < H) {
              *reinterpret_cast<uint4*>(p.dy_rows + r * H + c) =
                  *reinterpret_cast<const uint4*>(d + (i * kSwRows + rho) * kStageCols + 8 * lane);
            }
          }
        }
      }
      __syncwarp();
      if (lane == 0) Barrier::arrive(&ctl.empty[st.slot]);
      st.advance();
    }
#pragma unroll
    for (int j = 0; j < kRowsPerWarp; ++j) {
      if (!ok[j]) continue;
      const float total = warp_sum_fixed(dw[j]);
      if (lane == 0) {
        static_cast<W*>(win.dw[place[j].rank])[place[j].local] = from_float<W>(total);
      }
    }
  }
}

// Rank `rank`'s combine task: dx for p.combine_tokens of its tokens (combine_tokens):
// each token's dx rows (one rank: by their rows; P ranks: from the rank's receive
// window, at the pairs' places) summed over k ascending in f32 and rounded once
// (combine_rows' arithmetic without weights); an unrouted or dropped pair adds
// nothing and gets d expert_weights = 0.
template <typename W>
__device__ void combine_task(const Params& p, const Windows& win, int32_t rank, int64_t task) {
  const int ctid = threadIdx.x - kProducerThreads;
  const int64_t K = p.top_k, local0 = task * p.combine_tokens;
  W* d_weights = static_cast<W*>(win.dw[rank]);
  for (int64_t i = ctid; i < p.combine_tokens * K; i += kConsumerThreads) {
    const int64_t local = local0 + i / K;
    if (local < p.rank_tokens &&
        p.pair_row[(int64_t(rank) * p.rank_tokens + local0) * K + i] < 0) {
      d_weights[local0 * K + i] = from_float<W>(0.0f);
    }
  }
  combine_tokens<void>(ctid, p.combine_tokens, p.pair_row, nullptr, local0, p.rank_tokens,
                       int64_t(rank) * p.rank_tokens, K, p.ranks == 1, win.recv[0],
                       win.recv[rank], win.dx[rank], p.hidden);
}

// A weight-gradient tile's K loop over its expert's k_blocks 64-row blocks; an expert
// without rows gives a zero gradient.
template <class Mma, class SmemA, class SmemB, int kSlot, class Acc>
__device__ __forceinline__ void wgrad_k_loop(Control& ctl, char* tiles, Ring<kStages>& st,
                                             int k_blocks, Acc& acc) {
  if (k_blocks == 0) {
    clear(acc);
  } else {
    mma_k_loop<Mma, SmemA, SmemB, kSlot>(ctl, tiles, st, k_blocks, acc);
  }
}

template <typename W, int kSlot>
__device__ void consume(const Params& p, const Windows& win, Control& ctl, char* tiles,
                        Elem* store_tile, int32_t rank) {
  Ring<kStages> st{0, 0u};
  Ring<kTaskSlots> mail{0, 0u};
  const int64_t H = p.hidden, F = p.ffn;
  // This warp group's store buffers.
  constexpr int kParts = group_parts(kSlot);
  const int g = (threadIdx.x - kProducerThreads) / 128;
  Elem* const buffers = store_tile + g * kParts * (kPartBytes / sizeof(Elem));
  for (;;) {
    const Task task = take_task(ctl, mail);
    const RowBlock& rb = task.rb;
    switch (task.kind) {
      case Kind::kEnd:
        // The stores read shared memory until they are done; then the kernel
        // may end (its end makes their global writes visible).
        if (threadIdx.x % 128 == 0) tma_store_wait<0>();
        return;
      case Kind::kCombine:
        combine_task<W>(p, win, rank, task.tile);
        break;
      case Kind::kSwiglu:
        swiglu_task<W, kSlot>(p, win, ctl, tiles, st, rb);
        consumer_signal2(p.block_ready + task.block, p.expert_ready + rb.expert);
        break;
      case Kind::kDgrad2: {
        using D = Dgrad<kSlot>;
        typename D::Acc acc;
        mma_k_loop<typename D::Mma, LayoutARows<kSlot>, LayoutBK, kSlot>(
            ctl, tiles, st, static_cast<int>((H + kBlockK - 1) / kBlockK), acc);
        const int64_t rows = rb.rows(), f0 = int64_t(task.tile) * kStageCols;
        auto put = [&](int m, int n, float v0, float v1) {
          const int64_t f = f0 + n;
          if (m < rows && f < F) {
            store_global_8(p.dh + (rb.row0 + m) * F + f, __float_as_uint(v0), __float_as_uint(v1));
          }
        };
        for_each_pair<typename D::Mma, typename D::Tile>(acc, put);
        consumer_signal(p.block_ready + task.block);
        break;
      }
      case Kind::kDgrad1: {
        using D = Dgrad<kSlot>;
        typename D::Acc acc;
        mma_k_loop<typename D::Mma, LayoutARows<kSlot>, LayoutBK, kSlot>(
            ctl, tiles, st, static_cast<int>((2 * F + kBlockK - 1) / kBlockK), acc);
        const int64_t rows = rb.rows(), h0 = int64_t(task.tile) * kStageCols;
        // This warp's 16 rows of the warp group's: 64 rows (64 g on) x 256 columns in
        // 128-row tiles, 64 rows x columns 128 g .. 128 g + 127 in 64-row ones; 64
        // columns at a time through the warp's 2 KB of the group's store buffers, once
        // the group's last TMA store has read them.
        const int warp = (threadIdx.x - kProducerThreads) / 32;
        const int m0 = (kSlot == kWideRows ? 64 * g : 0) + 16 * (warp % 4);
        const int64_t n0 = h0 + (kSlot == kWideRows ? 0 : 128 * g);
        Elem* const stage = buffers + (warp % 4) * (kPartBytes / 4 / sizeof(Elem));
        if (threadIdx.x % 128 == 0) tma_store_wait<0>();
        cutlass::arch::NamedBarrier::sync(128, kWarpGroupSync + g);
        auto put_at = [&](int64_t n1) {
          return [&, n1](int mm, int c, uint4 v) {
            const int m = m0 + mm;
            const int64_t h = n1 + 8 * c;  // H % 8 == 0: a chunk is in or out whole
            if (m < rows && h < H) store_global_16(dx_row_out(p, win, rb.row0 + m) + h, v);
          };
        };
        warp_part_out<0>(acc, stage, put_at(n0));
        warp_part_out<32>(acc, stage, put_at(n0 + 64));
        if constexpr (kSlot == kWideRows) {
          warp_part_out<64>(acc, stage, put_at(n0 + 128));
          warp_part_out<96>(acc, stage, put_at(n0 + 192));
        }
        consumer_signal(p.dgrad1_done);
        break;
      }
      default: {  // a weight gradient
        const bool down = task.kind == Kind::kWgradDown;
        const int64_t M = down ? F : H, N = down ? H : 2 * F;
        const int64_t rows = rb.row_end - rb.row0;
        // The task's N tiles: [task.tile, nt_end).
        const int nt_end = min(static_cast<int>(tiles_of(N, kStageCols)),
                               task.tile + static_cast<int>(p.wgrad_n));
        const TmaStore& tma = down ? p.tma_d_down : p.tma_d_gate_up;
        Tensor mD = tma.get_tma_tensor(make_shape(M, N, p.experts));
        const bool issuer = threadIdx.x % 128 == 0;
        // The group's kParts 64 x 64 parts from (M block mb, 64-column block nb) on, one
        // in each of its buffers: once the group's last stores have read the buffers,
        // write(part) fills them (part(i): buffer i), and one thread stores each part
        // (clipped at M and N; a part wholly past either is skipped, and so are all when
        // the first is: the same for the whole group).
        auto store_parts = [&](int64_t mb, int64_t nb, auto write) {
          if (nb * kBlockK >= N || mb * kBlockRows >= M) return;
          auto buffer = [&](int i) { return buffers + i * (kPartBytes / sizeof(Elem)); };
          auto part = [&](int i) { return make_tensor(make_smem_ptr(buffer(i)), LayoutC{}); };
          if (issuer) tma_store_wait<0>();
          cutlass::arch::NamedBarrier::sync(128, kWarpGroupSync + g);
          write(buffer);
          tma_store_fence();  // the parts' writes, then the TMA's reads
          cutlass::arch::NamedBarrier::sync(128, kWarpGroupSync + g);
          if (issuer) {
#pragma unroll
            for (int i = 0; i < kParts; ++i) {
              if ((nb + i) * kBlockK >= N) break;
              Tensor sC = part(i);
              Tensor gD = local_tile(mD(_, _, rb.expert), PartTile{}, make_coord(mb, nb + i));
              auto [tg, ts] = tma_partition(tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sC),
                                            group_modes<0, 2>(gD));
              copy(tma, ts, tg);
            }
            tma_store_arrive();
          }
        };
        const int k_blocks = wgrad_k_blocks(rows);
        if constexpr (kSlot == kWideRows) {
          // 128 x 256 tiles: this warp group's 64 rows, its four 64-column parts in turn
          // through its one buffer.
          static_assert(kParts == 1);
          const int64_t mb = 2 * int64_t(task.mtile) + g;
#pragma unroll 1
          for (int nt = task.tile; nt < nt_end; ++nt) {
            AccMNW acc;
            wgrad_k_loop<MmaMNW, LayoutAW, LayoutB, kSlot>(ctl, tiles, st, k_blocks, acc);
            const int64_t nb = 4 * int64_t(nt);
            store_parts(mb, nb, [&](auto buffer) { stage_part<0>(acc, buffer(0)); });
            store_parts(mb, nb + 1, [&](auto buffer) { stage_part<32>(acc, buffer(0)); });
            store_parts(mb, nb + 2, [&](auto buffer) { stage_part<64>(acc, buffer(0)); });
            store_parts(mb, nb + 3, [&](auto buffer) { stage_part<96>(acc, buffer(0)); });
          }
        } else {
          // 64 x 256 tiles: this warp group's half, columns 128 g .. 128 g + 127, as two
          // 64-column parts in its two buffers.
          static_assert(kParts == 2);
#pragma unroll 1
          for (int nt = task.tile; nt < nt_end; ++nt) {
            AccMN acc;
            wgrad_k_loop<MmaMN, LayoutAM, LayoutB, kSlot>(ctl, tiles, st, k_blocks, acc);
            store_parts(task.mtile, 4 * int64_t(nt) + 2 * g, [&](auto buffer) {
              stage_part<0>(acc, buffer(0));
              stage_part<32>(acc, buffer(1));
            });
          }
        }
        break;
      }
    }
  }
}

template <typename W, int kSlot>
__global__ void __launch_bounds__(kThreads, 1)
    moe_backward_persistent(const __grid_constant__ Params p) {
  char* tiles = aligned_dynamic_smem();
  // The store buffers: 2 groups x group_parts(kSlot) x 8 KB.
  Elem* store_tile = reinterpret_cast<Elem*>(tiles + tile_bytes(kStages, kSlot));
  int32_t* block_begin = reinterpret_cast<int32_t*>(tiles + tiles_bytes(kSlot));  // [E + 1]
  __shared__ Control ctl;
  __shared__ Windows win;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int o = 0; o < kMaxRanks; ++o) {  // constant indices: read from the parameters
      win.dy[o] = p.dy_win[o];
      win.dx[o] = p.dx_win[o];
      win.w[o] = p.w_win[o];
      win.dw[o] = p.dw_win[o];
      win.recv[o] = p.recv_win[o];
    }
    prefetch_tma_descriptor(p.tma_down.get_tma_descriptor());
    prefetch_tma_descriptor(p.tma_gate_up.get_tma_descriptor());
    prefetch_tma_descriptor(p.tma_d_down.get_tma_descriptor());
    prefetch_tma_descriptor(p.tma_d_gate_up.get_tma_descriptor());
    if (p.tokens * p.top_k > 0) {  // no rows: these tensor maps are not encoded
      prefetch_tma_descriptor(p.tma_wh.get_tma_descriptor());
      prefetch_tma_descriptor(p.tma_x_rows.get_tma_descriptor());
      prefetch_tma_descriptor(p.tma_dgu.get_tma_descriptor());
      prefetch_tma_descriptor(p.tma_dy_rows.get_tma_descriptor());
      prefetch_tma_descriptor(p.tma_wh_w.get_tma_descriptor());
      prefetch_tma_descriptor(p.tma_x_rows_w.get_tma_descriptor());
      prefetch_tma_descriptor(p.tma_gate_up_sw.get_tma_descriptor());
      prefetch_tma_descriptor(p.tma_dh_sw.get_tma_descriptor());
    }
    init_control(ctl);
  }
  using Scan = cub::BlockScan<int32_t, kThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  scan_row_blocks<kThreads, Scan, kSlot>(p.expert_begin, p.experts, block_begin, scan_tmp);

  // This CTA's rank: the CTAs in P contiguous groups of (nearly) equal size.
  const int32_t rank = static_cast<int32_t>(int64_t(blockIdx.x) * p.ranks / gridDim.x);
  if (threadIdx.x < kProducerThreads) {
    cutlass::arch::warpgroup_reg_dealloc<kBwdProducerRegs>();
    const TaskList list(p.rank_tokens, p.experts, p.hidden, p.ffn, block_begin,
                        int64_t(rank) * p.rank_experts, int64_t(rank + 1) * p.rank_experts,
                        kSlot, TaskList::swiglu_lag(p.ffn, gridDim.x / p.ranks), p.wgrad_n,
                        static_cast<uint32_t>(p.combine_tokens));
    produce<kSlot>(p, win, ctl, tiles, block_begin, list, p.ticket + rank);
  } else {
    cutlass::arch::warpgroup_reg_alloc<kBwdConsumerRegs>();
    consume<W, kSlot>(p, win, ctl, tiles, store_tile, rank);
  }
}

size_t elem_bytes(int64_t n) { return static_cast<size_t>(n) * sizeof(Elem); }

struct Scratch {
  // block_ready[max row blocks], expert_ready[E], dgrad1_done, ticket[P]
  uint32_t* counters;
  size_t counter_bytes;
  float* dh;
  Elem* wh;
  Elem* dgu;
  Elem* dy_rows;
  Elem* recv[kMaxRanks];  // the ranks' receive windows [T/P * K, H] (P = 1: [R, H])
};

Scratch carve(void* ws, const MoeShape& s, int ranks, size_t* total) {
  // The launchers reject ranks outside [1, kMaxRanks] (persistent_ranks_error); the
  // sizes asked for them are those of the nearest valid count.
  ranks = std::clamp(ranks, 1, kMaxRanks);
  const int64_t rows = s.tokens * s.top_k;
  Carver c(ws);
  Scratch b{};
  b.counter_bytes = (max_row_blocks(rows, s.experts) + s.experts + 1 + ranks) * sizeof(uint32_t);
  b.counters = static_cast<uint32_t*>(c.take(b.counter_bytes));
  b.dh = static_cast<float*>(c.take(static_cast<size_t>(rows * s.ffn) * sizeof(float)));
  b.wh = static_cast<Elem*>(c.take(elem_bytes(rows * s.ffn)));
  b.dgu = static_cast<Elem*>(c.take(elem_bytes(rows * 2 * s.ffn)));
  b.dy_rows = static_cast<Elem*>(c.take(elem_bytes(rows * s.hidden)));
  for (int o = 0; o < ranks; ++o) {
    b.recv[o] = static_cast<Elem*>(c.take(elem_bytes(rows / ranks * s.hidden)));
  }
  *total = c.used();
  return b;
}

}  // namespace

size_t persistent_backward_workspace_bytes(const MoeShape& s, int ranks) {
  size_t total = 0;
  carve(nullptr, s, ranks, &total);
  return total;
}

std::string persistent_backward_prepare(const MoeShape& s, void* workspace,
                                        size_t workspace_bytes, cudaStream_t stream, int ranks) {
  MOK_RETURN_IF_MESSAGE(persistent_ranks_error(s, ranks));
  size_t need = 0;
  const Scratch b = carve(workspace, s, ranks, &need);
  if (need > workspace_bytes) return "persistent MoE backward: workspace too small";
  MOK_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(b.counters, 0, b.counter_bytes, stream));
  return {};
}

std::string persistent_backward(const PersistentBackwardArgs& a, void* workspace,
                                size_t workspace_bytes, cudaStream_t stream) {
  const MoeShape& s = a.shape;
  MOK_RETURN_IF_MESSAGE(persistent_ranks_error(s, a.ranks));
  size_t need = 0;
  const Scratch b = carve(workspace, s, a.ranks, &need);
  if (need > workspace_bytes) return "persistent MoE backward: workspace too small";
  if (!aligned16(a.w_gate_up) || !aligned16(a.w_down) || !aligned16(a.d_w_gate_up) ||
      !aligned16(a.d_w_down)) {
    return "persistent MoE backward: the expert weights or their gradients are not 16-byte "
           "aligned";
  }
  if (!aligned16(a.dx)) {  // dgrad1's and the combine's stores
    return "persistent MoE backward: dx is not 16-byte aligned";
  }
  if (max_tasks(s) >= (int64_t(1) << 32)) return "persistent MoE backward: 2^32 tasks or more";
  Params p{};
  p.tokens = s.tokens;
  p.top_k = s.top_k;
  p.experts = s.experts;
  p.hidden = s.hidden;
  p.ffn = s.ffn;
  p.tma_down = make_tma_k(static_cast<const Elem*>(a.w_down), s.ffn, s.hidden, s.experts);
  p.tma_gate_up =
      make_tma_k(static_cast<const Elem*>(a.w_gate_up), s.hidden, 2 * s.ffn, s.experts);
  p.tma_d_down = make_tma_store(static_cast<Elem*>(a.d_w_down), s.ffn, s.hidden, s.experts);
  p.tma_d_gate_up =
      make_tma_store(static_cast<Elem*>(a.d_w_gate_up), s.hidden, 2 * s.ffn, s.experts);
  if (!encoded(p.tma_down) || !encoded(p.tma_gate_up) || !encoded(p.tma_d_down) ||
      !encoded(p.tma_d_gate_up)) {
    return "persistent MoE backward: cuTensorMapEncodeTiled failed for the expert weights "
           "or their gradients";
  }
  // Rank o's windows: its slices of dy, dx and the weights' rows, and its receive
  // window in the scratch.
  const size_t wb = a.weight_dtype == DType::kF32 ? sizeof(float) : sizeof(bf16);
  p.ranks = a.ranks;
  p.rank_tokens = static_cast<int32_t>(s.tokens / a.ranks);
  p.rank_experts = static_cast<int32_t>(s.experts / a.ranks);
  p.by_rank_tokens = cutlass::FastDivmod(std::max(p.rank_tokens, 1));
  for (int o = 0; o < a.ranks; ++o) {
    const int64_t t0 = int64_t(o) * p.rank_tokens;
    p.dy_win[o] = static_cast<const Elem*>(a.dy) + t0 * s.hidden;
    p.dx_win[o] = static_cast<Elem*>(a.dx) + t0 * s.hidden;
    p.w_win[o] = static_cast<const char*>(a.expert_weights) + t0 * s.top_k * wb;
    p.dw_win[o] = static_cast<char*>(a.d_expert_weights) + t0 * s.top_k * wb;
    p.recv_win[o] = b.recv[o];
  }
  p.x_rows = static_cast<const Elem*>(a.x_rows);
  const int64_t rows = s.tokens * s.top_k;
  const int wgrad_rows = backward_wgrad_rows(s);
  p.wgrad_n = TaskList::wgrad_n(rows, s.experts);
  if (rows > 0) {  // no rows: no weight-gradient block is loaded
    if (!aligned16(a.x_rows) || !aligned16(a.gate_up)) {
      return "persistent MoE backward: the forward's x rows or gate_up are not 16-byte "
             "aligned";
    }
    p.tma_wh = make_tma_rows_a(b.wh, s.ffn, rows);
    p.tma_x_rows = make_tma_rows_a(p.x_rows, s.hidden, rows);
    p.tma_dgu = make_tma_rows_b(b.dgu, 2 * s.ffn, rows);
    p.tma_dy_rows = make_tma_rows_b(b.dy_rows, s.hidden, rows);
    p.tma_wh_w = make_tma_rows_aw(b.wh, s.ffn, rows);
    p.tma_x_rows_w = make_tma_rows_aw(p.x_rows, s.hidden, rows);
    p.tma_gate_up_sw =
        make_tma_rows_sw(static_cast<const Elem*>(a.gate_up), 2 * s.ffn, rows);
    p.tma_dh_sw = make_tma_rows_sw(static_cast<const float*>(b.dh), s.ffn, rows);
    if (!encoded(p.tma_wh) || !encoded(p.tma_x_rows) || !encoded(p.tma_dgu) ||
        !encoded(p.tma_dy_rows) || !encoded(p.tma_wh_w) || !encoded(p.tma_x_rows_w) ||
        !encoded(p.tma_gate_up_sw) || !encoded(p.tma_dh_sw)) {
      return "persistent MoE backward: cuTensorMapEncodeTiled failed for the rows of the "
             "weight gradients or of SwiGLU's backward";
    }
  }
  p.expert_begin = a.expert_begin;
  p.row_pair = a.row_pair;
  p.pair_row = a.pair_row;
  p.dh = b.dh;
  p.wh = b.wh;
  p.dgu = b.dgu;
  p.dy_rows = b.dy_rows;
  const int64_t blocks = max_row_blocks(rows, s.experts);
  p.block_ready = b.counters;
  p.expert_ready = b.counters + blocks;
  p.dgrad1_done = p.expert_ready + s.experts;
  p.ticket = p.dgrad1_done + 1;

  DeviceInfo info;
  MOK_RETURN_IF_MESSAGE(current_device_info(&info));
  if (a.ranks > info.sm_count) return "persistent MoE backward: more ranks than SMs";
  p.combine_tokens = combine_tokens_per_task(p.rank_tokens, info.sm_count / a.ranks);
  // Every CTA claims one ticket past the last task: no claim may wrap around 2^32.
  if (max_tasks(s) + info.sm_count >= (int64_t(1) << 32)) {
    return "persistent MoE backward: 2^32 tasks or more";
  }
  const bool f32 = a.weight_dtype == DType::kF32;
  const bool wide = wgrad_rows == kWideRows;
  auto kernel = wide ? (f32 ? moe_backward_persistent<float, kWideRows>
                            : moe_backward_persistent<bf16, kWideRows>)
                     : (f32 ? moe_backward_persistent<float, kBlockRows>
                            : moe_backward_persistent<bf16, kBlockRows>);
  return launch_one_cta_per_sm(
      kernel, p, dynamic_smem_bytes(tiles_bytes(wide ? kWideRows : kBlockRows), s.experts),
      info.sm_count, stream);
}

}  // namespace mok::cuda
