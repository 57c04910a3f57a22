// XLA FFI handlers for the CUDA MoE forward and backward: decode and validate
// (shared with the CPU handlers), take scratch from XLA's allocator, enqueue
// the launchers of ffi/kernels on XLA's stream.
#include "handlers/moe_cuda.h"

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "checks.h"
#include "decode.h"
#include "signatures.h"
#include "kernels/expert_ffn_cuda.h"
#include "kernels/moe_cuda.h"

namespace mok {
namespace {

namespace ffi = xla::ffi;
using ffi_checks::check_backward_operands;
using ffi_checks::check_forward_results;
using ffi_checks::decode;
using ffi_checks::Decoded;

// The workspace is the custom call's last result, a uint8 buffer the lowering
// sizes from the same static shapes (`workspace_request`), so that its address is
// XLA's, not the handler's: XLA may record a call into a CUDA graph once and replay
// it without calling the handler, and scratch taken from `ffi::ScratchAllocator`
// would be freed under the replayed graph. The request includes kAlign bytes of
// slack, so the pointer can be rounded up to the 256 bytes the launchers' carvers
// assume whatever alignment XLA gives the buffer.
constexpr size_t kAlign = 256;

size_t with_slack(size_t bytes) { return bytes == 0 ? 0 : bytes + kAlign; }

ffi::Error take_workspace(const char* op, ffi::Result<ffi::AnyBuffer>& workspace, size_t bytes,
                          void** out) {
  *out = nullptr;
  if (bytes == 0) return ffi::Error::Success();
  const size_t have = workspace->size_bytes();
  if (have < with_slack(bytes)) {
    return ffi::Error::InvalidArgument(
        std::string(op) + ": the workspace result has " + std::to_string(have) +
        " bytes, this call needs " + std::to_string(with_slack(bytes)) +
        " (it is sized when the call is lowered, from the current GPU: was it lowered for "
        "another kind of GPU?)");
  }
  const uintptr_t base = reinterpret_cast<uintptr_t>(workspace->untyped_data());
  *out = reinterpret_cast<void*>((base + kAlign - 1) / kAlign * kAlign);
  return ffi::Error::Success();
}

std::atomic<uint64_t> g_handler_calls{0};

// Row and pair indices are int32 on the device.
ffi::Error rows_fit_int32(const char* op, int64_t rows) {
  if (rows <= INT32_MAX) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(op) + ": " + std::to_string(rows) +
                                     " rows (T * K, or P * T * K under EP) must be below 2^31");
}

ffi::Error MoeForwardCuda(cudaStream_t stream, ffi::AnyBuffer x,
                          ffi::Buffer<ffi::S32> expert_ids, ffi::AnyBuffer expert_weights,
                          ffi::AnyBuffer w_gate_up, ffi::AnyBuffer w_down, int64_t capacity,
                          bool save_gate_up, ffi::Result<ffi::AnyBuffer> y,
                          ffi::Result<ffi::AnyBuffer> gate_up,
                          ffi::Result<ffi::AnyBuffer> x_rows,
                          ffi::Result<ffi::Buffer<ffi::S32>> tokens_per_expert,
                          ffi::Result<ffi::Buffer<ffi::S32>> dropped,
                          ffi::Result<ffi::Buffer<ffi::S32>> invalid,
                          ffi::Result<ffi::AnyBuffer> workspace) {
  constexpr const char* op = "mok_moe_fwd (CUDA)";
  g_handler_calls.fetch_add(1, std::memory_order_relaxed);
  Decoded d;
  MOK_RETURN_IF_ERROR(decode(op, x, expert_ids, expert_weights, w_gate_up, w_down, &d));
  MOK_RETURN_IF_ERROR(check_forward_results(op, d, *y, *gate_up, *x_rows, *tokens_per_expert,
                                            save_gate_up));
  MOK_RETURN_IF_ERROR(rows_fit_int32(op, d.shape.tokens * d.shape.top_k));

  const MoeForwardArgs args = ffi_checks::forward_args(
      d, x, expert_ids, expert_weights, w_gate_up, w_down, capacity, save_gate_up, *y,
      *gate_up, *tokens_per_expert, *dropped, *invalid);

  // Saved: the forward gathers x into the x_rows result, not into its workspace (the
  // workspace size and moe_forward's carve both follow save_gate_up).
  const size_t bytes = cuda::moe_forward_workspace_bytes(d.shape, d.x_dtype, save_gate_up);
  void* ws = nullptr;
  MOK_RETURN_IF_ERROR(take_workspace(op, workspace, bytes, &ws));
  std::string err = cuda::moe_forward(args, save_gate_up ? x_rows->untyped_data() : nullptr, ws,
                                      bytes, stream);
  return ffi_checks::launcher_result(op, err);
}

ffi::Error MoeBackwardCuda(cudaStream_t stream, ffi::AnyBuffer x,
                           ffi::Buffer<ffi::S32> expert_ids, ffi::AnyBuffer expert_weights,
                           ffi::AnyBuffer w_gate_up, ffi::AnyBuffer w_down,
                           ffi::AnyBuffer gate_up, ffi::AnyBuffer x_rows, ffi::AnyBuffer dy,
                           int64_t capacity,
                           ffi::Result<ffi::AnyBuffer> dx,
                           ffi::Result<ffi::AnyBuffer> d_expert_weights,
                           ffi::Result<ffi::AnyBuffer> d_w_gate_up,
                           ffi::Result<ffi::AnyBuffer> d_w_down,
                           ffi::Result<ffi::AnyBuffer> workspace) {
  constexpr const char* op = "mok_moe_bwd (CUDA)";
  g_handler_calls.fetch_add(1, std::memory_order_relaxed);
  Decoded d;
  MOK_RETURN_IF_ERROR(decode(op, x, expert_ids, expert_weights, w_gate_up, w_down, &d));
  MOK_RETURN_IF_ERROR(check_backward_operands(op, d, gate_up, x_rows, dy, *dx, *d_expert_weights,
                                              *d_w_gate_up, *d_w_down));
  MOK_RETURN_IF_ERROR(rows_fit_int32(op, d.shape.tokens * d.shape.top_k));

  const MoeBackwardArgs args = ffi_checks::backward_args(
      d, x, expert_ids, expert_weights, w_gate_up, w_down, gate_up, dy, capacity, *dx,
      *d_expert_weights, *d_w_gate_up, *d_w_down);

  const size_t bytes = cuda::moe_backward_workspace_bytes(d.shape, d.x_dtype);
  void* ws = nullptr;
  MOK_RETURN_IF_ERROR(take_workspace(op, workspace, bytes, &ws));
  std::string err = cuda::moe_backward(args, x_rows.untyped_data(), ws, bytes, stream);
  return ffi_checks::launcher_result(op, err);
}


ffi::Error ExpertFfnForwardCuda(cudaStream_t stream,
                                ffi::AnyBuffer x_rows, ffi::Buffer<ffi::S32> group_sizes,
                                ffi::AnyBuffer w_gate_up, ffi::AnyBuffer w_down,
                                bool save_gate_up, ffi::Result<ffi::AnyBuffer> out_rows,
                                ffi::Result<ffi::AnyBuffer> gate_up,
                                ffi::Result<ffi::AnyBuffer> workspace) {
  constexpr const char* op = "mok_expert_ffn_fwd (CUDA)";
  g_handler_calls.fetch_add(1, std::memory_order_relaxed);
  MoeShape s;
  DType dt;
  MOK_RETURN_IF_ERROR(
      ffi_checks::decode_expert_side(op, x_rows, group_sizes, w_gate_up, w_down, &s, &dt));
  MOK_RETURN_IF_ERROR(rows_fit_int32(op, s.tokens));
  MOK_RETURN_IF_ERROR(ffi_checks::expect_shape(op, "out_rows", *out_rows, {s.tokens, s.hidden}));
  MOK_RETURN_IF_ERROR(ffi_checks::expect_dtype(op, "out_rows", *out_rows, dt));
  MOK_RETURN_IF_ERROR(ffi_checks::expect_shape(op, "gate_up", *gate_up,
                                               {save_gate_up ? s.tokens : 0, 2 * s.ffn}));
  const cuda::ExpertFfnShape shape{s.tokens, s.experts, s.hidden, s.ffn};
  const size_t bytes = cuda::expert_ffn_forward_workspace_bytes(shape, dt, save_gate_up);
  void* ws = nullptr;
  MOK_RETURN_IF_ERROR(take_workspace(op, workspace, bytes, &ws));
  std::string err = cuda::expert_ffn_forward(
      shape, dt, x_rows.untyped_data(), group_sizes.typed_data(), w_gate_up.untyped_data(),
      w_down.untyped_data(), out_rows->untyped_data(),
      save_gate_up ? gate_up->untyped_data() : nullptr, ws, bytes, stream);
  return ffi_checks::launcher_result(op, err);
}

ffi::Error ExpertFfnBackwardCuda(cudaStream_t stream,
                                 ffi::AnyBuffer x_rows, ffi::AnyBuffer dy_rows,
                                 ffi::AnyBuffer w_rows, ffi::Buffer<ffi::S32> group_sizes,
                                 ffi::AnyBuffer w_gate_up, ffi::AnyBuffer w_down,
                                 ffi::AnyBuffer gate_up, ffi::Result<ffi::AnyBuffer> dx_rows,
                                 ffi::Result<ffi::AnyBuffer> dw_rows,
                                 ffi::Result<ffi::AnyBuffer> d_w_gate_up,
                                 ffi::Result<ffi::AnyBuffer> d_w_down,
                                 ffi::Result<ffi::AnyBuffer> workspace) {
  constexpr const char* op = "mok_expert_ffn_bwd (CUDA)";
  g_handler_calls.fetch_add(1, std::memory_order_relaxed);
  MoeShape s;
  DType dt, wdt;
  MOK_RETURN_IF_ERROR(
      ffi_checks::decode_expert_side(op, x_rows, group_sizes, w_gate_up, w_down, &s, &dt));
  MOK_RETURN_IF_ERROR(ffi_checks::check_expert_backward(op, s, dt, dy_rows, w_rows, gate_up,
                                                        *dx_rows, *dw_rows, *d_w_gate_up,
                                                        *d_w_down, &wdt));
  MOK_RETURN_IF_ERROR(rows_fit_int32(op, s.tokens));
  const cuda::ExpertFfnShape shape{s.tokens, s.experts, s.hidden, s.ffn};
  const size_t bytes = cuda::expert_ffn_backward_workspace_bytes(shape, dt);
  void* ws = nullptr;
  MOK_RETURN_IF_ERROR(take_workspace(op, workspace, bytes, &ws));
  std::string err = cuda::expert_ffn_backward(
      shape, dt, wdt, x_rows.untyped_data(), dy_rows.untyped_data(), w_rows.untyped_data(),
      group_sizes.typed_data(), w_gate_up.untyped_data(), w_down.untyped_data(),
      gate_up.untyped_data(), dx_rows->untyped_data(), dw_rows->untyped_data(),
      d_w_gate_up->untyped_data(), d_w_down->untyped_data(), ws, bytes, stream);
  return ffi_checks::launcher_result(op, err);
}

ffi::Error CombineCuda(cudaStream_t stream, ffi::AnyBuffer rows,
                       ffi::AnyBuffer weights, ffi::Buffer<ffi::S32> kept, bool weighted,
                       ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::AnyBuffer> workspace) {
  constexpr const char* op = "mok_combine (CUDA)";
  g_handler_calls.fetch_add(1, std::memory_order_relaxed);
  ffi_checks::CombineShape c;
  MOK_RETURN_IF_ERROR(ffi_checks::decode_combine(op, rows, weights, kept, weighted, *out, &c));
  MOK_RETURN_IF_ERROR(rows_fit_int32(op, c.tokens * c.top_k));
  const size_t bytes = cuda::combine_workspace_bytes(c.tokens * c.top_k);
  void* ws = nullptr;
  MOK_RETURN_IF_ERROR(take_workspace(op, workspace, bytes, &ws));
  std::string err = cuda::combine_kept_rows(
      c.x_dtype, c.weight_dtype, rows.untyped_data(), weighted ? weights.untyped_data() : nullptr,
      kept.typed_data(), c.tokens, c.top_k, c.hidden, out->untyped_data(), ws, bytes, stream);
  return ffi_checks::launcher_result(op, err);
}

}  // namespace

