// The row-wise float32 ops, each one op where the graph ran several (rowops.h has their
// arithmetic, which the fused block ops share bit for bit):
// TokenserveEpilogue  the same epilogue on a finished product z [M, N] (int8 weights' matmul).
// TokenserveNorm      LayerNorm (scale, bias) or RMSNorm (scale) over the last axis of [M, D].
//
// Two paths with the same math: AVX2+FMA (chosen at run time) and portable scalar C++ (also
// forced with isa="scalar" for tests).

#include <cstdint>
#include <string>
#include <vector>

#include "op_support.h"
#include "rowops.h"

namespace tokenserve {
namespace {

using rowops::Activation;
using rowops::FinishRow;

}  // namespace

REGISTER_OP("TokenserveEpilogue")
    .Input("z: float")         // [M, N], a matmul's output (int8 weights: TokenserveInt8Matmul)
    .Input("bias: float")      // [N] or [0]
    .Input("residual: float")  // [M, out] or [0, 0]
    .Output("y: float")        // [M, out]; out = N, or N / 2 for swiglu and geglu
    .Attr("activation: {'none', 'gelu_tanh', 'swiglu', 'geglu'} = 'none'")
    .Attr("isa: {'auto', 'scalar'} = 'auto'")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle z;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &z));
      std::string activation;
      TF_RETURN_IF_ERROR(c->GetAttr("activation", &activation));
      DimensionHandle n = c->Dim(z, 1);
      if (activation == "swiglu" || activation == "geglu") {
        TF_RETURN_IF_ERROR(c->Divide(n, 2, true, &n));
      }
      c->set_output(0, c->Matrix(c->Dim(z, 0), n));
      return absl::OkStatus();
    })
    .Doc("TokenserveDense's epilogue alone: activation(z + bias) + residual.");

REGISTER_OP("TokenserveNorm")
    .Input("x: float")      // [M, D]
    .Input("scale: float")  // [D]
    .Input("bias: float")   // [D] (layernorm) or [0] (rmsnorm)
    .Output("y: float")
    .Attr("eps: float")
    .Attr("isa: {'auto', 'scalar'} = 'auto'")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle x;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &x));
      c->set_output(0, x);
      return absl::OkStatus();
    })
    .Doc("LayerNorm (bias given) or RMSNorm (bias empty) over the last axis, float32.");

class EpilogueOp : public OpKernel {
 public:
  explicit EpilogueOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    act_ = ActivationAttr(ctx);
    avx2_ = Avx2Attr(ctx);
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& z = ctx->input(0);
    const Tensor& bias = ctx->input(1);
    const Tensor& residual = ctx->input(2);
    OP_REQUIRES(ctx, z.dims() == 2, InvalidArgument("z must be [M, N], got ",
                                                    z.shape().DebugString()));
    const int64 m = z.dim_size(0), n = z.dim_size(1);
    OP_REQUIRES(ctx, !rowops::Gated(act_) || n % 2 == 0,
                InvalidArgument(GatedName(act_), " needs an even N, got ", n));
    const int64 out = rowops::Gated(act_) ? n / 2 : n;
    OP_REQUIRES(ctx, bias.NumElements() == 0 || (bias.dims() == 1 && bias.dim_size(0) == n),
                InvalidArgument("bias must be [N] = [", n, "] or empty, got ",
                                bias.shape().DebugString()));
    OP_REQUIRES(ctx, residual.NumElements() == 0 ||
                         (residual.dims() == 2 && residual.dim_size(0) == m &&
                          residual.dim_size(1) == out),
                InvalidArgument("residual must be [M, out] = [", m, ", ", out,
                                "] or empty, got ", residual.shape().DebugString()));
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({m, out}), &y));
    const float* zp = z.flat<float>().data();
    const float* bp = Data(bias);
    const float* rp = Data(residual);
    float* yp = y->flat<float>().data();
    const bool avx2 = avx2_;
    const Activation act = act_;
    auto work = [&](int64 begin, int64 end) {
      std::vector<float> row(bp ? n : 0);
      for (int64 r = begin; r < end; ++r) {
        const float* zr = zp + r * n;
        if (bp) {
          for (int64 j = 0; j < n; ++j) row[j] = zr[j] + bp[j];
          zr = row.data();
        }
        FinishRow(avx2, out, act, zr, zr + out, rp ? rp + r * out : nullptr, yp + r * out);
      }
    };
    // ~cycles per row: an exp per value for the activations, a few ops otherwise
    const int64 cost = n * (act == Activation::kNone ? 2 : 20);
    WorkerPool(ctx)->ParallelFor(
        m, tensorflow::thread::ThreadPool::SchedulingParams::Adaptive(cost), work);
  }

 private:
  Activation act_ = Activation::kNone;
  bool avx2_ = false;
};

class NormOp : public OpKernel {
 public:
  explicit NormOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("eps", &eps_));
    avx2_ = Avx2Attr(ctx);
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& scale = ctx->input(1);
    const Tensor& bias = ctx->input(2);
    OP_REQUIRES(ctx, x.dims() == 2, InvalidArgument("x must be [M, D], got ",
                                                    x.shape().DebugString()));
    const int64 m = x.dim_size(0), d = x.dim_size(1);
    OP_REQUIRES(ctx, scale.dims() == 1 && scale.dim_size(0) == d,
                InvalidArgument("scale must be [D] = [", d, "], got ", scale.shape().DebugString()));
    const bool layernorm = bias.NumElements() > 0;  // else RMSNorm
    OP_REQUIRES(ctx, !layernorm || (bias.dims() == 1 && bias.dim_size(0) == d),
                InvalidArgument("bias must be [D] = [", d, "] or empty, got ",
                                bias.shape().DebugString()));
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &y));
    const float* xp = x.flat<float>().data();
    const float* sp = scale.flat<float>().data();
    const float* bp = layernorm ? bias.flat<float>().data() : nullptr;
    float* yp = y->flat<float>().data();
    for (int64 r = 0; r < m; ++r) {  // a few rows of ~1k values: not worth a thread handoff
      rowops::NormRow(avx2_, d, xp + r * d, sp, bp, eps_, yp + r * d);
    }
  }

 private:
  float eps_ = 1e-5f;
  bool avx2_ = false;
};

REGISTER_KERNEL_BUILDER(Name("TokenserveEpilogue").Device(DEVICE_CPU), EpilogueOp);
REGISTER_KERNEL_BUILDER(Name("TokenserveNorm").Device(DEVICE_CPU), NormOp);

}  // namespace tokenserve
