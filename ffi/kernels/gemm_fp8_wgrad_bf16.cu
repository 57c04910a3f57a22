// fp8 instance: weight gradients over each expert's padded rows (ragged K) -> bf16.
#include "cutlass_fp8_grouped.cuh"

namespace mok::cuda::fp8_grouped {
size_t wgrad_bf16_workspace_bytes(int64_t groups, int device, int sm_count) {
  return workspace_bytes<Family::kWeightGrad, cutlass::bfloat16_t>(groups, device, sm_count);
}
std::string wgrad_bf16_run(const WgradOperands& op, int device, int sm_count, void* ws,
                           size_t ws_bytes, cudaStream_t stream) {
  const int64_t groups = op.d2 != nullptr ? 2 * op.experts : op.experts;
  return run<Family::kWeightGrad, cutlass::bfloat16_t>(op, groups, device, sm_count, ws, ws_bytes,
                                                       stream);
}
}  // namespace mok::cuda::fp8_grouped
