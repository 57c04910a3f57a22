// XLA FFI handlers of the fused EP transport (backend="fused" under expert
// parallelism): mok_ep_dispatch and mok_ep_combine. They find their rank's
// communicator by (handle attribute, CUDA ordinal), check every shape against
// the window, and enqueue barrier -> copy -> barrier on XLA's stream
// (ffi/comm/ep_kernels.cuh). The routes come from mok_jax's plan
// (mok_jax/_src/transport.py, NvlinkTransport.route).
#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <string>

#include "comm/ep_kernels.cuh"
#include "comm/ep_registry.h"
#include "handlers/checks.h"
#include "kernels/expert_ffn_cuda.h"
#include "mok/types.h"
#include "xla/ffi/api/ffi.h"

namespace mok {
namespace {

namespace ffi = xla::ffi;
using comm::Phase;

size_t element_bytes(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return 4;
    case ffi::DataType::BF16: return 2;
    default: return 0;
  }
}

// A buffer's element count as the signed type of its dimensions.
template <class Buffer>
int64_t elements(const Buffer& b) {
  return static_cast<int64_t>(b.element_count());
}

// FNV-1a over the call's shape words: what every rank of the call must agree on.
uint32_t signature(std::initializer_list<int64_t> words) {
  uint32_t h = 2166136261u;
  for (int64_t w : words) {
    for (int i = 0; i < 8; ++i) {
      h ^= static_cast<uint32_t>((static_cast<uint64_t>(w) >> (8 * i)) & 0xff);
      h *= 16777619u;
    }
  }
  return h;
}

ffi::Error invalid(const char* op, const std::string& msg) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + msg);
}

ffi::Error barrier(const char* op, const comm::RankView& v, Phase phase, uint32_t sig,
                   cudaStream_t stream) {
  comm::BarrierArgs b;
  b.window = v.window;
  b.rank = v.rank;
  b.nranks = v.nranks;
  b.epoch = v.epoch;
  b.signature = sig ^ (static_cast<uint32_t>(phase) * 0x9e3779b9u);
  b.phase = static_cast<int32_t>(phase);
  b.timeout_ns = v.timeout_ns;
  b.error = v.error;
  return ffi_checks::launcher_result(op, comm::launch_barrier(b, stream));
}

// A device-to-device copy on XLA's stream (between XLA buffers and the window).
ffi::Error copy_async(const char* op, void* dst, const void* src, size_t bytes,
                      cudaStream_t stream) {
  if (bytes == 0) return ffi::Error::Success();
  cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream);
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi_checks::launcher_result(op, std::string("cudaMemcpyAsync: ") + cudaGetErrorString(e));
}

// Pairs are numbered owner * T * K + pair in int32 over the exchange group.
ffi::Error pairs_fit(const char* op, const comm::RankView& v, int64_t T, int64_t K) {
  if (int64_t(v.nranks) * T * K <= INT32_MAX) return ffi::Error::Success();
  return invalid(op, "P * T * K must be below 2^31 (pairs of the exchange group)");
}

ffi::Error window_fits(const char* op, const comm::RankView& v, const comm::WindowLayout& l) {
  if (l.total <= v.window_bytes) return ffi::Error::Success();
  return invalid(op, "this call needs a " + std::to_string(l.total) +
                         "-byte window but the communicator's is " +
                         std::to_string(v.window_bytes) +
                         " bytes (mok_jax sizes it when it traces a call; was this "
                         "executable compiled for other shapes?)");
}

