// The row kernels of the GGUF-block matmul (gguf_matmul.cc): output rows [n0, n0 + count) of
// y[M, N] = x @ dequant(w).T, from the quantized activations (gguf_blocks.h) and the weight
// rows' blocks as stored, one weight row at a time, read front to back (one sequential stream
// the hardware prefetcher follows), each block decoded once for up to four rows of x held in
// registers. Decode steps (a few rows of x) take these; gguf_tiles.h holds the kernel for
// more rows (prefill chunks, many streams). A portable scalar version and SIMD ones.
//
// The SIMD kernels are templates over the block type and the integer dot product:
//   MaddAvx2    _mm256_maddubs_epi16 + _mm256_madd_epi16 (u8 x s8 pairs, then pairs of those)
//   DpbusdVnni  one _mm256_dpbusd_epi32 (four u8 x s8 products per int32 lane), compiled only
//               where the build's flags include AVX512-VNNI and AVX512VL
// Both give the same int32 lanes, so the two paths differ only where the scalar path does:
// float summation order.
#ifndef TOKENSERVE_KERNELS_GGUF_KERNELS_H_
#define TOKENSERVE_KERNELS_GGUF_KERNELS_H_

#include <cstdint>

#include "cpu.h"
#include "gguf_blocks.h"

namespace tokenserve {
namespace gguf {

// Where the kernels write: y[m * ldy + n] for output row n and row m of x.
struct Output {
  float* y;
  int64 ldy;
};

// ---- scalar ---------------------------------------------------------------------------------
// The same formula per block as the SIMD kernels: sum over groups (d * dx_g) * dot_g + c * sx.
template <class Type>
void RowsScalar(const Q8Rows& xq, int64 M, const uint8_t* w, int64 row_bytes, int64 n0,
                int64 count, Output out) {
  int8_t v[kBlock];
  for (int64 r = 0; r < count; ++r) {
    const uint8_t* row = w + (n0 + r) * row_bytes;
    for (int64 m = 0; m < M; ++m) out.y[m * out.ldy + n0 + r] = 0.f;
    for (int64 b = 0; b < xq.blocks; ++b) {
      const uint8_t* block = row + b * Type::kBytes;
      DecodeValues<Type>(block, v);
      const float d = Scale(block), c = Type::Offset(block, d);
      for (int64 m = 0; m < M; ++m) {
        const int8_t* qx = xq.Values(m, b);
        const int64 i = xq.Index(m, b);
        float part = 0.f;
        for (int g = 0; g < kGroups; ++g) {
          int32_t dot = 0;
          for (int j = g * kGroup; j < (g + 1) * kGroup; ++j) dot += int32_t{v[j]} * int32_t{qx[j]};
          part += d * xq.GroupScale(i, g) * static_cast<float>(dot);
        }
        if constexpr (Type::kHasOffset) part += c * xq.s[i];
        out.y[m * out.ldy + n0 + r] += part;
      }
    }
  }
}

#ifdef TOKENSERVE_CPU_X86
// ---- SIMD -------------------------------------------------------------------------------------

struct MaddAvx2 {
  static constexpr const char* kName = "AVX2+FMA";
  TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) static inline __m256i Dot(__m256i u,
                                                                               __m256i s) {
    // |u| <= 128, |s| <= 127: a pair sums to at most 32512, so maddubs never saturates
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
  }
  TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) static inline __m256i Accumulate(
      __m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, Dot(u, s));
  }
};

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TOKENSERVE_GGUF_VNNI 1
struct DpbusdVnni {
  static constexpr const char* kName = "AVX512-VNNI";
  TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) static inline __m256i Dot(__m256i u,
                                                                               __m256i s) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
  }
  TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) static inline __m256i Accumulate(
      __m256i acc, __m256i u, __m256i s) {
    return _mm256_dpbusd_epi32(acc, u, s);
  }
};
#endif

// The dot product's operands from a block's values w and an activation block x: unsigned u
// and signed s with u * s == w * x per byte. 4-bit values are already unsigned; Q8_0's move
// their sign onto x (|w| <= 128 read as unsigned, sign(x, w) within +-127).
template <class Type>
TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) inline __m256i Unsigned(__m256i w) {
  if constexpr (Type::kSigned) return _mm256_abs_epi8(w);
  return w;
}
template <class Type>
TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) inline __m256i Signed(__m256i x, __m256i w) {
  if constexpr (Type::kSigned) return _mm256_sign_epi8(x, w);
  return x;
}

