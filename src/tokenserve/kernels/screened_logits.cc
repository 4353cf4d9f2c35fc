// TokenserveScreenedLogits: the LM head's screen (engine/step/head.py) as one op: the
// products of x with the head's float16 or int8 copy (head_screen_rows.h), the bounds, and
// the exact logits of the candidates from the head as the model holds it (float32, or
// bfloat16 widened exactly); with per-row noise, the argmax of logits + noise (a sampled
// row's Gumbel draw) instead of the argmax of the logits.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "chunks.h"
#include "head_screen_rows.h"
#include "op_support.h"

namespace tokenserve {

// The whole screened head in one op (engine/step/head.py has the math): the screen's
// products with the bias, per row of x the best lower bound (floor), then the float32
// logit of every entry whose upper bound reaches it. As TF ops that was nine more ops over
// [M, vocab] (norm, bound, max, compare, where, two gathers, a product, a scatter), about
// 0.9 ms of a 2.6 ms GPT-2-small head at one row.
//
// With noise [M, N] (an empty tensor for none), the op screens the argmax of logits + noise
// instead, and returns logits + noise: the same bounds hold for each entry, since the noise
// is exact; the one addition's float32 rounding is covered by two units in the last place
// of the sum on each side (NoiseSlack). A sampled row's Gumbel noise makes that argmax its
// draw (engine/sampler/draw.py), and a greedy row's noise row is zeros.
REGISTER_OP("TokenserveScreenedLogits")
    .Input("x: float")          // [M, K]: the final norm's output
    .Input("screen: T")         // [N, K]: the head's float16 or int8 copy
    .Input("scale: float")      // [N] for int8 (one per row), [0] for float16
    .Input("row_bound: float")  // [N]: r_i, the bound on |(w_i - h_i) . x| / ||x||
    .Input("weight: Tw")        // the head: [N, K] ("nk") or [K, N] ("kn")
    .Input("bias: float")       // [N], or [0] for none
    .Input("noise: float")      // [M, N], or empty for none: added to the logits
    .Output("logits: float")    // [M, N]
    .Attr("T: {half, int8}")
    .Attr("Tw: {float, bfloat16} = DT_FLOAT")  // a bfloat16 model's head, widened exactly
    .Attr("layout: {'nk', 'kn'} = 'nk'")
    .Attr("isa: {'auto', 'scalar'} = 'auto'")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle x, screen;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &x));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &screen));
      DimensionHandle k;
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(x, 1), c->Dim(screen, 1), &k));
      c->set_output(0, c->Matrix(c->Dim(x, 0), c->Dim(screen, 0)));
      return absl::OkStatus();
    });

// The float32 rounding of an entry's logit + noise, on each side of the screen: two units in
// the last place of the sum (2^-22 of it; rounding is at most half a unit, and the exact
// recomputation is rounded once more).
inline float NoiseSlack(float sum) { return std::fabs(sum) * 0x1p-22f; }

