// fp8 instance: rows @ W_e^T -> f32 (forward GEMM1, the dgrad of GEMM2).
#include "cutlass_fp8_grouped.cuh"

namespace mok::cuda::fp8_grouped {
size_t rows_f32_workspace_bytes(int64_t experts, int device, int sm_count) {
  return workspace_bytes<Family::kRows, float>(experts, device, sm_count);
}
std::string rows_f32_run(const RowsOperands& op, int device, int sm_count, void* ws,
                         size_t ws_bytes, cudaStream_t stream) {
  return run<Family::kRows, float>(op, op.experts, device, sm_count, ws, ws_bytes, stream);
}
}  // namespace mok::cuda::fp8_grouped
