// Handler symbols of the CUDA MoE targets (defined in moe_cuda.cc).
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(MokMoeForwardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MokMoeForwardRanksCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MokMoeBackwardRanksCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MokMoeBackwardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MokExpertFfnForwardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MokExpertFfnBackwardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MokCombineCuda);
