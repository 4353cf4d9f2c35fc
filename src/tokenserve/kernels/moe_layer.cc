// TokenserveMoeLayer: a whole mixture-of-experts MLP for one step's rows, router included:
//
//   probs = softmax(x @ router)                       [M, E], float32
//   ids, gates = top_k(probs, k), renormalised to sum to 1 when `normalize`
//   y = residual + sum_j gates[:, j] * expert_{ids[:, j]}(x)
//       (+ sigmoid(x @ shared_gate) * shared_expert(x), where shared_gate is given)
//
//   x [M, D] float32; router [D, E] and shared_gate [D, 1] or [0, 0], float32 or bfloat16
//   (attribute R); residual [M, D] or [0, 0]; up / down: the E routed experts' matrices as
//   TokenserveMoeExperts takes them, then the shared expert's where shared_gate is given
//   (N = E + 1). Outputs y [M, D] and counts [E], the rows each routed expert ran on.
//
// One op a layer where the router used to be a matmul, a softmax, a top-k and a division of
// their own. The routing follows TF's ops (tokenserve.model.moe.route): a float32 softmax
// (the row's maximum subtracted, exp, times the inverse of the sum), then the k largest
// probabilities in descending order, a tie going to the lower expert index (as
// tf.math.top_k), then each chosen one divided by their sum. The shared expert rides along
// as expert E, chosen by every row with its sigmoid gate. The experts run grouped
// (moe_grouped.h): one without rows is never read.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "dense_args.h"
#include "dense_compute.h"
#include "moe_grouped.h"
#include "op_support.h"

namespace tokenserve {

REGISTER_OP("TokenserveMoeLayer")
    .Input("x: float")            // [M, D]
    .Input("router: R")           // [D, E]
    .Input("residual: float")     // [M, D] or [0, 0]
    .Input("shared_gate: R")      // [D, 1] or [0, 0]
    .Input("up: N * T")           // N x [D, 2 F_e]
    .Input("down: N * T")         // N x [F_e, D]
    .Output("y: float")           // [M, D]
    .Output("counts: int32")      // [E] rows each routed expert ran on
    .Attr("k: int >= 1")
    .Attr("normalize: bool")
    .Attr("N: int >= 1")
    .Attr("T: {float, bfloat16} = DT_FLOAT")
    .Attr("R: {float, bfloat16} = DT_FLOAT")
    .Attr("isa: {'auto', 'scalar'} = 'auto'")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle x, router;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &x));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &router));
      c->set_output(0, x);
      c->set_output(1, c->Vector(c->Dim(router, 1)));
      return absl::OkStatus();
    })
    .Doc("A mixture-of-experts MLP with its router: softmax top-k routing (optionally "
         "renormalised), the chosen experts grouped by expert, an optional gated shared "
         "expert.");

