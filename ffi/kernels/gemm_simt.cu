#include "gemm_simt.cuh"

#include <algorithm>

#include "cuda_check.h"
#include "mok/bf16.h"
#include "routing.h"

namespace mok::cuda {
namespace {

constexpr int kTileM = static_cast<int>(kSimtTileRows);  // tiles never straddle experts
constexpr int kTileN = 32;
constexpr int kTileK = 16;
constexpr int kRowsPerThread = kTileM / 8;                // block is 32 x 8 threads

template <typename AB, typename D>
__global__ void __launch_bounds__(256)
rows_gemm_simt(const AB* __restrict__ a, const AB* __restrict__ b, D* __restrict__ d,
               const int64_t* __restrict__ expert_begin, const int64_t* __restrict__ tile_begin,
               int64_t experts, int64_t n, int64_t k, bool transpose_b, int64_t tile_bound) {
  __shared__ float as[kTileM][kTileK + 1];
  __shared__ float bs[kTileK][kTileN + 1];
  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * 32 + tx;
  const int64_t n0 = int64_t(blockIdx.x) * kTileN;
  for (int64_t tile = blockIdx.y; tile < tile_bound; tile += gridDim.y) {
    if (tile >= tile_begin[experts]) return;
    int64_t lo = 0, hi = experts - 1;  // last e with tile_begin[e] <= tile
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (tile_begin[mid] <= tile) lo = mid; else hi = mid - 1;
    }
    const int64_t e = lo;
    const int64_t row0 = expert_begin[e] + (tile - tile_begin[e]) * kTileM;
    const int64_t row_end = expert_begin[e + 1];
    const AB* be = b + e * k * n;
    float acc[kRowsPerThread] = {};
    for (int64_t k0 = 0; k0 < k; k0 += kTileK) {
      for (int i = tid; i < kTileM * kTileK; i += 256) {
        const int r = i / kTileK, c = i % kTileK;
        const int64_t row = row0 + r, col = k0 + c;
        as[r][c] = (row < row_end && col < k) ? to_float(a[row * k + col]) : 0.0f;
      }
      for (int i = tid; i < kTileK * kTileN; i += 256) {
        const int r = i / kTileN, c = i % kTileN;
        const int64_t kk = k0 + r, col = n0 + c;
        float v = 0.0f;
        if (kk < k && col < n) v = to_float(transpose_b ? be[col * k + kk] : be[kk * n + col]);
        bs[r][c] = v;
      }
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < kTileK; ++kk) {
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) acc[i] += as[ty + 8 * i][kk] * bs[kk][tx];
      }
      __syncthreads();
    }
    const int64_t col = n0 + tx;
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int64_t row = row0 + ty + 8 * i;
      if (row < row_end && col < n) d[row * n + col] = from_float<D>(acc[i]);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(256)
weight_grad_simt(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ d,
                 const int64_t* __restrict__ expert_begin, int64_t m, int64_t n) {
  __shared__ float as[kTileK][kTileM + 1];
  __shared__ float bs[kTileK][kTileN + 1];
  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * 32 + tx;
  const int64_t e = blockIdx.z;
  const int64_t n0 = int64_t(blockIdx.x) * kTileN, m0 = int64_t(blockIdx.y) * kTileM;
  const int64_t begin = expert_begin[e], end = expert_begin[e + 1];
  float acc[kRowsPerThread] = {};
  for (int64_t r0 = begin; r0 < end; r0 += kTileK) {  // rows in canonical order
    for (int i = tid; i < kTileK * kTileM; i += 256) {
      const int r = i / kTileM, c = i % kTileM;
      as[r][c] = (r0 + r < end && m0 + c < m) ? to_float(a[(r0 + r) * m + m0 + c]) : 0.0f;
    }
    for (int i = tid; i < kTileK * kTileN; i += 256) {
      const int r = i / kTileN, c = i % kTileN;
      bs[r][c] = (r0 + r < end && n0 + c < n) ? to_float(b[(r0 + r) * n + n0 + c]) : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTileK; ++kk) {
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) acc[i] += as[kk][ty + 8 * i] * bs[kk][tx];
    }
    __syncthreads();
  }
  const int64_t col = n0 + tx;
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int64_t row = m0 + ty + 8 * i;
    if (row < m && col < n) d[e * m * n + row * n + col] = from_float<T>(acc[i]);
  }
}

}  // namespace

std::string run_rows_gemm_simt(const RowsGemm& p, const int64_t* tile_begin, cudaStream_t stream) {
  if (p.max_rows == 0 || p.n == 0 || p.experts == 0) return {};
  const int64_t tile_bound = (p.max_rows + kTileM - 1) / kTileM + p.experts;
  const dim3 grid(static_cast<unsigned>((p.n + kTileN - 1) / kTileN),
                  static_cast<unsigned>(std::min<int64_t>(tile_bound, 65535)));
  const dim3 block(32, 8);
  auto launch = [&](auto ab_tag, auto d_tag) {
    using AB = decltype(ab_tag);
    using D = decltype(d_tag);
    rows_gemm_simt<AB, D><<<grid, block, 0, stream>>>(
        static_cast<const AB*>(p.a), static_cast<const AB*>(p.b), static_cast<D*>(p.d),
        p.expert_begin, tile_begin, p.experts, p.n, p.k, p.transpose_b, tile_bound);
  };
  if (p.ab_dtype == DType::kF32 && p.d_dtype == DType::kF32) {
    launch(float{}, float{});
  } else if (p.ab_dtype == DType::kBF16 && p.d_dtype == DType::kBF16) {
    launch(bf16{}, bf16{});
  } else if (p.ab_dtype == DType::kBF16 && p.d_dtype == DType::kF32) {
    launch(bf16{}, float{});
  } else {
    return "rows GEMM: unsupported element types";
  }
  MOK_CUDA_RETURN_IF_LAUNCH_FAILED("rows_gemm_simt");
  return {};
}

std::string run_weight_grad_gemm_simt(const WeightGradGemm& p, cudaStream_t stream) {
  if (p.experts == 0 || p.m == 0 || p.n == 0) return {};
  if (p.experts > 65535) return "weight-gradient GEMM: too many experts for the SIMT path";
  const dim3 grid(static_cast<unsigned>((p.n + kTileN - 1) / kTileN),
                  static_cast<unsigned>((p.m + kTileM - 1) / kTileM),
                  static_cast<unsigned>(p.experts));
  const dim3 block(32, 8);
  if (p.dtype == DType::kF32) {
    weight_grad_simt<float><<<grid, block, 0, stream>>>(
        static_cast<const float*>(p.a), static_cast<const float*>(p.b), static_cast<float*>(p.d),
        p.expert_begin, p.m, p.n);
  } else {
    weight_grad_simt<bf16><<<grid, block, 0, stream>>>(
        static_cast<const bf16*>(p.a), static_cast<const bf16*>(p.b), static_cast<bf16*>(p.d),
        p.expert_begin, p.m, p.n);
  }
  MOK_CUDA_RETURN_IF_LAUNCH_FAILED("weight_grad_simt");
  return {};
}

}  // namespace mok::cuda
