// XLA FFI handlers for the CUDA MoE forward and backward: decode and validate
// (shared with the CPU handlers), take scratch from XLA's allocator, enqueue
// the launchers of ffi/kernels on XLA's stream.
#include "handlers/moe_cuda.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <string>

#include "checks.h"
#include "decode.h"
#include "signatures.h"
#include "kernels/expert_ffn_cuda.h"
#include "kernels/moe_cuda.h"
#include "kernels/moe_persistent.h"

namespace mok {
namespace {

namespace ffi = xla::ffi;
using ffi_checks::check_backward_operands;
using ffi_checks::check_forward_results;
using ffi_checks::decode;
using ffi_checks::Decoded;

// Scratch for one call; XLA frees it when the handler returns (stream order).
// XLA's FFI allocator accepts alignments up to 16 bytes only, so over-allocate and
// round the pointer up to the 256 bytes the launchers' carvers assume.
ffi::Error take_scratch(ffi::ScratchAllocator& scratch, size_t bytes, void** out) {
  constexpr size_t kXlaAlignment = 16, kWanted = 256;
  *out = nullptr;
  if (bytes == 0) return ffi::Error::Success();
  std::optional<void*> p = scratch.Allocate(bytes + kWanted, kXlaAlignment);
  if (!p.has_value()) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "mok_jax: could not allocate " + std::to_string(bytes) +
                          " bytes of GPU scratch for the MoE layer");
  }
  const uintptr_t base = reinterpret_cast<uintptr_t>(*p);
  *out = reinterpret_cast<void*>((base + kWanted - 1) / kWanted * kWanted);
  return ffi::Error::Success();
}

// Row and pair indices are int32 on the device.
ffi::Error rows_fit_int32(const char* op, int64_t rows) {
  if (rows <= INT32_MAX) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(op) + ": " + std::to_string(rows) +
                                     " rows (T * K, or P * T * K under EP) must be below 2^31");
}

ffi::Error MoeForwardCuda(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer x,
                          ffi::Buffer<ffi::S32> expert_ids, ffi::AnyBuffer expert_weights,
                          ffi::AnyBuffer w_gate_up, ffi::AnyBuffer w_down, int32_t recipe_attr,
                          int64_t capacity, bool save_gate_up, ffi::Result<ffi::AnyBuffer> y,
                          ffi::Result<ffi::AnyBuffer> gate_up,
                          ffi::Result<ffi::AnyBuffer> x_rows,
                          ffi::Result<ffi::Buffer<ffi::S32>> tokens_per_expert,
                          ffi::Result<ffi::Buffer<ffi::S32>> dropped,
                          ffi::Result<ffi::Buffer<ffi::S32>> invalid) {
  constexpr const char* op = "mok_moe_fwd (CUDA)";
  Decoded d;
  Recipe recipe;
  MOK_RETURN_IF_ERROR(ffi_checks::decode_recipe(op, recipe_attr, &recipe));
  MOK_RETURN_IF_ERROR(decode(op, x, expert_ids, expert_weights, w_gate_up, w_down, &d));
  MOK_RETURN_IF_ERROR(check_forward_results(op, d, *y, *gate_up, *x_rows, *tokens_per_expert,
                                            *dropped, *invalid, save_gate_up));
  MOK_RETURN_IF_ERROR(rows_fit_int32(op, d.shape.tokens * d.shape.top_k));

  const MoeForwardArgs args = ffi_checks::forward_args(
      d, x, expert_ids, expert_weights, w_gate_up, w_down, recipe, capacity, save_gate_up, *y,
      *gate_up, *tokens_per_expert, *dropped, *invalid);

  // Saved: the forward gathers x into the x_rows result, not into its workspace (the
  // workspace size and moe_forward's carve both follow save_gate_up).
  const size_t bytes = cuda::moe_forward_workspace_bytes(d.shape, recipe, d.x_dtype,
                                                          save_gate_up);
  void* ws = nullptr;
  MOK_RETURN_IF_ERROR(take_scratch(scratch, bytes, &ws));
  std::string err = cuda::moe_forward(args, save_gate_up ? x_rows->untyped_data() : nullptr, ws,
                                      bytes, stream);
  return ffi_checks::launcher_result(op, err);
}

