// CUDA versions of the pieces expert parallelism composes with collectives
// (mok_jax/ep.py): the expert FFN over rows grouped by expert, its backward,
// and the ordered combine. Same operands and numerics as ffi/cpu/moe_cpu.h.
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

// Group sizes are read on the device; negative sizes count as 0 and rows past R
// are clamped, so no kernel reads or writes out of bounds (ep.py always passes
// valid sizes; the CPU handler reports invalid ones as an error).
size_t expert_ffn_forward_workspace_bytes(const ExpertFfnShape& s, DType dtype, bool save);
std::string expert_ffn_forward(const ExpertFfnShape& s, DType dtype, const void* x_rows,
                               const int32_t* group_sizes, const void* w_gate_up,
                               const void* w_down, void* out_rows, void* gate_up_out,
                               void* workspace, size_t workspace_bytes, cudaStream_t stream);

size_t expert_ffn_backward_workspace_bytes(const ExpertFfnShape& s, DType dtype);
std::string expert_ffn_backward(const ExpertFfnShape& s, DType dtype, DType weight_dtype,
                                const void* x_rows, const void* dy_rows, const void* w_rows,
                                const int32_t* group_sizes, const void* w_gate_up,
                                const void* w_down, const void* gate_up, void* dx_rows,
                                void* dw_rows, void* d_w_gate_up, void* d_w_down,
                                void* workspace, size_t workspace_bytes, cudaStream_t stream);

// out[t] = round_x(sum over kept k ascending of w[t,k] * rows[t*K+k]); w = 1 if null.
size_t combine_workspace_bytes(int64_t pairs);
std::string combine_kept_rows(DType dtype, DType weight_dtype, const void* rows,
                              const void* weights, const int32_t* kept, int64_t tokens,
                              int64_t top_k, int64_t hidden, void* out, void* workspace,
                              size_t workspace_bytes, cudaStream_t stream);

}  // namespace mok::cuda
