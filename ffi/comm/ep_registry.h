// The fused EP transport's host state: communicator sets by handle.
//
// A set holds, for one layout of EP groups (one mesh axis of one mesh), this
// process's NvlinkComm of every group that has a local device, each with its
// symmetric windows. Python (mok_jax/comm.py) creates it at trace time, before
// any kernel that uses it runs; the FFI handlers find their rank by (handle,
// CUDA ordinal). No XLA types here.
//
// Failed barriers: a watchdog thread polls every rank's host-mapped
// ErrorRecord and prints the first failure of each (which rank, which phase,
// which peer, how long) to stderr; the kernel itself traps, so the step ends
// with a CUDA error rather than a hang.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <shared_mutex>
#include <string>
#include <vector>

#include "ep_kernels.cuh"

namespace mok::comm {

struct GroupSpec {
  int nranks = 0;
  std::vector<int> ranks;    // this process's ranks of the group
  std::vector<int> devices;  // their CUDA ordinals
  std::string unique_id;     // empty when every rank is local
};

// One local rank, as a handler sees it.
struct RankView {
  ncclWindow_t window = nullptr;
  void* buffer = nullptr;    // this rank's own window memory (a device pointer)
  size_t window_bytes = 0;
  int rank = 0;
  int nranks = 0;
  uint64_t* epoch = nullptr;      // device
  ErrorRecord* error = nullptr;   // device view of the host-mapped record
  uint64_t timeout_ns = 0;
};

// Creates a set; returns its handle (> 0) or 0 with *err set. `fingerprint`
// identifies the set's groups (all their devices, in order): handlers check it
// against their attribute, so an executable made for other devices (a
// compilation cache hit, another process's handle numbering) fails instead of
// moving rows between the wrong ranks. A set is never rebuilt in place: a
// larger window is a new set, and executables compiled for the old one keep it.
int64_t create_comm_set(const std::vector<GroupSpec>& groups, size_t window_bytes,
                        double timeout_s, uint64_t fingerprint, std::string* err);
// Destroys every set (abort) and stops the watchdog: for interpreter exit.
std::string shutdown_comm_sets();

// The NCCL version code of the headers this was compiled with.
int nccl_header_version();

// The first failure any barrier recorded, as text ("" if none).
std::string comm_last_error();

// Holds the registry's shared lock for the duration of one handler.
class RankLookup {
 public:
  // Empty message on success; then view() is valid until this object dies.
  std::string find(int64_t handle, uint64_t fingerprint, int device);
  const RankView& view() const { return view_; }

 private:
  std::shared_lock<std::shared_mutex> lock_;
  RankView view_;
};

}  // namespace mok::comm
