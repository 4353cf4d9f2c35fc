// The int8 matmul's AVX2+FMA kernels over a tile of output channels (int8_tiles.h): x
// quantized per 32-block, four weight rows swept by every row of x (Int8TileAvx2), and the
// float kernel over a dequantized tile (FloatTileAvx2).
//
// Internal linkage (an unnamed namespace): every op file that includes this compiles its own
// copy, so its calls stay direct and the compiler inlines and clones it within that file as
// it would the file's own code.
#ifndef TOKENSERVE_KERNELS_INT8_TILES_AVX2_H_
#define TOKENSERVE_KERNELS_INT8_TILES_AVX2_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu.h"
#include "int8_tiles.h"
#include "q8_quantize.h"

namespace tokenserve {
namespace {

// ---------------------------------------------------------------------------------------
// AVX2 + FMA path. Functions carry target attributes (rather than relying on -m flags) so the
// library still loads and runs the scalar path on a CPU without AVX2.
#ifdef TOKENSERVE_CPU_X86
#define AVX2_FN __attribute__((target("avx2,fma")))

AVX2_FN float QuantizeBlockAvx2(const float* x, int64 len, int8_t* q) {
  alignas(32) float padded[kBlock];
  if (len < kBlock) {  // rare: the last block of a group whose size is not a multiple of 32
    std::memset(padded, 0, sizeof(padded));
    std::memcpy(padded, x, len * sizeof(float));
    x = padded;
  }
  return q8::QuantizeAvx2(x, kBlock, q);  // the same bytes and scale as QuantizeBlockScalar
}

// One 32-value activation block against the same block of NT weight rows (stride apart):
// acc[r] += d * (8 partial int32 sums of x . w_r).
template <int NT>
AVX2_FN __attribute__((always_inline)) inline void Int8BlockAvx2(const int8_t* x, float d,
                                                                 const int8_t* w, int64 stride,
                                                                 __m256* acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  // maddubs multiplies unsigned by signed bytes: use |x| and move x's sign onto w.
  // |x|, |w| <= 127, so a pair sum is at most 2 * 127 * 127 and never saturates.
  const __m256i ax = _mm256_sign_epi8(xv, xv);
  const __m256 dv = _mm256_set1_ps(d);
  for (int r = 0; r < NT; ++r) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * stride));
    const __m256i pairs = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv, xv));
    const __m256i sums = _mm256_madd_epi16(pairs, ones);
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), dv, acc[r]);
  }
}

// NT output channels x every row of x. The NT weight rows (NT * K bytes) stay in L1 while
// all M rows sweep over them.
template <int NT>
AVX2_FN void Int8TileAvx2(const Geometry& g, const QuantizedRows& xq, const Tile& t, float* y) {
  // Locals, so the compiler keeps them in registers across the stores to y.
  const int64 K = g.K, G = g.G, group = g.group, blocks = g.blocks, tail = g.tail;
  const int64 row_blocks = g.RowBlocks();
  // Blocks of a group that need no padding: all but a last block shorter than 32.
  const int64 full = tail == kBlock ? blocks : blocks - 1;
  alignas(32) int8_t padded[NT * kBlock] = {};  // a short last block's weights, zero-padded
  for (int64 m = 0; m < g.M; ++m) {
    const int8_t* xrow = xq.q.data() + m * row_blocks * kBlock;
    const float* drow = xq.d.data() + m * row_blocks;
    __m256 total[NT];
    for (int r = 0; r < NT; ++r) total[r] = _mm256_setzero_ps();
    for (int64 grp = 0; grp < G; ++grp) {
      const int8_t* xg = xrow + grp * blocks * kBlock;
      const float* dg = drow + grp * blocks;
      const int8_t* wg = t.q + grp * group;
      __m256 acc[NT];
      for (int r = 0; r < NT; ++r) acc[r] = _mm256_setzero_ps();
      for (int64 j = 0; j < full; ++j) {
        Int8BlockAvx2<NT>(xg + j * kBlock, dg[j], wg + j * kBlock, K, acc);
      }
      if (full < blocks) {  // copy rather than read past the end of q
        for (int r = 0; r < NT; ++r) {
          std::memcpy(padded + r * kBlock, wg + full * kBlock + r * K, tail);
        }
        Int8BlockAvx2<NT>(xg + full * kBlock, dg[full], padded, kBlock, acc);
      }
      if (G == 1) {
        for (int r = 0; r < NT; ++r) total[r] = acc[r];
      } else {
        for (int r = 0; r < NT; ++r) {
          total[r] = _mm256_fmadd_ps(acc[r], _mm256_set1_ps(t.scale[r * G + grp]), total[r]);
        }
      }
    }
    // Per-channel scale (G == 1) applied once, after the sum.
    for (int r = 0; r < NT; ++r) {
      y[m * g.N + t.n0 + r] = cpu::HorizontalSum(total[r]) * (G == 1 ? t.scale[r] : 1.f);
    }
  }
}

AVX2_FN void DequantizeTileAvx2(const Geometry& g, const Tile& t, float* buf) {
  for (int64 r = 0; r < t.count; ++r) {
    const int8_t* w = t.q + r * g.K;
    float* out = buf + r * g.padded;
    for (int64 grp = 0; grp < g.G; ++grp) {
      const float s = t.scale[r * g.G + grp];
      const __m256 sv = _mm256_set1_ps(s);
      const int64 begin = grp * g.group, end = begin + g.group;
      int64 k = begin;
      for (; k + 8 <= end; k += 8) {
        const __m128i w8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k));
        const __m256 wf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(w8));
        _mm256_storeu_ps(out + k, _mm256_mul_ps(wf, sv));
      }
      for (; k < end; ++k) out[k] = static_cast<float>(w[k]) * s;
    }
    for (int64 k = g.K; k < g.padded; ++k) out[k] = 0.f;
  }
}

template <int NT>
AVX2_FN void FloatTileAvx2(const Geometry& g, const float* x, const Tile& t, float* buf,
                           float* y) {
  DequantizeTileAvx2(g, t, buf);
  const int64 K = g.K, padded = g.padded, full = g.K / 8 * 8;
  // Lanes of the last, partial 8-vector of x (the buffer is zero-padded there).
  alignas(32) int32_t mask_lanes[8];
  for (int i = 0; i < 8; ++i) mask_lanes[i] = full + i < K ? -1 : 0;
  const __m256i mask = _mm256_load_si256(reinterpret_cast<const __m256i*>(mask_lanes));
  for (int64 m = 0; m < g.M; ++m) {
    const float* xrow = x + m * K;
    __m256 acc[NT];
    for (int r = 0; r < NT; ++r) acc[r] = _mm256_setzero_ps();
    for (int64 k = 0; k < full; k += 8) {
      const __m256 xv = _mm256_loadu_ps(xrow + k);
      for (int r = 0; r < NT; ++r) {
        acc[r] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(buf + r * padded + k), acc[r]);
      }
    }
    if (full < K) {
      const __m256 xv = _mm256_maskload_ps(xrow + full, mask);
      for (int r = 0; r < NT; ++r) {
        acc[r] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(buf + r * padded + full), acc[r]);
      }
    }
    for (int r = 0; r < NT; ++r) y[m * g.N + t.n0 + r] = cpu::HorizontalSum(acc[r]);
  }
}
#undef AVX2_FN

#endif  // TOKENSERVE_CPU_X86

}  // namespace
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_INT8_TILES_AVX2_H_
