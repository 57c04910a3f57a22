#include "moe_cpu.h"

#include <cmath>
#include <cstring>
#include <exception>
#include <vector>

#include "fp8.h"
#include "gemm.h"
#include "mok/bf16.h"
#include "parallel.h"
#include "routing.h"

namespace mok::cpu {
namespace {

inline float sigmoid(float g) { return 1.0f / (1.0f + std::exp(-g)); }

// Copies `count` elements of type T into f32.
template <typename T>
void load_f32(const T* in, float* out, int64_t count) {
  for (int64_t i = 0; i < count; ++i) out[i] = to_float(in[i]);
}

// Where the rows of a grouped expert computation live. Row r (rows of expert e
// are [begin[e], begin[e+1]) in canonical order) reads x / dy at row `token(r)`
// and reads w / writes its per-pair results at `pair(r)`. Null maps are the
// identity: the rows were already gathered (the expert side of EP).
struct RowMap {
  const int64_t* pair_of_row = nullptr;  // [rows] pair index t * K + k
  int64_t top_k = 1;
  int64_t pair(int64_t r) const { return pair_of_row ? pair_of_row[r] : r; }
  int64_t token(int64_t r) const { return pair_of_row ? pair_of_row[r] / top_k : r; }
};

// Gathers rows of `src` ([*, cols] of type T) for rows [begin, begin + n) as f32.
template <typename T>
void gather_rows(const T* src, const RowMap& map, int64_t begin, int64_t n, int64_t cols,
                 float* dst) {
  for (int64_t r = 0; r < n; ++r) load_f32(src + map.token(begin + r) * cols, dst + r * cols, cols);
}

// The fp8 recipe's blocks for one problem size (docs/contract.md, "The fp8 recipe"):
// K-blocks of 128 along H, F and 2F (the gate and up halves blocked separately),
// each element its own block (for the column blocks along rows), and which block
// each column is in.
struct Fp8Layout {
  std::vector<int64_t> h, f, gu;           // blocks of 128 along H, F, 2F (halves)
  std::vector<int64_t> each_h, each_f, each_gu;  // one block per element
  std::vector<int32_t> col_h, col_f, col_gu;     // block of each column
  std::vector<int32_t> id_h, id_gu;              // identity maps
  Fp8Layout(int64_t H, int64_t F)
      : h(fp8_bounds(H, kFp8Block)), f(fp8_bounds(F, kFp8Block)),
        gu(fp8_bounds(2 * F, kFp8Block, 2)), each_h(fp8_bounds(H, 1)),
        each_f(fp8_bounds(F, 1)), each_gu(fp8_bounds(2 * F, 1)), col_h(fp8_col_blocks(h)),
        col_f(fp8_col_blocks(f)), col_gu(fp8_col_blocks(gu)), id_h(fp8_col_blocks(each_h)),
        id_gu(fp8_col_blocks(each_gu)) {}
  int64_t nh() const { return static_cast<int64_t>(h.size()) - 1; }
  int64_t nf() const { return static_cast<int64_t>(f.size()) - 1; }
  int64_t ngu() const { return static_cast<int64_t>(gu.size()) - 1; }
};

// Quantizes rows [n, cols] in row blocks along cols (`bounds`): q, s [n, nb].
inline void fp8_rows(const float* v, int64_t n, int64_t cols, const std::vector<int64_t>& bounds,
                     std::vector<float>* q, std::vector<float>* s) {
  q->resize(n * cols);
  s->resize(n * (bounds.size() - 1));
  fp8_quantize(v, n, cols, fp8_bounds(n, 1), bounds, q->data(), s->data());
}

// Quantizes an expert's rows [n, cols] in column blocks along rows (128 rows from
// its first) and transposes them for the weight-gradient GEMM's A operand:
// qt [cols, n], st [cols, nrb].
inline void fp8_cols_t(const float* v, int64_t n, int64_t cols,
                       const std::vector<int64_t>& each_col, std::vector<float>* q,
                       std::vector<float>* s, std::vector<float>* qt, std::vector<float>* st) {
  const std::vector<int64_t> rb = fp8_bounds(n, kFp8Block);
  const int64_t nrb = static_cast<int64_t>(rb.size()) - 1;
  q->resize(n * cols);
  s->resize(nrb * cols);
  fp8_quantize(v, n, cols, rb, each_col, q->data(), s->data());
  if (qt != nullptr) {
    qt->resize(n * cols);
    st->resize(nrb * cols);
    transpose_f32(q->data(), qt->data(), n, cols);
    transpose_f32(s->data(), st->data(), nrb, cols);
  }
}

// Per-expert SwiGLU FFN over grouped rows: out[pair(r)] = round_x(FFN_e(x[token(r)]))
// and, when gate_up_out is given, gate_up_out[r] = round_x(x @ Wgu_e).
// With Recipe::kFp8 the two GEMMs are the block-scaled fp8 ones and h stays f32
// (it is quantized, not rounded to x.dtype).
template <typename X>
void expert_ffn_forward(const X* x, const RowMap& map, const int64_t* expert_begin,
                        int64_t experts, int64_t H, int64_t F, const X* wgu, const X* wd, X* out,
                        X* gate_up_out, Recipe recipe) {
  struct Scratch {
    std::vector<float> w_gu, w_d, xe, gu, h, o;
    std::vector<float> wgu_q, wgu_s, wd_q, wd_s, a_q, a_s, tmp;  // fp8 only
  };
  const int workers = cpu_threads();
  std::vector<Scratch> scratch(workers);
  const bool fp8 = recipe == Recipe::kFp8;
  const Fp8Layout L = fp8 ? Fp8Layout(H, F) : Fp8Layout(0, 0);

  // Experts are independent and write disjoint rows: one work item each.
  parallel_for(experts, workers, [&](int64_t e, int worker) {
    const int64_t begin = expert_begin[e], n = expert_begin[e + 1] - begin;
    if (n == 0) return;
    Scratch& s = scratch[worker];
    s.w_gu.resize(H * 2 * F);
    s.w_d.resize(F * H);
    s.xe.resize(n * H);
    s.gu.resize(n * 2 * F);
    s.h.resize(n * F);
    s.o.resize(n * H);
    load_f32(wgu + e * H * 2 * F, s.w_gu.data(), H * 2 * F);
    load_f32(wd + e * F * H, s.w_d.data(), F * H);
    gather_rows(x, map, begin, n, H, s.xe.data());

    if (fp8) {
      s.wgu_q.resize(H * 2 * F);
      s.wgu_s.resize(L.nh() * L.ngu());
      fp8_quantize(s.w_gu.data(), H, 2 * F, L.h, L.gu, s.wgu_q.data(), s.wgu_s.data());
      s.wd_q.resize(F * H);
      s.wd_s.resize(L.nf() * L.nh());
      fp8_quantize(s.w_d.data(), F, H, L.f, L.h, s.wd_q.data(), s.wd_s.data());
      fp8_rows(s.xe.data(), n, H, L.h, &s.a_q, &s.a_s);
      fp8_gemm(s.a_q.data(), s.a_s.data(), s.wgu_q.data(), s.wgu_s.data(), L.col_gu.data(),
               L.ngu(), L.h, n, 2 * F, s.gu.data(), &s.tmp);
    } else {
      gemm_f32(s.xe.data(), s.w_gu.data(), s.gu.data(), n, 2 * F, H);
    }
    for (int64_t r = 0; r < n; ++r) {
      const float* g = s.gu.data() + r * 2 * F;
      const float* u = g + F;
      for (int64_t f = 0; f < F; ++f) {
        const float hv = g[f] * sigmoid(g[f]) * u[f];
        s.h[r * F + f] = fp8 ? hv : round_to<X>(hv);
      }
      if (gate_up_out != nullptr) {
        X* dst = gate_up_out + (begin + r) * 2 * F;
        for (int64_t j = 0; j < 2 * F; ++j) dst[j] = from_float<X>(g[j]);
      }
    }
    if (fp8) {
      fp8_rows(s.h.data(), n, F, L.f, &s.a_q, &s.a_s);
      fp8_gemm(s.a_q.data(), s.a_s.data(), s.wd_q.data(), s.wd_s.data(), L.col_h.data(), L.nh(),
               L.f, n, H, s.o.data(), &s.tmp);
    } else {
      gemm_f32(s.h.data(), s.w_d.data(), s.o.data(), n, H, F);
    }
    for (int64_t r = 0; r < n; ++r) {
      X* dst = out + map.pair(begin + r) * H;
      for (int64_t j = 0; j < H; ++j) dst[j] = from_float<X>(s.o[r * H + j]);
    }
  });
}

// Backward of expert_ffn_forward for rows combined with weight w[pair(r)]:
// dx_out[pair(r)] = round_x(dgu @ Wgu_e^T), dw_out[pair(r)] = <dy @ Wd_e^T, h>,
// d_w_gate_up / d_w_down reduced over each expert's rows in canonical order
// (zero for experts without rows). gate_up is the forward's, by row; so is x_rows
// when not null (x[token(r)] at row r), else x is gathered through `map`.
template <typename X, typename W>
void expert_ffn_backward(const X* x, const X* x_rows, const X* dy, const W* w, const RowMap& map,
                         const int64_t* expert_begin, int64_t experts, int64_t H, int64_t F,
                         const X* wgu, const X* wd, const X* gate_up, X* dx_out, W* dw_out,
                         X* dwgu, X* dwd, Recipe recipe) {
  struct Scratch {
    std::vector<float> w_gu, w_gu_t, w_d, w_d_t, xe, xe_t, dye, dh, gu, hr, hr_t, dgu, dxe,
        acc_gu, acc_d;
    std::vector<float> wq, ws, ws_t, a_q, a_s, a_qt, a_st, b_q, b_s, tmp;  // fp8 only
  };
  const int workers = cpu_threads();
  std::vector<Scratch> scratch(workers);
  const bool fp8 = recipe == Recipe::kFp8;
  const Fp8Layout L = fp8 ? Fp8Layout(H, F) : Fp8Layout(0, 0);

  parallel_for(experts, workers, [&](int64_t e, int worker) {
    const int64_t begin = expert_begin[e], n = expert_begin[e + 1] - begin;
    X* dwgu_e = dwgu + e * H * 2 * F;
    X* dwd_e = dwd + e * F * H;
    if (n == 0) {
      for (int64_t i = 0; i < H * 2 * F; ++i) dwgu_e[i] = from_float<X>(0.0f);
      for (int64_t i = 0; i < F * H; ++i) dwd_e[i] = from_float<X>(0.0f);
      return;
    }
    Scratch& s = scratch[worker];
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
    s.dxe.resize(n * H);
    load_f32(wgu + e * H * 2 * F, s.w_gu.data(), H * 2 * F);
    load_f32(wd + e * F * H, s.w_d.data(), F * H);
    transpose_f32(s.w_gu.data(), s.w_gu_t.data(), H, 2 * F);
    transpose_f32(s.w_d.data(), s.w_d_t.data(), F, H);
    if (x_rows != nullptr) {
      load_f32(x_rows + begin * H, s.xe.data(), n * H);
    } else {
      gather_rows(x, map, begin, n, H, s.xe.data());
    }
    gather_rows(dy, map, begin, n, H, s.dye.data());
    load_f32(gate_up + begin * 2 * F, s.gu.data(), n * 2 * F);

    // dh_raw = dy @ Wd^T: the gradient of h before the combine weight.
    if (fp8) {
      // Wd's 128x128 blocks (the forward's values), transposed with their scales.
      s.wq.resize(F * H);
      s.ws.resize(L.nf() * L.nh());
      s.ws_t.resize(L.nh() * L.nf());
      fp8_quantize(s.w_d.data(), F, H, L.f, L.h, s.wq.data(), s.ws.data());
      transpose_f32(s.wq.data(), s.w_d_t.data(), F, H);
      transpose_f32(s.ws.data(), s.ws_t.data(), L.nf(), L.nh());
      fp8_rows(s.dye.data(), n, H, L.h, &s.a_q, &s.a_s);
      fp8_gemm(s.a_q.data(), s.a_s.data(), s.w_d_t.data(), s.ws_t.data(), L.col_f.data(),
               L.nf(), L.h, n, F, s.dh.data(), &s.tmp);
    } else {
      gemm_f32(s.dye.data(), s.w_d_t.data(), s.dh.data(), n, F, H);
    }
    for (int64_t r = 0; r < n; ++r) {
      const int64_t p = map.pair(begin + r);
      const float wv = to_float(w[p]);
      const float* g = s.gu.data() + r * 2 * F;
      const float* u = g + F;
      const float* dhr = s.dh.data() + r * F;
      float dw = 0.0f;
      for (int64_t f = 0; f < F; ++f) {
        const float sg = sigmoid(g[f]);
        const float silu = g[f] * sg;
        const float hv = round_to<X>(silu * u[f]);
        s.hr[r * F + f] = round_to<X>(wv * hv);  // dW_down's operand: round_x(w h)
        dw += dhr[f] * hv;  // <dy, o> = <dy @ Wd^T, h>
        const float dhv = wv * dhr[f];
        s.dgu[r * 2 * F + f] = round_to<X>(dhv * u[f] * (sg * (1.0f + g[f] * (1.0f - sg))));
        s.dgu[r * 2 * F + F + f] = round_to<X>(dhv * silu);
      }
      dw_out[p] = from_float<W>(dw);
    }

    // dx rows = dgu @ Wgu^T, rounded to x.dtype like the forward's expert outputs.
    if (fp8) {
      s.wq.resize(H * 2 * F);
      s.ws.resize(L.nh() * L.ngu());
      s.ws_t.resize(L.ngu() * L.nh());
      fp8_quantize(s.w_gu.data(), H, 2 * F, L.h, L.gu, s.wq.data(), s.ws.data());
      transpose_f32(s.wq.data(), s.w_gu_t.data(), H, 2 * F);
      transpose_f32(s.ws.data(), s.ws_t.data(), L.nh(), L.ngu());
      fp8_rows(s.dgu.data(), n, 2 * F, L.gu, &s.a_q, &s.a_s);
      fp8_gemm(s.a_q.data(), s.a_s.data(), s.w_gu_t.data(), s.ws_t.data(), L.col_h.data(),
               L.nh(), L.gu, n, H, s.dxe.data(), &s.tmp);
    } else {
      gemm_f32(s.dgu.data(), s.w_gu_t.data(), s.dxe.data(), n, H, 2 * F);
    }
    for (int64_t r = 0; r < n; ++r) {
      X* dst = dx_out + map.pair(begin + r) * H;
      for (int64_t j = 0; j < H; ++j) dst[j] = from_float<X>(s.dxe[r * H + j]);
    }

    // Weight gradients reduce over the expert's rows in canonical (token, k) order.
    if (fp8) {
      // Both operands in column blocks of 128 rows from the expert's first row.
      const std::vector<int64_t> rb = fp8_bounds(n, kFp8Block);
      fp8_cols_t(s.hr.data(), n, F, L.each_f, &s.b_q, &s.b_s, &s.a_qt, &s.a_st);
      fp8_cols_t(s.dye.data(), n, H, L.each_h, &s.b_q, &s.b_s, nullptr, nullptr);
      fp8_gemm(s.a_qt.data(), s.a_st.data(), s.b_q.data(), s.b_s.data(), L.id_h.data(), H, rb,
               F, H, s.acc_d.data(), &s.tmp);
      fp8_cols_t(s.xe.data(), n, H, L.each_h, &s.b_q, &s.b_s, &s.a_qt, &s.a_st);
      fp8_cols_t(s.dgu.data(), n, 2 * F, L.each_gu, &s.b_q, &s.b_s, nullptr, nullptr);
      fp8_gemm(s.a_qt.data(), s.a_st.data(), s.b_q.data(), s.b_s.data(), L.id_gu.data(), 2 * F,
               rb, H, 2 * F, s.acc_gu.data(), &s.tmp);
    } else {
      transpose_f32(s.hr.data(), s.hr_t.data(), n, F);
      gemm_f32(s.hr_t.data(), s.dye.data(), s.acc_d.data(), F, H, n);
      transpose_f32(s.xe.data(), s.xe_t.data(), n, H);
      gemm_f32(s.xe_t.data(), s.dgu.data(), s.acc_gu.data(), H, 2 * F, n);
    }
    for (int64_t i = 0; i < H * 2 * F; ++i) dwgu_e[i] = from_float<X>(s.acc_gu[i]);
    for (int64_t i = 0; i < F * H; ++i) dwd_e[i] = from_float<X>(s.acc_d[i]);
  });
}

// out[t] = round_x(sum over kept k, ascending, of weight(t, k) * rows[t * K + k]) in f32;
// weight is 1 when `weights` is null. kept(p) says whether pair p has a row.
template <typename X, typename W, typename Kept>
void combine(const X* rows, const W* weights, Kept kept, int64_t T, int64_t K, int64_t H, X* out) {
  std::vector<float> acc(H);
  for (int64_t t = 0; t < T; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t k = 0; k < K; ++k) {
      const int64_t p = t * K + k;
      if (!kept(p)) continue;
      const X* row = rows + p * H;
      if (weights != nullptr) {
        const float wv = to_float(weights[p]);
        for (int64_t j = 0; j < H; ++j) acc[j] += wv * to_float(row[j]);
      } else {
        for (int64_t j = 0; j < H; ++j) acc[j] += to_float(row[j]);
      }
    }
    for (int64_t j = 0; j < H; ++j) out[t * H + j] = from_float<X>(acc[j]);
  }
}

template <typename X, typename W>
void forward(const MoeForwardArgs& a, X* x_rows_out) {
  const auto [T, K, E, H, F] = a.shape;
  const RoutingPlan plan = build_routing_plan(a.expert_ids, T, K, E, a.capacity);
  for (int64_t e = 0; e < E; ++e) a.tokens_per_expert[e] = plan.routed[e];
  *a.dropped = plan.dropped;
  *a.invalid = plan.invalid;

  // The x row of each kept pair by plan row, for the backward; zeros past them.
  if (x_rows_out != nullptr) {
    const X* x = static_cast<const X*>(a.x);
    for (int64_t r = 0; r < plan.num_rows; ++r) {
      std::memcpy(x_rows_out + r * H, x + (plan.row_pair[r] / K) * H, H * sizeof(X));
    }
    for (int64_t i = plan.num_rows * H; i < T * K * H; ++i) x_rows_out[i] = from_float<X>(0.0f);
  }

  // Expert outputs by pair, rounded to x.dtype; pairs without a row are unused.
  std::vector<X> o_pair(plan.num_rows > 0 ? T * K * H : 0);
  const RowMap map{plan.row_pair.data(), K};
  expert_ffn_forward<X>(static_cast<const X*>(a.x), map, plan.expert_begin.data(), E, H, F,
                        static_cast<const X*>(a.w_gate_up), static_cast<const X*>(a.w_down),
                        o_pair.data(), static_cast<X*>(a.gate_up_out), a.recipe);
  combine<X, W>(o_pair.data(), static_cast<const W*>(a.expert_weights),
                [&](int64_t p) { return plan.pair_row[p] >= 0; }, T, K, H, static_cast<X*>(a.y));
}

template <typename X, typename W>
void backward(const MoeBackwardArgs& a, const X* x_rows) {
  const auto [T, K, E, H, F] = a.shape;
  const RoutingPlan plan = build_routing_plan(a.expert_ids, T, K, E, a.capacity);
  W* dew = static_cast<W*>(a.d_expert_weights);
  for (int64_t p = 0; p < T * K; ++p) dew[p] = from_float<W>(0.0f);

  std::vector<X> dx_pair(plan.num_rows > 0 ? T * K * H : 0);
  const RowMap map{plan.row_pair.data(), K};
  expert_ffn_backward<X, W>(
      static_cast<const X*>(a.x), x_rows, static_cast<const X*>(a.dy),
      static_cast<const W*>(a.expert_weights), map, plan.expert_begin.data(), E, H, F,
      static_cast<const X*>(a.w_gate_up), static_cast<const X*>(a.w_down),
      static_cast<const X*>(a.gate_up), dx_pair.data(), dew, static_cast<X*>(a.d_w_gate_up),
      static_cast<X*>(a.d_w_down), a.recipe);
  combine<X, W>(dx_pair.data(), nullptr, [&](int64_t p) { return plan.pair_row[p] >= 0; }, T, K,
                H, static_cast<X*>(a.dx));
}

// expert_begin from group sizes; an error message if they are negative or
// exceed the rows the buffers hold.
std::string group_offsets(const int32_t* group_sizes, int64_t experts, int64_t rows,
                          std::vector<int64_t>* begin) {
  begin->assign(experts + 1, 0);
  for (int64_t e = 0; e < experts; ++e) {
    if (group_sizes[e] < 0) return "group_sizes has a negative entry";
    (*begin)[e + 1] = (*begin)[e] + group_sizes[e];
  }
  if ((*begin)[experts] > rows) {
    return "group_sizes sum to " + std::to_string((*begin)[experts]) + " rows but the row "
           "buffers hold " + std::to_string(rows);
  }
  return {};
}

// Calls fn.template operator()<X, W>() for the runtime element types, with IEEE
// subnormals on the calling thread: the work outside parallel_for (the combine)
// runs there, and XLA's CPU threads flush subnormals.
template <typename Fn>
std::string dispatch(DType x_dtype, DType weight_dtype, Fn&& fn) {
  IeeeSubnormals ieee;
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

// The recipes this file implements: kNative (the expert GEMMs in the activations'
// dtype) for f32 and bf16, kFp8 for bf16 activations and weights.
std::string check_recipe(Recipe recipe, DType x_dtype) {
  if (recipe == Recipe::kNative) return {};
  if (recipe == Recipe::kFp8) {
    if (x_dtype == DType::kBF16) return {};
    return std::string("recipe fp8 needs bfloat16 x and expert weights; got ") +
           dtype_name(x_dtype);
  }
  return std::string("recipe ") + recipe_name(recipe) + " has no CPU implementation";
}

}  // namespace

std::string moe_forward(const MoeForwardArgs& args, void* x_rows_out) {
  if (std::string err = check_recipe(args.recipe, args.x_dtype); !err.empty()) return err;
  return dispatch(args.x_dtype, args.weight_dtype, [&]<typename X, typename W>() {
    forward<X, W>(args, static_cast<X*>(x_rows_out));
  });
}

std::string moe_backward(const MoeBackwardArgs& args, const void* x_rows) {
  if (std::string err = check_recipe(args.recipe, args.x_dtype); !err.empty()) return err;
  return dispatch(args.x_dtype, args.weight_dtype, [&]<typename X, typename W>() {
    backward<X, W>(args, static_cast<const X*>(x_rows));
  });
}

std::string expert_ffn_forward(const ExpertFfnForwardArgs& a) {
  if (std::string err = check_recipe(a.recipe, a.x_dtype); !err.empty()) return err;
  std::vector<int64_t> begin;
  std::string err = group_offsets(a.group_sizes, a.experts, a.rows, &begin);
  if (!err.empty()) return err;
  // The weight type does not matter here: dispatch on (x, f32).
  return dispatch(a.x_dtype, a.x_dtype == DType::kF32 ? DType::kF32 : DType::kBF16,
                  [&]<typename X, typename W>() {
                    expert_ffn_forward<X>(static_cast<const X*>(a.x_rows), RowMap{}, begin.data(),
                                          a.experts, a.hidden, a.ffn,
                                          static_cast<const X*>(a.w_gate_up),
                                          static_cast<const X*>(a.w_down),
                                          static_cast<X*>(a.out_rows),
                                          static_cast<X*>(a.gate_up_out), a.recipe);
                  });
}

std::string expert_ffn_backward(const ExpertFfnBackwardArgs& a) {
  if (std::string err = check_recipe(a.recipe, a.x_dtype); !err.empty()) return err;
  std::vector<int64_t> begin;
  std::string err = group_offsets(a.group_sizes, a.experts, a.rows, &begin);
  if (!err.empty()) return err;
  return dispatch(a.x_dtype, a.weight_dtype, [&]<typename X, typename W>() {
    expert_ffn_backward<X, W>(
        static_cast<const X*>(a.x_rows), nullptr, static_cast<const X*>(a.dy_rows),
        static_cast<const W*>(a.w_rows), RowMap{}, begin.data(), a.experts, a.hidden, a.ffn,
        static_cast<const X*>(a.w_gate_up), static_cast<const X*>(a.w_down),
        static_cast<const X*>(a.gate_up), static_cast<X*>(a.dx_rows),
        static_cast<W*>(a.dw_rows), static_cast<X*>(a.d_w_gate_up), static_cast<X*>(a.d_w_down),
        a.recipe);
  });
}

std::string combine_rows(const CombineArgs& a) {
  return dispatch(a.x_dtype, a.weight_dtype, [&]<typename X, typename W>() {
    combine<X, W>(static_cast<const X*>(a.rows), static_cast<const W*>(a.weights),
                  [&](int64_t p) { return a.kept[p] != 0; }, a.tokens, a.top_k, a.hidden,
                  static_cast<X*>(a.out));
  });
}

}  // namespace mok::cpu
