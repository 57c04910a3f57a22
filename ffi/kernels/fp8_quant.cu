#include "fp8_quant.h"

#include <cuda_fp8.h>

#include <algorithm>

#include "cuda_check.h"
#include "mok/bf16.h"
#include "swiglu_math.cuh"

namespace mok::cuda {
namespace {

constexpr float kE4m3Max = 448.0f;
constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 8192;

// The scale of a block: amax / 448 (IEEE division), or 1 where that is 0 (an
// all-zero block, or amax below 448 * 2^-150, where the quotient underflows); NaN
// when the block holds a NaN (so that every value of the block becomes NaN).
__device__ __forceinline__ float block_scale(float amax, bool any_nan) {
  if (any_nan) return __int_as_float(0x7fc00000);  // the canonical quiet NaN
  const float s = amax / kE4m3Max;
  return s == 0.0f ? 1.0f : s;
}

// Four values v / s packed little-endian as e4m3: the f32 quotient (IEEE, round to
// nearest; the build has no fast-math) rounded to e4m3 with round-to-nearest-even,
// saturated to +-448, NaN kept; two per conversion instruction. Elements at or past
// `valid` are 0 (padding, also in a NaN block).
__device__ __forceinline__ uint32_t q8x4(const float v[4], float s, int valid = 4) {
  float d[4];
#pragma unroll
  for (int t = 0; t < 4; ++t) d[t] = t < valid ? v[t] / s : 0.0f;
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(d[0], d[1]), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(d[2], d[3]), __NV_SATFINITE, __NV_E4M3);
  return lo | hi << 16;
}

// Two f32 values read from memory as a bf16 pair (a in the low half), rounded as
// float_to_bf16 (swiglu_math.cuh's pack_bf16x2, the hardware's conversion, is for
// computed values only: a NaN read from memory may carry another payload).
__device__ __forceinline__ uint32_t pack_read_bf16x2(float a, float b) {
  return uint32_t(float_to_bf16(a).bits) | uint32_t(float_to_bf16(b).bits) << 16;
}

// How many of four elements lie before the end, `left` elements away.
__device__ __forceinline__ int valid4(int64_t left) {
  return left >= 4 ? 4 : left <= 0 ? 0 : static_cast<int>(left);
}

// Four bf16 values (two 32-bit words of bf16 pairs) as f32.
__device__ __forceinline__ void bf16x4_floats(uint32_t lo, uint32_t hi, float v[4]) {
  v[0] = bits_float(lo << 16), v[1] = bits_float(lo & 0xffff0000u);
  v[2] = bits_float(hi << 16), v[3] = bits_float(hi & 0xffff0000u);
}


__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// OR over the warp's lanes (__reduce_or_sync needs sm_80; the shuffle tree keeps
// older targets of the SIMT build compiling).
__device__ __forceinline__ unsigned warp_or(unsigned v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_or_sync(0xffffffffu, v);
#else
  for (int offset = 16; offset > 0; offset >>= 1) v |= __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
#endif
}

// kN independent warp maxima, their shuffles interleaved.
template <int kN>
__device__ __forceinline__ void warp_max_n(float (&v)[kN]) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
    for (int u = 0; u < kN; ++u) v[u] = fmaxf(v[u], __shfl_xor_sync(0xffffffffu, v[u], off));
  }
}

// Blocks a warp quantizes per step of the row kernels: their loads are all issued
// before the first reduction waits.
constexpr int kBlocksInFlight = 4;

unsigned grid_for(int64_t threads) {
  return static_cast<unsigned>(std::max<int64_t>(
      1, std::min<int64_t>((threads + kThreads - 1) / kThreads, kMaxBlocks)));
}

// Four consecutive source elements as f32 (vector load when `vec`: 4 | half and
// the row start aligned, so the four are all inside or all past the half).
__device__ __forceinline__ void load4(const bf16* p, int64_t j, int64_t half, bool vec,
                                      float v[4]) {
  if (vec) {
    if (j < half) {
      const uint2 w = *reinterpret_cast<const uint2*>(p + j);
      v[0] = bits_float(w.x << 16), v[1] = bits_float(w.x & 0xffff0000u);
      v[2] = bits_float(w.y << 16), v[3] = bits_float(w.y & 0xffff0000u);
    } else {
      v[0] = v[1] = v[2] = v[3] = 0.0f;
    }
    return;
  }
#pragma unroll
  for (int t = 0; t < 4; ++t) v[t] = j + t < half ? to_float(p[j + t]) : 0.0f;
}

