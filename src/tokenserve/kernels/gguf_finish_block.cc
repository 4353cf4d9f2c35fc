// TokenserveGgufFinishBlock: a transformer block's second half (output projection,
// residual, MLP norm, MLP up and activation, MLP down, residual) with GGUF weights kept as
// stored, through TokenserveGgufMatmul's kernels (gguf_matmul.h) in one op, and optionally
// the next block's norm and QKV projection. int8_finish_block.cc is the int8 weights' twin,
// and the reason is the same: at one row the matrices then stream back to back. Separate
// ops leave the weights' stream idle between them while the executor runs the small ops
// around each matmul (on a 2-core EPYC a SmolLM2 decode step ran about 14 ops a layer, each
// a restart of the stream), and the step runs ten fewer ops a layer.
//
// Each projection may be several parts of different block types, in output order (a
// Q4_K_M file's fused QKV: Q4_K query and key rows, Q6_K value rows): `*_blocks` lists the
// parts, `*_types` their types, and the parts' outputs are the columns of one product, in
// order. Each part quantizes its input for itself (q8 blocks of 32, or q8_K blocks of 256), as the
// separate op does.
//
// The arithmetic is the separate ops' (gguf_matmul, then TokenserveEpilogue, TokenserveNorm
// and, with post-norms, TokenserveNorm and an add; rowops.h), so the result is theirs bit
// for bit and greedy tokens do not change.

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "gguf_matmul.h"
#include "op_support.h"
#include "rowops.h"

namespace tokenserve {

REGISTER_OP("TokenserveGgufFinishBlock")
    .Input("attn: float")                    // [M, Da] attention output
    .Input("x: float")                       // [M, D] the residual stream
    .Input("out_blocks: num_out * uint8")    // parts of [D, Da]
    .Input("out_bias: float")                // [D] or [0]
    .Input("norm_scale: float")              // [D]
    .Input("norm_bias: float")               // [D] (LayerNorm) or [0] (RMSNorm)
    .Input("up_blocks: num_up * uint8")      // parts of [F, D]
    .Input("up_bias: float")                 // [F] or [0]
    .Input("down_blocks: num_down * uint8")  // parts of [D, F] (F / 2 for swiglu, geglu)
    .Input("down_bias: float")               // [D] or [0]
    .Input("post_attn_norm: float")          // [D] RMSNorm scale (Gemma) or [0]
    .Input("post_mlp_norm: float")           // [D] or [0]
    // the next block's first half, optional (no parts: none): its norm and QKV projection
    .Input("next_norm_scale: float")         // [D] or [0]
    .Input("next_norm_bias: float")          // [D] (LayerNorm), or [0]
    .Input("next_blocks: num_next * uint8")  // parts of [Nq, D], or none
    .Input("next_bias: float")               // [Nq] or [0]
    .Output("y: float")                      // [M, D]
    .Output("next: float")                   // [M, Nq], or [M, 0] without a next block
    .Attr("num_out: int >= 1")
    .Attr("num_up: int >= 1")
    .Attr("num_down: int >= 1")
    .Attr("num_next: int >= 0")
    .Attr("out_types: list({" TOKENSERVE_GGUF_TYPES "})")
    .Attr("up_types: list({" TOKENSERVE_GGUF_TYPES "})")
    .Attr("down_types: list({" TOKENSERVE_GGUF_TYPES "})")
    .Attr("next_types: list({" TOKENSERVE_GGUF_TYPES "}) >= 0")
    .Attr("activation: {'gelu_tanh', 'swiglu', 'geglu'} = 'gelu_tanh'")
    .Attr("eps: float = 1e-5")
    .Attr("isa: {'auto', 'avx2', 'scalar'} = 'auto'")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle x;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &x));
      int num_out, num_up, num_down, num_next;
      TF_RETURN_IF_ERROR(c->GetAttr("num_out", &num_out));
      TF_RETURN_IF_ERROR(c->GetAttr("num_up", &num_up));
      TF_RETURN_IF_ERROR(c->GetAttr("num_down", &num_down));
      TF_RETURN_IF_ERROR(c->GetAttr("num_next", &num_next));
      const int first_next = 2 + num_out + 3 + num_up + 1 + num_down + 5;
      DimensionHandle nq = c->MakeDim(0);
      for (int i = 0; i < num_next; ++i) {
        ShapeHandle part;
        TF_RETURN_IF_ERROR(c->WithRank(c->input(first_next + i), 2, &part));
        TF_RETURN_IF_ERROR(c->Add(nq, c->Dim(part, 0), &nq));
      }
      c->set_output(0, x);
      c->set_output(1, c->Matrix(c->Dim(x, 0), nq));
      return absl::OkStatus();
    })
    .Doc("x1 = attn @ dequant(out).T + out_bias + x; "
         "y = dequant(down) applied to act(norm(x1) @ dequant(up).T + up_bias), + down_bias + "
         "x1 (with post-norms: x + post_norm(branch) instead); "
         "next = next_norm(y) @ dequant(next).T + next_bias.");

