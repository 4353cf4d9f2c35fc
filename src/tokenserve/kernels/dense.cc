// TokenserveDense: one dense layer for small decode batches, in graph mode (no XLA), with
// its bias, activation and residual fused; float32 activations and arithmetic, float32 or
// bfloat16 weights (attribute T, widened as they are read: dense_args.h).
//
//   y = epilogue(x @ W + bias)            x [M, K], y [M, N] or [M, N / 2]
//   layout "kn": W is [K, N] (Keras' Dense kernel); "nk": W is [N, K] (a tied embedding used
//   as the LM head). bias: [N] or [0] (none). residual: [M, N] or [0, 0] (none), added last.
//   activation: "none"; "gelu_tanh" (GPT-2's); "swiglu": y[:, j] = silu(z[:, j]) * z[:, j + N/2]
//   or "geglu" (Gemma's): gelu_tanh(z[:, j]) * z[:, j + N/2] (gate and up fused in one kernel,
//   the output is N / 2 wide).
//
// TokenserveDenseInfo: which instruction set the float32 ops' kernels (this library: also
// row_ops.cc, finish_block.cc, split_rope.cc) take on this CPU.
//
// Why these exist: a batch-1 decode step of GPT-2-small reads 498 MB of float32 weights.
// This machine streams about 45 GB/s with two cores, so the floor is about 11 ms, and the
// matmuls alone reach it; but XLA's CPU runtime spends several more milliseconds per step
// between its small fusions (norms, bias adds, GELU), and graph-mode TF spends ~10 us per
// op. Here each dense layer is one op with its bias, activation and residual fused, and a
// norm is one op (row_ops.cc), so a transformer block is about a dozen ops.
//
// The work split between threads and the kernels: dense_compute.h. Two inner paths with the
// same math: AVX2+FMA (functions with target attributes, chosen at run time) and portable
// scalar C++ (also forced with isa="scalar" for tests).

#include <cstdint>
#include <string>

#include "cpu.h"
#include "dense_args.h"
#include "dense_compute.h"
#include "op_support.h"

namespace tokenserve {

REGISTER_OP("TokenserveDense")
    .Input("x: float")         // [M, K]
    .Input("w: T")             // [K, N] ("kn") or [N, K] ("nk"); float32 or bfloat16
    .Input("bias: float")      // [N] or [0]
    .Input("residual: float")  // [M, out] or [0, 0]
    .Output("y: float")        // [M, out]; out = N, or N / 2 for swiglu and geglu
    .Attr("layout: {'kn', 'nk'} = 'kn'")
    .Attr("T: {float, bfloat16} = DT_FLOAT")
    .Attr("activation: {'none', 'gelu_tanh', 'swiglu', 'geglu'} = 'none'")
    .Attr("isa: {'auto', 'scalar'} = 'auto'")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle x, w;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &x));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &w));
      std::string layout, activation;
      TF_RETURN_IF_ERROR(c->GetAttr("layout", &layout));
      TF_RETURN_IF_ERROR(c->GetAttr("activation", &activation));
      DimensionHandle k, n = c->Dim(w, layout == "kn" ? 1 : 0);
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(x, 1), c->Dim(w, layout == "kn" ? 0 : 1), &k));
      if (activation == "swiglu" || activation == "geglu") {
        TF_RETURN_IF_ERROR(c->Divide(n, 2, true, &n));
      }
      c->set_output(0, c->Matrix(c->Dim(x, 0), n));
      return absl::OkStatus();
    })
    .Doc("y = activation(x @ W + bias) + residual, float32, for small M.");

REGISTER_OP("TokenserveDenseInfo")
    .Output("info: string")
    .SetShapeFn(tensorflow::shape_inference::ScalarShape)
    .Doc("Which instruction set the TokenserveDense and TokenserveNorm kernels use here.");

class DenseOp : public OpKernel {
 public:
  explicit DenseOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    kn_ = StringAttr(ctx, "layout") == "kn";
    act_ = ActivationAttr(ctx);
    avx2_ = Avx2Attr(ctx);
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& w = ctx->input(1);
    const Tensor& bias = ctx->input(2);
    const Tensor& residual = ctx->input(3);
    OP_REQUIRES(ctx, x.dims() == 2 && w.dims() == 2,
                InvalidArgument("x and w must be matrices, got ", x.shape().DebugString(),
                                " and ", w.shape().DebugString()));
    DenseGeometry g;
    g.M = x.dim_size(0);
    g.K = x.dim_size(1);
    g.N = w.dim_size(kn_ ? 1 : 0);
    OP_REQUIRES(ctx, w.dim_size(kn_ ? 0 : 1) == g.K,
                InvalidArgument("x is [M, K] with K = ", g.K, " but w is ",
                                w.shape().DebugString(), kn_ ? ", expected [K, N]" : ", expected [N, K]"));
    OP_REQUIRES(ctx, !rowops::Gated(act_) || g.N % 2 == 0,
                InvalidArgument(GatedName(act_), " needs an even N, got ", g.N));
    g.out = rowops::Gated(act_) ? g.N / 2 : g.N;
    OP_REQUIRES(ctx, bias.NumElements() == 0 || (bias.dims() == 1 && bias.dim_size(0) == g.N),
                InvalidArgument("bias must be [N] = [", g.N, "] or empty, got ",
                                bias.shape().DebugString()));
    OP_REQUIRES(ctx, residual.NumElements() == 0 ||
                         (residual.dims() == 2 && residual.dim_size(0) == g.M &&
                          residual.dim_size(1) == g.out),
                InvalidArgument("residual must be [M, out] = [", g.M, ", ", g.out,
                                "] or empty, got ", residual.shape().DebugString()));
    Tensor* y_tensor = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({g.M, g.out}), &y_tensor));
    if (g.M == 0 || g.out == 0) return;
    auto* pool = WorkerPool(ctx);
    const float* b = Data(bias);
    const float* res = Data(residual);
    float* y = y_tensor->flat<float>().data();
    const float* xp = x.flat<float>().data();
    if (w.dtype() == tensorflow::DT_BFLOAT16) {
      ComputeDense<bfloat16>(g, {xp, w.flat<bfloat16>().data(), b, res, y, act_}, kn_, pool,
                             avx2_);
    } else {
      ComputeDense<float>(g, {xp, w.flat<float>().data(), b, res, y, act_}, kn_, pool, avx2_);
    }
  }

 private:
  bool kn_ = true;
  Activation act_ = Activation::kNone;
  bool avx2_ = false;
};

namespace {

const char* DenseIsa() { return cpu::HasAvx2Fma() ? "AVX2+FMA" : "scalar (no AVX2+FMA)"; }

}  // namespace

REGISTER_KERNEL_BUILDER(Name("TokenserveDense").Device(DEVICE_CPU), DenseOp);
REGISTER_KERNEL_BUILDER(Name("TokenserveDenseInfo").Device(DEVICE_CPU), IsaInfoOp<DenseIsa>);

}  // namespace tokenserve