__device__ __forceinline__ void load4(const float* p, int64_t j, int64_t half, bool vec,
                                      float v[4]) {
  if (vec) {
    if (j < half) {
      const float4 w = *reinterpret_cast<const float4*>(p + j);
      v[0] = w.x, v[1] = w.y, v[2] = w.z, v[3] = w.w;
    } else {
      v[0] = v[1] = v[2] = v[3] = 0.0f;
    }
    return;
  }
#pragma unroll
  for (int t = 0; t < 4; ++t) v[t] = j + t < half ? p[j + t] : 0.0f;
}

__device__ __forceinline__ bool aligned(const void* p, unsigned bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

// Where row r's scales go: row-major (r * row_stride + c), or per group M-major
// (first + c * group_rows): the row's group is looked up once per row.
struct ScaleRow {
  int64_t first, step;
};

__device__ __forceinline__ ScaleRow scale_row(int64_t r, int64_t per_row, int64_t row_stride,
                                              const int64_t* __restrict__ group_begin,
                                              int64_t groups) {
  if (group_begin == nullptr) return {r * row_stride, 1};
  int64_t lo = 0, hi = groups - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (group_begin[mid] <= r) lo = mid; else hi = mid - 1;
  }
  const int64_t begin = group_begin[lo];
  const int64_t g_rows = group_begin[lo + 1] - begin;
  return {begin * per_row + (r - begin), g_rows};
}

// One warp per row (grid-stride over rows), its (half, 128-block)s kBlocksInFlight
// at a time; each lane holds 4 consecutive elements of a block, loaded and stored
// as one vector where the sizes allow (decided once per launch).
template <typename X>
__global__ void __launch_bounds__(kThreads)
quantize_rows_kernel(const X* __restrict__ src, int64_t rows, int64_t halves, int64_t half,
                     const int64_t* __restrict__ num_rows, uint8_t* __restrict__ q,
                     int64_t out_half, int64_t out_row_stride, float* __restrict__ scales,
                     int64_t scale_row_stride, const int64_t* __restrict__ group_begin,
                     int64_t groups) {
  constexpr int kU = kBlocksInFlight;
  const int64_t n_rows = num_rows != nullptr ? min(*num_rows, rows) : rows;
  const int64_t blocks_per_half = (out_half + kFp8Block - 1) / kFp8Block;
  const int64_t per_row = halves * blocks_per_half;
  const bool vec_in = half % 4 == 0 && aligned(src, 4 * sizeof(X));
  const bool vec_out = (out_half | out_row_stride) % 4 == 0 && aligned(q, 4);
  const int lane = threadIdx.x & 31;
  const int64_t first = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t stride = (int64_t(gridDim.x) * blockDim.x) >> 5;
  for (int64_t r = first; r < n_rows; r += stride) {
    ScaleRow where{0, 0};
    if (lane == 0) where = scale_row(r, per_row, scale_row_stride, group_begin, groups);
    for (int64_t h = 0; h < halves; ++h) {
      const X* s_row = src + r * halves * half + h * half;
      uint8_t* q_row = q + r * out_row_stride + h * out_half;
      for (int64_t blk0 = 0; blk0 < blocks_per_half; blk0 += kU) {
        float v[kU][4], amax[kU];
        unsigned nan = 0;
#pragma unroll
        for (int u = 0; u < kU; ++u) {  // past the half: zeros
          load4(s_row, (blk0 + u) * kFp8Block + lane * 4, half, vec_in, v[u]);
        }
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          amax[u] = 0.0f;
#pragma unroll
          for (int t = 0; t < 4; ++t) {
            amax[u] = fmaxf(amax[u], fabsf(v[u][t]));
            nan |= unsigned(isnan(v[u][t])) << u;
          }
        }
        warp_max_n<kU>(amax);
        nan = warp_or(nan);
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int64_t blk = blk0 + u;
          if (blk >= blocks_per_half) break;
          const int64_t j0 = blk * kFp8Block + lane * 4;
          const float s = block_scale(amax[u], (nan >> u) & 1u);
          const int valid = valid4(half - j0);
          if (vec_out) {
            if (j0 < out_half) {  // 4 | out_half: all four inside
              *reinterpret_cast<uint32_t*>(q_row + j0) = q8x4(v[u], s, valid);
            }
          } else {
            const uint32_t packed = q8x4(v[u], s, valid);
#pragma unroll
            for (int t = 0; t < 4; ++t) {
              if (j0 + t < out_half) q_row[j0 + t] = uint8_t(packed >> (8 * t));
            }
          }
          if (lane == 0) scales[where.first + (h * blocks_per_half + blk) * where.step] = s;
        }
      }
    }
  }
}

