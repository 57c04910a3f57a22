// Handler symbols of the CUDA MoE targets (defined in moe_cuda.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "mok/types.h"
#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(MokMoeForwardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MokMoeBackwardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MokExpertFfnForwardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MokExpertFfnBackwardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MokCombineCuda);

namespace mok {

// The bytes of the workspace result the lowering must give a call of `target`
// ("mok_moe_fwd", ...) on the current GPU; SIZE_MAX for an unknown target. rows is
// T for the layer and the combine, R for the expert FFN; top_k is ignored by the
// expert FFN, experts/hidden/ffn by the combine.
size_t cuda_workspace_request(std::string_view target, int64_t rows, int64_t top_k,
                              int64_t experts, int64_t hidden, int64_t ffn, DType dtype,
                              bool save_gate_up);

// How many times the CUDA handlers above have run in this process: calls that
// XLA replays from a CUDA graph do not count (a diagnostic for tests).
uint64_t cuda_handler_calls();

}  // namespace mok
