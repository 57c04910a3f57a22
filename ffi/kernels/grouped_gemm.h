// Grouped GEMMs over the experts' row blocks (host launchers; raw pointers).
//
// Rows of expert e are rows [begin[e], begin[e+1]) of a packed [R, *] matrix;
// `expert_begin` lives on the device (the routing plan computed it), so no host
// synchronisation is needed. Every output element is reduced by one thread
// block in a fixed order: results are deterministic and do not depend on where
// a row sits, which keeps them invariant under expert parallelism.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "mok/types.h"

namespace mok::cuda {

// D[r, :n] = A[r, :k] @ W_e for every row r of expert e.
//   W_e = b + e * k * n, stored [k, n] row-major (transpose_b = false), or
//   W_e = b + e * n * k, stored [n, k] row-major, used transposed (transpose_b = true).
struct RowsGemm {
  int64_t experts;
  const int64_t* expert_begin;  // device [E + 1]
  int64_t max_rows;             // R bound (T * K): rows past begin[E] are untouched
  int64_t n, k;
  bool transpose_b;
  DType ab_dtype;               // A and B element type
  DType d_dtype;                // D element type (rounded from the f32 accumulator)
  const void* a;                // [R, k]
  const void* b;
  void* d;                      // [R, n]
};

// D_e[m, n] = sum over rows r of expert e, ascending: A[r, m] * B[r, n].
// Experts without rows get D_e = 0.
struct WeightGradGemm {
  int64_t experts;
  const int64_t* expert_begin;  // device [E + 1]
  int64_t max_rows;
  int64_t m, n;
  DType dtype;                  // A, B and D element type
  const void* a;                // [R, m]
  const void* b;                // [R, n]
  void* d;                      // [E, m, n]
};

// Forward GEMM1 and SwiGLU in one kernel (bf16, tensor cores, F % 128 == 0):
// h = round(silu(g) * u) and, when gate_up_out is set, the rounded gate/up
// residual, from x_rows @ w_gate_up. `interleaved` is scratch for the
// block-interleaved weight (swiglu_interleave_bytes). Used on the shapes of
// mok::swiglu_epilogue_shape (mok/swiglu_rule.h): many rows per weight byte.
struct SwigluGemm {
  int64_t experts;
  const int64_t* expert_begin;  // device [E + 1]
  int64_t max_rows;             // R
  int64_t hidden, ffn;
  DType dtype;
  const void* x_rows;           // [R, H]
  const void* w_gate_up;        // [E, H, 2F]
  void* h;                      // [R, F]
  void* gate_up_out;            // [R, 2F] or null
};
// Turns the SwiGLU epilogue off (false) or back on for every later call in this
// process; returns the previous setting. The unfused path (GEMM1 to f32, then the
// SwiGLU kernel) gives the same bits: the switch exists so that tests can show it.
bool set_swiglu_epilogue(bool enabled);
// Bytes of the interleaved weight, 0 where the fused kernel is not used for that size.
size_t swiglu_interleave_bytes(int64_t experts, int64_t hidden, int64_t ffn, int64_t rows);
// Runs the fused kernel and sets *ran when it applies to `p` on this device (and
// set_swiglu_epilogue has not turned it off); leaves *ran false, running nothing,
// otherwise.
std::string run_swiglu_gemm(const SwigluGemm& p, void* interleaved, void* workspace,
                            size_t workspace_bytes, cudaStream_t stream, bool* ran);

// Workspace every launcher here needs for `experts` experts on the current device
// (pointer arrays, problem shapes, the tensor-core kernels' own workspace; 2E
// groups for run_weight_grad_gemms).
size_t grouped_gemm_workspace_bytes(int64_t experts);

// True when the tensor-core (TMA + wgmma) path serves this problem on a device
// of compute capability `cc` (major * 10 + minor); the SIMT fallback serves the
// rest (f32, sizes not multiple of 8, other GPUs).
bool rows_gemm_uses_tensor_cores(const RowsGemm& p, int cc);
bool weight_grad_uses_tensor_cores(const WeightGradGemm& p, int cc);

// Return an empty string on success, else what failed.
// simt_tile_begin: the routing plan's tile map, used by the SIMT fallback.
std::string run_rows_gemm(const RowsGemm& p, const int64_t* simt_tile_begin, void* workspace,
                          size_t workspace_bytes, cudaStream_t stream);
std::string run_weight_grad_gemm(const WeightGradGemm& p, void* workspace,
                                 size_t workspace_bytes, cudaStream_t stream);
// Both weight gradients of a layer, p and q over the same experts' rows (the same
// expert_begin), in one tensor-core launch where both take that path (else one
// after the other). Each output element is the same reduction as in
// run_weight_grad_gemm, so the results are the same bits; the launch only deals
// the two problems' tiles over the SMs together.
std::string run_weight_grad_gemms(const WeightGradGemm& p, const WeightGradGemm& q,
                                  void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace mok::cuda
