// TokenserveMoeExperts: a mixture of experts' routed MLPs for one step's rows, given the
// router's choice: y = residual + sum_j gates[:, j] * expert_{ids[:, j]}(x), and counts [N],
// the rows each expert ran on (the step's expert load, from the grouping itself).
//
//   x [M, D] float32 rows; expert_ids [M, k] int32 and gates [M, k] float32 (the router's
//   choice, computed before the op); residual [M, D] or [0, 0]; up: N matrices [D, 2 F_e],
//   down: N matrices [F_e, D], float32 or bfloat16 (attribute T).
//
// The grouping is moe_grouped.h's; TokenserveMoeLayer (moe_layer.cc) is the same with the
// router inside. An expert no row chose is never touched (a decode step of one row with
// top-2 of 8 reads a quarter of the experts).

#include <cstdint>
#include <vector>

#include "moe_grouped.h"
#include "op_support.h"

namespace tokenserve {

REGISTER_OP("TokenserveMoeExperts")
    .Input("x: float")            // [M, D]
    .Input("expert_ids: int32")   // [M, k], each in [0, N)
    .Input("gates: float")        // [M, k]
    .Input("residual: float")     // [M, D] or [0, 0]
    .Input("up: N * T")           // N x [D, 2 F_e]
    .Input("down: N * T")         // N x [F_e, D]
    .Output("y: float")           // [M, D]
    .Output("counts: int32")      // [N] rows each expert ran on (the step's expert load)
    .Attr("N: int >= 1")
    .Attr("T: {float, bfloat16} = DT_FLOAT")
    .Attr("isa: {'auto', 'scalar'} = 'auto'")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle x;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &x));
      c->set_output(0, x);
      int n;
      TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
      c->set_output(1, c->Vector(n));
      return absl::OkStatus();
    })
    .Doc("y = residual + sum_j gates[:, j] * swiglu_mlp_{expert_ids[:, j]}(x), grouped by "
         "expert: an expert without rows is not read.");

REGISTER_OP("TokenserveMoeInfo")
    .Output("info: string")
    .SetShapeFn(tensorflow::shape_inference::ScalarShape)
    .Doc("Which instruction set the TokenserveMoeExperts kernels use here.");

class MoeExpertsOp : public OpKernel {
 public:
  explicit MoeExpertsOp(OpKernelConstruction* ctx) : OpKernel(ctx) { avx2_ = Avx2Attr(ctx); }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& ids = ctx->input(1);
    const Tensor& gates = ctx->input(2);
    const Tensor& residual = ctx->input(3);
    OpInputList up, down;
    OP_REQUIRES_OK(ctx, ctx->input_list("up", &up));
    OP_REQUIRES_OK(ctx, ctx->input_list("down", &down));
    OP_REQUIRES(ctx, x.dims() == 2, InvalidArgument("x must be [M, D], got ",
                                                    x.shape().DebugString()));
    const int64 m = x.dim_size(0), d = x.dim_size(1), n = up.size();
    OP_REQUIRES(ctx, ids.dims() == 2 && ids.dim_size(0) == m && ids.dim_size(1) > 0,
                InvalidArgument("expert_ids must be [M, k] with M = ", m, ", got ",
                                ids.shape().DebugString()));
    const int64 k = ids.dim_size(1);
    OP_REQUIRES(ctx, IsMatrix(gates, m, k),
                InvalidArgument("gates must be [", m, ", ", k, "], got ",
                                gates.shape().DebugString()));
    OP_REQUIRES(ctx, residual.NumElements() == 0 || IsMatrix(residual, m, d),
                InvalidArgument("residual must be [", m, ", ", d, "] or empty, got ",
                                residual.shape().DebugString()));
    CheckExperts(ctx, up, down, d);
    if (!ctx->status().ok()) return;
    const int32_t* id = ids.flat<int32_t>().data();
    for (int64 p = 0; p < m * k; ++p) {
      OP_REQUIRES(ctx, id[p] >= 0 && id[p] < n,
                  InvalidArgument("expert_ids[", p / k, ", ", p % k, "] = ", id[p],
                                  " is outside [0, ", n, ")"));
    }
    float* y = nullptr;
    int32_t* counts = nullptr;
    StartOutputs(ctx, residual, m, d, n, &y, &counts);
    if (!ctx->status().ok()) return;
    RunGroupedExperts(ctx, avx2_, x.flat<float>().data(), m, d, id, gates.flat<float>().data(),
                      k, up, down, y, counts);
  }

 private:
  bool avx2_ = false;
};

namespace {

const char* MoeIsa() { return cpu::HasAvx2Fma() ? "AVX2+FMA" : "scalar (no AVX2+FMA)"; }

}  // namespace

REGISTER_KERNEL_BUILDER(Name("TokenserveMoeExperts").Device(DEVICE_CPU), MoeExpertsOp);
REGISTER_KERNEL_BUILDER(Name("TokenserveMoeInfo").Device(DEVICE_CPU), IsaInfoOp<MoeIsa>);

}  // namespace tokenserve
