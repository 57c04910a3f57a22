#include "expert_ffn_fp8.h"

#include <algorithm>

#include "cuda_check.h"
#include "device_info.h"
#include "fp8_quant.h"
#include "moe_elementwise.h"
#include "workspace.h"
#ifdef MOK_HAVE_SM90A
#include "gemm_fp8.h"
#endif

namespace mok::cuda {
namespace {

// The padded sizes: every 128-block of K starts 128-aligned (per gate/up half).
struct Dims {
  int64_t R, E, H, F, Hp, Fp;
  explicit Dims(const ExpertFfnShape& s)
      : R(s.rows), E(s.experts), H(s.hidden), F(s.ffn), Hp(fp8_round_up(s.hidden)),
        Fp(fp8_round_up(s.ffn)) {}
};

size_t gemm_workspace_bytes(int64_t experts, bool wgrad) {
#ifdef MOK_HAVE_SM90A
  DeviceInfo d;
  if (!current_device_info(&d).empty()) return 0;
  size_t bytes = std::max(fp8_grouped::rows_f32_workspace_bytes(experts, d.device, d.sm_count),
                          fp8_grouped::rows_bf16_workspace_bytes(experts, d.device, d.sm_count));
  if (wgrad) {
    bytes = std::max(bytes,
                     fp8_grouped::wgrad_bf16_workspace_bytes(2 * experts, d.device, d.sm_count));
  }
  return bytes;
#else
  (void)experts, (void)wgrad;
  return 0;
#endif
}

// Quantized rows and their scales (per group, CUTLASS's M-major SFA).
struct QRows {
  uint8_t* q;
  float* s;
};

QRows take_rows(Carver& c, int64_t rows, int64_t cols_padded) {
  QRows r;
  r.q = static_cast<uint8_t*>(c.take(rows * cols_padded));
  r.s = static_cast<float*>(c.take(rows * (cols_padded / kFp8Block) * sizeof(float)));
  return r;
}

// A quantized weight per expert: [n_rows, k_padded] e4m3 and [n_blocks, k_blocks] scales.
struct QWeight {
  uint8_t* q;
  float* s;
  int64_t q_stride;  // per expert
  int64_t s_stride;
  int64_t n_blocks;
};

QWeight take_weight(Carver& c, int64_t experts, int64_t n_rows, int64_t k_padded) {
  QWeight w;
  w.q_stride = n_rows * k_padded;
  w.n_blocks = fp8_blocks(n_rows);
  w.s_stride = w.n_blocks * (k_padded / kFp8Block);
  w.q = static_cast<uint8_t*>(c.take(experts * w.q_stride));
  w.s = static_cast<float*>(c.take(experts * w.s_stride * sizeof(float)));
  return w;
}

// Transposed rows for the weight gradients: [cols, ld] and [ld / 128, cols] scales.
struct QTrans {
  uint8_t* q;
  float* s;
};

QTrans take_trans(Carver& c, int64_t cols, int64_t ld) {
  QTrans t;
  t.q = static_cast<uint8_t*>(c.take(cols * ld));
  t.s = static_cast<float*>(c.take((ld / kFp8Block) * cols * sizeof(float)));
  return t;
}

struct ForwardScratch {
  QRows x;       // [R, Hp]
  QWeight wgu;   // W_gate_up^T: [E, 2Fp, Hp]
  QWeight wd;    // W_down^T:    [E, Hp, Fp]
  float* gu;     // [R, 2Fp] GEMM1's f32 accumulators
  QRows h;       // [R, Fp]
  void* gemm_ws;
  size_t gemm_ws_bytes;
};

ForwardScratch carve_forward(Carver& c, const Dims& d) {
  ForwardScratch b{};
  b.x = take_rows(c, d.R, d.Hp);
  b.wgu = take_weight(c, d.E, 2 * d.Fp, d.Hp);
  b.wd = take_weight(c, d.E, d.Hp, d.Fp);
  b.gu = static_cast<float*>(c.take(d.R * 2 * d.Fp * sizeof(float)));
  b.h = take_rows(c, d.R, d.Fp);
  b.gemm_ws_bytes = gemm_workspace_bytes(d.E, false);
  b.gemm_ws = c.take(b.gemm_ws_bytes);
  return b;
}

struct BackwardScratch {
  QRows dy;        // [R, Hp]
  QWeight wd;      // W_down as stored: [E, F, Hp]
  float* dh_raw;   // [R, F]
  void* wh_rows;   // [R, F] bf16
  void* d_gate_up; // [R, 2F] bf16
  int64_t* padded_begin;  // [E + 1]
  int64_t ld;      // padded rows of the transposed operands
  QTrans xt, dgut, wht, dyt;
  QRows dgu;       // [R, 2Fp]
  QWeight wgu;     // W_gate_up as stored: [E, H, 2Fp]
  void* gemm_ws;
  size_t gemm_ws_bytes;
};

BackwardScratch carve_backward(Carver& c, const Dims& d) {
  BackwardScratch b{};
  b.dy = take_rows(c, d.R, d.Hp);
  b.wd = take_weight(c, d.E, d.F, d.Hp);
  b.dh_raw = static_cast<float*>(c.take(d.R * d.F * sizeof(float)));
  b.wh_rows = c.take(d.R * d.F * 2);
  b.d_gate_up = c.take(d.R * 2 * d.F * 2);
  b.padded_begin = static_cast<int64_t*>(c.take((d.E + 1) * sizeof(int64_t)));
  b.ld = fp8_padded_rows(d.R, d.E);
  b.xt = take_trans(c, d.H, b.ld);
  b.dgut = take_trans(c, 2 * d.F, b.ld);
  b.wht = take_trans(c, d.F, b.ld);
  b.dyt = take_trans(c, d.H, b.ld);
  b.dgu = take_rows(c, d.R, 2 * d.Fp);
  b.wgu = take_weight(c, d.E, d.H, 2 * d.Fp);
  b.gemm_ws_bytes = gemm_workspace_bytes(d.E, true);
  b.gemm_ws = c.take(b.gemm_ws_bytes);
  return b;
}

// Rows [R, halves * half] bf16 -> e4m3 [R, halves * round_up(half)], per-group scales.
std::string quantize_rows(const void* src, const Dims& d, int64_t halves, int64_t half,
                          const ExpertGroups& g, const QRows& out, cudaStream_t stream) {
  RowQuant p{};
  p.src_dtype = DType::kBF16;
  p.src = src;
  p.rows = d.R;
  p.halves = halves;
  p.half = half;
  p.num_rows = g.expert_begin + d.E;
  p.q = out.q;
  p.out_half = fp8_round_up(half);
  p.out_row_stride = halves * p.out_half;
  p.scales = out.s;
  p.scale_row_stride = p.out_row_stride / kFp8Block;
  p.group_begin = g.expert_begin;
  p.groups = d.E;
  return quantize_rows_fp8(p, stream);
}

// One [p, q] matrix (or half) of each expert's weight into `w`.
std::string quantize_weight(const void* src, int64_t experts, int64_t p, int64_t q,
                            int64_t src_expert_stride, int64_t ld, int64_t col_offset,
                            bool transposed, int64_t offset, int64_t k_padded, const QWeight& w,
                            cudaStream_t stream) {
  WeightQuant a{};
  a.src = src;
  a.experts = experts;
  a.p = p;
  a.q = q;
  a.src_expert_stride = src_expert_stride;
  a.ld = ld;
  a.col_offset = col_offset;
  a.transposed = transposed;
  a.dst = w.q;
  a.dst_expert_stride = w.q_stride;
  a.dst_ld = k_padded;
  a.offset = offset;
  a.scales = w.s;
  a.scale_expert_stride = w.s_stride;
  a.scale_n = 1;            // N-major SFB: the scale of (nb, kb) at nb + kb * n_blocks
  a.scale_k = w.n_blocks;
  return quantize_weight_fp8(a, stream);
}

std::string quantize_trans(const void* src, int64_t cols, const Dims& d, const ExpertGroups& g,
                           const BackwardScratch& b, const QTrans& out, cudaStream_t stream) {
  TransposeQuant p{};
  p.src = src;
  p.rows = d.R;
  p.cols = cols;
  p.ld = cols;
  p.experts = d.E;
  p.expert_begin = g.expert_begin;
  p.padded_begin = b.padded_begin;
  p.dst = out.q;
  p.dst_ld = b.ld;
  p.scales = out.s;
  return quantize_transposed_fp8(p, stream);
}

}  // namespace

std::string fp8_supported(const ExpertFfnShape& s, DType dtype) {
  if (dtype != DType::kBF16) {
    return std::string("recipe fp8 needs bfloat16 x and expert weights; got ") +
           dtype_name(dtype);
  }
#ifdef MOK_HAVE_SM90A
  DeviceInfo d;
  MOK_RETURN_IF_MESSAGE(current_device_info(&d));
  if (d.cc != 90) return "recipe fp8 has CUDA kernels for sm_90a (Hopper) only";
  // 16-byte rows of the bf16 and f32 results (TMA stores): H % 8, F % 4.
  if (s.hidden % 8 != 0 || s.ffn % 4 != 0 || s.hidden == 0 || s.ffn == 0) {
    return "recipe fp8 on CUDA needs hidden a multiple of 8 and ffn a multiple of 4";
  }
  // CUTLASS's block-scale layouts index a group's scales in int32: (rows or padded
  // K) x (K / 128) must fit, and R bounds every group's rows and padded K.
  const int64_t padded_rows = fp8_padded_rows(s.rows, s.experts);
  const int64_t widest_k = std::max(fp8_round_up(s.hidden), 2 * fp8_round_up(s.ffn));
  const int64_t weight = 2 * fp8_round_up(s.ffn) * fp8_round_up(s.hidden);
  const int64_t scales = padded_rows / 128 * widest_k;
  if (padded_rows > INT32_MAX || weight > INT32_MAX || scales > INT32_MAX) {
    return "recipe fp8 on CUDA: its block scales are indexed in int32, so R + 127 E rounded "
           "up to 128 (" + std::to_string(padded_rows) + "), an expert's padded 2F x H weight (" +
           std::to_string(weight) + " elements) and the rows' scales, (R + 127 E) / 128 x "
           "max(H, 2F) padded (" + std::to_string(scales) + "), must each be at most 2^31 - 1";
  }
  return {};
#else
  (void)s;
  return "recipe fp8 needs this build's sm_90a kernels";
#endif
}

size_t expert_ffn_forward_rows_fp8_bytes(const ExpertFfnShape& s) {
  Carver c(nullptr);
  carve_forward(c, Dims(s));
  return c.used();
}

std::string expert_ffn_forward_rows_fp8(const ExpertFfnShape& s, const ExpertGroups& g,
                                        const void* x_rows, const void* w_gate_up,
                                        const void* w_down, void* out_rows, void* gate_up_out,
                                        void* scratch, size_t scratch_bytes,
                                        cudaStream_t stream) {
  MOK_RETURN_IF_MESSAGE(fp8_supported(s, DType::kBF16));
  if (expert_ffn_forward_rows_fp8_bytes(s) > scratch_bytes) {
    return "expert FFN forward (fp8): scratch too small";
  }
  if (s.rows == 0 || s.experts == 0) return {};
#ifdef MOK_HAVE_SM90A
  const Dims d(s);
  Carver c(scratch);
  const ForwardScratch b = carve_forward(c, d);
  DeviceInfo dev;
  MOK_RETURN_IF_MESSAGE(current_device_info(&dev));
  const int64_t* num_rows = g.expert_begin + d.E;

  // Weights, once per call, as the forward's B operands (W^T, K-major).
  for (int half = 0; half < 2; ++half) {
    MOK_RETURN_IF_MESSAGE(quantize_weight(w_gate_up, d.E, d.H, d.F, d.H * 2 * d.F, 2 * d.F,
                                          half * d.F, true, half * d.Fp, d.Hp, b.wgu, stream));
  }
  MOK_RETURN_IF_MESSAGE(quantize_weight(w_down, d.E, d.F, d.H, d.F * d.H, d.H, 0, true, 0, d.Fp,
                                        b.wd, stream));
  // GEMM1: gu [R, 2Fp] f32 = xq @ Wgu (gate at 0, up at Fp).
  MOK_RETURN_IF_MESSAGE(quantize_rows(x_rows, d, 1, d.H, g, b.x, stream));
  const fp8_grouped::RowsOperands gemm1{d.E,  g.expert_begin, 2 * d.Fp,   d.Hp,       b.x.q,
                                        b.x.s, b.wgu.q,       b.wgu.q_stride, b.wgu.s,
                                        b.wgu.s_stride, b.gu};
  MOK_RETURN_IF_MESSAGE(fp8_grouped::rows_f32_run(gemm1, dev.device, dev.sm_count, b.gemm_ws,
                                                  b.gemm_ws_bytes, stream));
  // SwiGLU on the f32 accumulators; h quantized; the bf16 residual.
  MOK_RETURN_IF_MESSAGE(swiglu_forward_quantize_fp8(b.gu, num_rows, d.R, d.F, d.Fp, gate_up_out,
                                                    b.h.q, b.h.s, g.expert_begin, d.E, stream));
  // GEMM2: out [R, H] bf16 = hq @ Wd.
  const fp8_grouped::RowsOperands gemm2{d.E,  g.expert_begin, d.H,       d.Fp,          b.h.q,
                                        b.h.s, b.wd.q,        b.wd.q_stride, b.wd.s,
                                        b.wd.s_stride, out_rows};
  return fp8_grouped::rows_bf16_run(gemm2, dev.device, dev.sm_count, b.gemm_ws, b.gemm_ws_bytes,
                                    stream);
#else
  (void)x_rows, (void)w_gate_up, (void)w_down, (void)out_rows, (void)gate_up_out, (void)stream;
  return "recipe fp8 needs this build's sm_90a kernels";
#endif
}

size_t expert_ffn_backward_rows_fp8_bytes(const ExpertFfnShape& s) {
  Carver c(nullptr);
  carve_backward(c, Dims(s));
  return c.used();
}

std::string expert_ffn_backward_rows_fp8(const ExpertFfnShape& s, const ExpertGroups& g,
                                         const RowWeights& w, const void* x_rows,
                                         const void* dy_rows, const void* w_gate_up,
                                         const void* w_down, const void* gate_up,
                                         void* dx_rows, void* d_w_gate_up, void* d_w_down,
                                         void* scratch, size_t scratch_bytes,
                                         cudaStream_t stream) {
  MOK_RETURN_IF_MESSAGE(fp8_supported(s, DType::kBF16));
  if (expert_ffn_backward_rows_fp8_bytes(s) > scratch_bytes) {
    return "expert FFN backward (fp8): scratch too small";
  }
  if (s.experts == 0) return {};
#ifdef MOK_HAVE_SM90A
  const Dims d(s);
  Carver c(scratch);
  const BackwardScratch b = carve_backward(c, d);
  DeviceInfo dev;
  MOK_RETURN_IF_MESSAGE(current_device_info(&dev));
  const int64_t* num_rows = g.expert_begin + d.E;

  if (d.R > 0) {
    // dh_raw [R, F] f32 = dyq @ Wd^T (w_down as stored, K = H).
    MOK_RETURN_IF_MESSAGE(quantize_weight(w_down, d.E, d.F, d.H, d.F * d.H, d.H, 0, false, 0,
                                          d.Hp, b.wd, stream));
    MOK_RETURN_IF_MESSAGE(quantize_rows(dy_rows, d, 1, d.H, g, b.dy, stream));
    const fp8_grouped::RowsOperands dgrad2{d.E,   g.expert_begin, d.F,          d.Hp,
                                           b.dy.q, b.dy.s,        b.wd.q,       b.wd.q_stride,
                                           b.wd.s, b.wd.s_stride, b.dh_raw};
    MOK_RETURN_IF_MESSAGE(fp8_grouped::rows_f32_run(dgrad2, dev.device, dev.sm_count, b.gemm_ws,
                                                    b.gemm_ws_bytes, stream));
  }
  // SwiGLU backward and the combine weights' gradients, exactly as the native recipe.
  MOK_RETURN_IF_MESSAGE(swiglu_backward(DType::kBF16, w.weight_dtype, gate_up, b.dh_raw,
                                        w.weights, w.row_pair, w.pair_row, num_rows, d.R, w.pairs,
                                        d.F, b.wh_rows, b.d_gate_up, w.d_weights, stream));
  // Weight gradients: both operands transposed per expert (rows 128-aligned), one
  // launch for both problems; they read dy_rows before dgrad1 may overwrite them.
  MOK_RETURN_IF_MESSAGE(fp8_padded_begin(g.expert_begin, d.E, b.padded_begin, stream));
  if (d.R > 0) {
    MOK_RETURN_IF_MESSAGE(quantize_trans(x_rows, d.H, d, g, b, b.xt, stream));
    MOK_RETURN_IF_MESSAGE(quantize_trans(b.d_gate_up, 2 * d.F, d, g, b, b.dgut, stream));
    MOK_RETURN_IF_MESSAGE(quantize_trans(b.wh_rows, d.F, d, g, b, b.wht, stream));
    MOK_RETURN_IF_MESSAGE(quantize_trans(dy_rows, d.H, d, g, b, b.dyt, stream));
    fp8_grouped::WgradOperands wg{};
    wg.experts = d.E;
    wg.padded_begin = b.padded_begin;
    wg.ld = b.ld;
    wg.m = d.H;
    wg.n = 2 * d.F;
    wg.a = b.xt.q;
    wg.sa = b.xt.s;
    wg.b = b.dgut.q;
    wg.sb = b.dgut.s;
    wg.d = d_w_gate_up;
    wg.m2 = d.F;
    wg.n2 = d.H;
    wg.a2 = b.wht.q;
    wg.sa2 = b.wht.s;
    wg.b2 = b.dyt.q;
    wg.sb2 = b.dyt.s;
    wg.d2 = d_w_down;
    MOK_RETURN_IF_MESSAGE(fp8_grouped::wgrad_bf16_run(wg, dev.device, dev.sm_count, b.gemm_ws,
                                                      b.gemm_ws_bytes, stream));
  }
  // Experts without rows get no tiles: their gradients are zero.
  MOK_RETURN_IF_MESSAGE(zero_empty_experts(DType::kBF16, g.expert_begin, d.E, d.H * 2 * d.F,
                                           d_w_gate_up, stream));
  MOK_RETURN_IF_MESSAGE(
      zero_empty_experts(DType::kBF16, g.expert_begin, d.E, d.F * d.H, d_w_down, stream));
  if (d.R == 0) return {};
  // dx rows [R, H] bf16 = dguq (gate/up halves blocked apart) @ Wgu^T (as stored).
  for (int half = 0; half < 2; ++half) {
    MOK_RETURN_IF_MESSAGE(quantize_weight(w_gate_up, d.E, d.H, d.F, d.H * 2 * d.F, 2 * d.F,
                                          half * d.F, false, half * d.Fp, 2 * d.Fp, b.wgu,
                                          stream));
  }
  MOK_RETURN_IF_MESSAGE(quantize_rows(b.d_gate_up, d, 2, d.F, g, b.dgu, stream));
  const fp8_grouped::RowsOperands dgrad1{d.E,    g.expert_begin, d.H,           2 * d.Fp,
                                         b.dgu.q, b.dgu.s,       b.wgu.q,       b.wgu.q_stride,
                                         b.wgu.s, b.wgu.s_stride, dx_rows};
  return fp8_grouped::rows_bf16_run(dgrad1, dev.device, dev.sm_count, b.gemm_ws, b.gemm_ws_bytes,
                                    stream);
#else
  (void)w, (void)x_rows, (void)dy_rows, (void)w_gate_up, (void)w_down, (void)gate_up,
      (void)dx_rows, (void)d_w_gate_up, (void)d_w_down, (void)stream;
  return "recipe fp8 needs this build's sm_90a kernels";
#endif
}

}  // namespace mok::cuda
