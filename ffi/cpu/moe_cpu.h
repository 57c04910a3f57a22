// CPU implementation of the MoE layer (forward and backward) with the contract's
// numerics (DESIGN.md §1). Launchers take raw pointers and sizes only.
//
// Forward, per kept pair (t, k) routed to expert e:
//   gu = x[t] @ Wgu[e]                 (f32 accumulate)
//   h  = round_x(silu(g) * u)          (f32, rounded to x.dtype)
//   o  = round_x(h @ Wd[e])
//   y[t] = round_x(sum_k ascending w[t,k] * o)   (f32 sum)
// Backward recomputes h from the saved gu (rounded to x.dtype) and uses
// <dy, o> = <dy @ Wd^T, h>, so o need not be saved.
#pragma once

#include <cstdint>
#include <string>

#include "mok/types.h"

namespace mok::cpu {

struct MoeForwardArgs {
  MoeShape shape;
  DType x_dtype;        // of x, w_gate_up, w_down, y, gate_up_out
  DType weight_dtype;   // of expert_weights
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
};

struct MoeBackwardArgs {
  MoeShape shape;
  DType x_dtype;
  DType weight_dtype;
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
};

// Both return an empty string on success, else a message (allocation failure).
std::string moe_forward(const MoeForwardArgs& args);
std::string moe_backward(const MoeBackwardArgs& args);

}  // namespace mok::cpu
