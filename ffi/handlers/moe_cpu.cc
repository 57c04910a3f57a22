// XLA FFI handlers for the CPU MoE forward and backward: decode buffers,
// validate shapes and dtypes, call the launchers in ffi/cpu.
#include "handlers/moe_cpu.h"

#include "checks.h"
#include "decode.h"
#include "signatures.h"
#include "cpu/fp8.h"
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
                         ffi::AnyBuffer w_down, int32_t recipe_attr, int64_t capacity,
                         bool save_gate_up,
                         ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> gate_up,
                         ffi::Result<ffi::AnyBuffer> x_rows,
                         ffi::Result<ffi::Buffer<ffi::S32>> tokens_per_expert,
                         ffi::Result<ffi::Buffer<ffi::S32>> dropped,
                         ffi::Result<ffi::Buffer<ffi::S32>> invalid) {
  constexpr const char* op = "mok_moe_fwd";
  Decoded d;
  Recipe recipe;
  MOK_RETURN_IF_ERROR(ffi_checks::decode_recipe(op, recipe_attr, &recipe));
  MOK_RETURN_IF_ERROR(decode(op, x, expert_ids, expert_weights, w_gate_up, w_down, &d));
  MOK_RETURN_IF_ERROR(check_forward_results(op, d, *y, *gate_up, *x_rows, *tokens_per_expert,
                                            *dropped, *invalid, save_gate_up));

  const MoeForwardArgs args = ffi_checks::forward_args(
      d, x, expert_ids, expert_weights, w_gate_up, w_down, recipe, capacity, save_gate_up, *y,
      *gate_up, *tokens_per_expert, *dropped, *invalid);
  std::string err = cpu::moe_forward(args, save_gate_up ? x_rows->untyped_data() : nullptr);
  return ffi_checks::launcher_result(op, err);
}

ffi::Error MoeBackwardCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> expert_ids,
                          ffi::AnyBuffer expert_weights, ffi::AnyBuffer w_gate_up,
                          ffi::AnyBuffer w_down, ffi::AnyBuffer gate_up, ffi::AnyBuffer x_rows,
                          ffi::AnyBuffer dy, int32_t recipe_attr, int64_t capacity,
                          ffi::Result<ffi::AnyBuffer> dx,
                          ffi::Result<ffi::AnyBuffer> d_expert_weights,
                          ffi::Result<ffi::AnyBuffer> d_w_gate_up,
                          ffi::Result<ffi::AnyBuffer> d_w_down) {
  constexpr const char* op = "mok_moe_bwd";
  Decoded d;
  Recipe recipe;
  MOK_RETURN_IF_ERROR(ffi_checks::decode_recipe(op, recipe_attr, &recipe));
  MOK_RETURN_IF_ERROR(decode(op, x, expert_ids, expert_weights, w_gate_up, w_down, &d));
  MOK_RETURN_IF_ERROR(check_backward_operands(op, d, gate_up, x_rows, dy, *dx, *d_expert_weights,
                                              *d_w_gate_up, *d_w_down));
  const MoeBackwardArgs args = ffi_checks::backward_args(
      d, x, expert_ids, expert_weights, w_gate_up, w_down, gate_up, dy, recipe, capacity, *dx,
      *d_expert_weights, *d_w_gate_up, *d_w_down);
  std::string err = cpu::moe_backward(args, x_rows.untyped_data());
  return ffi_checks::launcher_result(op, err);
}

}  // namespace
}  // namespace mok

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MokMoeForwardCpu, mok::MoeForwardCpu,
    mok::signatures::moe_forward(xla::ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MokMoeBackwardCpu, mok::MoeBackwardCpu,
    mok::signatures::moe_backward(xla::ffi::Ffi::Bind()));

// --- pieces for expert parallelism (mok_jax/_src/ep.py) -----------------------

