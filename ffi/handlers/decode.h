// Decoding of the MoE operands shared by the CPU and CUDA handlers.
#pragma once

#include <cstdint>
#include <string>

#include "checks.h"
#include "mok/moe_args.h"
#include "mok/types.h"

namespace mok::ffi_checks {

// Derives the problem shape from x, expert_ids and the weights and checks every
// operand of the forward against it.
struct Decoded {
  MoeShape shape;
  DType x_dtype;
  DType weight_dtype;
};

inline ffi::Error decode(const char* op, const ffi::AnyBuffer& x, const ffi::Buffer<ffi::S32>& ids,
                  const ffi::AnyBuffer& weights, const ffi::AnyBuffer& w_gate_up,
                  const ffi::AnyBuffer& w_down, Decoded* out) {
  if (x.dimensions().size() != 2 || ids.dimensions().size() != 2 ||
      w_gate_up.dimensions().size() != 3) {
    return ffi::Error::InvalidArgument(
        std::string(op) + ": x must be rank 2, expert_ids rank 2 and w_gate_up rank 3; got " +
        ffi_checks::dims_str(x.dimensions()) + ", " + ffi_checks::dims_str(ids.dimensions()) +
        ", " + ffi_checks::dims_str(w_gate_up.dimensions()));
  }
  const int64_t T = x.dimensions()[0], H = x.dimensions()[1];
  const int64_t K = ids.dimensions()[1];
  const int64_t E = w_gate_up.dimensions()[0];
  const int64_t two_f = w_gate_up.dimensions()[2];
  if (two_f % 2 != 0) {
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": w_gate_up's last dimension must be even (2F), got " +
                                       ffi_checks::dims_str(w_gate_up.dimensions()));
  }
  const int64_t F = two_f / 2;
  auto x_dtype = to_mok_dtype(x.element_type());
  auto weight_dtype = to_mok_dtype(weights.element_type());
  if (!x_dtype || !weight_dtype || (*x_dtype == DType::kF32 && *weight_dtype != DType::kF32)) {
    return ffi::Error::InvalidArgument(
        std::string(op) + ": x must be float32 or bfloat16 and expert_weights float32 or x.dtype");
  }
  MOK_RETURN_IF_ERROR(expect_shape(op, "expert_ids", ids, {T, K}));
  MOK_RETURN_IF_ERROR(expect_shape(op, "expert_weights", weights, {T, K}));
  MOK_RETURN_IF_ERROR(expect_shape(op, "w_gate_up", w_gate_up, {E, H, 2 * F}));
  MOK_RETURN_IF_ERROR(expect_shape(op, "w_down", w_down, {E, F, H}));
  MOK_RETURN_IF_ERROR(expect_dtype(op, "w_gate_up", w_gate_up, *x_dtype));
  MOK_RETURN_IF_ERROR(expect_dtype(op, "w_down", w_down, *x_dtype));
  // The statistics (and the kernels' pair and row indices) are int32.
  if (T * K > INT32_MAX) {
    return ffi::Error::InvalidArgument(std::string(op) + ": T * K = " + std::to_string(T * K) +
                                       " pairs must be below 2^31");
  }
  *out = Decoded{MoeShape{T, K, E, H, F}, *x_dtype, *weight_dtype};
  return ffi::Error::Success();
}

// The recipe attribute as a mok::Recipe; an error for a value no recipe has.
inline ffi::Error decode_recipe(const char* op, int32_t value, Recipe* out) {
  if (to_recipe(value, out)) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(op) + ": unknown recipe " +
                                     std::to_string(value));
}

// The forward's results must match the decoded problem.
inline ffi::Error check_forward_results(const char* op, const Decoded& d, const ffi::AnyBuffer& y,
                                        const ffi::AnyBuffer& gate_up,
                                        const ffi::AnyBuffer& x_rows,
                                        const ffi::Buffer<ffi::S32>& tokens_per_expert,
                                        const ffi::Buffer<ffi::S32>& dropped,
                                        const ffi::Buffer<ffi::S32>& invalid,
                                        bool save_gate_up) {
  const auto [T, K, E, H, F] = d.shape;
  MOK_RETURN_IF_ERROR(expect_shape(op, "y", y, {T, H}));
  MOK_RETURN_IF_ERROR(expect_dtype(op, "y", y, d.x_dtype));
  MOK_RETURN_IF_ERROR(expect_shape(op, "gate_up", gate_up, {save_gate_up ? T * K : 0, 2 * F}));
  MOK_RETURN_IF_ERROR(expect_dtype(op, "gate_up", gate_up, d.x_dtype));
  MOK_RETURN_IF_ERROR(expect_shape(op, "x_rows", x_rows, {save_gate_up ? T * K : 0, H}));
  MOK_RETURN_IF_ERROR(expect_dtype(op, "x_rows", x_rows, d.x_dtype));
  MOK_RETURN_IF_ERROR(expect_shape(op, "tokens_per_expert", tokens_per_expert, {E}));
  // Scalars: the launchers store one int32 into each.
  MOK_RETURN_IF_ERROR(expect_shape(op, "dropped", dropped, {}));
  MOK_RETURN_IF_ERROR(expect_shape(op, "invalid", invalid, {}));
  return ffi::Error::Success();
}

