// Hopper grouped GEMM (TMA + wgmma, warp-specialized, persistent) from CUTLASS
// building blocks, for the experts' row blocks. One template, instantiated per
// operand layout in its own .cu file (they compile in parallel).
//
// Problem shapes and operand pointers are written on the device by a setup
// kernel from the routing plan's expert_begin, so nothing waits for the host.
// Each output tile is reduced by one CTA over K in order (no split-K): the
// result is deterministic.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "cutlass_run.cuh"
#include "gemm_tc.h"
#include "workspace.h"

namespace mok::cuda::cutlass_grouped {

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
using ShapeMNK = ProblemShape::UnderlyingProblemShape;

// Operand roles of the three GEMM families of the MoE layer.
enum class Family {
  kRowsByWeight,   // A rows [M, K] row-major, B [K, N] row-major      (forward)
  kRowsByWeightT,  // A rows [M, K] row-major, B [N, K] row-major as B^T (dgrad)
  kWeightGrad,     // A [K, M] row-major as A^T, B [K, N] row-major    (wgrad)
};

// The TMA + wgmma main loop of every grouped GEMM here: bf16 operands, f32
// accumulators, as many stages as shared memory holds beside the epilogue's.
// A and B rows are 16-byte aligned (8 bf16) for TMA.
constexpr int kAlignAB = 8;

template <class LayoutA, class LayoutB, class TileShape, class ClusterShape,
          class KernelSchedule, int kEpilogueSmemBytes>
using Sm90Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cutlass::bfloat16_t, LayoutA*,
    kAlignAB, cutlass::bfloat16_t, LayoutB*, kAlignAB, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<kEpilogueSmemBytes>,
    KernelSchedule>::CollectiveOp;

// Every instance runs CUTLASS's cooperative schedule (two consumer warp groups
// share a 128x256 tile) on a cluster of two CTAs along M, which share the B tiles
// through TMA multicast. (Ping-pong instances and 128x128 weight-gradient tiles
// were measured no faster: docs/ledger.md.)
using Sm90KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
using Sm90ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;

template <Family kFamily, class ElementD>
struct GroupedGemm {
  using ElementAB = cutlass::bfloat16_t;
  using LayoutA = std::conditional_t<kFamily == Family::kWeightGrad,
                                     cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using LayoutB = std::conditional_t<kFamily == Family::kRowsByWeightT,
                                     cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;

  using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;
  using ClusterShape = Sm90ClusterShape;
  using KernelSchedule = Sm90KernelSchedule;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD*, kAlignD,      // no C operand: D = acc
      ElementD, LayoutD*, kAlignD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;

  using CollectiveMainloop =
      Sm90Mainloop<LayoutA, LayoutB, TileShape, ClusterShape, KernelSchedule,
                   static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>;

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
  typename G::Device::EpilogueOutputOp::ElementOutput** ptr_d;
  typename G::StrideA* stride_a;
  typename G::StrideB* stride_b;
  typename G::StrideD* stride_d;
};

}  // namespace mok::cuda::cutlass_grouped

