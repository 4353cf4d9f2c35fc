// The LM head screen's matmuls (engine/screened_head.py), on the CPU, x float32 and the
// sums float32, w output-major (each output's K weights contiguous, a tied embedding's
// layout "nk"):
//
//   TokenserveHalfMatmul      y[M, N] = x[M, K] @ w[N, K].T, w float16
//   TokenserveInt8RowMatmul   y[M, N] = (x[M, K] @ q[N, K].T) * scale[N], q int8, one
//                             float32 scale per row (per output)
//   TokenserveScreenedLogits  the whole screened head: one of those products, the bounds,
//                             and the exact logits of the candidates from the head as the
//                             model holds it (float32, or bfloat16 widened exactly); with
//                             per-row noise, the argmax of logits + noise (a sampled row's
//                             Gumbel draw) instead of the argmax of the logits
//
// A greedy decode step of a few sequences reads one of these copies of the head (half or a
// quarter of the float32 head's bytes) and needs its products only to rule tokens out, so
// x stays float32: no activation quantization, whose error would widen the screen (the
// int8 weights op, int8_matmul.cc, quantizes x per block of 32, and that made thousands of
// candidates a row on SmolLM2).
//
// Work split: weight rows in tiles of kTileRows, a contiguous range of them for the calling
// thread and for each of TF's intra-op threads (RunRanges in chunks.h). Each weight row is
// read once, front to back, a single sequential stream software-prefetched kRowPrefetch
// bytes ahead into L1 and kRowPrefetchL2 into L2, and each 8 weights of it
// become floats (float16: one F16C instruction, vcvtph2ps; int8: a sign extension and a
// conversion) that feed up to four rows of x. On a 2-core AVX2-only EPYC, against four
// weight rows interleaved (as dense.cc's "nk" float32 kernel), one row at a time took
// 4.4 / 4.7 / 7.3 ms for GPT-2-small's float16 head [50257, 768] at 1 / 4 / 8 rows of x,
// against 4.9 / 6.3 / 9.0; the float32 head 7.2-8.9 ms at one row.
// Two paths with the same math: AVX2+FMA (+F16C for float16; functions with target
// attributes, chosen at run time) and portable scalar C++ (also forced with isa="scalar"
// for tests).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TOKENSERVE_X86 1
#endif

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/platform/threadpool.h"
#include "chunks.h"
#include "cpu.h"

