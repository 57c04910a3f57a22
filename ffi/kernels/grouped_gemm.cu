// Chooses the tensor-core or the SIMT path for each grouped GEMM.
#include "grouped_gemm.h"

#include <algorithm>
#include <atomic>

#include "cuda_check.h"
#include "device_info.h"
#include "gemm_simt.cuh"
#include "gemm_tc.h"
#include "moe_elementwise.h"
#include "mok/swiglu_rule.h"

namespace mok::cuda {
namespace {

namespace tc = cutlass_grouped;

// The sm_90a kernels run on compute capability 9.0 exactly.
bool tensor_core_device(int cc) {
#ifdef MOK_HAVE_SM90A
  return cc == 90;
#else
  (void)cc;
  return false;
#endif
}

// Whether GEMM1 may run with SwiGLU in its epilogue (see set_swiglu_epilogue).
std::atomic<bool> swiglu_epilogue_enabled{true};

}  // namespace

bool rows_gemm_uses_tensor_cores(const RowsGemm& p, int cc) {
  if (!tensor_core_device(cc) || p.ab_dtype != DType::kBF16) return false;
  // 16-byte rows for TMA; an empty reduction (k = 0) would leave CUTLASS's
  // accumulators uninitialised, the SIMT kernel writes zeros.
  if (p.n % 8 != 0 || p.k % 8 != 0 || p.k == 0 || p.n == 0) return false;
  return true;  // every family has bf16 and f32 D instances
}

bool weight_grad_uses_tensor_cores(const WeightGradGemm& p, int cc) {
  return tensor_core_device(cc) && p.dtype == DType::kBF16 && p.m % 8 == 0 && p.n % 8 == 0 &&
         p.m > 0 && p.n > 0;
}

size_t grouped_gemm_workspace_bytes(int64_t experts) {
#ifdef MOK_HAVE_SM90A
  DeviceInfo info;
  if (!current_device_info(&info).empty() || !tensor_core_device(info.cc)) return 0;
  return std::max({tc::rows_bf16_workspace_bytes(experts, info.device, info.sm_count),
                   tc::rows_f32_workspace_bytes(experts, info.device, info.sm_count),
                   tc::rows_t_bf16_workspace_bytes(experts, info.device, info.sm_count),
                   tc::rows_t_f32_workspace_bytes(experts, info.device, info.sm_count),
                   tc::rows_swiglu_workspace_bytes(experts, info.device, info.sm_count),
                   // run_weight_grad_gemms: two problems' groups in one launch
                   tc::wgrad_bf16_workspace_bytes(2 * experts, info.device, info.sm_count)});
#else
  (void)experts;
  return 0;
#endif
}

std::string run_rows_gemm(const RowsGemm& p, const int64_t* simt_tile_begin, void* workspace,
                          size_t workspace_bytes, cudaStream_t stream) {
  DeviceInfo info;
  MOK_RETURN_IF_MESSAGE(current_device_info(&info));
  if (!rows_gemm_uses_tensor_cores(p, info.cc) || p.max_rows == 0 || p.n == 0) {
    return run_rows_gemm_simt(p, simt_tile_begin, stream);
  }
#ifdef MOK_HAVE_SM90A
  const tc::Operands op{p.experts, p.expert_begin, p.n, p.k, p.a, p.b, p.d};
  const int dev = info.device, sms = info.sm_count;
  if (!p.transpose_b) {
    return p.d_dtype == DType::kF32 ? tc::rows_f32_run(op, dev, sms, workspace, workspace_bytes, stream)
                                    : tc::rows_bf16_run(op, dev, sms, workspace, workspace_bytes, stream);
  }
  return p.d_dtype == DType::kF32 ? tc::rows_t_f32_run(op, dev, sms, workspace, workspace_bytes, stream)
                                  : tc::rows_t_bf16_run(op, dev, sms, workspace, workspace_bytes, stream);
#else
  return "unreachable: tensor-core path without sm_90a kernels";
#endif
}

size_t swiglu_interleave_bytes(int64_t experts, int64_t hidden, int64_t ffn, int64_t rows) {
  if (!swiglu_epilogue_shape(experts, hidden, ffn, rows)) return 0;
  return static_cast<size_t>(experts * hidden * 2 * ffn) * 2;  // bf16
}

bool set_swiglu_epilogue(bool enabled) {
  return swiglu_epilogue_enabled.exchange(enabled);
}

std::string run_swiglu_gemm(const SwigluGemm& p, void* interleaved, void* workspace,
                            size_t workspace_bytes, cudaStream_t stream, bool* ran) {
  *ran = false;
  if (!swiglu_epilogue_enabled.load(std::memory_order_relaxed)) return {};
  if (p.dtype != DType::kBF16 || !swiglu_epilogue_shape(p.experts, p.hidden, p.ffn, p.max_rows)) {
    return {};
  }
  // The epilogue stores 16-byte vectors (F % 128 == 0 keeps rows aligned; the bases
  // must be too): otherwise the unfused path runs.
  if (!aligned16(p.h) || (p.gate_up_out != nullptr && !aligned16(p.gate_up_out))) return {};
  DeviceInfo info;
  MOK_RETURN_IF_MESSAGE(current_device_info(&info));
  if (!tensor_core_device(info.cc)) return {};
#ifdef MOK_HAVE_SM90A
  MOK_RETURN_IF_MESSAGE(
      interleave_gate_up(p.w_gate_up, p.experts, p.hidden, p.ffn, interleaved, stream));
  const tc::SwigluOperands op{p.experts, p.expert_begin, p.hidden, p.ffn,
                              p.x_rows,  interleaved,    p.h,      p.gate_up_out};
  MOK_RETURN_IF_MESSAGE(
      tc::rows_swiglu_run(op, info.device, info.sm_count, workspace, workspace_bytes, stream));
  *ran = true;
  return {};
#else
  (void)interleaved, (void)workspace, (void)workspace_bytes, (void)stream;
  return {};
#endif
}

std::string run_weight_grad_gemm(const WeightGradGemm& p, void* workspace,
                                 size_t workspace_bytes, cudaStream_t stream) {
  DeviceInfo info;
  MOK_RETURN_IF_MESSAGE(current_device_info(&info));
  if (!weight_grad_uses_tensor_cores(p, info.cc) || p.m == 0 || p.n == 0) {
    return run_weight_grad_gemm_simt(p, stream);
  }
#ifdef MOK_HAVE_SM90A
  const tc::Operands op{p.experts, p.expert_begin, p.n, p.m, p.a, p.b, p.d};
  MOK_RETURN_IF_MESSAGE(
      tc::wgrad_bf16_run(op, info.device, info.sm_count, workspace, workspace_bytes, stream));
  // The tensor-core kernel gives experts without rows no tiles: zero them here.
  return zero_empty_experts(p.dtype, p.expert_begin, p.experts, p.m * p.n, p.d, stream);
#else
  return "unreachable: tensor-core path without sm_90a kernels";
#endif
}

std::string run_weight_grad_gemms(const WeightGradGemm& p, const WeightGradGemm& q,
                                  void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  DeviceInfo info;
  MOK_RETURN_IF_MESSAGE(current_device_info(&info));
  const bool together = p.experts == q.experts && p.expert_begin == q.expert_begin &&
                        p.dtype == q.dtype && weight_grad_uses_tensor_cores(p, info.cc) &&
                        weight_grad_uses_tensor_cores(q, info.cc);
  if (!together) {
    MOK_RETURN_IF_MESSAGE(run_weight_grad_gemm(p, workspace, workspace_bytes, stream));
    return run_weight_grad_gemm(q, workspace, workspace_bytes, stream);
  }
#ifdef MOK_HAVE_SM90A
  tc::Operands op{p.experts, p.expert_begin, p.n, p.m, p.a, p.b, p.d};
  op.n2 = q.n;
  op.m2 = q.m;
  op.a2 = q.a;
  op.b2 = q.b;
  op.d2 = q.d;
  MOK_RETURN_IF_MESSAGE(
      tc::wgrad_bf16_run(op, info.device, info.sm_count, workspace, workspace_bytes, stream));
  // The tensor-core kernel gives experts without rows no tiles: zero them here.
  MOK_RETURN_IF_MESSAGE(
      zero_empty_experts(p.dtype, p.expert_begin, p.experts, p.m * p.n, p.d, stream));
  return zero_empty_experts(q.dtype, q.expert_begin, q.experts, q.m * q.n, q.d, stream);
#else
  return "unreachable: tensor-core path without sm_90a kernels";
#endif
}

}  // namespace mok::cuda