ffi::Error EpDispatch(cudaStream_t stream, int32_t device, ffi::AnyBuffer values,
                      ffi::AnyBuffer pair_values, ffi::Buffer<ffi::S32> entries,
                      ffi::Buffer<ffi::S32> dest, int64_t handle, int64_t fingerprint,
                      int64_t site, ffi::Result<ffi::AnyBuffer> rows,
                      ffi::Result<ffi::AnyBuffer> row_values) {
  constexpr const char* op = "mok_ep_dispatch (CUDA)";
  auto vd = values.dimensions();
  auto dd = dest.dimensions();
  auto rd = rows->dimensions();
  if (vd.size() != 2 || dd.size() != 2 || rd.size() != 2 || entries.dimensions().size() != 1)
    return invalid(op, "values, dest and rows must be 2-D, entries 1-D");
  const int64_t T = vd[0], H = vd[1], K = dd[1], N = dd[0], R = rd[0];
  const size_t es = element_bytes(values.element_type());
  if (es == 0 || rows->element_type() != values.element_type())
    return invalid(op, "values and rows must both be float32 or bfloat16");
  if (rd[1] != H || elements(entries) != N)
    return invalid(op, "rows " + ffi_checks::dims_str(rd) + " / entries do not match values " +
                           ffi_checks::dims_str(vd) + " and dest " + ffi_checks::dims_str(dd));
  const bool with_scalars = elements(pair_values) > 0;
  size_t sb = 0;
  if (with_scalars) {
    sb = element_bytes(pair_values.element_type());
    if (sb == 0 || elements(pair_values) != T * K ||
        row_values->element_type() != pair_values.element_type() ||
        elements(*row_values) != R)
      return invalid(op, "pair_values must be [T, K] and row_values [R], both of one float type");
  } else if (elements(*row_values) != 0) {
    return invalid(op, "row_values must be empty when pair_values is");
  }
  const size_t row_bytes = static_cast<size_t>(H) * es;
  if (row_bytes % 16 != 0) return invalid(op, "a row must be a multiple of 16 bytes");

  comm::RankLookup lookup;
  MOK_RETURN_IF_ERROR(ffi_checks::launcher_result(
      op, lookup.find(handle, static_cast<uint64_t>(fingerprint), device)));
  const comm::RankView& v = lookup.view();
  MOK_RETURN_IF_ERROR(pairs_fit(op, v, T, K));
  if (N != static_cast<int64_t>(v.nranks) * T)
    return invalid(op, std::to_string(N) + " pull entries for " + std::to_string(v.nranks) +
                           " ranks of " + std::to_string(T) + " tokens");
  const comm::WindowLayout layout = comm::window_layout(T, K, row_bytes, 4);
  MOK_RETURN_IF_ERROR(window_fits(op, v, layout));
  // The call site (which EP call of the program, numbered at lowering) is part of
  // the signature: ranks running different calls of equal shapes fail too.
  const uint32_t sig = signature({1, site, T, K, H, int64_t(es), int64_t(sb), R});

  comm::PullArgs a;
  a.window = v.window;
  a.layout = layout;
  a.nranks = v.nranks;
  a.tokens = T;
  a.top_k = K;
  a.row_bytes = row_bytes;
  a.scalar_bytes = sb;
  a.entries = entries.typed_data();
  a.dest = dest.typed_data();
  a.n_entries = N;
  a.out = rows->untyped_data();
  a.out_scalars = with_scalars ? row_values->untyped_data() : nullptr;
  a.out_rows = R;
  // Every check before the first barrier: a rank that stopped after it would
  // leave its peers waiting there until the timeout.
  MOK_RETURN_IF_ERROR(ffi_checks::launcher_result(op, comm::check_pull(a)));
  int blocks = 0;
  MOK_RETURN_IF_ERROR(
      ffi_checks::launcher_result(op, comm::copy_blocks(device, a.n_entries, &blocks)));

  char* own = static_cast<char*>(v.buffer);
  MOK_RETURN_IF_ERROR(copy_async(op, own + layout.tokens_offset, values.untyped_data(),
                                  static_cast<size_t>(T) * row_bytes, stream));
  if (with_scalars) {
    MOK_RETURN_IF_ERROR(copy_async(op, own + layout.pair_scalars_offset,
                                    pair_values.untyped_data(), static_cast<size_t>(T * K) * sb,
                                    stream));
  }
  MOK_RETURN_IF_ERROR(barrier(op, v, Phase::kDispatchBegin, sig, stream));
  MOK_RETURN_IF_ERROR(ffi_checks::launcher_result(op, comm::launch_pull(a, blocks, stream)));
  return barrier(op, v, Phase::kDispatchEnd, sig, stream);
}

