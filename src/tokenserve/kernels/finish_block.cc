// TokenserveFinishBlock: a transformer block's second half (output projection, residual,
// MLP norm, MLP up and activation, MLP down, residual) in one op, optionally with the next
// block's norm and QKV projection: TokenserveDense's and TokenserveNorm's code
// (dense_compute.h, rowops.h), called in turn, so the matrices stream back to back.
//
// Float32 arithmetic on float32 or bfloat16 matrices (attribute T, the four alike). With
// post-norm scales (Gemma 2 and 3) each branch's output is RMS-normed before its residual add.

#include <cstdint>
#include <string>
#include <vector>

#include "dense_args.h"
#include "dense_compute.h"
#include "op_support.h"
#include "rowops.h"

namespace tokenserve {

REGISTER_OP("TokenserveFinishBlock")
    .Input("attn: float")        // [M, Da] attention output
    .Input("x: float")           // [M, D] the residual stream
    .Input("out_w: T")           // [Da, D]
    .Input("out_bias: float")    // [D] or [0]
    .Input("norm_scale: float")  // [D]
    .Input("norm_bias: float")   // [D] (LayerNorm) or [0] (RMSNorm)
    .Input("up_w: T")            // [D, F]
    .Input("up_bias: float")     // [F] or [0]
    .Input("down_w: T")          // [F, D] (F / 2 rows for swiglu, geglu)
    .Input("down_bias: float")   // [D] or [0]
    // the next block's first half, optional (all empty: none): its norm and QKV projection
    .Input("next_norm_scale: float")  // [D] or [0]
    .Input("next_norm_bias: float")   // [D] (LayerNorm), or [0] (RMSNorm, or no next)
    .Input("next_w: T")               // [D, Nq] or [0, 0]
    .Input("next_bias: float")        // [Nq] or [0]
    // post-norms, optional (both empty: none): RMSNorm scales of the attention and MLP
    // branches' outputs, applied before each residual add
    .Input("post_attn_scale: float")  // [D] or [0]
    .Input("post_mlp_scale: float")   // [D] or [0]
    .Output("y: float")          // [M, D]
    .Output("next: float")       // [M, Nq], or [M, 0] without a next block
    .Attr("activation: {'gelu_tanh', 'swiglu', 'geglu'} = 'gelu_tanh'")
    .Attr("T: {float, bfloat16} = DT_FLOAT")  // the four matrices' dtype
    .Attr("eps: float = 1e-5")
    .Attr("isa: {'auto', 'scalar'} = 'auto'")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle x, next_w;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &x));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(12), 2, &next_w));
      c->set_output(0, x);
      c->set_output(1, c->Matrix(c->Dim(x, 0), c->Dim(next_w, 1)));
      return absl::OkStatus();
    })
    .Doc("x1 = attn @ out_w + out_bias + x; "
         "y = act(norm(x1) @ up_w + up_bias) @ down_w + down_bias + x1; "
         "next = next_norm(y) @ next_w + next_bias. Float32, small M. With post-norm "
         "scales: x1 = x + rms(attn @ out_w + out_bias) * post_attn_scale, and likewise "
         "y = x1 + rms(...) * post_mlp_scale.");

