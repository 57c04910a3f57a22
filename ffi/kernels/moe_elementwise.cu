#include "moe_elementwise.h"

#include <algorithm>
#include <tuple>

#include "cuda_check.h"
#include "mok/bf16.h"
#include "swiglu_math.cuh"

namespace mok::cuda {
namespace {

// The built-in type of V elements' bytes, for kernels that only move data.
template <int Bytes> struct RawOf;
template <> struct RawOf<2> { using type = unsigned short; };
template <> struct RawOf<4> { using type = unsigned int; };
template <> struct RawOf<16> { using type = uint4; };


// Elements per thread: 16-byte vectors when the row length allows it.
template <typename T>
int vector_width(int64_t cols) {
  constexpr int v = 16 / sizeof(T);
  return cols % v == 0 ? v : 1;
}

constexpr int kThreads = 256;

// Row kernels: one warp per row, rows strided over a grid of at most kMaxBlocks
// blocks (a block per row left most lanes idle on 1-2 KB rows and made block
// scheduling the limit). Each lane moves kUnroll vectors per step, all loads
// before any store, so that enough bytes are in flight.
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;
constexpr int64_t kMaxBlocks = 4096;

__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }
__device__ __forceinline__ int64_t first_warp() {
  return (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
}
__device__ __forceinline__ int64_t warp_stride() {
  return (int64_t(gridDim.x) * blockDim.x) >> 5;
}

// Loads the kUnroll vectors of `row` that this lane owns from column c0 on (those
// before `cols`; the others are left unset: callers guard their uses the same way).
template <typename X, int V>
__device__ __forceinline__ void load_lane_vectors(const X* row, int64_t c0, int64_t cols,
                                                  Vec<X, V> (&v)[kUnroll]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t c = c0 + u * 32 * V;
    if (c < cols) v[u] = load_vec<X, V>(row + c);
  }
}

template <typename X, int V>
__global__ void __launch_bounds__(kThreads)
gather_rows_kernel(const X* __restrict__ src, const int32_t* __restrict__ row_pair,
                   const int64_t* __restrict__ num_rows, int64_t top_k, int64_t cols,
                   X* __restrict__ dst) {
  // Copied as the built-in type of V elements: copied as Vec<X, V> structs, the
  // compiler stored rows longer than one pass (32 * V * kUnroll elements) one
  // element at a time (8 st.global.u16 for one st.global.v4 in bf16): 4 KB rows
  // were gathered at a fifth of the memory's speed (docs/ledger.md, 0dda46c).
  using Raw = typename RawOf<sizeof(X) * V>::type;
  const int64_t n = *num_rows;
  const int64_t vectors = cols / V;  // V divides cols (vector_width)
  const int lane = lane_id();
  for (int64_t r = first_warp(); r < n; r += warp_stride()) {
    const Raw* s = reinterpret_cast<const Raw*>(src + (row_pair[r] / top_k) * cols);
    Raw* d = reinterpret_cast<Raw*>(dst + r * cols);
    for (int64_t c0 = lane; c0 < vectors; c0 += 32 * kUnroll) {
      Raw v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (c0 + u * 32 < vectors) v[u] = s[c0 + u * 32];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (c0 + u * 32 < vectors) d[c0 + u * 32] = v[u];
      }
    }
  }
}

template <typename X, int V>
__global__ void __launch_bounds__(kThreads)
swiglu_forward_kernel(const float* __restrict__ gate_up, const int64_t* __restrict__ num_rows,
                      int64_t ffn, X* __restrict__ h, X* __restrict__ gate_up_out) {
  constexpr int kU = kUnroll / 2;  // gate and up: two vectors each
  const int64_t n = *num_rows;
  const int lane = lane_id();
  for (int64_t r = first_warp(); r < n; r += warp_stride()) {
    const float* g = gate_up + r * 2 * ffn;
    const float* u = g + ffn;
    for (int64_t f0 = int64_t(lane) * V; f0 < ffn; f0 += 32 * V * kU) {
      Vec<float, V> gv[kU], uv[kU];
#pragma unroll
      for (int j = 0; j < kU; ++j) {
        const int64_t f = f0 + j * 32 * V;
        if (f < ffn) gv[j] = load_vec<float, V>(g + f), uv[j] = load_vec<float, V>(u + f);
      }
#pragma unroll
      for (int j = 0; j < kU; ++j) {
        const int64_t f = f0 + j * 32 * V;
        if (f >= ffn) continue;
        Vec<X, V> out, gx, ux;
#pragma unroll
        for (int i = 0; i < V; ++i) {
          out.v[i] = from_float<X>(gv[j].v[i] * sigmoid(gv[j].v[i]) * uv[j].v[i]);
          gx.v[i] = from_float<X>(gv[j].v[i]);
          ux.v[i] = from_float<X>(uv[j].v[i]);
        }
        store_vec<X, V>(h + r * ffn + f, out);
        if (gate_up_out != nullptr) {
          store_vec<X, V>(gate_up_out + r * 2 * ffn + f, gx);
          store_vec<X, V>(gate_up_out + r * 2 * ffn + ffn + f, ux);
        }
      }
    }
  }
}

