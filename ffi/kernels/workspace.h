// Carving one scratch allocation into the arrays a launcher needs.
#pragma once

#include <cstddef>

namespace mok::cuda {

// Every carved array starts on a 256-byte boundary (TMA wants 16, vector loads 16).
constexpr size_t kWorkspaceAlign = 256;

inline size_t workspace_aligned(size_t bytes) {
  return (bytes + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
}

// Bump allocator over the caller's workspace; with a null base it only measures,
// so one function both sizes the workspace and lays it out.
class Carver {
 public:
  explicit Carver(void* base) : base_(static_cast<char*>(base)) {}
  void* take(size_t bytes) {
    char* at = base_ ? base_ + used_ : nullptr;
    used_ += workspace_aligned(bytes);
    return at;
  }
  size_t used() const { return used_; }

 private:
  char* base_;
  size_t used_ = 0;
};

}  // namespace mok::cuda