size_t cuda_workspace_request(std::string_view target, int64_t rows, int64_t top_k,
                              int64_t experts, int64_t hidden, int64_t ffn, DType dtype,
                              bool save_gate_up) {
  const MoeShape shape{rows, top_k, experts, hidden, ffn};
  const cuda::ExpertFfnShape expert_shape{rows, experts, hidden, ffn};
  size_t bytes = 0;
  if (target == "mok_moe_fwd") {
    bytes = cuda::moe_forward_workspace_bytes(shape, dtype, save_gate_up);
  } else if (target == "mok_moe_bwd") {
    bytes = cuda::moe_backward_workspace_bytes(shape, dtype);
  } else if (target == "mok_expert_ffn_fwd") {
    bytes = cuda::expert_ffn_forward_workspace_bytes(expert_shape, dtype, save_gate_up);
  } else if (target == "mok_expert_ffn_bwd") {
    bytes = cuda::expert_ffn_backward_workspace_bytes(expert_shape, dtype);
  } else if (target == "mok_combine") {
    bytes = cuda::combine_workspace_bytes(rows * top_k);
  } else {
    return SIZE_MAX;
  }
  return with_slack(bytes);
}

uint64_t cuda_handler_calls() { return g_handler_calls.load(std::memory_order_relaxed); }

}  // namespace mok

