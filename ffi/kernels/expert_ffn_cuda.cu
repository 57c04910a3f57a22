#include "expert_ffn_cuda.h"

#include <algorithm>

#include "cuda_check.h"
#include "expert_ffn_fp8.h"
#include "grouped_gemm.h"
#include "moe_elementwise.h"
#include "routing.h"
#include "workspace.h"

namespace mok::cuda {
namespace {

size_t elem_bytes(DType t) { return t == DType::kF32 ? 4 : 2; }

// The recipes these kernels implement: the expert GEMMs in the activations' dtype
// (kNative) and in e4m3 with block scales (kFp8, expert_ffn_fp8.h).
std::string check_recipe(Recipe recipe, const char* what) {
  if (recipe == Recipe::kNative || recipe == Recipe::kFp8) return {};
  return std::string(what) + ": recipe " + recipe_name(recipe) + " has no CUDA kernels";
}

// The forward's scratch, laid out (or, with a null base, measured) by one function.
struct ForwardScratch {
  float* gate_up_f32;  // [R, 2F] GEMM1's f32 accumulators, or the interleaved
                       // weight of the fused SwiGLU GEMM (which is smaller)
  void* h;             // [R, F]
  void* gemm_ws;
  size_t gemm_ws_bytes;
};

ForwardScratch carve_forward(Carver& c, const ExpertFfnShape& s, DType dtype) {
  ForwardScratch b{};
  b.gate_up_f32 = static_cast<float*>(c.take(std::max(
      s.rows * 2 * s.ffn * sizeof(float),
      swiglu_interleave_bytes(s.experts, s.hidden, s.ffn, s.rows))));
  b.h = c.take(s.rows * s.ffn * elem_bytes(dtype));
  b.gemm_ws_bytes = grouped_gemm_workspace_bytes(s.experts);
  b.gemm_ws = c.take(b.gemm_ws_bytes);
  return b;
}

struct BackwardScratch {
  float* dh_raw;    // [R, F] f32
  void* wh_rows;    // [R, F] round_x(w h), dW_down's operand
  void* d_gate_up;  // [R, 2F]
  void* gemm_ws;
  size_t gemm_ws_bytes;
};

BackwardScratch carve_backward(Carver& c, const ExpertFfnShape& s, DType dtype) {
  const size_t eb = elem_bytes(dtype);
  BackwardScratch b{};
  b.dh_raw = static_cast<float*>(c.take(s.rows * s.ffn * sizeof(float)));
  b.wh_rows = c.take(s.rows * s.ffn * eb);
  b.d_gate_up = c.take(s.rows * 2 * s.ffn * eb);
  b.gemm_ws_bytes = grouped_gemm_workspace_bytes(s.experts);
  b.gemm_ws = c.take(b.gemm_ws_bytes);
  return b;
}

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

// The groups of the EP pieces, from their sizes.
struct SizedGroups {
  int64_t* expert_begin;
  int64_t* tile_begin;
  ExpertGroups view() const { return {expert_begin, tile_begin}; }
};

SizedGroups carve_groups(Carver& c, int64_t experts) {
  SizedGroups g;
  g.expert_begin = static_cast<int64_t*>(c.take((experts + 1) * sizeof(int64_t)));
  g.tile_begin = static_cast<int64_t*>(c.take((experts + 1) * sizeof(int64_t)));
  return g;
}

std::string launch_groups(const SizedGroups& g, const int32_t* sizes, const ExpertFfnShape& s,
                          cudaStream_t stream) {
  group_offsets<<<1, 32, 0, stream>>>(sizes, s.experts, s.rows, g.expert_begin, g.tile_begin);
  MOK_CUDA_RETURN_IF_LAUNCH_FAILED("group_offsets");
  return {};
}

}  // namespace

// --- the expert FFN over grouped rows ---------------------------------------------

size_t expert_ffn_forward_rows_bytes(const ExpertFfnShape& s, Recipe recipe, DType dtype) {
  if (recipe == Recipe::kFp8) return expert_ffn_forward_rows_fp8_bytes(s);
  Carver c(nullptr);
  carve_forward(c, s, dtype);
  return c.used();
}

std::string expert_ffn_forward_rows(const ExpertFfnShape& s, Recipe recipe, DType dtype,
                                    const ExpertGroups& g, const void* x_rows,
                                    const void* w_gate_up, const void* w_down, void* out_rows,
                                    void* gate_up_out, void* scratch, size_t scratch_bytes,
                                    cudaStream_t stream) {
  MOK_RETURN_IF_MESSAGE(check_recipe(recipe, "expert FFN forward"));
  if (recipe == Recipe::kFp8) {
    const std::string why = fp8_supported(s, dtype);
    if (!why.empty()) return "expert FFN forward: " + why;
    return expert_ffn_forward_rows_fp8(s, g, x_rows, w_gate_up, w_down, out_rows, gate_up_out,
                                       scratch, scratch_bytes, stream);
  }
  if (expert_ffn_forward_rows_bytes(s, recipe, dtype) > scratch_bytes) {
    return "expert FFN forward: scratch too small";
  }
  Carver c(scratch);
  const ForwardScratch b = carve_forward(c, s, dtype);
  const int64_t* num_rows = g.expert_begin + s.experts;  // rows in all, on the device

  // SwiGLU in GEMM1's epilogue where it applies; else GEMM1 keeps f32 so that
  // SwiGLU sees the accumulators (the residual is rounded). Same bits either way.
  bool fused = false;
  const SwigluGemm fused_gemm1{s.experts, g.expert_begin, s.rows, s.hidden, s.ffn, dtype,
                               x_rows,    w_gate_up,      b.h,    gate_up_out};
  MOK_RETURN_IF_MESSAGE(
      run_swiglu_gemm(fused_gemm1, b.gate_up_f32, b.gemm_ws, b.gemm_ws_bytes, stream, &fused));
  if (!fused) {
    RowsGemm gemm1{s.experts, g.expert_begin, s.rows, 2 * s.ffn, s.hidden, false, dtype,
                   DType::kF32, x_rows, w_gate_up, b.gate_up_f32};
    MOK_RETURN_IF_MESSAGE(run_rows_gemm(gemm1, g.tile_begin, b.gemm_ws, b.gemm_ws_bytes, stream));
    MOK_RETURN_IF_MESSAGE(swiglu_forward(dtype, b.gate_up_f32, num_rows, s.rows, s.ffn, b.h,
                                         gate_up_out, stream));
  }
  RowsGemm gemm2{s.experts, g.expert_begin, s.rows, s.hidden, s.ffn, false, dtype, dtype,
                 b.h, w_down, out_rows};
  return run_rows_gemm(gemm2, g.tile_begin, b.gemm_ws, b.gemm_ws_bytes, stream);
}

size_t expert_ffn_backward_rows_bytes(const ExpertFfnShape& s, Recipe recipe, DType dtype) {
  if (recipe == Recipe::kFp8) return expert_ffn_backward_rows_fp8_bytes(s);
  Carver c(nullptr);
  carve_backward(c, s, dtype);
  return c.used();
}

std::string expert_ffn_backward_rows(const ExpertFfnShape& s, Recipe recipe, DType dtype,
                                     const ExpertGroups& g, const RowWeights& w,
                                     const void* x_rows, const void* dy_rows,
                                     const void* w_gate_up, const void* w_down,
                                     const void* gate_up, void* dx_rows, void* d_w_gate_up,
                                     void* d_w_down, void* scratch, size_t scratch_bytes,
                                     cudaStream_t stream) {
  MOK_RETURN_IF_MESSAGE(check_recipe(recipe, "expert FFN backward"));
  if (recipe == Recipe::kFp8) {
    const std::string why = fp8_supported(s, dtype);
    if (!why.empty()) return "expert FFN backward: " + why;
    return expert_ffn_backward_rows_fp8(s, g, w, x_rows, dy_rows, w_gate_up, w_down, gate_up,
                                        dx_rows, d_w_gate_up, d_w_down, scratch, scratch_bytes,
                                        stream);
  }
  if (expert_ffn_backward_rows_bytes(s, recipe, dtype) > scratch_bytes) {
    return "expert FFN backward: scratch too small";
  }
  Carver c(scratch);
  const BackwardScratch b = carve_backward(c, s, dtype);
  const int64_t* num_rows = g.expert_begin + s.experts;

  // dh_raw = dy @ Wd^T (f32), then SwiGLU backward and the combine weights' gradients
  // (the weight goes into SwiGLU's backward and into dW_down's h operand, so the dy
  // rows stay unweighted).
  RowsGemm dgrad2{s.experts, g.expert_begin, s.rows, s.ffn, s.hidden, true, dtype, DType::kF32,
                  dy_rows, w_down, b.dh_raw};
  MOK_RETURN_IF_MESSAGE(run_rows_gemm(dgrad2, g.tile_begin, b.gemm_ws, b.gemm_ws_bytes, stream));
  MOK_RETURN_IF_MESSAGE(swiglu_backward(dtype, w.weight_dtype, gate_up, b.dh_raw, w.weights,
                                        w.row_pair, w.pair_row, num_rows, s.rows, w.pairs, s.ffn,
                                        b.wh_rows, b.d_gate_up, w.d_weights, stream));
  // Weight gradients over each expert's rows in their order, both in one launch;
  // dW_down reads the dy rows, so they run before dgrad1 may overwrite them.
  WeightGradGemm wgrad_gate_up{s.experts, g.expert_begin, s.rows, s.hidden, 2 * s.ffn, dtype,
                               x_rows, b.d_gate_up, d_w_gate_up};
  WeightGradGemm wgrad_down{s.experts, g.expert_begin, s.rows, s.ffn, s.hidden, dtype,
                            b.wh_rows, dy_rows, d_w_down};
  MOK_RETURN_IF_MESSAGE(
      run_weight_grad_gemms(wgrad_gate_up, wgrad_down, b.gemm_ws, b.gemm_ws_bytes, stream));
  // dx rows = d gate_up @ Wgu^T.
  RowsGemm dgrad1{s.experts, g.expert_begin, s.rows, s.hidden, 2 * s.ffn, true, dtype, dtype,
                  b.d_gate_up, w_gate_up, dx_rows};
  return run_rows_gemm(dgrad1, g.tile_begin, b.gemm_ws, b.gemm_ws_bytes, stream);
}

// --- the EP pieces: groups from sizes, each row its own pair -------------------

size_t expert_ffn_forward_workspace_bytes(const ExpertFfnShape& s, Recipe recipe, DType dtype) {
  Carver c(nullptr);
  carve_groups(c, s.experts);
  c.take(expert_ffn_forward_rows_bytes(s, recipe, dtype));
  return c.used();
}

std::string expert_ffn_forward(const ExpertFfnShape& s, Recipe recipe, DType dtype,
                               const void* x_rows, const int32_t* group_sizes,
                               const void* w_gate_up, const void* w_down, void* out_rows,
                               void* gate_up_out, void* workspace, size_t workspace_bytes,
                               cudaStream_t stream) {
  if (expert_ffn_forward_workspace_bytes(s, recipe, dtype) > workspace_bytes) {
    return "expert FFN forward: workspace too small";
  }
  Carver c(workspace);
  const SizedGroups g = carve_groups(c, s.experts);
  const size_t bytes = expert_ffn_forward_rows_bytes(s, recipe, dtype);
  void* scratch = c.take(bytes);
  MOK_RETURN_IF_MESSAGE(launch_groups(g, group_sizes, s, stream));
  return expert_ffn_forward_rows(s, recipe, dtype, g.view(), x_rows, w_gate_up, w_down,
                                 out_rows, gate_up_out, scratch, bytes, stream);
}

size_t expert_ffn_backward_workspace_bytes(const ExpertFfnShape& s, Recipe recipe, DType dtype) {
  Carver c(nullptr);
  carve_groups(c, s.experts);
  c.take(s.rows * sizeof(int32_t));  // identity row <-> pair map
  c.take(expert_ffn_backward_rows_bytes(s, recipe, dtype));
  return c.used();
}

std::string expert_ffn_backward(const ExpertFfnShape& s, Recipe recipe, DType dtype,
                                DType weight_dtype, const void* x_rows, const void* dy_rows,
                                const void* w_rows, const int32_t* group_sizes,
                                const void* w_gate_up, const void* w_down, const void* gate_up,
                                void* dx_rows, void* dw_rows, void* d_w_gate_up, void* d_w_down,
                                void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (expert_ffn_backward_workspace_bytes(s, recipe, dtype) > workspace_bytes) {
    return "expert FFN backward: workspace too small";
  }
  Carver c(workspace);
  const SizedGroups g = carve_groups(c, s.experts);
  auto* identity = static_cast<int32_t*>(c.take(s.rows * sizeof(int32_t)));
  const size_t bytes = expert_ffn_backward_rows_bytes(s, recipe, dtype);
  void* scratch = c.take(bytes);
  MOK_RETURN_IF_MESSAGE(launch_groups(g, group_sizes, s, stream));
  if (s.rows > 0) {
    iota<<<blocks_for(s.rows), kThreads, 0, stream>>>(identity, s.rows);
    MOK_CUDA_RETURN_IF_LAUNCH_FAILED("iota");
  }
  // Rows are their own pairs here (the identity map): w_rows and dw_rows are by row.
  const RowWeights w{weight_dtype, w_rows, dw_rows, identity, identity, s.rows};
  return expert_ffn_backward_rows(s, recipe, dtype, g.view(), w, x_rows, dy_rows, w_gate_up,
                                  w_down, gate_up, dx_rows, d_w_gate_up, d_w_down, scratch,
                                  bytes, stream);
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
