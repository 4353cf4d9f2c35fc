// TokenserveMoeExperts: a mixture of experts' routed MLPs for one step's rows, grouped by
// expert: y = residual + sum_j gates[:, j] * expert_{ids[:, j]}(x), and counts [N], the rows
// each expert ran on (the step's expert load, from the grouping itself).
//
//   x [M, D] float32 rows; expert_ids [M, k] int32 and gates [M, k] float32 (the router's
//   choice, computed before the op); residual [M, D] or [0, 0]; up: N matrices [D, 2 F_e]
//   (SwiGLU's gate and up halves side by side), down: N matrices [F_e, D], float32 or
//   bfloat16 (attribute T, widened as they are read).
//
// The (row, expert) pairs are sorted by expert (a counting sort), then each expert with rows
// runs once: its rows gathered into a block, the up matrix with SwiGLU, the down matrix
// (TokenserveDense's ComputeDense, dense_compute.h, with its work split between threads),
// and each product row added into its row of y, scaled by its gate. An expert no row chose is
// never touched: the bytes a step reads are the active experts' (a decode step of one row
// with top-2 of 8 reads a quarter of the experts). Within a row, experts add in ascending
// index order.

#include <cstdint>
#include <cstring>
#include <vector>

#include "dense_args.h"
#include "dense_compute.h"
#include "op_support.h"

namespace tokenserve {

using tensorflow::OpInputList;

REGISTER_OP("TokenserveMoeExperts")
    .Input("x: float")            // [M, D]
    .Input("expert_ids: int32")   // [M, k], each in [0, N)
    .Input("gates: float")        // [M, k]
    .Input("residual: float")     // [M, D] or [0, 0]
    .Input("up: N * T")           // N x [D, 2 F_e]
    .Input("down: N * T")         // N x [F_e, D]
    .Output("y: float")           // [M, D]
    .Output("counts: int32")      // [N] rows each expert ran on (the step's expert load)
    .Attr("N: int >= 1")
    .Attr("T: {float, bfloat16} = DT_FLOAT")
    .Attr("isa: {'auto', 'scalar'} = 'auto'")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle x;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &x));
      c->set_output(0, x);
      int n;
      TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
      c->set_output(1, c->Vector(n));
      return absl::OkStatus();
    })
    .Doc("y = residual + sum_j gates[:, j] * swiglu_mlp_{expert_ids[:, j]}(x), grouped by "
         "expert: an expert without rows is not read.");

REGISTER_OP("TokenserveMoeInfo")
    .Output("info: string")
    .SetShapeFn(tensorflow::shape_inference::ScalarShape)
    .Doc("Which instruction set the TokenserveMoeExperts kernels use here.");

class MoeExpertsOp : public OpKernel {
 public:
  explicit MoeExpertsOp(OpKernelConstruction* ctx) : OpKernel(ctx) { avx2_ = Avx2Attr(ctx); }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& ids = ctx->input(1);
    const Tensor& gates = ctx->input(2);
    const Tensor& residual = ctx->input(3);
    OpInputList up, down;
    OP_REQUIRES_OK(ctx, ctx->input_list("up", &up));
    OP_REQUIRES_OK(ctx, ctx->input_list("down", &down));
    OP_REQUIRES(ctx, x.dims() == 2, InvalidArgument("x must be [M, D], got ",
                                                    x.shape().DebugString()));
    const int64 m = x.dim_size(0), d = x.dim_size(1), n = up.size();
    OP_REQUIRES(ctx, ids.dims() == 2 && ids.dim_size(0) == m && ids.dim_size(1) > 0,
                InvalidArgument("expert_ids must be [M, k] with M = ", m, ", got ",
                                ids.shape().DebugString()));
    const int64 k = ids.dim_size(1);
    OP_REQUIRES(ctx, IsMatrix(gates, m, k),
                InvalidArgument("gates must be [", m, ", ", k, "], got ",
                                gates.shape().DebugString()));
    OP_REQUIRES(ctx, residual.NumElements() == 0 || IsMatrix(residual, m, d),
                InvalidArgument("residual must be [", m, ", ", d, "] or empty, got ",
                                residual.shape().DebugString()));
    for (int64 e = 0; e < n; ++e) {
      OP_REQUIRES(ctx, up[e].dims() == 2 && up[e].dim_size(0) == d && up[e].dim_size(1) > 0 &&
                           up[e].dim_size(1) % 2 == 0,
                  InvalidArgument("up[", e, "] must be [D, 2F] with D = ", d, ", got ",
                                  up[e].shape().DebugString()));
      OP_REQUIRES(ctx, IsMatrix(down[e], up[e].dim_size(1) / 2, d),
                  InvalidArgument("down[", e, "] must be [", up[e].dim_size(1) / 2, ", ", d,
                                  "], got ", down[e].shape().DebugString()));
    }
    // the (row, expert) pairs by expert: pair p = row * k + j
    const int32_t* id = ids.flat<int32_t>().data();
    std::vector<int64> start(n + 1, 0);
    for (int64 p = 0; p < m * k; ++p) {
      OP_REQUIRES(ctx, id[p] >= 0 && id[p] < n,
                  InvalidArgument("expert_ids[", p / k, ", ", p % k, "] = ", id[p],
                                  " is outside [0, ", n, ")"));
      ++start[id[p] + 1];
    }
    for (int64 e = 0; e < n; ++e) start[e + 1] += start[e];
    std::vector<int64> pairs(m * k), next(start.begin(), start.end() - 1);
    for (int64 p = 0; p < m * k; ++p) pairs[next[id[p]]++] = p;

