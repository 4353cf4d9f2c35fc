// The "nk" dense kernels (W [N, K]: a tied embedding used as the LM head) for fewer rows of
// x than dense_packed.h takes: each weight row a dot product with every row of x
// (NkTileAvx2, NkTileScalar).
//
// Internal linkage (an unnamed namespace): every op file that includes this compiles its own
// copy, so its calls stay direct and the compiler inlines and clones it within that file as
// it would the file's own code.
#ifndef TOKENSERVE_KERNELS_DENSE_NK_H_
#define TOKENSERVE_KERNELS_DENSE_NK_H_

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu.h"
#include "dense_args.h"

namespace tokenserve {
namespace {

constexpr int64 kNkPrefetchRows = 8;  // "nk": how many weight rows ahead to prefetch
// "nk": and four rows this many ahead into L2, up to the end of the tile the worker takes
// next. GPT-2-small's head [50257, 768] alone, AVX2 code on a 2-core Zen 5, alternating
// processes, 3 rounds: M = 1 6.2-6.4 -> 4.6-5.7 ms, M = 4 7.4-7.6 -> 5.7-7.1, M = 8
// 9.1-9.3 -> 7.8-8.8, M = 16 12.6-13.1 -> 11.6-12.1. In the engine (one float32 sequence
// sampled at temperature 0.8, which reads this head every step) no change showed beyond the
// noise: 44.6-52.1 -> 41.5-51.9 tok/s, 5 alternating rounds.
constexpr int64 kNkPrefetchL2Rows = 24;

#ifdef TOKENSERVE_CPU_X86
#define AVX2_FN __attribute__((target("avx2,fma")))

// "nk": z[r, n] = W[n, :] . x[r, :] for weight rows [n0, n1) and every row r of x.
// Four weight rows at a time, each with its own accumulator per row of x, and up to three
// rows of x per pass, so each load of x feeds four FMAs and each load of W up to three; the
// first pass over the four rows software-prefetches the rows 8 ahead. GPT-2-small's tied LM
// head [50257, 768] on a 2-core AMX Xeon (AVX2 cap), in process, median: at M = 1, one row
// at a time 6.44 ms; four rows 5.51; four rows with the rows 4, 8 or 12 ahead prefetched
// 4.75, 4.68, 5.02 (numpy's sgemv: 3.9-4.7 in other runs of the same hour). At M = 8 and 16,
// one row of x per pass 12.4 and 18.4 ms, three 10.2 and 14.6.
// far (kPrefetch only): four rows further on, into L2 a line of each per line of these
// (nullptr: none).
template <int R, bool kPrefetch, typename W>
AVX2_FN inline void NkQuadAvx2(const DenseGeometry& g, const float* x, const W* w0, float* z,
                               const W* far) {
  const int64 vec = g.K / 8 * 8;
  const int64 ahead = kNkPrefetchRows * g.K;  // floats
  const W* ws[4] = {w0, w0 + g.K, w0 + 2 * g.K, w0 + 3 * g.K};
  __m256 s[R][4];
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < 4; ++i) s[r][i] = _mm256_setzero_ps();
  }
  int64 k = 0;
  for (; k < vec; k += 8) {
    if (kPrefetch && (k & 15) == 0) {  // a cache line of each row kNkPrefetchRows ahead (past
      // the tile's or W's end too: a prefetch never faults)
      for (int i = 0; i < 4; ++i) {
        _mm_prefetch(reinterpret_cast<const char*>(ws[i] + ahead + k), _MM_HINT_T0);
      }
      if (far != nullptr) {
        for (int i = 0; i < 4; ++i) {
          _mm_prefetch(reinterpret_cast<const char*>(far + i * g.K + k), _MM_HINT_T1);
        }
      }
    }
    __m256 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + r * g.K + k);
    for (int i = 0; i < 4; ++i) {
      const __m256 wv = Load8(ws[i] + k);
      for (int r = 0; r < R; ++r) s[r][i] = _mm256_fmadd_ps(wv, xv[r], s[r][i]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float* xr = x + r * g.K;
    float sums[4];
    for (int i = 0; i < 4; ++i) {
      sums[i] = cpu::HorizontalSum(s[r][i]);
      for (int64 kk = k; kk < g.K; ++kk) sums[i] += ToFloat(ws[i][kk]) * xr[kk];
    }
    std::memcpy(z + r * g.N, sums, sizeof(sums));
  }
}

template <int R, typename W>
AVX2_FN inline void NkRowsAvx2(bool prefetch, const DenseGeometry& g, const float* x, const W* w0,
                               float* z, const W* far) {
  prefetch ? NkQuadAvx2<R, true>(g, x, w0, z, far) : NkQuadAvx2<R, false>(g, x, w0, z, far);
}

template <typename W>
AVX2_FN void NkTileAvx2(const DenseGeometry& g, const float* x, const W* w, int64 n0, int64 n1,
                        const W* prefetch_end, float* z) {
  int64 n = n0;
  for (; n + 4 <= n1; n += 4) {
    const W* w0 = w + n * g.K;
    // four rows further ahead, into L2: a line at a time from the first pass over these
    // (a burst of all their lines here stalled on the core's few line-fill buffers)
    const W* far = w0 + kNkPrefetchL2Rows * g.K;
    if (far + 4 * g.K > prefetch_end) far = nullptr;
    for (int64 r = 0; r < g.M; r += 3) {
      const float* xr = x + r * g.K;
      float* zr = z + r * g.N + n;
      const bool first = r == 0;  // reads the four rows from memory: prefetch ahead
      switch (std::min<int64>(3, g.M - r)) {
        case 1: NkRowsAvx2<1>(first, g, xr, w0, zr, far); break;
        case 2: NkRowsAvx2<2>(first, g, xr, w0, zr, far); break;
        default: NkRowsAvx2<3>(first, g, xr, w0, zr, far); break;
      }
    }
  }
  const int64 vec = g.K / 8 * 8;
  for (; n < n1; ++n) {  // the tile's last rows, one at a time
    const W* wn = w + n * g.K;
    for (int64 r = 0; r < g.M; ++r) {
      const float* xr = x + r * g.K;
      __m256 s = _mm256_setzero_ps();
      int64 k = 0;
      for (; k < vec; k += 8) s = _mm256_fmadd_ps(Load8(wn + k), _mm256_loadu_ps(xr + k), s);
      float sum = cpu::HorizontalSum(s);
      for (; k < g.K; ++k) sum += ToFloat(wn[k]) * xr[k];
      z[r * g.N + n] = sum;
    }
  }
}

#undef AVX2_FN
#endif  // TOKENSERVE_CPU_X86

template <typename W>
void NkTileScalar(const DenseGeometry& g, const float* x, const W* w, int64 n0, int64 n1,
                  float* z) {
  for (int64 n = n0; n < n1; ++n) {
    for (int64 r = 0; r < g.M; ++r) {
      float sum = 0.f;
      for (int64 k = 0; k < g.K; ++k) sum += ToFloat(w[n * g.K + k]) * x[r * g.K + k];
      z[r * g.N + n] = sum;
    }
  }
}

}  // namespace
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_DENSE_NK_H_
