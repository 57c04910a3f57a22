// nanobind module mok_jax._mok: the FFI handler capsules per platform and the
// enums Python must mirror. Python (mok_jax/_src/ext.py) registers the targets.
#include <nanobind/nanobind.h>

#include <type_traits>

#include "cpu/parallel.h"
#include "handlers/moe_cpu.h"
#ifdef MOK_WITH_CUDA
#include "handlers/moe_cuda.h"
#include "handlers/norm_cuda.h"
#include "handlers/quantize_cuda.h"
#include "kernels/grouped_gemm.h"
#include "kernels/moe_persistent.h"
#endif
#include "mok/swiglu_rule.h"
#include "mok/types.h"

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule encapsulate(Fn* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Fn, XLA_FFI_CallFrame*>,
                "an XLA FFI handler must take an XLA_FFI_CallFrame*");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// {platform: {target name: handler capsule}}; platform names as jax.ffi expects.
nb::dict registrations() {
  nb::dict cpu;
  cpu["mok_moe_fwd"] = encapsulate(MokMoeForwardCpu);
  cpu["mok_moe_bwd"] = encapsulate(MokMoeBackwardCpu);
  cpu["mok_expert_ffn_fwd"] = encapsulate(MokExpertFfnForwardCpu);
  cpu["mok_expert_ffn_bwd"] = encapsulate(MokExpertFfnBackwardCpu);
  cpu["mok_combine"] = encapsulate(MokCombineCpu);
  cpu["mok_quantize_rows_fp8"] = encapsulate(MokQuantizeRowsFp8Cpu);
  nb::dict out;
  out["cpu"] = cpu;
#ifdef MOK_WITH_CUDA
  nb::dict gpu;
  gpu["mok_moe_fwd"] = encapsulate(MokMoeForwardCuda);
  gpu["mok_moe_fwd_ranks"] = encapsulate(MokMoeForwardRanksCuda);
  gpu["mok_moe_bwd_ranks"] = encapsulate(MokMoeBackwardRanksCuda);
  gpu["mok_moe_bwd"] = encapsulate(MokMoeBackwardCuda);
  gpu["mok_expert_ffn_fwd"] = encapsulate(MokExpertFfnForwardCuda);
  gpu["mok_expert_ffn_bwd"] = encapsulate(MokExpertFfnBackwardCuda);
  gpu["mok_combine"] = encapsulate(MokCombineCuda);
  gpu["mok_add_rms_norm_fwd"] = encapsulate(MokAddRmsNormForwardCuda);
  gpu["mok_add_rms_norm_bwd"] = encapsulate(MokAddRmsNormBackwardCuda);
  gpu["mok_quantize_rows_fp8"] = encapsulate(MokQuantizeRowsFp8Cuda);
  out["CUDA"] = gpu;
#endif
  return out;
}

nb::dict recipes() {
  nb::dict out;
  for (mok::Recipe r : {mok::Recipe::kNative, mok::Recipe::kFp8}) {
    out[mok::recipe_name(r)] = static_cast<int32_t>(r);
  }
  return out;
}

}  // namespace

