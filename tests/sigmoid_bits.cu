// The kernels' sigmoid (ffi/kernels/swiglu_math.cuh) over every one of the 2^32
// float inputs, against
//   - __fdividef(1, 1 + __expf(-g)), the form it stands for (bit for bit: NaN
//     results compared as NaN), and
//   - the logistic function in double precision, within 4 + 1.173 |g| ulp of its
//     float rounding: __expf's documented bound (2 + floor(1.173 |x|) ulp, from the
//     rounding of x log2(e) before ex2) and one more ulp each for the add of 1 and
//     the reciprocal (ulp as the distance of the bit patterns; where the rounded
//     reference is below 2^-126 the result may also be 0).
// Prints "mismatches <n> max_ulp <u> beyond_bound <b>" and exits 1 unless n and b are
// 0 (or on a CUDA error, CHECK). Built and run by tests/test_gpu.py.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>

#include "check_cuda.h"  // scripts/
#include "swiglu_math.cuh"

namespace {

__device__ __forceinline__ float reference_form(float g) {
  return __fdividef(1.0f, 1.0f + __expf(-g));
}

__global__ void check(unsigned long long* mismatches, unsigned* max_ulp,
                      unsigned long long* beyond_bound) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  unsigned long long bad = 0, beyond = 0;
  unsigned worst = 0;
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (uint64_t(1) << 32);
       i += stride) {
    const float g = __uint_as_float(static_cast<uint32_t>(i));
    const float s = mok::cuda::sigmoid(g);
    const float r = reference_form(g);
    const bool same = isnan(s) ? isnan(r) : __float_as_uint(s) == __float_as_uint(r);
    bad += !same;
    if (isnan(g)) continue;
    const double exact = 1.0 / (1.0 + exp(-static_cast<double>(g)));
    const float rounded = static_cast<float>(exact);
    const int64_t d = int64_t(__float_as_uint(s)) - int64_t(__float_as_uint(rounded));
    const double u = static_cast<double>(d < 0 ? -d : d);
    const bool flushed = s == 0.0f && rounded < 1.17549435e-38f;  // 2^-126
    if (!flushed) {
      const unsigned ui = static_cast<unsigned>(u);
      worst = ui > worst ? ui : worst;
      beyond += u > 4.0 + 1.173 * fabs(static_cast<double>(g));
    }
  }
  if (bad) atomicAdd(mismatches, bad);
  if (beyond) atomicAdd(beyond_bound, beyond);
  atomicMax(max_ulp, worst);
}

}  // namespace

int main() {
  unsigned long long* mismatches = nullptr;
  unsigned long long* beyond = nullptr;
  unsigned* ulp = nullptr;
  CHECK(cudaMalloc(&mismatches, sizeof(*mismatches)));
  CHECK(cudaMalloc(&beyond, sizeof(*beyond)));
  CHECK(cudaMalloc(&ulp, sizeof(*ulp)));
  CHECK(cudaMemset(mismatches, 0, sizeof(*mismatches)));
  CHECK(cudaMemset(beyond, 0, sizeof(*beyond)));
  CHECK(cudaMemset(ulp, 0, sizeof(*ulp)));
  check<<<4096, 256>>>(mismatches, ulp, beyond);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  unsigned long long m = 0, t = 0;
  unsigned u = 0;
  CHECK(cudaMemcpy(&m, mismatches, sizeof(m), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(&t, beyond, sizeof(t), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(&u, ulp, sizeof(u), cudaMemcpyDeviceToHost));
  std::printf("mismatches %llu max_ulp %u beyond_bound %llu\n", m, u, t);
  return m == 0 && t == 0 ? 0 : 1;
}
