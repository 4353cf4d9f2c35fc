// The LM head screen's products y[:, n0:n1] = x @ w[n0:n1].T (times a scale per row, for
// int8), tile by tile (ProductTile): what TokenserveHalfMatmul, TokenserveInt8RowMatmul
// (head_screen.cc) and TokenserveScreenedLogits (screened_logits.cc) compute.
//
// Work split: weight rows in tiles of kTileRows, a contiguous range of them for the calling
// thread and for each of TF's intra-op threads (RunRanges in chunks.h). Each weight row is
// read once, front to back, a single sequential stream software-prefetched kRowPrefetch
// bytes ahead into L1 and kRowPrefetchL2 into L2, and each 8 weights of it
// become floats (float16: one F16C instruction, vcvtph2ps; int8: a sign extension and a
// conversion) that feed up to four rows of x. On a 2-core AVX2-only EPYC, against four
// weight rows interleaved (as dense_nk.h's "nk" float32 kernel), one row at a time took
// 4.4 / 4.7 / 7.3 ms for GPT-2-small's float16 head [50257, 768] at 1 / 4 / 8 rows of x,
// against 4.9 / 6.3 / 9.0; the float32 head 7.2-8.9 ms at one row.
// Two paths with the same math: AVX2+FMA (+F16C for float16; functions with target
// attributes, chosen at run time) and portable scalar C++ (also forced with isa="scalar"
// for tests).
//
// Internal linkage (an unnamed namespace): every op file that includes this compiles its own
// copy, so its calls stay direct and the compiler inlines and clones it within that file as
// it would the file's own code.
#ifndef TOKENSERVE_KERNELS_HEAD_SCREEN_ROWS_H_
#define TOKENSERVE_KERNELS_HEAD_SCREEN_ROWS_H_

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "chunks.h"
#include "cpu.h"
#include "op_support.h"

namespace tokenserve {
namespace {

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

#ifdef TOKENSERVE_CPU_X86
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
#endif  // TOKENSERVE_CPU_X86

// y[:, n0:n1] = x @ w[n0:n1].T (times scale, if any): the AVX2 path where `avx2`, else the
// scalar one (both ops' products, tile by tile)
template <typename W>
void ProductTile(bool avx2, const Geometry& g, const float* x, const W* w, const float* scale,
                 int64 n0, int64 n1, const W* prefetch_end, float* y) {
#ifdef TOKENSERVE_CPU_X86
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
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_HEAD_SCREEN_ROWS_H_
