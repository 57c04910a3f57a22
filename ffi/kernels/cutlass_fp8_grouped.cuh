// Hopper fp8 grouped GEMMs with block scales (TMA + wgmma, warp-specialized,
// cooperative, persistent) from CUTLASS's blockwise-scaling ptr-array main loop:
// e4m3 operands, both K-major, f32 accumulators, and after every 128-deep K block
// the block's partial products are added to the accumulators times sa * sb. One
// template, instantiated per output type and family in its own .cu file.
//
// As in cutlass_grouped.cuh, problem shapes, operand and scale pointers are
// written on the device by a setup kernel (from expert_begin or the padded row
// offsets), and each output tile is reduced by one CTA over K in order (no
// split-K, no stream-K): deterministic.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "cutlass_run.cuh"
#include "gemm_fp8.h"
#include "workspace.h"

namespace mok::cuda::fp8_grouped {

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
using ShapeMNK = ProblemShape::UnderlyingProblemShape;

enum class Family {
  kRows,        // A rows (1x128 scales), B a weight (128x128 scales)
  kWeightGrad,  // A and B transposed rows (1x128 scales along the rows, each)
};

// Scale granularity (M, N, K) per family; CUTLASS's Hopper main loop reads the
// scales M-/N-major (the scale of (m, k block) at m + kb * M, per group).
template <Family kFamily>
using ScaleConfig = std::conditional_t<
    kFamily == Family::kRows, cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128>,
    cutlass::detail::Sm90BlockwiseScaleConfig<1, 1, 128>>;

template <Family kFamily, class ElementD_>
struct Fp8Gemm {
  using ElementAB = cutlass::float_e4m3_t;
  using ElementD = ElementD_;
  using LayoutA = cutlass::layout::RowMajor;     // [M, K], K contiguous
  using LayoutB = cutlass::layout::ColumnMajor;  // [N, K], K contiguous
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 16;  // 16 bytes of e4m3
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;

  using Scales = ScaleConfig<kFamily>;
  using LayoutSFA = decltype(Scales::deduce_layoutSFA());
  using LayoutSFB = decltype(Scales::deduce_layoutSFB());