// The backward's extra operands and its results must match the decoded problem.
inline ffi::Error check_backward_operands(const char* op, const Decoded& d,
                                          const ffi::AnyBuffer& gate_up,
                                          const ffi::AnyBuffer& x_rows, const ffi::AnyBuffer& dy,
                                          const ffi::AnyBuffer& dx,
                                          const ffi::AnyBuffer& d_expert_weights,
                                          const ffi::AnyBuffer& d_w_gate_up,
                                          const ffi::AnyBuffer& d_w_down) {
  const auto [T, K, E, H, F] = d.shape;
  MOK_RETURN_IF_ERROR(expect_shape(op, "gate_up", gate_up, {T * K, 2 * F}));
  MOK_RETURN_IF_ERROR(expect_dtype(op, "gate_up", gate_up, d.x_dtype));
  MOK_RETURN_IF_ERROR(expect_shape(op, "x_rows", x_rows, {T * K, H}));
  MOK_RETURN_IF_ERROR(expect_dtype(op, "x_rows", x_rows, d.x_dtype));
  MOK_RETURN_IF_ERROR(expect_shape(op, "dy", dy, {T, H}));
  MOK_RETURN_IF_ERROR(expect_dtype(op, "dy", dy, d.x_dtype));
  MOK_RETURN_IF_ERROR(expect_shape(op, "dx", dx, {T, H}));
  MOK_RETURN_IF_ERROR(expect_dtype(op, "dx", dx, d.x_dtype));
  MOK_RETURN_IF_ERROR(expect_shape(op, "d_expert_weights", d_expert_weights, {T, K}));
  MOK_RETURN_IF_ERROR(expect_dtype(op, "d_expert_weights", d_expert_weights, d.weight_dtype));
  MOK_RETURN_IF_ERROR(expect_shape(op, "d_w_gate_up", d_w_gate_up, {E, H, 2 * F}));
  MOK_RETURN_IF_ERROR(expect_dtype(op, "d_w_gate_up", d_w_gate_up, d.x_dtype));
  MOK_RETURN_IF_ERROR(expect_shape(op, "d_w_down", d_w_down, {E, F, H}));
  MOK_RETURN_IF_ERROR(expect_dtype(op, "d_w_down", d_w_down, d.x_dtype));
  return ffi::Error::Success();
}

// Checks the expert-side operands: rows [R, H], group_sizes [E], weights.
inline ffi::Error decode_expert_side(const char* op, const ffi::AnyBuffer& x_rows,
                              const ffi::Buffer<ffi::S32>& group_sizes,
                              const ffi::AnyBuffer& w_gate_up, const ffi::AnyBuffer& w_down,
                              MoeShape* shape, DType* x_dtype) {
  if (x_rows.dimensions().size() != 2 || w_gate_up.dimensions().size() != 3) {
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": x_rows must be rank 2 and w_gate_up rank 3");
  }
  const int64_t R = x_rows.dimensions()[0], H = x_rows.dimensions()[1];
  const int64_t E = w_gate_up.dimensions()[0], two_f = w_gate_up.dimensions()[2];
  if (two_f % 2 != 0) {
    return ffi::Error::InvalidArgument(std::string(op) + ": w_gate_up's last dimension is odd");
  }
  auto dt = to_mok_dtype(x_rows.element_type());
  if (!dt) return ffi::Error::InvalidArgument(std::string(op) + ": x_rows must be f32 or bf16");
  MOK_RETURN_IF_ERROR(expect_shape(op, "group_sizes", group_sizes, {E}));
  MOK_RETURN_IF_ERROR(expect_shape(op, "w_gate_up", w_gate_up, {E, H, two_f}));
  MOK_RETURN_IF_ERROR(expect_shape(op, "w_down", w_down, {E, two_f / 2, H}));
  MOK_RETURN_IF_ERROR(expect_dtype(op, "w_gate_up", w_gate_up, *dt));
  MOK_RETURN_IF_ERROR(expect_dtype(op, "w_down", w_down, *dt));
  *shape = MoeShape{R, 1, E, H, two_f / 2};
  *x_dtype = *dt;
  return ffi::Error::Success();
}

