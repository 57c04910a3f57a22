// CUDA implementation of the MoE layer (one device): host launchers that
// enqueue the routing plan, gathers, grouped GEMMs, SwiGLU and ordered
// combines on a stream. Same operands and numerics as ffi/cpu/moe_cpu.h.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "mok/types.h"

namespace mok::cuda {

struct MoeForwardArgs {
  MoeShape shape;
  DType x_dtype;
  DType weight_dtype;
  int64_t capacity;              // kNoCapacity keeps all
  const void* x;                 // [T, H]
  const int32_t* expert_ids;     // [T, K]
  const void* expert_weights;    // [T, K]
  const void* w_gate_up;         // [E, H, 2F]
  const void* w_down;            // [E, F, H]
  void* y;                       // [T, H]
  void* gate_up_out;             // [T * K, 2F] by plan row, or nullptr (not saved)
  int32_t* tokens_per_expert;    // [E]
  int32_t* dropped;              // []
  int32_t* invalid;              // []
};

struct MoeBackwardArgs {
  MoeShape shape;
  DType x_dtype;
  DType weight_dtype;
  int64_t capacity;
  const void* x;
  const int32_t* expert_ids;
  const void* expert_weights;
  const void* w_gate_up;
  const void* w_down;
  const void* gate_up;           // [T * K, 2F] by plan row, from the forward
  const void* dy;                // [T, H]
  void* dx;
  void* d_expert_weights;
  void* d_w_gate_up;
  void* d_w_down;
};

// Device scratch each pass needs, for the current device.
size_t moe_forward_workspace_bytes(const MoeShape& shape, DType x_dtype, bool save_gate_up);
size_t moe_backward_workspace_bytes(const MoeShape& shape, DType x_dtype);

// Enqueue on `stream`; return an empty string on success, else what failed.
std::string moe_forward(const MoeForwardArgs& args, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream);
std::string moe_backward(const MoeBackwardArgs& args, void* workspace, size_t workspace_bytes,
                         cudaStream_t stream);

}  // namespace mok::cuda