  // 128x128 tiles, 128 deep (one scale block per K step), as CUTLASS's example 68
  // and DeepGEMM's common configuration; the two consumer warp groups of the
  // cooperative schedule take 64 rows each. No cluster: groups are small in M.
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_128>;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD*, kAlignD,  // no C operand: D = acc
      ElementD, LayoutD*, kAlignD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB,
      cute::tuple<LayoutA*, LayoutSFA*>, kAlignAB, ElementAB, cute::tuple<LayoutB*, LayoutSFB*>,
      kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;

  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};

// Device arrays the grouped kernel reads, carved from the caller's workspace.
template <class G>
struct GroupArrays {
  ShapeMNK* shapes;
  const typename G::ElementAB** ptr_a;
  const typename G::ElementAB** ptr_b;
  const float** ptr_sfa;
  const float** ptr_sfb;
  typename G::ElementD** ptr_d;
  typename G::StrideA* stride_a;
  typename G::StrideB* stride_b;
  typename G::StrideD* stride_d;
  typename G::LayoutSFA* layout_sfa;
  typename G::LayoutSFB* layout_sfb;
};

template <class G>
size_t carve(void* ws, int64_t groups, GroupArrays<G>* out) {
  Carver c(ws);
  const size_t e = static_cast<size_t>(groups);
  out->shapes = static_cast<ShapeMNK*>(c.take(e * sizeof(ShapeMNK)));
  out->ptr_a = static_cast<decltype(out->ptr_a)>(c.take(e * sizeof(void*)));
  out->ptr_b = static_cast<decltype(out->ptr_b)>(c.take(e * sizeof(void*)));
  out->ptr_sfa = static_cast<decltype(out->ptr_sfa)>(c.take(e * sizeof(void*)));
  out->ptr_sfb = static_cast<decltype(out->ptr_sfb)>(c.take(e * sizeof(void*)));
  out->ptr_d = static_cast<decltype(out->ptr_d)>(c.take(e * sizeof(void*)));
  out->stride_a = static_cast<typename G::StrideA*>(c.take(e * sizeof(typename G::StrideA)));
  out->stride_b = static_cast<typename G::StrideB*>(c.take(e * sizeof(typename G::StrideB)));
  out->stride_d = static_cast<typename G::StrideD*>(c.take(e * sizeof(typename G::StrideD)));
  out->layout_sfa =
      static_cast<typename G::LayoutSFA*>(c.take(e * sizeof(typename G::LayoutSFA)));
  out->layout_sfb =
      static_cast<typename G::LayoutSFB*>(c.take(e * sizeof(typename G::LayoutSFB)));
  return c.used();
}

// One group's entries. The kernel derives the scales' layout from the problem
// shape (M-/N-major, as Scales::tile_atom_to_shape_SF*); the layout arrays are
// filled the same way for completeness.
template <class G>
__device__ void write_group(const GroupArrays<G>& g, int64_t slot, int m, int n, int k,
                            const void* a, const float* sfa, const void* b, const float* sfb,
                            void* d) {
  using Element = typename G::ElementAB;
  g.shapes[slot] = ShapeMNK{m, n, k};
  g.ptr_a[slot] = static_cast<const Element*>(a);
  g.ptr_b[slot] = static_cast<const Element*>(b);
  g.ptr_sfa[slot] = sfa;
  g.ptr_sfb[slot] = sfb;
  g.ptr_d[slot] = static_cast<typename G::ElementD*>(d);
  g.stride_a[slot] = cutlass::make_cute_packed_stride(typename G::StrideA{}, {m, k, 1});
  g.stride_b[slot] = cutlass::make_cute_packed_stride(typename G::StrideB{}, {n, k, 1});
  g.stride_d[slot] = cutlass::make_cute_packed_stride(typename G::StrideD{}, {m, n, 1});
  g.layout_sfa[slot] = G::Scales::tile_atom_to_shape_SFA(cute::make_shape(m, n, k, 1));
  g.layout_sfb[slot] = G::Scales::tile_atom_to_shape_SFB(cute::make_shape(m, n, k, 1));
}

// Rows x weight: group e = expert e. A's scales per group M-major: the expert's
// k/128 x rows block of scales starts at begin * (k / 128).
template <class G>
__global__ void setup_rows(GroupArrays<G> g, RowsOperands op) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= op.experts) return;
  const int64_t begin = op.expert_begin[e];
  const int rows = static_cast<int>(op.expert_begin[e + 1] - begin);
  const int n = static_cast<int>(op.n), k = static_cast<int>(op.k);
  const int64_t kb = op.k / 128;
  write_group<G>(g, e, rows, n, k, static_cast<const uint8_t*>(op.a) + begin * op.k,
                 op.sa + begin * kb,
                 static_cast<const uint8_t*>(op.b) + e * op.b_expert_stride,
                 op.sb + e * op.sb_expert_stride,
                 static_cast<typename G::ElementD*>(op.d) + begin * op.n);
}

