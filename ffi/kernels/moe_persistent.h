// The MoE forward after the routing plan as one persistent kernel (sm_90a, bf16,
// the native recipe): gather, GEMM1 with SwiGLU, GEMM2 and the ordered combine in
// one launch, with the same bits as the kernel chain (moe_cuda.cu).
//
// One CTA per SM, three warp groups: a producer (takes numbered tasks in
// increasing order, waits for what each needs, hands it over through a
// shared-memory mailbox, then streams its K blocks into the stages: A rows by
// cp.async, weight tiles by TMA, running ahead across task boundaries) and two
// consumers (wgmma from the stages, the epilogues, the combine). Row blocks of BM
// rows: 64 where experts average at most 64 rows (five stages; tasks claimed from
// a ticket counter, lowest first), else 128 (four stages; tasks dealt round robin
// over the CTAs; epilogues through shared memory, whole 128-byte row segments per
// store); persistent_forward_tile_rows says which.
//   GEMM1 tasks (BM rows of one expert x 128 F columns): the rows are loaded
//     straight from x by their tokens (no gathered copy, unless the backward keeps
//     one: each of a row block's GEMM1 tasks copies its share); gate and up in
//     f32, SwiGLU on the accumulators, h rows to scratch; then h_ready[row block]
//     += 1.
//   GEMM2 tasks (BM rows x 256 H columns): after h_ready[row block] reaches the
//     number of GEMM1 column tiles, h @ W_down to the expert-output rows; then
//     gemm2_done += 1.
//   combine tasks (2 or 8 tokens: combine_tokens_per_task): after every GEMM2
//     task, each token's K rows summed over k ascending in f32 and rounded once.
// EP on one launch (`ranks` P > 1, virtual ranks on one device): the CTAs form P
// groups, rank o's group takes the GEMM tasks of experts [o E/P, (o+1) E/P) and
// the combine of tokens [o T/P, (o+1) T/P) (with 64-row tiles from its own ticket).
// A rank's x rows, y rows and received expert-output rows live in its own windows,
// reached through pointer tables only: GEMM1 reads each row from the window of the
// token's rank, GEMM2 writes each output row into the receive window of the
// token's rank (at the pair's place), and a rank's combine waits for every rank's
// GEMM2 tasks. P = 1 is the one-device forward.
// A task only waits for tasks of lower numbers (of its rank, or GEMM2 tasks of
// other ranks, which wait for nothing of another rank), a CTA takes its tasks in
// increasing order and its producer has issued every load of a task before it
// takes the next, and every CTA is resident (one per SM, a cooperative launch), so
// the lowest unfinished task is the current task of its CTA and can always run: no
// deadlock. Counters pick which CTA computes a tile, never what is summed or in
// which order: each output element is reduced by one CTA over K in order.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "mok/types.h"

