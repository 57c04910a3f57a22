// The fused EP transport's host state: see ep_registry.h.
#include "ep_registry.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "comm_check.h"
#include "nvlink_comm.h"

namespace mok::comm {

namespace {

struct LocalRank {
  int group = 0;             // index into CommSet::comms
  int local = 0;             // local index in that NvlinkComm
  int device = 0;
  uint64_t* epoch = nullptr;         // cudaMalloc on device
  ErrorRecord* error_host = nullptr;  // cudaHostAlloc(mapped)
  ErrorRecord* error_dev = nullptr;
  bool reported = false;
};

struct CommSet {
  std::vector<std::unique_ptr<NvlinkComm>> comms;
  std::vector<LocalRank> ranks;
  uint64_t timeout_ns = 0;
  uint64_t fingerprint = 0;
};

std::shared_mutex g_mutex;  // exclusive: insert/destroy; shared: handlers, watchdog
std::map<int64_t, std::unique_ptr<CommSet>> g_sets;
int64_t g_next_handle = 1;
std::string g_last_error;   // guarded by g_report_mutex
std::mutex g_report_mutex;
std::thread g_watchdog;
std::atomic<bool> g_stop{false};

std::string describe(const ErrorRecord& e, int device) {
  std::string msg = "mok_jax fused EP: rank " + std::to_string(e.rank) + " (CUDA device " +
                    std::to_string(device) + "), phase " + phase_name(e.phase) + ": ";
  if (e.code == 1) {
    msg += "rank " + std::to_string(e.peer) + " did not arrive within " +
           std::to_string(e.waited_ms / 1000.0) +
           " s (MOK_JAX_COMM_TIMEOUT_S); the step was aborted (the kernel trapped)";
  } else {
    msg += "rank " + std::to_string(e.peer) +
           " is running a different call (signature " + std::to_string(e.peer_signature) +
           ", this rank " + std::to_string(e.signature) +
           "): the ranks traced different shapes; the step was aborted before any row moved";
  }
  return msg;
}

void watchdog_loop() {
  while (!g_stop.load()) {
    {
      std::shared_lock<std::shared_mutex> lock(g_mutex);
      for (auto& [handle, set] : g_sets) {
        for (LocalRank& r : set->ranks) {
          if (r.reported || r.error_host == nullptr || r.error_host->code == 0) continue;
          r.reported = true;
          std::string msg = describe(*r.error_host, r.device);
          std::fprintf(stderr, "%s\n", msg.c_str());
          std::fflush(stderr);
          std::lock_guard<std::mutex> g(g_report_mutex);
          if (g_last_error.empty()) g_last_error = msg;
        }
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

std::string free_ranks(CommSet& set) {
  std::string all;
  DeviceGuard guard;
  for (LocalRank& r : set.ranks) {
    MOK_COMM_CUDA_COLLECT(all, cudaSetDevice(r.device));
    if (r.epoch != nullptr) MOK_COMM_CUDA_COLLECT(all, cudaFree(r.epoch));
    if (r.error_host != nullptr) MOK_COMM_CUDA_COLLECT(all, cudaFreeHost(r.error_host));
    r.epoch = nullptr;
    r.error_host = nullptr;
    r.error_dev = nullptr;
  }
  set.ranks.clear();
  append_error(all, guard.restore());
  return all;
}

std::string teardown(CommSet& set, bool abort) {
  std::string all;
  for (auto& c : set.comms) append_error(all, c->destroy(abort));  // waits for the devices
  set.comms.clear();
  append_error(all, free_ranks(set));
  return all;
}

std::string build(CommSet& set, const std::vector<GroupSpec>& groups, size_t window_bytes) {
  if (window_bytes <= kBarrierBytes) return "window of " + std::to_string(window_bytes) + " bytes";
  for (size_t g = 0; g < groups.size(); ++g) {
    const GroupSpec& spec = groups[g];
    if (spec.nranks > kMaxRanks) {
      return "an EP group of " + std::to_string(spec.nranks) + " ranks (at most " +
             std::to_string(kMaxRanks) + ")";
    }
    NvlinkCommConfig cfg;
    cfg.nranks = spec.nranks;
    cfg.ranks = spec.ranks;
    cfg.devices = spec.devices;
    cfg.unique_id = spec.unique_id;
    cfg.buffer_bytes = window_bytes;
    cfg.lsa_barriers = 1;  // the transport uses its own bounded barrier
    auto comm = std::make_unique<NvlinkComm>();
    std::string err = comm->init(cfg);
    if (!err.empty()) return "EP group " + std::to_string(g) + ": " + err;
    set.comms.push_back(std::move(comm));
  }
  return keeping_current_device([&]() -> std::string {
    for (size_t g = 0; g < set.comms.size(); ++g) {
      const NvlinkComm& c = *set.comms[g];
      for (int l = 0; l < c.local_count(); ++l) {
        LocalRank r;
        r.group = static_cast<int>(g);
        r.local = l;
        r.device = c.device(l);
        set.ranks.push_back(r);
        LocalRank& back = set.ranks.back();
        MOK_COMM_CUDA_RETURN(cudaSetDevice(back.device));
        MOK_COMM_RETURN_IF_MESSAGE(load_ep_kernels());
        MOK_COMM_CUDA_RETURN(cudaMalloc(&back.epoch, sizeof(uint64_t)));
        MOK_COMM_CUDA_RETURN(cudaMemset(back.epoch, 0, sizeof(uint64_t)));
        MOK_COMM_CUDA_RETURN(cudaHostAlloc(reinterpret_cast<void**>(&back.error_host),
                                           sizeof(ErrorRecord), cudaHostAllocMapped));
        std::memset(const_cast<ErrorRecord*>(back.error_host), 0, sizeof(ErrorRecord));
        MOK_COMM_CUDA_RETURN(cudaHostGetDevicePointer(
            reinterpret_cast<void**>(&back.error_dev), back.error_host, 0));
        MOK_COMM_CUDA_RETURN(cudaDeviceSynchronize());
      }
    }
    return "";
  });
}

}  // namespace

int64_t create_comm_set(const std::vector<GroupSpec>& groups, size_t window_bytes,
                        double timeout_s, uint64_t fingerprint, std::string* err) {
  if (!(timeout_s > 0) || !std::isfinite(timeout_s)) {
    *err = "timeout must be a positive number of seconds";
    return 0;
  }
  auto set = std::make_unique<CommSet>();
  set->timeout_ns = static_cast<uint64_t>(timeout_s * 1e9);
  set->fingerprint = fingerprint;
  // Built without the registry lock: running steps (whose handlers take it
  // shared) are never blocked by a bootstrap.
  std::string msg = build(*set, groups, window_bytes);
  if (!msg.empty()) {
    append_error(msg, teardown(*set, /*abort=*/true));
    *err = msg;
    return 0;
  }
  std::unique_lock<std::shared_mutex> lock(g_mutex);
  const int64_t handle = g_next_handle++;
  g_sets[handle] = std::move(set);
  if (!g_watchdog.joinable()) {
    g_stop = false;
    g_watchdog = std::thread(watchdog_loop);
  }
  return handle;
}

std::string shutdown_comm_sets() {
  std::string all;
  g_stop = true;
  if (g_watchdog.joinable()) g_watchdog.join();
  std::unique_lock<std::shared_mutex> lock(g_mutex);
  for (auto& [handle, set] : g_sets) append_error(all, teardown(*set, /*abort=*/true));
  g_sets.clear();
  return all;
}

int nccl_header_version() { return kNcclHeaderVersion; }

std::string comm_last_error() {
  std::lock_guard<std::mutex> g(g_report_mutex);
  return g_last_error;
}

std::string RankLookup::find(int64_t handle, uint64_t fingerprint, int device) {
  lock_ = std::shared_lock<std::shared_mutex>(g_mutex);
  auto it = g_sets.find(handle);
  if (it == g_sets.end()) {
    return "no communicator set " + std::to_string(handle) +
           " (it was destroyed, or this executable was compiled in another process)";
  }
  const CommSet& set = *it->second;
  if (set.fingerprint != fingerprint) {
    return "communicator set " + std::to_string(handle) +
           " belongs to other devices than this executable was compiled for (a "
           "compilation-cache hit or an executable from another process?); recompile it "
           "in this process";
  }
  for (const LocalRank& r : set.ranks) {
    if (r.device != device) continue;
    const NvlinkComm& c = *set.comms[r.group];
    view_.window = c.window(r.local);
    view_.buffer = c.buffer(r.local);
    view_.window_bytes = c.buffer_bytes();
    view_.rank = c.world_rank(r.local);
    view_.nranks = c.size();
    view_.epoch = r.epoch;
    view_.error = r.error_dev;
    view_.timeout_ns = set.timeout_ns;
    return "";
  }
  return "CUDA device " + std::to_string(device) + " is in no EP group of communicator set " +
         std::to_string(handle);
}

}  // namespace mok::comm
