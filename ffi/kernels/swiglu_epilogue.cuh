// Forward GEMM1 with SwiGLU in its epilogue: rows [M, H] @ W_e [H, 2F] gives the
// gate and up projections in f32 accumulators, and the epilogue writes
//   h[r, f]        = round(silu(g) * u)        (f32 arithmetic, as the contract says)
//   gate_up[r, f]  = round(g),  gate_up[r, F + f] = round(u)   (the saved residual)
// straight from the registers: the [R, 2F] f32 tensor that a separate SwiGLU
// pass would write and read back never exists.
//
// Pairing: the weight is first copied to a block-interleaved layout (columns
// [256b, 256b+128) are gate columns [128b, 128b+128) and [256b+128, 256b+256)
// the matching up columns), so one output tile 256 columns wide (128x256 in the
// cooperative instance, 64x256 per warp group in the ping-pong one) holds both
// halves of 128 outputs. In the warp group's accumulator fragment (per thread: two
// adjacent columns x two rows x N/8 column groups, the group index outermost),
// the up value of fragment element i is element i + size/2, same row, column
// + 128; the test suite checks the result bit for bit against the unfused path.
//
// The arithmetic per element is the SwiGLU forward kernel's (moe_elementwise.cu),
// so both paths give the same bits.
#pragma once

#include "cutlass_grouped.cuh"
#include "mok/bf16.h"
#include "swiglu_math.cuh"

namespace mok::cuda::cutlass_grouped {

// The epilogue proper, in CUTLASS's "no shared memory" epilogue interface (see
// cutlass/epilogue/collective/default_epilogue_array.hpp), wrapped below in
// Sm90TmaWarpSpecializedAdapter for the warp-specialized kernels.
class SwigluEpilogue {
 public:
  using DispatchPolicy = cutlass::epilogue::PtrArrayNoSmemWarpSpecialized;
  using EpilogueSchedule = DispatchPolicy;
  // Types the kernel and the device adapter name; only the strides' ranks matter.
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
    const int64_t* expert_begin = nullptr;  // [E + 1]: group l's rows start here
    bf16* h = nullptr;                      // [R, F]
    bf16* gate_up = nullptr;                // [R, 2F] or null (no residual)
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
    return args.h != nullptr && args.ffn % 128 == 0;
  }

  CUTLASS_HOST_DEVICE explicit SwigluEpilogue(Params const& params) : params_(params) {}

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
    static_assert(kBlkN == 256, "one tile = 128 gate + 128 up columns");
    constexpr int kHalf = kBlkN / 2;
    constexpr int kValues = decltype(size(accumulators))::value;
    static_assert(kValues % 4 == 0, "pairs of columns, gate and up halves");

    const int rows = get<0>(problem_shape_mnkl);
    const int m_coord = get<0>(blk_coord_mnkl);
    const int n_coord = get<1>(blk_coord_mnkl);
    const int l_coord = get<3>(blk_coord_mnkl);
    const int64_t row0 = params_.expert_begin[l_coord];
    const int64_t ffn = params_.ffn;

    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor coords = thr_mma.partition_C(
        make_identity_tensor(make_shape(Int<kBlkM>{}, Int<kBlkN>{})));  // tile-local (m, n)
    static_assert(decltype(size(coords))::value == kValues, "one coordinate per accumulator");
    // The pairing the loop below relies on, checked at compile time on the (static)
    // layout of the fragment's coordinates: for every even i < kValues/2, element
    // i + 1 is the next column of the same row and element i + kValues/2 is the up
    // column (n + 128) of the same row.
    using CoordLayout = decltype(coords.layout());
    static_assert(is_static<CoordLayout>::value, "static fragment layout");
    for_each(make_int_sequence<kValues / 2>{}, [](auto i) {
      constexpr auto a = CoordLayout{}(i);
      constexpr auto up = CoordLayout{}(i + Int<kValues / 2>{});
      static_assert(get<0>(up) == get<0>(a) && get<1>(up) == get<1>(a) + kHalf,
                    "element i + size/2 must be column n + 128 of the same row");
      if constexpr (decltype(i)::value % 2 == 0) {
        constexpr auto next = CoordLayout{}(i + Int<1>{});
        static_assert(get<0>(next) == get<0>(a) && get<1>(next) == get<1>(a) + 1,
                      "element i + 1 must be the next column of the same row");
      }
    });

