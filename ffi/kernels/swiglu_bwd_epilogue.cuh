// Backward data-gradient GEMM of W_down with SwiGLU's backward in its epilogue:
// rows dy [M, H] @ W_down_e^T [H, F] gives dh in f32 accumulators, and the
// epilogue, per element (swiglu_grad.cuh, the same arithmetic as
// swiglu_backward_kernel), reads the rounded gate/up residual and the row's
// combine weight and writes
//   h_rows[r, f]      = round(silu(g) * u)          (W_down's gradient reads it)
//   d_gate_up[r, f]   = round(w dh u silu'(g)),  d_gate_up[r, F + f] = round(w dh silu(g))
//   dw_chunks[r, c]   = this 256-column tile's part of sum_f dh * h
// so the [R, F] f32 dh that the unfused path writes and reads back never exists.
// swiglu_dw_from_chunks then sums each row's chunks in order: the combine weight's
// gradient has the same bits as the unfused kernel's, which sums in this order.
//
// Fragment layout (checked at compile time below, as in swiglu_epilogue.cuh): per
// thread, element 4j + 2*half + c is column 8j + 2*(lane % 4) + c of row m + 8*half
// of the warp group's 64 rows, j < 32 the tile's 8-column groups. Residual loads
// and result stores move 16 bytes per lane through QuadVectors' quad transpose.
#pragma once

#include "swiglu_epilogue.cuh"
#include "swiglu_grad.cuh"

namespace mok::cuda::cutlass_grouped {

class SwigluBackwardEpilogue {
 public:
  using DispatchPolicy = cutlass::epilogue::PtrArrayNoSmemWarpSpecialized;
  using EpilogueSchedule = DispatchPolicy;
  using ThreadEpilogueOp =
      cutlass::epilogue::thread::LinearCombination<cutlass::bfloat16_t, 1, float, float>;
  using ElementC = cutlass::bfloat16_t;
  using ElementD = cutlass::bfloat16_t;
  using StrideC = cute::Stride<int64_t, cute::_1, cute::_0>*;
  using StrideD = StrideC;
  using InternalStrideC = cute::remove_pointer_t<StrideC>;
  using InternalStrideD = InternalStrideC;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;

  struct SharedStorage {};
  using TensorMapStorage = SharedStorage;

  struct Arguments {
    const int64_t* expert_begin = nullptr;  // [E + 1]
    const bf16* gate_up = nullptr;          // [R, 2F] the forward's rounded residual
    const void* weights = nullptr;          // combine weights, indexed by pair
    bool weights_f32 = true;                // else bf16
    const int32_t* row_pair = nullptr;      // [R] row -> pair
    bf16* h_rows = nullptr;                 // [R, F]
    bf16* d_gate_up = nullptr;              // [R, 2F]
    float* dw_chunks = nullptr;             // [R, F / 256]
    int64_t ffn = 0;                        // F
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args,
                                                  void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&, int) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*,
                                              cudaStream_t, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.gate_up != nullptr && args.weights != nullptr && args.row_pair != nullptr &&
           args.h_rows != nullptr && args.d_gate_up != nullptr && args.dw_chunks != nullptr &&
           args.ffn % 256 == 0;
  }

  CUTLASS_HOST_DEVICE explicit SwigluBackwardEpilogue(Params const& params) : params_(params) {}

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_mnk,
                                 BlockCoordMNKL blk_coord_mnkl,
                                 cute::Tensor<FrgEngine, FrgLayout> const& accumulators,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    static_assert(is_static<FrgLayout>::value, "accumulator layout must be static");
    constexpr int kBlkM = size<0>(BlockShapeMNK{});
    constexpr int kBlkN = size<1>(BlockShapeMNK{});
    static_assert(kBlkN == kSwigluDwChunk, "one tile = one chunk of the d w sum");
    constexpr int kValues = decltype(size(accumulators))::value;
    constexpr int kGroups = kValues / 4;  // 8-column groups per row
    static_assert(kGroups * 8 == kBlkN && kGroups % 4 == 0, "two rows x two columns per group");

