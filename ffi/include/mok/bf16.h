// bfloat16 <-> float conversion with round-to-nearest-even, usable on host and
// device. Rounding here is the contract's "rounded to x.dtype", so it must match
// XLA's convert (RNE, NaN stays NaN).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MOK_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MOK_HOST_DEVICE inline
#endif

namespace mok {

struct bf16 {
  uint16_t bits;
};
static_assert(sizeof(bf16) == 2, "bf16 must be two bytes");

MOK_HOST_DEVICE uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

MOK_HOST_DEVICE float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

MOK_HOST_DEVICE float to_float(bf16 v) { return bits_float(uint32_t(v.bits) << 16); }
MOK_HOST_DEVICE float to_float(float v) { return v; }

MOK_HOST_DEVICE bf16 float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep sign, force a quiet payload
    return bf16{uint16_t((u >> 16) | 0x0040u)};
  }
  uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return bf16{uint16_t((u + rounding_bias) >> 16)};
}

// Converts a float to element type T (float or bf16).
template <typename T>
MOK_HOST_DEVICE T from_float(float f);
template <>
MOK_HOST_DEVICE float from_float<float>(float f) { return f; }
template <>
MOK_HOST_DEVICE bf16 from_float<bf16>(float f) { return float_to_bf16(f); }

// Rounds a float to the precision of T and back: the contract's "rounded to x.dtype".
template <typename T>
MOK_HOST_DEVICE float round_to(float f) { return to_float(from_float<T>(f)); }

}  // namespace mok
