// Host program (tests/test_cute_layouts.py compiles and runs it): the wgmma
// accumulator layouts the persistent kernels' hand-written epilogues rely on.
// moe_persistent_backward.cu's stmatrix_slice, for the two tiled MMAs of that kernel
// (64 x 256 tiles, two warp groups along N): consumer thread c (lane l, q = l % 4)
// holds rows r = 16 (c % 128 / 32) + l / 4 and r + 8; its value 4j + v is column
// 128 (c / 128) + 8j + 2q + v % 2 of row r + 8 (v / 2). moe_persistent.cu's 128-row
// tiles and the backward's 128-row weight-gradient and dgrad tiles (two warp groups
// along M, 64 x 256 each): rows r = 64 (c / 128) + 16 (c % 128 / 32) + l / 4 and
// r + 8; value 4j + v is column 8j + 2q + v % 2 of row r + 8 (v / 2).
// And the backward's 64 x 64 weight-gradient store parts (LayoutC, the TMA store's
// 128-byte swizzle), which stage_part addresses by hand: row m's 16-byte chunk c at
// element 64 m + 8 (c ^ m % 8).
// Exits non-zero and prints the first mismatches otherwise.
#include <cstdio>
#include <type_traits>

#include "cute/atom/mma_atom.hpp"
#include "cute/tensor.hpp"

using namespace cute;

using MmaMN = decltype(make_tiled_mma(
    SM90_64x128x16_F32BF16BF16_SS<GMMA::Major::MN, GMMA::Major::MN>{},
    Layout<Shape<_1, _2, _1>>{}));
using MmaKK = decltype(make_tiled_mma(
    SM90_64x128x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>{}, Layout<Shape<_1, _2, _1>>{}));

using MmaRows128 = decltype(make_tiled_mma(
    SM90_64x256x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::MN>{},
    Layout<Shape<_2, _1, _1>>{}));
using MmaWgrad128 = decltype(make_tiled_mma(
    SM90_64x256x16_F32BF16BF16_SS<GMMA::Major::MN, GMMA::Major::MN>{},
    Layout<Shape<_2, _1, _1>>{}));
using MmaDgrad128 = decltype(make_tiled_mma(
    SM90_64x256x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>{},
    Layout<Shape<_2, _1, _1>>{}));

// kAlongM: the warp groups one above the other (128 x 256), else side by side (64 x 256).
template <class Mma, bool kAlongM = false>
int mismatches(const char* name) {
  using Tile = std::conditional_t<kAlongM, Shape<_128, _256>, Shape<_64, _256>>;
  constexpr int kValues = kAlongM ? 128 : 64;
  int bad = 0;
  for (int c = 0; c < 256; ++c) {
    Mma mma;
    Tensor coord = mma.get_thread_slice(c).partition_C(make_identity_tensor(Tile{}));
    if (int(size(coord)) != kValues) {
      std::printf("%s: %d values a thread, want %d\n", name, int(size(coord)), kValues);
      return 1;
    }
    const int l = c % 32, q = l % 4, r = (kAlongM ? 64 * (c / 128) : 0) + 16 * (c % 128 / 32) + l / 4;
    for (int i = 0; i < kValues; ++i) {
      const int j = i / 4, v = i % 4;
      const int m = r + 8 * (v / 2), n = (kAlongM ? 0 : 128 * (c / 128)) + 8 * j + 2 * q + v % 2;
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

int part_mismatches() {
  using PartTile = Shape<_64, _64>;
  using LayoutC = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bfloat16_t>{}, PartTile{}));
  alignas(1024) static bfloat16_t part[64 * 64];
  Tensor t = make_tensor(make_smem_ptr(part), LayoutC{});
  int bad = 0;
  for (int m = 0; m < 64; ++m) {
    for (int n = 0; n < 64; ++n) {
      const long at = &t(m, n) - part, want = 64 * m + 8 * ((n / 8) ^ (m % 8)) + n % 8;
      if (at != want && ++bad <= 4) {
        std::printf("store part: (%d, %d) at element %ld, want %ld\n", m, n, at, want);
      }
    }
  }
  return bad;
}

int main() {
  const int bad = mismatches<MmaMN>("MN-major") + mismatches<MmaKK>("K-major") +
                  mismatches<MmaRows128, true>("128-row tiles") +
                  mismatches<MmaWgrad128, true>("128-row weight-gradient tiles") +
                  mismatches<MmaDgrad128, true>("128-row dgrad tiles") + part_mismatches();
  std::printf("%d mismatches\n", bad);
  return bad == 0 ? 0 : 1;
}
