// NVLink transport, device side: see nvlink_kernels.cuh.
#include "nvlink_kernels.cuh"

#include <algorithm>

#include "comm_check.h"
#include "row_copy.cuh"

namespace mok::comm {

namespace {

struct PullRowsKernelParams {
  ncclDevComm dev_comm;
  PullRowsArgs args;
};

// One warp per row. Peer rows are read with ld.global.cg (cached in L2, not
// in L1): the data changes between launches and is read once.
__device__ __forceinline__ void copy_rows(const ncclDevComm& dc, const PullRowsArgs& a) {
  const WarpSlot w = warp_slot();
  const int lane = w.lane;
  const size_t nvec = a.row_bytes / 16;
  for (int64_t i = w.warp; i < a.n_rows; i += w.warps) {
    const int rank = a.src_rank[i];
    const int64_t row = a.src_row[i];
    int4* dst = reinterpret_cast<int4*>(static_cast<char*>(a.out) + static_cast<size_t>(i) * a.row_bytes);
    const int lsa_peer = rank - dc.rank + dc.lsaRank;  // world rank -> index in the LSA team
    const bool ok = rank >= 0 && rank < dc.nRanks && lsa_peer >= 0 && lsa_peer < dc.lsaSize &&
                    row >= 0 && row < a.rows_per_rank;
    if (!ok) {
      for (size_t v = lane; v < nvec; v += 32) dst[v] = make_int4(0, 0, 0, 0);
      if (lane == 0 && a.bad_rows != nullptr) atomicAdd(a.bad_rows, 1);
      continue;
    }
    const int4* src = static_cast<const int4*>(
        ncclGetLsaPointer(a.window, a.window_offset + static_cast<size_t>(row) * a.row_bytes, lsa_peer));
    copy_row<true>(src, dst, nvec, lane);
  }
}

template <bool kBarriers>
__global__ void __launch_bounds__(kPullRowsThreads)
    pull_rows_kernel(const __grid_constant__ PullRowsKernelParams p) {
  if constexpr (kBarriers) {
    // One barrier per CTA; the session loads this barrier's epoch from the
    // resource buffer here and stores it back in its destructor.
    ncclLsaBarrierSession<ncclCoopCta> bar(ncclCoopCta(), p.dev_comm, ncclTeamTagLsa(),
                                           blockIdx.x, /*multimem=*/false);
    // Release: what this rank wrote to its window before (earlier stream work
    // and this CTA) is visible to peers that acquire; acquire: the peers'
    // writes before their arrival are visible to our reads.
    bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);
    copy_rows(p.dev_comm, p.args);
    // Release: our reads of the peers' windows are done before they see our
    // arrival; acquire: we do not leave (and let later stream work overwrite
    // our window) before every peer has finished reading it.
    bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);
  } else {
    copy_rows(p.dev_comm, p.args);
  }
}

std::string check_args(const ncclDevComm& dc, const PullRowsArgs& a, int blocks) {
  const std::string what = "pull_rows (rank " + std::to_string(dc.rank) + "): ";
  if (a.window == nullptr) return what + "window is null";
  if (a.row_bytes == 0 || a.row_bytes % 16 != 0)
    return what + "row_bytes " + std::to_string(a.row_bytes) + " is not a positive multiple of 16";
  if (a.window_offset % 16 != 0)
    return what + "window_offset " + std::to_string(a.window_offset) + " is not a multiple of 16";
  if (a.rows_per_rank < 0) return what + "rows_per_rank < 0";
  if (a.window_offset > a.window_bytes ||
      static_cast<size_t>(a.rows_per_rank) > (a.window_bytes - a.window_offset) / a.row_bytes)
    return what + std::to_string(a.rows_per_rank) + " rows of " + std::to_string(a.row_bytes) +
           " bytes from offset " + std::to_string(a.window_offset) + " exceed the window's " +
           std::to_string(a.window_bytes) + " bytes";
  if (a.n_rows < 0) return what + "n_rows < 0";
  if (a.n_rows > 0 && (a.src_rank == nullptr || a.src_row == nullptr || a.out == nullptr))
    return what + "src_rank, src_row and out must be set when n_rows > 0";
  if (reinterpret_cast<uintptr_t>(a.out) % 16 != 0) return what + "out is not 16-byte aligned";
  if (blocks < 1 || blocks > dc.lsaBarrier.nBarriers)
    return what + "blocks " + std::to_string(blocks) + " not in [1, " +
           std::to_string(dc.lsaBarrier.nBarriers) + "] (the device communicator's LSA barriers)";
  return "";
}

template <bool kBarriers>
std::string launch(const ncclDevComm& dev_comm, const PullRowsArgs& args, int blocks,
                   cudaStream_t stream) {
  MOK_COMM_RETURN_IF_MESSAGE(check_args(dev_comm, args, blocks));
  PullRowsKernelParams params;
  params.dev_comm = dev_comm;
  params.args = args;
  pull_rows_kernel<kBarriers><<<blocks, kPullRowsThreads, 0, stream>>>(params);
  MOK_COMM_CUDA_RETURN(cudaGetLastError());
  return "";
}

}  // namespace

std::string pull_rows_grid(int device, int lsa_barriers, int* blocks) {
  return keeping_current_device([&]() -> std::string {
    MOK_COMM_CUDA_RETURN(cudaSetDevice(device));
    cudaFuncAttributes attr;
    // Loads both instances on this device now (lazy loading would otherwise do
    // it at the first launch, possibly while a barrier-waiting kernel runs).
    MOK_COMM_CUDA_RETURN(cudaFuncGetAttributes(&attr, pull_rows_kernel<true>));
    MOK_COMM_CUDA_RETURN(cudaFuncGetAttributes(&attr, pull_rows_kernel<false>));
    int per_sm = 0, sms = 0;
    MOK_COMM_CUDA_RETURN(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm, pull_rows_kernel<true>, kPullRowsThreads, 0));
    MOK_COMM_CUDA_RETURN(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    if (per_sm < 1) {
      return "pull_rows_grid: the kernel does not fit on device " + std::to_string(device);
    }
    // One CTA per SM: 16 warps x 32 lanes x 4 x 16 B = 32 KiB of loads in flight
    // per SM, far more than NVLink's bandwidth-latency product, and a grid that
    // stays co-resident with room to spare.
    *blocks = std::max(1, std::min(lsa_barriers, sms));
    return "";
  });
}

std::string launch_pull_rows(const ncclDevComm& dev_comm, const PullRowsArgs& args, int blocks,
                             cudaStream_t stream) {
  return launch<true>(dev_comm, args, blocks, stream);
}

namespace testing {
std::string launch_pull_rows_without_barriers(const ncclDevComm& dev_comm,
                                              const PullRowsArgs& args, int blocks,
                                              cudaStream_t stream) {
  return launch<false>(dev_comm, args, blocks, stream);
}
}  // namespace testing

}  // namespace mok::comm