// d_weights[p] = <dh_raw row, h row>: each lane sums its elements in order, then
// the lanes' partials are added by warp_sum_fixed.
template <typename X, typename W, int V>
__global__ void __launch_bounds__(kThreads)
swiglu_backward_kernel(const X* __restrict__ gate_up, const float* __restrict__ dh_raw,
                       const W* __restrict__ weights, const int32_t* __restrict__ row_pair,
                       const int64_t* __restrict__ num_rows, int64_t ffn, X* __restrict__ wh_rows,
                       X* __restrict__ d_gate_up, W* __restrict__ d_weights) {
  const int64_t n = *num_rows;
  const int lane = lane_id();
  for (int64_t r = first_warp(); r < n; r += warp_stride()) {
    const int64_t p = row_pair[r];
    const float total = swiglu_backward_row<X, V, kUnroll / 2>(
        gate_up + r * 2 * ffn, dh_raw + r * ffn, to_float(weights[p]), ffn, lane,
        wh_rows + r * ffn, d_gate_up + r * 2 * ffn);
    if (lane == 0) d_weights[p] = from_float<W>(total);
  }
}

template <typename W>
__global__ void zero_unrouted_weights(const int32_t* __restrict__ pair_row, int64_t pairs,
                                      W* __restrict__ d_weights) {
  const int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p < pairs && pair_row[p] < 0) d_weights[p] = from_float<W>(0.0f);
}

// One warp per token; k ascending (the contract's order) for every element.
template <typename X, typename W, int V, bool kWeighted>
__global__ void __launch_bounds__(kThreads)
combine_kernel(const X* __restrict__ rows, const W* __restrict__ weights,
               const int32_t* __restrict__ pair_row, int64_t tokens, int64_t top_k,
               int64_t hidden, X* __restrict__ out) {
  const int lane = lane_id();
  for (int64_t t = first_warp(); t < tokens; t += warp_stride()) {
    for (int64_t c0 = int64_t(lane) * V; c0 < hidden; c0 += 32 * V * kUnroll) {
      float acc[kUnroll][V];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int i = 0; i < V; ++i) acc[u][i] = 0.0f;
      for (int64_t k = 0; k < top_k; ++k) {
        const int64_t p = t * top_k + k;
        const int32_t r = pair_row[p];
        if (r < 0) continue;
        const float w = kWeighted ? to_float(weights[p]) : 1.0f;
        Vec<X, V> v[kUnroll];
        load_lane_vectors<X, V>(rows + int64_t(r) * hidden, c0, hidden, v);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (c0 + u * 32 * V >= hidden) continue;  // v[u] was not loaded
#pragma unroll
          for (int i = 0; i < V; ++i) acc[u][i] += w * to_float(v[u].v[i]);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t c = c0 + u * 32 * V;
        if (c >= hidden) continue;
        Vec<X, V> o;
#pragma unroll
        for (int i = 0; i < V; ++i) o.v[i] = from_float<X>(acc[u][i]);
        store_vec<X, V>(out + t * hidden + c, o);
      }
    }
  }
}

template <typename X>
__global__ void zero_empty_kernel(const int64_t* __restrict__ expert_begin, int64_t per_expert,
                                  X* __restrict__ d) {
  const int64_t e = blockIdx.y;
  if (expert_begin[e + 1] != expert_begin[e]) return;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < per_expert;
       i += int64_t(gridDim.x) * blockDim.x) {
    d[e * per_expert + i] = from_float<X>(0.0f);
  }
}

