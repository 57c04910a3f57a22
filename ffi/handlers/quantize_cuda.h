// Handler symbol of the CUDA fp8 row quantizer (quantize_cuda.cc).
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(MokQuantizeRowsFp8Cuda);
