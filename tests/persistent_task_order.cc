// The persistent backward's task lists (ffi/kernels/moe_persistent_backward_tasks.h),
// checked on the host over many routings, one device and P = 2, 4, 8 EP ranks on one
// launch: every task appears exactly once and belongs to its rank, waits for the
// counter its data needs (stated here from what each kind of task reads and what
// the kernel's consumers count), and the ranks' lists run to their ends without a
// deadlock, with the weight gradients' M tiles of 64 rows and of 128, their N tiles
// in chunks of several sizes and the SwiGLU tasks at several lags behind their
// dgrad2 tasks. And the
// forward's GEMM task order (ffi/kernels/band_order.h) over the same routings: each
// rank's numbers give every (column tile, row block) of its experts once, each
// expert's within the expert's numbers. Run with
// tests/test_persistent_task_order.py; prints "N cases, 0 errors".
#include <cstdint>
#include <cstdio>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "band_order.h"
#include "moe_persistent_backward_tasks.h"

using namespace mok::cuda::backward_tasks;

namespace {

uint32_t ceil_div(int64_t n, int64_t d) { return static_cast<uint32_t>((n + d - 1) / d); }

// The forward's band order for P ranks (rank o: experts [o E/P, (o+1) E/P)) and n
// column tiles; returns the errors.
int check_band_order(const std::vector<int32_t>& blocks_of, uint32_t n, int P) {
  const int64_t E = static_cast<int64_t>(blocks_of.size());
  std::vector<int32_t> begin(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) begin[e + 1] = begin[e] + blocks_of[e];
  int errors = 0;
  for (int o = 0; o < P; ++o) {
    const int64_t e0 = o * (E / P), e1 = e0 + E / P, block0 = begin[e0];
    const uint32_t tasks = static_cast<uint32_t>(begin[e1] - block0) * n;
    std::set<std::pair<int32_t, int64_t>> seen;
    int64_t e = e0;
    for (uint32_t i = 0; i < tasks; ++i) {
      while ((begin[e + 1] - block0) * n <= i) ++e;  // the expert whose numbers hold i
      int32_t tile = -1;
      int64_t block = -1;
      mok::cuda::band_order(begin.data(), E, block0, i, n, &tile, &block);
      const bool ok = tile >= 0 && uint32_t(tile) < n && block >= begin[e] &&
                      block < begin[e + 1] && seen.insert({tile, block}).second;
      if (!ok && ++errors <= 5) {
        std::printf("band order, P=%d E=%lld n=%u: rank %d number %u: tile %d block %lld\n",
                    P, (long long)E, n, o, i, tile, (long long)block);
      }
    }
  }
  return errors;
}

// Runs P ranks' task lists (P = 1: the one-device list), each rank's tasks one at a
// time in number order, the ranks taking turns, as the counters would see them if
// each CTA finished its task before the next was claimed; returns the errors. A
// rank whose next task waits stays put; if no rank can go on, the lists deadlock.
int check(int64_t tokens, int64_t H, int64_t F, const std::vector<int32_t>& blocks_of,
          int P = 1, int wgrad_rows = kTileRows, uint32_t lag = mok::cuda::kBandBlocks,
          uint32_t wn = 1u << 20, uint32_t combine_tokens = 2) {
  const int64_t E = static_cast<int64_t>(blocks_of.size());
  std::vector<int32_t> begin(E + 1, 0);
  std::vector<int64_t> expert_of_block;
  for (int64_t e = 0; e < E; ++e) {
    begin[e + 1] = begin[e] + blocks_of[e];
    for (int32_t k = 0; k < blocks_of[e]; ++k) expert_of_block.push_back(e);
  }
  const int64_t B = begin[E];
  const uint32_t nf = ceil_div(F, 256), nh = ceil_div(H, 256);
  const uint32_t mf = ceil_div(F, wgrad_rows), mh = ceil_div(H, wgrad_rows);
  const uint32_t n2f = ceil_div(2 * F, 256);  // dW_gate_up's N tiles (dW_down's: nh)
  const uint32_t cd = ceil_div(nh, wn), cg = ceil_div(n2f, wn);  // N chunks per M tile
  const int64_t rank_tokens = tokens / P, rank_experts = E / P;
  const uint32_t combines = ceil_div(rank_tokens, combine_tokens);
  std::vector<TaskList> lists;
  std::vector<uint64_t> expected;
  for (int o = 0; o < P; ++o) {
    const int64_t e0 = o * rank_experts, e1 = e0 + rank_experts;
    lists.push_back(P == 1 ? TaskList(tokens, E, H, F, begin.data(), wgrad_rows, lag, wn,
                                      combine_tokens)
                           : TaskList(rank_tokens, E, H, F, begin.data(), e0, e1, wgrad_rows,
                                      lag, wn, combine_tokens));
    expected.push_back(uint64_t(begin[e1] - begin[e0]) * (nf + 1 + nh) +
                       uint64_t(rank_experts) * (mf * cd + mh * cg) + combines);
  }

  std::vector<uint32_t> block_ready(B, 0), expert_ready(E, 0);
  uint32_t dgrad1_done = 0;
  std::set<std::tuple<int, int64_t, int32_t, int32_t>> seen;  // kind, place, tiles
  int errors = 0;
  auto fail = [&](int o, uint32_t t, const char* what) {
    if (++errors <= 5) {
      std::printf("P=%d T=%lld E=%lld H=%lld F=%lld B=%lld: rank %d task %u: %s\n", P,
                  (long long)tokens, (long long)E, (long long)H, (long long)F, (long long)B, o,
                  t, what);
    }
  };
  std::vector<uint32_t> next(P, 0);
  std::vector<bool> done(P, false);
  struct Wgrad {
    Kind kind = Kind::kEnd;
    int64_t expert = -1;
    int32_t m = 0, n = 0;
  };
  std::vector<Wgrad> last(P);  // each rank's last weight-gradient task
  for (int finished = 0; finished < P;) {
    bool moved = false;
    for (int o = 0; o < P; ++o) {
      if (done[o]) continue;
      const uint32_t t = next[o];
      if (t > expected[o] + 1) {
        fail(o, t, "no end");
        done[o] = true, ++finished, moved = true;
        continue;
      }
      const TaskId id = lists[o].at(t, begin.data());
      if (id.kind == Kind::kEnd) {
        if (t != expected[o] || lists[o].total != expected[o]) {
          fail(o, t, "ends at the wrong number");
        }
        done[o] = true, ++finished, moved = true;
        continue;
      }
      // What the task reads, so what it must wait for; and that it is the rank's.
      const int64_t e0 = o * rank_experts, e1 = e0 + rank_experts;
      const bool block_ok = id.block >= begin[e0] && id.block < begin[e1];
      Counter want = Counter::kNone;
      int64_t want_index = 0;
      uint32_t want_target = 0;
      bool in_range = true;
      switch (id.kind) {
        case Kind::kDgrad2:  // dy and W_down only
          in_range = block_ok && id.tile >= 0 && uint32_t(id.tile) < nf;
          break;
        case Kind::kSwiglu:  // dh of its block: every dgrad2 tile of it
          in_range = block_ok;
          want = Counter::kBlockReady, want_index = id.block, want_target = nf;
          break;
        case Kind::kDgrad1:  // d gate_up of its block: its SwiGLU task
          in_range = block_ok && id.tile >= 0 && uint32_t(id.tile) < nh;
          want = Counter::kBlockReady, want_index = id.block, want_target = nf + 1;
          break;
        case Kind::kWgradDown:    // wh of the expert's rows
        case Kind::kWgradGateUp:  // d gate_up of the expert's rows
          // An M tile and the first of a chunk of wn N tiles.
          in_range = id.block >= e0 && id.block < e1 && id.mtile >= 0 &&
                     uint32_t(id.mtile) < (id.kind == Kind::kWgradDown ? mf : mh) &&
                     id.tile >= 0 && uint32_t(id.tile) % wn == 0 &&
                     uint32_t(id.tile) < (id.kind == Kind::kWgradDown ? nh : n2f);
          if (in_range) {
            want = Counter::kExpertReady, want_index = id.block,
            want_target = uint32_t(blocks_of[id.block]);
          }
          break;
        case Kind::kCombine:  // every rank's dx rows
          in_range = id.tile >= 0 && uint32_t(id.tile) < combines;
          want = Counter::kDgrad1Done, want_target = uint32_t(B) * nh;
          break;
        default:
          in_range = false;
      }
      if (!in_range) {
        fail(o, t, "out of range");
        ++next[o], moved = true;
        continue;
      }
      if (id.wait != want || (want != Counter::kNone && want != Counter::kDgrad1Done &&
                              id.wait_index != want_index) ||
          (want != Counter::kNone && id.wait_target != want_target)) {
        fail(o, t, "waits for the wrong counter or count");
        ++next[o], moved = true;
        continue;
      }
      uint32_t have = 0;
      switch (id.wait) {
        case Counter::kBlockReady: have = block_ready[id.wait_index]; break;
        case Counter::kExpertReady: have = expert_ready[id.wait_index]; break;
        case Counter::kDgrad1Done: have = dgrad1_done; break;
        case Counter::kNone: break;
      }
      if (have < id.wait_target) continue;  // the rank waits; another may go on
      if ((id.kind == Kind::kWgradDown || id.kind == Kind::kWgradGateUp)) {
        // The weight gradient's loop over the smaller side is the inner one: after
        // (m, n) comes (m + 1, n), or (0, n + wn) past the last M tile, when the M
        // side (tiles of wgrad_rows) is at most the N side (tiles of 256); else
        // (m, n + wn), or (m + 1, 0) past the last chunk.
        const bool down = id.kind == Kind::kWgradDown;
        const uint32_t mt = down ? mf : mh, nt = down ? nh : n2f;
        Wgrad& prev = last[o];
        if (prev.kind == id.kind && prev.expert == id.block) {
          int32_t m = prev.m, n = prev.n;
          if (mt * uint32_t(wgrad_rows) <= nt * 256u) {
            if (++m == int32_t(mt)) m = 0, n += int32_t(wn);
          } else if ((n += int32_t(wn)) >= int32_t(nt)) {
            n = 0, ++m;
          }
          if (id.mtile != m || id.tile != n) fail(o, t, "weight-gradient tiles out of order");
        } else if (id.mtile != 0 || id.tile != 0) {
          fail(o, t, "a weight gradient starts past its first tile");
        }
        prev = {id.kind, id.block, id.mtile, id.tile};
      }
      // What it counts when done (the kernel's consumers).
      switch (id.kind) {
        case Kind::kDgrad2: ++block_ready[id.block]; break;
        case Kind::kSwiglu:
          ++block_ready[id.block];
          ++expert_ready[expert_of_block[id.block]];
          break;
        case Kind::kDgrad1: ++dgrad1_done; break;
        default: break;
      }
      const bool wgrad = id.kind == Kind::kWgradDown || id.kind == Kind::kWgradGateUp;
      const int64_t place = id.kind == Kind::kCombine ? o : id.block;
      if (!seen.insert({int(id.kind), place, wgrad ? id.mtile : 0, id.tile}).second) {
        fail(o, t, "a task twice");
      }
      ++next[o], moved = true;
    }
    if (!moved) {
      fail(-1, 0, "deadlock: every unfinished rank waits for a task that cannot run");
      break;
    }
  }
  uint64_t all = 0;
  for (uint64_t n : expected) all += n;
  if (seen.size() != all) fail(-1, 0, "not every task once");
  return errors;
}

}  // namespace

