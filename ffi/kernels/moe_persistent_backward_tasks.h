// The persistent backward's numbered tasks (moe_persistent_backward.cu): their
// order, each task's kind and place, and the counter it waits for. Host and device
// code alike, so that tests/persistent_task_order.cc can check on the host that
// every task waits only for tasks numbered before it (with one CTA per SM taking
// tasks in number order, that is what keeps the kernel from deadlocking).
#pragma once

#include <cstdint>

#include "band_order.h"
#include "mok/bf16.h"  // MOK_HOST_DEVICE

namespace mok::cuda::backward_tasks {

constexpr int kTileCols = 256;     // the N tile of every GEMM task
constexpr int kTileRows = 64;      // a row block; the weight gradients' M tile, or:
constexpr int kWideRows = 128;     // their M tile past 128 rows per expert
constexpr int kCombineTokens = 2;  // tokens per combine task

enum class Kind : int32_t { kDgrad2, kSwiglu, kDgrad1, kWgradDown, kWgradGateUp, kCombine, kEnd };

// The counter a task waits for, before its producer streams anything:
//   block_ready[b]: +1 per finished dgrad2 task of row block b, +1 for its SwiGLU task;
//   expert_ready[e]: +1 per finished SwiGLU task of expert e's row blocks;
//   dgrad1_done: +1 per finished dgrad1 task.
enum class Counter : int32_t { kNone, kBlockReady, kExpertReady, kDgrad1Done };

struct TaskId {
  Kind kind;
  int32_t tile;   // N tile (dgrad tasks) or combine task number
  int32_t mtile;  // M tile (weight-gradient tasks)
  int64_t block;  // row block (dgrad and SwiGLU tasks) or expert (weight gradients)
  Counter wait;   // the task may run once counter[wait_index] >= wait_target
  int64_t wait_index;
  uint32_t wait_target;
};

MOK_HOST_DEVICE constexpr uint32_t tiles_of(int64_t n, int tile) {
  return static_cast<uint32_t>((n + tile - 1) / tile);
}

// A rank's numbered task list (every CTA of the rank computes the same), given
// block_begin[0..E]: the experts' row blocks prefix-summed. Rank o of P (EP ranks
// on one launch) holds experts [e0, e1) = [o E/P, (o+1) E/P), their row blocks
// [block_begin[e0], block_begin[e1]), and tokens [o T/P, (o+1) T/P); P = 1 is the
// one-device backward (every expert, block and token).
//   dgrad2 (row block x F tile of 256): dh = dy rows @ W_down^T, K = H, f32 to scratch
//     (each expert's tasks in bands of row blocks, `band_order`);
//   SwiGLU's backward (row block): after the block's dgrad2 tiles, wh, d gate_up and
//     d expert_weights for its rows (the chain's swiglu_backward, row by row);
//   then expert by expert (so that dgrad1's weight reads and the weight gradients'
//   writes run side by side), the expert's
//     dgrad1 tasks (row block x H tile of 256): dx rows = d gate_up @ W_gate_up^T,
//       K = 2F (in bands of row blocks);
//     weight gradients (M tile of `wgrad_rows`, 64 or 128, its 256-column N tiles one
//       after another),
//       dW_down's then dW_gate_up's: dW_down = wh^T dy rows, dW_gate_up = x rows^T
//       d gate_up, over the expert's rows in ascending 64-row K blocks;
//   the combine (2 of the rank's tokens, numbered from 0 in each rank): after every
//     rank's dgrad1 tasks (a token has rows at every rank's experts), dx = the sum
//     of each token's dx rows over k ascending, f32, rounded once.
// Each task waits only for tasks of its rank numbered before it (the SwiGLU tasks
// for dgrad2's, the expert's tasks for its SwiGLU tasks), or, the combine, for
// other ranks' dgrad1 tasks, which wait for nothing of another rank.
struct TaskList {
  uint32_t nf, nh, mf, mh;
  int64_t e0, e1;        // the rank's experts
  uint32_t block0;       // its first row block
  uint32_t blocks;       // its row blocks
  uint32_t all_blocks;   // every rank's
  uint32_t dgrad2_end, swiglu_end, experts_end, total;