    const int rows = get<0>(problem_shape_mnkl);
    const int m_coord = get<0>(blk_coord_mnkl);
    const int n_coord = get<1>(blk_coord_mnkl);
    const int l_coord = get<3>(blk_coord_mnkl);
    const int64_t row0 = params_.expert_begin[l_coord];
    const int64_t ffn = params_.ffn;
    const int64_t chunks = ffn / kBlkN;

    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor coords = thr_mma.partition_C(
        make_identity_tensor(make_shape(Int<kBlkM>{}, Int<kBlkN>{})));
    static_assert(decltype(size(coords))::value == kValues, "one coordinate per accumulator");
    using CoordLayout = decltype(coords.layout());
    static_assert(is_static<CoordLayout>::value, "static fragment layout");
    for_each(make_int_sequence<kValues>{}, [](auto i) {
      if constexpr (decltype(i)::value % 4 == 0) {
        constexpr auto a = CoordLayout{}(i);
        constexpr auto next = CoordLayout{}(i + Int<1>{});
        constexpr auto lower = CoordLayout{}(i + Int<2>{});
        constexpr auto lower_next = CoordLayout{}(i + Int<3>{});
        static_assert(get<0>(next) == get<0>(a) && get<1>(next) == get<1>(a) + 1,
                      "element i + 1 must be the next column of the same row");
        static_assert(get<0>(lower) == get<0>(a) + 8 && get<1>(lower) == get<1>(a),
                      "element i + 2 must be the same column 8 rows down");
        static_assert(get<0>(lower_next) == get<0>(a) + 8 && get<1>(lower_next) == get<1>(a) + 1,
                      "element i + 3 must be the next column 8 rows down");
        if constexpr (decltype(i)::value + 4 < kValues) {
          constexpr auto group = CoordLayout{}(i + Int<4>{});
          static_assert(get<0>(group) == get<0>(a) && get<1>(group) == get<1>(a) + 8,
                        "element i + 4 must be the next 8-column group of the same row");
        }
      }
    });

