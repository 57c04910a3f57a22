// CPU implementation of the MoE layer (forward and backward) with the contract's
// numerics (docs/contract.md). Launchers take raw pointers and sizes only.
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

#include "mok/moe_args.h"
#include "mok/types.h"

namespace mok::cpu {

using mok::MoeBackwardArgs;
using mok::MoeForwardArgs;

// Both return an empty string on success, else a message (allocation failure).
// x_rows_out: [T * K, H] in x.dtype or nullptr; when given, the forward writes the
// x row of each kept pair by plan row (x[row_pair[r] / K] at row r) and zeroes the
// rows past the kept ones. x_rows: the forward's x_rows for the backward, or
// nullptr to gather them from x (the same values, so the same results).
std::string moe_forward(const MoeForwardArgs& args, void* x_rows_out);
std::string moe_backward(const MoeBackwardArgs& args, const void* x_rows);

}  // namespace mok::cpu

namespace mok::cpu {

// The pieces of the layer that expert parallelism composes with collectives
// (mok_jax/_src/ep.py). The single-device launchers above use the same code, so the
// results are bitwise equal whatever the EP size.

// Expert side, forward: rows already gathered and grouped by local expert
// (group e is rows [sum(group_sizes[:e]), +group_sizes[e])), in canonical order.
struct ExpertFfnForwardArgs {
  int64_t rows;                  // R: rows the buffers hold (>= sum(group_sizes))
  int64_t experts;               // E_local
  int64_t hidden;
  int64_t ffn;
  DType x_dtype;
  Recipe recipe;
  const void* x_rows;            // [R, H]
  const int32_t* group_sizes;    // [E_local]
  const void* w_gate_up;         // [E_local, H, 2F]
  const void* w_down;            // [E_local, F, H]
  void* out_rows;                // [R, H]: round_x(FFN_e(x_r))
  void* gate_up_out;             // [R, 2F] or nullptr
};

// Expert side, backward, for rows combined with weights w_rows.
struct ExpertFfnBackwardArgs {
  int64_t rows;
  int64_t experts;
  int64_t hidden;
  int64_t ffn;
  DType x_dtype;
  DType weight_dtype;
  Recipe recipe;
  const void* x_rows;            // [R, H]
  const void* dy_rows;           // [R, H] cotangent of the token each row came from
  const void* w_rows;            // [R] combine weight of each row
  const int32_t* group_sizes;    // [E_local]
  const void* w_gate_up;
  const void* w_down;
  const void* gate_up;           // [R, 2F] from the forward
  void* dx_rows;                 // [R, H]
  void* dw_rows;                 // [R] d combine weight
  void* d_w_gate_up;             // [E_local, H, 2F]
  void* d_w_down;                // [E_local, F, H]
};

// Token side: out[t] = round_x(sum over kept k ascending of w[t,k] * rows[t*K+k]).
struct CombineArgs {
  int64_t tokens;
  int64_t top_k;
  int64_t hidden;
  DType x_dtype;
  DType weight_dtype;
  const void* rows;              // [T * K, H] by pair
  const void* weights;           // [T, K], or nullptr for weight 1
  const int32_t* kept;           // [T, K] nonzero where the pair has a row
  void* out;                     // [T, H]
};

std::string expert_ffn_forward(const ExpertFfnForwardArgs& args);
std::string expert_ffn_backward(const ExpertFfnBackwardArgs& args);
std::string combine_rows(const CombineArgs& args);

}  // namespace mok::cpu
