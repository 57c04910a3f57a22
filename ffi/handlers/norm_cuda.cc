// XLA FFI handlers of the fused residual add + RMSNorm (kernels/rms_norm.h):
// validate shapes and dtypes, enqueue on XLA's stream. CUDA only: on the CPU
// mok_jax.add_rms_norm lowers to its jnp form.
#include "handlers/norm_cuda.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "checks.h"
#include "kernels/rms_norm.h"

namespace mok {
namespace {

namespace ffi = xla::ffi;
using ffi_checks::expect_dtype;
using ffi_checks::expect_shape;
using F32 = ffi::Buffer<ffi::F32>;

// The rows' element type and [R, D] from x, checked against the kernels' limits.
ffi::Error row_shape(const char* op, const ffi::AnyBuffer& x, DType* dtype, int64_t* rows,
                     int64_t* dim) {
  auto t = ffi_checks::to_mok_dtype(x.element_type());
  auto dims = x.dimensions();
  if (!t || dims.size() != 2) {
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": rows must be a 2-D float32 or bfloat16 array");
  }
  *dtype = *t, *rows = dims[0], *dim = dims[1];
  std::string why = cuda::add_rms_norm_unsupported(*t, *dim);
  if (!why.empty()) return ffi::Error::InvalidArgument(std::string(op) + ": " + why);
  return ffi::Error::Success();
}

ffi::Error AddRmsNormForwardCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer branch,
                                 F32 scale, float epsilon, ffi::Result<ffi::AnyBuffer> sum,
                                 ffi::Result<ffi::AnyBuffer> out, ffi::Result<F32> rstd) {
  constexpr const char* op = "mok_add_rms_norm_fwd (CUDA)";
  DType dt;
  int64_t rows, dim;
  MOK_RETURN_IF_ERROR(row_shape(op, x, &dt, &rows, &dim));
  for (auto [name, buf] : {std::pair<const char*, const ffi::AnyBuffer*>{"branch", &branch},
                           {"sum", &*sum}, {"out", &*out}}) {
    MOK_RETURN_IF_ERROR(expect_shape(op, name, *buf, {rows, dim}));
    MOK_RETURN_IF_ERROR(expect_dtype(op, name, *buf, dt));
  }
  MOK_RETURN_IF_ERROR(expect_shape(op, "scale", scale, {dim}));
  MOK_RETURN_IF_ERROR(expect_shape(op, "rstd", *rstd, {rows}));
  std::string err = cuda::add_rms_norm_forward(
      dt, x.untyped_data(), branch.untyped_data(), scale.typed_data(), rows, dim, epsilon,
      sum->untyped_data(), out->untyped_data(), rstd->typed_data(), stream);
  return ffi_checks::launcher_result(op, err);
}

ffi::Error AddRmsNormBackwardCuda(cudaStream_t stream, ffi::AnyBuffer dn, ffi::AnyBuffer ds,
                                  ffi::AnyBuffer sum, F32 rstd, F32 scale,
                                  ffi::Result<ffi::AnyBuffer> d, ffi::Result<F32> partials) {
  constexpr const char* op = "mok_add_rms_norm_bwd (CUDA)";
  DType dt;
  int64_t rows, dim;
  MOK_RETURN_IF_ERROR(row_shape(op, sum, &dt, &rows, &dim));
  for (auto [name, buf] : {std::pair<const char*, const ffi::AnyBuffer*>{"dn", &dn},
                           {"ds", &ds}, {"d", &*d}}) {
    MOK_RETURN_IF_ERROR(expect_shape(op, name, *buf, {rows, dim}));
    MOK_RETURN_IF_ERROR(expect_dtype(op, name, *buf, dt));
  }
  MOK_RETURN_IF_ERROR(expect_shape(op, "rstd", rstd, {rows}));
  MOK_RETURN_IF_ERROR(expect_shape(op, "scale", scale, {dim}));
  const int64_t groups = (rows + cuda::kNormRowsPerGroup - 1) / cuda::kNormRowsPerGroup;
  MOK_RETURN_IF_ERROR(expect_shape(op, "dscale_partials", *partials, {groups, dim}));
  std::string err = cuda::add_rms_norm_backward(
      dt, dn.untyped_data(), ds.untyped_data(), sum.untyped_data(), rstd.typed_data(),
      scale.typed_data(), rows, dim, d->untyped_data(), partials->typed_data(), stream);
  return ffi_checks::launcher_result(op, err);
}

}  // namespace
}  // namespace mok

XLA_FFI_DEFINE_HANDLER_SYMBOL(MokAddRmsNormForwardCuda, mok::AddRmsNormForwardCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()          // x [R, D]
                                  .Arg<xla::ffi::AnyBuffer>()          // branch [R, D]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // scale [D]
                                  .Attr<float>("epsilon")
                                  .Ret<xla::ffi::AnyBuffer>()          // sum [R, D]
                                  .Ret<xla::ffi::AnyBuffer>()          // out [R, D]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // rstd [R]

XLA_FFI_DEFINE_HANDLER_SYMBOL(MokAddRmsNormBackwardCuda, mok::AddRmsNormBackwardCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()          // dn [R, D]
                                  .Arg<xla::ffi::AnyBuffer>()          // ds [R, D]
                                  .Arg<xla::ffi::AnyBuffer>()          // sum [R, D]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // rstd [R]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // scale [D]
                                  .Ret<xla::ffi::AnyBuffer>()          // d [R, D]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // partials [G, D]
