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
// their own; the router and its checks are moe_route.h's (shared with the GGUF blocks' op,
// moe_gguf_layer.cc). The shared expert rides along as expert E, chosen by every row with its
// sigmoid gate. The experts run grouped (moe_grouped.h): one without rows is never read.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "moe_grouped.h"
#include "moe_route.h"
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
    .SetShapeFn(LayerShape)
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
    int64 e = 0;
    CheckLayerInputs(ctx, x, router, residual, shared_gate, up.size(), k_, &e);
    if (!ctx->status().ok()) return;
    const int64 m = x.dim_size(0), d = x.dim_size(1);
    const bool shared = shared_gate.NumElements() > 0;
    CheckExperts(ctx, up, down, d);
    if (!ctx->status().ok()) return;

    float* y = nullptr;
    int32_t* counts = nullptr;
    StartOutputs(ctx, residual, m, d, e, &y, &counts);
    if (!ctx->status().ok()) return;
    if (m == 0) {
      std::fill(counts, counts + e, 0);
      return;
    }
    const float* xp = x.flat<float>().data();
    const int64 width = k_ + shared;  // pairs per row: the routed experts, then the shared one
    std::vector<int32_t> ids(m * width);
    std::vector<float> gates(m * width);
    RouteRows(ctx, avx2_, xp, m, d, e, k_, normalize_, router, shared_gate, ids.data(),
              gates.data());
    std::vector<int32_t> all_counts(up.size());
    RunGroupedExperts(ctx, avx2_, xp, m, d, ids.data(), gates.data(), width, up, down, y,
                      all_counts.data());
    std::copy(all_counts.begin(), all_counts.begin() + e, counts);
  }

 private:
  bool avx2_ = false;
  int64 k_ = 1;
  bool normalize_ = false;
};

REGISTER_KERNEL_BUILDER(Name("TokenserveMoeLayer").Device(DEVICE_CPU), MoeLayerOp);

}  // namespace tokenserve
