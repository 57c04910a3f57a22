// Host program (tests/test_cute_layouts.py compiles and runs it): the wgmma
// accumulator layout that moe_persistent_backward.cu's store_tile_bf16 relies on,
// for the two tiled MMAs of that kernel (64 x 256 tiles, two warp groups along N).
// Consumer thread c (lane l, q = l % 4) holds rows r = 16 (c % 128 / 32) + l / 4
// and r + 8; its value 4j + v is column 128 (c / 128) + 8j + 2q + v % 2 of row
// r + 8 (v / 2). Exits non-zero and prints the first mismatches otherwise.
#include <cstdio>

#include "cute/atom/mma_atom.hpp"
#include "cute/tensor.hpp"

using namespace cute;

using MmaMN = decltype(make_tiled_mma(
    SM90_64x128x16_F32BF16BF16_SS<GMMA::Major::MN, GMMA::Major::MN>{},
    Layout<Shape<_1, _2, _1>>{}));
using MmaKK = decltype(make_tiled_mma(
    SM90_64x128x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>{}, Layout<Shape<_1, _2, _1>>{}));

template <class Mma>
int mismatches(const char* name) {
  int bad = 0;
  for (int c = 0; c < 256; ++c) {
    Mma mma;
    Tensor coord = mma.get_thread_slice(c).partition_C(make_identity_tensor(Shape<_64, _256>{}));
    if (int(size(coord)) != 64) {
      std::printf("%s: %d values a thread, want 64\n", name, int(size(coord)));
      return 1;
    }
    const int l = c % 32, q = l % 4, r = 16 * (c % 128 / 32) + l / 4;
    for (int i = 0; i < 64; ++i) {
      const int j = i / 4, v = i % 4;
      const int m = r + 8 * (v / 2), n = 128 * (c / 128) + 8 * j + 2 * q + v % 2;
      if (int(get<0>(coord(i))) != m || int(get<1>(coord(i))) != n) {
        if (++bad <= 4) {
          std::printf("%s: thread %d value %d at (%d, %d), want (%d, %d)\n", name, c, i,
                      int(get<0>(coord(i))), int(get<1>(coord(i))), m, n);
        }
      }
    }
  }
  return bad;
}

int main() {
  const int bad = mismatches<MmaMN>("MN-major") + mismatches<MmaKK>("K-major");
  std::printf("%d mismatches\n", bad);
  return bad == 0 ? 0 : 1;
}
