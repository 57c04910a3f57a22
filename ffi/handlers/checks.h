// Shape and dtype checks shared by the FFI handlers. Each returns an
// InvalidArgument error naming the buffer and both shapes, so a mismatch that
// got past mok_jax.moe's Python validation is still reported, never run.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <string>

#include "mok/types.h"
#include "xla/ffi/api/ffi.h"

namespace mok::ffi_checks {

namespace ffi = xla::ffi;

inline std::string dims_str(ffi::Span<const int64_t> dims) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < dims.size(); ++i) s << (i ? ", " : "") << dims[i];
  s << "]";
  return s.str();
}

inline std::string dims_str(std::initializer_list<int64_t> dims) {
  std::ostringstream s;
  s << "[";
  size_t i = 0;
  for (int64_t d : dims) s << (i++ ? ", " : "") << d;
  s << "]";
  return s.str();
}

// The buffer named `name` must have exactly the shape `want`.
template <typename Buffer>
ffi::Error expect_shape(const char* op, const char* name, const Buffer& buf,
                                       std::initializer_list<int64_t> want) {
  auto dims = buf.dimensions();
  bool ok = dims.size() == want.size();
  size_t i = 0;
  for (int64_t d : want) {
    if (!ok) break;
    ok = dims[i++] == d;
  }
  if (ok) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(op) + ": " + name + " has shape " +
                                     dims_str(dims) + ", expected " + dims_str(want) +
                                     " (shapes are derived in mok_jax.moe)");
}

inline std::optional<DType> to_mok_dtype(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return DType::kF32;
    case ffi::DataType::BF16: return DType::kBF16;
    default: return std::nullopt;
  }
}

// The buffer named `name` must hold `want` elements.
template <typename Buffer>
ffi::Error expect_dtype(const char* op, const char* name, const Buffer& buf,
                                       DType want) {
  auto got = to_mok_dtype(buf.element_type());
  if (got && *got == want) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(op) + ": " + name + " must be " +
                                     dtype_name(want) + " (the Python wrappers check dtypes)");
}

// A launcher's result (empty, or what went wrong) as the handler's ffi::Error, the
// one place where launcher errors become XLA errors. `code`: kInvalidArgument for
// operands found bad only at run time (CPU group sizes), kInternal for the rest.
inline ffi::Error launcher_result(const char* op, const std::string& err,
                                  ffi::ErrorCode code = ffi::ErrorCode::kInternal) {
  if (err.empty()) return ffi::Error::Success();
  return ffi::Error(code, std::string("mok_jax ") + op + ": " + err);
}

}  // namespace mok::ffi_checks

// Returns from the enclosing handler when a check fails.
#define MOK_RETURN_IF_ERROR(expr)            \
  do {                                       \
    ::xla::ffi::Error _mok_err = (expr);     \
    if (_mok_err.failure()) return _mok_err; \
  } while (0)