NB_MODULE(_mok, m) {
  m.doc() = "mok_jax native extension: XLA FFI handlers for the fused MoE layer";
  m.def("registrations", &registrations,
        "Handler capsules by platform: {'cpu': {name: capsule}, 'CUDA': {...}}.");
  m.attr("NO_CAPACITY") = mok::kNoCapacity;
#ifdef MOK_HAVE_SM90A
  m.attr("HAS_SM90A_KERNELS") = true;
#else
  m.attr("HAS_SM90A_KERNELS") = false;
#endif
  // What this build holds (mok_jax.build_info()).
#ifdef MOK_WITH_CUDA
  m.attr("CUDA_KERNELS") = true;
  m.attr("CUDA_ARCHITECTURES") = MOK_CUDA_ARCHITECTURES;  // comma-separated
  m.attr("CUDA_VERSION") = MOK_CUDA_VERSION;              // of the nvcc that compiled them
#else
  m.attr("CUDA_KERNELS") = false;
  m.attr("CUDA_ARCHITECTURES") = "";
  m.attr("CUDA_VERSION") = "";
#endif
  m.def("swiglu_epilogue_shape", &mok::swiglu_epilogue_shape, nb::arg("experts"),
        nb::arg("hidden"), nb::arg("ffn"), nb::arg("rows"),
        "Whether a bf16 forward on sm_90a of these sizes (rows = T*K) runs GEMM1 with "
        "SwiGLU in its epilogue.");
  m.def("recipes", &recipes,
        "The recipes of the expert FFN: {name: value of the handlers' recipe attribute}.");
  m.def(
      "set_cpu_threads",
      [](int threads) {
        if (threads < 0) throw nb::value_error("set_cpu_threads: threads must be >= 0");
        return mok::cpu::set_cpu_threads(threads);
      },
      nb::arg("threads"),
      "Sets the threads of the CPU handlers for every later call in this process; 0 "
      "means the default (MOK_CPU_THREADS as the process had it at its first CPU call, "
      "else the machine's hardware threads). Returns the previous setting (0: the "
      "default). Results have the same bits for every count.");
  m.def("cpu_threads", &mok::cpu::cpu_threads,
        "The threads the next call of a CPU handler runs on.");
#ifdef MOK_WITH_CUDA
  m.def("set_swiglu_epilogue", &mok::cuda::set_swiglu_epilogue, nb::arg("enabled"),
        "Lets GEMM1 run SwiGLU in its epilogue where it applies (the default) or not, for "
        "every later call in this process; returns the previous setting. Both paths give "
        "the same bits; tests use this to show it.");
#endif
#ifdef MOK_HAVE_SM90A
  nb::enum_<mok::cuda::PersistentMode>(m, "PersistentMode",
                                       "When the one-device forward and backward each run "
                                       "as one persistent kernel after the routing plan.")
      .value("OFF", mok::cuda::PersistentMode::kOff, "never: the kernel chain")
      .value("AUTO", mok::cuda::PersistentMode::kAuto, "where it is faster (the default)")
      .value("ALWAYS", mok::cuda::PersistentMode::kAlways, "wherever it can");
  m.def("set_persistent_kernels", &mok::cuda::set_persistent_kernels, nb::arg("mode"),
        "Sets when the one-device forward and backward each run as one persistent kernel "
        "after the routing plan (gathers, expert GEMMs, SwiGLU, combine in one launch) "
        "instead of the kernel chains, for every later call in this process; returns the "
        "previous mode. Every mode gives the same bits; tests and the benchmark compare "
        "the paths.");
  m.def(
      "persistent_shape",
      [](int64_t tokens, int64_t top_k, int64_t experts, int64_t hidden, int64_t ffn,
         bool residuals) {
        const mok::MoeShape s{tokens, top_k, experts, hidden, ffn};
        return mok::cuda::persistent_supported(s, mok::Recipe::kNative, mok::DType::kBF16,
                                               residuals);
      },
      nb::arg("tokens"), nb::arg("top_k"), nb::arg("experts"), nb::arg("hidden"),
      nb::arg("ffn"), nb::arg("residuals") = false,
      "Whether a bf16 one-device forward of these sizes on this device runs as the "
      "persistent kernel under the current mode; residuals: a forward that also "
      "writes the residuals a backward keeps (under a gradient).");
  m.def(
      "persistent_tile_rows",
      [](int64_t tokens, int64_t top_k, int64_t experts, int64_t hidden, int64_t ffn) {
        const mok::MoeShape s{tokens, top_k, experts, hidden, ffn};
        return mok::cuda::persistent_forward_tile_rows(s);
      },
      nb::arg("tokens"), nb::arg("top_k"), nb::arg("experts"), nb::arg("hidden"),
      nb::arg("ffn"),
      "The rows of the persistent forward's GEMM tiles at these sizes: 64 where experts "
      "average at most 64 rows, else 128 (E <= 2048).");
  m.def(
      "persistent_backward_shape",
      [](int64_t tokens, int64_t top_k, int64_t experts, int64_t hidden, int64_t ffn) {
        const mok::MoeShape s{tokens, top_k, experts, hidden, ffn};
        return mok::cuda::persistent_backward_supported(s, mok::Recipe::kNative,
                                                        mok::DType::kBF16);
      },
      nb::arg("tokens"), nb::arg("top_k"), nb::arg("experts"), nb::arg("hidden"),
      nb::arg("ffn"),
      "Whether a bf16 one-device backward of these sizes on this device runs as the "
      "persistent kernel under the current mode (under AUTO: at most 256 rows per "
      "expert over 64 or more experts, 4096 for experts of H*F <= 2048*1024, where it "
      "is the faster one).");
#endif
  nb::enum_<mok::DType>(m, "DType", "Element types the kernels accept.", nb::is_arithmetic())
      .value("F32", mok::DType::kF32)
      .value("BF16", mok::DType::kBF16);
}
