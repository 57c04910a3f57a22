// Block quantization to float8_e4m3fn with f32 scales: the operands of the fp8
// recipe's grouped GEMMs. Every block's scale is amax / 448 (1 for an all-zero
// block), every value q8(v / s) with an IEEE f32 division, round to nearest even,
// saturated to +-448; NaN in a block makes the block's scale NaN. Deterministic:
// each block is reduced by one warp or one thread block (amax does not depend on
// the order).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "mok/types.h"

namespace mok::cuda {

constexpr int64_t kFp8Block = 128;

inline int64_t fp8_round_up(int64_t v) { return (v + kFp8Block - 1) / kFp8Block * kFp8Block; }
inline int64_t fp8_blocks(int64_t v) { return (v + kFp8Block - 1) / kFp8Block; }

// Rows along K in 1x128 blocks. The row's K elements are `halves` (1 or 2)
// halves of `half` elements each (src column h * half + j); in the output, half h
// starts at column h * out_half and its blocks' scales at scale column
// h * (out_half / 128), rows out_row_stride bytes apart and scale rows
// scale_row_stride floats apart. With out_half = round_up(half, 128) the columns
// [half, out_half) are written as zeros (pad = true); with out_half = half (one
// half) nothing is padded. Rows at or past *num_rows (when num_rows is not null)
// are left untouched.
// Scales: row-major (row r's block c at scales[r * scale_row_stride + c]), or, with
// group_begin set, per group as CUTLASS's M-major SFA wants them: the rows of group
// g (rows group_begin[g] .. group_begin[g + 1]) hold the scales
// [begin * C + c * rows_g + (r - begin)], C = scales per row (a row's group is
// found by binary search).
struct RowQuant {
  DType src_dtype;             // bf16 or f32
  const void* src;             // [rows, halves * half]
  int64_t rows;
  int64_t halves;
  int64_t half;
  const int64_t* num_rows;     // device scalar or null (all rows)
  uint8_t* q;                  // e4m3 bytes
  int64_t out_half;            // columns per output half
  int64_t out_row_stride;      // bytes per output row
  float* scales;
  int64_t scale_row_stride;    // floats per scale row (row-major scales)
  const int64_t* group_begin = nullptr;  // device [groups + 1], or null
  int64_t groups = 0;
};
std::string quantize_rows_fp8(const RowQuant& p, cudaStream_t stream);

// SwiGLU forward and the quantized h: gate_up_f32 [R, 2 * ffn_pad] (gate at
// column f, up at ffn_pad + f, the fp8 GEMM1's padded output) gives h = silu(g) u
// in f32 (as moe_elementwise.cu's swiglu_forward), its e4m3 values hq [R, ffn_pad]
// (zero past ffn) and scales (ffn_pad / 128 per row, laid out as RowQuant's:
// row-major, or per group with group_begin set); gate_up_out [R, 2 * ffn] (bf16)
// when not null.
std::string swiglu_forward_quantize_fp8(const float* gate_up_f32, const int64_t* num_rows,
                                        int64_t max_rows, int64_t ffn, int64_t ffn_pad,
                                        void* gate_up_out, uint8_t* hq, float* h_scales,
                                        const int64_t* group_begin, int64_t groups,
                                        cudaStream_t stream);

// One bf16 weight matrix per expert, [p, q] at src + e * src_expert_stride + i * ld
// + col_offset + j, blocked 128x128 (row blocks a over p, column blocks b over q).
// transposed = true (the forward's B = W^T, K = p contiguous):
//   q8 at dst + e * dst_expert_stride + (n_offset + j) * dst_ld + i for
//   j < round_up(q, 128), i < round_up(p, 128) (zeros outside [p, q]); the scale
//   of block (a, b) is that of (N block nb = n_offset / 128 + b, K block kb = a).
// transposed = false (the dgrad's B = W as stored, K = q contiguous):
//   q8 at dst + e * dst_expert_stride + i * dst_ld + k_offset + j for i < p,
//   j < round_up(q, 128) (zeros past q); the scale of block (a, b) is that of
//   (N block nb = a, K block kb = k_offset / 128 + b).
// The scale of (nb, kb) goes to scales[e * scale_expert_stride + nb * scale_n + kb *
// scale_k] (CUTLASS's N-major SFB: scale_n = 1, scale_k = N blocks).
struct WeightQuant {
  const void* src;  // bf16
  int64_t experts, p, q;
  int64_t src_expert_stride, ld, col_offset;
  bool transposed;
  uint8_t* dst;
  int64_t dst_expert_stride, dst_ld;
  int64_t offset;  // n_offset (transposed) or k_offset; a multiple of 128
  float* scales;
  int64_t scale_expert_stride, scale_n, scale_k;
};
std::string quantize_weight_fp8(const WeightQuant& p, cudaStream_t stream);

// padded_begin[e] = sum over e' < e of round_up(rows of e', 128), e = 0..E (one thread).
std::string fp8_padded_begin(const int64_t* expert_begin, int64_t experts, int64_t* padded_begin,
                             cudaStream_t stream);

// Rows bound of the padded row space: every expert's rows start 128-aligned.
inline int64_t fp8_padded_rows(int64_t rows, int64_t experts) {
  return fp8_round_up(rows + (kFp8Block - 1) * experts);
}

// The weight gradients' operands: bf16 rows src [R, cols] (row stride ld) per
// expert, transposed and quantized in column blocks along rows: for expert e and
// its rows r = begin + 128 t + i (i < 128), q8 at dst[c * dst_ld + padded_begin[e] +
// 128 t + i] (zero past the expert's last row, up to its padded end) and the scale
// of (column c, row block t) at scales[(padded_begin[e] / 128 + t) * cols + c].
// dst_ld = fp8_padded_rows(R, E); scales hold dst_ld / 128 rows of cols.
struct TransposeQuant {
  const void* src;  // bf16
  int64_t rows, cols, ld;
  int64_t experts;
  const int64_t* expert_begin;  // device [E + 1]
  const int64_t* padded_begin;  // device [E + 1]
  uint8_t* dst;  // 16-byte aligned
  int64_t dst_ld;
  float* scales;
  bool vec = false;  // set by quantize_transposed_fp8: rows load 8 columns at a time
};
std::string quantize_transposed_fp8(const TransposeQuant& p, cudaStream_t stream);

}  // namespace mok::cuda
