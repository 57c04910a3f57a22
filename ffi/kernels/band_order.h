// The order of a persistent kernel's GEMM tasks within an expert. Host and device
// code alike, so that tests/persistent_task_order.cc can check on the host that it
// numbers every (column tile, row block) of every expert once.
#pragma once

#include <cstdint>

#include "mok/bf16.h"  // MOK_HOST_DEVICE

namespace mok::cuda {

// Row blocks an expert's GEMM tasks go through at once.
constexpr int kBandBlocks = 8;

// A GEMM task's (column tile, row block) from its number i among a rank's tasks of
// that GEMM: n column tiles per row block, block_begin[0..experts] the experts' row
// blocks prefix-summed, the rank's row blocks from block0 on (its experts'). Each
// expert's tasks keep the numbers they would have row block by row block,
// [(block_begin[e] - block0) n, (block_begin[e + 1] - block0) n), and go band by
// band (kBandBlocks row blocks), each band column tile by column tile, so that the
// CTAs dealt consecutive numbers share each weight tile while it is in L2. (Row
// block by row block, the CTAs of one wave read every column tile of one or two row
// blocks: an expert with 112 gate/up column tiles, (H, F) = (4096, 14336), streamed
// its 235 MB weight from DRAM for every 128 rows.)
MOK_HOST_DEVICE void band_order(const int32_t* block_begin, int64_t experts,
                                       int64_t block0, uint32_t i, uint32_t n,
                                       int32_t* tile, int64_t* block) {
  const int64_t row_major = block0 + i / n;  // the expert of that row block: the last
  int64_t lo = 0, hi = experts;              // e with block_begin[e] <= row_major
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (block_begin[mid] <= row_major) lo = mid; else hi = mid;
  }
  const int64_t first = block_begin[lo], blocks = block_begin[lo + 1] - first;
  const int64_t j = int64_t(i) - (first - block0) * n;  // its number in the expert
  const int64_t band = j / (int64_t(kBandBlocks) * n);
  const int64_t rows = blocks - band * kBandBlocks < kBandBlocks ? blocks - band * kBandBlocks
                                                                 : int64_t(kBandBlocks);
  const int64_t k = j - band * kBandBlocks * n;         // its number in the band
  *tile = static_cast<int32_t>(k / rows);
  *block = first + band * kBandBlocks + k % rows;
}

}  // namespace mok::cuda
