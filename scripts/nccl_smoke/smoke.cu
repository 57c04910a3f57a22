// Smoke test of the NVLink transport foundation (ffi/comm): one process drives
// N GPUs (default 2) through NCCL symmetric memory and the NCCL device API.
//
//   (a) NvlinkComm::init: communicators, device communicators (LSA barriers),
//       a symmetric buffer per rank registered as a NCCL_WIN_COLL_SYMMETRIC window;
//   (b) each rank fills its buffer: word w of rank r in step t holds
//       pattern(r, w, t), so every 4 bytes say which rank, offset and step
//       they came from;
//   (c) pull_rows on every rank fetches a random mix of rows from itself and
//       its peers (random row sizes, window offsets, row counts including 0,
//       and a few out-of-range indices that must come back as zero rows);
//   (d) the host checks every byte of every output;
//   (e) --iters steps (default 100) in batches of --batch steps enqueued with no
//       host synchronisation in between, with random delays on one rank before
//       its fill or its pull, so that a missing or broken barrier shows up as
//       data from the wrong step;
//   (f) times pulls of --rows rows x --row-bytes bytes (default 32768 x 14336,
//       7168 bf16) from the peer with cudaEvents and prints GB/s;
//   (g) tears everything down and prints PASS or FAIL and the NCCL version.
// Every CUDA and NCCL call is checked and reported with its call site; any
// failure exits non-zero. A SIGALRM watchdog (--watchdog seconds, re-armed at
// each phase) kills the process if a barrier hangs.
//
// NVLink multicast stays off: the program sets NCCL_NVLS_ENABLE=0 before any
// NCCL call and never asks for multimem.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <nccl.h>

#include "comm_check.h"
#include "nvlink_comm.h"
#include "nvlink_kernels.cuh"

