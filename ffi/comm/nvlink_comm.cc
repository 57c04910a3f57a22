// NVLink transport, host side: see nvlink_comm.h.
#include "nvlink_comm.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>

#include "comm_check.h"

namespace mok::comm {

namespace {

std::string rank_prefix(int rank, int device) {
  return "rank " + std::to_string(rank) + " (device " + std::to_string(device) + "): ";
}

}  // namespace

std::string nccl_version_string(int code) {
  int major, minor, patch;
  if (code >= 10000) {  // NCCL_VERSION for 2.9 and later: X*10000 + Y*100 + Z
    major = code / 10000;
    minor = (code / 100) % 100;
    patch = code % 100;
  } else {  // up to 2.8: X*1000 + Y*100 + Z
    major = code / 1000;
    minor = (code / 100) % 10;
    patch = code % 100;
  }
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

std::string check_nccl_runtime_version(int* runtime_version) {
  int version = 0;
  MOK_COMM_NCCL_RETURN(ncclGetVersion(&version));
  if (runtime_version != nullptr) *runtime_version = version;
  if (version != kNcclHeaderVersion) {
    return "NCCL runtime library is " + nccl_version_string(version) + " (" +
           std::to_string(version) + ") but this code was compiled against the " +
           nccl_version_string(kNcclHeaderVersion) + " headers (" +
           std::to_string(kNcclHeaderVersion) +
           "); the device API structs (ncclDevComm, ncclWindow_vidmem) differ between "
           "releases, so the library and the headers must come from the same NCCL";
  }
  return "";
}

NvlinkComm::~NvlinkComm() {
  std::string err = destroy();
  if (!err.empty()) std::fprintf(stderr, "mok::comm::NvlinkComm teardown:\n%s\n", err.c_str());
}

std::string NvlinkComm::init(const NvlinkCommConfig& config) {
  if (initialized_) return "NvlinkComm::init: already initialized (call destroy() first)";
  DeviceGuard guard;
  std::string err = init_steps(config);
  if (err.empty()) {
    initialized_ = true;
  } else {
    append_error(err, destroy());
  }
  append_error(err, guard.restore());
  return err;
}

std::string NvlinkComm::init_steps(const NvlinkCommConfig& config) {
  const int n = static_cast<int>(config.devices.size());
  if (n < 1) return "NvlinkComm::init: no devices";
  const int nranks = config.nranks > 0 ? config.nranks : n;
  std::vector<int> ranks = config.ranks;
  if (ranks.empty()) {
    for (int r = 0; r < n; ++r) ranks.push_back(r);
  }
  if (static_cast<int>(ranks.size()) != n) return "NvlinkComm::init: ranks and devices differ in length";
  if (n > nranks) return "NvlinkComm::init: more local ranks than nranks";
  if (config.buffer_bytes == 0) return "NvlinkComm::init: buffer_bytes is 0";
  if (config.lsa_barriers < 1) return "NvlinkComm::init: lsa_barriers must be >= 1";
  {
    std::set<int> seen(config.devices.begin(), config.devices.end());
    if (static_cast<int>(seen.size()) != n) return "NvlinkComm::init: a device is listed twice";
    std::set<int> seen_ranks(ranks.begin(), ranks.end());
    if (static_cast<int>(seen_ranks.size()) != n) return "NvlinkComm::init: a rank is listed twice";
    for (int r : ranks) {
      if (r < 0 || r >= nranks) return "NvlinkComm::init: rank " + std::to_string(r) + " not in [0, nranks)";
    }
  }
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (config.unique_id.empty()) {
    if (n != nranks) return "NvlinkComm::init: a unique id is needed when other processes hold ranks";
  } else if (config.unique_id.size() != sizeof(id.internal)) {
    return "NvlinkComm::init: unique_id has " + std::to_string(config.unique_id.size()) +
           " bytes, expected " + std::to_string(sizeof(id.internal));
  } else {
    std::memcpy(id.internal, config.unique_id.data(), sizeof(id.internal));
  }

  // Multicast stays off: NCCL's own symmetric kernels would otherwise ask for
  // NVLS when the first NCCL_WIN_COLL_SYMMETRIC window is registered.
  const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
  if (nvls == nullptr || std::strcmp(nvls, "0") != 0) {
    return std::string("NvlinkComm::init: NCCL_NVLS_ENABLE must be set to 0 (NVLink multicast "
                       "stays off); it is ") +
           (nvls == nullptr ? "unset" : "'" + std::string(nvls) + "'");
  }

  MOK_COMM_RETURN_IF_MESSAGE(check_nccl_runtime_version(nullptr));
  if (config.unique_id.empty()) MOK_COMM_NCCL_RETURN(ncclGetUniqueId(&id));

  int visible = 0;
  MOK_COMM_CUDA_RETURN(cudaGetDeviceCount(&visible));
  for (int r = 0; r < n; ++r) {
    const int d = config.devices[r];
    if (d < 0 || d >= visible) {
      return "NvlinkComm::init: device " + std::to_string(d) + " does not exist (" +
             std::to_string(visible) + " visible)";
    }
  }
  // Symmetric memory needs CUDA P2P between every pair; say so plainly here
  // (for the local pairs; remote ones show in step 2's LSA team check) rather
  // than through ncclDevCommCreate's "no symmetric support".
  for (int a = 0; a < n; ++a) {
    for (int b = 0; b < n; ++b) {
      if (a == b) continue;
      int can = 0;
      MOK_COMM_CUDA_RETURN(cudaDeviceCanAccessPeer(&can, config.devices[a], config.devices[b]));
      if (!can) {
        return "NvlinkComm::init: device " + std::to_string(config.devices[a]) +
               " cannot access device " + std::to_string(config.devices[b]) +
               " (cudaDeviceCanAccessPeer = 0): no load/store path between them";
      }
    }
  }

  nranks_ = nranks;
  ranks_ = ranks;
  devices_ = config.devices;
  buffer_bytes_ = config.buffer_bytes;
  lsa_barriers_ = config.lsa_barriers;
  comms_.assign(n, nullptr);
  dev_comms_.assign(n, ncclDevComm{});
  dev_comm_created_.assign(n, 0);
  buffers_.assign(n, nullptr);
  windows_.assign(n, nullptr);

  // 1. Communicators: every local rank's ncclCommInitRank in one group (a
  // single thread drives them; the ranks of other processes join with the same id).
  {
    std::string err;
    MOK_COMM_NCCL_RETURN(ncclGroupStart());
    for (int r = 0; r < n; ++r) {
      MOK_COMM_CUDA_COLLECT(err, cudaSetDevice(devices_[r]));
      MOK_COMM_NCCL_COLLECT(err, ncclCommInitRank(&comms_[r], nranks_, id, ranks_[r]));
    }
    MOK_COMM_NCCL_COLLECT(err, ncclGroupEnd());
    if (!err.empty()) return err;
  }
  for (int r = 0; r < n; ++r) {
    int rank = -1, count = -1, dev = -1;
    MOK_COMM_NCCL_RETURN(ncclCommUserRank(comms_[r], &rank));
    MOK_COMM_NCCL_RETURN(ncclCommCount(comms_[r], &count));
    MOK_COMM_NCCL_RETURN(ncclCommCuDevice(comms_[r], &dev));
    if (rank != ranks_[r] || count != nranks_ || dev != devices_[r]) {
      return rank_prefix(ranks_[r], devices_[r]) + "communicator reports rank " + std::to_string(rank) +
             " of " + std::to_string(count) + " on device " + std::to_string(dev);
    }
  }

  // 2. Device communicators. ncclDevCommCreate is a collective: for one thread
  // driving N communicators every call must sit in one group; the work (and the
  // writes to dev_comms_[r]) happens in ncclGroupEnd.
  {
    ncclDevCommRequirements reqs;
    std::memset(&reqs, 0, sizeof(reqs));  // 2.28.9 has no initializer macro for it
    reqs.lsaMultimem = false;             // never NVLS
    reqs.lsaBarrierCount = config.lsa_barriers;
    std::string err;
    MOK_COMM_NCCL_RETURN(ncclGroupStart());
    for (int r = 0; r < n; ++r) {
      MOK_COMM_NCCL_COLLECT(err, ncclDevCommCreate(comms_[r], &reqs, &dev_comms_[r]));
    }
    MOK_COMM_NCCL_COLLECT(err, ncclGroupEnd());
    if (!err.empty()) return err;
    for (int r = 0; r < n; ++r) dev_comm_created_[r] = 1;
  }
  for (int r = 0; r < n; ++r) {
    const ncclDevComm& dc = dev_comms_[r];
    if (dc.rank != ranks_[r] || dc.nRanks != nranks_ || dc.lsaSize != nranks_ ||
        dc.lsaRank != ranks_[r]) {
      return rank_prefix(ranks_[r], devices_[r]) + "device communicator has rank " +
             std::to_string(dc.rank) + "/" + std::to_string(dc.nRanks) + ", LSA rank " +
             std::to_string(dc.lsaRank) + "/" + std::to_string(dc.lsaSize) +
             ": every rank must be load/store accessible from every other (one LSA team)";
    }
    if (dc.lsaBarrier.nBarriers < config.lsa_barriers) {
      return rank_prefix(ranks_[r], devices_[r]) + "device communicator has " +
             std::to_string(dc.lsaBarrier.nBarriers) + " LSA barriers, asked for " +
             std::to_string(config.lsa_barriers);
    }
  }

  // 3. Buffers: ncclMemAlloc allocates on the current device (cuMem, mapped
  // for every P2P-capable peer).
  for (int r = 0; r < n; ++r) {
    MOK_COMM_CUDA_RETURN(cudaSetDevice(devices_[r]));
    MOK_COMM_NCCL_RETURN(ncclMemAlloc(&buffers_[r], buffer_bytes_));
    if (buffers_[r] == nullptr) return rank_prefix(ranks_[r], devices_[r]) + "ncclMemAlloc gave null";
    MOK_COMM_CUDA_RETURN(cudaMemset(buffers_[r], 0, buffer_bytes_));
    MOK_COMM_CUDA_RETURN(cudaDeviceSynchronize());
  }

  // 4. Windows: ncclCommWindowRegister is a collective too (grouped; the
  // window handles are written in ncclGroupEnd).
  {
    std::string err;
    MOK_COMM_NCCL_RETURN(ncclGroupStart());
    for (int r = 0; r < n; ++r) {
      MOK_COMM_NCCL_COLLECT(err, ncclCommWindowRegister(comms_[r], buffers_[r], buffer_bytes_,
                                                        &windows_[r], NCCL_WIN_COLL_SYMMETRIC));
    }
    MOK_COMM_NCCL_COLLECT(err, ncclGroupEnd());
    if (!err.empty()) return err;
  }
  for (int r = 0; r < n; ++r) {
    // 2.28.9 returns success and leaves the handle untouched when the
    // communicator has no symmetric support; step 2 already rules that out.
    if (windows_[r] == nullptr) {
      return rank_prefix(ranks_[r], devices_[r]) +
             "ncclCommWindowRegister succeeded but gave no window (no symmetric-memory support?)";
    }
  }
  return "";
}

std::string NvlinkComm::destroy(bool abort) {
  std::string all;
  const int n = static_cast<int>(devices_.size());
  if (n == 0) {
    initialized_ = false;
    return all;
  }
  DeviceGuard guard;

  // Nothing may still run on the buffers or the barriers.
  for (int r = 0; r < n; ++r) {
    if (comms_[r] == nullptr) continue;
    MOK_COMM_CUDA_COLLECT(all, cudaSetDevice(devices_[r]));
    MOK_COMM_CUDA_COLLECT(all, cudaDeviceSynchronize());
  }
  // Windows (local in 2.28.9: unmaps this rank's view of every peer).
  for (int r = 0; r < n; ++r) {
    if (windows_[r] == nullptr) continue;
    MOK_COMM_NCCL_COLLECT(all, ncclCommWindowDeregister(comms_[r], windows_[r]));
    windows_[r] = nullptr;
  }
  // Buffers (ncclMemFree switches to the buffer's device itself).
  for (int r = 0; r < n; ++r) {
    if (buffers_[r] == nullptr) continue;
    MOK_COMM_NCCL_COLLECT(all, ncclMemFree(buffers_[r]));
    buffers_[r] = nullptr;
  }
  // Device communicators (local: deregisters the barrier resource window).
  for (int r = 0; r < n; ++r) {
    if (!dev_comm_created_[r]) continue;
    MOK_COMM_NCCL_COLLECT(all, ncclDevCommDestroy(comms_[r], &dev_comms_[r]));
    dev_comm_created_[r] = 0;
  }
  // Communicators: ncclCommFinalize is collective, so grouped; then the local
  // ncclCommDestroy. After a failed finalize, abort instead (does not block).
  bool any_comm = false;
  for (int r = 0; r < n; ++r) any_comm = any_comm || comms_[r] != nullptr;
  if (any_comm && abort) {
    for (int r = 0; r < n; ++r) {
      if (comms_[r] == nullptr) continue;
      MOK_COMM_NCCL_COLLECT(all, ncclCommAbort(comms_[r]));
      comms_[r] = nullptr;
    }
  } else if (any_comm) {
    std::string finalize_err;
    ncclResult_t start = ncclGroupStart();
    if (start != ncclSuccess) {
      append_error(finalize_err, nccl_message("ncclGroupStart()", start, __FILE__, __LINE__));
    } else {
      for (int r = 0; r < n; ++r) {
        if (comms_[r] == nullptr) continue;
        MOK_COMM_NCCL_COLLECT(finalize_err, ncclCommFinalize(comms_[r]));
      }
      MOK_COMM_NCCL_COLLECT(finalize_err, ncclGroupEnd());
    }
    append_error(all, finalize_err);
    for (int r = 0; r < n; ++r) {
      if (comms_[r] == nullptr) continue;
      if (finalize_err.empty()) {
        MOK_COMM_NCCL_COLLECT(all, ncclCommDestroy(comms_[r]));
      } else {
        MOK_COMM_NCCL_COLLECT(all, ncclCommAbort(comms_[r]));
      }
      comms_[r] = nullptr;
    }
  }

  nranks_ = 0;
  ranks_.clear();
  devices_.clear();
  comms_.clear();
  dev_comms_.clear();
  dev_comm_created_.clear();
  buffers_.clear();
  windows_.clear();
  buffer_bytes_ = 0;
  lsa_barriers_ = 0;
  initialized_ = false;
  append_error(all, guard.restore());
  return all;
}

}  // namespace mok::comm
