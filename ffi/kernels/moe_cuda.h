// CUDA implementation of the MoE layer (one device): host launchers that
// enqueue the routing plan, gathers, grouped GEMMs, SwiGLU and ordered
// combines on a stream. Same operands and numerics as ffi/cpu/moe_cpu.h.
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

// Device scratch each pass needs, for the current device.
size_t moe_forward_workspace_bytes(const MoeShape& shape, DType x_dtype, bool save_gate_up);
size_t moe_backward_workspace_bytes(const MoeShape& shape, DType x_dtype);

// Enqueue on `stream`; return an empty string on success, else what failed.
std::string moe_forward(const MoeForwardArgs& args, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream);
std::string moe_backward(const MoeBackwardArgs& args, void* workspace, size_t workspace_bytes,
                         cudaStream_t stream);

}  // namespace mok::cuda