ffi::Error EpCombine(cudaStream_t stream, ffi::ScratchAllocator scratch, int32_t device,
                     ffi::AnyBuffer rows, ffi::AnyBuffer row_values, ffi::AnyBuffer weights,
                     ffi::Buffer<ffi::S32> kept, ffi::Buffer<ffi::S32> dest, int64_t handle,
                     int64_t fingerprint, int64_t site, bool weighted,
                     ffi::Result<ffi::AnyBuffer> out,
                     ffi::Result<ffi::AnyBuffer> pair_values) {
  constexpr const char* op = "mok_ep_combine (CUDA)";
  auto rd = rows.dimensions();
  auto kd = kept.dimensions();
  auto od = out->dimensions();
  if (rd.size() != 2 || kd.size() != 2 || od.size() != 2 || dest.dimensions().size() != 1)
    return invalid(op, "rows, kept and out must be 2-D, dest 1-D");
  const int64_t R = rd[0], H = rd[1], T = kd[0], K = kd[1];
  const size_t es = element_bytes(rows.element_type());
  auto x_dtype = ffi_checks::to_mok_dtype(rows.element_type());
  auto w_dtype = ffi_checks::to_mok_dtype(weights.element_type());
  if (es == 0 || !x_dtype || out->element_type() != rows.element_type())
    return invalid(op, "rows and out must both be float32 or bfloat16");
  if (!w_dtype || elements(weights) != T * K)
    return invalid(op, "weights must be [T, K] float32 or bfloat16");
  if (od[0] != T || od[1] != H || elements(dest) != R)
    return invalid(op, "out " + ffi_checks::dims_str(od) + " / dest do not match rows " +
                           ffi_checks::dims_str(rd) + " and kept " + ffi_checks::dims_str(kd));
  const bool with_scalars = elements(row_values) > 0;
  size_t sb = 0;
  if (with_scalars) {
    sb = element_bytes(row_values.element_type());
    if (sb == 0 || elements(row_values) != R ||
        pair_values->element_type() != row_values.element_type() ||
        elements(*pair_values) != T * K)
      return invalid(op, "row_values must be [R] and pair_values [T * K], both of one float type");
  } else if (elements(*pair_values) != 0) {
    return invalid(op, "pair_values must be empty when row_values is");
  }
  const size_t row_bytes = static_cast<size_t>(H) * es;
  if (row_bytes % 16 != 0) return invalid(op, "a row must be a multiple of 16 bytes");
  if (T * K > INT32_MAX) return invalid(op, "T * K must be below 2^31");

  comm::RankLookup lookup;
  MOK_RETURN_IF_ERROR(ffi_checks::launcher_result(
      op, lookup.find(handle, static_cast<uint64_t>(fingerprint), device)));
  const comm::RankView& v = lookup.view();
  MOK_RETURN_IF_ERROR(pairs_fit(op, v, T, K));
  const comm::WindowLayout layout = comm::window_layout(T, K, row_bytes, 4);
  MOK_RETURN_IF_ERROR(window_fits(op, v, layout));
  const uint32_t sig =
      signature({2, site, T, K, H, int64_t(es), int64_t(sb), R, weighted ? 1 : 0});

  const size_t ws_bytes = cuda::combine_workspace_bytes(T * K);
  void* ws = nullptr;
  if (ws_bytes > 0) {
    // XLA's scratch allocator guarantees 16-byte alignment; round up to 256 ourselves.
    std::optional<void*> p = scratch.Allocate(ws_bytes + 256, 16);
    if (!p.has_value())
      return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                        std::string(op) + ": no scratch for the combine");
    ws = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(*p) + 255) & ~uintptr_t(255));
  }

  comm::PushArgs a;
  a.window = v.window;
  a.layout = layout;
  a.nranks = v.nranks;
  a.pairs = T * K;
  a.row_bytes = row_bytes;
  a.scalar_bytes = sb;
  a.rows = rows.untyped_data();
  a.row_scalars = with_scalars ? row_values.untyped_data() : nullptr;
  a.dest = dest.typed_data();
  a.n_rows = R;
  MOK_RETURN_IF_ERROR(ffi_checks::launcher_result(op, comm::check_push(a)));
  int blocks = 0;
  MOK_RETURN_IF_ERROR(
      ffi_checks::launcher_result(op, comm::copy_blocks(device, a.n_rows, &blocks)));
  MOK_RETURN_IF_ERROR(barrier(op, v, Phase::kCombineBegin, sig, stream));
  MOK_RETURN_IF_ERROR(ffi_checks::launcher_result(op, comm::launch_push(a, blocks, stream)));
  MOK_RETURN_IF_ERROR(barrier(op, v, Phase::kCombineEnd, sig, stream));

  const char* own = static_cast<const char*>(v.buffer);
  std::string err = cuda::combine_kept_rows(
      *x_dtype, *w_dtype, own + layout.slots_offset, weighted ? weights.untyped_data() : nullptr,
      kept.typed_data(), T, K, H, out->untyped_data(), ws, ws_bytes, stream);
  MOK_RETURN_IF_ERROR(ffi_checks::launcher_result(op, err));
  if (!with_scalars) return ffi::Error::Success();
  return copy_async(op, pair_values->untyped_data(), own + layout.slot_scalars_offset,
                    static_cast<size_t>(T * K) * sb, stream);
}

}  // namespace
}  // namespace mok

XLA_FFI_DEFINE_HANDLER_SYMBOL(MokEpDispatchCuda, mok::EpDispatch,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::AnyBuffer>()          // values [T, H]
                                  .Arg<xla::ffi::AnyBuffer>()          // pair_values [T, K] or [0]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // entries [P*T]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // dest [P*T, K]
                                  .Attr<int64_t>("handle")
                                  .Attr<int64_t>("fingerprint")      // the set's devices
                                  .Attr<int64_t>("site")             // which EP call
                                  .Ret<xla::ffi::AnyBuffer>()          // rows [R, H]
                                  .Ret<xla::ffi::AnyBuffer>());        // row_values [R] or [0]

XLA_FFI_DEFINE_HANDLER_SYMBOL(MokEpCombineCuda, mok::EpCombine,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::ScratchAllocator>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::AnyBuffer>()          // rows [R, H]
                                  .Arg<xla::ffi::AnyBuffer>()          // row_values [R] or [0]
                                  .Arg<xla::ffi::AnyBuffer>()          // weights [T, K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // kept [T, K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // dest [R]
                                  .Attr<int64_t>("handle")
                                  .Attr<int64_t>("fingerprint")
                                  .Attr<int64_t>("site")
                                  .Attr<bool>("weighted")
                                  .Ret<xla::ffi::AnyBuffer>()          // out [T, H]
                                  .Ret<xla::ffi::AnyBuffer>());        // pair_values [T*K] or [0]