// The expert-side forward's results: out_rows [R, H] and gate_up [R or 0, 2F], both in
// the rows' dtype.
inline ffi::Error check_expert_forward(const char* op, const MoeShape& s, DType dt,
                                       const ffi::AnyBuffer& out_rows,
                                       const ffi::AnyBuffer& gate_up, bool save_gate_up) {
  MOK_RETURN_IF_ERROR(expect_shape(op, "out_rows", out_rows, {s.tokens, s.hidden}));
  MOK_RETURN_IF_ERROR(expect_dtype(op, "out_rows", out_rows, dt));
  MOK_RETURN_IF_ERROR(expect_shape(op, "gate_up", gate_up,
                                   {save_gate_up ? s.tokens : 0, 2 * s.ffn}));
  MOK_RETURN_IF_ERROR(expect_dtype(op, "gate_up", gate_up, dt));
  return ffi::Error::Success();
}

// The expert-side backward's other operands and results; sets the weight dtype.
inline ffi::Error check_expert_backward(const char* op, const MoeShape& s, DType dt,
                                        const ffi::AnyBuffer& dy_rows,
                                        const ffi::AnyBuffer& w_rows,
                                        const ffi::AnyBuffer& gate_up,
                                        const ffi::AnyBuffer& dx_rows,
                                        const ffi::AnyBuffer& dw_rows,
                                        const ffi::AnyBuffer& d_w_gate_up,
                                        const ffi::AnyBuffer& d_w_down, DType* weight_dtype) {
  auto wdt = to_mok_dtype(w_rows.element_type());
  if (!wdt || (dt == DType::kF32 && *wdt != DType::kF32)) {
    return ffi::Error::InvalidArgument(std::string(op) + ": w_rows must be f32 or x.dtype");
  }
  const int64_t R = s.tokens, H = s.hidden, F = s.ffn, E = s.experts;
  MOK_RETURN_IF_ERROR(expect_shape(op, "dy_rows", dy_rows, {R, H}));
  MOK_RETURN_IF_ERROR(expect_dtype(op, "dy_rows", dy_rows, dt));
  MOK_RETURN_IF_ERROR(expect_shape(op, "w_rows", w_rows, {R}));
  MOK_RETURN_IF_ERROR(expect_shape(op, "gate_up", gate_up, {R, 2 * F}));
  MOK_RETURN_IF_ERROR(expect_dtype(op, "gate_up", gate_up, dt));
  MOK_RETURN_IF_ERROR(expect_shape(op, "dx_rows", dx_rows, {R, H}));
  MOK_RETURN_IF_ERROR(expect_dtype(op, "dx_rows", dx_rows, dt));
  MOK_RETURN_IF_ERROR(expect_shape(op, "dw_rows", dw_rows, {R}));
  MOK_RETURN_IF_ERROR(expect_dtype(op, "dw_rows", dw_rows, *wdt));
  MOK_RETURN_IF_ERROR(expect_shape(op, "d_w_gate_up", d_w_gate_up, {E, H, 2 * F}));
  MOK_RETURN_IF_ERROR(expect_dtype(op, "d_w_gate_up", d_w_gate_up, dt));
  MOK_RETURN_IF_ERROR(expect_shape(op, "d_w_down", d_w_down, {E, F, H}));
  MOK_RETURN_IF_ERROR(expect_dtype(op, "d_w_down", d_w_down, dt));
  *weight_dtype = *wdt;
  return ffi::Error::Success();
}

struct CombineShape {
  int64_t tokens, top_k, hidden;
  DType x_dtype, weight_dtype;
};

