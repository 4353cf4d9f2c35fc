// The int8 matmul's AVX2+FMA row kernels, for up to 8 rows of x (UsesRowKernel in
// int8_matmul.h): each weight row of a tile (int8_tiles.h) read front to back, one
// sequential stream, against one row of x (Int8RowsAvx2) or several (Int8RowsManyAvx2).
//
// Internal linkage (an unnamed namespace): every op file that includes this compiles its own
// copy, so its calls stay direct and the compiler inlines and clones it within that file as
// it would the file's own code.
#ifndef TOKENSERVE_KERNELS_INT8_ROWS_AVX2_H_
#define TOKENSERVE_KERNELS_INT8_ROWS_AVX2_H_

#include <cstdint>
#include <cstring>

#include "cpu.h"
#include "int8_tiles.h"

namespace tokenserve {
namespace {

#ifdef TOKENSERVE_CPU_X86
#define AVX2_FN __attribute__((target("avx2,fma")))

// One 32-value activation block against the same block of one weight row, added to acc:
// acc += d * (8 partial int32 sums of x . w). ax is |x| (maddubs takes it as unsigned).
AVX2_FN __attribute__((always_inline)) inline __m256 Int8DotAvx2(const int8_t* x,
                                                                const int8_t* ax, float d,
                                                                const int8_t* w, __m256 acc) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ax));
  const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i pairs = _mm256_maddubs_epi16(av, _mm256_sign_epi8(wv, xv));
  const __m256i sums = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(d), acc);
}

// The tile's output channels one at a time, each weight row read front to back against every
// row of x, with four accumulators over consecutive blocks (so the FMA latency does not chain
// them). The weights are then one sequential stream through memory, which the hardware
// prefetcher follows at full bandwidth: sweeping four rows at once (Int8TileAvx2, four
// streams 768 bytes apart that each end after a dozen cache lines) needed software prefetch
// and still streamed ~1.3-1.5x slower on a 2-core AVX2-only EPYC (docs/performance.md).
AVX2_FN void Int8RowsAvx2(const Geometry& g, const QuantizedRows& xq, const Tile& t, float* y) {
  const int64 K = g.K, G = g.G, group = g.group, blocks = g.blocks, tail = g.tail;
  const int64 row_blocks = g.RowBlocks();
  const int64 full = tail == kBlock ? blocks : blocks - 1;
  alignas(32) int8_t padded[kBlock] = {};  // a short last block's weights, zero-padded
  for (int64 r = 0; r < t.count; ++r) {
    const int8_t* w = t.q + r * K;
    const float* scale = t.scale + r * G;
    for (int64 m = 0; m < g.M; ++m) {
      const int8_t* xrow = xq.q.data() + m * row_blocks * kBlock;
      const int8_t* arow = xq.a.data() + m * row_blocks * kBlock;
      const float* drow = xq.d.data() + m * row_blocks;
      __m256 total = _mm256_setzero_ps();
      for (int64 grp = 0; grp < G; ++grp) {
        const int64 b0 = grp * blocks;  // the group's first activation block
        const int8_t* xg = xrow + b0 * kBlock;
        const int8_t* ag = arow + b0 * kBlock;
        const float* dg = drow + b0;
        const int8_t* wg = w + grp * group;
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                         _mm256_setzero_ps()};
        int64 j = 0;
        for (; j + 4 <= full; j += 4) {
          // the two cache lines kRowPrefetch bytes ahead (past the row's end: the next
          // row's, the stream's continuation; a prefetch past q's end does not fault)
          const char* ahead = reinterpret_cast<const char*>(wg + j * kBlock) + kRowPrefetch;
          _mm_prefetch(ahead, _MM_HINT_T0);
          _mm_prefetch(ahead + 64, _MM_HINT_T0);
          const int8_t* far = wg + j * kBlock + kRowPrefetchL2;
          if (far < t.prefetch_end) {
            _mm_prefetch(reinterpret_cast<const char*>(far), _MM_HINT_T1);
            _mm_prefetch(reinterpret_cast<const char*>(far) + 64, _MM_HINT_T1);
          }
          for (int i = 0; i < 4; ++i) {
            const int64 o = (j + i) * kBlock;
            acc[i] = Int8DotAvx2(xg + o, ag + o, dg[j + i], wg + o, acc[i]);
          }
        }
        for (; j < full; ++j) {
          const int64 o = j * kBlock;
          acc[j & 3] = Int8DotAvx2(xg + o, ag + o, dg[j], wg + o, acc[j & 3]);
        }
        if (full < blocks) {  // copy rather than read past the end of q
          std::memcpy(padded, wg + full * kBlock, tail);
          const int64 o = full * kBlock;
          acc[0] = Int8DotAvx2(xg + o, ag + o, dg[full], padded, acc[0]);
        }
        const __m256 sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]),
                                         _mm256_add_ps(acc[2], acc[3]));
        total = G == 1 ? sum : _mm256_fmadd_ps(sum, _mm256_set1_ps(scale[grp]), total);
      }
      y[m * g.N + t.n0 + r] = cpu::HorizontalSum(total) * (G == 1 ? scale[0] : 1.f);
    }
  }
}