ffi::Error MoeForwardRanksCuda(cudaStream_t stream, ffi::ScratchAllocator scratch,
                               ffi::AnyBuffer x, ffi::Buffer<ffi::S32> expert_ids,
                               ffi::AnyBuffer expert_weights, ffi::AnyBuffer w_gate_up,
                               ffi::AnyBuffer w_down, int64_t ranks, int64_t capacity,
                               bool save_gate_up, ffi::Result<ffi::AnyBuffer> y,
                               ffi::Result<ffi::AnyBuffer> gate_up,
                               ffi::Result<ffi::AnyBuffer> x_rows,
                               ffi::Result<ffi::Buffer<ffi::S32>> tokens_per_expert,
                               ffi::Result<ffi::Buffer<ffi::S32>> dropped,
                               ffi::Result<ffi::Buffer<ffi::S32>> invalid) {
  constexpr const char* op = "mok_moe_fwd_ranks (CUDA)";
  Decoded d;
  MOK_RETURN_IF_ERROR(decode(op, x, expert_ids, expert_weights, w_gate_up, w_down, &d));
  MOK_RETURN_IF_ERROR(check_forward_results(op, d, *y, *gate_up, *x_rows, *tokens_per_expert,
                                            *dropped, *invalid, save_gate_up));
  MOK_RETURN_IF_ERROR(rows_fit_int32(op, d.shape.tokens * d.shape.top_k));
  // Before the workspace is sized: its receive windows follow `ranks`.
  const std::string bad_ranks = cuda::persistent_ranks_error(d.shape, ranks);
  if (!bad_ranks.empty()) return ffi::Error::InvalidArgument(std::string(op) + ": " + bad_ranks);
  MoeForwardArgs args = ffi_checks::forward_args(
      d, x, expert_ids, expert_weights, w_gate_up, w_down, Recipe::kNative, capacity,
      save_gate_up, *y, *gate_up, *tokens_per_expert, *dropped, *invalid);
  args.ranks = static_cast<int>(ranks);
  const size_t bytes = cuda::moe_forward_workspace_bytes(d.shape, Recipe::kNative, d.x_dtype,
                                                          save_gate_up, args.ranks);
  void* ws = nullptr;
  MOK_RETURN_IF_ERROR(take_scratch(scratch, bytes, &ws));
  return ffi_checks::launcher_result(
      op, cuda::moe_forward(args, save_gate_up ? x_rows->untyped_data() : nullptr, ws, bytes,
                            stream));
}

ffi::Error MoeBackwardRanksCuda(cudaStream_t stream, ffi::ScratchAllocator scratch,
                                ffi::AnyBuffer x, ffi::Buffer<ffi::S32> expert_ids,
                                ffi::AnyBuffer expert_weights, ffi::AnyBuffer w_gate_up,
                                ffi::AnyBuffer w_down, ffi::AnyBuffer gate_up,
                                ffi::AnyBuffer x_rows, ffi::AnyBuffer dy, int64_t ranks,
                                int64_t capacity, ffi::Result<ffi::AnyBuffer> dx,
                                ffi::Result<ffi::AnyBuffer> d_expert_weights,
                                ffi::Result<ffi::AnyBuffer> d_w_gate_up,
                                ffi::Result<ffi::AnyBuffer> d_w_down) {
  constexpr const char* op = "mok_moe_bwd_ranks (CUDA)";
  Decoded d;
  MOK_RETURN_IF_ERROR(decode(op, x, expert_ids, expert_weights, w_gate_up, w_down, &d));
  MOK_RETURN_IF_ERROR(check_backward_operands(op, d, gate_up, x_rows, dy, *dx, *d_expert_weights,
                                              *d_w_gate_up, *d_w_down));
  MOK_RETURN_IF_ERROR(rows_fit_int32(op, d.shape.tokens * d.shape.top_k));
  const std::string bad_ranks = cuda::persistent_ranks_error(d.shape, ranks);
  if (!bad_ranks.empty()) return ffi::Error::InvalidArgument(std::string(op) + ": " + bad_ranks);
  MoeBackwardArgs args = ffi_checks::backward_args(
      d, x, expert_ids, expert_weights, w_gate_up, w_down, gate_up, dy, Recipe::kNative,
      capacity, *dx, *d_expert_weights, *d_w_gate_up, *d_w_down);
  args.ranks = static_cast<int>(ranks);
  const size_t bytes =
      cuda::moe_backward_workspace_bytes(d.shape, Recipe::kNative, d.x_dtype, args.ranks);
  void* ws = nullptr;
  MOK_RETURN_IF_ERROR(take_scratch(scratch, bytes, &ws));
  return ffi_checks::launcher_result(
      op, cuda::moe_backward(args, x_rows.untyped_data(), ws, bytes, stream));
}