// One warp per row, its 128-blocks of h kBlocksInFlight at a time; h as in
// swiglu_forward (moe_elementwise.cu).
__global__ void __launch_bounds__(kThreads)
swiglu_quantize_kernel(const float* __restrict__ gate_up, const int64_t* __restrict__ num_rows,
                       int64_t max_rows, int64_t ffn, int64_t ffn_pad,
                       bf16* __restrict__ gate_up_out, uint8_t* __restrict__ hq,
                       float* __restrict__ h_scales, const int64_t* __restrict__ group_begin,
                       int64_t groups) {
  constexpr int kU = kBlocksInFlight;
  const int64_t n_rows = min(*num_rows, max_rows);
  const int64_t per_row = ffn_pad / kFp8Block;
  // gate_up rows are 128-float aligned; 4 | ffn keeps 4-element groups whole.
  const bool vec = ffn % 4 == 0 && aligned(gate_up, 16) &&
                   (gate_up_out == nullptr || aligned(gate_up_out, 8));
  const int lane = threadIdx.x & 31;
  const int64_t first = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t stride = (int64_t(gridDim.x) * blockDim.x) >> 5;
  for (int64_t r = first; r < n_rows; r += stride) {
    ScaleRow where{0, 0};
    if (lane == 0) where = scale_row(r, per_row, per_row, group_begin, groups);
    const float* g_row = gate_up + r * 2 * ffn_pad;
    const float* u_row = g_row + ffn_pad;
    for (int64_t blk0 = 0; blk0 < per_row; blk0 += kU) {
      float g[kU][4], u[kU][4];
#pragma unroll
      for (int k = 0; k < kU; ++k) {  // past ffn: zeros
        const int64_t f0 = (blk0 + k) * kFp8Block + lane * 4;
        load4(g_row, f0, ffn, vec, g[k]);
        load4(u_row, f0, ffn, vec, u[k]);
      }
      float h[kU][4], amax[kU];
      unsigned nan = 0;
#pragma unroll
      for (int k = 0; k < kU; ++k) {
        const int64_t f0 = (blk0 + k) * kFp8Block + lane * 4;
        amax[k] = 0.0f;
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          // swiglu_forward_kernel's formula
          h[k][t] = f0 + t < ffn ? g[k][t] * sigmoid(g[k][t]) * u[k][t] : 0.0f;
          amax[k] = fmaxf(amax[k], fabsf(h[k][t]));
          nan |= unsigned(isnan(h[k][t])) << k;
        }
      }
      if (gate_up_out != nullptr) {
#pragma unroll
        for (int k = 0; k < kU; ++k) {
          const int64_t f0 = (blk0 + k) * kFp8Block + lane * 4;
          bf16* out_g = gate_up_out + r * 2 * ffn + f0;
          bf16* out_u = out_g + ffn;
          if (vec) {
            if (f0 < ffn) {
              const float* gk = g[k];
              const float* uk = u[k];
              uint2 wg, wu;
              wg.x = pack_read_bf16x2(gk[0], gk[1]), wg.y = pack_read_bf16x2(gk[2], gk[3]);
              wu.x = pack_read_bf16x2(uk[0], uk[1]), wu.y = pack_read_bf16x2(uk[2], uk[3]);
              *reinterpret_cast<uint2*>(out_g) = wg;
              *reinterpret_cast<uint2*>(out_u) = wu;
            }
          } else {
#pragma unroll
            for (int t = 0; t < 4; ++t) {
              if (f0 + t < ffn) {
                out_g[t] = float_to_bf16(g[k][t]), out_u[t] = float_to_bf16(u[k][t]);
              }
            }
          }
        }
      }
      warp_max_n<kU>(amax);
      nan = warp_or(nan);
#pragma unroll
      for (int k = 0; k < kU; ++k) {
        const int64_t blk = blk0 + k;
        if (blk >= per_row) break;
        const int64_t f0 = blk * kFp8Block + lane * 4;
        const float s = block_scale(amax[k], (nan >> k) & 1u);
        const int valid = valid4(ffn - f0);
        // ffn_pad is a multiple of 128 and f0 of 4: 4-byte aligned.
        *reinterpret_cast<uint32_t*>(hq + r * ffn_pad + f0) = q8x4(h[k], s, valid);
        if (lane == 0) h_scales[where.first + blk * where.step] = s;
      }
    }
  }
}

