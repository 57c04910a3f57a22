// NVLink transport, host side: one process drives its ranks of one NCCL
// communicator (all of them, or one rank per process, or anything between)
// through NCCL symmetric memory and the NCCL device API.
//
// Written against NCCL 2.28.9 exactly: ncclDevComm, ncclDevCommRequirements and
// ncclWindow_vidmem are plain structs shared by the host library and the device
// code compiled here, and their layouts change between 2.28.x and later
// releases. init() refuses a runtime library whose version differs from the
// headers this file was compiled with.
//
// What init() builds, in this order (destroy() undoes it in reverse):
//   1. the local ranks' communicators, ncclCommInitRank for each inside one
//      ncclGroupStart/End (with a fresh unique id when every rank is local);
//   2. N device communicators, ncclDevCommCreate (grouped: a collective), each
//      with `lsa_barriers` LSA barriers and no multimem. ncclDevCommCreate fails
//      on a communicator without symmetric-memory support, so this step also
//      proves that the windows of step 4 will be real symmetric windows;
//   3. one buffer of `buffer_bytes` per rank, ncclMemAlloc on its device;
//   4. one window per rank over that buffer, ncclCommWindowRegister(...,
//      NCCL_WIN_COLL_SYMMETRIC) (grouped: a collective).
// NVLink multicast (NVLS) is never requested; init() also refuses to run
// unless NCCL_NVLS_ENABLE=0 is set in the environment, so that NCCL's own
// symmetric kernels (set up by the first NCCL_WIN_COLL_SYMMETRIC window) do not
// create multicast objects either.
//
// Thread safety: none; one host thread drives all ranks. Nothing throws: each
// call returns an error message, empty on success.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include <cstddef>
#include <string>
#include <vector>

namespace mok::comm {

// The NCCL version whose headers this translation unit sees (e.g. 22809).
constexpr int kNcclHeaderVersion = NCCL_VERSION_CODE;

// "2.28.9" from a version code (works for both the old and the new encoding).
std::string nccl_version_string(int code);

// The runtime library's version (ncclGetVersion) and an error when it differs
// from kNcclHeaderVersion.
std::string check_nccl_runtime_version(int* runtime_version);

struct NvlinkCommConfig {
  int nranks = 0;            // ranks of the communicator (all processes); 0: devices.size()
  std::vector<int> ranks;    // this process's ranks; empty: 0..devices.size()-1
  std::vector<int> devices;  // CUDA ordinals; local rank i (ranks[i]) drives devices[i]
  // ncclUniqueId bytes shared by every process of the communicator (made by one
  // of them, NCCL_UNIQUE_ID_BYTES long); empty when this process holds every rank.
  std::string unique_id;
  size_t buffer_bytes = 0;   // symmetric buffer per rank (same on every rank)
  // LSA barriers per device communicator. A kernel uses one per CTA (index =
  // blockIdx.x), so this bounds the grid of every kernel that uses barriers.
  int lsa_barriers = 1024;
};

class NvlinkComm {
 public:
  NvlinkComm() = default;
  ~NvlinkComm();  // destroy(); a teardown error is printed to stderr
  NvlinkComm(const NvlinkComm&) = delete;
  NvlinkComm& operator=(const NvlinkComm&) = delete;

  // Builds everything (see the top of this file). On failure, what was built
  // is torn down again and the message says what failed (and anything the
  // teardown reported). The calling thread's current device is restored; a
  // failure to restore it is reported too, also after a build that succeeded
  // (initialized() is then true, and destroy() or the destructor tears it down).
  std::string init(const NvlinkCommConfig& config);

  // Waits for each device (cudaDeviceSynchronize), then: window deregister,
  // ncclMemFree, ncclDevCommDestroy, ncclCommFinalize (grouped) and
  // ncclCommDestroy (ncclCommAbort if the finalize failed). Carries on past
  // errors and reports them all. Idempotent; safe after a failed init().
  // abort=true skips the collective finalize (ncclCommAbort at once): for exit
  // and after a peer failed, when a finalize could wait for a rank that is gone.
  std::string destroy(bool abort = false);

  // Below, `rank` is the index of a local rank (0..local_count()-1) and
  // world_rank(rank) its rank in the communicator.
  bool initialized() const { return initialized_; }
  int local_count() const { return static_cast<int>(devices_.size()); }
  int size() const { return nranks_; }
  int world_rank(int rank) const { return ranks_[rank]; }
  int device(int rank) const { return devices_[rank]; }
  ncclComm_t nccl_comm(int rank) const { return comms_[rank]; }
  // Passed by value to kernels; the host copy stays valid until destroy().
  const ncclDevComm& dev_comm(int rank) const { return dev_comms_[rank]; }
  // Rank `rank`'s handle of the symmetric window (a device pointer: pass it to
  // kernels, do not dereference it on the host).
  ncclWindow_t window(int rank) const { return windows_[rank]; }
  // Rank `rank`'s own buffer, a plain device pointer on device(rank).
  void* buffer(int rank) const { return buffers_[rank]; }
  size_t buffer_bytes() const { return buffer_bytes_; }
  int lsa_barriers() const { return lsa_barriers_; }

 private:
  std::string init_steps(const NvlinkCommConfig& config);

  bool initialized_ = false;
  int nranks_ = 0;
  std::vector<int> ranks_;
  std::vector<int> devices_;
  std::vector<ncclComm_t> comms_;
  std::vector<ncclDevComm> dev_comms_;
  std::vector<char> dev_comm_created_;  // per rank: ncclDevCommDestroy is owed
  std::vector<void*> buffers_;
  std::vector<ncclWindow_t> windows_;
  size_t buffer_bytes_ = 0;
  int lsa_barriers_ = 0;
};

}  // namespace mok::comm
