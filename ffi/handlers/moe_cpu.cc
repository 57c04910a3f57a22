// XLA FFI handlers for the CPU MoE forward and backward: decode buffers,
// validate shapes and dtypes, call the launchers in ffi/cpu.
#include "handlers/moe_cpu.h"

#include "checks.h"
#include "cpu/moe_cpu.h"

namespace mok {
namespace {

namespace ffi = xla::ffi;
using ffi_checks::expect_dtype;
using ffi_checks::expect_shape;
using ffi_checks::to_mok_dtype;

// Derives the problem shape from x, expert_ids and the weights and checks every
// operand of the forward against it.
struct Decoded {
  MoeShape shape;
  DType x_dtype;
  DType weight_dtype;
};

ffi::Error decode(const char* op, const ffi::AnyBuffer& x, const ffi::Buffer<ffi::S32>& ids,
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
  *out = Decoded{MoeShape{T, K, E, H, F}, *x_dtype, *weight_dtype};
  return ffi::Error::Success();
}

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
  const auto [T, K, E, H, F] = d.shape;
  MOK_RETURN_IF_ERROR(expect_shape(op, "y", *y, {T, H}));
  MOK_RETURN_IF_ERROR(expect_dtype(op, "y", *y, d.x_dtype));
  MOK_RETURN_IF_ERROR(expect_shape(op, "gate_up", *gate_up, {save_gate_up ? T * K : 0, 2 * F}));
  MOK_RETURN_IF_ERROR(expect_shape(op, "tokens_per_expert", *tokens_per_expert, {E}));

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
  const auto [T, K, E, H, F] = d.shape;
  MOK_RETURN_IF_ERROR(expect_shape(op, "gate_up", gate_up, {T * K, 2 * F}));
  MOK_RETURN_IF_ERROR(expect_dtype(op, "gate_up", gate_up, d.x_dtype));
  MOK_RETURN_IF_ERROR(expect_shape(op, "dy", dy, {T, H}));
  MOK_RETURN_IF_ERROR(expect_dtype(op, "dy", dy, d.x_dtype));
  MOK_RETURN_IF_ERROR(expect_shape(op, "dx", *dx, {T, H}));
  MOK_RETURN_IF_ERROR(expect_dtype(op, "dx", *dx, d.x_dtype));
  MOK_RETURN_IF_ERROR(expect_shape(op, "d_expert_weights", *d_expert_weights, {T, K}));
  MOK_RETURN_IF_ERROR(expect_dtype(op, "d_expert_weights", *d_expert_weights, d.weight_dtype));
  MOK_RETURN_IF_ERROR(expect_shape(op, "d_w_gate_up", *d_w_gate_up, {E, H, 2 * F}));
  MOK_RETURN_IF_ERROR(expect_dtype(op, "d_w_gate_up", *d_w_gate_up, d.x_dtype));
  MOK_RETURN_IF_ERROR(expect_shape(op, "d_w_down", *d_w_down, {E, F, H}));
  MOK_RETURN_IF_ERROR(expect_dtype(op, "d_w_down", *d_w_down, d.x_dtype));

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