// Block (a, b) of one expert's weight: 128 x 128, one thread block. The tile is
// kept in shared memory as bf16 bits (its values are exact there); rows of 136
// elements keep 16-byte rows for vector access and put a warp's 32 consecutive
// columns of one row in distinct banks.
constexpr int kTileLd = 136;

// Max and NaN flag of a thread block (8 warps).
__device__ __forceinline__ float block_amax(float amax, bool nan, bool* any_nan) {
  __shared__ float warp_amax[kThreads / 32];
  __shared__ int warp_nan[kThreads / 32];
  amax = warp_max(amax);
  const bool wn = __any_sync(0xffffffffu, nan);
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) {
    warp_amax[warp] = amax;
    warp_nan[warp] = wn;
  }
  __syncthreads();
  float m = 0.0f;
  bool n = false;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) {
    m = fmaxf(m, warp_amax[w]);
    n |= warp_nan[w] != 0;
  }
  *any_nan = n;
  return m;
}

// kVecIn: 8 | ld, 8 | col_offset, 8 | q and a 16-byte aligned source, so that
// 8-element chunks load as one 16-byte vector, all inside or all past q.
template <bool kVecIn>
__global__ void __launch_bounds__(kThreads)
quantize_weight_kernel(WeightQuant p) {
  __shared__ __align__(16) uint16_t tile[128 * kTileLd];
  const int64_t b = blockIdx.x, a = blockIdx.y, e = blockIdx.z;
  const bf16* src = static_cast<const bf16*>(p.src) + e * p.src_expert_stride + p.col_offset;
  float amax = 0.0f;
  bool nan = false;
  if constexpr (kVecIn) {
    constexpr int kLoads = 128 * 16 / kThreads;  // 16-byte loads per thread, all in flight
    uint4 w[kLoads];
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int u = threadIdx.x + l * kThreads;
      const int i = u >> 4, j8 = (u & 15) * 8;
      const int64_t gi = a * 128 + i, gj = b * 128 + j8;
      w[l] = make_uint4(0, 0, 0, 0);
      if (gi < p.p && gj < p.q) w[l] = *reinterpret_cast<const uint4*>(src + gi * p.ld + gj);
    }
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int u = threadIdx.x + l * kThreads;
      const int i = u >> 4, j8 = (u & 15) * 8;
      *reinterpret_cast<uint4*>(tile + i * kTileLd + j8) = w[l];
      const uint32_t words[4] = {w[l].x, w[l].y, w[l].z, w[l].w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float lo = bits_float(words[k] << 16), hi = bits_float(words[k] & 0xffff0000u);
        amax = fmaxf(amax, fmaxf(fabsf(lo), fabsf(hi)));
        nan |= isnan(lo) || isnan(hi);
      }
    }
  } else {
    for (int idx = threadIdx.x; idx < 128 * 128; idx += kThreads) {
      const int i = idx >> 7, j = idx & 127;
      const int64_t gi = a * 128 + i, gj = b * 128 + j;
      uint16_t bits = 0;
      if (gi < p.p && gj < p.q) bits = src[gi * p.ld + gj].bits;
      tile[i * kTileLd + j] = bits;
      const float v = to_float(bf16{bits});
      amax = fmaxf(amax, fabsf(v));
      nan |= isnan(v);
    }
  }
  bool any_nan = false;
  amax = block_amax(amax, nan, &any_nan);  // its __syncthreads also orders the tile
  const float s = block_scale(amax, any_nan);
  uint8_t* dst = p.dst + e * p.dst_expert_stride;
  const bool vec_out = ((p.dst_ld | p.dst_expert_stride | p.offset) & 15) == 0 &&
                       (reinterpret_cast<uintptr_t>(p.dst) & 15) == 0;
  if (p.transposed) {
    // Output row j (a column of the tile), 32 consecutive i per thread (32 bytes);
    // a warp's lanes take 32 consecutive j, so its tile reads share a row.
    for (int u = threadIdx.x; u < 128 * 4; u += kThreads) {
      const int j = u & 127, i0 = (u >> 7) * 32;
      uint32_t packed[8];
#pragma unroll
      for (int w = 0; w < 8; ++w) {
        float v[4];
#pragma unroll
        for (int t = 0; t < 4; ++t) v[t] = to_float(bf16{tile[(i0 + w * 4 + t) * kTileLd + j]});
        packed[w] = q8x4(v, s);
      }
      uint8_t* out = dst + (p.offset + b * 128 + j) * p.dst_ld + a * 128 + i0;
      if (vec_out) {
        reinterpret_cast<uint4*>(out)[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
        reinterpret_cast<uint4*>(out)[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
      } else {
#pragma unroll
        for (int w = 0; w < 8; ++w) reinterpret_cast<uint32_t*>(out)[w] = packed[w];
      }
    }
    if (threadIdx.x == 0) {
      p.scales[e * p.scale_expert_stride + (p.offset / 128 + b) * p.scale_n + a * p.scale_k] = s;
    }
  } else {
    // Output row i < p, 16 consecutive j per thread (two 16-byte tile reads).
    for (int u = threadIdx.x; u < 128 * 8; u += kThreads) {
      const int i = u >> 3, j0 = (u & 7) * 16;
      if (a * 128 + i >= p.p) continue;
      const uint4 w0 = *reinterpret_cast<const uint4*>(tile + i * kTileLd + j0);
      const uint4 w1 = *reinterpret_cast<const uint4*>(tile + i * kTileLd + j0 + 8);
      const uint32_t words[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
      uint32_t packed[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        float v[4];
        bf16x4_floats(words[2 * k], words[2 * k + 1], v);
        packed[k] = q8x4(v, s);
      }
      uint8_t* out = dst + (a * 128 + i) * p.dst_ld + p.offset + b * 128 + j0;
      if (vec_out) {
        *reinterpret_cast<uint4*>(out) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) reinterpret_cast<uint32_t*>(out)[k] = packed[k];
      }
    }
    if (threadIdx.x == 0) {
      p.scales[e * p.scale_expert_stride + a * p.scale_n + (p.offset / 128 + b) * p.scale_k] = s;
    }
  }
}

__global__ void padded_begin_kernel(const int64_t* __restrict__ expert_begin, int64_t experts,
                                    int64_t* __restrict__ padded_begin) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  int64_t at = 0;
  for (int64_t e = 0; e < experts; ++e) {
    padded_begin[e] = at;
    at += (expert_begin[e + 1] - expert_begin[e] + kFp8Block - 1) / kFp8Block * kFp8Block;
  }
  padded_begin[experts] = at;
}