// One thread per 16-byte vector (8 bf16) of the output.
__global__ void interleave_gate_up_kernel(const uint4* __restrict__ w, int64_t vectors,
                                          int64_t ffn_vecs, uint4* __restrict__ out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= vectors) return;
  constexpr int64_t kBlock = 128 / 8;               // vectors per 128 columns
  const int64_t row = i / (2 * ffn_vecs);           // (e, k)
  const int64_t c = i % (2 * ffn_vecs);             // output vector column
  const int64_t b = c / (2 * kBlock), t = c % (2 * kBlock);
  const int64_t src = t < kBlock ? b * kBlock + t : ffn_vecs + b * kBlock + (t - kBlock);
  out[i] = w[row * 2 * ffn_vecs + src];
}

// Calls fn.template operator()<X>() for the element type.
template <typename Fn>
std::string with_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kF32: return fn.template operator()<float>();
    case DType::kBF16: return fn.template operator()<bf16>();
  }
  return "unsupported element type";
}

// Calls fn.template operator()<X, W>() for the (x, expert_weights) pair of types.
template <typename Fn>
std::string with_dtypes(DType dtype, DType weight_dtype, Fn&& fn) {
  if (dtype == DType::kF32 && weight_dtype == DType::kF32) return fn.template operator()<float, float>();
  if (dtype == DType::kBF16 && weight_dtype == DType::kF32) return fn.template operator()<bf16, float>();
  if (dtype == DType::kBF16 && weight_dtype == DType::kBF16) return fn.template operator()<bf16, bf16>();
  return "unsupported element types";
}

// Blocks for a warp-per-row kernel over at most `rows` rows.
unsigned grid_rows(int64_t rows) {
  const int64_t blocks = (std::max<int64_t>(rows, 0) + kWarps - 1) / kWarps;
  return static_cast<unsigned>(std::min(blocks, kMaxBlocks));
}

}  // namespace

std::string gather_token_rows(DType dtype, const void* src, const int32_t* row_pair,
                              const int64_t* num_rows, int64_t max_rows, int64_t top_k,
                              int64_t cols, void* dst, cudaStream_t stream) {
  if (max_rows == 0 || cols == 0) return {};
  return with_dtype(dtype, [&]<typename X>() -> std::string {
    const X* s = static_cast<const X*>(src);
    X* d = static_cast<X*>(dst);
    if (vector_width<X>(cols) > 1) {
      gather_rows_kernel<X, 16 / sizeof(X)><<<grid_rows(max_rows), kThreads, 0, stream>>>(
          s, row_pair, num_rows, top_k, cols, d);
    } else {
      gather_rows_kernel<X, 1><<<grid_rows(max_rows), kThreads, 0, stream>>>(
          s, row_pair, num_rows, top_k, cols, d);
    }
    MOK_CUDA_RETURN_IF_LAUNCH_FAILED("gather_rows_kernel");
    return {};
  });
}

std::string swiglu_forward(DType dtype, const float* gate_up_f32, const int64_t* num_rows,
                           int64_t max_rows, int64_t ffn, void* h, void* gate_up_out,
                           cudaStream_t stream) {
  if (max_rows == 0) return {};
  return with_dtype(dtype, [&]<typename X>() -> std::string {
    X* out = static_cast<X*>(h);
    X* residual = static_cast<X*>(gate_up_out);
    // f32 input: 4 elements (16 bytes) at a time when F allows it.
    if (ffn % 4 == 0) {
      swiglu_forward_kernel<X, 4><<<grid_rows(max_rows), kThreads, 0, stream>>>(
          gate_up_f32, num_rows, ffn, out, residual);
    } else {
      swiglu_forward_kernel<X, 1><<<grid_rows(max_rows), kThreads, 0, stream>>>(
          gate_up_f32, num_rows, ffn, out, residual);
    }
    MOK_CUDA_RETURN_IF_LAUNCH_FAILED("swiglu_forward_kernel");
    return {};
  });
}