namespace mok::signatures {

// A CUDA handler's context, bound before its operands: XLA's compute stream.
template <typename Binding>
auto cuda_context(Binding b) {
  return std::move(b).template Ctx<ffi::PlatformStream<cudaStream_t>>();
}

// ... and after its results: the workspace, a uint8 result of the bytes
// `cuda_workspace_request` names (see take_workspace).
template <typename Binding>
auto with_workspace(Binding b) {
  return std::move(b).template Ret<ffi::AnyBuffer>();
}

}  // namespace mok::signatures

// kCmdBufferCompatible: XLA may run these calls inside its CUDA graphs (record once
// under stream capture, replay without calling the handler while the call's buffers
// stay where they are). Each handler qualifies: it launches kernels and async
// memsets on its stream only, reads no device data on the host, allocates nothing
// and takes every buffer (the workspace included) from XLA; its host-side choices
// depend on shapes, dtypes, buffer addresses, the GPU and the MOK_JAX_GEMM_* /
// MOK_JAX_SWIGLU_EPILOGUE knobs, which a replayed graph keeps as they were when
// it was recorded. The EP transport's handlers (ep_fused.cc) are not marked.
#define MOK_CUDA_HANDLER(SYMBOL, IMPL, SIGNATURE)                                        \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                        \
      SYMBOL, IMPL,                                                                     \
      mok::signatures::with_workspace(                                                  \
          mok::signatures::SIGNATURE(mok::signatures::cuda_context(xla::ffi::Ffi::Bind()))), \
      {xla::ffi::Traits::kCmdBufferCompatible})

MOK_CUDA_HANDLER(MokMoeForwardCuda, mok::MoeForwardCuda, moe_forward);
MOK_CUDA_HANDLER(MokMoeBackwardCuda, mok::MoeBackwardCuda, moe_backward);
MOK_CUDA_HANDLER(MokExpertFfnForwardCuda, mok::ExpertFfnForwardCuda, expert_ffn_forward);
MOK_CUDA_HANDLER(MokExpertFfnBackwardCuda, mok::ExpertFfnBackwardCuda, expert_ffn_backward);
MOK_CUDA_HANDLER(MokCombineCuda, mok::CombineCuda, combine);
