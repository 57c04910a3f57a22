#include "expert_ffn_cuda.h"

#include <algorithm>

#include "cuda_check.h"
#include "workspace.h"
#include "grouped_gemm.h"
#include "mok/bf16.h"
#include "moe_elementwise.h"
#include "routing.h"

namespace mok::cuda {
namespace {

size_t elem_bytes(DType t) { return t == DType::kF32 ? 4 : 2; }

// expert_begin / tile_begin from group sizes (one thread: E is small).
__global__ void group_offsets(const int32_t* __restrict__ sizes, int64_t experts, int64_t rows,
                              int64_t* __restrict__ expert_begin,
                              int64_t* __restrict__ tile_begin) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  int64_t row = 0, tile = 0;
  for (int64_t e = 0; e < experts; ++e) {
    expert_begin[e] = row;
    tile_begin[e] = tile;
    const int64_t n = min(max(int64_t(sizes[e]), int64_t(0)), rows - row);
    row += n;
    tile += (n + kSimtTileRows - 1) / kSimtTileRows;
  }
  expert_begin[experts] = row;
  tile_begin[experts] = tile;
}

__global__ void iota(int32_t* __restrict__ out, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = static_cast<int32_t>(i);
}

// pair_row[p] = p where kept, else -1: the combine kernel's view of the rows.
__global__ void kept_to_pair_row(const int32_t* __restrict__ kept, int64_t pairs,
                                 int32_t* __restrict__ pair_row) {
  const int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p < pairs) pair_row[p] = kept[p] != 0 ? static_cast<int32_t>(p) : -1;
}

constexpr int kThreads = 256;

unsigned blocks_for(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

struct Groups {
  int64_t* expert_begin;
  int64_t* tile_begin;
};

Groups carve_groups(Carver& c, int64_t experts) {
  Groups g;
  g.expert_begin = static_cast<int64_t*>(c.take((experts + 1) * sizeof(int64_t)));
  g.tile_begin = static_cast<int64_t*>(c.take((experts + 1) * sizeof(int64_t)));
  return g;
}

std::string launch_groups(const Groups& g, const int32_t* sizes, const ExpertFfnShape& s,
                          cudaStream_t stream) {
  group_offsets<<<1, 32, 0, stream>>>(sizes, s.experts, s.rows, g.expert_begin, g.tile_begin);
  MOK_CUDA_RETURN_IF_LAUNCH_FAILED("group_offsets");
  return {};
}

}  // namespace

size_t expert_ffn_forward_workspace_bytes(const ExpertFfnShape& s, DType dtype, bool save) {
  (void)save;  // the residual, when saved, is a result buffer, not workspace
  Carver c(nullptr);
  carve_groups(c, s.experts);
  c.take(std::max(s.rows * 2 * s.ffn * sizeof(float),   // GEMM1's f32 accumulators or
                  swiglu_interleave_bytes(s.experts, s.hidden, s.ffn, s.rows)));  // the fused GEMM's weight
  c.take(s.rows * s.ffn * elem_bytes(dtype));
  c.take(grouped_gemm_workspace_bytes(s.experts));
  return c.used();
}

std::string expert_ffn_forward(const ExpertFfnShape& s, DType dtype, const void* x_rows,
                               const int32_t* group_sizes, const void* w_gate_up,
                               const void* w_down, void* out_rows, void* gate_up_out,
                               void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (expert_ffn_forward_workspace_bytes(s, dtype, gate_up_out != nullptr) > workspace_bytes) {
    return "expert FFN forward: workspace too small";
  }
  Carver c(workspace);
  const Groups g = carve_groups(c, s.experts);
  auto* gate_up_f32 = static_cast<float*>(c.take(std::max(
      s.rows * 2 * s.ffn * sizeof(float), swiglu_interleave_bytes(s.experts, s.hidden, s.ffn, s.rows))));
  void* h = c.take(s.rows * s.ffn * elem_bytes(dtype));
  const size_t gemm_bytes = grouped_gemm_workspace_bytes(s.experts);
  void* gemm_ws = c.take(gemm_bytes);
  const int64_t* num_rows = g.expert_begin + s.experts;

  MOK_RETURN_IF_MESSAGE(launch_groups(g, group_sizes, s, stream));
  bool fused = false;  // SwiGLU in GEMM1's epilogue where it applies (same bits)
  const SwigluGemm fused_gemm1{s.experts, g.expert_begin, s.rows, s.hidden, s.ffn, dtype,
                               x_rows,    w_gate_up,      h,        gate_up_out};
  MOK_RETURN_IF_MESSAGE(
      run_swiglu_gemm(fused_gemm1, gate_up_f32, gemm_ws, gemm_bytes, stream, &fused));
  if (!fused) {
    RowsGemm gemm1{s.experts, g.expert_begin, s.rows, 2 * s.ffn, s.hidden, false, dtype,
                   DType::kF32, x_rows, w_gate_up, gate_up_f32};
    MOK_RETURN_IF_MESSAGE(run_rows_gemm(gemm1, g.tile_begin, gemm_ws, gemm_bytes, stream));
    MOK_RETURN_IF_MESSAGE(swiglu_forward(dtype, gate_up_f32, num_rows, s.rows, s.ffn, h,
                                         gate_up_out, stream));
  }
  RowsGemm gemm2{s.experts, g.expert_begin, s.rows, s.hidden, s.ffn, false, dtype, dtype,
                 h, w_down, out_rows};
  return run_rows_gemm(gemm2, g.tile_begin, gemm_ws, gemm_bytes, stream);
}

