// SwiGLU backward, element by element and for the combine weight's gradient, in
// one place for the two kernels that compute it: swiglu_backward_kernel (after a
// data-gradient GEMM that wrote dh in f32) and the epilogue of that GEMM
// (swiglu_bwd_epilogue.cuh), which must give the same bits. Every operation is an
// explicitly rounded intrinsic, so that nvcc cannot contract them differently in
// the two contexts.
//
// For a kept row of pair p with weight w, gate g and up u (the rounded forward
// residual) and dh = (dy @ W_down^T)[f] in f32:
//   h      = round_x(silu(g) * u)                 (W_down's gradient reads it)
//   d gate = round_x(w dh u silu'(g)),  d up = round_x(w dh silu(g))
//   d w    = sum over f of dh * h, in the order of SwigluDwOrder below.
#pragma once

#include <cuda_runtime.h>

namespace mok::cuda {

struct SwigluGrad {
  float h_raw;  // silu(g) * u, before rounding to x.dtype
  float dgate;  // before rounding
  float dup;    // before rounding
};

__device__ __forceinline__ SwigluGrad swiglu_grad(float g, float u, float dh, float w) {
  const float s = __frcp_rn(__fadd_rn(1.0f, expf(-g)));  // = 1 / (1 + e^-g), rounded once
  const float silu = __fmul_rn(g, s);
  const float dhw = __fmul_rn(w, dh);
  const float dsilu = __fmul_rn(s, __fmaf_rn(g, __fsub_rn(1.0f, s), 1.0f));
  return {__fmul_rn(silu, u), __fmul_rn(__fmul_rn(dhw, u), dsilu), __fmul_rn(dhw, silu)};
}

// The order in which d w = sum_f dh[f] * h[f] is summed, the one the GEMM
// epilogue's register layout gives (wgmma accumulators of a 256-column tile):
//   chunk c = columns [256c, 256c + 256);
//   within a chunk, four partial sums q = 0..3, s_q = fma over j = 0..31 ascending
//     of columns 256c + 8j + 2q, then 256c + 8j + 2q + 1, from 0;
//   chunk sum = (s_0 + s_1) + (s_2 + s_3)   (two xor shuffles over a quad);
//   d w = 0 + chunk 0 + chunk 1 + ...       (in order).
// A ragged last chunk (F % 256 != 0, unfused path only) skips missing columns.
constexpr int kSwigluDwChunk = 256;

__device__ __forceinline__ float swiglu_dw_step(float acc, float dh, float h) {
  return __fmaf_rn(dh, h, acc);
}

// The chunk sum from the four partials held by the lanes of a quad (lane % 4 = q),
// the same bits in every lane.
__device__ __forceinline__ float swiglu_dw_quad_sum(float s) {
  s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, 1));
  return __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, 2));
}

}  // namespace mok::cuda
