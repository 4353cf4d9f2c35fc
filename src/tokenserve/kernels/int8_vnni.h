// The int8 matmul's AVX512-VNNI tile kernel (two 32-blocks per instruction), built where
// the build targets AVX-512 (TOKENSERVE_VNNI, int8_tiles.h), and whether the CPU runs it.
//
// Internal linkage (an unnamed namespace): every op file that includes this compiles its own
// copy, so its calls stay direct and the compiler inlines and clones it within that file as
// it would the file's own code.
#ifndef TOKENSERVE_KERNELS_INT8_VNNI_H_
#define TOKENSERVE_KERNELS_INT8_VNNI_H_

#include <cstdint>
#include <cstring>

#include "cpu.h"
#include "int8_tiles.h"

namespace tokenserve {
namespace {

#ifdef TOKENSERVE_VNNI
// AVX512-VNNI path of the int8 kernel. Functions carry their own target, as above.
#define VNNI_FN __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")))

// One 32-value block against the same block of NT weight rows (the odd block of a group):
// acc[r] += d * (8 int32 partial sums), in 256-bit registers.
template <int NT>
VNNI_FN __attribute__((always_inline)) inline void Int8BlockVnni256(
    const int8_t* x, float d, const int8_t* w, int64 stride, __m256* acc) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i ax = _mm256_abs_epi8(xv);
  const __m256 dv = _mm256_set1_ps(d);
  for (int r = 0; r < NT; ++r) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * stride));
    const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ax,
                                            _mm256_sign_epi8(wv, xv));
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), dv, acc[r]);
  }
}

// Two adjacent 32-value blocks (64 bytes) against the same blocks of NT weight rows:
// lanes 0-7 hold block j's partial sums and 8-15 block j + 1's, scaled by d0 and d1.
template <int NT>
VNNI_FN __attribute__((always_inline)) inline void Int8PairVnni(
    const int8_t* x, float d0, float d1, const int8_t* w, int64 stride, __m512* acc) {
  const __m512i xv = _mm512_loadu_si512(x);
  const __m512i ax = _mm512_abs_epi8(xv);
  const __mmask64 negative = _mm512_movepi8_mask(xv);  // x < 0: move its sign onto w
  const __m512 dv = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d0), _mm512_set1_ps(d1));
  const __m512i zero = _mm512_setzero_si512();
  for (int r = 0; r < NT; ++r) {
    const __m512i wv = _mm512_loadu_si512(w + r * stride);
    const __m512i sw = _mm512_mask_sub_epi8(wv, negative, zero, wv);
    const __m512i dot = _mm512_dpbusd_epi32(zero, ax, sw);
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), dv, acc[r]);
  }
}

// As Int8TileAvx2, two blocks per step.
template <int NT>
VNNI_FN void Int8TileVnni(const Geometry& g, const QuantizedRows& xq, const Tile& t, float* y) {
  const int64 K = g.K, G = g.G, group = g.group, blocks = g.blocks, tail = g.tail;
  const int64 row_blocks = g.RowBlocks();
  const int64 full = tail == kBlock ? blocks : blocks - 1;
  const int64 pairs = full / 2;
  alignas(32) int8_t padded[NT * kBlock] = {};
  for (int64 m = 0; m < g.M; ++m) {
    const int8_t* xrow = xq.q.data() + m * row_blocks * kBlock;
    const float* drow = xq.d.data() + m * row_blocks;
    __m512 total[NT];
    for (int r = 0; r < NT; ++r) total[r] = _mm512_setzero_ps();
    for (int64 grp = 0; grp < G; ++grp) {
      const int8_t* xg = xrow + grp * blocks * kBlock;
      const float* dg = drow + grp * blocks;
      const int8_t* wg = t.q + grp * group;
      __m512 acc[NT];
      __m256 odd[NT];
      for (int r = 0; r < NT; ++r) {
        acc[r] = _mm512_setzero_ps();
        odd[r] = _mm256_setzero_ps();
      }
      for (int64 p = 0; p < pairs; ++p) {
        const int64 j = 2 * p;
        Int8PairVnni<NT>(xg + j * kBlock, dg[j], dg[j + 1], wg + j * kBlock, K, acc);
      }
      if (full % 2) {
        const int64 j = full - 1;
        Int8BlockVnni256<NT>(xg + j * kBlock, dg[j], wg + j * kBlock, K, odd);
      }
      if (full < blocks) {  // copy rather than read past the end of q
        for (int r = 0; r < NT; ++r) {
          std::memcpy(padded + r * kBlock, wg + full * kBlock + r * K, tail);
        }
        Int8BlockVnni256<NT>(xg + full * kBlock, dg[full], padded, kBlock, odd);
      }
      for (int r = 0; r < NT; ++r) {
        const __m512 sum = _mm512_add_ps(acc[r], _mm512_zextps256_ps512(odd[r]));
        total[r] = G == 1 ? sum
                          : _mm512_fmadd_ps(sum, _mm512_set1_ps(t.scale[r * G + grp]), total[r]);
      }
    }
    for (int r = 0; r < NT; ++r) {
      y[m * g.N + t.n0 + r] = _mm512_reduce_add_ps(total[r]) * (G == 1 ? t.scale[r] : 1.f);
    }
  }
}
#undef VNNI_FN
#endif  // TOKENSERVE_VNNI

bool CpuHasAvx512Vnni() {
#ifdef TOKENSERVE_VNNI
  static const bool has = cpu::HasAvx2Fma() && __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512vnni");
  return has;
#else
  return false;
#endif
}

}  // namespace
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_INT8_VNNI_H_
