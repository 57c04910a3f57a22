// When the CUDA forward runs GEMM1 with SwiGLU in its epilogue (bf16 on sm_90a):
// the rule on shapes, shared by the kernels and the Python bindings (tests ask it).
#pragma once

#include <cstdint>

namespace mok {

// F a multiple of 128 (a 256-column tile pairs 128 gate with 128 up columns), 16-byte
// rows, and a block-interleaved weight copy (read and written: 8*E*H*F bytes) at
// most an eighth of the f32 [R, 2F] round trip it saves (16*R*F bytes): E*H*4 <= R. The
// epilogue stores from registers, not overlapped with the main loop, which costs
// back most of what a larger copy would leave (docs/ledger.md, bf2c4cd). With its
// 16-byte stores, E*H <= 2R was within 2 % either way where the copy is half the
// round trip and slower where it is all of it (docs/measurements.md, "The SwiGLU
// epilogue's rule, checked again").
inline bool swiglu_epilogue_shape(int64_t experts, int64_t hidden, int64_t ffn, int64_t rows) {
  return experts > 0 && hidden > 0 && hidden % 8 == 0 && ffn > 0 && ffn % 128 == 0 &&
         4 * experts * hidden <= rows;
}

}  // namespace mok
