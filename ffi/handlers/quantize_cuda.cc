// XLA FFI handler of mok_quantize_rows_fp8 on CUDA: the row quantizer of the fp8
// recipe's kernels (kernels/fp8_quant.h), plain 128-blocks along K, scales
// row-major: the same operands and bits as the CPU handler.
#include "handlers/quantize_cuda.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "checks.h"
#include "kernels/fp8_quant.h"
#include "signatures.h"

namespace mok {
namespace {

namespace ffi = xla::ffi;

ffi::Error QuantizeRowsFp8Cuda(cudaStream_t stream, ffi::AnyBuffer x,
                               ffi::Result<ffi::AnyBuffer> q,
                               ffi::Result<ffi::Buffer<ffi::F32>> scales) {
  constexpr const char* op = "mok_quantize_rows_fp8 (CUDA)";
  if (x.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument(std::string(op) + ": x must be rank 2, got " +
                                       ffi_checks::dims_str(x.dimensions()));
  }
  auto dt = ffi_checks::to_mok_dtype(x.element_type());
  if (!dt) return ffi::Error::InvalidArgument(std::string(op) + ": x must be f32 or bf16");
  const int64_t n = x.dimensions()[0], k = x.dimensions()[1];
  const int64_t blocks = cuda::fp8_blocks(k);
  MOK_RETURN_IF_ERROR(ffi_checks::expect_shape(op, "q", *q, {n, k}));
  if (q->element_type() != ffi::DataType::F8E4M3FN) {
    return ffi::Error::InvalidArgument(std::string(op) + ": q must be float8_e4m3fn");
  }
  MOK_RETURN_IF_ERROR(ffi_checks::expect_shape(op, "scales", *scales, {n, blocks}));
  cuda::RowQuant p{};
  p.src_dtype = *dt;
  p.src = x.untyped_data();
  p.rows = n;
  p.halves = 1;
  p.half = k;
  p.num_rows = nullptr;
  p.q = static_cast<uint8_t*>(q->untyped_data());
  p.out_half = k;  // no padding
  p.out_row_stride = k;
  p.scales = scales->typed_data();
  p.scale_row_stride = blocks;
  return ffi_checks::launcher_result(op, cuda::quantize_rows_fp8(p, stream));
}

}  // namespace
}  // namespace mok

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MokQuantizeRowsFp8Cuda, mok::QuantizeRowsFp8Cuda,
    mok::signatures::quantize_rows_fp8(
        xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()));