ffi::Error MoeBackwardCuda(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer x,
                           ffi::Buffer<ffi::S32> expert_ids, ffi::AnyBuffer expert_weights,
                           ffi::AnyBuffer w_gate_up, ffi::AnyBuffer w_down,
                           ffi::AnyBuffer gate_up, ffi::AnyBuffer x_rows, ffi::AnyBuffer dy,
                           int32_t recipe_attr, int64_t capacity,
                           ffi::Result<ffi::AnyBuffer> dx,
                           ffi::Result<ffi::AnyBuffer> d_expert_weights,
                           ffi::Result<ffi::AnyBuffer> d_w_gate_up,
                           ffi::Result<ffi::AnyBuffer> d_w_down) {
  constexpr const char* op = "mok_moe_bwd (CUDA)";
  Decoded d;
  Recipe recipe;
  MOK_RETURN_IF_ERROR(ffi_checks::decode_recipe(op, recipe_attr, &recipe));
  MOK_RETURN_IF_ERROR(decode(op, x, expert_ids, expert_weights, w_gate_up, w_down, &d));
  MOK_RETURN_IF_ERROR(check_backward_operands(op, d, gate_up, x_rows, dy, *dx, *d_expert_weights,
                                              *d_w_gate_up, *d_w_down));
  MOK_RETURN_IF_ERROR(rows_fit_int32(op, d.shape.tokens * d.shape.top_k));

  const MoeBackwardArgs args = ffi_checks::backward_args(
      d, x, expert_ids, expert_weights, w_gate_up, w_down, gate_up, dy, recipe, capacity, *dx,
      *d_expert_weights, *d_w_gate_up, *d_w_down);

  const size_t bytes = cuda::moe_backward_workspace_bytes(d.shape, recipe, d.x_dtype);
  void* ws = nullptr;
  MOK_RETURN_IF_ERROR(take_scratch(scratch, bytes, &ws));
  std::string err = cuda::moe_backward(args, x_rows.untyped_data(), ws, bytes, stream);
  return ffi_checks::launcher_result(op, err);
}


ffi::Error ExpertFfnForwardCuda(cudaStream_t stream, ffi::ScratchAllocator scratch,
                                ffi::AnyBuffer x_rows, ffi::Buffer<ffi::S32> group_sizes,
                                ffi::AnyBuffer w_gate_up, ffi::AnyBuffer w_down,
                                int32_t recipe_attr, bool save_gate_up,
                                ffi::Result<ffi::AnyBuffer> out_rows,
                                ffi::Result<ffi::AnyBuffer> gate_up) {
  constexpr const char* op = "mok_expert_ffn_fwd (CUDA)";
  MoeShape s;
  DType dt;
  Recipe recipe;
  MOK_RETURN_IF_ERROR(ffi_checks::decode_recipe(op, recipe_attr, &recipe));
  MOK_RETURN_IF_ERROR(
      ffi_checks::decode_expert_side(op, x_rows, group_sizes, w_gate_up, w_down, &s, &dt));
  MOK_RETURN_IF_ERROR(rows_fit_int32(op, s.tokens));
  MOK_RETURN_IF_ERROR(
      ffi_checks::check_expert_forward(op, s, dt, *out_rows, *gate_up, save_gate_up));
  const cuda::ExpertFfnShape shape{s.tokens, s.experts, s.hidden, s.ffn};
  const size_t bytes = cuda::expert_ffn_forward_workspace_bytes(shape, recipe, dt);
  void* ws = nullptr;
  MOK_RETURN_IF_ERROR(take_scratch(scratch, bytes, &ws));
  std::string err = cuda::expert_ffn_forward(
      shape, recipe, dt, x_rows.untyped_data(), group_sizes.typed_data(), w_gate_up.untyped_data(),
      w_down.untyped_data(), out_rows->untyped_data(),
      save_gate_up ? gate_up->untyped_data() : nullptr, ws, bytes, stream);
  return ffi_checks::launcher_result(op, err);
}

