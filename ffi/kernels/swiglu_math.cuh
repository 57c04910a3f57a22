// The SwiGLU arithmetic every CUDA path of the layer shares, so that the kernel
// chain (moe_elementwise.cu) and the persistent kernels (moe_persistent*.cu) give
// the same bits: one definition of each rounded step, of the lanes' element order
// and of the warp reduction.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "mok/bf16.h"

namespace mok::cuda {

template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

template <typename T, int V>
__device__ __forceinline__ Vec<T, V> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, V>*>(p);
}
template <typename T, int V>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, V>& v) {
  *reinterpret_cast<Vec<T, V>*>(p) = v;
}

// V floats from L2 (ld.global.cg): rows another thread block of the same launch
// wrote are never read through a stale L1 line.
template <int V>
__device__ __forceinline__ Vec<float, V> load_floats_cg(const float* p) {
  Vec<float, V> out;
  if constexpr (V == 4) {
    const float4 v = __ldcg(reinterpret_cast<const float4*>(p));
    out.v[0] = v.x, out.v[1] = v.y, out.v[2] = v.z, out.v[3] = v.w;
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) out.v[i] = __ldcg(p + i);
  }
  return out;
}

// The logistic function from the hardware's approximations: ex2.approx for the
// exponential and rcp.approx for the reciprocal, both flushing results below 2^-126
// to zero (.ftz): four instructions an element in the SASS (two MUFU, the scale by
// -log2(e) and the add of 1). Its bits are those of __fdividef(1, 1 + __expf(-g))
// for every input: e^-g under 2^-126 (flushed here, a subnormal there) adds nothing
// to 1, a subnormal -g log2(e) gives 1 either way, and 1 + e^-g >= 1 is never
// subnormal, while the reciprocal of anything above 2^126 is 0 in both (rcp.approx's
// ftz, div.approx's range rule). tests/sigmoid_bits.cu checks all 2^32 inputs against
// that form and against the logistic function in double precision (__expf's error,
// 2 + 1.173 |g| ulp, from rounding g log2(e), dominates: 63 ulp at worst on an
// H100; docs/measurements.md, "The sigmoid from the hardware's exp2 and
// reciprocal"). CPU and GPU agree to rounding, not bit for bit
// (docs/contract.md); every CUDA path takes this one definition, so the kernel chain
// and the persistent kernels give the same bits. g = -inf gives 0 (silu NaN),
// g = +inf gives 1, NaN stays NaN; below g = -87.3 (1 + e^-g > 2^126) it gives 0
// where the IEEE quotient is a number under 2^-126.
__device__ __forceinline__ float sigmoid(float g) {
  float e, s;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(g * -1.44269502f));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(s) : "f"(1.0f + e));
  return s;
}

// Two floats rounded to bf16, `a` in the low half, by the hardware's
// round-to-nearest-even conversion: one instruction for both, where float_to_bf16
// takes ~8 integer instructions a value. The bits are float_to_bf16's for every
// non-NaN value; a NaN becomes the canonical 0x7FFF, float_to_bf16's result for the
// only NaN the GPU's arithmetic produces (0x7FFFFFFF, tensor cores included). For
// the epilogues' products and accumulators only (the chain's SwiGLU GEMM epilogue,
// the persistent kernels'), never for a value read from memory; tests/test_gpu.py
// and tests/test_persistent_gpu.py check the bits with NaN, infinite, subnormal
// and halfway inputs.
__device__ __forceinline__ uint32_t pack_bf16x2(float a, float b) {
  uint32_t packed;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(b), "f"(a));  // b: high half
  return packed;
}

// Sum over a warp in a fixed order (a fixed xor tree): same bits on every run.
__device__ __forceinline__ float warp_sum_fixed(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// A value the GPU computed, as X: for bf16 the hardware's round-to-nearest-even
// conversion (one instruction, where float_to_bf16 takes ~8), whose bits are
// float_to_bf16's for every value but a NaN read from memory (the only NaN the GPU's
// arithmetic produces is 0x7FFFFFFF, which both make 0x7FFF; see pack_bf16x2).
// Targets before sm_80 (the SIMT build) have no such conversion: float_to_bf16.
template <typename X>
__device__ __forceinline__ X from_computed(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<X, bf16>) {
    uint16_t b;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(v));
    return bf16{b};
  }
#endif
  return from_float<X>(v);
}

// SwiGLU's backward for V elements of a row: from the rounded residual (gate g,
// up u), GEMM2's dgrad dh (f32) and the row's combine weight w,
//   h = round_x(silu(g) u); wh = round_x(w h) (dW_down's operand);
//   dg = round_x(w dh u silu'(g)); du = round_x(w dh silu(g));
// and dw += dh h, element by element in order.
template <typename X, int V>
__device__ __forceinline__ void swiglu_backward_vec(const Vec<X, V>& gv, const Vec<X, V>& uv,
                                                    const Vec<float, V>& dv, float w, float& dw,
                                                    Vec<X, V>& hv, Vec<X, V>& dgv,
                                                    Vec<X, V>& duv) {
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const float gf = to_float(gv.v[i]), uf = to_float(uv.v[i]);
    const float s = sigmoid(gf);
    const float silu = gf * s;
    const float h = to_float(from_computed<X>(silu * uf));
    hv.v[i] = from_computed<X>(w * h);
    const float dhr = dv.v[i];
    dw += dhr * h;  // <dy, o> = <dy @ Wd^T, h>
    const float dhw = w * dhr;
    dgv.v[i] = from_computed<X>(dhw * uf * (s * (1.0f + gf * (1.0f - s))));
    duv.v[i] = from_computed<X>(dhw * silu);
  }
}

// SwiGLU's backward for one row, by one warp (every lane calls it), gate row g, up
// row g + ffn: swiglu_backward_vec over the row; returns <dh, h> over the row: lane l
// sums its elements (V at a time from l V, kU vectors per step of 32 V kU) in
// order, then warp_sum_fixed adds the lanes.
template <typename X, int V, int kU>
__device__ __forceinline__ float swiglu_backward_row(const X* __restrict__ g,
                                                     const float* __restrict__ dh, float w,
                                                     int64_t ffn, int lane, X* __restrict__ wh,
                                                     X* __restrict__ dg) {
  const X* u = g + ffn;
  X* du = dg + ffn;
  float dw = 0.0f;
  for (int64_t f0 = int64_t(lane) * V; f0 < ffn; f0 += 32 * V * kU) {
    Vec<X, V> gv[kU], uv[kU];
    Vec<float, V> dv[kU];
#pragma unroll
    for (int j = 0; j < kU; ++j) {
      const int64_t f = f0 + j * 32 * V;
      if (f < ffn) {
        gv[j] = load_vec<X, V>(g + f);
        uv[j] = load_vec<X, V>(u + f);
        dv[j] = load_floats_cg<V>(dh + f);
      }
    }
#pragma unroll
    for (int j = 0; j < kU; ++j) {
      const int64_t f = f0 + j * 32 * V;
      if (f >= ffn) continue;
      Vec<X, V> hv, dgv, duv;
      swiglu_backward_vec<X, V>(gv[j], uv[j], dv[j], w, dw, hv, dgv, duv);
      store_vec<X, V>(wh + f, hv);
      store_vec<X, V>(dg + f, dgv);
      store_vec<X, V>(du + f, duv);
    }
  }
  return warp_sum_fixed(dw);
}

}  // namespace mok::cuda