    // The stores: each thread holds, for one row, two adjacent columns of every
    // 8-column group; the four lanes of a quad hold the same row (lane % 4 picks
    // the column pair: the wgmma accumulator layout, which the bitwise test checks).
    // A 4x4 transpose of 32-bit words inside the quad gives each lane 8 adjacent
    // columns of one group, stored as one 16-byte vector: a warp writes 8 rows x 64
    // contiguous bytes per store instead of 8 rows x 16 bytes.
    static_assert(kValues % 32 == 0, "four column groups of both row halves per step");
    for_each(make_int_sequence<kValues / 2>{}, [](auto i) {
      if constexpr (decltype(i)::value % 4 == 0) {
        constexpr auto a = CoordLayout{}(i);
        constexpr auto lower = CoordLayout{}(i + Int<2>{});
        static_assert(get<0>(lower) == get<0>(a) + 8 && get<1>(lower) == get<1>(a),
                      "element i + 2 must be the same column 8 rows down");
        if constexpr (decltype(i)::value + 4 < kValues / 2) {
          constexpr auto next = CoordLayout{}(i + Int<4>{});
          static_assert(get<0>(next) == get<0>(a) && get<1>(next) == get<1>(a) + 8,
                        "element i + 4 must be the next 8-column group of the same row");
        }
      }
    });
    const int quad_lane = thread_idx % 4;  // = lane % 4: thread_idx counts from a warp group's start
    CUTLASS_PRAGMA_UNROLL
    for (int half = 0; half < 2; ++half) {  // rows r and r + 8
      const int m = m_coord * kBlkM + get<0>(coords(2 * half));
      const bool row_ok = m < rows;
      const int64_t row = row0 + m;
      CUTLASS_PRAGMA_UNROLL
      for (int j0 = 0; j0 < kValues / 8; j0 += 4) {  // four 8-column groups: 32 columns
        uint32_t h[4], g[4], u[4];
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < 4; ++k) {
          const int i = 4 * (j0 + k) + 2 * half;
          const float g0 = accumulators(i), g1 = accumulators(i + 1);
          const float u0 = accumulators(i + kValues / 2), u1 = accumulators(i + kValues / 2 + 1);
          h[k] = pack(g0 * sigmoid(g0) * u0, g1 * sigmoid(g1) * u1);
          g[k] = pack(g0, g1);
          u[k] = pack(u0, u1);
        }
        // Every lane shuffles (full warp), whether or not its row is stored.
        quad_transpose(h, quad_lane);
        const int64_t f = int64_t(n_coord) * kHalf + (get<1>(coords(4 * j0)) & ~7) +
                          8 * quad_lane;  // column 0 of group j0 + quad_lane
        if (row_ok) store16(params_.h + row * ffn + f, h);
        if (params_.gate_up != nullptr) {
          quad_transpose(g, quad_lane);
          quad_transpose(u, quad_lane);
          if (row_ok) {
            bf16* gu = params_.gate_up + row * 2 * ffn;
            store16(gu + f, g);
            store16(gu + ffn + f, u);
          }
        }
      }
    }
  }

 private:
  // The rounded steps of swiglu_math.cuh: the SwiGLU forward kernel's sigmoid and
  // the hardware's bf16 pair rounding (the epilogue rounds three values an output).
  CUTLASS_DEVICE static float sigmoid(float g) { return mok::cuda::sigmoid(g); }
  CUTLASS_DEVICE static uint32_t pack(float a, float b) { return mok::cuda::pack_bf16x2(a, b); }
  // One 16-byte store, written as PTX: nvcc compiled a uint4 store here (plain or
  // through memcpy) to four 4-byte stores (tests/test_ptx.py checks the instances'
  // PTX). No "memory" clobber: nothing in the kernel reads h or gate_up, so the
  // compiler may keep scheduling other work around the stores.
  CUTLASS_DEVICE static void store16(bf16* p, const uint32_t (&w)[4]) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w[0]), "r"(w[1]),
                 "r"(w[2]), "r"(w[3]));
  }
  // On entry lane q of each quad holds row q of a 4x4 matrix of words, M[q][0..3];
  // on exit it holds column q: w[s] = M[s][q]. Two butterfly stages (lane ^ 2, then
  // lane ^ 1), two shuffles each.
  CUTLASS_DEVICE static void quad_transpose(uint32_t (&w)[4], int q) {
    const bool b1 = q & 2, b0 = q & 1;
    // Stage 1: keep the columns whose bit 1 is q's, send the other two to lane q ^ 2.
    const uint32_t keep0 = b1 ? w[2] : w[0], keep1 = b1 ? w[3] : w[1];
    const uint32_t send0 = b1 ? w[0] : w[2], send1 = b1 ? w[1] : w[3];
    const uint32_t recv0 = __shfl_xor_sync(0xffffffffu, send0, 2);
    const uint32_t recv1 = __shfl_xor_sync(0xffffffffu, send1, 2);
    // t[x][c]: row (q with bit 1 = x), column (2 * bit1(q) + c).
    uint32_t t00 = b1 ? recv0 : keep0, t01 = b1 ? recv1 : keep1;
    uint32_t t10 = b1 ? keep0 : recv0, t11 = b1 ? keep1 : recv1;
    // Stage 2: keep column bit 0 == bit0(q), send the other to lane q ^ 1.
    const uint32_t s0 = b0 ? t00 : t01, s1 = b0 ? t10 : t11;
    const uint32_t r0 = __shfl_xor_sync(0xffffffffu, s0, 1);
    const uint32_t r1 = __shfl_xor_sync(0xffffffffu, s1, 1);
    const uint32_t k0 = b0 ? t01 : t00, k1 = b0 ? t11 : t10;
    // Row s = 2 * x + y of the result: y == bit0(q) kept, the other received.
    w[0] = b0 ? r0 : k0;
    w[1] = b0 ? k0 : r0;
    w[2] = b0 ? r1 : k1;
    w[3] = b0 ? k1 : r1;
  }

  Params params_;
};

// CUTLASS's cooperative schedule: the two consumer warp groups share a 128x256 tile.
struct SwigluGemm {
  using ElementAB = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::RowMajor;
  using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;
  using ClusterShape = Sm90ClusterShape;
  using KernelSchedule = Sm90KernelSchedule;

  using CollectiveEpilogue =
      cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<SwigluEpilogue>;
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