// Weight gradient: groups 0..E-1 the first problem's experts, E..2E-1 the
// second's; placed in order of rows, most first (as cutlass_grouped.cuh's
// setup_groups: the long tiles are dealt first). K = the expert's padded rows.
template <class G>
__global__ void setup_wgrad(GroupArrays<G> g, WgradOperands op) {
  const int64_t n_groups = op.d2 != nullptr ? 2 * op.experts : op.experts;
  const int64_t group = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (group >= n_groups) return;
  const bool second = group >= op.experts;
  const int64_t e = second ? group - op.experts : group;
  const int64_t pbegin = op.padded_begin[e];
  const int64_t k = op.padded_begin[e + 1] - pbegin;
  int64_t slot = 0;
  for (int64_t other = 0; other < n_groups; ++other) {
    const int64_t oe = other >= op.experts ? other - op.experts : other;
    const int64_t other_k = op.padded_begin[oe + 1] - op.padded_begin[oe];
    slot += other_k > k || (other_k == k && other < group);
  }
  const int64_t m = second ? op.m2 : op.m;
  const int64_t n = second ? op.n2 : op.n;
  const auto* a = static_cast<const uint8_t*>(second ? op.a2 : op.a);
  const auto* b = static_cast<const uint8_t*>(second ? op.b2 : op.b);
  const float* sa = second ? op.sa2 : op.sa;
  const float* sb = second ? op.sb2 : op.sb;
  auto* d = static_cast<typename G::ElementD*>(second ? op.d2 : op.d);
  const int64_t rb = pbegin / 128;
  // An expert without rows gets no tiles (M = 0); the caller zeroes its D.
  write_group<G>(g, slot, k > 0 ? static_cast<int>(m) : 0, static_cast<int>(n),
                 static_cast<int>(k), a + pbegin, sa + rb * m, b + pbegin, sb + rb * n,
                 d + e * m * n);
  // The operands' rows are ld apart, not k: the strides are the transposed
  // matrices' (K-major, leading dimension ld).
  g.stride_a[slot] = cutlass::make_cute_packed_stride(typename G::StrideA{},
                                                      {static_cast<int>(m),
                                                       static_cast<int>(op.ld), 1});
  g.stride_b[slot] = cutlass::make_cute_packed_stride(typename G::StrideB{},
                                                      {static_cast<int>(n),
                                                       static_cast<int>(op.ld), 1});
}

template <class G>
typename G::Device::Arguments make_arguments(const GroupArrays<G>& g, int64_t groups, int device,
                                             int sm_count) {
  typename G::Device::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {static_cast<int>(groups), g.shapes, nullptr};
  args.mainloop.ptr_A = g.ptr_a;
  args.mainloop.dA = g.stride_a;
  args.mainloop.ptr_B = g.ptr_b;
  args.mainloop.dB = g.stride_b;
  args.mainloop.ptr_SFA = g.ptr_sfa;
  args.mainloop.layout_SFA = g.layout_sfa;
  args.mainloop.ptr_SFB = g.ptr_sfb;
  args.mainloop.layout_SFB = g.layout_sfb;
  auto& fusion = args.epilogue.thread;
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;
  fusion.alpha_ptr = nullptr;
  fusion.beta_ptr = nullptr;
  fusion.alpha_ptr_array = nullptr;
  fusion.beta_ptr_array = nullptr;
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = nullptr;
  args.epilogue.ptr_D = g.ptr_d;
  args.epilogue.dD = g.stride_d;
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sm_count;
  return args;
}

template <Family kFamily, class ElementD>
size_t workspace_bytes(int64_t groups, int device, int sm_count) {
  using G = Fp8Gemm<kFamily, ElementD>;
  GroupArrays<G> g{};
  const size_t arrays = carve<G>(nullptr, groups, &g);
  auto args = make_arguments<G>(g, groups, device, sm_count);
  return arrays + workspace_aligned(G::Device::get_workspace_size(args));
}

template <Family kFamily, class ElementD, class Operands>
std::string run(const Operands& op, int64_t groups, int device, int sm_count, void* ws,
                size_t ws_bytes, cudaStream_t stream) {
  using G = Fp8Gemm<kFamily, ElementD>;
  if (groups == 0) return {};
  GroupArrays<G> g{};
  const size_t arrays = carve<G>(ws, groups, &g);
  auto args = make_arguments<G>(g, groups, device, sm_count);
  const size_t need = arrays + workspace_aligned(G::Device::get_workspace_size(args));
  if (need > ws_bytes) return "fp8 grouped GEMM workspace too small";
  constexpr int kThreads = 128;
  const unsigned blocks = static_cast<unsigned>((groups + kThreads - 1) / kThreads);
  if constexpr (kFamily == Family::kRows) {
    setup_rows<G><<<blocks, kThreads, 0, stream>>>(g, op);
  } else {
    setup_wgrad<G><<<blocks, kThreads, 0, stream>>>(g, op);
  }
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return std::string("fp8 grouped GEMM setup launch: ") + cudaGetErrorString(err);
  }
  return initialize_and_run<typename G::Device>(args, static_cast<char*>(ws) + arrays, stream,
                                                "fp8 grouped GEMM");
}

}  // namespace mok::cuda::fp8_grouped