namespace {

// One projection's weights: its parts, each rows of one block type, in output order.
struct Projection {
  std::vector<const Tensor*> parts;
  std::vector<std::string> types;
  int64 n = 0;  // outputs: the parts' rows together
};

// The projection whose parts are the op's inputs `name` (types in `types`), checked against
// K inputs; sets ctx's status and returns false when a part does not fit.
bool ReadProjection(OpKernelContext* ctx, const char* name, const std::vector<std::string>& types,
                    int64 k, Projection* p) {
  tensorflow::OpInputList parts;
  const absl::Status status = ctx->input_list(name, &parts);
  if (!status.ok()) {
    ctx->CtxFailure(__FILE__, __LINE__, status);
    return false;
  }
  if (static_cast<size_t>(parts.size()) != types.size()) {
    ctx->CtxFailure(__FILE__, __LINE__, InvalidArgument(name, ": ", parts.size(), " parts but ",
                                                        types.size(), " block types"));
    return false;
  }
  p->types = types;
  for (int i = 0; i < parts.size(); ++i) {
    const Tensor& part = parts[i];
    std::string why = part.dims() == 2 ? BlocksMismatch(types[i], k, part.dim_size(1))
                                       : "must be [rows, bytes a row]";
    if (why.empty()) why = RowsMismatch(types[i], part.dim_size(0));
    if (!why.empty()) {
      ctx->CtxFailure(__FILE__, __LINE__, InvalidArgument(name, "[", i, "] (",
                                                          part.shape().DebugString(), "): ", why));
      return false;
    }
    p->parts.push_back(&part);
    p->n += part.dim_size(0);
  }
  return true;
}

}  // namespace

class GgufFinishBlockOp : public OpKernel {
 public:
  explicit GgufFinishBlockOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    act_ = ActivationAttr(ctx);  // gelu_tanh, swiglu or geglu (the attribute allows no other)
    OP_REQUIRES_OK(ctx, ctx->GetAttr("eps", &eps_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("out_types", &out_types_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("up_types", &up_types_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("down_types", &down_types_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("next_types", &next_types_));
    isa_ = ChooseIsa(StringAttr(ctx, "isa"));
    avx2_ = isa_ != Isa::kScalar && cpu::HasAvx2Fma();  // the row ops' choice under "auto"
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& attn = ctx->input(0);
    const Tensor& x = ctx->input(1);
    OP_REQUIRES(ctx, attn.dims() == 2 && x.dims() == 2 && x.dim_size(0) == attn.dim_size(0),
                InvalidArgument("attn and x must be [M, Da] and [M, D], got ",
                                attn.shape().DebugString(), " and ", x.shape().DebugString()));
    const int64 m = x.dim_size(0), d = x.dim_size(1);
    Projection out, up, down, next;
    if (!ReadProjection(ctx, "out_blocks", out_types_, attn.dim_size(1), &out)) return;
    OP_REQUIRES(ctx, out.n == d, InvalidArgument("out has ", out.n, " rows; x has D = ", d));
    if (!ReadProjection(ctx, "up_blocks", up_types_, d, &up)) return;
    const bool gated = rowops::Gated(act_);
    OP_REQUIRES(ctx, !gated || up.n % 2 == 0,
                InvalidArgument(GatedName(act_), " needs an even up width, got ", up.n));
    const int64 inner = gated ? up.n / 2 : up.n;
    if (!ReadProjection(ctx, "down_blocks", down_types_, inner, &down)) return;
    OP_REQUIRES(ctx, down.n == d, InvalidArgument("down has ", down.n, " rows; D = ", d));
    const Tensor* vectors[8];
    const char* names[8] = {"out_bias",       "norm_scale",     "norm_bias",     "up_bias",
                            "down_bias",      "post_attn_norm", "post_mlp_norm", "next_bias"};
    for (int i = 0; i < 8; ++i) OP_REQUIRES_OK(ctx, ctx->input(names[i], &vectors[i]));
    const int64 widths[8] = {d, d, d, up.n, d, d, d, 0};
    for (int i = 0; i < 7; ++i) {
      OP_REQUIRES(ctx, IsVectorOrEmpty(*vectors[i], widths[i]) &&
                           (i != 1 || vectors[i]->NumElements() == d),
                  InvalidArgument(names[i], " must be [", widths[i], "]",
                                  i == 1 ? "" : " or empty", ", got ",
                                  vectors[i]->shape().DebugString()));
    }
    const bool has_next = !next_types_.empty();
    const Tensor *next_norm_scale, *next_norm_bias;
    OP_REQUIRES_OK(ctx, ctx->input("next_norm_scale", &next_norm_scale));
    OP_REQUIRES_OK(ctx, ctx->input("next_norm_bias", &next_norm_bias));
    if (!CheckNextNorm(ctx, has_next, "next_blocks", d, *next_norm_scale, *next_norm_bias,
                       *vectors[7])) {
      return;
    }
    if (has_next && !ReadProjection(ctx, "next_blocks", next_types_, d, &next)) return;
    OP_REQUIRES(ctx, IsVectorOrEmpty(*vectors[7], next.n),
                InvalidArgument("next_bias must be [", next.n, "] or empty, got ",
                                vectors[7]->shape().DebugString()));
    Tensor* y_tensor = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({m, d}), &y_tensor));
    Tensor* next_tensor = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({m, next.n}), &next_tensor));
    if (m == 0 || d == 0) return;
    OP_REQUIRES(ctx, attn.dim_size(1) > 0 && inner > 0,
                InvalidArgument("out's K and up's width must be positive"));

