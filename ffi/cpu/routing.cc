#include "routing.h"

#include <algorithm>

namespace mok::cpu {

RoutingPlan build_routing_plan(const int32_t* ids, int64_t tokens, int64_t top_k,
                               int64_t experts, int64_t capacity) {
  const int64_t pairs = tokens * top_k;
  RoutingPlan plan;
  plan.routed.assign(experts, 0);
  plan.expert_begin.assign(experts + 1, 0);
  plan.pair_row.assign(pairs, -1);

  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t e = ids[p];
    if (e < 0 || e >= experts) {
      ++plan.invalid;
    } else {
      ++plan.routed[e];
    }
  }
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t kept = capacity < 0 ? plan.routed[e]
                                      : std::min<int64_t>(plan.routed[e], capacity);
    plan.dropped += static_cast<int32_t>(plan.routed[e] - kept);
    plan.expert_begin[e + 1] = plan.expert_begin[e] + kept;
  }
  plan.num_rows = plan.expert_begin[experts];
  plan.row_pair.assign(plan.num_rows, 0);

  // Second pass in (t, k) order: the n-th pair of expert e takes row begin[e] + n.
  std::vector<int64_t> seen(experts, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t e = ids[p];
    if (e < 0 || e >= experts) continue;
    const int64_t n = seen[e]++;
    const int64_t row = plan.expert_begin[e] + n;
    if (row < plan.expert_begin[e + 1]) {
      plan.pair_row[p] = row;
      plan.row_pair[row] = p;
    }
  }
  return plan;
}

}  // namespace mok::cpu
