// The expert FFN of Recipe::kFp8 on CUDA (sm_90a): the chain of
// expert_ffn_cuda.h with every expert GEMM in e4m3 with f32 block scales
// (1x128 blocks along the reduction for activations, 128x128 for weights),
// bf16 x and weights. Called by expert_ffn_forward_rows / _backward_rows.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "expert_ffn_cuda.h"

namespace mok::cuda {

// Empty when this build and device run the fp8 recipe for these sizes, else why not.
std::string fp8_supported(const ExpertFfnShape& s, DType dtype);

size_t expert_ffn_forward_rows_fp8_bytes(const ExpertFfnShape& s);
std::string expert_ffn_forward_rows_fp8(const ExpertFfnShape& s, const ExpertGroups& g,
                                        const void* x_rows, const void* w_gate_up,
                                        const void* w_down, void* out_rows, void* gate_up_out,
                                        void* scratch, size_t scratch_bytes,
                                        cudaStream_t stream);

size_t expert_ffn_backward_rows_fp8_bytes(const ExpertFfnShape& s);
std::string expert_ffn_backward_rows_fp8(const ExpertFfnShape& s, const ExpertGroups& g,
                                         const RowWeights& w, const void* x_rows,
                                         const void* dy_rows, const void* w_gate_up,
                                         const void* w_down, const void* gate_up,
                                         void* dx_rows, void* d_w_gate_up, void* d_w_down,
                                         void* scratch, size_t scratch_bytes,
                                         cudaStream_t stream);

}  // namespace mok::cuda
