// Forward GEMM1 with SwiGLU in the epilogue (swiglu_epilogue.cuh): host entry points.
#include <algorithm>

#include "swiglu_epilogue.cuh"

namespace mok::cuda::cutlass_grouped {
namespace {

template <class G>
struct SwigluArrays {
  ShapeMNK* shapes;
  const typename G::ElementAB** ptr_a;
  const typename G::ElementAB** ptr_b;
  typename G::StrideA* stride_a;
  typename G::StrideB* stride_b;
};

template <class G>
size_t carve_swiglu(void* ws, int64_t experts, SwigluArrays<G>* out) {
  Carver c(ws);
  const size_t e = static_cast<size_t>(experts);
  out->shapes = static_cast<ShapeMNK*>(c.take(e * sizeof(ShapeMNK)));
  out->ptr_a = static_cast<const typename G::ElementAB**>(c.take(e * sizeof(void*)));
  out->ptr_b = static_cast<const typename G::ElementAB**>(c.take(e * sizeof(void*)));
  out->stride_a = static_cast<typename G::StrideA*>(c.take(e * sizeof(typename G::StrideA)));
  out->stride_b = static_cast<typename G::StrideB*>(c.take(e * sizeof(typename G::StrideB)));
  return c.used();
}

template <class G>
__global__ void setup_swiglu_groups(SwigluArrays<G> g, SwigluOperands op) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= op.experts) return;
  const int64_t begin = op.expert_begin[e];
  const int rows = static_cast<int>(op.expert_begin[e + 1] - begin);
  const int k = static_cast<int>(op.k);
  const int n = static_cast<int>(2 * op.ffn);
  g.shapes[e] = ShapeMNK{rows, n, k};
  g.ptr_a[e] = static_cast<const typename G::ElementAB*>(op.a) + begin * k;
  g.ptr_b[e] = static_cast<const typename G::ElementAB*>(op.b_interleaved) + e * int64_t(k) * n;
  g.stride_a[e] = cutlass::make_cute_packed_stride(typename G::StrideA{}, {rows, k, 1});
  g.stride_b[e] = cutlass::make_cute_packed_stride(typename G::StrideB{}, {n, k, 1});
}

template <class G>
typename G::Device::Arguments make_swiglu_arguments(const SwigluArrays<G>& g,
                                                    const SwigluOperands& op, int device,
                                                    int sm_count) {
  typename G::Device::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {static_cast<int>(op.experts), g.shapes, nullptr};
  args.mainloop.ptr_A = g.ptr_a;
  args.mainloop.dA = g.stride_a;
  args.mainloop.ptr_B = g.ptr_b;
  args.mainloop.dB = g.stride_b;
  args.epilogue.expert_begin = op.expert_begin;
  args.epilogue.h = static_cast<bf16*>(op.h);
  args.epilogue.gate_up = static_cast<bf16*>(op.gate_up);
  args.epilogue.ffn = op.ffn;
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sm_count;
  return args;
}

template <class G>
size_t workspace_bytes(int64_t experts, int device, int sm_count) {
  SwigluArrays<G> g{};
  const size_t arrays = carve_swiglu(nullptr, experts, &g);
  SwigluOperands op{};
  op.experts = experts;
  op.ffn = 128;
  auto args = make_swiglu_arguments(g, op, device, sm_count);
  return arrays + workspace_aligned(G::Device::get_workspace_size(args));
}

template <class G>
std::string run(const SwigluOperands& op, int device, int sm_count, void* ws, size_t ws_bytes,
                cudaStream_t stream) {
  SwigluArrays<G> g{};
  const size_t arrays = carve_swiglu(ws, op.experts, &g);
  auto args = make_swiglu_arguments(g, op, device, sm_count);
  const size_t need = arrays + workspace_aligned(G::Device::get_workspace_size(args));
  if (need > ws_bytes) return "SwiGLU grouped GEMM workspace too small";
  constexpr int kThreads = 128;
  setup_swiglu_groups<G><<<(op.experts + kThreads - 1) / kThreads, kThreads, 0, stream>>>(g, op);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return std::string("SwiGLU grouped GEMM setup launch: ") + cudaGetErrorString(err);
  }
  if (cutlass::Status status = G::Device::can_implement(args);
      status != cutlass::Status::kSuccess) {
    return std::string("SwiGLU grouped GEMM: cannot implement: ") + cutlassGetStatusString(status);
  }
  return initialize_and_run<typename G::Device>(args, static_cast<char*>(ws) + arrays, stream,
                                                "SwiGLU grouped GEMM");
}


}  // namespace

size_t rows_swiglu_workspace_bytes(int64_t experts, int device, int sm_count) {
  return workspace_bytes<SwigluGemm>(experts, device, sm_count);
}

std::string rows_swiglu_run(const SwigluOperands& op, int device, int sm_count, void* ws,
                            size_t ws_bytes, cudaStream_t stream) {
  return run<SwigluGemm>(op, device, sm_count, ws, ws_bytes, stream);
}

}  // namespace mok::cuda::cutlass_grouped
