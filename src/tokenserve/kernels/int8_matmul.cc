// TokenserveInt8Matmul: y[M, N] = x[M, K] @ dequant(q[N, K], scale[N, G]).T on the CPU.
//
// Built for LLM decode (M = 1..32): the run time is dominated by streaming the weights, so
// they are kept as int8 (one byte per weight, output-major so each output's K weights are
// contiguous) and read from memory once per call, software-prefetched a few tiles ahead.
// Every row of x is swept over a small tile of output channels while that tile's weights
// sit in L1; tiles are spread over TF's intra-op threads.
//
// Two inner kernels, both with an AVX2+FMA path and a portable scalar path (same math):
//   * int8 activations (llama.cpp's q8_0 idea): each row of x is quantized once per call to
//     int8 in blocks of 32 with one float scale per block, then 32-wide integer dot products
//     (_mm256_maddubs_epi16 + _mm256_madd_epi16) are scaled by the block scale. About half
//     the instructions per multiply-add of the float kernel; error ~1/254 of the block absmax.
//     With up to 8 rows of x (decode of a few sequences, or one checking drafts) the AVX2
//     path reads one weight row at a time, a single sequential stream, each block of it
//     loaded once for four (or five) rows of x; with more it sweeps every row of x over a tile of
//     four weight rows held in L1.
//   * float activations: a tile of weights is dequantized (scale folded in) into a small
//     float buffer once, then plain FMA dot products for every row of x. Exact up to float
//     rounding.
// The int8 kernel is the default: it measured about 2x faster than the float one at every
// shape of benchmarks/int8_matmul.py. The float kernel stays as an exact option
// (activations="float").
// Where the CPU has AVX512-VNNI (with AVX512BW and VL), the int8 kernel takes two 32-blocks
// per instruction instead: one vpdpbusd (u8 x s8, four products per int32 lane, no
// saturation) on 64 bytes replaces maddubs + madd on 32, and the two blocks' scales ride in
// the two halves of one float vector. Same integer dot products per block, so it differs
// from the AVX2 path only in float summation order.
//
//
// Scales: scale[n, g] applies to q[n, g*K/G : (g+1)*K/G]. Activation blocks never straddle a
// weight group (they restart at each group boundary), so any K and any group size work; a
// block shorter than 32 is zero-padded. q must lie in [-127, 127] (symmetric quantization,
// as quantize_weight produces): the AVX2 sign trick cannot negate -128.
//
// The kernels: int8_tiles.h (shapes, scalar), int8_tiles_avx2.h, int8_rows_avx2.h,
// int8_vnni.h; the work split and dispatch: int8_matmul.h.

#include <algorithm>
#include <cstdint>
#include <string>

#include "int8_matmul.h"
#include "op_support.h"

namespace tokenserve {

REGISTER_OP("TokenserveInt8Matmul")
    .Input("x: float")       // [M, K]
    .Input("q: int8")        // [N, K], values in [-127, 127]
    .Input("scale: float")   // [N, G], G divides K
    .Output("y: float")      // [M, N]
    .Attr("activations: {'int8', 'float'} = 'int8'")
    .Attr("isa: {'auto', 'avx2', 'scalar'} = 'auto'")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle x, q, scale;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &x));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &q));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 2, &scale));
      DimensionHandle k, n;
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(x, 1), c->Dim(q, 1), &k));
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(q, 0), c->Dim(scale, 0), &n));
      c->set_output(0, c->Matrix(c->Dim(x, 0), n));
      return absl::OkStatus();
    })
    .Doc("y = x @ (q * scale expanded over K / G columns per group).T; int8 weights.");

REGISTER_OP("TokenserveInt8MatmulInfo")
    .Output("info: string")
    .SetShapeFn(tensorflow::shape_inference::ScalarShape)
    .Doc("Which instruction set the TokenserveInt8Matmul kernel uses on this CPU.");

class Int8MatmulOp : public OpKernel {
 public:
  explicit Int8MatmulOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("activations", &activations_));
    isa_ = ChooseIsa(StringAttr(ctx, "isa"));
    avx2_ = isa_ != Isa::kScalar;  // quantizing x and the float kernel: AVX2 at most
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    OP_REQUIRES(ctx, x.dims() == 2,
                InvalidArgument("x must be [M, K], got shape ", x.shape().DebugString()));
    Geometry g;
    if (!CheckInt8Args(ctx, "matmul", x.dim_size(0), x.dim_size(1), ctx->input(1), ctx->input(2),
                       &g)) {
      return;
    }
    Tensor* y_tensor = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({g.M, g.N}), &y_tensor));
    float* y = y_tensor->flat<float>().data();
    if (g.M == 0 || g.N == 0) return;
    if (g.K == 0) {  // empty sum
      std::fill(y, y + g.M * g.N, 0.f);
      return;
    }
    Int8MatmulRows(WorkerPool(ctx), g,
                   x.flat<float>().data(), ctx->input(1).flat<int8_t>().data(),
                   ctx->input(2).flat<float>().data(), activations_ == "int8", isa_, avx2_, y);
  }

 private:
  std::string activations_;
  Isa isa_ = Isa::kScalar;
  bool avx2_ = false;
};

namespace {

const char* Int8Isa() { return IsaName(ChooseIsa("auto")); }

}  // namespace

REGISTER_KERNEL_BUILDER(Name("TokenserveInt8Matmul").Device(DEVICE_CPU), Int8MatmulOp);
REGISTER_KERNEL_BUILDER(Name("TokenserveInt8MatmulInfo").Device(DEVICE_CPU),
                        IsaInfoOp<Int8Isa>);

}  // namespace tokenserve
