// Operands of one MoE layer call (forward and backward), shared by the CPU
// and CUDA launchers: raw pointers and sizes only, filled by the FFI handlers.
#pragma once

#include <cstdint>

#include "mok/types.h"

namespace mok {

struct MoeForwardArgs {
  MoeShape shape;
  DType x_dtype;        // of x, w_gate_up, w_down, y, gate_up_out
  DType weight_dtype;   // of expert_weights
  Recipe recipe;        // how the expert GEMMs compute
  int64_t capacity;     // rows kept per expert, kNoCapacity for all
  const void* x;                 // [T, H]
  const int32_t* expert_ids;     // [T, K]
  const void* expert_weights;    // [T, K]
  const void* w_gate_up;         // [E, H, 2F]
  const void* w_down;            // [E, F, H]
  void* y;                       // [T, H]
  void* gate_up_out;             // [T * K, 2F] by plan row, for the backward, or nullptr
  int32_t* tokens_per_expert;    // [E]
  int32_t* dropped;              // []
  int32_t* invalid;              // []
  // EP ranks served by one launch on this device (virtual ranks: x and y split in
  // `ranks` windows of T/ranks tokens, the experts in `ranks` groups); > 1 runs the
  // persistent forward only (moe_persistent.h).
  int ranks = 1;
};

struct MoeBackwardArgs {
  MoeShape shape;
  DType x_dtype;
  DType weight_dtype;
  Recipe recipe;
  int64_t capacity;
  const void* x;                 // [T, H]
  const int32_t* expert_ids;     // [T, K]
  const void* expert_weights;    // [T, K]
  const void* w_gate_up;         // [E, H, 2F]
  const void* w_down;            // [E, F, H]
  const void* gate_up;           // [T * K, 2F] by plan row, from the forward
  const void* dy;                // [T, H]
  void* dx;                      // [T, H]
  void* d_expert_weights;        // [T, K]
  void* d_w_gate_up;             // [E, H, 2F]
  void* d_w_down;                // [E, F, H]
  // EP ranks served by one launch on this device (virtual ranks: dy, dx and the
  // weights' rows split in `ranks` windows, the experts in `ranks` groups); > 1 runs
  // the persistent backward only (moe_persistent.h).
  int ranks = 1;
};

}  // namespace mok
