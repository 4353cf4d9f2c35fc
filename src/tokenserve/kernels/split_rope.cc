// TokenserveSplitRope: a fused QKV projection's output [N, (H + 2 Hkv) Dh] split into q
// [N, H, Dh], k and v [N, Hkv Dh], with rotary position embedding applied to q and k (see
// the op's Doc below), as one op. Optionally each q and k head is RMS-normed first (QK-norm:
// Qwen3, Gemma 3), and RoPE may turn only a head's leading R dimensions (a partial rotary:
// Phi-3's kind).

#include <cstdint>
#include <cstring>

#include "op_support.h"

namespace tokenserve {

REGISTER_OP("TokenserveSplitRope")
    .Input("qkv: float")  // [N, (H + 2 * Hkv) * Dh]
    .Input("cos: float")  // [N, R] (R <= Dh, even: the rotated width), or [0]: no rotation
    .Input("sin: float")  // [N, R], or [0]
    .Input("q_norm: float")  // [Dh]: QK-norm's query scale, or [0]: none
    .Input("k_norm: float")  // [Dh], or [0] (given with q_norm)
    .Output("q: float")   // [N, H, Dh]
    .Output("k: float")   // [N, Hkv * Dh]
    .Output("v: float")   // [N, Hkv * Dh]
    .Attr("num_heads: int >= 1")
    .Attr("num_kv_heads: int >= 1")
    .Attr("head_dim: int >= 2")
    .Attr("eps: float = 1e-6")  // QK-norm's
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
rotate_half(x) = concat(-x[R/2:R], x[:R/2]) over the head's first R dimensions (R: cos's
width; the rest pass through); each product and the sum rounded to float32 separately, as
the graph's Mul, Mul and AddV2 round them. With q_norm and k_norm, each q and k head is
first RMS-normed (x * rsqrt(mean(x^2) + eps) * scale) as QK-norm does.
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
    OP_REQUIRES(ctx, dh_ % 2 == 0 && dh_ <= kMaxHeadDim,
                InvalidArgument("head_dim must be even and at most ", kMaxHeadDim, ", got ",
                                dh_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("eps", &eps_));
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
    const int64 r = rotate && cos.dims() == 2 ? cos.dim_size(1) : 0;
    for (const Tensor* t : {&cos, &sin}) {
      OP_REQUIRES(ctx, rotate ? (IsMatrix(*t, n, r) && r % 2 == 0 && r <= dh_)
                              : t->NumElements() == 0,
                  InvalidArgument("cos and sin must both be [N, R] with N = ", n,
                                  " and R even, at most head_dim ", dh_,
                                  ", or both empty, got ", cos.shape().DebugString(), " and ",
                                  sin.shape().DebugString()));
    }
    const Tensor& q_norm = ctx->input(3);
    const Tensor& k_norm = ctx->input(4);
    const bool qk_norm = q_norm.NumElements() > 0;
    OP_REQUIRES(ctx, qk_norm ? (IsVectorOrEmpty(q_norm, dh_) && IsVectorOrEmpty(k_norm, dh_) &&
                                k_norm.NumElements() > 0)
                             : k_norm.NumElements() == 0,
                InvalidArgument("q_norm and k_norm must both be [", dh_, "] or both empty, got ",
                                q_norm.shape().DebugString(), " and ",
                                k_norm.shape().DebugString()));
    const float* norms[2] = {Data(q_norm), Data(k_norm)};  // q's, k's (nullptr: none)
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
      const float* c = rotate ? cos.flat<float>().data() + i * r : nullptr;
      const float* s = rotate ? sin.flat<float>().data() + i * r : nullptr;
      for (int part = 0; part < 3; ++part) {
        const int64 span = heads[part] * dh_;
        float* out = outs[part] + i * span;
        if (part == 2 || (!rotate && !qk_norm)) {
          std::memcpy(out, row, span * sizeof(float));
          row += span;
          continue;
        }
        for (int64 head = 0; head < heads[part]; ++head) {
          const float* x = row + head * dh_;
          float* y = out + head * dh_;
          if (qk_norm) {  // normed into the output, then turned there (RotateHalf reads a
                          // copy of the turned dimensions: input and output may alias)
            rowops::NormRow(false, dh_, x, norms[part], nullptr, eps_, y);
            x = y;
          }
          if (rotate) {
            RotateHalf(x, r, c, s, y);
          } else if (x != y) {
            std::memcpy(y, x, dh_ * sizeof(float));
          }
        }
        row += span;
      }
    }
  }

 private:
  // The head's first r dimensions turned, the rest copied; out may be x. No fused
  // multiply-add: the graph rounds both products before their sum.
  __attribute__((optimize("fp-contract=off"))) void RotateHalf(
      const float* x, int64 r, const float* c, const float* s, float* out) const {
    float turned[kMaxHeadDim];
    std::memcpy(turned, x, r * sizeof(float));
    const int64 half = r / 2;
    for (int64 d = 0; d < half; ++d) {
      const float a = turned[d] * c[d];
      const float b = -turned[d + half] * s[d];
      out[d] = a + b;
    }
    for (int64 d = half; d < r; ++d) {
      const float a = turned[d] * c[d];
      const float b = turned[d - half] * s[d];
      out[d] = a + b;
    }
    if (out != x) std::memcpy(out + r, x + r, (dh_ - r) * sizeof(float));
  }

  static constexpr int64 kMaxHeadDim = 1024;
  int64 h_ = 1, hkv_ = 1, dh_ = 2;
  float eps_ = 1e-6f;
};

REGISTER_KERNEL_BUILDER(Name("TokenserveSplitRope").Device(DEVICE_CPU), SplitRopeOp);

}  // namespace tokenserve
