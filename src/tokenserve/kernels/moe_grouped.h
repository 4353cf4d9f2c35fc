// A mixture of experts' routed MLPs for one step's rows, grouped by expert: what both MoE ops
// run once the (row, expert) choices are known (moe_experts.cc takes them as inputs,
// moe_layer.cc computes them from the router).
//
//   x [M, D] float32 rows; ids [M, k] int32 and gates [M, k] float32 (pair p = row * k + j);
//   up: N matrices [D, 2 F_e] (SwiGLU's gate and up halves side by side), down: N matrices
//   [F_e, D], float32 or bfloat16 (widened as they are read); y [M, D] accumulates.
//
// The pairs are sorted by expert (a counting sort), then each expert with rows runs once: its
// rows gathered into a block, the up matrix with SwiGLU, the down matrix (ComputeDense,
// dense_compute.h, with its work split between threads), and each product row added into its
// row of y, scaled by its gate. An expert no row chose is never touched: the bytes a step
// reads are the active experts'. Within a row, experts add in ascending index order.
//
// Internal linkage, as dense_compute.h: each op file that includes this has its own copy.
#ifndef TOKENSERVE_KERNELS_MOE_GROUPED_H_
#define TOKENSERVE_KERNELS_MOE_GROUPED_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dense_args.h"
#include "dense_compute.h"
#include "op_support.h"