// A thread block per 64 columns (x) and 128-row block of the padded row space (y,
// and every gridDim.y-th one after it).
constexpr int kTCols = 64;
constexpr int kTLd = kTCols + 8;  // 16-byte rows

// Row block rb (pstart below padded_begin[E]) of the columns of thread block x.
__device__ __forceinline__ void quantize_transposed_block(const TransposeQuant& p, int64_t rb) {
  __shared__ __align__(16) uint16_t tile[128 * kTLd];
  __shared__ float part_amax[4][kTCols];
  __shared__ int part_nan[4][kTCols];
  __shared__ float col_scale[kTCols];
  const int64_t pstart = rb * kFp8Block;
  // The expert whose padded rows hold pstart: the last e with padded_begin[e] <= pstart
  // (experts without rows share their successor's begin and are skipped so).
  int64_t lo = 0, hi = p.experts;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (p.padded_begin[mid] <= pstart) lo = mid; else hi = mid - 1;
  }
  const int64_t e = lo;
  const int64_t r0 = p.expert_begin[e] + (pstart - p.padded_begin[e]);
  const int64_t count = min(int64_t(kFp8Block), p.expert_begin[e + 1] - r0);
  const int64_t c0 = int64_t(blockIdx.x) * kTCols;
  const bf16* src = static_cast<const bf16*>(p.src);
  if (p.vec) {  // 8 | ld, 8 | cols, 16-byte aligned rows: 8 columns per load
    constexpr int kLoads = 128 * (kTCols / 8) / kThreads;  // all in flight
    uint4 w[kLoads];
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int u = threadIdx.x + l * kThreads;
      const int i = u / (kTCols / 8), j8 = u % (kTCols / 8) * 8;
      w[l] = make_uint4(0, 0, 0, 0);
      if (i < count && c0 + j8 < p.cols) {
        w[l] = *reinterpret_cast<const uint4*>(src + (r0 + i) * p.ld + c0 + j8);
      }
    }
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int u = threadIdx.x + l * kThreads;
      const int i = u / (kTCols / 8), j8 = u % (kTCols / 8) * 8;
      *reinterpret_cast<uint4*>(tile + i * kTLd + j8) = w[l];
    }
  } else {
    for (int idx = threadIdx.x; idx < 128 * kTCols; idx += kThreads) {
      const int i = idx / kTCols, j = idx % kTCols;
      uint16_t bits = 0;
      if (i < count && c0 + j < p.cols) bits = src[(r0 + i) * p.ld + c0 + j].bits;
      tile[i * kTLd + j] = bits;
    }
  }
  __syncthreads();
  {
    const int c = threadIdx.x % kTCols, quarter = threadIdx.x / kTCols;
    float amax = 0.0f;
    bool nan = false;
    for (int i = quarter * 32; i < quarter * 32 + 32; ++i) {
      const float v = to_float(bf16{tile[i * kTLd + c]});
      amax = fmaxf(amax, fabsf(v));
      nan |= isnan(v);
    }
    part_amax[quarter][c] = amax;
    part_nan[quarter][c] = nan;
  }
  __syncthreads();
  if (threadIdx.x < kTCols) {
    const int c = threadIdx.x;
    float amax = 0.0f;
    bool nan = false;
#pragma unroll
    for (int k = 0; k < 4; ++k) amax = fmaxf(amax, part_amax[k][c]), nan |= part_nan[k][c] != 0;
    const float s = block_scale(amax, nan);
    col_scale[c] = s;
    if (c0 + c < p.cols) p.scales[rb * p.cols + c0 + c] = s;
  }
  __syncthreads();
  {
    // A warp's lanes take 32 consecutive columns of the same 32 rows (distinct
    // banks); each writes its column's 32 bytes (zero rows give 0).
    const int c = threadIdx.x % kTCols, seg = threadIdx.x / kTCols;
    if (c0 + c < p.cols) {
      const float s = col_scale[c];
      uint32_t packed[8];
#pragma unroll
      for (int w = 0; w < 8; ++w) {
        float v[4];
#pragma unroll
        for (int t = 0; t < 4; ++t) v[t] = to_float(bf16{tile[(seg * 32 + w * 4 + t) * kTLd + c]});
        packed[w] = q8x4(v, s);
      }
      // dst_ld and pstart are multiples of 128: 16-byte aligned when dst is.
      uint4* out = reinterpret_cast<uint4*>(p.dst + (c0 + c) * p.dst_ld + pstart + seg * 32);
      out[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      out[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
    }
  }
}

// Row blocks blockIdx.y, + gridDim.y, ...: past 65535 row blocks (8M padded rows) a
// launch's y dimension cannot give each its own thread block.
__global__ void __launch_bounds__(kThreads)
quantize_transposed_kernel(TransposeQuant p) {
  for (int64_t rb = blockIdx.y; rb < p.dst_ld / kFp8Block; rb += gridDim.y) {
    // The row blocks past the experts' padded rows are empty; so are all after them.
    if (rb * kFp8Block >= p.padded_begin[p.experts]) return;
    quantize_transposed_block(p, rb);
    __syncthreads();  // its tile and scales read before the next row block writes them
  }
}

}  // namespace

