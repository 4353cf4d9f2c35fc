// The router of the mixture-of-experts layer ops (moe_layer.cc for float experts,
// moe_gguf_layer.cc for GGUF blocks), and the checks and shapes of the inputs they share:
//
//   probs = softmax(x @ router)                       [M, E], float32
//   ids, gates = top_k(probs, k), renormalised to sum to 1 when `normalize`
//   (then expert E with gate sigmoid(x @ shared_gate), where shared_gate is given)
//
//   x [M, D] float32; router [D, E] and shared_gate [D, 1] or [0, 0], float32 or bfloat16;
//   residual [M, D] or [0, 0]; ids, gates [M, k + shared].
//
// The routing follows TF's ops (tokenserve.model.moe.route): a float32 softmax (the row's
// maximum subtracted, exp, times the inverse of the sum), then the k largest probabilities in
// descending order, a tie going to the lower expert index (as tf.math.top_k), then each
// chosen one divided by their sum.
//
// Internal linkage, as dense_compute.h: each op file that includes this has its own copy.
#ifndef TOKENSERVE_KERNELS_MOE_ROUTE_H_
#define TOKENSERVE_KERNELS_MOE_ROUTE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "dense_args.h"
#include "dense_compute.h"
#include "op_support.h"

namespace tokenserve {
namespace {

// The layer ops' shape function: y like x (input 0, [M, D]), counts [E] (the router's
// columns, input 1).
inline absl::Status LayerShape(InferenceContext* c) {
  ShapeHandle x, router;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &x));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &router));
  c->set_output(0, x);
  c->set_output(1, c->Vector(c->Dim(router, 1)));
  return absl::OkStatus();
}

// Checks the layer op's x, router, shared_gate and residual, and that `num_experts_given`
// matrices (per role) are the router's E experts plus the shared one; sets ctx's status
// otherwise. *e: the router's E.
inline void CheckLayerInputs(OpKernelContext* ctx, const Tensor& x, const Tensor& router,
                             const Tensor& residual, const Tensor& shared_gate,
                             int64 num_experts_given, int64 k, int64* e) {
  OP_REQUIRES(ctx, x.dims() == 2,
              InvalidArgument("x must be [M, D], got ", x.shape().DebugString()));
  const int64 m = x.dim_size(0), d = x.dim_size(1);
  OP_REQUIRES(ctx, router.dims() == 2 && router.dim_size(0) == d,
              InvalidArgument("router must be [", d, ", E], got ", router.shape().DebugString()));
  *e = router.dim_size(1);
  const bool shared = shared_gate.NumElements() > 0;
  OP_REQUIRES(ctx, !shared || IsMatrix(shared_gate, d, 1),
              InvalidArgument("shared_gate must be [", d, ", 1] or empty, got ",
                              shared_gate.shape().DebugString()));
  OP_REQUIRES(ctx, num_experts_given == *e + shared,
              InvalidArgument("the router has ", *e, " experts",
                              shared ? " and shared_gate one more" : "", " but ",
                              num_experts_given, " up matrices are given"));
  OP_REQUIRES(ctx, k <= *e,
              InvalidArgument("k = ", k, " exceeds the router's ", *e, " experts"));
  OP_REQUIRES(ctx, residual.NumElements() == 0 || IsMatrix(residual, m, d),
              InvalidArgument("residual must be [", m, ", ", d, "] or empty, got ",
                              residual.shape().DebugString()));
}

template <typename R>
void RouteRowsAs(OpKernelContext* ctx, bool avx2, const float* x, int64 m, int64 d, int64 e,
                 int64 k, bool normalize, const Tensor& router, const Tensor& shared_gate,
                 int32_t* ids, float* gates) {
  const bool shared = shared_gate.NumElements() > 0;
  const int64 width = k + shared;
  std::vector<float> logits(m * e), shared_logits(shared ? m : 0);
  auto* pool = WorkerPool(ctx);
  ComputeDense<R>({m, d, e, e}, {x, router.flat<R>().data(), nullptr, nullptr, logits.data(),
                                 Activation::kNone},
                  true, pool, avx2);
  if (shared) {
    ComputeDense<R>({m, d, 1, 1}, {x, shared_gate.flat<R>().data(), nullptr, nullptr,
                                   shared_logits.data(), Activation::kNone},
                    true, pool, avx2);
  }
  std::vector<float> probs(e);
  std::vector<char> taken(e);
  for (int64 r = 0; r < m; ++r) {
    const float* l = logits.data() + r * e;
    float top = l[0];
    for (int64 c = 1; c < e; ++c) top = std::max(top, l[c]);
    float sum = 0.f;
    for (int64 c = 0; c < e; ++c) sum += probs[c] = std::exp(l[c] - top);
    const float inverse = 1.f / sum;
    for (int64 c = 0; c < e; ++c) probs[c] *= inverse;
    std::fill(taken.begin(), taken.end(), 0);
    int32_t* row_ids = ids + r * width;
    float* row_gates = gates + r * width;
    float chosen = 0.f;
    for (int64 j = 0; j < k; ++j) {  // descending; strictly greater keeps the lower index
      int64 best = -1;
      for (int64 c = 0; c < e; ++c) {
        if (!taken[c] && (best < 0 || probs[c] > probs[best])) best = c;
      }
      taken[best] = 1;
      row_ids[j] = static_cast<int32_t>(best);
      chosen += row_gates[j] = probs[best];
    }
    if (normalize) {
      for (int64 j = 0; j < k; ++j) row_gates[j] /= chosen;
    }
    if (shared) {
      row_ids[k] = static_cast<int32_t>(e);
      row_gates[k] = 1.f / (1.f + std::exp(-shared_logits[r]));
    }
  }
}

// Each row's k experts and their gates (then expert E and its sigmoid gate, when shared):
// ids, gates [M, k + shared], for a float32 or bfloat16 router.
inline void RouteRows(OpKernelContext* ctx, bool avx2, const float* x, int64 m, int64 d,
                      int64 e, int64 k, bool normalize, const Tensor& router,
                      const Tensor& shared_gate, int32_t* ids, float* gates) {
  if (router.dtype() == tensorflow::DT_BFLOAT16) {
    RouteRowsAs<bfloat16>(ctx, avx2, x, m, d, e, k, normalize, router, shared_gate, ids, gates);
  } else {
    RouteRowsAs<float>(ctx, avx2, x, m, d, e, k, normalize, router, shared_gate, ids, gates);
  }
}

}  // namespace
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_MOE_ROUTE_H_
