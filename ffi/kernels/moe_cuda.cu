#include "moe_cuda.h"

#include <algorithm>

#include "cuda_check.h"
#include "workspace.h"
#include "grouped_gemm.h"
#include "moe_elementwise.h"
#include "routing.h"

namespace mok::cuda {
namespace {

size_t elem_bytes(DType t) { return t == DType::kF32 ? 4 : 2; }

struct ForwardBuffers {
  RoutingPlanDevice plan;
  void* x_rows;     // [R, H], or nullptr when saved (the x_rows result buffer holds them)
  float* gate_up_f32;  // [R, 2F] GEMM1's f32 accumulators, or the interleaved
                       // weight of the fused SwiGLU GEMM (which is smaller)
  void* h;          // [R, F]
  void* out_rows;   // [R, H]
  void* gemm_ws;
  size_t gemm_ws_bytes;
};

ForwardBuffers carve_forward(void* ws, const MoeShape& s, DType dt, bool save_gate_up,
                             size_t* total) {
  // The residuals, when saved, are result buffers, not workspace: gate_up, and the
  // x rows GEMM1 reads (gathered straight into the x_rows result).
  const int64_t pairs = s.tokens * s.top_k;
  const size_t eb = elem_bytes(dt);
  Carver c(ws);
  ForwardBuffers b{};
  void* plan = c.take(routing_plan_bytes(pairs, s.experts));
  if (ws) b.plan = carve_routing_plan(plan, pairs, s.experts);
  if (!save_gate_up) b.x_rows = c.take(pairs * s.hidden * eb);
  // GEMM1's f32 accumulators, or the interleaved weight of the fused SwiGLU GEMM.
  b.gate_up_f32 = static_cast<float*>(c.take(std::max(
      pairs * 2 * s.ffn * sizeof(float), swiglu_interleave_bytes(s.experts, s.hidden, s.ffn, pairs))));
  b.h = c.take(pairs * s.ffn * eb);
  b.out_rows = c.take(pairs * s.hidden * eb);
  b.gemm_ws_bytes = grouped_gemm_workspace_bytes(s.experts);
  b.gemm_ws = c.take(b.gemm_ws_bytes);
  *total = c.used();
  return b;
}

struct BackwardBuffers {
  RoutingPlanDevice plan;
  void* dy_rows;    // [R, H], reused for dx rows once dh and dW_down are computed
  float* dh_raw;    // [R, F] f32
  void* wh_rows;    // [R, F] round_x(w h), dW_down's operand
  void* d_gate_up;  // [R, 2F]
  void* gemm_ws;
  size_t gemm_ws_bytes;
};

BackwardBuffers carve_backward(void* ws, const MoeShape& s, DType dt, size_t* total) {
  const int64_t pairs = s.tokens * s.top_k;
  const size_t eb = elem_bytes(dt);
  Carver c(ws);
  BackwardBuffers b{};
  void* plan = c.take(routing_plan_bytes(pairs, s.experts));
  if (ws) b.plan = carve_routing_plan(plan, pairs, s.experts);
  b.dy_rows = c.take(pairs * s.hidden * eb);
  b.dh_raw = static_cast<float*>(c.take(pairs * s.ffn * sizeof(float)));
  b.wh_rows = c.take(pairs * s.ffn * eb);
  b.d_gate_up = c.take(pairs * 2 * s.ffn * eb);
  b.gemm_ws_bytes = grouped_gemm_workspace_bytes(s.experts);
  b.gemm_ws = c.take(b.gemm_ws_bytes);
  *total = c.used();
  return b;
}

}  // namespace

size_t moe_forward_workspace_bytes(const MoeShape& shape, DType x_dtype, bool save_gate_up) {
  size_t total = 0;
  carve_forward(nullptr, shape, x_dtype, save_gate_up, &total);
  return total;
}

size_t moe_backward_workspace_bytes(const MoeShape& shape, DType x_dtype) {
  size_t total = 0;
  carve_backward(nullptr, shape, x_dtype, &total);
  return total;
}

std::string moe_forward(const MoeForwardArgs& a, void* x_rows_out, void* workspace,
                        size_t workspace_bytes, cudaStream_t stream) {
  const auto [T, K, E, H, F] = a.shape;
  const int64_t pairs = T * K;
  size_t need = 0;
  ForwardBuffers b = carve_forward(workspace, a.shape, a.x_dtype, x_rows_out != nullptr, &need);
  if (need > workspace_bytes) return "MoE forward: workspace too small";
  if (x_rows_out != nullptr) b.x_rows = x_rows_out;  // saved for the backward
  const int64_t* num_rows = b.plan.expert_begin + E;  // kept rows, on the device

  MOK_RETURN_IF_MESSAGE(build_routing_plan(a.expert_ids, pairs, E, a.capacity, b.plan,
                                           a.tokens_per_expert, a.dropped, a.invalid, stream));
  MOK_RETURN_IF_MESSAGE(gather_token_rows(a.x_dtype, a.x, b.plan.row_pair, num_rows, pairs, K, H,
                                          b.x_rows, stream));
  // SwiGLU in GEMM1's epilogue where it applies; else GEMM1 keeps f32 so that
  // SwiGLU sees the accumulators (the residual is rounded). Same bits either way.
  bool fused = false;
  const SwigluGemm fused_gemm1{E, b.plan.expert_begin, pairs, H, F, a.x_dtype, b.x_rows, a.w_gate_up,
                               b.h, a.gate_up_out};
  MOK_RETURN_IF_MESSAGE(
      run_swiglu_gemm(fused_gemm1, b.gate_up_f32, b.gemm_ws, b.gemm_ws_bytes, stream, &fused));
  if (!fused) {
    RowsGemm gemm1{E, b.plan.expert_begin, pairs, 2 * F, H, false, a.x_dtype, DType::kF32,
                   b.x_rows, a.w_gate_up, b.gate_up_f32};
    MOK_RETURN_IF_MESSAGE(
        run_rows_gemm(gemm1, b.plan.tile_begin, b.gemm_ws, b.gemm_ws_bytes, stream));
    MOK_RETURN_IF_MESSAGE(swiglu_forward(a.x_dtype, b.gate_up_f32, num_rows, pairs, F, b.h,
                                         a.gate_up_out, stream));
  }
  RowsGemm gemm2{E, b.plan.expert_begin, pairs, H, F, false, a.x_dtype, a.x_dtype,
                 b.h, a.w_down, b.out_rows};
  MOK_RETURN_IF_MESSAGE(run_rows_gemm(gemm2, b.plan.tile_begin, b.gemm_ws, b.gemm_ws_bytes, stream));
  return combine_rows(a.x_dtype, a.weight_dtype, b.out_rows, a.expert_weights, b.plan.pair_row, T,
                      K, H, a.y, stream);
}

std::string moe_backward(const MoeBackwardArgs& a, const void* x_rows, void* workspace,
                         size_t workspace_bytes, cudaStream_t stream) {
  const auto [T, K, E, H, F] = a.shape;
  const int64_t pairs = T * K;
  size_t need = 0;
  BackwardBuffers b = carve_backward(workspace, a.shape, a.x_dtype, &need);
  if (need > workspace_bytes) return "MoE backward: workspace too small";
  if (x_rows == nullptr && pairs > 0) return "MoE backward: the forward's x rows are missing";
  const int64_t* num_rows = b.plan.expert_begin + E;

  MOK_RETURN_IF_MESSAGE(build_routing_plan(a.expert_ids, pairs, E, a.capacity, b.plan, nullptr,
                                           nullptr, nullptr, stream));
  // x rows: the forward's (x_rows), not gathered again. dy rows: a plain gather
  // (the combine weight goes into SwiGLU's backward and into dW_down's h operand).
  MOK_RETURN_IF_MESSAGE(gather_token_rows(a.x_dtype, a.dy, b.plan.row_pair, num_rows, pairs, K,
                                          H, b.dy_rows, stream));
  // dh_raw = dy @ Wd^T (f32), then SwiGLU backward and d expert_weights.
  RowsGemm dgrad2{E, b.plan.expert_begin, pairs, F, H, true, a.x_dtype, DType::kF32,
                  b.dy_rows, a.w_down, b.dh_raw};
  MOK_RETURN_IF_MESSAGE(run_rows_gemm(dgrad2, b.plan.tile_begin, b.gemm_ws, b.gemm_ws_bytes, stream));
  MOK_RETURN_IF_MESSAGE(swiglu_backward(a.x_dtype, a.weight_dtype, a.gate_up, b.dh_raw,
                                        a.expert_weights, b.plan.row_pair, b.plan.pair_row,
                                        num_rows, pairs, pairs, F, b.wh_rows, b.d_gate_up,
                                        a.d_expert_weights, stream));
  // Weight gradients over each expert's rows in canonical order, both in one
  // launch; dW_down reads the dy rows, so they run before dgrad1 overwrites them.
  WeightGradGemm wgrad_gate_up{E, b.plan.expert_begin, pairs, H, 2 * F, a.x_dtype, x_rows,
                               b.d_gate_up, a.d_w_gate_up};
  WeightGradGemm wgrad_down{E, b.plan.expert_begin, pairs, F, H, a.x_dtype, b.wh_rows,
                            b.dy_rows, a.d_w_down};
  MOK_RETURN_IF_MESSAGE(
      run_weight_grad_gemms(wgrad_gate_up, wgrad_down, b.gemm_ws, b.gemm_ws_bytes, stream));
  // dx rows = dgu @ Wgu^T (into the dy rows' buffer, no longer needed).
  void* dx_rows = b.dy_rows;
  RowsGemm dgrad1{E, b.plan.expert_begin, pairs, H, 2 * F, true, a.x_dtype, a.x_dtype,
                  b.d_gate_up, a.w_gate_up, dx_rows};
  MOK_RETURN_IF_MESSAGE(run_rows_gemm(dgrad1, b.plan.tile_begin, b.gemm_ws, b.gemm_ws_bytes, stream));
  return combine_rows(a.x_dtype, a.weight_dtype, dx_rows, nullptr, b.plan.pair_row, T, K, H, a.dx,
                      stream);
}

}  // namespace mok::cuda