// A transformer block's second half (output projection and residual, MLP norm, MLP up and
// activation, MLP down and residual) as one op: the same ComputeDense and NormRow calls as
// three TokenserveDense ops and a TokenserveNorm, so the three matrices stream back to back
// instead of with the executor's gaps between them (docs/performance.md, "Between the ops"),
// and a layer runs three fewer ops. With next_w given, the next block's norm and QKV
// projection follow in the same op (next = next_norm(y) @ next_w + next_bias): four
// matrices back to back, two ops fewer. int8_finish_block.cc has the int8 weights' twin.
class FinishBlockOp : public OpKernel {
 public:
  explicit FinishBlockOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    act_ = ActivationAttr(ctx);  // gelu_tanh, swiglu or geglu (the attribute allows no other)
    OP_REQUIRES_OK(ctx, ctx->GetAttr("eps", &eps_));
    avx2_ = Avx2Attr(ctx);
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& attn = ctx->input(0);
    const Tensor& x = ctx->input(1);
    const Tensor& out_w = ctx->input(2);
    const Tensor& norm_scale = ctx->input(4);
    const Tensor& up_w = ctx->input(6);
    const Tensor& down_w = ctx->input(8);
    OP_REQUIRES(ctx, attn.dims() == 2 && x.dims() == 2 && attn.dim_size(0) == x.dim_size(0),
                InvalidArgument("attn and x must be [M, Da] and [M, D], got ",
                                attn.shape().DebugString(), " and ", x.shape().DebugString()));
    const int64 m = x.dim_size(0), d = x.dim_size(1), da = attn.dim_size(1);
    OP_REQUIRES(ctx, IsMatrix(out_w, da, d),
                InvalidArgument("out_w must be [Da, D] = [", da, ", ", d, "], got ",
                                out_w.shape().DebugString()));
    OP_REQUIRES(ctx, norm_scale.dims() == 1 && norm_scale.dim_size(0) == d,
                InvalidArgument("norm_scale must be [", d, "], got ",
                                norm_scale.shape().DebugString()));
    OP_REQUIRES(ctx, up_w.dims() == 2 && up_w.dim_size(0) == d && up_w.dim_size(1) > 0,
                InvalidArgument("up_w must be [D, F] with D = ", d, ", got ",
                                up_w.shape().DebugString()));
    const int64 f = up_w.dim_size(1);
    const bool gated = rowops::Gated(act_);
    OP_REQUIRES(ctx, !gated || f % 2 == 0,
                InvalidArgument(GatedName(act_), " needs an even up width, got ", f));
    const int64 inner = gated ? f / 2 : f;
    OP_REQUIRES(ctx, IsMatrix(down_w, inner, d),
                InvalidArgument("down_w must be [", inner, ", ", d, "], got ",
                                down_w.shape().DebugString()));
    const int64 widths[] = {d, d, f, d};  // out_bias, norm_bias, up_bias, down_bias
    const char* names[] = {"out_bias", "norm_bias", "up_bias", "down_bias"};
    for (int i = 0; i < 4; ++i) {
      const Tensor& t = ctx->input(3 + 2 * i);
      OP_REQUIRES(ctx, IsVectorOrEmpty(t, widths[i]),
                  InvalidArgument(names[i], " must be [", widths[i], "] or empty, got ",
                                  t.shape().DebugString()));
    }
    // the next block's norm and QKV: all given, or all empty
    const Tensor& next_norm_scale = ctx->input(10);
    const Tensor& next_norm_bias = ctx->input(11);
    const Tensor& next_w = ctx->input(12);
    const Tensor& next_bias = ctx->input(13);
    const bool has_next = next_w.NumElements() > 0;
    const int64 nq = has_next ? next_w.dim_size(1) : 0;
    if (has_next) {
      OP_REQUIRES(ctx, next_w.dims() == 2 && next_w.dim_size(0) == d,
                  InvalidArgument("next_w must be [D, Nq] with D = ", d, ", got ",
                                  next_w.shape().DebugString()));
    }
    if (!CheckNextNorm(ctx, has_next, "next_w", d, next_norm_scale, next_norm_bias, next_bias)) {
      return;
    }
    OP_REQUIRES(ctx, IsVectorOrEmpty(next_bias, nq),
                InvalidArgument("next_bias must be [", nq, "] or empty, got ",
                                next_bias.shape().DebugString()));
    const Tensor& post_attn = ctx->input(14);
    const Tensor& post_mlp = ctx->input(15);
    OP_REQUIRES(ctx, IsVectorOrEmpty(post_attn, d) && IsVectorOrEmpty(post_mlp, d) &&
                         (post_attn.NumElements() == 0) == (post_mlp.NumElements() == 0),
                InvalidArgument("post_attn_scale and post_mlp_scale must both be [", d,
                                "] or both empty, got ", post_attn.shape().DebugString(),
                                " and ", post_mlp.shape().DebugString()));
    Tensor* y_tensor = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({m, d}), &y_tensor));
    Tensor* next_tensor = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({m, nq}), &next_tensor));
    if (m == 0 || d == 0) return;

    if (out_w.dtype() == tensorflow::DT_BFLOAT16) {
      Run<bfloat16>(ctx, m, d, da, f, inner, nq, has_next, y_tensor, next_tensor);
    } else {
      Run<float>(ctx, m, d, da, f, inner, nq, has_next, y_tensor, next_tensor);
    }
  }

  // The op's arithmetic, once the shapes are checked: W is the matrices' storage type.
  template <typename W>
  void Run(OpKernelContext* ctx, int64 m, int64 d, int64 da, int64 f, int64 inner, int64 nq,
           bool has_next, Tensor* y_tensor, Tensor* next_tensor) {
    auto* pool = WorkerPool(ctx);
    auto in = [ctx](int i) { return ctx->input(i).flat<float>().data(); };
    auto weights = [ctx](int i) { return ctx->input(i).flat<W>().data(); };
    const float* post_attn = Data(ctx->input(14));  // nullptr: no post-norms
    const float* post_mlp = Data(ctx->input(15));
    std::vector<float> x1(m * d), h(m * d), u(m * inner);
    // x1 = attn @ out_w + out_bias + x (post-norm: x + rms(attn @ out_w + out_bias))
    ComputeDense<W>({m, da, d, d}, {in(0), weights(2), Data(ctx->input(3)),
                                    post_attn ? nullptr : in(1), x1.data(), Activation::kNone},
                    true, pool, avx2_);
    if (post_attn) NormAddRows(m, d, post_attn, in(1), x1.data());
    // h = norm(x1)
    for (int64 r = 0; r < m; ++r) {
      rowops::NormRow(avx2_, d, x1.data() + r * d, in(4), Data(ctx->input(5)), eps_,
                      h.data() + r * d);
    }
    // u = act(h @ up_w + up_bias)
    ComputeDense<W>({m, d, f, inner}, {h.data(), weights(6), Data(ctx->input(7)),
                                       nullptr, u.data(), act_},
                    true, pool, avx2_);
    // y = u @ down_w + down_bias + x1 (post-norm: x1 + rms(u @ down_w + down_bias))
    float* y = y_tensor->flat<float>().data();
    ComputeDense<W>({m, inner, d, d}, {u.data(), weights(8), Data(ctx->input(9)),
                                       post_mlp ? nullptr : x1.data(), y, Activation::kNone},
                    true, pool, avx2_);
    if (post_mlp) NormAddRows(m, d, post_mlp, x1.data(), y);
    if (!has_next) return;
    // next = next_norm(y) @ next_w + next_bias (the norm's rows reuse h)
    for (int64 r = 0; r < m; ++r) {
      rowops::NormRow(avx2_, d, y + r * d, in(10), Data(ctx->input(11)), eps_, h.data() + r * d);
    }
    ComputeDense<W>({m, d, nq, nq}, {h.data(), weights(12), Data(ctx->input(13)),
                                     nullptr, next_tensor->flat<float>().data(),
                                     Activation::kNone},
                    true, pool, avx2_);
  }

 private:
  // z [m, d] <- residual + RMSNorm(z) * scale, row by row (the graph's x + norm(h): the norm
  // rounded to float32 before the add). NormRow may write over its input.
  void NormAddRows(int64 m, int64 d, const float* scale, const float* residual,
                   float* z) const {
    for (int64 r = 0; r < m; ++r) {
      float* row = z + r * d;
      rowops::NormRow(avx2_, d, row, scale, nullptr, eps_, row);
      const float* res = residual + r * d;
      for (int64 j = 0; j < d; ++j) row[j] += res[j];
    }
  }

  Activation act_ = Activation::kGeluTanh;
  float eps_ = 1e-5f;
  bool avx2_ = false;
};

REGISTER_KERNEL_BUILDER(Name("TokenserveFinishBlock").Device(DEVICE_CPU), FinishBlockOp);

}  // namespace tokenserve
