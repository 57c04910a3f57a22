// Handler symbols of the CUDA residual-add + RMSNorm targets (norm_cuda.cc).
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(MokAddRmsNormForwardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MokAddRmsNormBackwardCuda);
