#include "moe_cpu.h"

#include <cmath>
#include <exception>
#include <vector>

#include "gemm.h"
#include "mok/bf16.h"
#include "routing.h"

namespace mok::cpu {
namespace {

inline float sigmoid(float g) { return 1.0f / (1.0f + std::exp(-g)); }

// Copies rows*cols elements of type T into f32.
template <typename T>
void load_f32(const T* in, float* out, int64_t count) {
  for (int64_t i = 0; i < count; ++i) out[i] = to_float(in[i]);
}

// Gathers rows src[row_token[r]] ([*, cols] of type T) into dst[r] as f32.
template <typename T>
void gather_rows(const T* src, const int64_t* row_pair, int64_t top_k, int64_t rows,
                 int64_t cols, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    load_f32(src + (row_pair[r] / top_k) * cols, dst + r * cols, cols);
  }
}

void write_stats(const RoutingPlan& plan, int64_t experts, int32_t* tokens_per_expert,
                 int32_t* dropped, int32_t* invalid) {
  for (int64_t e = 0; e < experts; ++e) tokens_per_expert[e] = plan.routed[e];
  *dropped = plan.dropped;
  *invalid = plan.invalid;
}

template <typename X, typename W>
void forward(const MoeForwardArgs& a) {
  const auto [T, K, E, H, F] = a.shape;
  const X* x = static_cast<const X*>(a.x);
  const W* ew = static_cast<const W*>(a.expert_weights);
  const X* wgu = static_cast<const X*>(a.w_gate_up);
  const X* wd = static_cast<const X*>(a.w_down);
  X* y = static_cast<X*>(a.y);
  X* gu_out = static_cast<X*>(a.gate_up_out);

  const RoutingPlan plan = build_routing_plan(a.expert_ids, T, K, E, a.capacity);
  write_stats(plan, E, a.tokens_per_expert, a.dropped, a.invalid);

  // Expert outputs per pair, already rounded to x.dtype; dropped pairs unused.
  std::vector<float> o_pair(plan.num_rows > 0 ? T * K * H : 0);
  std::vector<float> w_gu(H * 2 * F), w_d(F * H);
  std::vector<float> xe, gu, h, o;

  for (int64_t e = 0; e < E; ++e) {
    const int64_t begin = plan.expert_begin[e], n = plan.expert_begin[e + 1] - begin;
    if (n == 0) continue;
    const int64_t* rows = plan.row_pair.data() + begin;
    xe.resize(n * H);
    gu.resize(n * 2 * F);
    h.resize(n * F);
    o.resize(n * H);
    load_f32(wgu + e * H * 2 * F, w_gu.data(), H * 2 * F);
    load_f32(wd + e * F * H, w_d.data(), F * H);
    gather_rows(x, rows, K, n, H, xe.data());

    gemm_f32(xe.data(), w_gu.data(), gu.data(), n, 2 * F, H);
    for (int64_t r = 0; r < n; ++r) {
      const float* g = gu.data() + r * 2 * F;
      const float* u = g + F;
      for (int64_t f = 0; f < F; ++f) {
        h[r * F + f] = round_to<X>(g[f] * sigmoid(g[f]) * u[f]);
      }
      if (gu_out != nullptr) {
        X* dst = gu_out + rows[r] * 2 * F;
        for (int64_t j = 0; j < 2 * F; ++j) dst[j] = from_float<X>(g[j]);
      }
    }
    gemm_f32(h.data(), w_d.data(), o.data(), n, H, F);
    for (int64_t r = 0; r < n; ++r) {
      float* dst = o_pair.data() + rows[r] * H;
      for (int64_t j = 0; j < H; ++j) dst[j] = round_to<X>(o[r * H + j]);
    }
  }

  // Ordered combine: ascending k, f32 sum, one rounding at the end.
  std::vector<float> acc(H);
  for (int64_t t = 0; t < T; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t k = 0; k < K; ++k) {
      const int64_t p = t * K + k;
      if (plan.pair_row[p] < 0) continue;
      const float w = to_float(ew[p]);
      const float* op = o_pair.data() + p * H;
      for (int64_t j = 0; j < H; ++j) acc[j] += w * op[j];
    }
    for (int64_t j = 0; j < H; ++j) y[t * H + j] = from_float<X>(acc[j]);
  }
}

