// The FP8 recipe's primitives on CPU (docs/contract.md, "The fp8 recipe"):
// float -> float8_e4m3fn conversion, block scales, block quantizers and the
// block-scaled GEMM. Plain C++, no XLA types.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mok/types.h"

namespace mok::cpu {

constexpr int64_t kFp8Block = 128;  // block length of every fp8 scale
constexpr float kE4m3Max = 448.0f;  // largest finite float8_e4m3fn

// f32 -> float8_e4m3fn bits: round to nearest even, saturating to +-448 (0x7E /
// 0xFE; infinities too), NaN -> 0x7F with the input's sign. The bits of CUDA's
// __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3) for every f32.
uint8_t f32_to_e4m3(float v);

// The value of float8_e4m3fn bits (exact in f32).
float e4m3_to_f32(uint8_t bits);

// A block's scale: amax / 448 (f32 division), or 1 where that is 0 (amax 0, or
// below 448 * 2^-150, where the quotient underflows and v / 0 would make the
// block's values NaN or saturated); NaN or Inf when amax is (the block's values
// then become NaN or 0).
inline float fp8_scale(float amax) {
  const float s = amax / kE4m3Max;
  return s == 0.0f ? 1.0f : s;
}

// q8(v, s): the e4m3 value of v / s (f32 division), as f32.
inline float q8(float v, float s) { return e4m3_to_f32(f32_to_e4m3(v / s)); }

// Block boundaries along one dimension: [0, b1, ..., n]. Blocks of `block`
// elements (the last shorter) within each of `parts` equal parts of n (the gate
// and up halves of 2F are blocked separately: parts = 2).
std::vector<int64_t> fp8_bounds(int64_t n, int64_t block, int64_t parts = 1);

// Quantizes v [rows, cols] (row-major, f32) in the blocks that row_bounds x
// col_bounds cut it into: q[i, j] = q8(v[i, j], s[a, b]) for the block (a, b)
// holding (i, j), s[a, b] = fp8_scale(max |v| over the block) ([nra, ncb]).
// The amax propagates NaN.
void fp8_quantize(const float* v, int64_t rows, int64_t cols,
                  const std::vector<int64_t>& row_bounds,
                  const std::vector<int64_t>& col_bounds, float* q, float* s);

// The block-scaled GEMM: C[m, n] = sum over K-blocks kb ascending of
//   P_kb[i, j] * (sa[i, kb] * sb[kb, col_block[j]])
// with P_kb[i, j] = sum over k in kb ascending of aq[i, k] * bq[k, j] in f32,
// accumulated in one f32 value per element. aq [m, kd], sa [m, nkb], bq [kd, n],
// sb [nkb, ncb]; k_bounds the K-blocks (nkb + 1 entries). `scratch` is reused.
void fp8_gemm(const float* aq, const float* sa, const float* bq, const float* sb,
              const int32_t* col_block, int64_t ncb, const std::vector<int64_t>& k_bounds,
              int64_t m, int64_t n, float* c, std::vector<float>* scratch);

// col_block[j] for the columns that `bounds` cut into blocks.
std::vector<int32_t> fp8_col_blocks(const std::vector<int64_t>& bounds);

// The quantize op (mok_quantize_rows_fp8): x [N, K] (f32 or bf16) in row blocks
// of 128 along K; q [N, K] e4m3 bits, scales [N, ceil(K / 128)].
struct QuantizeRowsArgs {
  int64_t rows;
  int64_t cols;
  DType x_dtype;
  const void* x;
  uint8_t* q;
  float* scales;
};

// Empty on success, else a message.
std::string quantize_rows_fp8(const QuantizeRowsArgs& args);

}  // namespace mok::cpu
