// SIMT (CUDA-core) grouped GEMMs: the fallback for what the tensor-core path
// does not serve (f32 operands, sizes not a multiple of 8, pre-Hopper GPUs).
// Each output element is one thread's f32 sum over K in ascending order.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "grouped_gemm.h"

namespace mok::cuda {

// Requires the SIMT tile map (RoutingPlanDevice::tile_begin).
std::string run_rows_gemm_simt(const RowsGemm& p, const int64_t* tile_begin, cudaStream_t stream);
std::string run_weight_grad_gemm_simt(const WeightGradGemm& p, cudaStream_t stream);

}  // namespace mok::cuda