// Rows m0 .. m0 + R - 1 of x against one weight row w (output channel n), written to y. Each
// 32-byte block of w is loaded once for all R rows, and the R accumulators are independent
// chains. Measured and not kept: two weight rows at a time, sharing each block of x too (ran
// out of registers, 1.1-1.6x slower); two accumulators per row of x when R < 3, and groups
// of 3 + 2 rather than 4 + 1 (both ties or 1-10 % slower).
template <int R>
AVX2_FN __attribute__((always_inline)) inline void Int8RowGroupAvx2(
    const Geometry& g, const QuantizedRows& xq, int64 m0, const int8_t* w, const float* scale,
    int64 n, const int8_t* prefetch_end, float* y) {
  const int64 G = g.G, group = g.group, blocks = g.blocks, tail = g.tail;
  const int64 row_blocks = g.RowBlocks();
  const int64 full = tail == kBlock ? blocks : blocks - 1;
  const __m256i ones = _mm256_set1_epi16(1);
  alignas(32) int8_t padded[kBlock] = {};  // a short last block's weights, zero-padded
  const int8_t* xrow[R];
  const int8_t* arow[R];
  const float* drow[R];
  __m256 total[R];
  for (int i = 0; i < R; ++i) {
    xrow[i] = xq.q.data() + (m0 + i) * row_blocks * kBlock;
    arow[i] = xq.a.data() + (m0 + i) * row_blocks * kBlock;
    drow[i] = xq.d.data() + (m0 + i) * row_blocks;
    total[i] = _mm256_setzero_ps();
  }
  // acc[i] += d * (x_i . w) over activation block b, whose weights start at wb. Written out
  // rather than calling Int8DotAvx2 per row: that loads wb per row, and at five rows it
  // measured 1.5x slower (23.5-24.7 against 14.9-16.1 ms over GPT-2-small's matrices).
  auto block = [&](const int8_t* wb, int64 b, __m256* acc) AVX2_FN {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb));
    for (int i = 0; i < R; ++i) {
      const __m256i xv =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xrow[i] + b * kBlock));
      const __m256i av =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(arow[i] + b * kBlock));
      const __m256i pairs = _mm256_maddubs_epi16(av, _mm256_sign_epi8(wv, xv));
      const __m256i sums = _mm256_madd_epi16(pairs, ones);
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_broadcast_ss(drow[i] + b),
                               acc[i]);
    }
  };
  for (int64 grp = 0; grp < G; ++grp) {
    const int64 b0 = grp * blocks;
    const int8_t* wg = w + grp * group;
    __m256 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
    for (int64 j = 0; j < full; ++j) {
      if (!(j & 1)) {  // one cache line per two blocks, into L1 and further ahead into L2
        _mm_prefetch(reinterpret_cast<const char*>(wg + j * kBlock + kRowPrefetch), _MM_HINT_T0);
        const int8_t* far = wg + j * kBlock + kRowPrefetchL2;
        if (far < prefetch_end) _mm_prefetch(reinterpret_cast<const char*>(far), _MM_HINT_T1);
      }
      block(wg + j * kBlock, b0 + j, acc);
    }
    if (full < blocks) {  // copy rather than read past the end of q
      std::memcpy(padded, wg + full * kBlock, tail);
      block(padded, b0 + full, acc);
    }
    for (int i = 0; i < R; ++i) {
      total[i] = G == 1 ? acc[i] : _mm256_fmadd_ps(acc[i], _mm256_set1_ps(scale[grp]), total[i]);
    }
  }
  for (int i = 0; i < R; ++i) {
    y[(m0 + i) * g.N + n] = cpu::HorizontalSum(total[i]) * (G == 1 ? scale[0] : 1.f);
  }
}

// The tile's output channels one at a time, as Int8RowsAvx2 (one sequential weight stream),
// each weight row against the rows of x four at a time: the weight row's blocks are loaded
// once per four rows of x, and while the row is in L1 every group of rows sweeps it. Five
// rows go as one group (GPT-2-small's int8 matrices, alternating in one process: 20.1 ->
// 18.5 ms against 4 + 1, whose one-row pass is a single FMA chain).
AVX2_FN void Int8RowsManyAvx2(const Geometry& g, const QuantizedRows& xq, const Tile& t,
                              float* y) {
  for (int64 r = 0; r < t.count; ++r) {
    const int8_t* w = t.q + r * g.K;
    const float* scale = t.scale + r * g.G;
    const int64 n = t.n0 + r;
    int64 m = 0;
    if (g.M == 5) {  // one sequence checking four drafts: one group of five, not 4 + 1
      Int8RowGroupAvx2<5>(g, xq, 0, w, scale, n, t.prefetch_end, y);
      continue;
    }
    for (; m + 4 <= g.M; m += 4) Int8RowGroupAvx2<4>(g, xq, m, w, scale, n, t.prefetch_end, y);
    switch (g.M - m) {
      case 3: Int8RowGroupAvx2<3>(g, xq, m, w, scale, n, t.prefetch_end, y); break;
      case 2: Int8RowGroupAvx2<2>(g, xq, m, w, scale, n, t.prefetch_end, y); break;
      case 1: Int8RowGroupAvx2<1>(g, xq, m, w, scale, n, t.prefetch_end, y); break;
      default: break;
    }
  }
}

#undef AVX2_FN
#endif  // TOKENSERVE_CPU_X86

}  // namespace
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_INT8_ROWS_AVX2_H_