// W: the screen's type (Half or int8_t); V: the head's (float, or BFloat16 for a bfloat16
// model, whose logits the fused dense op computes in float32 from the widened weights)
template <typename W, typename V>
class ScreenedLogitsOp : public OpKernel {
 public:
  explicit ScreenedLogitsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    avx2_ = UsesAvx2<W>(StringAttr(ctx, "isa"));
    kn_ = StringAttr(ctx, "layout") == "kn";
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& screen = ctx->input(1);
    const Tensor& scale = ctx->input(2);
    const Tensor& row_bound = ctx->input(3);
    const Tensor& weight = ctx->input(4);
    const Tensor& bias = ctx->input(5);
    const Tensor& noise = ctx->input(6);
    OP_REQUIRES(ctx, x.dims() == 2 && screen.dims() == 2 && weight.dims() == 2,
                InvalidArgument("x, screen and weight must be matrices, got ",
                                x.shape().DebugString(), ", ", screen.shape().DebugString(),
                                " and ", weight.shape().DebugString()));
    const Geometry g{x.dim_size(0), x.dim_size(1), screen.dim_size(0)};
    const int64 want_rows = kn_ ? g.K : g.N, want_cols = kn_ ? g.N : g.K;
    OP_REQUIRES(ctx, screen.dim_size(1) == g.K && weight.dim_size(0) == want_rows &&
                         weight.dim_size(1) == want_cols,
                InvalidArgument("x is [M, K] with K = ", g.K, ", screen ",
                                screen.shape().DebugString(), ", weight ",
                                weight.shape().DebugString(), ": expected screen [N, K] and ",
                                "weight ", kn_ ? "[K, N]" : "[N, K]"));
    const bool int8 = std::is_same<W, int8_t>::value;
    OP_REQUIRES(ctx, row_bound.dims() == 1 && row_bound.dim_size(0) == g.N &&
                         scale.dims() == 1 && scale.dim_size(0) == (int8 ? g.N : 0) &&
                         bias.dims() == 1 && (bias.dim_size(0) == g.N || bias.dim_size(0) == 0),
                InvalidArgument("with N = ", g.N, ": row_bound must be [N], scale [",
                                int8 ? "N" : "0", "] and bias [N] or [0], got ",
                                row_bound.shape().DebugString(), ", ",
                                scale.shape().DebugString(), " and ",
                                bias.shape().DebugString()));
    const bool noisy = noise.NumElements() > 0;
    OP_REQUIRES(ctx, !noisy || (noise.dims() == 2 && noise.dim_size(0) == g.M &&
                                noise.dim_size(1) == g.N),
                InvalidArgument("noise must be [M, N] = [", g.M, ", ", g.N,
                                "] or empty, got ", noise.shape().DebugString()));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({g.M, g.N}), &out));
    if (g.M == 0 || g.N == 0) return;
    const float* zp = noisy ? noise.flat<float>().data() : nullptr;
    const float* xp = x.flat<float>().data();
    const W* sp = screen.flat<W>().data();
    const float* scp = int8 ? scale.flat<float>().data() : nullptr;
    const float* rb = row_bound.flat<float>().data();
    const V* wp = weight.flat<V>().data();
    const float* bp = bias.dim_size(0) ? bias.flat<float>().data() : nullptr;
    float* y = out->flat<float>().data();
    // ||x|| per row, in double: the bound's scale (the 1.0001 margin of row_bound covers the
    // float32 rounding of the products below)
    std::vector<double> norms(g.M);
    for (int64 m = 0; m < g.M; ++m) {
      double sum = 0;
      for (int64 k = 0; k < g.K; ++k) sum += double(xp[m * g.K + k]) * xp[m * g.K + k];
      norms[m] = std::sqrt(sum);
    }
    auto bound = [&](int64 m, int64 n) { return static_cast<float>(norms[m] * rb[n]); };
    // with noise: the bound plus the rounding of the addition (NoiseSlack)
    auto reach = [&](int64 m, int64 n, float value) {
      return zp != nullptr ? bound(m, n) + NoiseSlack(value) : bound(m, n);
    };
    auto* pool = WorkerPool(ctx);
    const int64 workers = std::max(1, pool->NumThreads());
    const int64 tiles = (g.N + kTileRows - 1) / kTileRows;
    const float kNone = -std::numeric_limits<float>::infinity();
    // 1. the screen's logits and, per tile and row of x, the best lower bound (a NaN never
    // counts: x with a NaN leaves every entry NaN, as the float32 head would)
    std::vector<float> tile_floor(tiles * g.M, kNone);
    const bool avx2 = avx2_;
    RunRanges(pool, workers, tiles, [&](int64 tile, int64, int64 next) {
      const int64 n0 = tile * kTileRows, n1 = std::min(g.N, n0 + kTileRows);
      if (g.K == 0) {
        for (int64 m = 0; m < g.M; ++m) std::fill(y + m * g.N + n0, y + m * g.N + n1, 0.f);
      } else {
        ProductTile<W>(avx2, g, xp, sp, scp, n0, n1, sp + StreamEnd(g, tile, next) * g.K, y);
      }
      for (int64 m = 0; m < g.M; ++m) {
        float* ym = y + m * g.N;
        float best = kNone;
        const float* zm = zp != nullptr ? zp + m * g.N : nullptr;
        for (int64 n = n0; n < n1; ++n) {
          if (bp != nullptr) ym[n] += bp[n];
          if (zm != nullptr) ym[n] += zm[n];
          const float low = ym[n] - reach(m, n, ym[n]);
          if (low > best) best = low;
        }
        tile_floor[tile * g.M + m] = best;
      }
    });
    std::vector<float> floor(g.M, kNone);
    for (int64 t = 0; t < tiles; ++t) {
      for (int64 m = 0; m < g.M; ++m) floor[m] = std::max(floor[m], tile_floor[t * g.M + m]);
    }
    // 2. every entry that could be the argmax: its float32 logit, from the head's row
    // (widened to float32 if bfloat16, summed in double, then rounded once)
    RunChunks(pool, workers, tiles, [&](int64 tile, int64) {
      const int64 n0 = tile * kTileRows, n1 = std::min(g.N, n0 + kTileRows);
      for (int64 m = 0; m < g.M; ++m) {
        float* ym = y + m * g.N;
        const float* xm = xp + m * g.K;
        for (int64 n = n0; n < n1; ++n) {
          if (!(ym[n] + reach(m, n, ym[n]) >= floor[m])) continue;
          double sum = 0;
          if (kn_) {
            for (int64 k = 0; k < g.K; ++k) sum += double(ToFloat(wp[k * g.N + n])) * xm[k];
          } else {
            const V* wn = wp + n * g.K;
            for (int64 k = 0; k < g.K; ++k) sum += double(ToFloat(wn[k])) * xm[k];
          }
          ym[n] = static_cast<float>(sum) + (bp != nullptr ? bp[n] : 0.f);
          if (zp != nullptr) ym[n] += zp[m * g.N + n];
        }
      }
    });
  }

 private:
  bool avx2_ = false, kn_ = false;
};

#define TOKENSERVE_SCREENED_LOGITS(W, V)                                          \
  REGISTER_KERNEL_BUILDER(Name("TokenserveScreenedLogits")                        \
                              .Device(DEVICE_CPU)                                 \
                              .TypeConstraint<W>("T")                             \
                              .TypeConstraint<V>("Tw"),                           \
                          ScreenedLogitsOp<W, V>);
TOKENSERVE_SCREENED_LOGITS(Half, float)
TOKENSERVE_SCREENED_LOGITS(int8_t, float)
TOKENSERVE_SCREENED_LOGITS(Half, BFloat16)
TOKENSERVE_SCREENED_LOGITS(int8_t, BFloat16)
#undef TOKENSERVE_SCREENED_LOGITS

}  // namespace tokenserve