    Tensor* counts = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n}), &counts));
    for (int64 e = 0; e < n; ++e) counts->flat<int32_t>()(e) = start[e + 1] - start[e];
    Tensor* y_tensor = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({m, d}), &y_tensor));
    float* y = y_tensor->flat<float>().data();
    if (residual.NumElements()) {
      std::memcpy(y, residual.flat<float>().data(), m * d * sizeof(float));
    } else {
      std::fill(y, y + m * d, 0.f);
    }
    if (m == 0 || d == 0) return;
    const bool bf16 = up[0].dtype() == tensorflow::DT_BFLOAT16;
    Scratch scratch;  // per call: TF may run one kernel's Compute on two threads at once
    for (int64 e = 0; e < n; ++e) {
      if (start[e + 1] == start[e]) continue;  // no rows: never read
      if (bf16) {
        RunExpert<bfloat16>(ctx, x, gates, up[e], down[e], pairs.data() + start[e],
                            start[e + 1] - start[e], k, y, scratch);
      } else {
        RunExpert<float>(ctx, x, gates, up[e], down[e], pairs.data() + start[e],
                         start[e + 1] - start[e], k, y, scratch);
      }
    }
  }

 private:
  struct Scratch {
    std::vector<float> rows, hidden, product;  // [count, D], [count, F], [count, D]
  };

  // One expert on its `count` pairs: gather their rows, up with SwiGLU, down, add each
  // product row into y scaled by its gate.
  template <typename W>
  void RunExpert(OpKernelContext* ctx, const Tensor& x, const Tensor& gates, const Tensor& up,
                 const Tensor& down, const int64* pairs, int64 count, int64 k, float* y,
                 Scratch& s) {
    const int64 d = x.dim_size(1), f2 = up.dim_size(1), f = f2 / 2;
    const float* xp = x.flat<float>().data();
    const float* gp = gates.flat<float>().data();
    s.rows.resize(count * d);
    s.hidden.resize(count * f);
    s.product.resize(count * d);
    for (int64 i = 0; i < count; ++i) {
      std::memcpy(s.rows.data() + i * d, xp + pairs[i] / k * d, d * sizeof(float));
    }
    auto* pool = WorkerPool(ctx);
    ComputeDense<W>({count, d, f2, f}, {s.rows.data(), up.flat<W>().data(), nullptr, nullptr,
                                        s.hidden.data(), Activation::kSwiglu},
                    true, pool, avx2_);
    ComputeDense<W>({count, f, d, d}, {s.hidden.data(), down.flat<W>().data(), nullptr, nullptr,
                                       s.product.data(), Activation::kNone},
                    true, pool, avx2_);
    for (int64 i = 0; i < count; ++i) {
      const float gate = gp[pairs[i]];
      float* out = y + pairs[i] / k * d;
      const float* z = s.product.data() + i * d;
      for (int64 c = 0; c < d; ++c) out[c] += gate * z[c];
    }
  }

  bool avx2_ = false;
};

namespace {

const char* MoeIsa() { return cpu::HasAvx2Fma() ? "AVX2+FMA" : "scalar (no AVX2+FMA)"; }

}  // namespace

REGISTER_KERNEL_BUILDER(Name("TokenserveMoeExperts").Device(DEVICE_CPU), MoeExpertsOp);
REGISTER_KERNEL_BUILDER(Name("TokenserveMoeInfo").Device(DEVICE_CPU), IsaInfoOp<MoeIsa>);

}  // namespace tokenserve