int main() {
  std::mt19937 rng(7);
  int cases = 0, errors = 0;
  auto run = [&](int64_t tokens, int64_t H, int64_t F, const std::vector<int32_t>& blocks) {
    ++cases;
    errors += check(tokens, H, F, blocks) + check(tokens, H, F, blocks, 1, kWideRows);
    errors += check(tokens, H, F, blocks, 1, kWideRows, mok::cuda::kBandBlocks, 1u << 20, 8);
    for (uint32_t lag : {0u, 9u, 23u, TaskList::swiglu_lag(F, 132)}) {
      errors += check(tokens, H, F, blocks, 1, kTileRows, lag);
    }
    int64_t rows = 0;  // as many as the row blocks hold at most
    for (int32_t b : blocks) rows += int64_t(b) * kTileRows;
    for (uint32_t wn : {1u, 3u, TaskList::wgrad_n(rows, int64_t(blocks.size()))}) {
      errors += check(tokens, H, F, blocks, 1, kWideRows, mok::cuda::kBandBlocks, wn);
    }
    errors += check_band_order(blocks, ceil_div(F, 128), 1) + check_band_order(blocks, 1, 1);
  };
  // Fixed corners: one expert, every expert empty, one expert with every block,
  // sizes off the 64 and 256 tiles.
  run(1, 8, 8, {1});
  run(3, 136, 200, {0, 0, 0});
  run(256, 2048, 768, std::vector<int32_t>(128, 1));
  std::vector<int32_t> one_hot(64, 0);
  one_hot[17] = 32;
  run(256, 2048, 1024, one_hot);
  const int64_t dims[] = {8, 64, 136, 200, 256, 264, 768, 1536, 2048, 2880};
  for (int i = 0; i < 300; ++i) {
    const int64_t E = 1 + rng() % 160;
    std::vector<int32_t> blocks(E);
    const int most = 1 + rng() % (i % 4 == 0 ? 40 : 6);  // some past a band's 8 blocks
    for (auto& b : blocks) b = (rng() % 3 == 0) ? 0 : int32_t(rng() % (most + 1));
    run(1 + rng() % 5000, dims[rng() % 10], dims[rng() % 10], blocks);
  }
  // EP ranks on one launch: P = 2, 4, 8 over experts and tokens divisible by P.
  auto run_ranks = [&](int P, int64_t tokens, int64_t H, int64_t F,
                       const std::vector<int32_t>& blocks) {
    ++cases;
    errors += check(tokens, H, F, blocks, P) + check(tokens, H, F, blocks, P, kWideRows);
    errors += check(tokens, H, F, blocks, P, kTileRows, TaskList::swiglu_lag(F, 132 / P), 2);
    errors += check(tokens, H, F, blocks, P, kWideRows, mok::cuda::kBandBlocks, 1u << 20, 8);
    errors += check_band_order(blocks, ceil_div(H, 256), P);
  };
  run_ranks(8, 8, 64, 72, std::vector<int32_t>(8, 0));  // one token per rank, no rows
  run_ranks(4, 0, 64, 64, std::vector<int32_t>(8, 0));  // no tokens: weight gradients only
  run_ranks(2, 256, 2048, 768, one_hot);                 // every block at one rank
  for (int i = 0; i < 150; ++i) {
    const int P = 2 << (rng() % 3);
    const int64_t E = P * (1 + rng() % 20);
    std::vector<int32_t> blocks(E);
    const int most = 1 + rng() % 6;
    for (auto& b : blocks) b = (rng() % 3 == 0) ? 0 : int32_t(rng() % (most + 1));
    run_ranks(P, P * (1 + rng() % 600), dims[rng() % 10], dims[rng() % 10], blocks);
  }
  std::printf("%d cases, %d errors\n", cases, errors);
  return errors == 0 ? 0 : 1;
}
