#include "moe_cpu.h"

#include <cmath>
#include <exception>
#include <vector>

#include "gemm.h"
#include "parallel.h"
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
  struct Scratch {
    std::vector<float> w_gu, w_d, xe, gu, h, o;
  };
  const int workers = cpu_threads();
  std::vector<Scratch> scratch(workers);

  // Experts are independent and write disjoint rows: one work item each.
  parallel_for(E, workers, [&](int64_t e, int worker) {
    const int64_t begin = plan.expert_begin[e], n = plan.expert_begin[e + 1] - begin;
    if (n == 0) return;
    Scratch& s = scratch[worker];
    const int64_t* rows = plan.row_pair.data() + begin;
    s.w_gu.resize(H * 2 * F);
    s.w_d.resize(F * H);
    s.xe.resize(n * H);
    s.gu.resize(n * 2 * F);
    s.h.resize(n * F);
    s.o.resize(n * H);
    load_f32(wgu + e * H * 2 * F, s.w_gu.data(), H * 2 * F);
    load_f32(wd + e * F * H, s.w_d.data(), F * H);
    gather_rows(x, rows, K, n, H, s.xe.data());

    gemm_f32(s.xe.data(), s.w_gu.data(), s.gu.data(), n, 2 * F, H);
    for (int64_t r = 0; r < n; ++r) {
      const float* g = s.gu.data() + r * 2 * F;
      const float* u = g + F;
      for (int64_t f = 0; f < F; ++f) {
        s.h[r * F + f] = round_to<X>(g[f] * sigmoid(g[f]) * u[f]);
      }
      if (gu_out != nullptr) {
        X* dst = gu_out + (begin + r) * 2 * F;
        for (int64_t j = 0; j < 2 * F; ++j) dst[j] = from_float<X>(g[j]);
      }
    }
    gemm_f32(s.h.data(), s.w_d.data(), s.o.data(), n, H, F);
    for (int64_t r = 0; r < n; ++r) {
      float* dst = o_pair.data() + rows[r] * H;
      for (int64_t j = 0; j < H; ++j) dst[j] = round_to<X>(s.o[r * H + j]);
    }
  });

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
  struct Scratch {
    std::vector<float> w_gu, w_gu_t, w_d, w_d_t, xe, xe_t, dye, dh, gu, hr, hr_t, dgu, dout, dxe,
        acc_gu, acc_d;
  };
  const int workers = cpu_threads();
  std::vector<Scratch> scratch(workers);

  parallel_for(E, workers, [&](int64_t e, int worker) {
    const int64_t begin = plan.expert_begin[e], n = plan.expert_begin[e + 1] - begin;
    X* dwgu_e = dwgu + e * H * 2 * F;
    X* dwd_e = dwd + e * F * H;
    if (n == 0) {
      for (int64_t i = 0; i < H * 2 * F; ++i) dwgu_e[i] = from_float<X>(0.0f);
      for (int64_t i = 0; i < F * H; ++i) dwd_e[i] = from_float<X>(0.0f);
      return;
    }
    Scratch& s = scratch[worker];
    const int64_t* rows = plan.row_pair.data() + begin;
    s.w_gu.resize(H * 2 * F);
    s.w_gu_t.resize(2 * F * H);
    s.w_d.resize(F * H);
    s.w_d_t.resize(H * F);
    s.acc_gu.resize(H * 2 * F);
    s.acc_d.resize(F * H);
    s.xe.resize(n * H);
    s.xe_t.resize(n * H);
    s.dye.resize(n * H);
    s.dh.resize(n * F);
    s.gu.resize(n * 2 * F);
    s.hr.resize(n * F);
    s.hr_t.resize(n * F);
    s.dgu.resize(n * 2 * F);
    s.dout.resize(n * H);
    s.dxe.resize(n * H);
    load_f32(wgu + e * H * 2 * F, s.w_gu.data(), H * 2 * F);
    load_f32(wd + e * F * H, s.w_d.data(), F * H);
    transpose_f32(s.w_gu.data(), s.w_gu_t.data(), H, 2 * F);
    transpose_f32(s.w_d.data(), s.w_d_t.data(), F, H);
    gather_rows(x, rows, K, n, H, s.xe.data());
    gather_rows(dy, rows, K, n, H, s.dye.data());
    load_f32(gu_saved + begin * 2 * F, s.gu.data(), n * 2 * F);

    // dh_raw = dy @ Wd^T: the gradient of h before the combine weight.
    gemm_f32(s.dye.data(), s.w_d_t.data(), s.dh.data(), n, F, H);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t p = rows[r];
      const float w = to_float(ew[p]);
      const float* g = s.gu.data() + r * 2 * F;
      const float* u = g + F;
      const float* dhr = s.dh.data() + r * F;
      float dw = 0.0f;
      for (int64_t f = 0; f < F; ++f) {
        const float sg = sigmoid(g[f]);
        const float silu = g[f] * sg;
        const float hv = round_to<X>(silu * u[f]);
        s.hr[r * F + f] = hv;
        dw += dhr[f] * hv;  // <dy, o> = <dy @ Wd^T, h>
        const float dhv = w * dhr[f];
        s.dgu[r * 2 * F + f] = round_to<X>(dhv * u[f] * (sg * (1.0f + g[f] * (1.0f - sg))));
        s.dgu[r * 2 * F + F + f] = round_to<X>(dhv * silu);
      }
      dew[p] = from_float<W>(dw);
      for (int64_t j = 0; j < H; ++j) s.dout[r * H + j] = round_to<X>(w * s.dye[r * H + j]);
    }

    // dx rows = dgu @ Wgu^T, rounded to x.dtype and combined per token below.
    gemm_f32(s.dgu.data(), s.w_gu_t.data(), s.dxe.data(), n, H, 2 * F);
    for (int64_t r = 0; r < n; ++r) {
      float* dst = dx_pair.data() + rows[r] * H;
      for (int64_t j = 0; j < H; ++j) dst[j] = round_to<X>(s.dxe[r * H + j]);
    }

    // Weight gradients reduce over the expert's rows in canonical (token, k) order.
    transpose_f32(s.hr.data(), s.hr_t.data(), n, F);
    gemm_f32(s.hr_t.data(), s.dout.data(), s.acc_d.data(), F, H, n);
    transpose_f32(s.xe.data(), s.xe_t.data(), n, H);
    gemm_f32(s.xe_t.data(), s.dgu.data(), s.acc_gu.data(), H, 2 * F, n);
    for (int64_t i = 0; i < H * 2 * F; ++i) dwgu_e[i] = from_float<X>(s.acc_gu[i]);
    for (int64_t i = 0; i < F * H; ++i) dwd_e[i] = from_float<X>(s.acc_d[i]);
  });

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
