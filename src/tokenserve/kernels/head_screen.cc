// The LM head screen's matmuls (engine/step/head.py), on the CPU, x float32 and the
// sums float32, w output-major (each output's K weights contiguous, a tied embedding's
// layout "nk"):
//
//   TokenserveHalfMatmul      y[M, N] = x[M, K] @ w[N, K].T, w float16
//   TokenserveInt8RowMatmul   y[M, N] = (x[M, K] @ q[N, K].T) * scale[N], q int8, one
//                             float32 scale per row (per output)
//   TokenserveHalfMatmulInfo  which instruction set their kernels take on this CPU
//
// (screened_logits.cc has the whole screened head as one op.)
//
// A greedy decode step of a few sequences reads one of these copies of the head (half or a
// quarter of the float32 head's bytes) and needs its products only to rule tokens out, so
// x stays float32: no activation quantization, whose error would widen the screen (the
// int8 weights op, int8_matmul.cc, quantizes x per block of 32, and that made thousands of
// candidates a row on SmolLM2).
//
// The kernels and the work split: head_screen_rows.h.

#include <algorithm>
#include <cstdint>
#include <string>

#include "chunks.h"
#include "cpu.h"
#include "head_screen_rows.h"
#include "op_support.h"

namespace tokenserve {

absl::Status MatmulShape(InferenceContext* c) {
  ShapeHandle x, w;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &x));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &w));
  DimensionHandle k;
  TF_RETURN_IF_ERROR(c->Merge(c->Dim(x, 1), c->Dim(w, 1), &k));
  if (c->num_inputs() > 2) {  // the int8 op's scale: one per weight row
    ShapeHandle scale;
    TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &scale));
    DimensionHandle n;
    TF_RETURN_IF_ERROR(c->Merge(c->Dim(scale, 0), c->Dim(w, 0), &n));
  }
  c->set_output(0, c->Matrix(c->Dim(x, 0), c->Dim(w, 0)));
  return absl::OkStatus();
}

REGISTER_OP("TokenserveHalfMatmul")
    .Input("x: float")   // [M, K]
    .Input("w: half")    // [N, K]
    .Output("y: float")  // [M, N]
    .Attr("isa: {'auto', 'scalar'} = 'auto'")
    .SetShapeFn(MatmulShape);

REGISTER_OP("TokenserveInt8RowMatmul")
    .Input("x: float")      // [M, K]
    .Input("w: int8")       // [N, K]
    .Input("scale: float")  // [N]
    .Output("y: float")     // [M, N]
    .Attr("isa: {'auto', 'scalar'} = 'auto'")
    .SetShapeFn(MatmulShape);

REGISTER_OP("TokenserveHalfMatmulInfo")
    .Output("isa: string")
    .SetShapeFn(tensorflow::shape_inference::ScalarShape);

// W: Half (TokenserveHalfMatmul) or int8_t (TokenserveInt8RowMatmul, with a scale input)
template <typename W>
class RowMatmulOp : public OpKernel {
 public:
  explicit RowMatmulOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    avx2_ = UsesAvx2<W>(StringAttr(ctx, "isa"));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& w = ctx->input(1);
    OP_REQUIRES(ctx, x.dims() == 2 && w.dims() == 2,
                InvalidArgument("x and w must be matrices, got ", x.shape().DebugString(),
                                " and ", w.shape().DebugString()));
    Geometry g{x.dim_size(0), x.dim_size(1), w.dim_size(0)};
    OP_REQUIRES(ctx, w.dim_size(1) == g.K,
                InvalidArgument("x is [M, K] with K = ", g.K, " but w is ",
                                w.shape().DebugString(), ", expected [N, K]"));
    const float* scale = nullptr;
    if (ctx->num_inputs() > 2) {
      const Tensor& s = ctx->input(2);
      OP_REQUIRES(ctx, s.dims() == 1 && s.dim_size(0) == g.N,
                  InvalidArgument("scale must be [N] = [", g.N, "], got ",
                                  s.shape().DebugString()));
      scale = s.flat<float>().data();
    }
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({g.M, g.N}), &y));
    if (g.M == 0 || g.N == 0) return;
    if (g.K == 0) {
      std::fill(y->flat<float>().data(), y->flat<float>().data() + g.M * g.N, 0.f);
      return;
    }
    const float* xp = x.flat<float>().data();
    const W* wp = w.flat<W>().data();
    float* yp = y->flat<float>().data();
    auto* pool = WorkerPool(ctx);
    const int64 tiles = (g.N + kTileRows - 1) / kTileRows;
    const bool avx2 = avx2_;
    RunRanges(pool, std::max(1, pool->NumThreads()), tiles, [&](int64 tile, int64, int64 next) {
      const int64 n0 = tile * kTileRows, n1 = std::min(g.N, n0 + kTileRows);
      ProductTile<W>(avx2, g, xp, wp, scale, n0, n1, wp + StreamEnd(g, tile, next) * g.K, yp);
    });
  }

 private:
  bool avx2_ = false;
};

namespace {

const char* HeadScreenIsa() {
  return cpu::HasAvx2FmaF16c() ? "AVX2+FMA+F16C" : "scalar (no AVX2+FMA+F16C)";
}

}  // namespace

REGISTER_KERNEL_BUILDER(Name("TokenserveHalfMatmul").Device(DEVICE_CPU), RowMatmulOp<Half>);
REGISTER_KERNEL_BUILDER(Name("TokenserveInt8RowMatmul").Device(DEVICE_CPU),
                        RowMatmulOp<int8_t>);
REGISTER_KERNEL_BUILDER(Name("TokenserveHalfMatmulInfo").Device(DEVICE_CPU),
                        IsaInfoOp<HeadScreenIsa>);

}  // namespace tokenserve
