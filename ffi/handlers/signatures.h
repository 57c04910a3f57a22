// The operand, attribute and result lists of every mok_jax FFI target, defined
// once for both platforms. A CPU handler binds `moe_forward(Ffi::Bind())`; a
// CUDA handler first binds its context with `cuda_context(Ffi::Bind())`, so its
// implementation takes (stream, scratch, operands...).
#pragma once

#include <cstdint>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace mok::signatures {

namespace ffi = xla::ffi;
using S32 = ffi::Buffer<ffi::S32>;

template <typename Binding>
auto moe_forward(Binding b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()   // x [T, H]
      .template Arg<S32>()                  // expert_ids [T, K]
      .template Arg<ffi::AnyBuffer>()       // expert_weights [T, K]
      .template Arg<ffi::AnyBuffer>()       // w_gate_up [E, H, 2F]
      .template Arg<ffi::AnyBuffer>()       // w_down [E, F, H]
      .template Attr<int32_t>("recipe")     // mok::Recipe: how the expert GEMMs compute
      .template Attr<int64_t>("capacity")   // rows kept per expert, < 0: all
      .template Attr<bool>("save_gate_up")  // write gate_up and x_rows for the backward
      .template Ret<ffi::AnyBuffer>()       // y [T, H]
      .template Ret<ffi::AnyBuffer>()       // gate_up [T*K or 0, 2F] by plan row
      .template Ret<ffi::AnyBuffer>()       // x_rows [T*K or 0, H] by plan row
      .template Ret<S32>()                  // tokens_per_expert [E]
      .template Ret<S32>()                  // dropped []
      .template Ret<S32>();                 // invalid []
}

// The forward of `ranks` EP ranks in one launch on one device (virtual ranks;
// CUDA only): the persistent kernel's EP role, with y and the residuals bit for
// bit moe_forward's.
template <typename Binding>
auto moe_forward_ranks(Binding b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()   // x [T, H], rank o: rows [o T/P, (o+1) T/P)
      .template Arg<S32>()                  // expert_ids [T, K]
      .template Arg<ffi::AnyBuffer>()       // expert_weights [T, K]
      .template Arg<ffi::AnyBuffer>()       // w_gate_up [E, H, 2F], rank o: [o E/P, (o+1) E/P)
      .template Arg<ffi::AnyBuffer>()       // w_down [E, F, H]
      .template Attr<int64_t>("ranks")      // P, 1..8, dividing T and E
      .template Attr<int64_t>("capacity")   // rows kept per expert, < 0: all
      .template Attr<bool>("save_gate_up")  // write gate_up and x_rows for the backward
      .template Ret<ffi::AnyBuffer>()       // y [T, H]
      .template Ret<ffi::AnyBuffer>()       // gate_up [T*K or 0, 2F] by plan row
      .template Ret<ffi::AnyBuffer>()       // x_rows [T*K or 0, H] by plan row
      .template Ret<S32>()                  // tokens_per_expert [E]
      .template Ret<S32>()                  // dropped []
      .template Ret<S32>();                 // invalid []
}

// The backward of `ranks` EP ranks in one launch on one device (virtual ranks;
// CUDA only): the persistent backward's EP role, bit for bit moe_backward's.
template <typename Binding>
auto moe_backward_ranks(Binding b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()   // x [T, H]
      .template Arg<S32>()                  // expert_ids [T, K]
      .template Arg<ffi::AnyBuffer>()       // expert_weights [T, K], rank o: rows [o T/P, ...)
      .template Arg<ffi::AnyBuffer>()       // w_gate_up [E, H, 2F], rank o: [o E/P, (o+1) E/P)
      .template Arg<ffi::AnyBuffer>()       // w_down [E, F, H]
      .template Arg<ffi::AnyBuffer>()       // gate_up [T*K, 2F] from the forward
      .template Arg<ffi::AnyBuffer>()       // x_rows [T*K, H] from the forward
      .template Arg<ffi::AnyBuffer>()       // dy [T, H], rank o: rows [o T/P, (o+1) T/P)
      .template Attr<int64_t>("ranks")      // P, 1..8, dividing T and E
      .template Attr<int64_t>("capacity")   // rows kept per expert, < 0: all
      .template Ret<ffi::AnyBuffer>()       // dx [T, H]
      .template Ret<ffi::AnyBuffer>()       // d_expert_weights [T, K]
      .template Ret<ffi::AnyBuffer>()       // d_w_gate_up [E, H, 2F]
      .template Ret<ffi::AnyBuffer>();      // d_w_down [E, F, H]
}

