// The persistent backward's task list (ffi/kernels/moe_persistent_backward_tasks.h),
// checked on the host over many routings: every task appears exactly once, waits
// for the counter its data needs (stated here from what each kind of task reads
// and what the kernel's consumers count), and that wait is met by the tasks
// numbered before it. Run with tests/test_persistent_task_order.py; prints
// "N cases, 0 errors".
#include <cstdint>
#include <cstdio>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "moe_persistent_backward_tasks.h"

using namespace mok::cuda::backward_tasks;

namespace {

uint32_t ceil_div(int64_t n, int64_t d) { return static_cast<uint32_t>((n + d - 1) / d); }

// Runs the tasks one at a time in number order, as the counters would see them if
// each CTA finished its task before the next was claimed; returns the errors.
int check(int64_t tokens, int64_t H, int64_t F, const std::vector<int32_t>& blocks_of) {
  const int64_t E = static_cast<int64_t>(blocks_of.size());
  std::vector<int32_t> begin(E + 1, 0);
  std::vector<int64_t> expert_of_block;
  for (int64_t e = 0; e < E; ++e) {
    begin[e + 1] = begin[e] + blocks_of[e];
    for (int32_t k = 0; k < blocks_of[e]; ++k) expert_of_block.push_back(e);
  }
  const int64_t B = begin[E];
  const uint32_t nf = ceil_div(F, 256), nh = ceil_div(H, 256);
  const uint32_t mf = ceil_div(F, 64), mh = ceil_div(H, 64);
  const uint32_t combines = ceil_div(tokens, 2);
  const TaskList list(tokens, E, H, F, begin.data());

  std::vector<uint32_t> block_ready(B, 0), expert_ready(E, 0);
  uint32_t dgrad1_done = 0;
  std::set<std::tuple<int, int64_t, int32_t>> seen;
  int errors = 0;
  auto fail = [&](uint32_t t, const char* what) {
    if (++errors <= 5) {
      std::printf("T=%lld E=%lld H=%lld F=%lld B=%lld: task %u: %s\n", (long long)tokens,
                  (long long)E, (long long)H, (long long)F, (long long)B, t, what);
    }
  };
  const uint64_t expected_tasks =
      uint64_t(B) * (nf + 1 + nh) + uint64_t(E) * (mf + mh) + combines;
  for (uint32_t t = 0;; ++t) {
    if (t > expected_tasks + 1) {
      fail(t, "no end");
      break;
    }
    const TaskId id = list.at(t, begin.data(), E);
    if (id.kind == Kind::kEnd) {
      if (t != expected_tasks || list.total != expected_tasks) fail(t, "ends at the wrong number");
      break;
    }
    // What the task reads, so what it must wait for.
    Counter want = Counter::kNone;
    int64_t want_index = 0;
    uint32_t want_target = 0;
    bool in_range = true;
    switch (id.kind) {
      case Kind::kDgrad2:  // dy and W_down only
        in_range = id.block >= 0 && id.block < B && id.tile >= 0 && uint32_t(id.tile) < nf;
        break;
      case Kind::kSwiglu:  // dh of its block: every dgrad2 tile of it
        in_range = id.block >= 0 && id.block < B;
        want = Counter::kBlockReady, want_index = id.block, want_target = nf;
        break;
      case Kind::kDgrad1:  // d gate_up of its block: its SwiGLU task
        in_range = id.block >= 0 && id.block < B && id.tile >= 0 && uint32_t(id.tile) < nh;
        want = Counter::kBlockReady, want_index = id.block, want_target = nf + 1;
        break;
      case Kind::kWgradDown:    // wh of the expert's rows
      case Kind::kWgradGateUp:  // d gate_up of the expert's rows
        in_range = id.block >= 0 && id.block < E && id.mtile >= 0 &&
                   uint32_t(id.mtile) < (id.kind == Kind::kWgradDown ? mf : mh);
        if (in_range) {
          want = Counter::kExpertReady, want_index = id.block,
          want_target = uint32_t(blocks_of[id.block]);
        }
        break;
      case Kind::kCombine:  // every dx row
        in_range = id.tile >= 0 && uint32_t(id.tile) < combines;
        want = Counter::kDgrad1Done, want_target = uint32_t(B) * nh;
        break;
      default:
        in_range = false;
    }
    if (!in_range) {
      fail(t, "out of range");
      continue;
    }
    if (id.wait != want || (want != Counter::kNone && want != Counter::kDgrad1Done &&
                            id.wait_index != want_index) ||
        (want != Counter::kNone && id.wait_target != want_target)) {
      fail(t, "waits for the wrong counter or count");
      continue;
    }
    // The tasks before it have brought the counter there.
    uint32_t have = 0;
    switch (id.wait) {
      case Counter::kBlockReady: have = block_ready[id.wait_index]; break;
      case Counter::kExpertReady: have = expert_ready[id.wait_index]; break;
      case Counter::kDgrad1Done: have = dgrad1_done; break;
      case Counter::kNone: break;
    }
    if (have < id.wait_target) fail(t, "waits for a task numbered after it");
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
    const int32_t tile = id.kind == Kind::kWgradDown || id.kind == Kind::kWgradGateUp ? id.mtile
                                                                                       : id.tile;
    const int64_t place = id.kind == Kind::kCombine ? 0 : id.block;
    if (!seen.insert({int(id.kind), place, tile}).second) fail(t, "a task twice");
  }
  if (seen.size() != expected_tasks) fail(0, "not every task once");
  return errors;
}

}  // namespace

int main() {
  std::mt19937 rng(7);
  int cases = 0, errors = 0;
  auto run = [&](int64_t tokens, int64_t H, int64_t F, const std::vector<int32_t>& blocks) {
    ++cases;
    errors += check(tokens, H, F, blocks);
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
    const int most = 1 + rng() % 6;
    for (auto& b : blocks) b = (rng() % 3 == 0) ? 0 : int32_t(rng() % (most + 1));
    run(1 + rng() % 5000, dims[rng() % 10], dims[rng() % 10], blocks);
  }
  std::printf("%d cases, %d errors\n", cases, errors);
  return errors == 0 ? 0 : 1;
}
