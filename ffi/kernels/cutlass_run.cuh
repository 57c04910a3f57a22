// Initialising and running a CUTLASS device GEMM, shared by the grouped GEMMs of
// every recipe (cutlass_grouped.cuh, cutlass_fp8_grouped.cuh).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "cutlass/cutlass.h"

namespace mok::cuda {

// Initialises a CUTLASS device GEMM with `args` and its workspace `ws` and runs it
// on `stream`; errors name the step, after `what`.
template <class Device>
std::string initialize_and_run(typename Device::Arguments const& args, void* ws,
                               cudaStream_t stream, const char* what) {
  Device gemm;
  cutlass::Status status = gemm.initialize(args, ws, stream);
  if (status != cutlass::Status::kSuccess) {
    return std::string(what) + " initialize: " + cutlassGetStatusString(status);
  }
  status = gemm.run(stream);
  if (status != cutlass::Status::kSuccess) {
    return std::string(what) + " run: " + cutlassGetStatusString(status);
  }
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return std::string(what) + " launch: " + cudaGetErrorString(err);
  }
  return {};
}

}  // namespace mok::cuda
