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
constexpr int kTileRows = 64;      // a row block and the weight gradients' M tile, or:
constexpr int kWideRows = 128;     // both past 128 rows per expert

enum class Kind : int32_t { kDgrad2, kSwiglu, kDgrad1, kWgradDown, kWgradGateUp, kCombine, kEnd };

// The counter a task waits for, before its producer streams anything:
//   block_ready[b]: +1 per finished dgrad2 task of row block b, +1 for its SwiGLU task;
//   expert_ready[e]: +1 per finished SwiGLU task of expert e's row blocks;
//   dgrad1_done: +1 per finished dgrad1 task.
enum class Counter : int32_t { kNone, kBlockReady, kExpertReady, kDgrad1Done };

struct TaskId {
  Kind kind;
  int32_t tile;   // N tile (dgrad tasks; a weight gradient's first) or combine task number
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
//     (each expert's tasks in bands of row blocks, `band_order`), and among them
//   SwiGLU's backward (row block): after the block's dgrad2 tiles, wh, d gate_up and
//     d expert_weights for its rows (the chain's swiglu_backward, row by row). Row
//     block b's task comes `lag` row blocks' worth of dgrad2 tasks after b's own
//     (lag >= kBandBlocks: after every dgrad2 task of b's band), so that these
//     memory-bound tasks run beside the dgrad2 GEMMs instead of in a phase of
//     their own, and late enough that b's dgrad2 tasks are done when it is taken;
//   then expert by expert (so that dgrad1's weight reads and the weight gradients'
//   writes run side by side), the expert's
//     dgrad1 tasks (row block x H tile of 256): dx rows = d gate_up @ W_gate_up^T,
//       K = 2F (in bands of row blocks);
//     weight gradients (M tile of `wgrad_rows`, 64 or 128, and `wn` of its 256-column
//       N tiles, one after another), dW_down's then dW_gate_up's: dW_down = wh^T dy
//       rows, dW_gate_up = x rows^T d gate_up, over the expert's rows in ascending
//       64-row K blocks. Of the two loops over M tiles and N chunks, the one over
//       the smaller side is the inner one (`m_inner`): consecutive tasks share the
//       larger side's operand panel and read it at about the same time, and the
//       smaller side's panels come back after few tasks, so that L2 serves both.
//       (dW_gate_up at Mixtral's shapes, 32 M tiles x 112 N tiles over 4096 rows:
//       with the N tiles inner, 112 panels of 2 MB were in flight at once);
//   the combine (`combine_tokens` of the rank's tokens, numbered from 0 in each rank,
//     the kernel's combine_tokens_per_task): after every
//     rank's dgrad1 tasks (a token has rows at every rank's experts), dx = the sum
//     of each token's dx rows over k ascending, f32, rounded once.
// Each task waits only for tasks of its rank numbered before it (the SwiGLU tasks
// for dgrad2's, the expert's tasks for its SwiGLU tasks), or, the combine, for
// other ranks' dgrad1 tasks, which wait for nothing of another rank.
struct TaskList {
  uint32_t nf, nh, mf, mh;
  uint32_t n2f;          // dW_gate_up's N tiles (dW_down's: nh)
  uint32_t wn;           // N tiles per weight-gradient task
  uint32_t cd, cg;       // N chunks per M tile: dW_down's, dW_gate_up's
  bool down_m_inner, gu_m_inner;  // M tiles the inner loop (else N chunks)
  int64_t e0, e1;        // the rank's experts
  uint32_t block0;       // its first row block
  uint32_t blocks;       // its row blocks
  uint32_t all_blocks;   // every rank's
  uint32_t lag;          // in row blocks; at most `blocks`
  uint32_t swiglu_end, experts_end, total;

  // The SwiGLU tasks' lag for `ctas` CTAs taking a rank's tasks: a block's last
  // dgrad2 task may sit kBandBlocks - 1 units after its own (its band's last), and
  // two waves of dgrad2 tasks (nf per unit) after that, it has left the CTAs.
  MOK_HOST_DEVICE static uint32_t swiglu_lag(int64_t ffn, int64_t ctas) {
    const int64_t nf = tiles_of(ffn, kTileCols) > 0 ? tiles_of(ffn, kTileCols) : 1;
    return static_cast<uint32_t>(kBandBlocks - 1 + (2 * ctas + nf - 1) / nf);
  }

  // N tiles per weight-gradient task: about kWgradStages stages (64-row K blocks x
  // N tiles) at `rows` per expert on average, at least one N tile. Long tasks at
  // few experts (an M tile of dW_gate_up over 112 N tiles and 64 K blocks) left a
  // tail with most CTAs idle, and with the M tiles the inner loop, the operand
  // panels in flight grow with the tiles per task (one N tile at 64 K blocks).
  static constexpr int64_t kWgradStages = 64;
  MOK_HOST_DEVICE static uint32_t wgrad_n(int64_t rows, int64_t experts) {
    const int64_t per = experts > 0 ? rows / experts : 0;
    const int64_t k = per / kTileRows > 1 ? per / kTileRows : 1;
    const int64_t n = (kWgradStages + k - 1) / k;
    return static_cast<uint32_t>(n < (1 << 20) ? n : (1 << 20));
  }