template <typename X, typename W>
void backward(const MoeBackwardArgs& a) {
  const auto [T, K, E, H, F] = a.shape;
  const X* x = static_cast<const X*>(a.x);
  const W* ew = static_cast<const W*>(a.expert_weights);
  const X* wgu = static_cast<const X*>(a.w_gate_up);
  const X* wd = static_cast<const X*>(a.w_down);
  const X* gu_saved = static_cast<const X*>(a.gate_up);
  const X* dy = static_cast<const X*>(a.dy);
  X* dx = static_cast<X*>(a.dx);
  W* dew = static_cast<W*>(a.d_expert_weights);
  X* dwgu = static_cast<X*>(a.d_w_gate_up);
  X* dwd = static_cast<X*>(a.d_w_down);

  const RoutingPlan plan = build_routing_plan(a.expert_ids, T, K, E, a.capacity);

  for (int64_t p = 0; p < T * K; ++p) dew[p] = from_float<W>(0.0f);
  // dx contribution of each kept pair, rounded to x.dtype like the forward's o.
  std::vector<float> dx_pair(plan.num_rows > 0 ? T * K * H : 0);
  std::vector<float> w_gu(H * 2 * F), w_gu_t(2 * F * H), w_d(F * H), w_d_t(H * F);
  std::vector<float> xe, xe_t, dye, dh, gu, hr, hr_t, dgu, dout, dxe, acc_gu(H * 2 * F),
      acc_d(F * H);

  for (int64_t e = 0; e < E; ++e) {
    const int64_t begin = plan.expert_begin[e], n = plan.expert_begin[e + 1] - begin;
    X* dwgu_e = dwgu + e * H * 2 * F;
    X* dwd_e = dwd + e * F * H;
    if (n == 0) {
      for (int64_t i = 0; i < H * 2 * F; ++i) dwgu_e[i] = from_float<X>(0.0f);
      for (int64_t i = 0; i < F * H; ++i) dwd_e[i] = from_float<X>(0.0f);
      continue;
    }
    const int64_t* rows = plan.row_pair.data() + begin;
    xe.resize(n * H);
    xe_t.resize(n * H);
    dye.resize(n * H);
    dh.resize(n * F);
    gu.resize(n * 2 * F);
    hr.resize(n * F);
    hr_t.resize(n * F);
    dgu.resize(n * 2 * F);
    dout.resize(n * H);
    dxe.resize(n * H);
    load_f32(wgu + e * H * 2 * F, w_gu.data(), H * 2 * F);
    load_f32(wd + e * F * H, w_d.data(), F * H);
    transpose_f32(w_gu.data(), w_gu_t.data(), H, 2 * F);
    transpose_f32(w_d.data(), w_d_t.data(), F, H);
    gather_rows(x, rows, K, n, H, xe.data());
    gather_rows(dy, rows, K, n, H, dye.data());
    for (int64_t r = 0; r < n; ++r) load_f32(gu_saved + rows[r] * 2 * F, gu.data() + r * 2 * F, 2 * F);

    // dh_raw = dy @ Wd^T: the gradient of h before the combine weight.
    gemm_f32(dye.data(), w_d_t.data(), dh.data(), n, F, H);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t p = rows[r];
      const float w = to_float(ew[p]);
      const float* g = gu.data() + r * 2 * F;
      const float* u = g + F;
      float* dhr = dh.data() + r * F;
      float dw = 0.0f;
      for (int64_t f = 0; f < F; ++f) {
        const float s = sigmoid(g[f]);
        const float silu = g[f] * s;
        const float hv = round_to<X>(silu * u[f]);
        hr[r * F + f] = hv;
        dw += dhr[f] * hv;  // <dy, o> = <dy @ Wd^T, h>
        const float dhv = w * dhr[f];
        dgu[r * 2 * F + f] = round_to<X>(dhv * u[f] * (s * (1.0f + g[f] * (1.0f - s))));
        dgu[r * 2 * F + F + f] = round_to<X>(dhv * silu);
      }
      dew[p] = from_float<W>(dw);
      for (int64_t j = 0; j < H; ++j) dout[r * H + j] = round_to<X>(w * dye[r * H + j]);
    }

    // dx rows = dgu @ Wgu^T, rounded to x.dtype and combined per token below.
    gemm_f32(dgu.data(), w_gu_t.data(), dxe.data(), n, H, 2 * F);
    for (int64_t r = 0; r < n; ++r) {
      float* dst = dx_pair.data() + rows[r] * H;
      for (int64_t j = 0; j < H; ++j) dst[j] = round_to<X>(dxe[r * H + j]);
    }

    // Weight gradients reduce over the expert's rows in canonical (token, k) order.
    transpose_f32(hr.data(), hr_t.data(), n, F);
    gemm_f32(hr_t.data(), dout.data(), acc_d.data(), F, H, n);
    transpose_f32(xe.data(), xe_t.data(), n, H);
    gemm_f32(xe_t.data(), dgu.data(), acc_gu.data(), H, 2 * F, n);
    for (int64_t i = 0; i < H * 2 * F; ++i) dwgu_e[i] = from_float<X>(acc_gu[i]);
    for (int64_t i = 0; i < F * H; ++i) dwd_e[i] = from_float<X>(acc_d[i]);
  }

  std::vector<float> acc(H);
  for (int64_t t = 0; t < T; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t k = 0; k < K; ++k) {
      const int64_t p = t * K + k;
      if (plan.pair_row[p] < 0) continue;
      const float* src = dx_pair.data() + p * H;
      for (int64_t j = 0; j < H; ++j) acc[j] += src[j];
    }
    for (int64_t j = 0; j < H; ++j) dx[t * H + j] = from_float<X>(acc[j]);
  }
}

// Calls fn.template operator()<X, W>() for the runtime element types.
template <typename Fn>
std::string dispatch(DType x_dtype, DType weight_dtype, Fn&& fn) {
  try {
    if (x_dtype == DType::kF32 && weight_dtype == DType::kF32) {
      fn.template operator()<float, float>();
    } else if (x_dtype == DType::kBF16 && weight_dtype == DType::kF32) {
      fn.template operator()<bf16, float>();
    } else if (x_dtype == DType::kBF16 && weight_dtype == DType::kBF16) {
      fn.template operator()<bf16, bf16>();
    } else {
      return std::string("unsupported dtypes: x ") + dtype_name(x_dtype) +
             ", expert_weights " + dtype_name(weight_dtype);
    }
  } catch (const std::exception& err) {
    return std::string("mok_jax CPU MoE failed: ") + err.what();
  }
  return {};
}

}  // namespace

std::string moe_forward(const MoeForwardArgs& args) {
  return dispatch(args.x_dtype, args.weight_dtype,
                  [&]<typename X, typename W>() { forward<X, W>(args); });
}

std::string moe_backward(const MoeBackwardArgs& args) {
  return dispatch(args.x_dtype, args.weight_dtype,
                  [&]<typename X, typename W>() { backward<X, W>(args); });
}

}  // namespace mok::cpu
