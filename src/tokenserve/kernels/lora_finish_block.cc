// TokenserveLoraFinishBlock: TokenserveFinishBlock (finish_block.cc) with each row's LoRA
// delta on its four projections (output, MLP up, MLP down, the next block's QKV), so a step
// with adapter rows keeps the base step's one op per layer.
//
// Each projection's delta is the batched low-rank product the engine's step takes
// (engine/step/lora.py): for the K adapters of the step side by side,
//
//     delta = ((in @ A) * mask) @ B      A [in, K*R], B [K*R, out], mask [M, K*R]
//
// where mask's row is 1 on the R columns of that row's adapter (one_hot [M, K], each entry
// repeated R times: R = A's width / K, per projection), and in is the projection's own input
// (attn, the MLP norm's rows, the activation's rows, the next norm's rows), all of which
// this op holds. The delta is added before the bias's epilogue and the activation: up's
// product is finished (bias, delta) and only then activated.
//
// Float32 arithmetic; the block's matrices float32 or bfloat16 (attribute T), the factors
// float32.

#include <cstdint>
#include <string>
#include <vector>

#include "dense_args.h"
#include "dense_compute.h"
#include "op_support.h"
#include "rowops.h"

namespace tokenserve {

REGISTER_OP("TokenserveLoraFinishBlock")
    .Input("attn: float")             // [M, Da]
    .Input("x: float")                // [M, D]
    .Input("out_w: T")                // [Da, D]
    .Input("out_bias: float")         // [D] or [0]
    .Input("norm_scale: float")       // [D]
    .Input("norm_bias: float")        // [D] or [0]
    .Input("up_w: T")                 // [D, F]
    .Input("up_bias: float")          // [F] or [0]
    .Input("down_w: T")               // [F, D] (F / 2 rows for swiglu)
    .Input("down_bias: float")        // [D] or [0]
    .Input("next_norm_scale: float")  // [D] or [0]
    .Input("next_norm_bias: float")   // [D] or [0]
    .Input("next_w: T")               // [D, Nq] or [0, 0]
    .Input("next_bias: float")        // [Nq] or [0]
    .Input("one_hot: float")          // [M, K] each row's adapter among the K (zeros: none)
    .Input("out_a: float")            // [Da, K*Ro]
    .Input("out_b: float")            // [K*Ro, D]
    .Input("up_a: float")             // [D, K*Ru]
    .Input("up_b: float")             // [K*Ru, F]
    .Input("down_a: float")           // [F or F / 2, K*Rd]
    .Input("down_b: float")           // [K*Rd, D]
    .Input("next_a: float")           // [D, K*Rq] or [0, 0]
    .Input("next_b: float")           // [K*Rq, Nq] or [0, 0]
    .Output("y: float")               // [M, D]
    .Output("next: float")            // [M, Nq], or [M, 0] without a next block
    .Attr("activation: {'gelu_tanh', 'swiglu'} = 'gelu_tanh'")
    .Attr("T: {float, bfloat16} = DT_FLOAT")
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
    .Doc("TokenserveFinishBlock with per-row LoRA deltas ((in @ A) * mask) @ B on out, up, "
         "down and next.");

class LoraFinishBlockOp : public OpKernel {
 public:
  explicit LoraFinishBlockOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    act_ = ActivationAttr(ctx);
    OP_REQUIRES_OK(ctx, ctx->GetAttr("eps", &eps_));
    avx2_ = Avx2Attr(ctx);
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& attn = ctx->input(0);
    const Tensor& x = ctx->input(1);
    const Tensor& up_w = ctx->input(6);
    const Tensor& next_w = ctx->input(12);
    const Tensor& one_hot = ctx->input(14);
    OP_REQUIRES(ctx, attn.dims() == 2 && x.dims() == 2 && attn.dim_size(0) == x.dim_size(0),
                InvalidArgument("attn and x must be [M, Da] and [M, D]"));
    const int64 m = x.dim_size(0), d = x.dim_size(1), da = attn.dim_size(1);
    OP_REQUIRES(ctx, up_w.dims() == 2 && up_w.dim_size(0) == d && up_w.dim_size(1) > 0,
                InvalidArgument("up_w must be [D, F] with D = ", d));
    const int64 f = up_w.dim_size(1);
    const bool swiglu = act_ == Activation::kSwiglu;
    OP_REQUIRES(ctx, !swiglu || f % 2 == 0, InvalidArgument("swiglu needs an even up width"));
    const int64 inner = swiglu ? f / 2 : f;
    const bool has_next = next_w.NumElements() > 0;
    const int64 nq = has_next ? next_w.dim_size(1) : 0;
    OP_REQUIRES(ctx, one_hot.dims() == 2 && one_hot.dim_size(0) == m && one_hot.dim_size(1) > 0,
                InvalidArgument("one_hot must be [M, K] with M = ", m, ", got ",
                                one_hot.shape().DebugString()));
    const int64 k = one_hot.dim_size(1);
    // the matrices (shape-checked as finish_block.cc checks them) and each factor pair
    const int64 mats[][3] = {{2, da, d}, {6, d, f}, {8, inner, d}, {12, d, nq}};
    for (int i = 0; i < 4; ++i) {
      const int64* mat = mats[i];
      if (mat[0] == 12 && !has_next) continue;
      OP_REQUIRES(ctx, IsMatrix(ctx->input(mat[0]), mat[1], mat[2]),
                  InvalidArgument("input ", mat[0], " must be [", mat[1], ", ", mat[2], "]"));
      const Tensor& a = ctx->input(15 + 2 * i);
      const Tensor& b = ctx->input(16 + 2 * i);
      OP_REQUIRES(ctx, a.dims() == 2 && a.dim_size(0) == mat[1] && a.dim_size(1) % k == 0 &&
                           IsMatrix(b, a.dim_size(1), mat[2]),
                  InvalidArgument("LoRA factors of input ", mat[0], " must be [", mat[1],
                                  ", K*R] and [K*R, ", mat[2], "] with K = ", k, ", got ",
                                  a.shape().DebugString(), " and ", b.shape().DebugString()));
    }
    const int64 widths[] = {d, d, f, d};
    for (int i = 0; i < 4; ++i) {
      OP_REQUIRES(ctx, IsVectorOrEmpty(ctx->input(3 + 2 * i), widths[i]),
                  InvalidArgument("a bias or norm bias has the wrong width"));
    }
    OP_REQUIRES(ctx, ctx->input(4).dims() == 1 && ctx->input(4).dim_size(0) == d,
                InvalidArgument("norm_scale must be [", d, "]"));
    if (!CheckNextNorm(ctx, has_next, "next_w", d, ctx->input(10), ctx->input(11),
                       ctx->input(13))) {
      return;
    }
    OP_REQUIRES(ctx, IsVectorOrEmpty(ctx->input(13), nq),
                InvalidArgument("next_bias must be [", nq, "] or empty"));
    Tensor* y_tensor = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({m, d}), &y_tensor));
    Tensor* next_tensor = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({m, nq}), &next_tensor));
    if (m == 0 || d == 0) return;
    if (ctx->input(2).dtype() == tensorflow::DT_BFLOAT16) {
      Run<bfloat16>(ctx, m, d, da, f, inner, nq, k, has_next, y_tensor, next_tensor);
    } else {
      Run<float>(ctx, m, d, da, f, inner, nq, k, has_next, y_tensor, next_tensor);
    }
  }

 private:
  // y [m, out] += ((in [m, width] @ a) * mask) @ b, a = input(a_index), b the next input.
  void AddDelta(OpKernelContext* ctx, int a_index, int64 m, int64 width, int64 out, int64 k,
                const float* in, float* y) {
    const Tensor& a = ctx->input(a_index);
    const int64 kr = a.dim_size(1), r = kr / k;
    const float* one_hot = ctx->input(14).flat<float>().data();
    auto* pool = WorkerPool(ctx);
    std::vector<float> t(m * kr), delta(m * out);
    ComputeDense<float>({m, width, kr, kr}, {in, a.flat<float>().data(), nullptr, nullptr,
                                             t.data(), Activation::kNone},
                        true, pool, avx2_);
    for (int64 row = 0; row < m; ++row) {
      for (int64 c = 0; c < kr; ++c) t[row * kr + c] *= one_hot[row * k + c / r];
    }
    ComputeDense<float>({m, kr, out, out}, {t.data(), ctx->input(a_index + 1).flat<float>().data(),
                                            nullptr, y, delta.data(), Activation::kNone},
                        true, pool, avx2_);
    std::copy(delta.begin(), delta.end(), y);
  }

  template <typename W>
  void Run(OpKernelContext* ctx, int64 m, int64 d, int64 da, int64 f, int64 inner, int64 nq,
           int64 k, bool has_next, Tensor* y_tensor, Tensor* next_tensor) {
    auto* pool = WorkerPool(ctx);
    auto in = [ctx](int i) { return ctx->input(i).flat<float>().data(); };
    auto weights = [ctx](int i) { return ctx->input(i).flat<W>().data(); };
    std::vector<float> x1(m * d), h(m * d), z(m * f), u(m * inner);
    // x1 = attn @ out_w + out_bias + x + delta_out(attn)
    ComputeDense<W>({m, da, d, d}, {in(0), weights(2), Data(ctx->input(3)), in(1), x1.data(),
                                    Activation::kNone},
                    true, pool, avx2_);
    AddDelta(ctx, 15, m, da, d, k, in(0), x1.data());
    // h = norm(x1); z = h @ up_w + up_bias + delta_up(h); u = act(z)
    for (int64 r = 0; r < m; ++r) {
      rowops::NormRow(avx2_, d, x1.data() + r * d, in(4), Data(ctx->input(5)), eps_,
                      h.data() + r * d);
    }
    ComputeDense<W>({m, d, f, f}, {h.data(), weights(6), Data(ctx->input(7)), nullptr,
                                   z.data(), Activation::kNone},
                    true, pool, avx2_);
    AddDelta(ctx, 17, m, d, f, k, h.data(), z.data());
    rowops::FinishRows(avx2_, m, f, inner, act_, z.data(), nullptr, nullptr, u.data());
    // y = u @ down_w + down_bias + x1 + delta_down(u)
    float* y = y_tensor->flat<float>().data();
    ComputeDense<W>({m, inner, d, d}, {u.data(), weights(8), Data(ctx->input(9)), x1.data(), y,
                                       Activation::kNone},
                    true, pool, avx2_);
    AddDelta(ctx, 19, m, inner, d, k, u.data(), y);
    if (!has_next) return;
    // next = next_norm(y) @ next_w + next_bias + delta_next(next_norm(y))
    for (int64 r = 0; r < m; ++r) {
      rowops::NormRow(avx2_, d, y + r * d, in(10), Data(ctx->input(11)), eps_, h.data() + r * d);
    }
    float* next = next_tensor->flat<float>().data();
    ComputeDense<W>({m, d, nq, nq}, {h.data(), weights(12), Data(ctx->input(13)), nullptr, next,
                                     Activation::kNone},
                    true, pool, avx2_);
    AddDelta(ctx, 21, m, d, nq, k, h.data(), next);
  }

  Activation act_ = Activation::kGeluTanh;
  float eps_ = 1e-5f;
  bool avx2_ = false;
};

REGISTER_KERNEL_BUILDER(Name("TokenserveLoraFinishBlock").Device(DEVICE_CPU),
                        LoraFinishBlockOp);

}  // namespace tokenserve
