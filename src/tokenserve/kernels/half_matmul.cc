// TokenserveHalfMatmul: y[M, N] = x[M, K] @ w[N, K].T with w stored as float16, on the CPU.
//
// Built for the LM head's screen (engine/screened_head.py): a greedy decode step of a few
// sequences reads a float16 copy of the head, half the bytes of the float32 one, and needs
// its products only to rule tokens out, so x stays float32 (no activation quantization, whose
// error would widen the screen) and the sums are float32. w is output-major, each output's
// K weights contiguous (a tied embedding's layout, "nk").
//
// Work split: weight rows in tiles of kTileRows, taken by the calling thread and TF's
// intra-op threads (chunks.h). Each weight row is read once, front to back, a single
// sequential stream software-prefetched kRowPrefetch bytes ahead, and each 8 halves of it
// become floats with one F16C instruction (vcvtph2ps) that feed up to four rows of x. On a
// 2-core AVX2-only EPYC, against four weight rows interleaved (as dense.cc's "nk" float32
// kernel), one row at a time took 4.4 / 4.7 / 7.3 ms for GPT-2-small's head [50257, 768] at
// 1 / 4 / 8 rows of x, against 4.9 / 6.3 / 9.0; the float32 head 7.2-8.9 ms at one row.
// Two paths with the same math: AVX2+FMA+F16C (functions with target attributes, chosen at
// run time) and portable scalar C++ (also forced with isa="scalar" for tests).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

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

constexpr int64 kTileRows = 256;     // weight rows per work item

struct Geometry {
  int64 M, K, N;  // x [M, K], w [N, K], y [M, N]
};

void TileScalar(const Geometry& g, const float* x, const Half* w, int64 n0, int64 n1,
                float* y) {
  for (int64 n = n0; n < n1; ++n) {
    const Half* wn = w + n * g.K;
    for (int64 r = 0; r < g.M; ++r) {
      const float* xr = x + r * g.K;
      float sum = 0.f;
      for (int64 k = 0; k < g.K; ++k) sum += static_cast<float>(wn[k]) * xr[k];
      y[r * g.N + n] = sum;
    }
  }
}

#ifdef TOKENSERVE_X86
#define AVX2_FN __attribute__((target("avx2,fma,f16c")))

AVX2_FN inline __m256 Load8(const Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// One weight row at a time, a single sequential stream, prefetched kRowPrefetch bytes
// ahead; each 8 halves of it, once converted, feed R rows of x.
constexpr int64 kRowPrefetch = 1024;

template <int R>
AVX2_FN inline void RowAvx2(const Geometry& g, const float* x, const Half* wn, float* y) {
  // U accumulators per row of x: FMA latency (4-5 cycles) would otherwise hold one or two
  // rows of x to a few bytes of weights per cycle
  constexpr int U = R <= 2 ? 4 : 2;
  const int64 vec = g.K / (8 * U) * (8 * U);
  __m256 s[R][U];
  for (int r = 0; r < R; ++r) {
    for (int u = 0; u < U; ++u) s[r][u] = _mm256_setzero_ps();
  }
  const char* ahead = reinterpret_cast<const char*>(wn) + kRowPrefetch;
  int64 k = 0;
  for (; k < vec; k += 8 * U) {
    for (int u = 0; u < U; u += 2) {
      if (((k + 8 * u) & 31) == 0) _mm_prefetch(ahead + 2 * (k + 8 * u), _MM_HINT_T0);
    }
    __m256 wv[U];
    for (int u = 0; u < U; ++u) wv[u] = Load8(wn + k + 8 * u);
    for (int r = 0; r < R; ++r) {
      for (int u = 0; u < U; ++u) {
        s[r][u] = _mm256_fmadd_ps(wv[u], _mm256_loadu_ps(x + r * g.K + k + 8 * u), s[r][u]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 total = s[r][0];
    for (int u = 1; u < U; ++u) total = _mm256_add_ps(total, s[r][u]);
    float sum = cpu::HorizontalSum(total);
    for (int64 kk = k; kk < g.K; ++kk) sum += static_cast<float>(wn[kk]) * x[r * g.K + kk];
    y[r * g.N] = sum;
  }
}

AVX2_FN void TileAvx2(const Geometry& g, const float* x, const Half* w, int64 n0,
                            int64 n1, float* y) {
  for (int64 n = n0; n < n1; ++n) {
    const Half* wn = w + n * g.K;
    for (int64 r = 0; r < g.M; r += 4) {
      const float* xr = x + r * g.K;
      float* yr = y + r * g.N + n;
      switch (std::min<int64>(4, g.M - r)) {
        case 1: RowAvx2<1>(g, xr, wn, yr); break;
        case 2: RowAvx2<2>(g, xr, wn, yr); break;
        case 3: RowAvx2<3>(g, xr, wn, yr); break;
        default: RowAvx2<4>(g, xr, wn, yr); break;
      }
    }
  }
}

#undef AVX2_FN
#endif  // TOKENSERVE_X86

}  // namespace

REGISTER_OP("TokenserveHalfMatmul")
    .Input("x: float")   // [M, K]
    .Input("w: half")    // [N, K]
    .Output("y: float")  // [M, N]
    .Attr("isa: {'auto', 'scalar'} = 'auto'")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle x, w;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &x));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &w));
      DimensionHandle k;
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(x, 1), c->Dim(w, 1), &k));
      c->set_output(0, c->Matrix(c->Dim(x, 0), c->Dim(w, 0)));
      return absl::OkStatus();
    });

REGISTER_OP("TokenserveHalfMatmulInfo")
    .Output("isa: string")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Scalar());
      return absl::OkStatus();
    });

class HalfMatmulOp : public OpKernel {
 public:
  explicit HalfMatmulOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string isa;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("isa", &isa));
    avx2_ = isa == "auto" && cpu::HasAvx2FmaF16c();
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
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({g.M, g.N}), &y));
    if (g.M == 0 || g.N == 0) return;
    if (g.K == 0) {
      std::fill(y->flat<float>().data(), y->flat<float>().data() + g.M * g.N, 0.f);
      return;
    }
    const float* xp = x.flat<float>().data();
    const Half* wp = w.flat<Half>().data();
    float* yp = y->flat<float>().data();
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    const int64 tiles = (g.N + kTileRows - 1) / kTileRows;
    const bool avx2 = avx2_;
    RunChunks(pool, std::max(1, pool->NumThreads()), tiles, [&](int64 tile, int64) {
      const int64 n0 = tile * kTileRows, n1 = std::min(g.N, n0 + kTileRows);
#ifdef TOKENSERVE_X86
      if (avx2) {
        TileAvx2(g, xp, wp, n0, n1, yp);
        return;
      }
#endif
      TileScalar(g, xp, wp, n0, n1, yp);
    });
  }

 private:
  bool avx2_ = false;
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

REGISTER_KERNEL_BUILDER(Name("TokenserveHalfMatmul").Device(DEVICE_CPU), HalfMatmulOp);
REGISTER_KERNEL_BUILDER(Name("TokenserveHalfMatmulInfo").Device(DEVICE_CPU), HalfMatmulInfoOp);

}  // namespace tokenserve
