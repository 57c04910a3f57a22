// The fused EP transport's device side: a bounded barrier and the two row moves.
//
// Every rank of a communicator owns one symmetric window (NvlinkComm), laid out
// as WindowLayout says: barrier words, then the regions of one call's shapes.
// Calls move rows in three stream-ordered kernels, barrier -> copy -> barrier:
//   dispatch (pull): each rank first copies its token rows (and optional
//     per-pair scalars) into its own window; after the barrier, a warp per
//     entry of the pull list reads one token row of one peer ONCE and writes
//     it to every row of the local expert-grouped input that needs it (one per
//     k whose expert is here). The closing barrier keeps a rank from
//     overwriting its window while a peer may still read it.
//   combine (push): after the barrier (the owners no longer read their slots),
//     a warp per expert row writes it into its token owner's window at the
//     pair's slot (t * K + k); the closing barrier says every slot has arrived.
//     The owner then sums over k from its own window (combine_kept_rows).
// The kernel boundaries order everything on one rank's stream; the barrier's
// release/acquire at system scope carries those writes to the peers.
//
// The barrier is mok_jax's own, not ncclLsaBarrierSession, so that a wait is
// bounded: each rank stores (epoch << 32 | signature) into word [rank] of every
// peer's window and spins on its own words until every peer reached the epoch.
// After `timeout_ns` it writes an ErrorRecord (host-mapped memory that a host
// thread watches) and traps, ending the step with a CUDA error instead of a
// hang. The signature hashes the call's shapes and phase: ranks that traced
// different shapes meet in the barrier, see different signatures and trap
// before any row moves.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>  // ncclWindow_t; the .cu includes the device API

#include <cstddef>
#include <cstdint>
#include <string>

namespace mok::comm {

constexpr size_t kBarrierBytes = 16384;                  // window [0, 16 KiB): barrier words
constexpr int kMaxRanks = static_cast<int>(kBarrierBytes / 8);
constexpr size_t kRegionAlign = 256;

// Where one call's regions sit in every rank's window. Python's
// mok_jax.comm.window_bytes computes the same total.
struct WindowLayout {
  size_t tokens_offset = 0;   // [T, row_bytes]: the token rows a dispatch reads
  size_t pair_scalars_offset = 0;  // [T*K, scalar_bytes]: per-pair scalars a dispatch reads
  size_t slots_offset = 0;    // [T*K, row_bytes]: the rows a combine pushes, by pair
  size_t slot_scalars_offset = 0;  // [T*K, scalar_bytes]: per-row scalars a combine pushes
  size_t total = 0;           // bytes the window needs
};
WindowLayout window_layout(int64_t tokens, int64_t top_k, size_t row_bytes, size_t scalar_bytes);

enum class Phase : int32_t {
  kDispatchBegin = 1,  // token rows are in every window
  kDispatchEnd = 2,    // every pull has finished reading
  kCombineBegin = 3,   // every owner has finished reading its slots
  kCombineEnd = 4,     // every pushed row has arrived
};
const char* phase_name(int32_t phase);

// What a failed barrier leaves for the host (one per rank, host-mapped).
struct ErrorRecord {
  volatile int32_t code;  // 0 none, 1 timed out, 2 signatures differ
  volatile int32_t phase;
  volatile int32_t rank;
  volatile int32_t peer;
  volatile uint32_t signature;
  volatile uint32_t peer_signature;
  volatile uint32_t epoch;
  volatile uint32_t waited_ms;
};

struct BarrierArgs {
  ncclWindow_t window = nullptr;   // barrier words at offset 0
  int rank = 0;                    // world rank == LSA rank (one LSA team)
  int nranks = 0;
  uint64_t* epoch = nullptr;       // device: barriers this rank has passed
  uint32_t signature = 0;          // shapes and phase of the call
  int32_t phase = 0;
  uint64_t timeout_ns = 0;
  ErrorRecord* error = nullptr;    // device view of the host-mapped record
};
std::string launch_barrier(const BarrierArgs& args, cudaStream_t stream);

struct PullArgs {
  ncclWindow_t window = nullptr;
  WindowLayout layout;
  int nranks = 0;
  int64_t tokens = 0;             // T: token rows per rank
  int64_t top_k = 0;              // K
  size_t row_bytes = 0;           // % 16 == 0
  size_t scalar_bytes = 0;        // 2 or 4 when out_scalars is set
  const int32_t* entries = nullptr;  // [n_entries]: src_rank * T + token, < 0: none
  const int32_t* dest = nullptr;     // [n_entries, K]: grouped row of pair k, < 0: none
  int64_t n_entries = 0;
  void* out = nullptr;            // [out_rows, row_bytes]
  void* out_scalars = nullptr;    // [out_rows] or null
  int64_t out_rows = 0;
};
// The argument checks of launch_pull, for a handler to run before its first
// barrier (a rank that stops after it would leave its peers waiting).
std::string check_pull(const PullArgs& args);
// `blocks`: copy_blocks(device, args.n_entries, ...).
std::string launch_pull(const PullArgs& args, int blocks, cudaStream_t stream);

struct PushArgs {
  ncclWindow_t window = nullptr;
  WindowLayout layout;
  int nranks = 0;
  int64_t pairs = 0;              // T*K: slots per rank
  size_t row_bytes = 0;           // % 16 == 0
  size_t scalar_bytes = 0;        // 2 or 4 when row_scalars is set
  const void* rows = nullptr;     // [n_rows, row_bytes]
  const void* row_scalars = nullptr;  // [n_rows] or null
  const int32_t* dest = nullptr;  // [n_rows]: owner_rank * T*K + pair, < 0: none
  int64_t n_rows = 0;
};
std::string check_push(const PushArgs& args);
// `blocks`: copy_blocks(device, args.n_rows, ...).
std::string launch_push(const PushArgs& args, int blocks, cudaStream_t stream);

// The grid of a pull or push of `items` entries or rows on `device` (from its SM
// count), for a handler to ask before its first barrier, as the checks.
std::string copy_blocks(int device, int64_t items, int* blocks);

// Loads the kernels on the current device (do it before the first launch: lazy
// loading must not happen while a peer spins in a barrier).
std::string load_ep_kernels();

}  // namespace mok::comm
