#include "rms_norm.h"

#include <algorithm>

#include "cuda_check.h"
#include "mok/bf16.h"

namespace mok::cuda {
namespace {

// 16 bytes of T, moved as one uint4 (a struct of T copied element by element
// made the compiler split the stores: moe_elementwise.cu).
template <typename T> struct Pack;
template <> struct Pack<float> { static constexpr int kN = 4; };
template <> struct Pack<bf16> { static constexpr int kN = 8; };

__device__ __forceinline__ void unpack(uint4 raw, float (&f)[4]) {
  f[0] = __uint_as_float(raw.x), f[1] = __uint_as_float(raw.y);
  f[2] = __uint_as_float(raw.z), f[3] = __uint_as_float(raw.w);
}
__device__ __forceinline__ void unpack(uint4 raw, float (&f)[8]) {
  const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // little endian: the lower half is the first element
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ uint4 pack(const float (&f)[4]) {
  return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                    __float_as_uint(f[3]));
}
__device__ __forceinline__ uint4 pack(const float (&f)[8]) {
  unsigned w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[i] = unsigned(float_to_bf16(f[2 * i]).bits) |
           (unsigned(float_to_bf16(f[2 * i + 1]).bits) << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}
// The N scale values of vector v (N = 4 or 8 f32: one or two float4 loads).
template <int N>
__device__ __forceinline__ void load_scale(const float* scale, int64_t v, float (&f)[N]) {
  const float4* p = reinterpret_cast<const float4*>(scale + v * N);
#pragma unroll
  for (int j = 0; j < N / 4; ++j) {
    const float4 q = __ldg(p + j);
    f[4 * j] = q.x, f[4 * j + 1] = q.y, f[4 * j + 2] = q.z, f[4 * j + 3] = q.w;
  }
}

// A team of W warps normalises one row at a time; each of its threads owns the
// 16-byte vectors tid + k * 32W of the row, k < kVectorsPerThread. One-warp
// teams come four to a block (no block barrier between them); wider teams are a
// block each and sum over their warps through shared memory.
constexpr int kVectorsPerThread = 4;
template <int W> constexpr int kTeamsPerBlock = W == 1 ? 4 : 1;
template <int W> constexpr int kBlockThreads = 32 * W * kTeamsPerBlock<W>;

__device__ __forceinline__ float warp_sum_fixed(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;  // a fixed xor tree: every lane holds the same bits
}

// The sum of v over the team's threads: each warp's xor tree, then the warps in order.
template <int W>
__device__ __forceinline__ float team_sum(float v, float* shared) {
  v = warp_sum_fixed(v);
  if constexpr (W == 1) {
    return v;
  } else {
    if ((threadIdx.x & 31) == 0) shared[threadIdx.x >> 5] = v;
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < W; ++w) total += shared[w];
    __syncthreads();  // before the next row writes shared again
    return total;
  }
}

template <typename T, int W>
__global__ void __launch_bounds__(kBlockThreads<W>)
add_rms_norm_forward_kernel(const T* __restrict__ x, const T* __restrict__ branch,
                            const float* __restrict__ scale, int64_t rows, int64_t dim,
                            float epsilon, T* __restrict__ sum, T* __restrict__ out,
                            float* __restrict__ rstd) {
  constexpr int N = Pack<T>::kN;
  constexpr int kK = kVectorsPerThread;
  constexpr int kTeam = 32 * W;
  __shared__ float shared[W];
  const int tid = threadIdx.x % kTeam;
  const int64_t vectors = dim / N;
  const int64_t teams = int64_t(gridDim.x) * kTeamsPerBlock<W>;
  for (int64_t r = int64_t(blockIdx.x) * kTeamsPerBlock<W> + threadIdx.x / kTeam; r < rows;
       r += teams) {
    const uint4* xr = reinterpret_cast<const uint4*>(x + r * dim);
    const uint4* br = reinterpret_cast<const uint4*>(branch + r * dim);
    uint4 xv[kK], bv[kK];
#pragma unroll
    for (int k = 0; k < kK; ++k) {
      const int64_t v = tid + k * kTeam;
      if (v < vectors) xv[k] = xr[v], bv[k] = br[v];
    }
    float s[kK][N];
    float squares = 0.0f;
#pragma unroll
    for (int k = 0; k < kK; ++k) {
      const int64_t v = tid + k * kTeam;
      if (v >= vectors) continue;
      float a[N], b[N];
      unpack(xv[k], a);
      unpack(bv[k], b);
#pragma unroll
      for (int i = 0; i < N; ++i) {
        s[k][i] = round_to<T>(a[i] + b[i]);
        squares += s[k][i] * s[k][i];
      }
      reinterpret_cast<uint4*>(sum + r * dim)[v] = pack(s[k]);
    }
    const float rs = 1.0f / sqrtf(team_sum<W>(squares, shared) / float(dim) + epsilon);
#pragma unroll
    for (int k = 0; k < kK; ++k) {
      const int64_t v = tid + k * kTeam;
      if (v >= vectors) continue;
      float g[N];
      load_scale<N>(scale, v, g);
#pragma unroll
      for (int i = 0; i < N; ++i) g[i] = s[k][i] * (rs * g[i]);
      reinterpret_cast<uint4*>(out + r * dim)[v] = pack(g);
    }
    if (tid == 0) rstd[r] = rs;
  }
}

template <typename T, int W>
__global__ void __launch_bounds__(kBlockThreads<W>)
add_rms_norm_backward_kernel(const T* __restrict__ dn, const T* __restrict__ ds,
                             const T* __restrict__ sum, const float* __restrict__ rstd,
                             const float* __restrict__ scale, int64_t rows, int64_t dim,
                             T* __restrict__ d, float* __restrict__ partials) {
  constexpr int N = Pack<T>::kN;
  constexpr int kK = kVectorsPerThread;
  constexpr int kTeam = 32 * W;
  __shared__ float shared[W];
  const int tid = threadIdx.x % kTeam;
  const int64_t vectors = dim / N;
  const int64_t groups = (rows + kNormRowsPerGroup - 1) / kNormRowsPerGroup;
  const int64_t teams = int64_t(gridDim.x) * kTeamsPerBlock<W>;
  for (int64_t p = int64_t(blockIdx.x) * kTeamsPerBlock<W> + threadIdx.x / kTeam; p < groups;
       p += teams) {
    float acc[kK][N];
#pragma unroll
    for (int k = 0; k < kK; ++k) {
#pragma unroll
      for (int i = 0; i < N; ++i) acc[k][i] = 0.0f;
    }
    const int64_t last = std::min(rows, (p + 1) * kNormRowsPerGroup);
    for (int64_t r = p * kNormRowsPerGroup; r < last; ++r) {
      const uint4* dnr = reinterpret_cast<const uint4*>(dn + r * dim);
      const uint4* dsr = reinterpret_cast<const uint4*>(ds + r * dim);
      const uint4* sr = reinterpret_cast<const uint4*>(sum + r * dim);
      uint4 dnv[kK], dsv[kK], sv[kK];
#pragma unroll
      for (int k = 0; k < kK; ++k) {
        const int64_t v = tid + k * kTeam;
        if (v < vectors) dnv[k] = dnr[v], dsv[k] = dsr[v], sv[k] = sr[v];
      }
      const float rs = rstd[r];
      float dot = 0.0f;
#pragma unroll
      for (int k = 0; k < kK; ++k) {
        const int64_t v = tid + k * kTeam;
        if (v >= vectors) continue;
        float a[N], s[N], g[N];
        unpack(dnv[k], a);
        unpack(sv[k], s);
        load_scale<N>(scale, v, g);
#pragma unroll
        for (int i = 0; i < N; ++i) {
          dot += a[i] * g[i] * s[i];
          acc[k][i] += a[i] * s[i] * rs;
        }
      }
      const float c = rs * rs * rs * team_sum<W>(dot, shared) / float(dim);
#pragma unroll
      for (int k = 0; k < kK; ++k) {
        const int64_t v = tid + k * kTeam;
        if (v >= vectors) continue;
        float a[N], s[N], g[N], e[N];
        unpack(dnv[k], a);
        unpack(sv[k], s);
        unpack(dsv[k], e);
        load_scale<N>(scale, v, g);
#pragma unroll
        for (int i = 0; i < N; ++i) e[i] = e[i] + rs * (a[i] * g[i]) - s[i] * c;
        reinterpret_cast<uint4*>(d + r * dim)[v] = pack(e);
      }
    }
#pragma unroll
    for (int k = 0; k < kK; ++k) {
      const int64_t v = tid + k * kTeam;
      if (v >= vectors) continue;
      float4* q = reinterpret_cast<float4*>(partials + p * dim + v * N);
#pragma unroll
      for (int j = 0; j < N / 4; ++j) {
        q[j] = make_float4(acc[k][4 * j], acc[k][4 * j + 1], acc[k][4 * j + 2],
                           acc[k][4 * j + 3]);
      }
    }
  }
}

// Smallest team (a power of two of warps, at most 16: past 512 threads a block the
// registers run out and the kernels spill) whose threads' vectors cover a row; 0 if none.
int team_warps(DType dtype, int64_t dim) {
  const int64_t n = dtype == DType::kBF16 ? 8 : 4;
  int w = 1;
  while (w < 16 && int64_t(32) * w * kVectorsPerThread * n < dim) w *= 2;
  return int64_t(32) * w * kVectorsPerThread * n < dim ? 0 : w;
}

constexpr int64_t kMaxGrid = 1 << 16;

template <typename T, int W>
std::string launch_forward(const void* x, const void* branch, const float* scale, int64_t rows,
                           int64_t dim, float epsilon, void* sum, void* out, float* rstd,
                           cudaStream_t stream) {
  const int64_t blocks =
      std::min(kMaxGrid, (rows + kTeamsPerBlock<W> - 1) / kTeamsPerBlock<W>);
  add_rms_norm_forward_kernel<T, W><<<unsigned(blocks), kBlockThreads<W>, 0, stream>>>(
      static_cast<const T*>(x), static_cast<const T*>(branch), scale, rows, dim, epsilon,
      static_cast<T*>(sum), static_cast<T*>(out), rstd);
  MOK_CUDA_RETURN_IF_LAUNCH_FAILED("add_rms_norm_forward_kernel");
  return {};
}

template <typename T, int W>
std::string launch_backward(const void* dn, const void* ds, const void* sum, const float* rstd,
                            const float* scale, int64_t rows, int64_t dim, void* d,
                            float* partials, cudaStream_t stream) {
  const int64_t groups = (rows + kNormRowsPerGroup - 1) / kNormRowsPerGroup;
  const int64_t blocks =
      std::min(kMaxGrid, (groups + kTeamsPerBlock<W> - 1) / kTeamsPerBlock<W>);
  add_rms_norm_backward_kernel<T, W><<<unsigned(blocks), kBlockThreads<W>, 0, stream>>>(
      static_cast<const T*>(dn), static_cast<const T*>(ds), static_cast<const T*>(sum), rstd,
      scale, rows, dim, static_cast<T*>(d), partials);
  MOK_CUDA_RETURN_IF_LAUNCH_FAILED("add_rms_norm_backward_kernel");
  return {};
}

// Calls fn.template operator()<T, W>() for the element type and team width of a row.
template <typename Fn>
std::string dispatch(DType dtype, int64_t dim, Fn&& fn) {
  const bool bf = dtype == DType::kBF16;
  switch (team_warps(dtype, dim)) {
    case 1: return bf ? fn.template operator()<bf16, 1>() : fn.template operator()<float, 1>();
    case 2: return bf ? fn.template operator()<bf16, 2>() : fn.template operator()<float, 2>();
    case 4: return bf ? fn.template operator()<bf16, 4>() : fn.template operator()<float, 4>();
    case 8: return bf ? fn.template operator()<bf16, 8>() : fn.template operator()<float, 8>();
    case 16:
      return bf ? fn.template operator()<bf16, 16>() : fn.template operator()<float, 16>();
  }
  return add_rms_norm_unsupported(dtype, dim);
}

}  // namespace

std::string add_rms_norm_unsupported(DType dtype, int64_t dim) {
  if (dtype != DType::kBF16 && dtype != DType::kF32) return "rows must be float32 or bfloat16";
  if (dim <= 0 || dim % 8 != 0 || dim > kNormMaxDim || team_warps(dtype, dim) == 0) {
    return "the fused kernels take rows of a multiple of 8 elements, at most " +
           std::to_string(dtype == DType::kBF16 ? kNormMaxDim : kNormMaxDim / 2) + " (got " +
           std::to_string(dim) + ")";
  }
  return {};
}

std::string add_rms_norm_forward(DType dtype, const void* x, const void* branch,
                                 const float* scale, int64_t rows, int64_t dim, float epsilon,
                                 void* sum, void* out, float* rstd, cudaStream_t stream) {
  MOK_RETURN_IF_MESSAGE(add_rms_norm_unsupported(dtype, dim));
  if (rows == 0) return {};
  for (const void* p : {x, branch, static_cast<const void*>(scale), static_cast<const void*>(sum),
                        static_cast<const void*>(out)}) {
    if (!aligned16(p)) return "add_rms_norm: a buffer is not 16-byte aligned";
  }
  return dispatch(dtype, dim, [&]<typename T, int W>() {
    return launch_forward<T, W>(x, branch, scale, rows, dim, epsilon, sum, out, rstd, stream);
  });
}

std::string add_rms_norm_backward(DType dtype, const void* dn, const void* ds, const void* sum,
                                  const float* rstd, const float* scale, int64_t rows,
                                  int64_t dim, void* d, float* dscale_partials,
                                  cudaStream_t stream) {
  MOK_RETURN_IF_MESSAGE(add_rms_norm_unsupported(dtype, dim));
  if (rows == 0) return {};
  for (const void* p : {dn, ds, sum, static_cast<const void*>(scale), static_cast<const void*>(d),
                        static_cast<const void*>(dscale_partials)}) {
    if (!aligned16(p)) return "add_rms_norm: a buffer is not 16-byte aligned";
  }
  return dispatch(dtype, dim, [&]<typename T, int W>() {
    return launch_backward<T, W>(dn, ds, sum, rstd, scale, rows, dim, d, dscale_partials,
                                 stream);
  });
}

}  // namespace mok::cuda