class MoeLayerOp : public OpKernel {
 public:
  explicit MoeLayerOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    avx2_ = Avx2Attr(ctx);
    OP_REQUIRES_OK(ctx, ctx->GetAttr("k", &k_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("normalize", &normalize_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& router = ctx->input(1);
    const Tensor& residual = ctx->input(2);
    const Tensor& shared_gate = ctx->input(3);
    OpInputList up, down;
    OP_REQUIRES_OK(ctx, ctx->input_list("up", &up));
    OP_REQUIRES_OK(ctx, ctx->input_list("down", &down));
    OP_REQUIRES(ctx, x.dims() == 2, InvalidArgument("x must be [M, D], got ",
                                                    x.shape().DebugString()));
    const int64 m = x.dim_size(0), d = x.dim_size(1);
    OP_REQUIRES(ctx, router.dims() == 2 && router.dim_size(0) == d,
                InvalidArgument("router must be [", d, ", E], got ",
                                router.shape().DebugString()));
    const int64 e = router.dim_size(1);
    const bool shared = shared_gate.NumElements() > 0;
    OP_REQUIRES(ctx, !shared || IsMatrix(shared_gate, d, 1),
                InvalidArgument("shared_gate must be [", d, ", 1] or empty, got ",
                                shared_gate.shape().DebugString()));
    OP_REQUIRES(ctx, up.size() == e + shared,
                InvalidArgument("the router has ", e, " experts",
                                shared ? " and shared_gate one more" : "", " but ", up.size(),
                                " up matrices are given"));
    OP_REQUIRES(ctx, k_ <= e, InvalidArgument("k = ", k_, " exceeds the router's ", e,
                                              " experts"));
    OP_REQUIRES(ctx, residual.NumElements() == 0 || IsMatrix(residual, m, d),
                InvalidArgument("residual must be [", m, ", ", d, "] or empty, got ",
                                residual.shape().DebugString()));
    CheckExperts(ctx, up, down, d);
    if (!ctx->status().ok()) return;

    Tensor* y_tensor = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({m, d}), &y_tensor));
    Tensor* counts = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({e}), &counts));
    float* y = y_tensor->flat<float>().data();
    StartOutput(residual, m, d, y);
    if (m == 0) {
      std::fill(counts->flat<int32_t>().data(), counts->flat<int32_t>().data() + e, 0);
      return;
    }
    const float* xp = x.flat<float>().data();
    const int64 width = k_ + shared;  // pairs per row: the routed experts, then the shared one
    std::vector<int32_t> ids(m * width);
    std::vector<float> gates(m * width);
    if (router.dtype() == tensorflow::DT_BFLOAT16) {
      Route<bfloat16>(ctx, xp, m, d, e, router, shared_gate, ids.data(), gates.data());
    } else {
      Route<float>(ctx, xp, m, d, e, router, shared_gate, ids.data(), gates.data());
    }
    std::vector<int32_t> all_counts(up.size());
    RunGroupedExperts(ctx, avx2_, xp, m, d, ids.data(), gates.data(), width, up, down, y,
                      all_counts.data());
    std::copy(all_counts.begin(), all_counts.begin() + e, counts->flat<int32_t>().data());
  }

 private:
  // Each row's k experts and their gates (then expert E and its sigmoid gate, when shared):
  // ids, gates [M, k + shared].
  template <typename R>
  void Route(OpKernelContext* ctx, const float* x, int64 m, int64 d, int64 e,
             const Tensor& router, const Tensor& shared_gate, int32_t* ids, float* gates) {
    const bool shared = shared_gate.NumElements() > 0;
    const int64 width = k_ + shared;
    std::vector<float> logits(m * e), shared_logits(shared ? m : 0);
    auto* pool = WorkerPool(ctx);
    ComputeDense<R>({m, d, e, e}, {x, router.flat<R>().data(), nullptr, nullptr, logits.data(),
                                   Activation::kNone},
                    true, pool, avx2_);
    if (shared) {
      ComputeDense<R>({m, d, 1, 1}, {x, shared_gate.flat<R>().data(), nullptr, nullptr,
                                     shared_logits.data(), Activation::kNone},
                      true, pool, avx2_);
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
      for (int64 j = 0; j < k_; ++j) {  // descending; strictly greater keeps the lower index
        int64 best = -1;
        for (int64 c = 0; c < e; ++c) {
          if (!taken[c] && (best < 0 || probs[c] > probs[best])) best = c;
        }
        taken[best] = 1;
        row_ids[j] = static_cast<int32_t>(best);
        chosen += row_gates[j] = probs[best];
      }
      if (normalize_) {
        for (int64 j = 0; j < k_; ++j) row_gates[j] /= chosen;
      }
      if (shared) {
        row_ids[k_] = static_cast<int32_t>(e);
        row_gates[k_] = 1.f / (1.f + std::exp(-shared_logits[r]));
      }
    }
  }

  bool avx2_ = false;
  int64 k_ = 1;
  bool normalize_ = false;
};

REGISTER_KERNEL_BUILDER(Name("TokenserveMoeLayer").Device(DEVICE_CPU), MoeLayerOp);

}  // namespace tokenserve
