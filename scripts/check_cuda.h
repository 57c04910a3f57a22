// CHECK(call): a CUDA runtime call in the standalone programs (scripts/*_ceiling.cu,
// tests/sigmoid_bits.cu); on an error, prints the call and the error and exits 1.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
#define CHECK(call)                                                              \
  do {                                                                           \
    cudaError_t e_ = (call);                                                     \
    if (e_ != cudaSuccess) {                                                     \
      std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(e_));           \
      std::exit(1);                                                              \
    }                                                                            \
  } while (0)