namespace mok {
namespace {

ffi::Error ExpertFfnForwardCpu(ffi::AnyBuffer x_rows, ffi::Buffer<ffi::S32> group_sizes,
                               ffi::AnyBuffer w_gate_up, ffi::AnyBuffer w_down,
                               int32_t recipe_attr, bool save_gate_up,
                               ffi::Result<ffi::AnyBuffer> out_rows,
                               ffi::Result<ffi::AnyBuffer> gate_up) {
  constexpr const char* op = "mok_expert_ffn_fwd";
  MoeShape s;
  DType dt;
  Recipe recipe;
  MOK_RETURN_IF_ERROR(ffi_checks::decode_recipe(op, recipe_attr, &recipe));
  MOK_RETURN_IF_ERROR(ffi_checks::decode_expert_side(op, x_rows, group_sizes, w_gate_up, w_down, &s, &dt));
  MOK_RETURN_IF_ERROR(
      ffi_checks::check_expert_forward(op, s, dt, *out_rows, *gate_up, save_gate_up));
  cpu::ExpertFfnForwardArgs a{};
  a.rows = s.tokens;
  a.experts = s.experts;
  a.hidden = s.hidden;
  a.ffn = s.ffn;
  a.x_dtype = dt;
  a.recipe = recipe;
  a.x_rows = x_rows.untyped_data();
  a.group_sizes = group_sizes.typed_data();
  a.w_gate_up = w_gate_up.untyped_data();
  a.w_down = w_down.untyped_data();
  a.out_rows = out_rows->untyped_data();
  a.gate_up_out = save_gate_up ? gate_up->untyped_data() : nullptr;
  std::string err = cpu::expert_ffn_forward(a);
  return ffi_checks::launcher_result(op, err, ffi::ErrorCode::kInvalidArgument);
}

ffi::Error ExpertFfnBackwardCpu(ffi::AnyBuffer x_rows, ffi::AnyBuffer dy_rows,
                                ffi::AnyBuffer w_rows, ffi::Buffer<ffi::S32> group_sizes,
                                ffi::AnyBuffer w_gate_up, ffi::AnyBuffer w_down,
                                ffi::AnyBuffer gate_up, int32_t recipe_attr,
                                ffi::Result<ffi::AnyBuffer> dx_rows,
                                ffi::Result<ffi::AnyBuffer> dw_rows,
                                ffi::Result<ffi::AnyBuffer> d_w_gate_up,
                                ffi::Result<ffi::AnyBuffer> d_w_down) {
  constexpr const char* op = "mok_expert_ffn_bwd";
  MoeShape s;
  DType dt;
  Recipe recipe;
  MOK_RETURN_IF_ERROR(ffi_checks::decode_recipe(op, recipe_attr, &recipe));
  MOK_RETURN_IF_ERROR(ffi_checks::decode_expert_side(op, x_rows, group_sizes, w_gate_up, w_down, &s, &dt));
  DType wdt;
  MOK_RETURN_IF_ERROR(ffi_checks::check_expert_backward(op, s, dt, dy_rows, w_rows, gate_up,
                                                        *dx_rows, *dw_rows, *d_w_gate_up,
                                                        *d_w_down, &wdt));
  const int64_t R = s.tokens, H = s.hidden, F = s.ffn, E = s.experts;
  cpu::ExpertFfnBackwardArgs a{};
  a.rows = R;
  a.experts = E;
  a.hidden = H;
  a.ffn = F;
  a.x_dtype = dt;
  a.weight_dtype = wdt;
  a.recipe = recipe;
  a.x_rows = x_rows.untyped_data();
  a.dy_rows = dy_rows.untyped_data();
  a.w_rows = w_rows.untyped_data();
  a.group_sizes = group_sizes.typed_data();
  a.w_gate_up = w_gate_up.untyped_data();
  a.w_down = w_down.untyped_data();
  a.gate_up = gate_up.untyped_data();
  a.dx_rows = dx_rows->untyped_data();
  a.dw_rows = dw_rows->untyped_data();
  a.d_w_gate_up = d_w_gate_up->untyped_data();
  a.d_w_down = d_w_down->untyped_data();
  std::string err = cpu::expert_ffn_backward(a);
  return ffi_checks::launcher_result(op, err, ffi::ErrorCode::kInvalidArgument);
}

ffi::Error CombineCpu(ffi::AnyBuffer rows, ffi::AnyBuffer weights, ffi::Buffer<ffi::S32> kept,
                      bool weighted, ffi::Result<ffi::AnyBuffer> out) {
  constexpr const char* op = "mok_combine";
  ffi_checks::CombineShape c;
  MOK_RETURN_IF_ERROR(ffi_checks::decode_combine(op, rows, weights, kept, weighted, *out, &c));
  const int64_t T = c.tokens, K = c.top_k, H = c.hidden;
  cpu::CombineArgs a{};
  a.tokens = T;
  a.top_k = K;
  a.hidden = H;
  a.x_dtype = c.x_dtype;
  a.weight_dtype = c.weight_dtype;
  a.rows = rows.untyped_data();
  a.weights = weighted ? weights.untyped_data() : nullptr;
  a.kept = kept.typed_data();
  a.out = out->untyped_data();
  std::string err = cpu::combine_rows(a);
  return ffi_checks::launcher_result(op, err);
}

}  // namespace
}  // namespace mok

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MokExpertFfnForwardCpu, mok::ExpertFfnForwardCpu,
    mok::signatures::expert_ffn_forward(xla::ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MokExpertFfnBackwardCpu, mok::ExpertFfnBackwardCpu,
    mok::signatures::expert_ffn_backward(xla::ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MokCombineCpu, mok::CombineCpu,
    mok::signatures::combine(xla::ffi::Ffi::Bind()));

// --- the fp8 recipe's quantizer (mok_jax.quantize_rows_fp8) --------------------

namespace mok {
namespace {

ffi::Error QuantizeRowsFp8Cpu(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q,
                              ffi::Result<ffi::Buffer<ffi::F32>> scales) {
  constexpr const char* op = "mok_quantize_rows_fp8";
  if (x.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument(std::string(op) + ": x must be rank 2, got " +
                                       ffi_checks::dims_str(x.dimensions()));
  }
  auto dt = ffi_checks::to_mok_dtype(x.element_type());
  if (!dt) return ffi::Error::InvalidArgument(std::string(op) + ": x must be f32 or bf16");
  const int64_t N = x.dimensions()[0], K = x.dimensions()[1];
  const int64_t blocks = (K + cpu::kFp8Block - 1) / cpu::kFp8Block;
  MOK_RETURN_IF_ERROR(ffi_checks::expect_shape(op, "q", *q, {N, K}));
  if (q->element_type() != ffi::DataType::F8E4M3FN) {
    return ffi::Error::InvalidArgument(std::string(op) + ": q must be float8_e4m3fn");
  }
  MOK_RETURN_IF_ERROR(ffi_checks::expect_shape(op, "scales", *scales, {N, blocks}));
  cpu::QuantizeRowsArgs a{};
  a.rows = N;
  a.cols = K;
  a.x_dtype = *dt;
  a.x = x.untyped_data();
  a.q = static_cast<uint8_t*>(q->untyped_data());
  a.scales = scales->typed_data();
  return ffi_checks::launcher_result(op, cpu::quantize_rows_fp8(a));
}

}  // namespace
}  // namespace mok

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MokQuantizeRowsFp8Cpu, mok::QuantizeRowsFp8Cpu,
    mok::signatures::quantize_rows_fp8(xla::ffi::Ffi::Bind()));