namespace tokenserve {
namespace {

using tensorflow::DEVICE_CPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::errors::InvalidArgument;
using tensorflow::shape_inference::DimensionHandle;
using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;
using int64 = int64_t;
using Half = Eigen::half;
using BFloat16 = Eigen::bfloat16;

constexpr int64 kTileRows = 256;     // weight rows per work item

struct Geometry {
  int64 M, K, N;  // x [M, K], w [N, K], y [M, N]
};

inline float ToFloat(Half w) { return static_cast<float>(w); }
inline float ToFloat(int8_t w) { return static_cast<float>(w); }
inline float ToFloat(float w) { return w; }
// bfloat16's bits are a float32's upper half: widening is exact
inline float ToFloat(BFloat16 w) { return static_cast<float>(w); }

// scale: one per weight row, or nullptr (1)
template <typename W>
void TileScalar(const Geometry& g, const float* x, const W* w, const float* scale, int64 n0,
                int64 n1, float* y) {
  for (int64 n = n0; n < n1; ++n) {
    const W* wn = w + n * g.K;
    for (int64 r = 0; r < g.M; ++r) {
      const float* xr = x + r * g.K;
      float sum = 0.f;
      for (int64 k = 0; k < g.K; ++k) sum += ToFloat(wn[k]) * xr[k];
      y[r * g.N + n] = scale == nullptr ? sum : sum * scale[n];
    }
  }
}

#ifdef TOKENSERVE_X86
#define AVX2_FN __attribute__((target("avx2,fma,f16c")))

AVX2_FN inline __m256 Load8(const Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
AVX2_FN inline __m256 Load8(const int8_t* p) {
  const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
}

// One weight row at a time, a single sequential stream, prefetched kRowPrefetch bytes
// ahead; each 8 weights of it, once converted, feed R rows of x.
constexpr int64 kRowPrefetch = 1024;
// The stream is also prefetched into L2, whole weight rows about this many bytes ahead, up
// to the end of what the worker reads next. GPT-2-small's int8 screen [50257, 768] alone at
// one row of x (TokenserveInt8RowMatmul; 2-core Zen 5, AVX2 code, alternating processes,
// 3 rounds): 1.40-1.76 -> 1.27-1.32 ms. In the float32 engine step the screen is about a
// tenth of the time, and one sequence measured 0.99x (0.97-1.01, 5 rounds): within noise.
constexpr int64 kRowPrefetchL2 = 32768;

// far: the row kRowPrefetchL2 bytes ahead, prefetched into L2 a line for each line of this
// one (nullptr: none)
template <typename W, int R>
AVX2_FN inline void RowAvx2(const Geometry& g, const float* x, const W* wn, float scale,
                            float* y, const char* far) {
  // U accumulators per row of x: FMA latency (4-5 cycles) would otherwise hold one or two
  // rows of x to a few bytes of weights per cycle
  constexpr int U = R <= 2 ? 4 : 2;
  constexpr int64 kPerLine = 64 / sizeof(W);  // weights per cache line: one prefetch each
  const int64 vec = g.K / (8 * U) * (8 * U);
  __m256 s[R][U];
  for (int r = 0; r < R; ++r) {
    for (int u = 0; u < U; ++u) s[r][u] = _mm256_setzero_ps();
  }
  const char* ahead = reinterpret_cast<const char*>(wn) + kRowPrefetch;
  int64 k = 0;
  for (; k < vec; k += 8 * U) {
    for (int u = 0; u < U; ++u) {
      if (((k + 8 * u) & (kPerLine - 1)) == 0) {
        _mm_prefetch(ahead + sizeof(W) * (k + 8 * u), _MM_HINT_T0);
        if (far != nullptr) _mm_prefetch(far + sizeof(W) * (k + 8 * u), _MM_HINT_T1);
      }
    }
    __m256 wv[U];
    for (int u = 0; u < U; ++u) wv[u] = Load8(wn + k + 8 * u);
    for (int r = 0; r < R; ++r) {
      for (int u = 0; u < U; ++u) {
        s[r][u] = _mm256_fmadd_ps(wv[u], _mm256_loadu_ps(x + r * g.K + k + 8 * u), s[r][u]);
      }
    }
  }
  const int64 issued = (vec * static_cast<int64>(sizeof(W)) + 63) / 64 * 64;
  if (far != nullptr) {  // the lines past the vector loop's
    cpu::PrefetchL2(far + issued, g.K * static_cast<int64>(sizeof(W)) - issued);
  }
  for (int r = 0; r < R; ++r) {
    __m256 total = s[r][0];
    for (int u = 1; u < U; ++u) total = _mm256_add_ps(total, s[r][u]);
    float sum = cpu::HorizontalSum(total);
    for (int64 kk = k; kk < g.K; ++kk) sum += ToFloat(wn[kk]) * x[r * g.K + kk];
    y[r * g.N] = sum * scale;  // a scale of 1 (float16) leaves the sum as it is
  }
}

template <typename W>
AVX2_FN void TileAvx2(const Geometry& g, const float* x, const W* w, const float* scale,
                      int64 n0, int64 n1, const W* prefetch_end, float* y) {
  const int64 row_bytes = g.K * static_cast<int64>(sizeof(W));
  const int64 rows_ahead = std::max<int64>(1, kRowPrefetchL2 / std::max<int64>(1, row_bytes));
  for (int64 n = n0; n < n1; ++n) {
    const W* wn = w + n * g.K;
    // The row rows_ahead further on, into L2: a line at a time from the first pass over
    // this row (RowAvx2), where a burst of the row's lines here had stalled on the core's
    // few line-fill buffers (a third of this function's samples, float32 engine step).
    const W* far_row = wn + rows_ahead * g.K;
    const char* far = far_row + g.K <= prefetch_end ? reinterpret_cast<const char*>(far_row)
                                                    : nullptr;
    const float sn = scale == nullptr ? 1.f : scale[n];
    for (int64 r = 0; r < g.M; r += 4) {
      const float* xr = x + r * g.K;
      float* yr = y + r * g.N + n;
      const char* f = r == 0 ? far : nullptr;
      switch (std::min<int64>(4, g.M - r)) {
        case 1: RowAvx2<W, 1>(g, xr, wn, sn, yr, f); break;
        case 2: RowAvx2<W, 2>(g, xr, wn, sn, yr, f); break;
        case 3: RowAvx2<W, 3>(g, xr, wn, sn, yr, f); break;
        default: RowAvx2<W, 4>(g, xr, wn, sn, yr, f); break;
      }
    }
  }
}

#undef AVX2_FN
#endif  // TOKENSERVE_X86

// y[:, n0:n1] = x @ w[n0:n1].T (times scale, if any): the AVX2 path where `avx2`, else the
// scalar one (both ops' products, tile by tile)
template <typename W>
void ProductTile(bool avx2, const Geometry& g, const float* x, const W* w, const float* scale,
                 int64 n0, int64 n1, const W* prefetch_end, float* y) {
#ifdef TOKENSERVE_X86
  if (avx2) return TileAvx2<W>(g, x, w, scale, n0, n1, prefetch_end, y);
#endif
  TileScalar<W>(g, x, w, scale, n0, n1, y);
}

// The weight row where a worker's stream stops after `tile` (RunRanges).
int64 StreamEnd(const Geometry& g, int64 tile, int64 next) {
  return std::min(g.N, RangeStreamEnd(tile, next) * kTileRows);
}

// Whether an op with this isa attribute takes the AVX2 path here: float16 needs F16C too
template <typename W>
bool UsesAvx2(const std::string& isa) {
  return isa == "auto" &&
         (std::is_same<W, Half>::value ? cpu::HasAvx2FmaF16c() : cpu::HasAvx2Fma());
}

}  // namespace

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

// The whole screened head in one op (engine/screened_head.py has the math): the screen's
// products with the bias, per row of x the best lower bound (floor), then the float32
// logit of every entry whose upper bound reaches it. As TF ops that was nine more ops over
// [M, vocab] (norm, bound, max, compare, where, two gathers, a product, a scatter), about
// 0.9 ms of a 2.6 ms GPT-2-small head at one row.
//
// With noise [M, N] (an empty tensor for none), the op screens the argmax of logits + noise
// instead, and returns logits + noise: the same bounds hold for each entry, since the noise
// is exact; the one addition's float32 rounding is covered by two units in the last place
// of the sum on each side (NoiseSlack). A sampled row's Gumbel noise makes that argmax its
// draw (engine/sampler.py), and a greedy row's noise row is zeros.
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

REGISTER_OP("TokenserveHalfMatmulInfo")
    .Output("isa: string")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Scalar());
      return absl::OkStatus();
    });