namespace mok::cuda::cutlass_grouped {


// Groups of one launch: E, or 2E with a second weight-gradient problem.
__host__ __device__ inline int64_t groups(const Operands& op) {
  return op.d2 != nullptr ? 2 * op.experts : op.experts;
}

// The expert of `group`: groups 0..E-1 are the first problem's experts, E..2E-1
// the second's (weight gradient with d2 set).
__host__ __device__ inline int64_t expert_of(const Operands& op, int64_t group) {
  return group >= op.experts ? group - op.experts : group;
}

template <Family kFamily, class ElementD>
__global__ void setup_groups(GroupArrays<GroupedGemm<kFamily, ElementD>> g, Operands op) {
  using G = GroupedGemm<kFamily, ElementD>;
  const int64_t group = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (group >= groups(op)) return;
  const bool second = group >= op.experts;
  const int64_t e = expert_of(op, group);
  const int64_t begin = op.expert_begin[e];
  const int rows = static_cast<int>(op.expert_begin[e + 1] - begin);
  const auto* a = static_cast<const typename G::ElementAB*>(second ? op.a2 : op.a);
  const auto* b = static_cast<const typename G::ElementAB*>(second ? op.b2 : op.b);
  auto* d = static_cast<ElementD*>(second ? op.d2 : op.d);
  const int n = static_cast<int>(second ? op.n2 : op.n);
  if constexpr (kFamily == Family::kWeightGrad) {
    const int m = static_cast<int>(second ? op.m2 : op.k_or_m);
    // The group's place in the launch. CUTLASS's persistent scheduler numbers the
    // tiles group after group and CTA c takes tiles c, c + grid, c + 2 grid, ...;
    // here every tile of a group is as long as the group's rows (its K), so a
    // busy expert's tiles are the long ones. So the groups go in order of
    // rows, most first (ties in group order, so even routing keeps
    // expert order): the long tiles are the first round's, so no CTA gets two
    // of them while they number at most one per CTA (in expert order, two
    // problems' long tiles of one busy expert can meet on the same CTAs). Only
    // the schedule changes: every tile is still reduced over its rows by one
    // CTA, in order.
    int64_t slot = 0;
    for (int64_t other = 0; other < groups(op); ++other) {
      const int64_t oe = expert_of(op, other);
      const int64_t other_rows = op.expert_begin[oe + 1] - op.expert_begin[oe];
      slot += other_rows > rows || (other_rows == rows && other < group);
    }
    // An expert without rows gets no tiles (M = 0); the caller zeroes its D.
    g.shapes[slot] = ShapeMNK{rows > 0 ? m : 0, n, rows};
    g.ptr_a[slot] = a + begin * m;
    g.ptr_b[slot] = b + begin * n;
    g.ptr_d[slot] = d + e * int64_t(m) * n;
    g.stride_a[slot] = cutlass::make_cute_packed_stride(typename G::StrideA{}, {m, rows, 1});
    g.stride_b[slot] = cutlass::make_cute_packed_stride(typename G::StrideB{}, {n, rows, 1});
    g.stride_d[slot] = cutlass::make_cute_packed_stride(typename G::StrideD{}, {m, n, 1});
  } else {
    const int k = static_cast<int>(op.k_or_m);
    g.shapes[e] = ShapeMNK{rows, n, k};
    g.ptr_a[e] = a + begin * k;
    g.ptr_b[e] = b + e * int64_t(k) * n;
    g.ptr_d[e] = d + begin * n;
    g.stride_a[e] = cutlass::make_cute_packed_stride(typename G::StrideA{}, {rows, k, 1});
    g.stride_b[e] = cutlass::make_cute_packed_stride(typename G::StrideB{}, {n, k, 1});
    g.stride_d[e] = cutlass::make_cute_packed_stride(typename G::StrideD{}, {rows, n, 1});
  }
}

// Carves the group arrays from `ws`; returns the bytes they take.
template <class G>
size_t carve(void* ws, int64_t experts, GroupArrays<G>* out) {
  Carver c(ws);
  const size_t e = static_cast<size_t>(experts);
  out->shapes = static_cast<ShapeMNK*>(c.take(e * sizeof(ShapeMNK)));
  out->ptr_a = static_cast<decltype(out->ptr_a)>(c.take(e * sizeof(void*)));
  out->ptr_b = static_cast<decltype(out->ptr_b)>(c.take(e * sizeof(void*)));
  out->ptr_d = static_cast<decltype(out->ptr_d)>(c.take(e * sizeof(void*)));
  out->stride_a = static_cast<typename G::StrideA*>(c.take(e * sizeof(typename G::StrideA)));
  out->stride_b = static_cast<typename G::StrideB*>(c.take(e * sizeof(typename G::StrideB)));
  out->stride_d = static_cast<typename G::StrideD*>(c.take(e * sizeof(typename G::StrideD)));
  return c.used();
}

template <class G>
typename G::Device::Arguments make_arguments(const GroupArrays<G>& g, int64_t experts,
                                             int device, int sm_count) {
  typename G::Device::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {static_cast<int>(experts), g.shapes, nullptr};
  args.mainloop.ptr_A = g.ptr_a;
  args.mainloop.dA = g.stride_a;
  args.mainloop.ptr_B = g.ptr_b;
  args.mainloop.dB = g.stride_b;
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
size_t workspace_bytes(int64_t experts, int device, int sm_count) {
  using G = GroupedGemm<kFamily, ElementD>;
  GroupArrays<G> g{};
  const size_t arrays = carve<G>(nullptr, experts, &g);
  auto args = make_arguments<G>(g, experts, device, sm_count);
  return arrays + workspace_aligned(G::Device::get_workspace_size(args));
}

template <Family kFamily, class ElementD>
std::string run(const Operands& op, int device, int sm_count, void* ws, size_t ws_bytes,
                cudaStream_t stream) {
  using G = GroupedGemm<kFamily, ElementD>;
  if (op.d2 != nullptr && kFamily != Family::kWeightGrad) {
    return "grouped GEMM: a second problem is for weight gradients only";
  }
  const int64_t n_groups = groups(op);
  GroupArrays<G> g{};
  const size_t arrays = carve<G>(ws, n_groups, &g);
  auto args = make_arguments<G>(g, n_groups, device, sm_count);
  const size_t need = arrays + workspace_aligned(G::Device::get_workspace_size(args));
  if (need > ws_bytes) return "grouped GEMM workspace too small";
  constexpr int kThreads = 128;
  setup_groups<kFamily, ElementD><<<(n_groups + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
      g, op);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return std::string("grouped GEMM setup launch: ") + cudaGetErrorString(err);
  }
  return initialize_and_run<typename G::Device>(args, static_cast<char*>(ws) + arrays, stream,
                                                "grouped GEMM");
}

}  // namespace mok::cuda::cutlass_grouped

// Defines one instance's entry points (declared in gemm_tc.h).
#define MOK_GROUPED_GEMM_DEFINE(NAME, FAMILY, ELEMENT_D)                                   \
  namespace mok::cuda::cutlass_grouped {                                                   \
  size_t NAME##_workspace_bytes(int64_t experts, int device, int sm_count) {                \
    return workspace_bytes<FAMILY, ELEMENT_D>(experts, device, sm_count);                   \
  }                                                                                        \
  std::string NAME##_run(const Operands& op, int device, int sm_count, void* ws,            \
                         size_t ws_bytes, cudaStream_t stream) {                            \
    return run<FAMILY, ELEMENT_D>(op, device, sm_count, ws, ws_bytes, stream);              \
  }                                                                                        \
  }
