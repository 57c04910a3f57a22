// CUDA implementation of the MoE layer (one device): host launchers that
// enqueue the routing plan, the gather of x (dy) rows, the expert FFN of
// expert_ffn_cuda.h (the code the EP pieces run too) and the ordered combine on
// a stream. Same operands and numerics as ffi/cpu/moe_cpu.h.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "mok/moe_args.h"
#include "mok/types.h"

namespace mok::cuda {

using mok::MoeBackwardArgs;
using mok::MoeForwardArgs;

// Device scratch each pass needs, for the current device. save_gate_up: the
// forward is given x_rows_out (and gate_up_out) and gathers x into it, not into
// its workspace; it must be true exactly when moe_forward gets an x_rows_out.
size_t moe_forward_workspace_bytes(const MoeShape& shape, Recipe recipe, DType x_dtype,
                                   bool save_gate_up, int ranks = 1);
size_t moe_backward_workspace_bytes(const MoeShape& shape, Recipe recipe, DType x_dtype,
                                    int ranks = 1);

// Enqueue on `stream`; return an empty string on success, else what failed.
// x_rows_out: [T * K, H] in x.dtype, or nullptr: the forward's gathered x rows by
// plan row, for the backward (rows past the kept ones are left as they are).
// x_rows: those rows, from the forward; the backward does not gather x again.
std::string moe_forward(const MoeForwardArgs& args, void* x_rows_out, void* workspace,
                        size_t workspace_bytes, cudaStream_t stream);
std::string moe_backward(const MoeBackwardArgs& args, const void* x_rows, void* workspace,
                         size_t workspace_bytes, cudaStream_t stream);

}  // namespace mok::cuda