// W: Half (TokenserveHalfMatmul) or int8_t (TokenserveInt8RowMatmul, with a scale input)
template <typename W>
class RowMatmulOp : public OpKernel {
 public:
  explicit RowMatmulOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string isa;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("isa", &isa));
    avx2_ = UsesAvx2<W>(isa);
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
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
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
    std::string isa, layout;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("isa", &isa));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("layout", &layout));
    avx2_ = UsesAvx2<W>(isa);
    kn_ = layout == "kn";
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
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
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

class HalfMatmulInfoOp : public OpKernel {
 public:
  explicit HalfMatmulInfoOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  void Compute(OpKernelContext* ctx) override {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<tensorflow::tstring>()() =
        cpu::HasAvx2FmaF16c() ? "AVX2+FMA+F16C" : "scalar (no AVX2+FMA+F16C)";
  }
};

REGISTER_KERNEL_BUILDER(Name("TokenserveHalfMatmul").Device(DEVICE_CPU), RowMatmulOp<Half>);
REGISTER_KERNEL_BUILDER(Name("TokenserveInt8RowMatmul").Device(DEVICE_CPU),
                        RowMatmulOp<int8_t>);
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
REGISTER_KERNEL_BUILDER(Name("TokenserveHalfMatmulInfo").Device(DEVICE_CPU), HalfMatmulInfoOp);

}  // namespace tokenserve