std::string quantize_rows_fp8(const RowQuant& p, cudaStream_t stream) {
  if (p.halves != 1 && p.halves != 2) return "quantize_rows_fp8: halves must be 1 or 2";
  if (p.group_begin != nullptr && p.groups < 1) return "quantize_rows_fp8: no groups";
  if (p.out_half < p.half) return "quantize_rows_fp8: output half shorter than the input's";
  if (p.src_dtype != DType::kBF16 && p.src_dtype != DType::kF32) {
    return "quantize_rows_fp8: rows must be bfloat16 or float32";
  }
  if (p.rows == 0 || p.out_half == 0) return {};
  const unsigned grid = grid_for(p.rows * 32);
  if (p.src_dtype == DType::kBF16) {
    quantize_rows_kernel<bf16><<<grid, kThreads, 0, stream>>>(
        static_cast<const bf16*>(p.src), p.rows, p.halves, p.half, p.num_rows, p.q, p.out_half,
        p.out_row_stride, p.scales, p.scale_row_stride, p.group_begin, p.groups);
  } else {
    quantize_rows_kernel<float><<<grid, kThreads, 0, stream>>>(
        static_cast<const float*>(p.src), p.rows, p.halves, p.half, p.num_rows, p.q, p.out_half,
        p.out_row_stride, p.scales, p.scale_row_stride, p.group_begin, p.groups);
  }
  MOK_CUDA_RETURN_IF_LAUNCH_FAILED("quantize_rows_kernel");
  return {};
}

