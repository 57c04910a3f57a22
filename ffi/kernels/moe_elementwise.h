// Memory-bound steps of the MoE layer around the grouped GEMMs: gathering rows
// into plan order, SwiGLU forward/backward, and the ordered combines.
// Rows past the plan's kept count (expert_begin[E], read on the device) are
// skipped, so nothing waits for the host: one warp per row, the rows strided
// over a grid of at most 4096 blocks.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "mok/types.h"

namespace mok::cuda {

// dst[r] = src[row_pair[r] / K] for kept rows r. [*, cols] of x.dtype (x rows in
// the forward, dy rows in the backward).
std::string gather_token_rows(DType dtype, const void* src, const int32_t* row_pair,
                              const int64_t* num_rows, int64_t max_rows, int64_t top_k,
                              int64_t cols, void* dst, cudaStream_t stream);

// From GEMM1's f32 accumulators gate_up_f32 [R, 2F]: h[r, f] = round_x(silu(g) * u)
// computed in f32, and, when gate_up_out is not null, the residual
// gate_up_out[r] = round_x(gate_up_f32[r]).
std::string swiglu_forward(DType dtype, const float* gate_up_f32, const int64_t* num_rows,
                           int64_t max_rows, int64_t ffn, void* h, void* gate_up_out,
                           cudaStream_t stream);

// Per kept row r (pair p): h = round_x(silu(g) u); d_expert_weights[p] = <dh_raw, h>
// (each lane's elements in order, then a fixed xor tree over the warp); dh = w dh_raw; d_gate_up = round_x([dh u silu'(g),
// dh silu(g)]); wh_rows = round_x(w h), dW_down's operand (w applied here, so
// the dy rows stay unweighted). Pairs without a row get d_expert_weights = 0.
std::string swiglu_backward(DType dtype, DType weight_dtype, const void* gate_up,
                            const float* dh_raw, const void* expert_weights,
                            const int32_t* row_pair, const int32_t* pair_row,
                            const int64_t* num_rows, int64_t max_rows, int64_t pairs,
                            int64_t ffn, void* wh_rows, void* d_gate_up,
                            void* d_expert_weights, cudaStream_t stream);

// out[t] = round_x(sum over k ascending of weight(t, k) * rows[pair_row[t * K + k]]),
// f32 sum; weight is expert_weights[t, k], or 1 when expert_weights is null.
std::string combine_rows(DType dtype, DType weight_dtype, const void* rows,
                         const void* expert_weights, const int32_t* pair_row, int64_t tokens,
                         int64_t top_k, int64_t hidden, void* out, cudaStream_t stream);

// d[e] = 0 for experts without rows ([E, per_expert] of x.dtype).
std::string zero_empty_experts(DType dtype, const int64_t* expert_begin, int64_t experts,
                               int64_t per_expert, void* d, cudaStream_t stream);

// out = w_gate_up [E, H, 2F] bf16 with its columns block-interleaved for the
// fused SwiGLU GEMM: out[e, k, 256b + t] = gate column 128b + t and
// out[e, k, 256b + 128 + t] = up column 128b + t, t < 128 (F % 128 == 0).
std::string interleave_gate_up(const void* w_gate_up, int64_t experts, int64_t hidden,
                               int64_t ffn, void* out, cudaStream_t stream);

}  // namespace mok::cuda