  // The one-device list: every expert and token.
  MOK_HOST_DEVICE TaskList(int64_t tokens, int64_t experts, int64_t hidden, int64_t ffn,
                           const int32_t* block_begin, int wgrad_rows = kTileRows,
                           uint32_t swiglu_lag_ = kBandBlocks, uint32_t wgrad_n_ = 1u << 20,
                           uint32_t combine_tokens = 2)
      : TaskList(tokens, experts, hidden, ffn, block_begin, 0, experts, wgrad_rows,
                 swiglu_lag_, wgrad_n_, combine_tokens) {}

  // Rank o's of P: experts [e0, e1) and `rank_tokens` = T/P tokens.
  MOK_HOST_DEVICE TaskList(int64_t rank_tokens, int64_t experts, int64_t hidden, int64_t ffn,
                           const int32_t* block_begin, int64_t e0_, int64_t e1_,
                           int wgrad_rows = kTileRows, uint32_t swiglu_lag_ = kBandBlocks,
                           uint32_t wgrad_n_ = 1u << 20, uint32_t combine_tokens = 2)
      : nf(tiles_of(ffn, kTileCols)),
        nh(tiles_of(hidden, kTileCols)),
        mf(tiles_of(ffn, wgrad_rows)),
        mh(tiles_of(hidden, wgrad_rows)),
        n2f(tiles_of(2 * ffn, kTileCols)),
        wn(wgrad_n_ > 0 ? wgrad_n_ : 1),
        cd((nh + wn - 1) / wn),
        cg((n2f + wn - 1) / wn),
        down_m_inner(mf * static_cast<uint32_t>(wgrad_rows) <= nh * kTileCols),
        gu_m_inner(mh * static_cast<uint32_t>(wgrad_rows) <= n2f * kTileCols),
        e0(e0_),
        e1(e1_),
        block0(static_cast<uint32_t>(block_begin[e0_])),
        blocks(static_cast<uint32_t>(block_begin[e1_] - block_begin[e0_])),
        all_blocks(static_cast<uint32_t>(block_begin[experts])) {
    const uint32_t at_least = swiglu_lag_ < kBandBlocks ? kBandBlocks : swiglu_lag_;
    lag = at_least < blocks ? at_least : blocks;
    swiglu_end = blocks * (nf + 1);
    experts_end = swiglu_end + group_begin(block_begin, e1);
    total = experts_end + tiles_of(rank_tokens, combine_tokens > 0 ? combine_tokens : 1);
  }

  // Expert e's first task, counted from swiglu_end (strictly increasing in e: every
  // expert has weight-gradient tasks).
  MOK_HOST_DEVICE uint32_t group_begin(const int32_t* block_begin, int64_t e) const {
    return (static_cast<uint32_t>(block_begin[e]) - block0) * nh +
           static_cast<uint32_t>(e - e0) * (mf * cd + mh * cg);
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
    if (t < swiglu_end) {
      // Units of one row block's worth: the first `lag` hold nf dgrad2 numbers each
      // (band_order's i), the next blocks - lag nf dgrad2 numbers and then the
      // SwiGLU task of the block `lag` before, and the last lag SwiGLU tasks follow.
      const uint32_t head = lag * nf, mixed = (blocks - lag) * (nf + 1);
      uint32_t dgrad2 = t, swiglu = 0;
      bool is_swiglu = false;
      if (t >= head + mixed) {
        is_swiglu = true, swiglu = blocks - lag + (t - head - mixed);
      } else if (t >= head) {
        const uint32_t unit = lag + (t - head) / (nf + 1), k = (t - head) % (nf + 1);
        if (k == nf) {
          is_swiglu = true, swiglu = unit - lag;
        } else {
          dgrad2 = unit * nf + k;
        }
      }
      if (is_swiglu) {
        const int64_t b = block0 + swiglu;
        return {Kind::kSwiglu, 0, 0, b, Counter::kBlockReady, b, nf};
      }
      TaskId id{Kind::kDgrad2, 0, 0, 0, Counter::kNone, 0, 0};
      band_order(block_begin + e0, e1 - e0, block0, dgrad2, nf, &id.tile, &id.block);
      return id;
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
      const bool down = j < mf * cd;
      if (!down) j -= mf * cd;
      const uint32_t chunks = down ? cd : cg, mt = down ? mf : mh;
      const bool m_inner = down ? down_m_inner : gu_m_inner;
      const uint32_t m = m_inner ? j % mt : j / chunks, c = m_inner ? j / mt : j % chunks;
      // tile: the task's first N tile
      return {down ? Kind::kWgradDown : Kind::kWgradGateUp, int32_t(c * wn), int32_t(m), e,
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