std::string swiglu_backward(DType dtype, DType weight_dtype, const void* gate_up,
                            const float* dh_raw, const void* expert_weights,
                            const int32_t* row_pair, const int32_t* pair_row,
                            const int64_t* num_rows, int64_t max_rows, int64_t pairs,
                            int64_t ffn, void* wh_rows, void* d_gate_up,
                            void* d_expert_weights, cudaStream_t stream) {
  return with_dtypes(dtype, weight_dtype, [&]<typename X, typename W>() -> std::string {
    W* dw = static_cast<W*>(d_expert_weights);
    if (pairs > 0) {
      zero_unrouted_weights<W><<<(pairs + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
          pair_row, pairs, dw);
      MOK_CUDA_RETURN_IF_LAUNCH_FAILED("zero_unrouted_weights");
    }
    if (max_rows == 0) return {};
    auto args = std::make_tuple(static_cast<const X*>(gate_up), dh_raw,
                                static_cast<const W*>(expert_weights), row_pair, num_rows, ffn,
                                static_cast<X*>(wh_rows), static_cast<X*>(d_gate_up), dw);
    // f32 dh_raw is read 4 elements at a time at most.
    if (ffn % 4 == 0) {
      std::apply([&](auto... a) {
        swiglu_backward_kernel<X, W, 4><<<grid_rows(max_rows), kThreads, 0, stream>>>(a...);
      }, args);
    } else {
      std::apply([&](auto... a) {
        swiglu_backward_kernel<X, W, 1><<<grid_rows(max_rows), kThreads, 0, stream>>>(a...);
      }, args);
    }
    MOK_CUDA_RETURN_IF_LAUNCH_FAILED("swiglu_backward_kernel");
    return {};
  });
}

std::string combine_rows(DType dtype, DType weight_dtype, const void* rows,
                         const void* expert_weights, const int32_t* pair_row, int64_t tokens,
                         int64_t top_k, int64_t hidden, void* out, cudaStream_t stream) {
  if (tokens == 0 || hidden == 0) return {};
  return with_dtypes(dtype, weight_dtype, [&]<typename X, typename W>() -> std::string {
    const X* r = static_cast<const X*>(rows);
    const W* w = static_cast<const W*>(expert_weights);
    X* o = static_cast<X*>(out);
    const bool vec = vector_width<X>(hidden) > 1;
    constexpr int kV = 16 / sizeof(X);
    const unsigned grid = grid_rows(tokens);
    if (w != nullptr && vec) {
      combine_kernel<X, W, kV, true><<<grid, kThreads, 0, stream>>>(r, w, pair_row, tokens, top_k, hidden, o);
    } else if (w != nullptr) {
      combine_kernel<X, W, 1, true><<<grid, kThreads, 0, stream>>>(r, w, pair_row, tokens, top_k, hidden, o);
    } else if (vec) {
      combine_kernel<X, W, kV, false><<<grid, kThreads, 0, stream>>>(r, w, pair_row, tokens, top_k, hidden, o);
    } else {
      combine_kernel<X, W, 1, false><<<grid, kThreads, 0, stream>>>(r, w, pair_row, tokens, top_k, hidden, o);
    }
    MOK_CUDA_RETURN_IF_LAUNCH_FAILED("combine_kernel");
    return {};
  });
}

std::string interleave_gate_up(const void* w_gate_up, int64_t experts, int64_t hidden,
                               int64_t ffn, void* out, cudaStream_t stream) {
  if (ffn % 128 != 0) return "interleave_gate_up: F must be a multiple of 128";
  const int64_t vectors = experts * hidden * 2 * ffn / 8;
  if (vectors == 0) return {};
  interleave_gate_up_kernel<<<static_cast<unsigned>((vectors + kThreads - 1) / kThreads), kThreads,
                              0, stream>>>(static_cast<const uint4*>(w_gate_up), vectors, ffn / 8,
                                           static_cast<uint4*>(out));
  MOK_CUDA_RETURN_IF_LAUNCH_FAILED("interleave_gate_up_kernel");
  return {};
}

std::string zero_empty_experts(DType dtype, const int64_t* expert_begin, int64_t experts,
                               int64_t per_expert, void* d, cudaStream_t stream) {
  if (experts == 0 || per_expert == 0) return {};
  return with_dtype(dtype, [&]<typename X>() -> std::string {
    // Few blocks per expert: most experts have rows and their blocks exit at once
    // (1024 per expert made the launch itself cost ~20 us at E = 32).
    const int64_t blocks = std::min<int64_t>((per_expert + kThreads - 1) / kThreads, 32);
    zero_empty_kernel<X><<<dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(experts)),
                           kThreads, 0, stream>>>(expert_begin, per_expert, static_cast<X*>(d));
    MOK_CUDA_RETURN_IF_LAUNCH_FAILED("zero_empty_kernel");
    return {};
  });
}

}  // namespace mok::cuda