    const float *out_bias = Data(*vectors[0]), *norm_scale = Data(*vectors[1]),
                *norm_bias = Data(*vectors[2]), *up_bias = Data(*vectors[3]),
                *down_bias = Data(*vectors[4]), *post_attn = Data(*vectors[5]),
                *post_mlp = Data(*vectors[6]);
    auto* pool = WorkerPool(ctx);
    float* y = y_tensor->flat<float>().data();
    const float* xp = x.flat<float>().data();
    std::vector<float> z(m * std::max({d, up.n, next.n})), x1(m * d), h(m * d), u(m * inner);
    // x1 = attn @ out.T + out_bias + x, or x + post_attn(attn @ out.T + out_bias)
    Multiply(pool, out, attn.flat<float>().data(), m, attn.dim_size(1), z.data());
    AddBranch(m, d, z.data(), out_bias, post_attn, xp, x1.data());
    for (int64 r = 0; r < m; ++r) {  // h = norm(x1)
      rowops::NormRow(avx2_, d, x1.data() + r * d, norm_scale, norm_bias, eps_, h.data() + r * d);
    }
    // u = act(h @ up.T + up_bias)
    Multiply(pool, up, h.data(), m, d, z.data());
    rowops::FinishRows(avx2_, m, up.n, inner, act_, z.data(), up_bias, nullptr, u.data());
    // y = u @ down.T + down_bias + x1, or x1 + post_mlp(...)
    Multiply(pool, down, u.data(), m, inner, z.data());
    AddBranch(m, d, z.data(), down_bias, post_mlp, x1.data(), y);
    if (has_next) {  // next = next_norm(y) @ next.T + next_bias, into h as the norm's rows
      for (int64 r = 0; r < m; ++r) {
        rowops::NormRow(avx2_, d, y + r * d, Data(*next_norm_scale), Data(*next_norm_bias),
                        eps_, h.data() + r * d);
      }
      Multiply(pool, next, h.data(), m, d, z.data());
      rowops::FinishRows(avx2_, m, next.n, next.n, rowops::Activation::kNone, z.data(),
                         Data(*vectors[7]), nullptr, next_tensor->flat<float>().data());
    }
  }

 private:
  // z [m, p.n] = x [m, k] @ p.T, part by part into its columns.
  void Multiply(tensorflow::thread::ThreadPool* pool, const Projection& p, const float* x,
                int64 m, int64 k, float* z) const {
    int64 column = 0;
    for (size_t i = 0; i < p.parts.size(); ++i) {
      const Tensor& part = *p.parts[i];
      const Geometry g{m, k, part.dim_size(0), part.dim_size(1), p.n};
      GgufMatmulRows(pool, isa_, p.types[i], g, x, part.flat<uint8_t>().data(), z + column);
      column += g.N;
    }
  }

  // out [m, d] = residual + (z + bias), or residual + post_norm(z + bias) with a post-norm:
  // the separate ops' epilogue, and for post-norms their epilogue, norm and add.
  void AddBranch(int64 m, int64 d, float* z, const float* bias, const float* post_norm,
                 const float* residual, float* out) const {
    if (post_norm == nullptr) {
      rowops::FinishRows(avx2_, m, d, d, rowops::Activation::kNone, z, bias, residual, out);
      return;
    }
    rowops::FinishRows(avx2_, m, d, d, rowops::Activation::kNone, z, bias, nullptr, out);
    for (int64 r = 0; r < m; ++r) {
      float* row = out + r * d;
      rowops::NormRow(avx2_, d, row, post_norm, nullptr, eps_, row);
      const float* res = residual + r * d;
      for (int64 j = 0; j < d; ++j) row[j] += res[j];
    }
  }

  rowops::Activation act_ = rowops::Activation::kGeluTanh;
  float eps_ = 1e-5f;
  std::vector<std::string> out_types_, up_types_, down_types_, next_types_;
  Isa isa_ = Isa::kScalar;
  bool avx2_ = false;
};

REGISTER_KERNEL_BUILDER(Name("TokenserveGgufFinishBlock").Device(DEVICE_CPU),
                        GgufFinishBlockOp);

}  // namespace tokenserve
