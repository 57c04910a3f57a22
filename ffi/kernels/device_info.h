// The current CUDA device and the facts the launchers choose kernels by.
#pragma once

#include <string>

namespace mok::cuda {

struct DeviceInfo {
  int device = 0;
  int sm_count = 0;
  int cc = 0;  // compute capability, major * 10 + minor
};

// Fills `info` for the calling thread's current device. The device is asked for
// on every call; its attributes (fixed for a device) once per device and process.
std::string current_device_info(DeviceInfo* info);

}  // namespace mok::cuda
