// nanobind module mok_jax._mok_comm: the fused EP transport (NCCL symmetric
// memory over NVLink). Kept apart from mok_jax._mok so that libnccl is loaded
// only when backend="fused" needs it (mok_jax/comm.py imports this lazily).
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "comm/ep_kernels.cuh"
#include "comm/ep_registry.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

extern "C" XLA_FFI_Error* MokEpDispatchCuda(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* MokEpCombineCuda(XLA_FFI_CallFrame*);

namespace {

using GroupTuple = std::tuple<int, std::vector<int>, std::vector<int>, nb::bytes>;

std::vector<mok::comm::GroupSpec> to_specs(const std::vector<GroupTuple>& groups) {
  std::vector<mok::comm::GroupSpec> specs;
  for (const auto& [nranks, ranks, devices, uid] : groups) {
    mok::comm::GroupSpec s;
    s.nranks = nranks;
    s.ranks = ranks;
    s.devices = devices;
    s.unique_id = std::string(uid.c_str(), uid.size());
    specs.push_back(std::move(s));
  }
  return specs;
}

void raise_if(const std::string& err) {
  if (!err.empty()) throw std::runtime_error(err);
}

nb::dict registrations() {
  nb::dict gpu;
  gpu["mok_ep_dispatch"] = nb::capsule(reinterpret_cast<void*>(MokEpDispatchCuda));
  gpu["mok_ep_combine"] = nb::capsule(reinterpret_cast<void*>(MokEpCombineCuda));
  nb::dict out;
  out["CUDA"] = gpu;
  return out;
}

nb::bytes unique_id() {
  ncclUniqueId id;
  ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) throw std::runtime_error(std::string("ncclGetUniqueId: ") + ncclGetErrorString(r));
  return nb::bytes(id.internal, sizeof(id.internal));
}

// The loaded library's NCCL_VERSION_CODE, also where it differs from the headers'
// (create() refuses that case; mok_jax.comm names both versions).
int nccl_runtime_version() {
  int v = 0;
  ncclResult_t r = ncclGetVersion(&v);
  if (r != ncclSuccess) {
    throw std::runtime_error(std::string("ncclGetVersion: ") + ncclGetErrorString(r));
  }
  return v;
}

}  // namespace

NB_MODULE(_mok_comm, m) {
  m.doc() = "mok_jax fused EP transport: NCCL communicators, symmetric windows, FFI handlers";
  m.def("registrations", &registrations, "Handler capsules: {'CUDA': {name: capsule}}.");
  m.def("unique_id", &unique_id, "A fresh ncclUniqueId, as bytes.");
  m.def(
      "create",
      [](const std::vector<GroupTuple>& groups, size_t window_bytes, double timeout_s,
         uint64_t fingerprint) {
        std::vector<mok::comm::GroupSpec> specs = to_specs(groups);
        std::string err;
        int64_t h;
        {
          // NCCL's collective init and device syncs block: let host callbacks of
          // running steps (which need the GIL) finish meanwhile.
          nb::gil_scoped_release release;
          h = mok::comm::create_comm_set(specs, window_bytes, timeout_s, fingerprint, &err);
        }
        raise_if(err);
        return h;
      },
      nb::arg("groups"), nb::arg("window_bytes"), nb::arg("timeout_s"), nb::arg("fingerprint"),
      "Communicators for this process's ranks of every group [(nranks, ranks, devices, "
      "unique_id)], each with a symmetric window of window_bytes; returns the handle.");
  m.def("shutdown",
        []() {
          nb::gil_scoped_release release;
          return mok::comm::shutdown_comm_sets();
        },
        "Destroys every set (no collective finalize) and stops the watchdog; returns errors.");
  m.def(
      "window_bytes",
      [](int64_t tokens, int64_t top_k, int64_t hidden, int64_t itemsize) {
        return mok::comm::window_layout(tokens, top_k, size_t(hidden * itemsize), 4).total;
      },
      nb::arg("tokens"), nb::arg("top_k"), nb::arg("hidden"), nb::arg("itemsize"));
  m.def("last_error", &mok::comm::comm_last_error,
        "The first barrier failure the watchdog saw, or ''.");
  m.def("nccl_runtime_version", &nccl_runtime_version);
  m.def(
      "can_access_peer",
      [](int a, int b) {
        int can = 0;
        cudaError_t e = cudaDeviceCanAccessPeer(&can, a, b);
        if (e != cudaSuccess) throw std::runtime_error(cudaGetErrorString(e));
        return can != 0;
      },
      nb::arg("device"), nb::arg("peer"), "cudaDeviceCanAccessPeer(device, peer).");
  m.attr("NCCL_HEADER_VERSION") = mok::comm::nccl_header_version();
}
