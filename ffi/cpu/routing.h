// The routing plan: which (token, k) pair becomes which row of which expert.
//
// Rows of expert e are the kept pairs routed to e in global order (token index,
// then k). Capacity keeps the first `capacity` pairs of each expert in that order
// and drops the rest (highest token index first). Ids outside [0, E) are invalid:
// they get no row and are counted. Positions come from counts and prefix sums
// only, so the plan is the same on every run and for every way of sharding.
#pragma once

#include <cstdint>
#include <vector>

#include "mok/types.h"

namespace mok::cpu {

struct RoutingPlan {
  int64_t num_rows = 0;                 // kept pairs over all experts
  std::vector<int64_t> expert_begin;    // [E + 1] first row of each expert
  std::vector<int64_t> row_pair;        // [num_rows] row -> pair index t * K + k
  std::vector<int64_t> pair_row;        // [T * K] pair -> row, or -1 (dropped/invalid)
  std::vector<int32_t> routed;          // [E] valid pairs routed to e, before capacity
  int32_t dropped = 0;                  // valid pairs removed by capacity
  int32_t invalid = 0;                  // pairs whose id is outside [0, E)
};

// ids: [T, K] expert ids. capacity < 0 keeps every pair.
RoutingPlan build_routing_plan(const int32_t* ids, int64_t tokens, int64_t top_k,
                               int64_t experts, int64_t capacity);

}  // namespace mok::cpu
