// fp8 instance: rows @ W_e^T -> bf16 (forward GEMM2, the dgrad of GEMM1).
#include "cutlass_fp8_grouped.cuh"

namespace mok::cuda::fp8_grouped {
size_t rows_bf16_workspace_bytes(int64_t experts, int device, int sm_count) {
  return workspace_bytes<Family::kRows, cutlass::bfloat16_t>(experts, device, sm_count);
}
std::string rows_bf16_run(const RowsOperands& op, int device, int sm_count, void* ws,
                          size_t ws_bytes, cudaStream_t stream) {
  return run<Family::kRows, cutlass::bfloat16_t>(op, op.experts, device, sm_count, ws, ws_bytes,
                                                 stream);
}
}  // namespace mok::cuda::fp8_grouped