namespace {

// ---------------------------------------------------------------- failures

[[noreturn]] void die(const std::string& msg) {
  std::fflush(stdout);
  std::fprintf(stderr, "nccl_smoke: ERROR: %s\nnccl_smoke: FAIL\n", msg.c_str());
  std::fflush(stderr);
  // No teardown: a kernel may be spinning on a barrier; exiting the process
  // releases the GPUs.
  _exit(1);
}

#define SMOKE_CUDA(expr)                                                                    \
  do {                                                                                      \
    cudaError_t _e = (expr);                                                                \
    if (_e != cudaSuccess) die(::mok::comm::cuda_message(#expr, _e, __FILE__, __LINE__));   \
  } while (0)

#define SMOKE_NCCL(expr)                                                                    \
  do {                                                                                      \
    ncclResult_t _r = (expr);                                                               \
    if (_r != ncclSuccess) die(::mok::comm::nccl_message(#expr, _r, __FILE__, __LINE__));   \
  } while (0)

#define SMOKE_MSG(expr)                                                                     \
  do {                                                                                      \
    std::string _m = (expr);                                                                \
    if (!_m.empty())                                                                        \
      die(::mok::comm::call_site(__FILE__, __LINE__) + ": " + #expr + " failed:\n" + _m);   \
  } while (0)

// ---------------------------------------------------------------- watchdog

volatile const char* g_phase = "startup";
unsigned g_watchdog_s = 60;

void write_stderr(const char* s) {
  size_t n = 0;
  while (s[n] != '\0') ++n;
  ssize_t ignored = write(2, s, n);
  (void)ignored;
}

void on_alarm(int) {
  write_stderr("\nnccl_smoke: WATCHDOG: no progress within the time limit in phase: ");
  write_stderr(const_cast<const char*>(g_phase));
  write_stderr("\nnccl_smoke: a barrier or a kernel is probably stuck\nnccl_smoke: FAIL\n");
  _exit(124);
}

void phase(const char* name) {
  g_phase = name;
  alarm(g_watchdog_s);
  std::printf("-- %s\n", name);
  std::fflush(stdout);
}

// ---------------------------------------------------------------- data

// The 32-bit value of word `word` (byte offset / 4) of rank `rank`'s buffer in
// step `tag`; tag 0 is the zeroed buffer NvlinkComm starts with.
__host__ __device__ __forceinline__ uint32_t pattern(uint32_t rank, uint64_t word, uint32_t tag) {
  uint64_t z = word + (static_cast<uint64_t>(tag & 0xFFFFu) << 32) +
               (static_cast<uint64_t>(rank & 0xFFFFu) << 48) + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<uint32_t>(z);
}

__global__ void fill_kernel(uint4* buf, size_t n_vec, uint32_t rank, uint32_t tag) {
  for (size_t v = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < n_vec;
       v += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint64_t w = static_cast<uint64_t>(v) * 4;
    buf[v] = make_uint4(pattern(rank, w, tag), pattern(rank, w + 1, tag), pattern(rank, w + 2, tag),
                        pattern(rank, w + 3, tag));
  }
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void spin_kernel(uint64_t ns) {
  const uint64_t t0 = global_timer_ns();
  while (global_timer_ns() - t0 < ns) __nanosleep(1000);
}

// ---------------------------------------------------------------- options

struct Options {
  int gpus = 2;
  int iters = 100;
  int batch = 10;
  int64_t check_rows = 1024;
  int64_t rows = 32768;
  size_t row_bytes = 14336;
  int reps = 20;
  int blocks = 0;  // 0: pull_rows_grid
  uint64_t seed = 1;
  bool negative_control = false;
};

void usage() {
  std::printf(
      "usage: nccl_smoke [--gpus N=2] [--iters N=100] [--batch N=10] [--check-rows N=1024]\n"
      "                  [--rows N=32768] [--row-bytes B=14336] [--reps N=20] [--blocks N=auto]\n"
      "                  [--seed N=1] [--watchdog SECONDS=60] [--negative-control]\n"
      "  --negative-control  after the test, run the check loop with the barriers left out and\n"
      "                      report how many words it caught from the wrong step (expected > 0)\n");
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> long long {
      if (i + 1 >= argc) die("missing value after " + a);
      char* end = nullptr;
      long long v = std::strtoll(argv[++i], &end, 10);
      if (end == nullptr || *end != '\0') die("bad value for " + a + ": " + argv[i]);
      return v;
    };
    if (a == "--gpus") o.gpus = static_cast<int>(next());
    else if (a == "--iters") o.iters = static_cast<int>(next());
    else if (a == "--batch") o.batch = static_cast<int>(next());
    else if (a == "--check-rows") o.check_rows = next();
    else if (a == "--rows") o.rows = next();
    else if (a == "--row-bytes") o.row_bytes = static_cast<size_t>(next());
    else if (a == "--reps") o.reps = static_cast<int>(next());
    else if (a == "--blocks") o.blocks = static_cast<int>(next());
    else if (a == "--seed") o.seed = static_cast<uint64_t>(next());
    else if (a == "--watchdog") g_watchdog_s = static_cast<unsigned>(next());
    else if (a == "--negative-control") o.negative_control = true;
    else if (a == "-h" || a == "--help") { usage(); std::exit(0); }
    else { usage(); die("unknown argument " + a); }
  }
  if (o.gpus < 2) die("--gpus must be >= 2");
  if (o.iters < 1 || o.batch < 1 || o.check_rows < 1 || o.rows < 1 || o.reps < 1) die("counts must be >= 1");
  if (o.row_bytes == 0 || o.row_bytes % 16 != 0) die("--row-bytes must be a positive multiple of 16");
  if (g_watchdog_s < 1) die("--watchdog must be >= 1");
  return o;
}

// ---------------------------------------------------------------- state

struct Rank {
  int device = 0;
  int sms = 0;
  cudaStream_t stream = nullptr;
  cudaEvent_t ev0 = nullptr, ev1 = nullptr;
  // Check slots, one per step of a batch.
  char* d_out = nullptr;       // batch x slot_bytes
  int32_t* d_idx = nullptr;    // batch x 2 x check_rows (src_rank then src_row)
  int32_t* d_bad = nullptr;    // batch
  char* h_out = nullptr;       // pinned, batch x slot_bytes
  int32_t* h_idx = nullptr;    // pinned, batch x 2 x check_rows
  int32_t* h_bad = nullptr;    // pinned, batch
  // Timing.
  char* d_tout = nullptr;      // rows x row_bytes
  int32_t* d_tidx = nullptr;   // 2 x rows
};

struct StepPlan {
  uint32_t tag = 0;
  size_t row_bytes = 0;
  size_t window_offset = 0;
  int64_t rows_per_rank = 0;
  std::vector<int64_t> n_rows;        // per rank
  std::vector<int32_t> expected_bad;  // per rank
  int delay_rank = -1;
  bool delay_before_fill = true;
  uint64_t delay_ns = 0;
};

struct Checker {
  int n = 0;
  int64_t words_checked = 0;
  int64_t bad_words = 0;
  int64_t bad_rows = 0;
  int reports = 0;

  std::string explain(uint32_t got, uint64_t gword, uint32_t tag) const {
    if (got == 0xFFFFFFFFu) return "0xffffffff: the poison, the row was never written";
    for (int r = 0; r < n; ++r) {
      for (int64_t t = static_cast<int64_t>(tag) - 3; t <= static_cast<int64_t>(tag) + 3; ++t) {
        if (t < 1) continue;
        if (pattern(r, gword, static_cast<uint32_t>(t)) == got) {
          return "rank " + std::to_string(r) + "'s value from step " + std::to_string(t) +
                 (t < tag ? " (stale: read before the owner's fill: barrier 1)"
                          : t > tag ? " (too new: owner overwrote it while we read: barrier 2)"
                                    : " (right step, wrong rank or place)");
        }
      }
    }
    if (got == 0) return "0 (the initial zeros, or a zero row)";
    return "an unrecognised value";
  }

  // Checks one rank's output of one step; returns the number of bad words.
  int64_t check(int rank, const StepPlan& s, const int32_t* idx, const char* out, int32_t got_bad,
                int64_t check_rows, const char* label) {
    int64_t bad_here = 0;
    const int64_t n_rows = s.n_rows[rank];
    const size_t words = s.row_bytes / 4;
    for (int64_t i = 0; i < n_rows; ++i) {
      const int32_t src_rank = idx[i];
      const int32_t src_row = idx[check_rows + i];
      const bool valid = src_rank >= 0 && src_rank < n && src_row >= 0 && src_row < s.rows_per_rank;
      const uint64_t gword0 = (s.window_offset + static_cast<uint64_t>(src_row) * s.row_bytes) / 4;
      const uint32_t* row = reinterpret_cast<const uint32_t*>(out + static_cast<size_t>(i) * s.row_bytes);
      bool row_bad = false;
      for (size_t w = 0; w < words; ++w) {
        const uint32_t want = valid ? pattern(src_rank, gword0 + w, s.tag) : 0u;
        if (row[w] != want) {
          ++bad_here;
          row_bad = true;
          if (reports < 20) {
            ++reports;
            std::fprintf(stderr,
                         "  MISMATCH %s step tag %u rank %d: out row %" PRId64 " word %zu "
                         "(src rank %d row %d, row_bytes %zu, offset %zu): got 0x%08x want 0x%08x"
                         " = %s\n",
                         label, s.tag, rank, i, w, src_rank, src_row, s.row_bytes, s.window_offset,
                         row[w], want,
                         valid ? explain(row[w], gword0 + w, s.tag).c_str() : "(zero row expected)");
          }
        }
      }
      if (row_bad) ++bad_rows;
    }
    if (got_bad != s.expected_bad[rank]) {
      ++bad_here;
      if (reports < 20) {
        ++reports;
        std::fprintf(stderr, "  MISMATCH %s step tag %u rank %d: bad_rows counter %d, want %d\n", label,
                     s.tag, rank, got_bad, s.expected_bad[rank]);
      }
    }
    words_checked += n_rows * static_cast<int64_t>(words);
    bad_words += bad_here;
    return bad_here;
  }
};

// ---------------------------------------------------------------- steps

StepPlan plan_step(std::mt19937_64& rng, int n, uint32_t tag, size_t buffer_bytes, int64_t check_rows,
                   size_t max_row_bytes, int32_t* const* h_idx_per_rank) {
  StepPlan s;
  s.tag = tag;
  const size_t sizes[] = {16, 48, 1040, 4096, 14336};
  do {
    s.row_bytes = sizes[rng() % (sizeof(sizes) / sizeof(sizes[0]))];
  } while (s.row_bytes > max_row_bytes);
  const size_t offsets[] = {0, 0, 16, 4096, 12345 * 16};
  s.window_offset = offsets[rng() % (sizeof(offsets) / sizeof(offsets[0]))];
  s.rows_per_rank = static_cast<int64_t>((buffer_bytes - s.window_offset) / s.row_bytes);
  if (s.rows_per_rank > INT32_MAX) s.rows_per_rank = INT32_MAX;
  s.n_rows.assign(n, 0);
  s.expected_bad.assign(n, 0);
  const int shape = static_cast<int>(rng() % 4);
  for (int r = 0; r < n; ++r) {
    int64_t rows;
    if (shape == 0) rows = static_cast<int64_t>(rng() % (check_rows + 1));  // anything, 0 included
    else if (shape == 1) rows = (r == static_cast<int>(tag % n)) ? check_rows : 0;  // lopsided
    else if (shape == 2) rows = check_rows;
    else rows = 1 + static_cast<int64_t>(rng() % 8);
    s.n_rows[r] = rows;
    int32_t* src_rank = h_idx_per_rank[r];
    int32_t* src_row = h_idx_per_rank[r] + check_rows;
    const bool inject_bad = (tag % 10 == 7) && rows >= 4;
    for (int64_t i = 0; i < rows; ++i) {
      // Mostly the peers, sometimes this rank itself.
      const int pick = static_cast<int>(rng() % (2 * n));
      src_rank[i] = pick < n ? (r + 1 + pick % (n - 1)) % n : pick - n;
      src_row[i] = static_cast<int32_t>(rng() % static_cast<uint64_t>(s.rows_per_rank));
    }
    if (inject_bad) {
      src_rank[0] = n;                                           // rank out of range
      src_row[1] = static_cast<int32_t>(s.rows_per_rank);       // row out of range
      src_rank[2] = -1;                                          // negative rank
      s.expected_bad[r] = 3;
    }
  }
  const int delay = static_cast<int>(rng() % 3);
  if (delay != 0) {
    s.delay_rank = static_cast<int>(rng() % n);
    s.delay_before_fill = delay == 1;
    s.delay_ns = 20000 + rng() % 300000;  // 20 us .. 320 us
  }
  return s;
}

const char* mb(size_t bytes, char* buf, size_t len) {
  std::snprintf(buf, len, "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  // Before anything can start NCCL: multicast stays off.
  const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
  if (nvls == nullptr || std::strcmp(nvls, "0") != 0) {
    std::printf("nccl_smoke: setting NCCL_NVLS_ENABLE=0 (was %s)\n", nvls ? nvls : "unset");
    setenv("NCCL_NVLS_ENABLE", "0", 1);
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);

  Options opt = parse(argc, argv);
  {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_alarm;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGALRM, &sa, nullptr) != 0) die("sigaction(SIGALRM) failed");
  }

  phase("versions and devices");
  int runtime_version = 0;
  SMOKE_NCCL(ncclGetVersion(&runtime_version));
  std::printf("NCCL runtime %s (%d), headers %s (%d); sizeof(ncclDevComm) = %zu, "
              "sizeof(ncclWindow_vidmem) = %zu\n",
              mok::comm::nccl_version_string(runtime_version).c_str(), runtime_version,
              mok::comm::nccl_version_string(NCCL_VERSION_CODE).c_str(), NCCL_VERSION_CODE,
              sizeof(ncclDevComm), sizeof(ncclWindow_vidmem));
  int cuda_rt = 0, cuda_drv = 0;
  SMOKE_CUDA(cudaRuntimeGetVersion(&cuda_rt));
  SMOKE_CUDA(cudaDriverGetVersion(&cuda_drv));
  std::printf("CUDA runtime %d, driver %d\n", cuda_rt, cuda_drv);
  SMOKE_MSG(mok::comm::check_nccl_runtime_version(nullptr));

  int visible = 0;
  SMOKE_CUDA(cudaGetDeviceCount(&visible));
  if (visible < opt.gpus) die("need " + std::to_string(opt.gpus) + " GPUs, " + std::to_string(visible) + " visible");
  const int n = opt.gpus;
  std::vector<Rank> ranks(n);
  for (int r = 0; r < n; ++r) {
    ranks[r].device = r;
    cudaDeviceProp prop;
    SMOKE_CUDA(cudaGetDeviceProperties(&prop, r));
    ranks[r].sms = prop.multiProcessorCount;
    std::printf("rank %d: device %d %s, sm_%d%d, %d SMs, %.1f GiB\n", r, r, prop.name, prop.major,
                prop.minor, prop.multiProcessorCount, prop.totalGlobalMem / double(1ull << 30));
  }
  for (int a = 0; a < n; ++a) {
    for (int b = 0; b < n; ++b) {
      if (a == b) continue;
      int access = 0, atomics = 0, perf = 0;
      SMOKE_CUDA(cudaDeviceGetP2PAttribute(&access, cudaDevP2PAttrAccessSupported, a, b));
      SMOKE_CUDA(cudaDeviceGetP2PAttribute(&atomics, cudaDevP2PAttrNativeAtomicSupported, a, b));
      SMOKE_CUDA(cudaDeviceGetP2PAttribute(&perf, cudaDevP2PAttrPerformanceRank, a, b));
      std::printf("P2P %d -> %d: access %d, native atomics %d, performance rank %d\n", a, b, access,
                  atomics, perf);
    }
  }

  // Symmetric buffer: the timing rows, and at least one largest check row.
  const size_t buffer_bytes = std::max(static_cast<size_t>(opt.rows) * opt.row_bytes, size_t(14336) * 64);
  if (buffer_bytes / 4 >= (1ull << 32)) die("buffer too large for the 32-bit word pattern");
  const size_t max_check_row_bytes = 14336;
  const size_t slot_bytes = static_cast<size_t>(opt.check_rows) * max_check_row_bytes;

  phase("NvlinkComm::init (ncclCommInitAll, ncclDevCommCreate, ncclMemAlloc, ncclCommWindowRegister)");
  mok::comm::NvlinkComm comm;
  {
    mok::comm::NvlinkCommConfig cfg;
    for (int r = 0; r < n; ++r) cfg.devices.push_back(ranks[r].device);
    cfg.buffer_bytes = buffer_bytes;
    cfg.lsa_barriers = 1024;
    SMOKE_MSG(comm.init(cfg));
  }
  char s1[64];
  for (int r = 0; r < n; ++r) {
    const ncclDevComm& dc = comm.dev_comm(r);
    std::printf("rank %d: devComm rank %d/%d lsa %d/%d, %d LSA barriers, window %p, buffer %p (%s)\n", r,
                dc.rank, dc.nRanks, dc.lsaRank, dc.lsaSize, dc.lsaBarrier.nBarriers,
                static_cast<void*>(comm.window(r)), comm.buffer(r), mb(buffer_bytes, s1, sizeof(s1)));
  }

  phase("allocations and kernel preload");
  int blocks = 0;
  for (int r = 0; r < n; ++r) {
    Rank& R = ranks[r];
    SMOKE_CUDA(cudaSetDevice(R.device));
    SMOKE_CUDA(cudaStreamCreateWithFlags(&R.stream, cudaStreamNonBlocking));
    SMOKE_CUDA(cudaEventCreate(&R.ev0));
    SMOKE_CUDA(cudaEventCreate(&R.ev1));
    SMOKE_CUDA(cudaMalloc(&R.d_out, slot_bytes * opt.batch));
    SMOKE_CUDA(cudaMalloc(&R.d_idx, sizeof(int32_t) * 2 * opt.check_rows * opt.batch));
    SMOKE_CUDA(cudaMalloc(&R.d_bad, sizeof(int32_t) * opt.batch));
    SMOKE_CUDA(cudaMallocHost(&R.h_out, slot_bytes * opt.batch));
    SMOKE_CUDA(cudaMallocHost(&R.h_idx, sizeof(int32_t) * 2 * opt.check_rows * opt.batch));
    SMOKE_CUDA(cudaMallocHost(&R.h_bad, sizeof(int32_t) * opt.batch));
    SMOKE_CUDA(cudaMalloc(&R.d_tout, static_cast<size_t>(opt.rows) * opt.row_bytes));
    SMOKE_CUDA(cudaMalloc(&R.d_tidx, sizeof(int32_t) * 2 * opt.rows));
    // Load every kernel on every device before anything waits on a barrier.
    cudaFuncAttributes attr;
    SMOKE_CUDA(cudaFuncGetAttributes(&attr, fill_kernel));
    SMOKE_CUDA(cudaFuncGetAttributes(&attr, spin_kernel));
    int b = 0;
    SMOKE_MSG(mok::comm::pull_rows_grid(R.device, comm.lsa_barriers(), &b));
    blocks = (r == 0) ? b : std::min(blocks, b);  // the same grid on every rank
  }
  if (opt.blocks > 0) blocks = opt.blocks;
  std::printf("pull_rows grid: %d CTAs x %d threads on every rank\n", blocks, mok::comm::kPullRowsThreads);
  for (int r = 0; r < n; ++r) {
    SMOKE_CUDA(cudaSetDevice(ranks[r].device));
    SMOKE_CUDA(cudaDeviceSynchronize());
  }

  auto fill = [&](int r, uint32_t tag) {
    Rank& R = ranks[r];
    const size_t n_vec = comm.buffer_bytes() / 16;
    fill_kernel<<<R.sms * 4, 256, 0, R.stream>>>(static_cast<uint4*>(comm.buffer(r)), n_vec, r, tag);
    SMOKE_CUDA(cudaGetLastError());
  };

  // Runs `iters` steps; returns the number of bad words.
  auto run_checks = [&](int iters, uint32_t first_tag, bool barriers, const char* label,
                        Checker& checker) {
    std::mt19937_64 rng(opt.seed * 7919 + first_tag);
    std::vector<StepPlan> plans;
    std::vector<int32_t*> idx_ptrs(n);
    char phase_name[128];
    for (int done = 0; done < iters;) {
      const int this_batch = std::min(opt.batch, iters - done);
      std::snprintf(phase_name, sizeof(phase_name), "%s: steps %d..%d enqueued, waiting", label, done + 1,
                    done + this_batch);
      g_phase = phase_name;
      alarm(g_watchdog_s);
      plans.clear();
      for (int k = 0; k < this_batch; ++k) {
        for (int r = 0; r < n; ++r) idx_ptrs[r] = ranks[r].h_idx + static_cast<size_t>(k) * 2 * opt.check_rows;
        plans.push_back(plan_step(rng, n, first_tag + done + k, comm.buffer_bytes(), opt.check_rows,
                                  max_check_row_bytes, idx_ptrs.data()));
      }
      // Enqueue the whole batch on every rank with no host synchronisation.
      for (int k = 0; k < this_batch; ++k) {
        const StepPlan& s = plans[k];
        for (int r = 0; r < n; ++r) {
          Rank& R = ranks[r];
          SMOKE_CUDA(cudaSetDevice(R.device));
          int32_t* d_idx = R.d_idx + static_cast<size_t>(k) * 2 * opt.check_rows;
          int32_t* h_idx = R.h_idx + static_cast<size_t>(k) * 2 * opt.check_rows;
          char* d_out = R.d_out + static_cast<size_t>(k) * slot_bytes;
          char* h_out = R.h_out + static_cast<size_t>(k) * slot_bytes;
          const size_t out_bytes = static_cast<size_t>(s.n_rows[r]) * s.row_bytes;
          SMOKE_CUDA(cudaMemcpyAsync(d_idx, h_idx, sizeof(int32_t) * 2 * opt.check_rows,
                                     cudaMemcpyHostToDevice, R.stream));
          SMOKE_CUDA(cudaMemsetAsync(d_out, 0xFF, out_bytes, R.stream));
          SMOKE_CUDA(cudaMemsetAsync(R.d_bad + k, 0, sizeof(int32_t), R.stream));
          if (s.delay_rank == r && s.delay_before_fill) {
            spin_kernel<<<1, 1, 0, R.stream>>>(s.delay_ns);
            SMOKE_CUDA(cudaGetLastError());
          }
          fill(r, s.tag);
          if (s.delay_rank == r && !s.delay_before_fill) {
            spin_kernel<<<1, 1, 0, R.stream>>>(s.delay_ns);
            SMOKE_CUDA(cudaGetLastError());
          }
          mok::comm::PullRowsArgs a;
          a.window = comm.window(r);
          a.window_bytes = comm.buffer_bytes();
          a.window_offset = s.window_offset;
          a.row_bytes = s.row_bytes;
          a.rows_per_rank = s.rows_per_rank;
          a.src_rank = d_idx;
          a.src_row = d_idx + opt.check_rows;
          a.n_rows = s.n_rows[r];
          a.out = d_out;
          a.bad_rows = R.d_bad + k;
          if (barriers) {
            SMOKE_MSG(mok::comm::launch_pull_rows(comm.dev_comm(r), a, blocks, R.stream));
          } else {
            SMOKE_MSG(mok::comm::testing::launch_pull_rows_without_barriers(comm.dev_comm(r), a, blocks,
                                                                            R.stream));
          }
          SMOKE_CUDA(cudaMemcpyAsync(h_out, d_out, out_bytes, cudaMemcpyDeviceToHost, R.stream));
          SMOKE_CUDA(cudaMemcpyAsync(R.h_bad + k, R.d_bad + k, sizeof(int32_t), cudaMemcpyDeviceToHost,
                                     R.stream));
        }
      }
      for (int r = 0; r < n; ++r) {
        SMOKE_CUDA(cudaSetDevice(ranks[r].device));
        SMOKE_CUDA(cudaStreamSynchronize(ranks[r].stream));
      }
      alarm(g_watchdog_s);
      for (int k = 0; k < this_batch; ++k) {
        for (int r = 0; r < n; ++r) {
          const Rank& R = ranks[r];
          checker.check(r, plans[k], R.h_idx + static_cast<size_t>(k) * 2 * opt.check_rows,
                        R.h_out + static_cast<size_t>(k) * slot_bytes, R.h_bad[k], opt.check_rows, label);
        }
      }
      done += this_batch;
    }
  };

  bool ok = true;

  // (b)-(e)
  phase("correctness: fill, pull_rows, host check");
  Checker checker;
  checker.n = n;
  run_checks(opt.iters, 1, /*barriers=*/true, "check", checker);
  std::printf("correctness: %d steps, %" PRId64 " words checked, %" PRId64 " bad words in %" PRId64
              " rows\n",
              opt.iters, checker.words_checked, checker.bad_words, checker.bad_rows);
  if (checker.bad_words != 0) ok = false;

  // (f)
  phase("timing");
  const uint32_t ttag = static_cast<uint32_t>(opt.iters) + 100;
  for (int r = 0; r < n; ++r) {
    SMOKE_CUDA(cudaSetDevice(ranks[r].device));
    fill(r, ttag);
  }
  for (int r = 0; r < n; ++r) {
    SMOKE_CUDA(cudaSetDevice(ranks[r].device));
    SMOKE_CUDA(cudaStreamSynchronize(ranks[r].stream));
  }
  const int64_t rows_per_rank = static_cast<int64_t>(comm.buffer_bytes() / opt.row_bytes);
  std::vector<std::vector<int32_t>> tidx(n, std::vector<int32_t>(2 * opt.rows));
  struct Mode {
    const char* name;
    int kind;  // 0 peer (all ranks), 1 peer (rank 0 only), 2 local, 3 empty
  };
  const Mode modes[] = {{"from peer, all ranks at once", 0},
                        {"from peer, rank 0 only (others 0 rows)", 1},
                        {"from itself (local HBM copy)", 2},
                        {"0 rows (launch + 2 barriers)", 3}};
  std::mt19937_64 trng(opt.seed + 12345);
  for (const Mode& m : modes) {
    std::vector<int64_t> n_rows(n);
    for (int r = 0; r < n; ++r) {
      int src = (m.kind == 2) ? r : (r + 1) % n;
      n_rows[r] = (m.kind == 3 || (m.kind == 1 && r != 0)) ? 0 : opt.rows;
      std::vector<int32_t> perm(rows_per_rank);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), trng);
      for (int64_t i = 0; i < opt.rows; ++i) {
        tidx[r][i] = src;
        tidx[r][opt.rows + i] = perm[i % rows_per_rank];
      }
      SMOKE_CUDA(cudaSetDevice(ranks[r].device));
      SMOKE_CUDA(cudaMemcpy(ranks[r].d_tidx, tidx[r].data(), sizeof(int32_t) * 2 * opt.rows,
                            cudaMemcpyHostToDevice));
    }
    auto launch_all = [&](int r) {
      mok::comm::PullRowsArgs a;
      a.window = comm.window(r);
      a.window_bytes = comm.buffer_bytes();
      a.window_offset = 0;
      a.row_bytes = opt.row_bytes;
      a.rows_per_rank = rows_per_rank;
      a.src_rank = ranks[r].d_tidx;
      a.src_row = ranks[r].d_tidx + opt.rows;
      a.n_rows = n_rows[r];
      a.out = ranks[r].d_tout;
      SMOKE_MSG(mok::comm::launch_pull_rows(comm.dev_comm(r), a, blocks, ranks[r].stream));
    };
    for (int warm = 0; warm < 3; ++warm) {
      for (int r = 0; r < n; ++r) {
        SMOKE_CUDA(cudaSetDevice(ranks[r].device));
        launch_all(r);
      }
    }
    for (int r = 0; r < n; ++r) {
      SMOKE_CUDA(cudaSetDevice(ranks[r].device));
      SMOKE_CUDA(cudaStreamSynchronize(ranks[r].stream));
    }
    alarm(g_watchdog_s);
    for (int r = 0; r < n; ++r) {
      SMOKE_CUDA(cudaSetDevice(ranks[r].device));
      SMOKE_CUDA(cudaEventRecord(ranks[r].ev0, ranks[r].stream));
    }
    for (int rep = 0; rep < opt.reps; ++rep) {
      for (int r = 0; r < n; ++r) {
        SMOKE_CUDA(cudaSetDevice(ranks[r].device));
        launch_all(r);
      }
    }
    for (int r = 0; r < n; ++r) {
      SMOKE_CUDA(cudaSetDevice(ranks[r].device));
      SMOKE_CUDA(cudaEventRecord(ranks[r].ev1, ranks[r].stream));
    }
    for (int r = 0; r < n; ++r) {
      SMOKE_CUDA(cudaSetDevice(ranks[r].device));
      SMOKE_CUDA(cudaEventSynchronize(ranks[r].ev1));
    }
    alarm(g_watchdog_s);
    std::printf("pull %s, %d reps:\n", m.name, opt.reps);
    for (int r = 0; r < n; ++r) {
      float ms = 0;
      SMOKE_CUDA(cudaEventElapsedTime(&ms, ranks[r].ev0, ranks[r].ev1));
      const double per = ms / 1e3 / opt.reps;
      const double bytes = static_cast<double>(n_rows[r]) * opt.row_bytes;
      if (n_rows[r] > 0) {
        std::printf("  rank %d: %" PRId64 " rows x %zu B = %.1f MB in %.1f us: %.1f GB/s\n", r, n_rows[r],
                    opt.row_bytes, bytes / 1e6, per * 1e6, bytes / per / 1e9);
      } else {
        std::printf("  rank %d: 0 rows, %.1f us per launch\n", r, per * 1e6);
      }
    }
    if (m.kind == 0 || m.kind == 2) {
      // Check the last pull's output completely.
      StepPlan s;
      s.tag = ttag;
      s.row_bytes = opt.row_bytes;
      s.window_offset = 0;
      s.rows_per_rank = rows_per_rank;
      s.n_rows = n_rows;
      s.expected_bad.assign(n, 0);
      std::vector<char> host(static_cast<size_t>(opt.rows) * opt.row_bytes);
      int64_t before = checker.bad_words;
      for (int r = 0; r < n; ++r) {
        SMOKE_CUDA(cudaSetDevice(ranks[r].device));
        SMOKE_CUDA(cudaMemcpy(host.data(), ranks[r].d_tout, host.size(), cudaMemcpyDeviceToHost));
        std::vector<int32_t> idx_copy = tidx[r];
        // Checker reads src_row at idx[check_rows + i]; here check_rows == rows.
        checker.check(r, s, idx_copy.data(), host.data(), 0, opt.rows, "timing");
      }
      std::printf("  output checked: %s\n", checker.bad_words == before ? "ok" : "MISMATCHES");
      if (checker.bad_words != before) ok = false;
    }
  }

  // Optional: the same checks without barriers must catch races.
  if (opt.negative_control) {
    phase("negative control: pull_rows without barriers");
    Checker nc;
    nc.n = n;
    nc.reports = 15;  // print at most 5 examples
    run_checks(std::min(opt.iters, 50), ttag + 100, /*barriers=*/false, "no-barrier", nc);
    std::printf("negative control: %" PRId64 " bad words in %" PRId64 " rows over %" PRId64
                " words (expected > 0: the checks can see a missing barrier)\n",
                nc.bad_words, nc.bad_rows, nc.words_checked);
    if (nc.bad_words == 0) std::printf("negative control: WARNING: no race was caught\n");
  }

  // (g)
  phase("teardown");
  for (int r = 0; r < n; ++r) {
    Rank& R = ranks[r];
    SMOKE_CUDA(cudaSetDevice(R.device));
    SMOKE_CUDA(cudaStreamSynchronize(R.stream));
    SMOKE_CUDA(cudaFree(R.d_out));
    SMOKE_CUDA(cudaFree(R.d_idx));
    SMOKE_CUDA(cudaFree(R.d_bad));
    SMOKE_CUDA(cudaFreeHost(R.h_out));
    SMOKE_CUDA(cudaFreeHost(R.h_idx));
    SMOKE_CUDA(cudaFreeHost(R.h_bad));
    SMOKE_CUDA(cudaFree(R.d_tout));
    SMOKE_CUDA(cudaFree(R.d_tidx));
    SMOKE_CUDA(cudaEventDestroy(R.ev0));
    SMOKE_CUDA(cudaEventDestroy(R.ev1));
    SMOKE_CUDA(cudaStreamDestroy(R.stream));
  }
  SMOKE_MSG(comm.destroy());
  alarm(0);

  std::printf("nccl_smoke: %s (NCCL %s, %d GPUs, %d steps checked)\n", ok ? "PASS" : "FAIL",
              mok::comm::nccl_version_string(runtime_version).c_str(), n, opt.iters);
  return ok ? 0 : 1;
}
