// Error plumbing for the CUDA launchers: every CUDA call is checked and turned
// into a message; nothing throws.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace mok::cuda {

// Whether p may be the base of 16-byte vector accesses and TMA descriptors.
inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

inline std::string cuda_error(const char* what, cudaError_t err) {
  return std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
}

}  // namespace mok::cuda

// Returns a message from the enclosing function (returning std::string) on a CUDA error.
#define MOK_CUDA_RETURN_IF_ERROR(expr)                                  \
  do {                                                                  \
    cudaError_t _mok_err = (expr);                                      \
    if (_mok_err != cudaSuccess) return ::mok::cuda::cuda_error(#expr, _mok_err); \
  } while (0)

// Checks the launch just made.
#define MOK_CUDA_RETURN_IF_LAUNCH_FAILED(name) \
  MOK_CUDA_RETURN_IF_ERROR((static_cast<void>(name), cudaGetLastError()))

// Propagates a non-empty message.
#define MOK_RETURN_IF_MESSAGE(expr)            \
  do {                                         \
    std::string _mok_msg = (expr);             \
    if (!_mok_msg.empty()) return _mok_msg;    \
  } while (0)