// rows [T*K, H], weights [T, K] (when weighted), kept [T, K], out [T, H].
inline ffi::Error decode_combine(const char* op, const ffi::AnyBuffer& rows,
                                 const ffi::AnyBuffer& weights,
                                 const ffi::Buffer<ffi::S32>& kept, bool weighted,
                                 const ffi::AnyBuffer& out, CombineShape* c) {
  if (kept.dimensions().size() != 2 || rows.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument(std::string(op) + ": kept must be [T, K], rows [T*K, H]");
  }
  const int64_t T = kept.dimensions()[0], K = kept.dimensions()[1], H = rows.dimensions()[1];
  auto dt = to_mok_dtype(rows.element_type());
  auto wdt = to_mok_dtype(weights.element_type());
  if (!dt || !wdt || (*dt == DType::kF32 && *wdt != DType::kF32)) {
    return ffi::Error::InvalidArgument(std::string(op) + ": unsupported dtypes");
  }
  MOK_RETURN_IF_ERROR(expect_shape(op, "rows", rows, {T * K, H}));
  if (weighted) MOK_RETURN_IF_ERROR(expect_shape(op, "weights", weights, {T, K}));
  MOK_RETURN_IF_ERROR(expect_shape(op, "out", out, {T, H}));
  MOK_RETURN_IF_ERROR(expect_dtype(op, "out", out, *dt));
  *c = CombineShape{T, K, H, *dt, *wdt};
  return ffi::Error::Success();
}

// Launcher arguments of the forward from its decoded, checked buffers.
inline MoeForwardArgs forward_args(const Decoded& d, const ffi::AnyBuffer& x,
                                   const ffi::Buffer<ffi::S32>& expert_ids,
                                   const ffi::AnyBuffer& expert_weights,
                                   const ffi::AnyBuffer& w_gate_up, const ffi::AnyBuffer& w_down,
                                   Recipe recipe, int64_t capacity, bool save_gate_up,
                                   ffi::AnyBuffer& y,
                                   ffi::AnyBuffer& gate_up,
                                   ffi::Buffer<ffi::S32>& tokens_per_expert,
                                   ffi::Buffer<ffi::S32>& dropped,
                                   ffi::Buffer<ffi::S32>& invalid) {
  MoeForwardArgs a{};
  a.shape = d.shape;
  a.x_dtype = d.x_dtype;
  a.weight_dtype = d.weight_dtype;
  a.recipe = recipe;
  a.capacity = capacity < 0 ? kNoCapacity : capacity;
  a.x = x.untyped_data();
  a.expert_ids = expert_ids.typed_data();
  a.expert_weights = expert_weights.untyped_data();
  a.w_gate_up = w_gate_up.untyped_data();
  a.w_down = w_down.untyped_data();
  a.y = y.untyped_data();
  a.gate_up_out = save_gate_up ? gate_up.untyped_data() : nullptr;
  a.tokens_per_expert = tokens_per_expert.typed_data();
  a.dropped = dropped.typed_data();
  a.invalid = invalid.typed_data();
  return a;
}

// Launcher arguments of the backward from its decoded, checked buffers.
inline MoeBackwardArgs backward_args(const Decoded& d, const ffi::AnyBuffer& x,
                                     const ffi::Buffer<ffi::S32>& expert_ids,
                                     const ffi::AnyBuffer& expert_weights,
                                     const ffi::AnyBuffer& w_gate_up,
                                     const ffi::AnyBuffer& w_down, const ffi::AnyBuffer& gate_up,
                                     const ffi::AnyBuffer& dy, Recipe recipe, int64_t capacity,
                                     ffi::AnyBuffer& dx, ffi::AnyBuffer& d_expert_weights,
                                     ffi::AnyBuffer& d_w_gate_up, ffi::AnyBuffer& d_w_down) {
  MoeBackwardArgs a{};
  a.shape = d.shape;
  a.x_dtype = d.x_dtype;
  a.weight_dtype = d.weight_dtype;
  a.recipe = recipe;
  a.capacity = capacity < 0 ? kNoCapacity : capacity;
  a.x = x.untyped_data();
  a.expert_ids = expert_ids.typed_data();
  a.expert_weights = expert_weights.untyped_data();
  a.w_gate_up = w_gate_up.untyped_data();
  a.w_down = w_down.untyped_data();
  a.gate_up = gate_up.untyped_data();
  a.dy = dy.untyped_data();
  a.dx = dx.untyped_data();
  a.d_expert_weights = d_expert_weights.untyped_data();
  a.d_w_gate_up = d_w_gate_up.untyped_data();
  a.d_w_down = d_w_down.untyped_data();
  return a;
}

}  // namespace mok::ffi_checks
