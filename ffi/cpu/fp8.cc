#include "fp8.h"

#include <algorithm>
#include <cmath>
#include <exception>

#include "gemm.h"
#include "mok/bf16.h"
#include "parallel.h"

namespace mok::cpu {

uint8_t f32_to_e4m3(float v) {
  const uint32_t u = float_bits(v);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7f;         // NaN
  if (a >= 0x43e00000u) return sign | 0x7e;        // >= 448 (and Inf): saturate
  const int32_t exp = static_cast<int32_t>(a >> 23) - 127;
  if (exp >= -6) {
    // Normal in e4m3: keep 3 of the 23 mantissa bits, round to nearest even; a
    // carry out of the mantissa moves to the next exponent, which is the right
    // result (below 448 it never reaches the NaN code).
    const uint32_t rounded = a + 0x7ffffu + ((a >> 20) & 1u);
    return sign | static_cast<uint8_t>((rounded >> 20) - ((127u - 7u) << 3));
  }
  // Subnormal (or zero) in e4m3: units of 2^-9. |v| = m * 2^(exp - 23) with the
  // implicit bit, so |v| / 2^-9 = m >> (14 - exp).
  if (exp < -10) return sign;  // |v| < 2^-10 (also f32 subnormals): rounds to 0
  const uint32_t m = (a & 0x7fffffu) | 0x800000u;
  const int shift = 14 - exp;  // 21 .. 24
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;  // q == 8 is the smallest normal
  return sign | static_cast<uint8_t>(q);
}

float e4m3_to_f32(uint8_t bits) {
  const uint32_t sign = uint32_t(bits & 0x80u) << 24;
  const uint32_t exp = (bits >> 3) & 0xfu, man = bits & 0x7u;
  if (exp == 0xf && man == 0x7) return bits_float(sign | 0x7fc00000u);
  if (exp == 0) return bits_float(sign | float_bits(static_cast<float>(man) * 0x1p-9f));
  return bits_float(sign | ((exp + 120u) << 23) | (man << 20));
}

std::vector<int64_t> fp8_bounds(int64_t n, int64_t block, int64_t parts) {
  std::vector<int64_t> bounds{0};
  const int64_t part = n / parts;
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t begin = p * part, end = p + 1 == parts ? n : begin + part;
    for (int64_t b = begin + block; b < end; b += block) bounds.push_back(b);
    if (end > begin) bounds.push_back(end);
  }
  return bounds;
}

std::vector<int32_t> fp8_col_blocks(const std::vector<int64_t>& bounds) {
  std::vector<int32_t> out(bounds.back());
  for (size_t b = 0; b + 1 < bounds.size(); ++b) {
    for (int64_t j = bounds[b]; j < bounds[b + 1]; ++j) out[j] = static_cast<int32_t>(b);
  }
  return out;
}

void fp8_quantize(const float* v, int64_t rows, int64_t cols,
                  const std::vector<int64_t>& row_bounds,
                  const std::vector<int64_t>& col_bounds, float* q, float* s) {
  const int64_t ncb = static_cast<int64_t>(col_bounds.size()) - 1;
  for (size_t a = 0; a + 1 < row_bounds.size(); ++a) {
    for (int64_t b = 0; b < ncb; ++b) {
      const int64_t c0 = col_bounds[b], c1 = col_bounds[b + 1];
      float amax = 0.0f;
      for (int64_t i = row_bounds[a]; i < row_bounds[a + 1]; ++i) {
        for (int64_t j = c0; j < c1; ++j) {
          const float m = std::fabs(v[i * cols + j]);
          if (m > amax || m != m) amax = m;  // a NaN stays
        }
      }
      const float scale = fp8_scale(amax);
      s[a * ncb + b] = scale;
      for (int64_t i = row_bounds[a]; i < row_bounds[a + 1]; ++i) {
        for (int64_t j = c0; j < c1; ++j) q[i * cols + j] = q8(v[i * cols + j], scale);
      }
    }
  }
  (void)rows;
}

void fp8_gemm(const float* aq, const float* sa, const float* bq, const float* sb,
              const int32_t* col_block, int64_t ncb, const std::vector<int64_t>& k_bounds,
              int64_t m, int64_t n, float* c, std::vector<float>* scratch) {
  const int64_t nkb = static_cast<int64_t>(k_bounds.size()) - 1;
  const int64_t kd = k_bounds.back();
  int64_t widest = 0;
  for (int64_t b = 0; b < nkb; ++b) widest = std::max(widest, k_bounds[b + 1] - k_bounds[b]);
  scratch->resize(m * widest + m * n);
  float* a_block = scratch->data();
  float* p = a_block + m * widest;
  std::fill(c, c + m * n, 0.0f);
  for (int64_t b = 0; b < nkb; ++b) {
    const int64_t k0 = k_bounds[b], len = k_bounds[b + 1] - k0;
    for (int64_t i = 0; i < m; ++i) {
      std::copy(aq + i * kd + k0, aq + i * kd + k0 + len, a_block + i * len);
    }
    gemm_f32(a_block, bq + k0 * n, p, m, n, len);  // P: k ascending from 0 in f32
    const float* sb_row = sb + b * ncb;
    for (int64_t i = 0; i < m; ++i) {
      const float sai = sa[i * nkb + b];
      float* ci = c + i * n;
      const float* pi = p + i * n;
      for (int64_t j = 0; j < n; ++j) ci[j] += pi[j] * (sai * sb_row[col_block[j]]);
    }
  }
}

namespace {

template <typename X>
void quantize_rows(const X* x, int64_t rows, int64_t cols, uint8_t* q, float* scales) {
  const int64_t nb = (cols + kFp8Block - 1) / kFp8Block;
  parallel_for(rows, cpu_threads(), [&](int64_t r, int) {
    const X* row = x + r * cols;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t c0 = b * kFp8Block, c1 = std::min(cols, c0 + kFp8Block);
      float amax = 0.0f;
      for (int64_t j = c0; j < c1; ++j) {
        const float m = std::fabs(to_float(row[j]));
        if (m > amax || m != m) amax = m;  // a NaN stays
      }
      const float scale = fp8_scale(amax);
      scales[r * nb + b] = scale;
      for (int64_t j = c0; j < c1; ++j) q[r * cols + j] = f32_to_e4m3(to_float(row[j]) / scale);
    }
  });
}

}  // namespace

std::string quantize_rows_fp8(const QuantizeRowsArgs& a) {
  try {
    if (a.x_dtype == DType::kF32) {
      quantize_rows(static_cast<const float*>(a.x), a.rows, a.cols, a.q, a.scales);
    } else {
      quantize_rows(static_cast<const bf16*>(a.x), a.rows, a.cols, a.q, a.scales);
    }
  } catch (const std::exception& err) {
    return std::string("mok_jax CPU fp8 quantize failed: ") + err.what();
  }
  return {};
}

}  // namespace mok::cpu
