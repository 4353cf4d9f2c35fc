// The "kn" dense kernels that read W [K, N] (Keras' Dense kernel) in place: a column range
// of W walked row by row for up to 8 rows of x at a time (KnRangeAvx2, KnRangeScalar), and
// whole weight rows read front to back into partial sums for up to 8 rows of x, the
// split-K path (KnRowsAvx2, KnRowsScalar). dense_compute.h decides which runs where.
//
// Internal linkage (an unnamed namespace): every op file that includes this compiles its own
// copy, so its calls stay direct and the compiler inlines and clones it within that file as
// it would the file's own code.
#ifndef TOKENSERVE_KERNELS_DENSE_KN_H_
#define TOKENSERVE_KERNELS_DENSE_KN_H_

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu.h"
#include "dense_args.h"

namespace tokenserve {
namespace {

// "kn" with bfloat16 weights and up to 8 rows of x: each of the four weight rows read at once
// is prefetched this many weights (2 KB) ahead. The float32 rows need no software prefetch,
// but the bfloat16 ones did: forty GPT-2-small MLP matrices [768, 3072] at one row of x on a
// 2-core Zen 5 EPYC, alternating processes, took 9.5-10.7 ms without it, 8.3 at 512 weights
// ahead, 7.2-8.0 at 1,024, 6.7-7.8 at 1,536 and 7.8-7.9 at 2,048 (float32: 10.3-13.4 ms).
constexpr int64 kBf16Ahead = 1024;

#ifdef TOKENSERVE_CPU_X86
#define AVX2_FN __attribute__((target("avx2,fma")))

// "kn": acc[r, 0 .. width) = x[r, :] @ W[:, j0 .. j0 + width) for rows r of one pass.
// Four weight rows per iteration: each accumulator is loaded and stored once per four FMAs.
template <typename W>
AVX2_FN void KnRangeAvx2(const DenseGeometry& g, const float* x, int64 rows, const W* w,
                         int64 j0, int64 width, float* acc) {
  std::fill(acc, acc + rows * width, 0.f);
  const int64 vec = width / 8 * 8;
  int64 k = 0;
  for (; k + 4 <= g.K; k += 4) {
    const W* w0 = w + k * g.N + j0;
    const W* w1 = w0 + g.N;
    const W* w2 = w1 + g.N;
    const W* w3 = w2 + g.N;
    if (k + 8 < g.K) {  // the rows after next: one line per 16 floats of the range
      const W* ahead = w0 + 8 * g.N;
      for (int64 j = 0; j < width; j += 16) {
        _mm_prefetch(reinterpret_cast<const char*>(ahead + j), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(ahead + g.N + j), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(ahead + 2 * g.N + j), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(ahead + 3 * g.N + j), _MM_HINT_T0);
      }
    }
    for (int64 r = 0; r < rows; ++r) {
      const float* xr = x + r * g.K + k;
      const __m256 x0 = _mm256_set1_ps(xr[0]), x1 = _mm256_set1_ps(xr[1]);
      const __m256 x2 = _mm256_set1_ps(xr[2]), x3 = _mm256_set1_ps(xr[3]);
      float* a = acc + r * width;
      int64 j = 0;
      for (; j < vec; j += 8) {
        __m256 s = _mm256_loadu_ps(a + j);
        s = _mm256_fmadd_ps(x0, Load8(w0 + j), s);
        s = _mm256_fmadd_ps(x1, Load8(w1 + j), s);
        s = _mm256_fmadd_ps(x2, Load8(w2 + j), s);
        s = _mm256_fmadd_ps(x3, Load8(w3 + j), s);
        _mm256_storeu_ps(a + j, s);
      }
      for (; j < width; ++j) {
        a[j] += xr[0] * ToFloat(w0[j]) + xr[1] * ToFloat(w1[j]) + xr[2] * ToFloat(w2[j]) +
                xr[3] * ToFloat(w3[j]);
      }
    }
  }
  for (; k < g.K; ++k) {
    const W* wk = w + k * g.N + j0;
    for (int64 r = 0; r < rows; ++r) {
      const float xv = x[r * g.K + k];
      float* a = acc + r * width;
      for (int64 j = 0; j < width; ++j) a[j] += xv * ToFloat(wk[j]);
    }
  }
}

// "kn" for up to 8 rows of x: acc[r, :] += x[r, k0 .. k1) @ W[k0 .. k1, :] with the whole
// width of W per weight row, so the rows [k0, k1) are read front to back. P weight rows per
// pass: each accumulator is loaded and stored once per P FMAs, not once per FMA. On a 2-core
// AVX2-only EPYC a standalone test of GPT-2-small's block matrices at batch 1 streamed them
// at 28-32 GB/s four rows at a time against 20-23 GB/s one row at a time (its plain read
// loop: 25-33 GB/s). Float32 weights take eight rows a pass: they feed the FMAs from
// memory (one row of x) or from eight registers (more rows, whose broadcasts of x are then
// read from the stack), so the accumulators' loads and stores halve again. On a 2-core
// Zen 5, one thread, standalone, medians of three: the [3072, 768] and [768, 3072] matrices
// read from memory at 17.0 and 19.9 GB/s against 14.3 and 18.5 with four at one row of x,
// 12.9 / 15.3 against 9.9 / 13.7 at two, 12.4 / 15.5 against 10.1 / 12.0 at four, 8.0 / 9.6
// against 7.5 / 7.2 at eight (its plain read loop: 20-25 GB/s). bfloat16 rows keep four:
// they are widened in registers, and eight measured 4 % slower (twelve GPT-2-small block
// ops at one row, native build). The FMAs into one accumulator run in k order either way,
// so the sums are the same bits. The hardware prefetcher follows the streams of float32
// rows, but not all the way: a prefetch of each row 8 weights ahead into L1 measured no
// better, while spreading a prefetch of the next pass's rows into L2 over this pass
// (`ahead`) brought the pass from 0.91-0.92 of a plain two-thread read loop to 0.98-0.99
// (benchmarks/experiments/kernels/kn_row_variants.cc: the 48 block matrices of GPT-2-small at one row
// of x, 2-core Zen 5 with AVX2 code, eight alternating rounds), and one float32 sequence in
// the engine 1.10x (alternating processes, 4 rounds, AVX2 cap). bfloat16 rows, four a pass,
// keep their prefetch into L1 and take the same one into L2 (one line a step): on the Zen 5
// without caps, one bfloat16 sequence 1.21x (1.15-1.29), eight 1.19x (1.14-1.33;
// alternating processes, 4 rounds). The prefetch changes no result.
template <int M, int P, typename W>
AVX2_FN inline void KnPassAvx2(const DenseGeometry& g, const float* x, const W* w, int64 k,
                               float* acc, const W* ahead = nullptr) {
  const int64 vec = g.N / 8 * 8;
  const W* rows[P];
  __m256 xs[M][P];
  for (int i = 0; i < P; ++i) rows[i] = w + (k + i) * g.N;
  for (int r = 0; r < M; ++r) {
    for (int i = 0; i < P; ++i) xs[r][i] = _mm256_set1_ps(x[r * g.K + k + i]);
  }
  int64 j = 0;
  for (; j < vec; j += 8) {
    if constexpr (sizeof(W) == 2) {  // a line of each row, kBf16Ahead weights ahead
      if ((j & 31) == 0) {
        for (int i = 0; i < P; ++i) {
          _mm_prefetch(reinterpret_cast<const char*>(rows[i] + j + kBf16Ahead), _MM_HINT_T0);
        }
      }
    }
    if (ahead != nullptr) {  // the next pass's P rows into L2, 8 * P weights a step
      cpu::PrefetchL2(ahead + j * P, 8 * P * sizeof(W));
    }
    __m256 v[P];
    for (int i = 0; i < P; ++i) v[i] = Load8(rows[i] + j);
    for (int r = 0; r < M; ++r) {
      float* a = acc + r * g.N + j;
      __m256 s = _mm256_loadu_ps(a);
      for (int i = 0; i < P; ++i) s = _mm256_fmadd_ps(xs[r][i], v[i], s);
      _mm256_storeu_ps(a, s);
    }
  }
  for (; j < g.N; ++j) {
    for (int r = 0; r < M; ++r) {
      float s = acc[r * g.N + j];
      for (int i = 0; i < P; ++i) s = std::fma(x[r * g.K + k + i], ToFloat(rows[i][j]), s);
      acc[r * g.N + j] = s;
    }
  }
}

template <int M, typename W>
AVX2_FN void KnRowsAvx2(const DenseGeometry& g, const float* x, const W* w, int64 k0, int64 k1,
                        float* acc) {
  int64 k = k0;
  if constexpr (sizeof(W) == 4) {
    for (; k + 8 <= k1; k += 8) {
      KnPassAvx2<M, 8>(g, x, w, k, acc, k + 16 <= k1 ? w + (k + 8) * g.N : nullptr);
    }
  }
  if constexpr (sizeof(W) == 2) {
    for (; k + 4 <= k1; k += 4) {
      KnPassAvx2<M, 4>(g, x, w, k, acc, k + 8 <= k1 ? w + (k + 4) * g.N : nullptr);
    }
  }
  for (; k + 4 <= k1; k += 4) KnPassAvx2<M, 4>(g, x, w, k, acc);
  for (; k < k1; ++k) KnPassAvx2<M, 1>(g, x, w, k, acc);
}

#undef AVX2_FN
#endif  // TOKENSERVE_CPU_X86

template <typename W>
void KnRangeScalar(const DenseGeometry& g, const float* x, int64 rows, const W* w, int64 j0,
                   int64 width, float* acc) {
  std::fill(acc, acc + rows * width, 0.f);
  for (int64 k = 0; k < g.K; ++k) {
    const W* wk = w + k * g.N + j0;
    for (int64 r = 0; r < rows; ++r) {
      const float xv = x[r * g.K + k];
      float* a = acc + r * width;
      for (int64 j = 0; j < width; ++j) a[j] += xv * ToFloat(wk[j]);
    }
  }
}

template <typename W>
void KnRowsScalar(const DenseGeometry& g, const float* x, const W* w, int64 k0, int64 k1,
                  float* acc) {
  for (int64 k = k0; k < k1; ++k) {
    const W* wk = w + k * g.N;
    for (int64 r = 0; r < g.M; ++r) {
      const float xv = x[r * g.K + k];
      float* a = acc + r * g.N;
      for (int64 j = 0; j < g.N; ++j) a[j] += xv * ToFloat(wk[j]);
    }
  }
}

}  // namespace
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_DENSE_KN_H_
