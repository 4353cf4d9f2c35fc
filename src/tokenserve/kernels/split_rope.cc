// TokenserveSplitRope: a fused QKV projection's output [N, (H + 2 Hkv) Dh] split into q
// [N, H, Dh], k and v [N, Hkv Dh], with rotary position embedding applied to q and k (see
// the op's Doc below), as one op.

#include <cstdint>
#include <cstring>

#include "op_support.h"

namespace tokenserve {

REGISTER_OP("TokenserveSplitRope")
    .Input("qkv: float")  // [N, (H + 2 * Hkv) * Dh]
    .Input("cos: float")  // [N, Dh], or [0]: no rotation
    .Input("sin: float")  // [N, Dh], or [0]
    .Output("q: float")   // [N, H, Dh]
    .Output("k: float")   // [N, Hkv * Dh]
    .Output("v: float")   // [N, Hkv * Dh]
    .Attr("num_heads: int >= 1")
    .Attr("num_kv_heads: int >= 1")
    .Attr("head_dim: int >= 2")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle qkv;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &qkv));
      int64_t h, hkv, dh;
      TF_RETURN_IF_ERROR(c->GetAttr("num_heads", &h));
      TF_RETURN_IF_ERROR(c->GetAttr("num_kv_heads", &hkv));
      TF_RETURN_IF_ERROR(c->GetAttr("head_dim", &dh));
      DimensionHandle n = c->Dim(qkv, 0);
      c->set_output(0, c->MakeShape({n, c->MakeDim(h), c->MakeDim(dh)}));
      c->set_output(1, c->Matrix(n, hkv * dh));
      c->set_output(2, c->Matrix(n, hkv * dh));
      return absl::OkStatus();
    })
    .Doc(R"doc(
A fused QKV projection's output split into q, k and v, with rotary position embedding
applied to q and k (rotate-half convention): x * cos + rotate_half(x) * sin per head, where
rotate_half(x) = concat(-x[Dh/2:], x[:Dh/2]); each product and the sum rounded to float32
separately, as the graph's Mul, Mul and AddV2 round them.
)doc");

// One op where the graph ran a split, a reshape and, for each of q and k, a reshape, a
// split, a negation, a concat, two products and a sum: about eighteen small ops a layer, each
// starting on caches the weight streams have just flushed (docs/performance.md). A step of a
// few tokens moves a few KB here, so one thread does it.
class SplitRopeOp : public OpKernel {
 public:
  explicit SplitRopeOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_heads", &h_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_kv_heads", &hkv_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("head_dim", &dh_));
    OP_REQUIRES(ctx, dh_ % 2 == 0, InvalidArgument("head_dim must be even, got ", dh_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& qkv = ctx->input(0);
    const Tensor& cos = ctx->input(1);
    const Tensor& sin = ctx->input(2);
    const int64 width = (h_ + 2 * hkv_) * dh_;
    OP_REQUIRES(ctx, qkv.dims() == 2 && qkv.dim_size(1) == width,
                InvalidArgument("qkv must be [N, ", width, "], got ", qkv.shape().DebugString()));
    const int64 n = qkv.dim_size(0);
    const bool rotate = cos.NumElements() > 0;
    for (const Tensor* t : {&cos, &sin}) {
      OP_REQUIRES(ctx, rotate ? (t->dims() == 2 && t->dim_size(0) == n && t->dim_size(1) == dh_)
                              : t->NumElements() == 0,
                  InvalidArgument("cos and sin must both be [N, Dh] = [", n, ", ", dh_,
                                  "] or both empty, got ", cos.shape().DebugString(), " and ",
                                  sin.shape().DebugString()));
    }
    Tensor *q = nullptr, *k = nullptr, *v = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, h_, dh_}), &q));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n, hkv_ * dh_}), &k));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({n, hkv_ * dh_}), &v));
    const float* in = qkv.flat<float>().data();
    float* outs[3] = {q->flat<float>().data(), k->flat<float>().data(),
                      v->flat<float>().data()};
    const int64 heads[3] = {h_, hkv_, hkv_};
    for (int64 i = 0; i < n; ++i) {
      const float* row = in + i * width;
      const float* c = rotate ? cos.flat<float>().data() + i * dh_ : nullptr;
      const float* s = rotate ? sin.flat<float>().data() + i * dh_ : nullptr;
      for (int part = 0; part < 3; ++part) {
        const int64 span = heads[part] * dh_;
        float* out = outs[part] + i * span;
        if (!rotate || part == 2) {
          std::memcpy(out, row, span * sizeof(float));
        } else {
          for (int64 head = 0; head < heads[part]; ++head) {
            RotateHalf(row + head * dh_, c, s, out + head * dh_);
          }
        }
        row += span;
      }
    }
  }

 private:
  // No fused multiply-add: the graph rounds both products before their sum.
  __attribute__((optimize("fp-contract=off"))) void RotateHalf(
      const float* x, const float* c, const float* s, float* out) const {
    const int64 half = dh_ / 2;
    for (int64 d = 0; d < half; ++d) {
      const float a = x[d] * c[d];
      const float b = -x[d + half] * s[d];
      out[d] = a + b;
    }
    for (int64 d = half; d < dh_; ++d) {
      const float a = x[d] * c[d];
      const float b = x[d - half] * s[d];
      out[d] = a + b;
    }
  }

  int64 h_ = 1, hkv_ = 1, dh_ = 2;
};

REGISTER_KERNEL_BUILDER(Name("TokenserveSplitRope").Device(DEVICE_CPU), SplitRopeOp);

}  // namespace tokenserve