template <typename Binding>
auto moe_backward(Binding b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()   // x [T, H]
      .template Arg<S32>()                  // expert_ids [T, K]
      .template Arg<ffi::AnyBuffer>()       // expert_weights [T, K]
      .template Arg<ffi::AnyBuffer>()       // w_gate_up [E, H, 2F]
      .template Arg<ffi::AnyBuffer>()       // w_down [E, F, H]
      .template Arg<ffi::AnyBuffer>()       // gate_up [T*K, 2F] from the forward
      .template Arg<ffi::AnyBuffer>()       // x_rows [T*K, H] from the forward
      .template Arg<ffi::AnyBuffer>()       // dy [T, H]
      .template Attr<int32_t>("recipe")     // mok::Recipe
      .template Attr<int64_t>("capacity")   // rows kept per expert, < 0: all
      .template Ret<ffi::AnyBuffer>()       // dx [T, H]
      .template Ret<ffi::AnyBuffer>()       // d_expert_weights [T, K]
      .template Ret<ffi::AnyBuffer>()       // d_w_gate_up [E, H, 2F]
      .template Ret<ffi::AnyBuffer>();      // d_w_down [E, F, H]
}

template <typename Binding>
auto expert_ffn_forward(Binding b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()   // x_rows [R, H], grouped by expert
      .template Arg<S32>()                  // group_sizes [E_local]
      .template Arg<ffi::AnyBuffer>()       // w_gate_up [E_local, H, 2F]
      .template Arg<ffi::AnyBuffer>()       // w_down [E_local, F, H]
      .template Attr<int32_t>("recipe")     // mok::Recipe
      .template Attr<bool>("save_gate_up")  // write gate_up for the backward
      .template Ret<ffi::AnyBuffer>()       // out_rows [R, H]
      .template Ret<ffi::AnyBuffer>();      // gate_up [R or 0, 2F]
}

template <typename Binding>
auto expert_ffn_backward(Binding b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()   // x_rows [R, H]
      .template Arg<ffi::AnyBuffer>()       // dy_rows [R, H]
      .template Arg<ffi::AnyBuffer>()       // w_rows [R]
      .template Arg<S32>()                  // group_sizes [E_local]
      .template Arg<ffi::AnyBuffer>()       // w_gate_up [E_local, H, 2F]
      .template Arg<ffi::AnyBuffer>()       // w_down [E_local, F, H]
      .template Arg<ffi::AnyBuffer>()       // gate_up [R, 2F]
      .template Attr<int32_t>("recipe")     // mok::Recipe
      .template Ret<ffi::AnyBuffer>()       // dx_rows [R, H]
      .template Ret<ffi::AnyBuffer>()       // dw_rows [R]
      .template Ret<ffi::AnyBuffer>()       // d_w_gate_up [E_local, H, 2F]
      .template Ret<ffi::AnyBuffer>();      // d_w_down [E_local, F, H]
}

template <typename Binding>
auto combine(Binding b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()   // rows [T*K, H] by pair
      .template Arg<ffi::AnyBuffer>()       // weights [T, K] (not read unless weighted)
      .template Arg<S32>()                  // kept [T, K]
      .template Attr<bool>("weighted")      // multiply by weights, else by 1
      .template Ret<ffi::AnyBuffer>();      // out [T, H]
}

template <typename Binding>
auto quantize_rows_fp8(Binding b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()   // x [N, K] f32 or bf16
      .template Ret<ffi::AnyBuffer>()       // q [N, K] float8_e4m3fn
      .template Ret<ffi::Buffer<ffi::F32>>();  // scales [N, ceil(K / 128)]
}

}  // namespace mok::signatures