size_t expert_ffn_backward_workspace_bytes(const ExpertFfnShape& s, DType dtype) {
  const size_t eb = elem_bytes(dtype);
  Carver c(nullptr);
  carve_groups(c, s.experts);
  c.take(s.rows * sizeof(int32_t));            // identity row -> pair map
  c.take(s.rows * s.ffn * sizeof(float));      // dh_raw
  c.take(s.rows * s.ffn * eb);                 // round_x(w h) rows
  c.take(s.rows * 2 * s.ffn * eb);             // d gate_up
  c.take(grouped_gemm_workspace_bytes(s.experts));
  return c.used();
}

std::string expert_ffn_backward(const ExpertFfnShape& s, DType dtype, DType weight_dtype,
                                const void* x_rows, const void* dy_rows, const void* w_rows,
                                const int32_t* group_sizes, const void* w_gate_up,
                                const void* w_down, const void* gate_up, void* dx_rows,
                                void* dw_rows, void* d_w_gate_up, void* d_w_down,
                                void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (expert_ffn_backward_workspace_bytes(s, dtype) > workspace_bytes) {
    return "expert FFN backward: workspace too small";
  }
  const size_t eb = elem_bytes(dtype);
  Carver c(workspace);
  const Groups g = carve_groups(c, s.experts);
  auto* identity = static_cast<int32_t*>(c.take(s.rows * sizeof(int32_t)));
  auto* dh_raw = static_cast<float*>(c.take(s.rows * s.ffn * sizeof(float)));
  void* wh_rows = c.take(s.rows * s.ffn * eb);
  void* d_gate_up = c.take(s.rows * 2 * s.ffn * eb);
  const size_t gemm_bytes = grouped_gemm_workspace_bytes(s.experts);
  void* gemm_ws = c.take(gemm_bytes);
  const int64_t* num_rows = g.expert_begin + s.experts;

  MOK_RETURN_IF_MESSAGE(launch_groups(g, group_sizes, s, stream));
  if (s.rows > 0) {
    iota<<<blocks_for(s.rows), kThreads, 0, stream>>>(identity, s.rows);
    MOK_CUDA_RETURN_IF_LAUNCH_FAILED("iota");
  }
  // Rows are their own pairs here (the identity map): dy_rows are already by row.
  RowsGemm dgrad2{s.experts, g.expert_begin, s.rows, s.ffn, s.hidden, true, dtype, DType::kF32,
                  dy_rows, w_down, dh_raw};
  MOK_RETURN_IF_MESSAGE(run_rows_gemm(dgrad2, g.tile_begin, gemm_ws, gemm_bytes, stream));
  MOK_RETURN_IF_MESSAGE(swiglu_backward(dtype, weight_dtype, gate_up, dh_raw, w_rows, identity,
                                        identity, num_rows, s.rows, s.rows, s.ffn, wh_rows,
                                        d_gate_up, dw_rows, stream));
  RowsGemm dgrad1{s.experts, g.expert_begin, s.rows, s.hidden, 2 * s.ffn, true, dtype, dtype,
                  d_gate_up, w_gate_up, dx_rows};
  MOK_RETURN_IF_MESSAGE(run_rows_gemm(dgrad1, g.tile_begin, gemm_ws, gemm_bytes, stream));
  WeightGradGemm wgrad_gate_up{s.experts, g.expert_begin, s.rows, s.hidden, 2 * s.ffn, dtype,
                               x_rows, d_gate_up, d_w_gate_up};
  WeightGradGemm wgrad_down{s.experts, g.expert_begin, s.rows, s.ffn, s.hidden, dtype, wh_rows,
                            dy_rows, d_w_down};
  return run_weight_grad_gemms(wgrad_gate_up, wgrad_down, gemm_ws, gemm_bytes, stream);
}

size_t combine_workspace_bytes(int64_t pairs) {
  return workspace_aligned(pairs * sizeof(int32_t));
}

std::string combine_kept_rows(DType dtype, DType weight_dtype, const void* rows,
                              const void* weights, const int32_t* kept, int64_t tokens,
                              int64_t top_k, int64_t hidden, void* out, void* workspace,
                              size_t workspace_bytes, cudaStream_t stream) {
  const int64_t pairs = tokens * top_k;
  if (combine_workspace_bytes(pairs) > workspace_bytes) return "combine: workspace too small";
  auto* pair_row = static_cast<int32_t*>(workspace);
  if (pairs > 0) {
    kept_to_pair_row<<<blocks_for(pairs), kThreads, 0, stream>>>(kept, pairs, pair_row);
    MOK_CUDA_RETURN_IF_LAUNCH_FAILED("kept_to_pair_row");
  }
  return combine_rows(dtype, weight_dtype, rows, weights, pair_row, tokens, top_k, hidden, out,
                      stream);
}

}  // namespace mok::cuda