// How far ahead of the block in use the row kernels prefetch their weight stream into L1.
constexpr int64 kPrefetchBytes = 1024;

// Block b of one weight row against rows m0 .. m0 + R - 1 of x, into acc (and corr: the
// float offset's term, Q4_1's).
template <class Type, class Dot, int R>
TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) inline void BlockStep(
    const Q8Rows& xq, int64 m0, const uint8_t* row, int64 b, __m256* acc, float* corr) {
  const uint8_t* block = row + b * Type::kBytes;
  _mm_prefetch(reinterpret_cast<const char*>(block) + kPrefetchBytes, _MM_HINT_T0);
  const __m256i w = LoadValues<Type>(block);
  const __m256i u = Unsigned<Type>(w);
  const float d = ScaleF16c(block);
  const float c = LoadOffset<Type>(block, d);
  for (int i = 0; i < R; ++i) {
    const int64 at = xq.Index(m0 + i, b);
    const __m256i x =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + at * kBlock));
    __m256i dot = Dot::Dot(u, Signed<Type>(x, w));
    // v - o in every lane, exactly, in the integers: one vector op per block where the
    // offset's float term was a scalar chain beside the vector work (Gemma 3's Q5_0 layers;
    // docs/gguf.md has the step's A/B)
    if constexpr (Type::kIntOffset > 0) {
      dot = _mm256_sub_epi32(
          dot, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.LaneSums(at))));
    }
    // lane l holds values 4l..4l+3: each lane's own group scale
    const __m256 scales = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_loadu_ps(xq.Lanes(at)));
    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scales, acc[i]);
    if constexpr (Type::kHasOffset && Type::kIntOffset == 0) corr[i] += c * xq.s[at];
  }
}

// Rows m0 .. m0 + R - 1 of x against one weight row. Even and odd blocks feed two chains of
// FMAs: one chain waits out the FMA's latency every block, which at one row of x left a
// Q8_0 head (Gemma 3's 262k rows) 13 % short of the memory's read rate on one core; two
// reach it. Every R sums in the same order, so a row of x gets the same bits at any row count.
template <class Type, class Dot, int R>
TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) inline void RowGroup(
    const Q8Rows& xq, int64 m0, const uint8_t* row, float* y, int64 ldy) {
  __m256 even[R], odd[R];
  float corr[R];
  for (int i = 0; i < R; ++i) {
    even[i] = odd[i] = _mm256_setzero_ps();
    corr[i] = 0.f;
  }
  int64 b = 0;
  // unrolled: at one or two rows of x the loop's own counting was a fifth of its instructions
#pragma GCC unroll 2
  for (; b + 2 <= xq.blocks; b += 2) {
    BlockStep<Type, Dot, R>(xq, m0, row, b, even, corr);
    BlockStep<Type, Dot, R>(xq, m0, row, b + 1, odd, corr);
  }
  if (b < xq.blocks) BlockStep<Type, Dot, R>(xq, m0, row, b, even, corr);
  for (int i = 0; i < R; ++i) {
    y[(m0 + i) * ldy] = cpu::HorizontalSum(_mm256_add_ps(even[i], odd[i])) + corr[i];
  }
}

// Output rows [n0, n0 + count), one weight row at a time against every row of x, four rows
// of x at a time.
template <class Type, class Dot>
TOKENSERVE_GGUF_SIMD void RowsSimd(const Q8Rows& xq, int64 M, const uint8_t* w, int64 row_bytes,
                                   int64 n0, int64 count, Output out) {
  for (int64 n = n0; n < n0 + count; ++n) {
    const uint8_t* row = w + n * row_bytes;
    float* y = out.y + n;
    int64 m = 0;
    for (; m + 4 <= M; m += 4) RowGroup<Type, Dot, 4>(xq, m, row, y, out.ldy);
    switch (M - m) {
      case 3: RowGroup<Type, Dot, 3>(xq, m, row, y, out.ldy); break;
      case 2: RowGroup<Type, Dot, 2>(xq, m, row, y, out.ldy); break;
      case 1: RowGroup<Type, Dot, 1>(xq, m, row, y, out.ldy); break;
      default: break;
    }
  }
}

#endif  // TOKENSERVE_CPU_X86

}  // namespace gguf
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_GGUF_KERNELS_H_