  // The one-device list: every expert and token.
  MOK_HOST_DEVICE TaskList(int64_t tokens, int64_t experts, int64_t hidden, int64_t ffn,
                           const int32_t* block_begin, int wgrad_rows = kTileRows)
      : TaskList(tokens, experts, hidden, ffn, block_begin, 0, experts, wgrad_rows) {}

  // Rank o's of P: experts [e0, e1) and `rank_tokens` = T/P tokens.
  MOK_HOST_DEVICE TaskList(int64_t rank_tokens, int64_t experts, int64_t hidden, int64_t ffn,
                           const int32_t* block_begin, int64_t e0_, int64_t e1_,
                           int wgrad_rows = kTileRows)
      : nf(tiles_of(ffn, kTileCols)),
        nh(tiles_of(hidden, kTileCols)),
        mf(tiles_of(ffn, wgrad_rows)),
        mh(tiles_of(hidden, wgrad_rows)),
        e0(e0_),
        e1(e1_),
        block0(static_cast<uint32_t>(block_begin[e0_])),
        blocks(static_cast<uint32_t>(block_begin[e1_] - block_begin[e0_])),
        all_blocks(static_cast<uint32_t>(block_begin[experts])) {
    dgrad2_end = blocks * nf;
    swiglu_end = dgrad2_end + blocks;
    experts_end = swiglu_end + group_begin(block_begin, e1);
    total = experts_end + tiles_of(rank_tokens, kCombineTokens);
  }

  // Expert e's first task, counted from swiglu_end (strictly increasing in e: every
  // expert has weight-gradient tasks).
  MOK_HOST_DEVICE uint32_t group_begin(const int32_t* block_begin, int64_t e) const {
    return (static_cast<uint32_t>(block_begin[e]) - block0) * nh +
           static_cast<uint32_t>(e - e0) * (mf + mh);
  }

  // The expert whose group holds task swiglu_end + i.
  MOK_HOST_DEVICE int64_t group_of(const int32_t* block_begin, uint32_t i) const {
    int64_t lo = e0, hi = e1;  // the last e with group_begin(e) <= i
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (group_begin(block_begin, mid) <= i) lo = mid; else hi = mid;
    }
    return lo;
  }

  // Task t (kEnd from `total` on). Blocks and experts are numbered over all ranks;
  // combine tasks within the rank.
  MOK_HOST_DEVICE TaskId at(uint32_t t, const int32_t* block_begin) const {
    if (t < dgrad2_end) {
      TaskId id{Kind::kDgrad2, 0, 0, 0, Counter::kNone, 0, 0};
      band_order(block_begin + e0, e1 - e0, block0, t, nf, &id.tile, &id.block);
      return id;
    }
    if (t < swiglu_end) {
      const int64_t b = block0 + (t - dgrad2_end);
      return {Kind::kSwiglu, 0, 0, b, Counter::kBlockReady, b, nf};
    }
    if (t < experts_end) {
      const uint32_t i = t - swiglu_end;
      const int64_t e = group_of(block_begin, i);
      const uint32_t blocks_e = static_cast<uint32_t>(block_begin[e + 1] - block_begin[e]);
      uint32_t j = i - group_begin(block_begin, e);
      if (j < blocks_e * nh) {
        TaskId id{Kind::kDgrad1, 0, 0, 0, Counter::kBlockReady, 0, nf + 1};
        band_order(block_begin + e, 1, block_begin[e], j, nh, &id.tile, &id.block);
        id.wait_index = id.block;
        return id;
      }
      j -= blocks_e * nh;
      const bool down = j < mf;
      return {down ? Kind::kWgradDown : Kind::kWgradGateUp, 0, int32_t(down ? j : j - mf), e,
              Counter::kExpertReady, e, blocks_e};
    }
    if (t < total) {
      return {Kind::kCombine, int32_t(t - experts_end), 0, 0, Counter::kDgrad1Done, 0,
              all_blocks * nh};
    }
    return {Kind::kEnd, 0, 0, 0, Counter::kNone, 0, 0};
  }
};

}  // namespace mok::cuda::backward_tasks