ffi::Error ExpertFfnBackwardCuda(cudaStream_t stream, ffi::ScratchAllocator scratch,
                                 ffi::AnyBuffer x_rows, ffi::AnyBuffer dy_rows,
                                 ffi::AnyBuffer w_rows, ffi::Buffer<ffi::S32> group_sizes,
                                 ffi::AnyBuffer w_gate_up, ffi::AnyBuffer w_down,
                                 ffi::AnyBuffer gate_up, int32_t recipe_attr,
                                 ffi::Result<ffi::AnyBuffer> dx_rows,
                                 ffi::Result<ffi::AnyBuffer> dw_rows,
                                 ffi::Result<ffi::AnyBuffer> d_w_gate_up,
                                 ffi::Result<ffi::AnyBuffer> d_w_down) {
  constexpr const char* op = "mok_expert_ffn_bwd (CUDA)";
  MoeShape s;
  DType dt, wdt;
  Recipe recipe;
  MOK_RETURN_IF_ERROR(ffi_checks::decode_recipe(op, recipe_attr, &recipe));
  MOK_RETURN_IF_ERROR(
      ffi_checks::decode_expert_side(op, x_rows, group_sizes, w_gate_up, w_down, &s, &dt));
  MOK_RETURN_IF_ERROR(ffi_checks::check_expert_backward(op, s, dt, dy_rows, w_rows, gate_up,
                                                        *dx_rows, *dw_rows, *d_w_gate_up,
                                                        *d_w_down, &wdt));
  MOK_RETURN_IF_ERROR(rows_fit_int32(op, s.tokens));
  const cuda::ExpertFfnShape shape{s.tokens, s.experts, s.hidden, s.ffn};
  const size_t bytes = cuda::expert_ffn_backward_workspace_bytes(shape, recipe, dt);
  void* ws = nullptr;
  MOK_RETURN_IF_ERROR(take_scratch(scratch, bytes, &ws));
  std::string err = cuda::expert_ffn_backward(
      shape, recipe, dt, wdt, x_rows.untyped_data(), dy_rows.untyped_data(), w_rows.untyped_data(),
      group_sizes.typed_data(), w_gate_up.untyped_data(), w_down.untyped_data(),
      gate_up.untyped_data(), dx_rows->untyped_data(), dw_rows->untyped_data(),
      d_w_gate_up->untyped_data(), d_w_down->untyped_data(), ws, bytes, stream);
  return ffi_checks::launcher_result(op, err);
}

ffi::Error CombineCuda(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer rows,
                       ffi::AnyBuffer weights, ffi::Buffer<ffi::S32> kept, bool weighted,
                       ffi::Result<ffi::AnyBuffer> out) {
  constexpr const char* op = "mok_combine (CUDA)";
  ffi_checks::CombineShape c;
  MOK_RETURN_IF_ERROR(ffi_checks::decode_combine(op, rows, weights, kept, weighted, *out, &c));
  MOK_RETURN_IF_ERROR(rows_fit_int32(op, c.tokens * c.top_k));
  const size_t bytes = cuda::combine_workspace_bytes(c.tokens * c.top_k);
  void* ws = nullptr;
  MOK_RETURN_IF_ERROR(take_scratch(scratch, bytes, &ws));
  std::string err = cuda::combine_kept_rows(
      c.x_dtype, c.weight_dtype, rows.untyped_data(), weighted ? weights.untyped_data() : nullptr,
      kept.typed_data(), c.tokens, c.top_k, c.hidden, out->untyped_data(), ws, bytes, stream);
  return ffi_checks::launcher_result(op, err);
}

}  // namespace
}  // namespace mok

namespace mok::signatures {

// A CUDA handler's context, bound before its operands: XLA's compute stream and
// the scratch allocator for its workspace.
template <typename Binding>
auto cuda_context(Binding b) {
  return std::move(b)
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's compute stream
      .template Ctx<ffi::ScratchAllocator>();             // workspace
}

}  // namespace mok::signatures

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MokMoeForwardCuda, mok::MoeForwardCuda,
    mok::signatures::moe_forward(mok::signatures::cuda_context(xla::ffi::Ffi::Bind())));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MokMoeForwardRanksCuda, mok::MoeForwardRanksCuda,
    mok::signatures::moe_forward_ranks(mok::signatures::cuda_context(xla::ffi::Ffi::Bind())));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MokMoeBackwardRanksCuda, mok::MoeBackwardRanksCuda,
    mok::signatures::moe_backward_ranks(mok::signatures::cuda_context(xla::ffi::Ffi::Bind())));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MokMoeBackwardCuda, mok::MoeBackwardCuda,
    mok::signatures::moe_backward(mok::signatures::cuda_context(xla::ffi::Ffi::Bind())));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MokExpertFfnForwardCuda, mok::ExpertFfnForwardCuda,
    mok::signatures::expert_ffn_forward(mok::signatures::cuda_context(xla::ffi::Ffi::Bind())));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MokExpertFfnBackwardCuda, mok::ExpertFfnBackwardCuda,
    mok::signatures::expert_ffn_backward(mok::signatures::cuda_context(xla::ffi::Ffi::Bind())));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MokCombineCuda, mok::CombineCuda,
    mok::signatures::combine(mok::signatures::cuda_context(xla::ffi::Ffi::Bind())));
