#include "device_info.h"

#include <atomic>
#include <cstdint>

#include "cuda_check.h"

namespace mok::cuda {
namespace {

// Per device ordinal: 0 while not queried, else kKnown | sm_count << 16 | cc.
constexpr int kCachedDevices = 64;
constexpr uint64_t kKnown = uint64_t(1) << 63;
std::atomic<uint64_t> known[kCachedDevices];

}  // namespace

std::string current_device_info(DeviceInfo* info) {
  MOK_CUDA_RETURN_IF_ERROR(cudaGetDevice(&info->device));
  const int d = info->device;
  const bool cached = d >= 0 && d < kCachedDevices;
  if (cached) {
    const uint64_t v = known[d].load(std::memory_order_relaxed);
    if (v & kKnown) {
      info->sm_count = static_cast<int>((v >> 16) & 0xffffffffu);
      info->cc = static_cast<int>(v & 0xffffu);
      return {};
    }
  }
  int major = 0, minor = 0;
  MOK_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&info->sm_count, cudaDevAttrMultiProcessorCount, d));
  MOK_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d));
  MOK_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, d));
  info->cc = major * 10 + minor;
  if (cached) {
    known[d].store(kKnown | uint64_t(static_cast<uint32_t>(info->sm_count)) << 16 |
                       uint64_t(info->cc & 0xffff),
                   std::memory_order_relaxed);
  }
  return {};
}

}  // namespace mok::cuda
