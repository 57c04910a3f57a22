// Element types and problem shapes shared by every mok_jax launcher.
// Launchers see these, never XLA or nanobind types; the FFI handlers translate.
#pragma once

#include <cstdint>

namespace mok {

// Element type of a floating-point operand. Values are exported to Python through
// the bindings (mok_jax._mok.DType), so they are defined here once.
enum class DType : int32_t {
  kF32 = 0,
  kBF16 = 1,
};

// How the expert GEMMs compute: one value per numeric variant of the expert FFN,
// carried from the Python API (mok_jax.Recipe, built from the bindings'
// mok_jax._mok.recipes()) through one handler attribute to every launcher.
//   kNative: every GEMM in the activations' dtype (bf16 or f32), f32 accumulation
//            (the numerics of docs/contract.md).
//   kFp8:    every expert GEMM in float8_e4m3fn with f32 block scales (1x128 along
//            the reduction for activations, 128x128 for weights) and f32
//            accumulation; bf16 activations and weights (docs/contract.md).
enum class Recipe : int32_t {
  kNative = 0,
  kFp8 = 1,
};

inline const char* recipe_name(Recipe r) {
  switch (r) {
    case Recipe::kNative: return "native";
    case Recipe::kFp8: return "fp8";
  }
  return "unknown";
}

// The Recipe of an attribute value, or false for a value no recipe has.
inline bool to_recipe(int32_t value, Recipe* out) {
  switch (static_cast<Recipe>(value)) {
    case Recipe::kNative:
    case Recipe::kFp8:
      *out = static_cast<Recipe>(value);
      return true;
  }
  return false;
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "float32";
    case DType::kBF16: return "bfloat16";
  }
  return "unknown";
}

// Sizes of one MoE layer call on one device.
struct MoeShape {
  int64_t tokens;   // T: token rows of x
  int64_t top_k;    // K: expert slots per token
  int64_t experts;  // E: experts held by this device (all of them without EP)
  int64_t hidden;   // H: model width
  int64_t ffn;      // F: expert FFN width (w_gate_up has 2F columns)
};

// A capacity below zero means "never drop" (capacity_factor=None).
constexpr int64_t kNoCapacity = -1;

}  // namespace mok
