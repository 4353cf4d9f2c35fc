// TokenserveGgufMatmul: y[M, N] = x[M, K] @ dequant(blocks).T on the CPU, with the weights
// kept as a GGUF file stores them: blocks is uint8 [N, K / 32 * block bytes], each output's
// row of Q4_0, Q4_1 or Q8_0 blocks (gguf_blocks.h) exactly as ggml lays out a [N, K] tensor,
// or of Q4_K, Q5_K or Q6_K super-blocks of 256 (gguf_kquants.h).
//
// As llama.cpp does on x86: x is quantized once per call into Q8 blocks of 32 (q8_K blocks of
// 256 for the K-quants, gguf_q8k.h), then each weight block meets each activation block in
// integer dot products (AVX2 maddubs + madd, or AVX512-VNNI dpbusd where the build's flags
// include it; the K-quants' sub-block scales ride on madd, so they stay AVX2), the block
// scales folded in with FMA (gguf_kernels.h, gguf_kquants_avx2.h). The weight rows are split over the op's threads in contiguous ranges
// (chunks.h), as the int8 op splits its rows. The op reads the stored bytes, or those of
// Q4_0/Q4_1/Q5_0 weights repacked at load into 8-row tiles (gguf_packed.h).
//
// Up to a few rows of x (decode of a few streams) each weight row is read once,
// front to back (gguf_kernels.h); with more (prefill chunks, many streams) eight weight rows
// at a time are decoded into a per-thread buffer and every row of x sweeps them
// (gguf_tiles.h). Weights repacked into 8-row tiles take one kernel at every row count
// (gguf_packed.h).

#include <algorithm>
#include <string>

#include "gguf_matmul.h"
#include "op_support.h"

namespace tokenserve {

REGISTER_OP("TokenserveGgufMatmul")
    .Input("x: float")       // [M, K], K a multiple of the type's block values (32 or 256)
    .Input("blocks: uint8")  // [N, K / values * block bytes]: a GGUF [N, K] tensor's bytes
    .Output("y: float")      // [M, N]
    .Attr("block_type: {" TOKENSERVE_GGUF_TYPES "}")
    .Attr("isa: {'auto', 'avx2', 'scalar'} = 'auto'")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle x, blocks;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &x));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &blocks));
      std::string type;
      TF_RETURN_IF_ERROR(c->GetAttr("block_type", &type));
      if (c->ValueKnown(c->Dim(x, 1)) && c->ValueKnown(c->Dim(blocks, 1))) {
        const std::string why = BlocksMismatch(type, c->Value(c->Dim(x, 1)),
                                               c->Value(c->Dim(blocks, 1)));
        if (!why.empty()) return InvalidArgument(why);
      }
      c->set_output(0, c->Matrix(c->Dim(x, 0), c->Dim(blocks, 0)));
      return absl::OkStatus();
    })
    .Doc("y = x @ dequant(blocks).T; blocks: GGUF Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q5_K/Q6_K rows as "
         "stored.");

REGISTER_OP("TokenserveGgufMatmulInfo")
    .Output("info: string")
    .SetShapeFn(tensorflow::shape_inference::ScalarShape)
    .Doc("Which instruction set the TokenserveGgufMatmul kernel uses on this CPU.");

namespace {

class GgufMatmulOp : public OpKernel {
 public:
  explicit GgufMatmulOp(OpKernelConstruction* ctx)
      : OpKernel(ctx),
        type_(StringAttr(ctx, "block_type")),
        isa_(ChooseIsa(StringAttr(ctx, "isa"))) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& blocks = ctx->input(1);
    OP_REQUIRES(ctx, x.dims() == 2,
                InvalidArgument("x must be [M, K], got shape ", x.shape().DebugString()));
    OP_REQUIRES(ctx, blocks.dims() == 2,
                InvalidArgument("blocks must be [N, bytes a row], got shape ",
                                blocks.shape().DebugString()));
    const Geometry g{x.dim_size(0), x.dim_size(1), blocks.dim_size(0), blocks.dim_size(1),
                     blocks.dim_size(0)};
    std::string why = BlocksMismatch(type_, g.K, g.row_bytes);
    if (why.empty()) why = RowsMismatch(type_, g.N);
    OP_REQUIRES(ctx, why.empty(), InvalidArgument(why));
    Tensor* y_tensor = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({g.M, g.N}), &y_tensor));
    float* y = y_tensor->flat<float>().data();
    if (g.M == 0 || g.N == 0) return;
    if (g.K == 0) {  // an empty sum
      std::fill(y, y + g.M * g.N, 0.f);
      return;
    }
    GgufMatmulRows(WorkerPool(ctx), isa_, type_, g, x.flat<float>().data(),
                   blocks.flat<uint8_t>().data(), y);
  }

 private:
  const std::string type_;
  const Isa isa_;
};

const char* GgufIsa() { return IsaName(ChooseIsa("auto")); }

REGISTER_KERNEL_BUILDER(Name("TokenserveGgufMatmul").Device(DEVICE_CPU), GgufMatmulOp);
REGISTER_KERNEL_BUILDER(Name("TokenserveGgufMatmulInfo").Device(DEVICE_CPU), IsaInfoOp<GgufIsa>);

}  // namespace
}  // namespace tokenserve
