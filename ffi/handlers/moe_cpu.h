// Handler symbols of the CPU MoE targets (defined in moe_cpu.cc).
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(MokMoeForwardCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MokMoeBackwardCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MokExpertFfnForwardCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MokExpertFfnBackwardCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MokCombineCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MokQuantizeRowsFp8Cpu);
