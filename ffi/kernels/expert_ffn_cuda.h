// The expert FFN on CUDA: the one implementation of the SwiGLU experts over rows
// grouped by expert, forward and backward. The one-device layer (moe_cuda.cu:
// routing plan, gather, this, combine) and the EP pieces (mok_jax/_src/ep.py: rows
// already grouped by a transport) both run it, so one device and EP execute the
// same expert code. Same operands and numerics as ffi/cpu/moe_cpu.h.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "mok/types.h"

namespace mok::cuda {

struct ExpertFfnShape {
  int64_t rows;     // R: rows the buffers hold
  int64_t experts;  // E_local
  int64_t hidden;   // H
  int64_t ffn;      // F
};

// Where each expert's rows are: rows [expert_begin[e], expert_begin[e + 1]) belong
// to expert e, expert_begin[E] rows in all (device arrays of E + 1 entries);
// tile_begin numbers the SIMT GEMM's M-tiles the same way.
struct ExpertGroups {
  const int64_t* expert_begin;
  const int64_t* tile_begin;
};

// The combine weight of each row, for the backward: row r is pair row_pair[r];
// weights and d_weights are by pair ([pairs], weight_dtype); pair_row[p] is the
// row of pair p, or -1 (its d_weights is 0).
struct RowWeights {
  DType weight_dtype;
  const void* weights;
  void* d_weights;
  const int32_t* row_pair;
  const int32_t* pair_row;
  int64_t pairs;
};

// Forward over grouped rows: out_rows = FFN(x_rows), and the rounded gate/up
// projection (gate_up_out, [R, 2F]) when not null.
size_t expert_ffn_forward_rows_bytes(const ExpertFfnShape& s, Recipe recipe, DType dtype);
std::string expert_ffn_forward_rows(const ExpertFfnShape& s, Recipe recipe, DType dtype,
                                    const ExpertGroups& g, const void* x_rows,
                                    const void* w_gate_up, const void* w_down, void* out_rows,
                                    void* gate_up_out, void* scratch, size_t scratch_bytes,
                                    cudaStream_t stream);

// Backward over grouped rows: dx_rows (may be dy_rows itself: the weight
// gradients read dy_rows before dx_rows is written), the combine weights'
// gradients through `w`, d_w_gate_up and d_w_down (over each expert's rows in
// their order).
size_t expert_ffn_backward_rows_bytes(const ExpertFfnShape& s, Recipe recipe, DType dtype);
std::string expert_ffn_backward_rows(const ExpertFfnShape& s, Recipe recipe, DType dtype,
                                     const ExpertGroups& g, const RowWeights& w,
                                     const void* x_rows, const void* dy_rows,
                                     const void* w_gate_up, const void* w_down,
                                     const void* gate_up, void* dx_rows, void* d_w_gate_up,
                                     void* d_w_down, void* scratch, size_t scratch_bytes,
                                     cudaStream_t stream);

// The EP pieces' entry points: the groups come as sizes ([E_local] int32, read on
// the device; negative sizes count as 0 and rows past R are clamped, so no
// kernel reads or writes out of bounds) and each row is its own pair.
size_t expert_ffn_forward_workspace_bytes(const ExpertFfnShape& s, Recipe recipe, DType dtype);
std::string expert_ffn_forward(const ExpertFfnShape& s, Recipe recipe, DType dtype,
                               const void* x_rows, const int32_t* group_sizes,
                               const void* w_gate_up, const void* w_down, void* out_rows,
                               void* gate_up_out, void* workspace, size_t workspace_bytes,
                               cudaStream_t stream);

size_t expert_ffn_backward_workspace_bytes(const ExpertFfnShape& s, Recipe recipe, DType dtype);
std::string expert_ffn_backward(const ExpertFfnShape& s, Recipe recipe, DType dtype,
                                DType weight_dtype, const void* x_rows, const void* dy_rows,
                                const void* w_rows, const int32_t* group_sizes,
                                const void* w_gate_up, const void* w_down, const void* gate_up,
                                void* dx_rows, void* dw_rows, void* d_w_gate_up, void* d_w_down,
                                void* workspace, size_t workspace_bytes, cudaStream_t stream);

// out[t] = round_x(sum over kept k ascending of w[t,k] * rows[t*K+k]); w = 1 if null.
size_t combine_workspace_bytes(int64_t pairs);
std::string combine_kept_rows(DType dtype, DType weight_dtype, const void* rows,
                              const void* weights, const int32_t* kept, int64_t tokens,
                              int64_t top_k, int64_t hidden, void* out, void* workspace,
                              size_t workspace_bytes, cudaStream_t stream);

}  // namespace mok::cuda