namespace mok::cuda {

// When the persistent kernels (the forward's and the backward's) run: never (the
// kernel chains), where they are the faster ones (the default, AUTO: both at most
// 256 rows per expert over 64 or more experts, 4096 for experts of H·F <= 2048·1024;
// over fewer, the forward at most 64 rows per expert, and without residuals 128, or
// 4096 for such small experts with H >= 2048; docs/performance.md), or wherever
// they can.
enum class PersistentMode : int { kOff = 0, kAuto = 1, kAlways = 2 };

// Sets the mode for every later call in this process and returns the previous one.
// All modes give the same bits: the switch exists so that tests and the benchmark
// can compare the two paths.
PersistentMode set_persistent_kernels(PersistentMode mode);

// Whether the persistent kernels can run this call (the build has sm_90a code, the
// device is compute capability 9.0, x and the weights are bf16, the recipe is the
// native one, H and F are multiples of 8 and E <= 4096).
bool persistent_can_run(const MoeShape& shape, Recipe recipe, DType x_dtype);

// Whether the persistent forward takes this call under the current mode; `residuals`:
// the call also writes the residuals a backward keeps (AUTO takes fewer such calls).
bool persistent_supported(const MoeShape& shape, Recipe recipe, DType x_dtype, bool residuals);

// The rows of the persistent forward's GEMM tiles at this shape: 64 where experts
// average at most 64 rows (the weights streamed), else 128 (for
// E <= 2048: the 48 KB stages leave room for the experts' row-block prefix sums).
int persistent_forward_tile_rows(const MoeShape& shape);

// Whether the persistent backward takes it under the current mode: under AUTO where
// experts average at most 256 rows (4096 for experts of H·F <= 2048·1024) and there
// are at least 64 experts (where it was measured even with or faster than the
// chain's backward; docs/performance.md). Any combination of the two passes' paths
// gives the same bits.
bool persistent_backward_supported(const MoeShape& shape, Recipe recipe, DType x_dtype);

// EP ranks one launch serves at most.
constexpr int kMaxPersistentRanks = 8;

// Why `ranks` cannot split this shape (empty when it can: 1 <= ranks <= 8, T and E
// divisible by ranks). Host-only; the FFI handler checks its attribute with it.
inline std::string persistent_ranks_error(const MoeShape& s, int64_t ranks) {
  if (ranks < 1 || ranks > kMaxPersistentRanks) {
    return "EP ranks on one launch: ranks must be in [1, " +
           std::to_string(kMaxPersistentRanks) + "], got " + std::to_string(ranks);
  }
  if (s.tokens % ranks != 0 || s.experts % ranks != 0) {
    return "EP ranks on one launch: " + std::to_string(ranks) +
           " ranks need T and E divisible by them (T = " + std::to_string(s.tokens) +
           ", E = " + std::to_string(s.experts) + ")";
  }
  return {};
}

// Its device scratch: h rows, the ranks' receive windows and the task counters.
size_t persistent_forward_workspace_bytes(const MoeShape& shape, int ranks = 1);

struct PersistentForwardArgs {
  MoeShape shape;
  DType weight_dtype;            // of expert_weights (f32 or bf16)
  const void* x;                 // [T, H] bf16
  const void* expert_weights;    // [T, K]
  const void* w_gate_up;         // [E, H, 2F]
  const void* w_down;            // [E, F, H]
  const int64_t* expert_begin;   // [E + 1] the routing plan's
  const int32_t* row_pair;       // [T * K]
  const int32_t* pair_row;       // [T * K]
  void* x_rows_out;              // [T * K, H] the gathered x rows, or nullptr
  void* gate_up_out;             // [T * K, 2F] round(gate, up), or nullptr
  void* y;                       // [T, H]
  int ranks = 1;                 // P: EP ranks on this launch (x and y split in P windows)
};

// Zeroes the task counters in `workspace` (enqueued before the routing plan, so
// that the pass after it is the one launch).
std::string persistent_forward_prepare(const MoeShape& shape, void* workspace,
                                       size_t workspace_bytes, cudaStream_t stream,
                                       int ranks = 1);

// The launch; the routing plan must be enqueued before it on `stream`.
std::string persistent_forward(const PersistentForwardArgs& args, void* workspace,
                               size_t workspace_bytes, cudaStream_t stream);

// The backward after the routing plan as one persistent kernel
// (moe_persistent_backward.cu), where persistent_backward_supported says so, with
// the same bits as the chain's backward.
// Tasks, numbered in this order, each waiting only for lower-numbered ones
// (moe_persistent_backward_tasks.h):
//   dgrad2 (a row block of 64 rows, 128 past 128 rows per expert, x 256 F columns):
//     dh = dy rows @ W_down^T in f32, the dy rows loaded straight from dy by their
//     tokens (no gathered copy);
//   among them, SwiGLU's backward (a row block): after the rows' dgrad2 tiles, the
//     chain's swiglu_backward row by row (round(w h), d gate_up, d expert_weights);
//   then expert by expert: its dgrad1 tasks (a row block x 256 H columns: dx rows =
//     d gate_up @ W_gate_up^T), then its weight gradients (M tiles of the row
//     blocks' height of dW_down, then of dW_gate_up, each over a chunk of its
//     256-column N tiles in turn), after the expert's SwiGLU tasks, over its rows
//     in 64-row K blocks, ascending;
//   the combine (2 or 8 tokens, as the forward's): after every dgrad1 task, dx =
//     the sum over k ascending of each token's dx rows (f32, rounded once).
// EP on one launch (`ranks` P > 1, virtual ranks on one device), as the forward:
// rank o's CTAs take the tasks of experts [o E/P, (o+1) E/P) and the combine of
// tokens [o T/P, (o+1) T/P); the dy, dx, expert_weights and d expert_weights rows
// of a token live in its rank's windows, reached through pointer tables only:
// dgrad2 and dW_down read each dy row from the window of the token's rank, the
// SwiGLU tasks read and write each pair's weight and d weight there, dgrad1 writes
// each dx row into the receive window of the token's rank (at the pair's place),
// and a rank's combine waits for every rank's dgrad1 tasks. The weight gradients
// of a rank's experts are its own (over its experts' rows in canonical order), so
// every P gives the bits of P = 1.
size_t persistent_backward_workspace_bytes(const MoeShape& shape, int ranks = 1);

struct PersistentBackwardArgs {
  MoeShape shape;
  DType weight_dtype;            // of expert_weights and d_expert_weights (f32 or bf16)
  const void* dy;                // [T, H] bf16
  const void* x_rows;            // [T * K, H] the forward's gathered x rows
  const void* gate_up;           // [T * K, 2F] the forward's round(gate, up)
  const void* expert_weights;    // [T, K]
  const void* w_gate_up;         // [E, H, 2F]
  const void* w_down;            // [E, F, H]
  const int64_t* expert_begin;   // [E + 1] the routing plan's
  const int32_t* row_pair;       // [T * K]
  const int32_t* pair_row;       // [T * K]
  void* dx;                      // [T, H]
  void* d_expert_weights;        // [T, K]
  void* d_w_gate_up;             // [E, H, 2F]
  void* d_w_down;                // [E, F, H]
  int ranks = 1;                 // P: EP ranks on this launch (dy, dx and the weights'
                                 // rows split in P windows)
};

// Zeroes the task counters in `workspace` (enqueued before the routing plan).
std::string persistent_backward_prepare(const MoeShape& shape, void* workspace,
                                        size_t workspace_bytes, cudaStream_t stream,
                                        int ranks = 1);

// The launch; the routing plan must be enqueued before it on `stream`.
std::string persistent_backward(const PersistentBackwardArgs& args, void* workspace,
                                size_t workspace_bytes, cudaStream_t stream);

}  // namespace mok::cuda
