// TokenserveInt8FinishBlock: a transformer block's second half (output projection,
// residual, MLP norm, MLP up and activation, MLP down, residual) with int8 weights, through
// TokenserveInt8Matmul's kernel (int8_matmul.h) in one op, and optionally the next block's
// norm and QKV projection, so those three or four matrices stream back to back (see the
// op's class below). finish_block.cc has the float32 weights' twin.

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "int8_matmul.h"
#include "op_support.h"
#include "rowops.h"

namespace tokenserve {

REGISTER_OP("TokenserveInt8FinishBlock")
    .Input("attn: float")        // [M, Da] attention output
    .Input("x: float")           // [M, D] the residual stream
    .Input("out_q: int8")        // [D, Da]
    .Input("out_scale: float")   // [D, G]
    .Input("out_bias: float")    // [D] or [0]
    .Input("norm_scale: float")  // [D]
    .Input("norm_bias: float")   // [D] (LayerNorm) or [0] (RMSNorm)
    .Input("up_q: int8")         // [F, D]
    .Input("up_scale: float")    // [F, G]
    .Input("up_bias: float")     // [F] or [0]
    .Input("down_q: int8")       // [D, F] (F / 2 for swiglu, geglu)
    .Input("down_scale: float")  // [D, G]
    .Input("down_bias: float")   // [D] or [0]
    // the next block's first half, optional (all empty: none): its norm and QKV projection
    .Input("next_norm_scale: float")  // [D] or [0]
    .Input("next_norm_bias: float")   // [D] (LayerNorm), or [0] (RMSNorm, or no next)
    .Input("next_q: int8")            // [Nq, D] or [0, 0]
    .Input("next_scale: float")       // [Nq, G] or [0, 0]
    .Input("next_bias: float")        // [Nq] or [0]
    .Output("y: float")          // [M, D]
    .Output("next: float")       // [M, Nq], or [M, 0] without a next block
    .Attr("activation: {'gelu_tanh', 'swiglu', 'geglu'} = 'gelu_tanh'")
    .Attr("eps: float = 1e-5")
    .Attr("isa: {'auto', 'avx2', 'scalar'} = 'auto'")
    .SetShapeFn(FinishBlockShape<15, 0>)  // Nq: next_q's (input 15) rows
    .Doc("x1 = attn @ dequant(out).T + out_bias + x; "
         "y = dequant(down) applied to act(norm(x1) @ dequant(up).T + up_bias), + down_bias + x1; "
         "next = next_norm(y) @ dequant(next_q).T + next_bias.");

// The second half of a transformer block with int8 weights, in one op:
//   x1 = attn @ out.T + out_bias + x
//   y  = down(act(norm(x1) @ up.T + up_bias)) + down_bias + x1
// the same arithmetic as TokenserveInt8Matmul followed by TokenserveEpilogue and
// TokenserveNorm (row_ops.cc, rowops.h), so the result is the separate ops' bit for bit.
// Why: at batch 1 the three matrices then stream back to back. Between separate ops a
// decode step spends 30-100 us on other work, and after such a pause the weights' stream
// restarts slowly (on a 2-core VM, two threads read GPT-2-small's block matrices at 26-32
// GB/s back to back and at 10-15 with 100 us between them; docs/performance.md), and the
// step runs six fewer ops a layer. With next_q given, the next block's norm and QKV
// projection follow in the same op
//   next = next_norm(y) @ next_q.T + next_bias
// (again the separate ops' arithmetic): four matrices back to back, three ops fewer.
class Int8FinishBlockOp : public OpKernel {
 public:
  explicit Int8FinishBlockOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    act_ = ActivationAttr(ctx);  // gelu_tanh, swiglu or geglu (the attribute allows no other)
    OP_REQUIRES_OK(ctx, ctx->GetAttr("eps", &eps_));
    isa_ = ChooseIsa(StringAttr(ctx, "isa"));
    avx2_ = isa_ != Isa::kScalar;
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& attn = ctx->input(0);
    const Tensor& x = ctx->input(1);
    OP_REQUIRES(ctx, attn.dims() == 2,
                InvalidArgument("attn must be [M, Da], got ", attn.shape().DebugString()));
    Geometry out, up, down;
    if (!CheckInt8Args(ctx, "out", attn.dim_size(0), attn.dim_size(1), ctx->input(2),
                       ctx->input(3), &out)) {
      return;
    }
    OP_REQUIRES(ctx, x.dims() == 2 && x.dim_size(0) == out.M && x.dim_size(1) == out.N,
                InvalidArgument("x must be [M, D] = [", out.M, ", ", out.N, "], got ",
                                x.shape().DebugString()));
    const int64 m = out.M, d = out.N;
    const Tensor& out_bias = ctx->input(4);
    const Tensor& norm_scale = ctx->input(5);
    const Tensor& norm_bias = ctx->input(6);
    if (!CheckVectorOrEmpty(ctx, "out_bias", out_bias, d)) return;
    if (!CheckVector(ctx, "norm_scale", norm_scale, d)) return;
    OP_REQUIRES(ctx, IsVectorOrEmpty(norm_bias, d),
                InvalidArgument("norm_bias must be [", d, "] or empty (RMSNorm), got ",
                                norm_bias.shape().DebugString()));
    if (!CheckInt8Args(ctx, "up", m, d, ctx->input(7), ctx->input(8), &up)) return;
    const Tensor& up_bias = ctx->input(9);
    if (!CheckVectorOrEmpty(ctx, "up_bias", up_bias, up.N)) return;
    const bool gated = rowops::Gated(act_);
    OP_REQUIRES(ctx, !gated || up.N % 2 == 0,
                InvalidArgument(GatedName(act_), " needs an even up width, got ", up.N));
    const int64 inner = gated ? up.N / 2 : up.N;
    if (!CheckInt8Args(ctx, "down", m, inner, ctx->input(10), ctx->input(11), &down)) return;
    OP_REQUIRES(ctx, down.N == d,
                InvalidArgument("down must have D = ", d, " rows, got ",
                                ctx->input(10).shape().DebugString()));
    const Tensor& down_bias = ctx->input(12);
    if (!CheckVectorOrEmpty(ctx, "down_bias", down_bias, d)) return;
    // the next block's norm and QKV: all given, or all empty
    const Tensor& next_norm_scale = ctx->input(13);
    const Tensor& next_norm_bias = ctx->input(14);
    const Tensor& next_bias = ctx->input(17);
    const bool has_next = ctx->input(15).NumElements() > 0;
    Geometry next{};
    if (!CheckNextNorm(ctx, has_next, "next_q", d, next_norm_scale, next_norm_bias, next_bias)) {
      return;
    }
    if (has_next) {
      if (!CheckInt8Args(ctx, "next", m, d, ctx->input(15), ctx->input(16), &next)) return;
      if (!CheckVectorOrEmpty(ctx, "next_bias", next_bias, next.N)) return;
    }
    Tensor* y_tensor = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({m, d}), &y_tensor));
    Tensor* next_tensor = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({m, has_next ? next.N : 0}),
                                             &next_tensor));
    if (m == 0 || d == 0) return;
    OP_REQUIRES(ctx, out.K > 0 && up.N > 0 && inner > 0,
                InvalidArgument("out's K and up's width must be positive"));

    auto* pool = WorkerPool(ctx);
    const bool int8 = true;
    float* y = y_tensor->flat<float>().data();
    const float* xp = x.flat<float>().data();
    std::vector<float> z(m * std::max(d, up.N)), x1(m * d), h(m * d), u(m * inner);
    // x1 = attn @ out.T + out_bias + x
    Int8MatmulRows(pool, out, attn.flat<float>().data(), ctx->input(2).flat<int8_t>().data(),
                   ctx->input(3).flat<float>().data(), int8, isa_, avx2_, z.data());
    rowops::FinishRows(avx2_, m, d, d, rowops::Activation::kNone, z.data(), Data(out_bias), xp,
                       x1.data());
    // h = norm(x1)
    for (int64 r = 0; r < m; ++r) {
      rowops::NormRow(avx2_, d, x1.data() + r * d, norm_scale.flat<float>().data(),
                      Data(norm_bias), eps_, h.data() + r * d);
    }
    // u = act(h @ up.T + up_bias)
    Int8MatmulRows(pool, up, h.data(), ctx->input(7).flat<int8_t>().data(),
                   ctx->input(8).flat<float>().data(), int8, isa_, avx2_, z.data());
    rowops::FinishRows(avx2_, m, up.N, inner, act_, z.data(), Data(up_bias), nullptr, u.data());
    // y = u @ down.T + down_bias + x1
    Int8MatmulRows(pool, down, u.data(), ctx->input(10).flat<int8_t>().data(),
                   ctx->input(11).flat<float>().data(), int8, isa_, avx2_, z.data());
    rowops::FinishRows(avx2_, m, d, d, rowops::Activation::kNone, z.data(), Data(down_bias),
                       x1.data(), y);
    if (has_next) {  // next = next_norm(y) @ next_q.T + next_bias, into h as the norm's rows
      for (int64 r = 0; r < m; ++r) {
        rowops::NormRow(avx2_, d, y + r * d, next_norm_scale.flat<float>().data(),
                        Data(next_norm_bias), eps_, h.data() + r * d);
      }
      z.resize(m * next.N);
      Int8MatmulRows(pool, next, h.data(), ctx->input(15).flat<int8_t>().data(),
                     ctx->input(16).flat<float>().data(), int8, isa_, avx2_, z.data());
      rowops::FinishRows(avx2_, m, next.N, next.N, rowops::Activation::kNone, z.data(),
                         Data(next_bias), nullptr, next_tensor->flat<float>().data());
    }
  }

 private:
  rowops::Activation act_ = rowops::Activation::kGeluTanh;
  float eps_ = 1e-5f;
  Isa isa_ = Isa::kScalar;
  bool avx2_ = false;
};

REGISTER_KERNEL_BUILDER(Name("TokenserveInt8FinishBlock").Device(DEVICE_CPU),
                        Int8FinishBlockOp);

}  // namespace tokenserve