std::string swiglu_forward_quantize_fp8(const float* gate_up_f32, const int64_t* num_rows,
                                        int64_t max_rows, int64_t ffn, int64_t ffn_pad,
                                        void* gate_up_out, uint8_t* hq, float* h_scales,
                                        const int64_t* group_begin, int64_t groups,
                                        cudaStream_t stream) {
  if (ffn_pad % kFp8Block != 0 || ffn_pad < ffn) return "SwiGLU fp8: bad padded width";
  if (max_rows == 0 || ffn_pad == 0) return {};
  swiglu_quantize_kernel<<<grid_for(max_rows * 32), kThreads, 0, stream>>>(
      gate_up_f32, num_rows, max_rows, ffn, ffn_pad, static_cast<bf16*>(gate_up_out), hq,
      h_scales, group_begin, groups);
  MOK_CUDA_RETURN_IF_LAUNCH_FAILED("swiglu_quantize_kernel");
  return {};
}

std::string quantize_weight_fp8(const WeightQuant& p, cudaStream_t stream) {
  if (p.offset % kFp8Block != 0 || p.dst_ld % 4 != 0) {
    return "quantize_weight_fp8: offsets and rows must be aligned";
  }
  if (p.experts == 0 || p.p == 0 || p.q == 0) return {};
  if (fp8_blocks(p.p) > 65535 || p.experts > 65535) return "quantize_weight_fp8: too large";
  const dim3 grid(static_cast<unsigned>(fp8_blocks(p.q)), static_cast<unsigned>(fp8_blocks(p.p)),
                  static_cast<unsigned>(p.experts));
  const bool vec_in = (p.ld | p.col_offset | p.q | p.src_expert_stride) % 8 == 0 &&
                      aligned16(p.src);
  if (vec_in) {
    quantize_weight_kernel<true><<<grid, kThreads, 0, stream>>>(p);
  } else {
    quantize_weight_kernel<false><<<grid, kThreads, 0, stream>>>(p);
  }
  MOK_CUDA_RETURN_IF_LAUNCH_FAILED("quantize_weight_kernel");
  return {};
}

std::string fp8_padded_begin(const int64_t* expert_begin, int64_t experts, int64_t* padded_begin,
                             cudaStream_t stream) {
  padded_begin_kernel<<<1, 32, 0, stream>>>(expert_begin, experts, padded_begin);
  MOK_CUDA_RETURN_IF_LAUNCH_FAILED("padded_begin_kernel");
  return {};
}

std::string quantize_transposed_fp8(const TransposeQuant& p, cudaStream_t stream) {
  if (p.dst_ld % kFp8Block != 0) return "quantize_transposed_fp8: padded rows not aligned";
  if (!aligned16(p.dst)) {
    return "quantize_transposed_fp8: dst must be 16-byte aligned";
  }
  if (p.cols == 0 || p.dst_ld == 0) return {};
  // At most 65535 thread blocks along y (the launch's limit): row block rb goes to
  // thread block rb % 65535.
  const int64_t row_blocks = std::min<int64_t>(p.dst_ld / kFp8Block, 65535);
  const dim3 grid(static_cast<unsigned>((p.cols + kTCols - 1) / kTCols),
                  static_cast<unsigned>(row_blocks));
  TransposeQuant launch = p;
  launch.vec = (p.ld | p.cols) % 8 == 0 && aligned16(p.src);
  quantize_transposed_kernel<<<grid, kThreads, 0, stream>>>(launch);
  MOK_CUDA_RETURN_IF_LAUNCH_FAILED("quantize_transposed_kernel");
  return {};
}

}  // namespace mok::cuda
