// TokenserveFinishBlock: a transformer block's second half (output projection, residual,
// MLP norm, MLP up and activation, MLP down, residual) in one op, optionally with the next
// block's norm and QKV projection: TokenserveDense's and TokenserveNorm's code
// (dense_compute.h, rowops.h; the checks and calls in finish_block.h, which the LoRA op
// shares), called in turn, so the matrices stream back to back.
//
// Float32 arithmetic on float32 or bfloat16 matrices (attribute T, the four alike). With
// post-norm scales (Gemma 2 and 3) each branch's output is RMS-normed before its residual add.

#include <cstdint>
#include <string>
#include <vector>

#include "finish_block.h"
#include "op_support.h"

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
    .SetShapeFn(FinishBlockShape<12, 1>)  // Nq: next_w's (input 12) columns
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
    BlockDims dims;
    if (!CheckFinishBlockInputs(ctx, act_, &dims)) return;
    const Tensor& post_attn = ctx->input(14);
    const Tensor& post_mlp = ctx->input(15);
    OP_REQUIRES(ctx, IsVectorOrEmpty(post_attn, dims.d) && IsVectorOrEmpty(post_mlp, dims.d) &&
                         (post_attn.NumElements() == 0) == (post_mlp.NumElements() == 0),
                InvalidArgument("post_attn_scale and post_mlp_scale must both be [", dims.d,
                                "] or both empty, got ", post_attn.shape().DebugString(),
                                " and ", post_mlp.shape().DebugString()));
    dims.post_attn = Data(post_attn);  // nullptr: no post-norms
    dims.post_mlp = Data(post_mlp);
    Tensor* y_tensor = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({dims.m, dims.d}), &y_tensor));
    Tensor* next_tensor = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({dims.m, dims.nq}), &next_tensor));
    if (dims.m == 0 || dims.d == 0) return;
    float* y = y_tensor->flat<float>().data();
    float* next = next_tensor->flat<float>().data();
    if (ctx->input(2).dtype() == tensorflow::DT_BFLOAT16) {
      RunFinishBlock<bfloat16>(ctx, dims, act_, eps_, avx2_, y, next, NoDelta{});
    } else {
      RunFinishBlock<float>(ctx, dims, act_, eps_, avx2_, y, next, NoDelta{});
    }
  }

 private:
  Activation act_ = Activation::kGeluTanh;
  float eps_ = 1e-5f;
  bool avx2_ = false;
};

REGISTER_KERNEL_BUILDER(Name("TokenserveFinishBlock").Device(DEVICE_CPU), FinishBlockOp);

}  // namespace tokenserve