namespace tokenserve {
namespace {

using tensorflow::OpInputList;

// Checks up[e] is [D, 2F] and down[e] is [F, D] for every expert; sets ctx's status otherwise.
inline void CheckExperts(OpKernelContext* ctx, const OpInputList& up, const OpInputList& down,
                         int64 d) {
  for (int64 e = 0; e < up.size(); ++e) {
    OP_REQUIRES(ctx, up[e].dims() == 2 && up[e].dim_size(0) == d && up[e].dim_size(1) > 0 &&
                         up[e].dim_size(1) % 2 == 0,
                InvalidArgument("up[", e, "] must be [D, 2F] with D = ", d, ", got ",
                                up[e].shape().DebugString()));
    OP_REQUIRES(ctx, IsMatrix(down[e], up[e].dim_size(1) / 2, d),
                InvalidArgument("down[", e, "] must be [", up[e].dim_size(1) / 2, ", ", d,
                                "], got ", down[e].shape().DebugString()));
  }
}

// The M * k (row, expert) pairs sorted by expert (a counting sort, stable: within an expert
// rows ascend): expert e's pairs are pairs[start[e] .. start[e + 1]), pair p = row * k + j.
struct ExpertGroups {
  std::vector<int64> start, pairs;  // [N + 1], [M * k]
  int64 Count(int64 e) const { return start[e + 1] - start[e]; }
};

// ids [M, k] in [0, n) (callers check); counts [n]: the pairs each expert got.
inline ExpertGroups GroupByExpert(const int32_t* ids, int64 m, int64 k, int64 n,
                                  int32_t* counts) {
  ExpertGroups g;
  g.start.assign(n + 1, 0);
  for (int64 p = 0; p < m * k; ++p) ++g.start[ids[p] + 1];
  for (int64 e = 0; e < n; ++e) g.start[e + 1] += g.start[e];
  g.pairs.resize(m * k);
  std::vector<int64> next(g.start.begin(), g.start.end() - 1);
  for (int64 p = 0; p < m * k; ++p) g.pairs[next[ids[p]]++] = p;
  for (int64 e = 0; e < n; ++e) counts[e] = static_cast<int32_t>(g.Count(e));
  return g;
}

// rows [count, d] = the rows of x that `pairs` (p = row * k + j) name.
inline void GatherRows(const float* x, int64 d, const int64* pairs, int64 count, int64 k,
                       float* rows) {
  for (int64 i = 0; i < count; ++i) {
    std::memcpy(rows + i * d, x + pairs[i] / k * d, d * sizeof(float));
  }
}

// y[row of pair i] += gates[pair i] * product[i] for the `count` pairs.
inline void ScatterAdd(const float* product, int64 d, const float* gates, const int64* pairs,
                       int64 count, int64 k, float* y) {
  for (int64 i = 0; i < count; ++i) {
    const float gate = gates[pairs[i]];
    float* out = y + pairs[i] / k * d;
    const float* z = product + i * d;
    for (int64 c = 0; c < d; ++c) out[c] += gate * z[c];
  }
}

struct ExpertScratch {
  std::vector<float> rows, hidden, product;  // [count, D], [count, F], [count, D]
};

// One expert on its `count` pairs: gather their rows, up with SwiGLU, down, add each product
// row into y scaled by its gate.
template <typename W>
void RunExpert(OpKernelContext* ctx, bool avx2, const float* x, int64 d, const float* gates,
               const Tensor& up, const Tensor& down, const int64* pairs, int64 count, int64 k,
               float* y, ExpertScratch& s) {
  const int64 f2 = up.dim_size(1), f = f2 / 2;
  s.rows.resize(count * d);
  s.hidden.resize(count * f);
  s.product.resize(count * d);
  GatherRows(x, d, pairs, count, k, s.rows.data());
  auto* pool = WorkerPool(ctx);
  ComputeDense<W>({count, d, f2, f}, {s.rows.data(), up.flat<W>().data(), nullptr, nullptr,
                                      s.hidden.data(), Activation::kSwiglu},
                  true, pool, avx2);
  ComputeDense<W>({count, f, d, d}, {s.hidden.data(), down.flat<W>().data(), nullptr, nullptr,
                                     s.product.data(), Activation::kNone},
                  true, pool, avx2);
  ScatterAdd(s.product.data(), d, gates, pairs, count, k, y);
}

// y[row] += sum_j gates[row, j] * expert_{ids[row, j]}(x[row]) for the M rows, grouped by
// expert; counts [N]: the rows each expert ran on. ids must be in [0, N) (callers check).
inline void RunGroupedExperts(OpKernelContext* ctx, bool avx2, const float* x, int64 m, int64 d,
                              const int32_t* ids, const float* gates, int64 k,
                              const OpInputList& up, const OpInputList& down, float* y,
                              int32_t* counts) {
  const int64 n = up.size();
  const ExpertGroups groups = GroupByExpert(ids, m, k, n, counts);
  const std::vector<int64>& start = groups.start;
  const std::vector<int64>& pairs = groups.pairs;
  if (m == 0 || d == 0) return;
  const bool bf16 = up[0].dtype() == tensorflow::DT_BFLOAT16;
  ExpertScratch scratch;  // per call: TF may run one kernel's Compute on two threads at once
  for (int64 e = 0; e < n; ++e) {
    if (start[e + 1] == start[e]) continue;  // no rows: never read
    if (bf16) {
      RunExpert<bfloat16>(ctx, avx2, x, d, gates, up[e], down[e], pairs.data() + start[e],
                          start[e + 1] - start[e], k, y, scratch);
    } else {
      RunExpert<float>(ctx, avx2, x, d, gates, up[e], down[e], pairs.data() + start[e],
                       start[e + 1] - start[e], k, y, scratch);
    }
  }
}

// The ops' outputs, allocated: *y [m, d] (output 0), starting as the residual [m, d] or as
// zeros where it is empty, and *counts [n] (output 1). Sets ctx's status where TF could not
// allocate them.
inline void StartOutputs(OpKernelContext* ctx, const Tensor& residual, int64 m, int64 d,
                         int64 n, float** y, int32_t** counts) {
  Tensor* y_tensor = nullptr;
  OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({m, d}), &y_tensor));
  Tensor* counts_tensor = nullptr;
  OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n}), &counts_tensor));
  *y = y_tensor->flat<float>().data();
  *counts = counts_tensor->flat<int32_t>().data();
  if (residual.NumElements()) {
    std::memcpy(*y, residual.flat<float>().data(), m * d * sizeof(float));
  } else {
    std::fill(*y, *y + m * d, 0.f);
  }
}

}  // namespace
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_MOE_GROUPED_H_
