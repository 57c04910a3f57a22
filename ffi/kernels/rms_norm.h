// Residual add fused with RMSNorm, forward and backward: the pre-norm
// transformer's `s = x + branch; n = rmsnorm(s) * scale` in one pass over the
// rows each way (XLA makes a row reduction and the broadcast that follows it
// two passes, and the residual add a third).
//
// Numerics, per row of D elements, f32 arithmetic, T the element type (f32 or
// bf16), scale f32:
//   forward:  s = round_T(x + branch); rstd = 1 / sqrt(sum(s^2) / D + eps);
//             n = round_T(s * (rstd * scale))
//   backward: g = dn * scale; dot = sum(g * s);
//             d = round_T(ds + rstd * g - s * (rstd^3 * dot / D))   (the gradient
//             of both x and branch; ds is the cotangent of s)
//             dscale_partials[p] = sum over the rows of group p (kNormRowsPerGroup
//             consecutive rows, in order) of dn * s * rstd
// Every row sum is each lane's elements in column order, then a fixed xor tree
// over the warp, then the warps in order: the same bits on every run and for
// every grid. The caller sums the partials over p (mok_jax/norm.py: an XLA
// reduce, then under row sharding a psum over the devices, so the scale
// gradient's bits depend on how the rows are split, unlike mok_jax.moe's).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "mok/types.h"

namespace mok::cuda {

// Rows per scale-gradient partial: a constant of the numerics (not of the
// machine), so the partials are the same on every GPU.
constexpr int64_t kNormRowsPerGroup = 16;

// Widest bf16 row the kernels take (elements; half that in f32); D must also be a
// multiple of 8.
constexpr int64_t kNormMaxDim = 16384;

// Empty when the kernels take rows of `dim` elements of `dtype`, else why not.
std::string add_rms_norm_unsupported(DType dtype, int64_t dim);

// x, branch, sum, out: [rows, dim] of dtype; scale [dim] f32; rstd [rows] f32.
std::string add_rms_norm_forward(DType dtype, const void* x, const void* branch,
                                 const float* scale, int64_t rows, int64_t dim, float epsilon,
                                 void* sum, void* out, float* rstd, cudaStream_t stream);

// dn, ds, sum, d: [rows, dim] of dtype; rstd [rows] f32; scale [dim] f32;
// dscale_partials [ceil(rows / kNormRowsPerGroup), dim] f32.
std::string add_rms_norm_backward(DType dtype, const void* dn, const void* ds, const void* sum,
                                  const float* rstd, const float* scale, int64_t rows,
                                  int64_t dim, void* d, float* dscale_partials,
                                  cudaStream_t stream);

}  // namespace mok::cuda
