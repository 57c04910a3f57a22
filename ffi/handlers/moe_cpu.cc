// XLA FFI handlers for the CPU MoE forward and backward: decode buffers,
// validate shapes and dtypes, call the launchers in ffi/cpu.
#include "handlers/moe_cpu.h"

#include "checks.h"
#include "decode.h"
#include "cpu/moe_cpu.h"

namespace mok {
namespace {

namespace ffi = xla::ffi;
using ffi_checks::check_backward_operands;
using ffi_checks::check_forward_results;
using ffi_checks::decode;
using ffi_checks::Decoded;

ffi::Error MoeForwardCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> expert_ids,
                         ffi::AnyBuffer expert_weights, ffi::AnyBuffer w_gate_up,
                         ffi::AnyBuffer w_down, int64_t capacity, bool save_gate_up,
                         ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> gate_up,
                         ffi::Result<ffi::Buffer<ffi::S32>> tokens_per_expert,
                         ffi::Result<ffi::Buffer<ffi::S32>> dropped,
                         ffi::Result<ffi::Buffer<ffi::S32>> invalid) {
  constexpr const char* op = "mok_moe_fwd";
  Decoded d;
  MOK_RETURN_IF_ERROR(decode(op, x, expert_ids, expert_weights, w_gate_up, w_down, &d));
  MOK_RETURN_IF_ERROR(check_forward_results(op, d, *y, *gate_up, *tokens_per_expert, save_gate_up));

  cpu::MoeForwardArgs args{};
  args.shape = d.shape;
  args.x_dtype = d.x_dtype;
  args.weight_dtype = d.weight_dtype;
  args.capacity = capacity < 0 ? kNoCapacity : capacity;
  args.x = x.untyped_data();
  args.expert_ids = expert_ids.typed_data();
  args.expert_weights = expert_weights.untyped_data();
  args.w_gate_up = w_gate_up.untyped_data();
  args.w_down = w_down.untyped_data();
  args.y = y->untyped_data();
  args.gate_up_out = save_gate_up ? gate_up->untyped_data() : nullptr;
  args.tokens_per_expert = tokens_per_expert->typed_data();
  args.dropped = dropped->typed_data();
  args.invalid = invalid->typed_data();
  std::string err = cpu::moe_forward(args);
  return err.empty() ? ffi::Error::Success() : ffi::Error::Internal(err);
}

ffi::Error MoeBackwardCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> expert_ids,
                          ffi::AnyBuffer expert_weights, ffi::AnyBuffer w_gate_up,
                          ffi::AnyBuffer w_down, ffi::AnyBuffer gate_up, ffi::AnyBuffer dy,
                          int64_t capacity, ffi::Result<ffi::AnyBuffer> dx,
                          ffi::Result<ffi::AnyBuffer> d_expert_weights,
                          ffi::Result<ffi::AnyBuffer> d_w_gate_up,
                          ffi::Result<ffi::AnyBuffer> d_w_down) {
  constexpr const char* op = "mok_moe_bwd";
  Decoded d;
  MOK_RETURN_IF_ERROR(decode(op, x, expert_ids, expert_weights, w_gate_up, w_down, &d));
  MOK_RETURN_IF_ERROR(check_backward_operands(op, d, gate_up, dy, *dx, *d_expert_weights,
                                              *d_w_gate_up, *d_w_down));
  cpu::MoeBackwardArgs args{};
  args.shape = d.shape;
  args.x_dtype = d.x_dtype;
  args.weight_dtype = d.weight_dtype;
  args.capacity = capacity < 0 ? kNoCapacity : capacity;
  args.x = x.untyped_data();
  args.expert_ids = expert_ids.typed_data();
  args.expert_weights = expert_weights.untyped_data();
  args.w_gate_up = w_gate_up.untyped_data();
  args.w_down = w_down.untyped_data();
  args.gate_up = gate_up.untyped_data();
  args.dy = dy.untyped_data();
  args.dx = dx->untyped_data();
  args.d_expert_weights = d_expert_weights->untyped_data();
  args.d_w_gate_up = d_w_gate_up->untyped_data();
  args.d_w_down = d_w_down->untyped_data();
  std::string err = cpu::moe_backward(args);
  return err.empty() ? ffi::Error::Success() : ffi::Error::Internal(err);
}

}  // namespace
}  // namespace mok

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MokMoeForwardCpu, mok::MoeForwardCpu,
    xla::ffi::Ffi::Bind()
        .Arg<xla::ffi::AnyBuffer>()                  // x [T, H]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()      // expert_ids [T, K]
        .Arg<xla::ffi::AnyBuffer>()                  // expert_weights [T, K]
        .Arg<xla::ffi::AnyBuffer>()                  // w_gate_up [E, H, 2F]
        .Arg<xla::ffi::AnyBuffer>()                  // w_down [E, F, H]
        .Attr<int64_t>("capacity")                   // rows kept per expert, < 0: all
        .Attr<bool>("save_gate_up")                  // write gate_up for the backward
        .Ret<xla::ffi::AnyBuffer>()                  // y [T, H]
        .Ret<xla::ffi::AnyBuffer>()                  // gate_up [T*K or 0, 2F]
        .Ret<xla::ffi::Buffer<xla::ffi::S32>>()      // tokens_per_expert [E]
        .Ret<xla::ffi::Buffer<xla::ffi::S32>>()      // dropped []
        .Ret<xla::ffi::Buffer<xla::ffi::S32>>());    // invalid []

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MokMoeBackwardCpu, mok::MoeBackwardCpu,
    xla::ffi::Ffi::Bind()
        .Arg<xla::ffi::AnyBuffer>()                  // x [T, H]
        .Arg<xla::ffi::Buffer<xla::ffi::S32>>()      // expert_ids [T, K]
        .Arg<xla::ffi::AnyBuffer>()                  // expert_weights [T, K]
        .Arg<xla::ffi::AnyBuffer>()                  // w_gate_up [E, H, 2F]
        .Arg<xla::ffi::AnyBuffer>()                  // w_down [E, F, H]
        .Arg<xla::ffi::AnyBuffer>()                  // gate_up [T*K, 2F] from the forward
        .Arg<xla::ffi::AnyBuffer>()                  // dy [T, H]
        .Attr<int64_t>("capacity")                   // rows kept per expert, < 0: all
        .Ret<xla::ffi::AnyBuffer>()                  // dx [T, H]
        .Ret<xla::ffi::AnyBuffer>()                  // d_expert_weights [T, K]
        .Ret<xla::ffi::AnyBuffer>()                  // d_w_gate_up [E, H, 2F]
        .Ret<xla::ffi::AnyBuffer>());                // d_w_down [E, F, H]
