// NVLink transport, device side: pull_rows.
//
// On rank r, for i in [0, n_rows): out row i <- row src_row[i] of rank
// src_rank[i]'s symmetric window (rows of row_bytes starting at window_offset),
// read straight from the peer's memory through the window's LSA pointer with
// 16-byte loads. A warp copies one row at a time.
//
// Synchronisation (NCCL device API, ncclLsaBarrierSession over the LSA team,
// one barrier per CTA: index = blockIdx.x):
//   barrier 1 (acq_rel) before the copy: every rank has finished writing its
//     own window (all work enqueued on that rank's stream before its pull_rows,
//     and anything its CTA did before the barrier) before any rank reads it;
//   barrier 2 (acq_rel) after the copy: no rank runs past its pull_rows (and so
//     cannot overwrite its window in later stream work) while a peer may still
//     be reading it. CTA b of rank p only leaves barrier 2 when CTA b of every
//     rank has finished its copy, so rank p's kernel ends after all ranks' CTAs
//     have read, provided every rank launches the same grid.
// The barrier epochs live in the device communicator's resource buffer (the
// session reads them when it is built and writes them back when it is
// destroyed), so back-to-back launches need no host work.
//
// Contract for callers:
//   * every rank of the device communicator launches pull_rows once per step,
//     with the same `blocks` (also with n_rows == 0: the barriers must meet);
//   * blocks <= the device communicator's LSA barrier count, and small enough
//     that all CTAs fit on the GPU at once (pull_rows_grid gives such a size);
//   * no other kernel uses the same barrier indices concurrently on that rank
//     (launch on one stream per rank, or order the launches);
//   * src_rank is the world rank in the device communicator and must be in this
//     rank's LSA team (NvlinkComm checks that all ranks are);
//   * an index out of range (src_rank not in [0, nRanks) or src_row not in
//     [0, rows_per_rank)) gives a zero row and, if bad_rows is set, +1 there.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace mok::comm {

constexpr int kPullRowsThreads = 512;  // 16 warps per CTA

struct PullRowsArgs {
  ncclWindow_t window = nullptr;       // this rank's handle of the window holding the rows
  size_t window_bytes = 0;             // the window's size on every rank (bounds the rows)
  size_t window_offset = 0;            // byte offset of row 0 in every rank's window; % 16 == 0
  size_t row_bytes = 0;                // > 0, % 16 == 0
  int64_t rows_per_rank = 0;           // rows in each window after window_offset
  const int32_t* src_rank = nullptr;   // [n_rows] device
  const int32_t* src_row = nullptr;    // [n_rows] device
  int64_t n_rows = 0;                  // >= 0
  void* out = nullptr;                 // [n_rows, row_bytes] on this rank's device, 16-byte aligned
  int32_t* bad_rows = nullptr;         // optional device counter
};

// The grid every rank should use: min(lsa_barriers, CTAs of pull_rows that fit
// on `device` at once). Also loads the kernel on that device (do this before
// any launch that spins on a barrier: lazy module loading must not happen while
// a peer-dependent kernel runs).
std::string pull_rows_grid(int device, int lsa_barriers, int* blocks);

// Enqueues pull_rows on `stream`; the current device must be the one of
// `dev_comm`'s rank. Checks the arguments and the launch.
std::string launch_pull_rows(const ncclDevComm& dev_comm, const PullRowsArgs& args, int blocks,
                             cudaStream_t stream);

namespace testing {
// The same copy with both barriers left out: races with the peers' writes.
// For the smoke test's negative control only (shows that its checks can see a
// missing barrier); never use it to move data.
std::string launch_pull_rows_without_barriers(const ncclDevComm& dev_comm,
                                              const PullRowsArgs& args, int blocks,
                                              cudaStream_t stream);
}  // namespace testing

}  // namespace mok::comm