    const int quad_lane = thread_idx % 4;
    // Rows m and m + 8 (half 0, 1): their pairs' weights first, both loads in flight.
    bool row_ok[2];
    int64_t row[2];
    int32_t pair[2] = {0, 0};
    CUTLASS_PRAGMA_UNROLL
    for (int half = 0; half < 2; ++half) {
      const int m = m_coord * kBlkM + get<0>(coords(2 * half));
      row_ok[half] = m < rows;
      row[half] = row0 + m;
      if (row_ok[half]) pair[half] = params_.row_pair[row[half]];
    }
    float w[2] = {0.0f, 0.0f};
    CUTLASS_PRAGMA_UNROLL
    for (int half = 0; half < 2; ++half) {
      if (row_ok[half]) {
        w[half] = params_.weights_f32
                      ? static_cast<const float*>(params_.weights)[pair[half]]
                      : to_float(static_cast<const bf16*>(params_.weights)[pair[half]]);
      }
    }
    CUTLASS_PRAGMA_UNROLL
    for (int half = 0; half < 2; ++half) {
      const bf16* g_row = params_.gate_up + row[half] * 2 * ffn;
      bf16* h_row = params_.h_rows + row[half] * ffn;
      bf16* dg_row = params_.d_gate_up + row[half] * 2 * ffn;
      // Lane q moves columns [8 (j0 + q), 8 (j0 + q) + 8) of the tile for every j0.
      const int64_t f_lane = int64_t(n_coord) * kBlkN + (get<1>(coords(0)) & ~7) + 8 * quad_lane;
      // The row's whole residual for the tile, every load issued before any is used:
      // one memory latency per row instead of one per 32 columns.
      uint32_t g[kGroups / 4][4], u[kGroups / 4][4];
      CUTLASS_PRAGMA_UNROLL
      for (int b = 0; b < kGroups / 4; ++b) {
        const int64_t f = f_lane + 32 * b;
        if (row_ok[half]) {
          load16(g_row + f, g[b]);
          load16(g_row + ffn + f, u[b]);
        } else {
          CUTLASS_PRAGMA_UNROLL
          for (int k = 0; k < 4; ++k) g[b][k] = 0u, u[b][k] = 0u;
        }
      }
      float part = 0.0f;  // this lane's partial of the row's d w over the tile
      CUTLASS_PRAGMA_UNROLL
      for (int b = 0; b < kGroups / 4; ++b) {  // four 8-column groups: 32 columns
        const int j0 = 4 * b;
        // Every lane shuffles (full warp), whether or not its row is kept.
        QuadVectors::quad_transpose(g[b], quad_lane);  // now: group j0 + k, this lane's pair
        QuadVectors::quad_transpose(u[b], quad_lane);
        uint32_t h[4], dg[4], du[4];
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < 4; ++k) {
          const int i = 4 * (j0 + k) + 2 * half;
          const float dh0 = accumulators(i), dh1 = accumulators(i + 1);
          const SwigluGrad e0 = swiglu_grad(low(g[b][k]), low(u[b][k]), dh0, w[half]);
          const SwigluGrad e1 = swiglu_grad(high(g[b][k]), high(u[b][k]), dh1, w[half]);
          const bf16 h0 = float_to_bf16(e0.h_raw), h1 = float_to_bf16(e1.h_raw);
          part = swiglu_dw_step(part, dh0, to_float(h0));
          part = swiglu_dw_step(part, dh1, to_float(h1));
          h[k] = uint32_t(h0.bits) | (uint32_t(h1.bits) << 16);
          dg[k] = QuadVectors::pack(e0.dgate, e1.dgate);
          du[k] = QuadVectors::pack(e0.dup, e1.dup);
        }
        QuadVectors::quad_transpose(h, quad_lane);
        QuadVectors::quad_transpose(dg, quad_lane);
        QuadVectors::quad_transpose(du, quad_lane);
        if (row_ok[half]) {
          const int64_t f = f_lane + 32 * b;
          QuadVectors::store16(h_row + f, h);
          QuadVectors::store16(dg_row + f, dg);
          QuadVectors::store16(dg_row + ffn + f, du);
        }
      }
      const float chunk = swiglu_dw_quad_sum(part);
      if (row_ok[half] && quad_lane == 0) {
        params_.dw_chunks[row[half] * chunks + n_coord] = chunk;
      }
    }
  }

 private:
  CUTLASS_DEVICE static float low(uint32_t w) { return bits_float(w << 16); }
  CUTLASS_DEVICE static float high(uint32_t w) { return bits_float(w & 0xffff0000u); }
  CUTLASS_DEVICE static void load16(const bf16* p, uint32_t (&w)[4]) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  }

  Params params_;
};

// Operands as the kRowsByWeightT family: A rows [M, H] row-major, B = W_down_e
// [F, H] row-major used transposed. kCooperative: two consumer warp groups share a
// 128x256 tile and the epilogue stops the tensor cores; kPingpong: each warp group
// owns a 64x256 tile, and one group's epilogue (the SwiGLU backward arithmetic and
// the residual's loads) runs while the other's main loop keeps them busy.
template <Schedule kSchedule>
struct SwigluBwdGemm {
  using ElementAB = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  static constexpr bool kPp = kSchedule == Schedule::kPingpong;
  using TileShape = std::conditional_t<kPp, cute::Shape<cute::_64, cute::_256, cute::_64>,
                                       cute::Shape<cute::_128, cute::_256, cute::_64>>;
  using ClusterShape = Sm90ClusterShape;
  using KernelSchedule = Sm90KernelSchedule<kSchedule>;

  using CollectiveEpilogue =
      cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<SwigluBackwardEpilogue>;
  using CollectiveMainloop =
      Sm90Mainloop<LayoutA, LayoutB, TileShape, ClusterShape, KernelSchedule,
                   static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>;
  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
};

}  // namespace mok::cuda::cutlass_grouped
