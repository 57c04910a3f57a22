#include "moe_cuda.h"

#include <algorithm>

#include "cuda_check.h"
#include "workspace.h"
#include "expert_ffn_cuda.h"
#include "moe_elementwise.h"
#include "moe_persistent.h"
#include "routing.h"

namespace mok::cuda {
namespace {

size_t elem_bytes(DType t) { return t == DType::kF32 ? 4 : 2; }

ExpertFfnShape ffn_shape(const MoeShape& s) {
  return {s.tokens * s.top_k, s.experts, s.hidden, s.ffn};
}

// The one place that chooses how a pass runs after the routing plan: the
// persistent kernel (moe_persistent.h) where it takes the call, else the kernel
// chain (gathers, expert FFN, combine). Both give the same bits, in either pass.
// (The persistent kernels exist in sm_90a builds only; elsewhere the chain runs.)
#ifdef MOK_HAVE_SM90A
bool use_persistent(const MoeShape& s, Recipe recipe, DType dt, bool residuals) {
  return persistent_supported(s, recipe, dt, residuals);
}
bool use_persistent_backward(const MoeShape& s, Recipe recipe, DType dt) {
  return persistent_backward_supported(s, recipe, dt);
}
#endif

// EP ranks on one launch (ranks > 1) exist in the persistent kernels only.
std::string ranks_can_run(const MoeShape& s, Recipe recipe, DType dt, int ranks,
                          const char* pass) {
  if (ranks == 1) return {};
  MOK_RETURN_IF_MESSAGE(persistent_ranks_error(s, ranks));
#ifdef MOK_HAVE_SM90A
  const bool can = persistent_can_run(s, recipe, dt);
#else
  const bool can = false;
  (void)s, (void)recipe, (void)dt;
#endif
  if (can) return {};
  return std::string("EP ranks on one launch run in the persistent ") + pass +
         " only: it needs sm_90a code, a compute capability 9.0 device, bf16 x and "
         "weights, the native recipe, H and F multiples of 8 and E <= 4096";
}

// The layer's own buffers around the expert FFN, which takes its scratch after them.
struct ForwardBuffers {
  RoutingPlanDevice plan;
  bool persistent;  // the pass is the persistent kernel (decided once, by the carve)
  void* x_rows;    // [R, H], or nullptr when saved (the x_rows result buffer holds them)
  void* out_rows;  // [R, H]
  void* ffn_scratch;
  size_t ffn_scratch_bytes;
};

ForwardBuffers carve_forward(void* ws, const MoeShape& s, Recipe recipe, DType dt,
                             bool save_gate_up, int ranks, size_t* total) {
  // The residuals, when saved, are result buffers, not workspace: gate_up, and the
  // x rows GEMM1 reads (gathered straight into the x_rows result).
  const int64_t pairs = s.tokens * s.top_k;
  const size_t eb = elem_bytes(dt);
  Carver c(ws);
  ForwardBuffers b{};
  void* plan = c.take(routing_plan_bytes(pairs, s.experts));
  if (ws) b.plan = carve_routing_plan(plan, pairs, s.experts);
#ifdef MOK_HAVE_SM90A
  if (ranks > 1 || use_persistent(s, recipe, dt, save_gate_up)) {
    b.persistent = true;
    b.ffn_scratch_bytes = persistent_forward_workspace_bytes(s, ranks);
    b.ffn_scratch = c.take(b.ffn_scratch_bytes);
    *total = c.used();
    return b;
  }
#endif
  if (!save_gate_up) b.x_rows = c.take(pairs * s.hidden * eb);
  b.out_rows = c.take(pairs * s.hidden * eb);
  b.ffn_scratch_bytes = expert_ffn_forward_rows_bytes(ffn_shape(s), recipe, dt);
  b.ffn_scratch = c.take(b.ffn_scratch_bytes);
  *total = c.used();
  return b;
}

struct BackwardBuffers {
  RoutingPlanDevice plan;
  bool persistent;  // the pass is the persistent kernel (decided once, by the carve)
  void* dy_rows;  // [R, H], then the dx rows (the expert FFN reads dy first)
  void* ffn_scratch;
  size_t ffn_scratch_bytes;
};

BackwardBuffers carve_backward(void* ws, const MoeShape& s, Recipe recipe, DType dt, int ranks,
                               size_t* total) {
  const int64_t pairs = s.tokens * s.top_k;
  Carver c(ws);
  BackwardBuffers b{};
  void* plan = c.take(routing_plan_bytes(pairs, s.experts));
  if (ws) b.plan = carve_routing_plan(plan, pairs, s.experts);
#ifdef MOK_HAVE_SM90A
  if (ranks > 1 || use_persistent_backward(s, recipe, dt)) {
    b.persistent = true;
    b.ffn_scratch_bytes = persistent_backward_workspace_bytes(s, ranks);
    b.ffn_scratch = c.take(b.ffn_scratch_bytes);
    *total = c.used();
    return b;
  }
#endif
  b.dy_rows = c.take(pairs * s.hidden * elem_bytes(dt));
  b.ffn_scratch_bytes = expert_ffn_backward_rows_bytes(ffn_shape(s), recipe, dt);
  b.ffn_scratch = c.take(b.ffn_scratch_bytes);
  *total = c.used();
  return b;
}

}  // namespace

size_t moe_forward_workspace_bytes(const MoeShape& shape, Recipe recipe, DType x_dtype,
                                   bool save_gate_up, int ranks) {
  size_t total = 0;
  carve_forward(nullptr, shape, recipe, x_dtype, save_gate_up, ranks, &total);
  return total;
}

size_t moe_backward_workspace_bytes(const MoeShape& shape, Recipe recipe, DType x_dtype,
                                    int ranks) {
  size_t total = 0;
  carve_backward(nullptr, shape, recipe, x_dtype, ranks, &total);
  return total;
}

std::string moe_forward(const MoeForwardArgs& a, void* x_rows_out, void* workspace,
                        size_t workspace_bytes, cudaStream_t stream) {
  const auto [T, K, E, H, F] = a.shape;
  const int64_t pairs = T * K;
  size_t need = 0;
  MOK_RETURN_IF_MESSAGE(ranks_can_run(a.shape, a.recipe, a.x_dtype, a.ranks, "forward"));
  ForwardBuffers b = carve_forward(workspace, a.shape, a.recipe, a.x_dtype,
                                   x_rows_out != nullptr, a.ranks, &need);
  if (need > workspace_bytes) return "MoE forward: workspace too small";
  if (x_rows_out != nullptr) b.x_rows = x_rows_out;  // saved for the backward
  const int64_t* num_rows = b.plan.expert_begin + E;  // kept rows, on the device

#ifdef MOK_HAVE_SM90A
  if (b.persistent) {
    MOK_RETURN_IF_MESSAGE(persistent_forward_prepare(a.shape, b.ffn_scratch,
                                                     b.ffn_scratch_bytes, stream, a.ranks));
    MOK_RETURN_IF_MESSAGE(build_routing_plan(a.expert_ids, pairs, E, a.capacity, b.plan,
                                             a.tokens_per_expert, a.dropped, a.invalid, stream));
    const PersistentForwardArgs p{a.shape,       a.weight_dtype,     a.x,
                                  a.expert_weights, a.w_gate_up,     a.w_down,
                                  b.plan.expert_begin, b.plan.row_pair, b.plan.pair_row,
                                  x_rows_out,    a.gate_up_out,      a.y,
                                  a.ranks};
    return persistent_forward(p, b.ffn_scratch, b.ffn_scratch_bytes, stream);
  }
#endif
  MOK_RETURN_IF_MESSAGE(build_routing_plan(a.expert_ids, pairs, E, a.capacity, b.plan,
                                           a.tokens_per_expert, a.dropped, a.invalid, stream));
  MOK_RETURN_IF_MESSAGE(gather_token_rows(a.x_dtype, a.x, b.plan.row_pair, num_rows, pairs, K, H,
                                          b.x_rows, stream));
  const ExpertGroups groups{b.plan.expert_begin, b.plan.tile_begin};
  MOK_RETURN_IF_MESSAGE(expert_ffn_forward_rows(ffn_shape(a.shape), a.recipe, a.x_dtype, groups,
                                                b.x_rows, a.w_gate_up, a.w_down, b.out_rows,
                                                a.gate_up_out, b.ffn_scratch,
                                                b.ffn_scratch_bytes, stream));
  return combine_rows(a.x_dtype, a.weight_dtype, b.out_rows, a.expert_weights, b.plan.pair_row, T,
                      K, H, a.y, stream);
}

std::string moe_backward(const MoeBackwardArgs& a, const void* x_rows, void* workspace,
                         size_t workspace_bytes, cudaStream_t stream) {
  const auto [T, K, E, H, F] = a.shape;
  const int64_t pairs = T * K;
  size_t need = 0;
  MOK_RETURN_IF_MESSAGE(ranks_can_run(a.shape, a.recipe, a.x_dtype, a.ranks, "backward"));
  BackwardBuffers b = carve_backward(workspace, a.shape, a.recipe, a.x_dtype, a.ranks, &need);
  if (need > workspace_bytes) return "MoE backward: workspace too small";
  if (x_rows == nullptr && pairs > 0) return "MoE backward: the forward's x rows are missing";
  const int64_t* num_rows = b.plan.expert_begin + E;

#ifdef MOK_HAVE_SM90A
  if (b.persistent) {
    MOK_RETURN_IF_MESSAGE(persistent_backward_prepare(a.shape, b.ffn_scratch,
                                                      b.ffn_scratch_bytes, stream, a.ranks));
    MOK_RETURN_IF_MESSAGE(build_routing_plan(a.expert_ids, pairs, E, a.capacity, b.plan,
                                             nullptr, nullptr, nullptr, stream));
    const PersistentBackwardArgs p{a.shape,        a.weight_dtype,   a.dy,
                                   x_rows,         a.gate_up,        a.expert_weights,
                                   a.w_gate_up,    a.w_down,         b.plan.expert_begin,
                                   b.plan.row_pair, b.plan.pair_row, a.dx,
                                   a.d_expert_weights, a.d_w_gate_up, a.d_w_down,
                                   a.ranks};
    return persistent_backward(p, b.ffn_scratch, b.ffn_scratch_bytes, stream);
  }
#endif
  MOK_RETURN_IF_MESSAGE(build_routing_plan(a.expert_ids, pairs, E, a.capacity, b.plan, nullptr,
                                           nullptr, nullptr, stream));
  // x rows: the forward's (x_rows), not gathered again. dy rows: a plain gather.
  MOK_RETURN_IF_MESSAGE(gather_token_rows(a.x_dtype, a.dy, b.plan.row_pair, num_rows, pairs, K,
                                          H, b.dy_rows, stream));
  const ExpertGroups groups{b.plan.expert_begin, b.plan.tile_begin};
  const RowWeights w{a.weight_dtype, a.expert_weights, a.d_expert_weights, b.plan.row_pair,
                     b.plan.pair_row, pairs};
  void* dx_rows = b.dy_rows;  // written after the last read of the dy rows
  MOK_RETURN_IF_MESSAGE(expert_ffn_backward_rows(ffn_shape(a.shape), a.recipe, a.x_dtype, groups,
                                                 w, x_rows, b.dy_rows, a.w_gate_up, a.w_down,
                                                 a.gate_up, dx_rows, a.d_w_gate_up, a.d_w_down,
                                                 b.ffn_scratch, b.ffn_scratch_bytes, stream));
  return combine_rows(a.x_dtype, a.weight_dtype, dx_rows, nullptr, b.plan.pair_row, T, K, H, a.dx,
                      stream);
}

}  // namespace mok::cuda
