// The K-quant kernels on AVX2 (gguf_matmul.cc): Q4_K, Q5_K and Q6_K super-blocks as stored
// against q8_K activations, with integer dot products (maddubs + madd), the same formula as
// the scalar reference (gguf_kquants.h):
//   dx * (d * sum_j scale_j * sum_{i in j} q_i m_i qx_i + dm * sum_j min_j bsums_j)
// Each super-block is unpacked into registers in one form (KBlockAvx2): eight vectors of 32
// unsigned values q, and per vector a madd operand holding its two sixteens' scales. Then per
// row of x and vector: one maddubs (q * qx, pairs: at most 2 * 63 * 127, no saturation), one
// multiply of the scales by the activations' step multiples (scale * m, at most 128 * 16),
// one madd by those (pairs * scale * m, summed into int32) and one add; per super-block and row
// two conversions and two FMAs (the d and dm terms, the latter from the bsums by one madd).
//
// Decode rows (a few rows of x): each weight row read once, front to back, each super-block
// unpacked once for up to four rows of x (KRowsAvx2). More rows (prefill chunks, many
// streams): each weight row is unpacked once into a per-thread buffer (about 2.2 bytes a
// weight: it stays in L1 for a few thousand K) and every row of x sweeps it, four at a time
// (KRowsBufferedAvx2), so a weight's bytes are read and unpacked once a call.
#ifndef TOKENSERVE_KERNELS_GGUF_KQUANTS_AVX2_H_
#define TOKENSERVE_KERNELS_GGUF_KQUANTS_AVX2_H_

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu.h"
#include "gguf_blocks.h"
#include "gguf_kernels.h"
#include "gguf_kquants.h"
#include "gguf_q8k.h"

namespace tokenserve {
namespace gguf {

#ifdef TOKENSERVE_CPU_X86

// A super-block in KBlock's form, in vectors: values 32c .. 32c + 31 in q[c], one byte each;
// scale[c] the madd operand for q[c]'s maddubs pairs: sixteen 2c's scale in its low eight
// int16 lanes, 2c + 1's in its high eight; min the 16 mins (int16), one a sixteen.
struct KBlockAvx2 {
  __m256i q[8], scale[8], min;
  float d, dm;
};

// Rows of x taken together by one pass over the weights: four accumulators, and each unpacked
// vector used four times while it is in a register.
constexpr int kKRowGroup = 4;

// A shuffle_epi8 index pair that picks int16 lane j of a 128-bit lane.
constexpr int PickInt16(int j) { return (2 * j + 1) << 8 | (2 * j); }

// scale[c] from the 16 sixteens' scales (int16 lane j: sixteen j's).
TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) inline void ChunkScales(__m256i s16,
                                                                           __m256i scale[8]) {
  const __m256i low = _mm256_permute2x128_si256(s16, s16, 0x00);   // sixteens 0..7, twice
  const __m256i high = _mm256_permute2x128_si256(s16, s16, 0x11);  // sixteens 8..15, twice
  for (int c = 0; c < 8; ++c) {
    const int j = 2 * (c % 4);  // q[c]'s sixteens are j and j + 1 of their half
    // bytes of int16 lane j repeated in the low 128 bits, of lane j + 1 in the high
    const __m256i pick = _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(PickInt16(j + 1))),
                                          _mm_set1_epi16(static_cast<int16_t>(PickInt16(j))));
    scale[c] = _mm256_shuffle_epi8(c < 4 ? low : high, pick);
  }
}

// Eight uint8 -> sixteen int16, each twice (a sub-block of 32's value for both its sixteens).
TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) inline __m256i Twice16(const uint8_t v[8]) {
  const __m128i wide = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v)));
  return _mm256_set_m128i(_mm_unpackhi_epi16(wide, wide), _mm_unpacklo_epi16(wide, wide));
}

// Q4_K's and Q5_K's d, dmin, scales and mins.
TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) inline void UnpackScalesMinsAvx2(
    const uint8_t* block, KBlockAvx2* out) {
  uint8_t scales[8], mins[8];
  UnpackScalesMins(block + 4, scales, mins);
  ChunkScales(Twice16(scales), out->scale);
  out->min = Twice16(mins);
  out->d = ScaleF16c(block);
  out->dm = -ScaleF16c(block + 2);
}

TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) inline __m256i Load256(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// Bit j of each byte of qh, as 16 (a 5-bit value's bit 4).
TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) inline __m256i HighBit(__m256i qh, int j) {
  const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << j));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(16));
}

// v's bits in `mask`, in every byte.
TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) inline __m256i Bits(__m256i v, int mask) {
  return _mm256_and_si256(v, _mm256_set1_epi8(static_cast<char>(mask)));
}

template <class Type>
void UnpackAvx2(const uint8_t* block, KBlockAvx2* out);

template <>
TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) inline void UnpackAvx2<Q4_K>(
    const uint8_t* block, KBlockAvx2* out) {
  UnpackScalesMinsAvx2(block, out);
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  for (int i = 0; i < 4; ++i) {  // 32 nibble bytes: sub-blocks 2i (low) and 2i + 1 (high)
    const __m256i v = Load256(block + 16 + 32 * i);
    out->q[2 * i] = _mm256_and_si256(v, low4);
    out->q[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
  }
}

template <>
TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) inline void UnpackAvx2<Q5_K>(
    const uint8_t* block, KBlockAvx2* out) {
  UnpackScalesMinsAvx2(block, out);
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i qh = Load256(block + 16);
  for (int i = 0; i < 4; ++i) {
    const __m256i v = Load256(block + 48 + 32 * i);
    out->q[2 * i] = _mm256_or_si256(_mm256_and_si256(v, low4), HighBit(qh, 2 * i));
    out->q[2 * i + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4),
                                        HighBit(qh, 2 * i + 1));
  }
}

template <>
TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) inline void UnpackAvx2<Q6_K>(
    const uint8_t* block, KBlockAvx2* out) {
  const __m256i s16 = _mm256_cvtepi8_epi16(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192)));
  ChunkScales(s16, out->scale);
  out->min = _mm256_mullo_epi16(s16, _mm256_set1_epi16(-32));
  out->d = out->dm = ScaleF16c(block + 208);
  for (int half = 0; half < 2; ++half) {
    const __m256i l0 = Load256(block + 64 * half), l1 = Load256(block + 64 * half + 32);
    const __m256i qh = Load256(block + 128 + 32 * half);
    // value 32 g + l of the half: a nibble of l0 or l1, and bits 2g, 2g + 1 of qh as 16, 32
    // (16-bit shifts of masked bytes move no bit into the other byte)
    out->q[4 * half] = _mm256_or_si256(Bits(l0, 0x0f), _mm256_slli_epi16(Bits(qh, 0x03), 4));
    out->q[4 * half + 1] = _mm256_or_si256(Bits(l1, 0x0f), _mm256_slli_epi16(Bits(qh, 0x0c), 2));
    out->q[4 * half + 2] = _mm256_or_si256(Bits(_mm256_srli_epi16(l0, 4), 0x0f), Bits(qh, 0x30));
    out->q[4 * half + 3] = _mm256_or_si256(Bits(_mm256_srli_epi16(l1, 4), 0x0f),
                                           _mm256_srli_epi16(Bits(qh, 0xc0), 2));
  }
}

// Chunk c's four step multiples (bytes) as the int16 lanes of its maddubs pairs: lanes 0-3
// (values 0-7) m_0, 4-7 m_1, 8-11 m_2, 12-15 m_3, zero-extended.
TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) inline __m256i ExpandMultiples(
    const uint8_t* four) {
  int32_t bytes;
  std::memcpy(&bytes, four, 4);
  const __m256i pick = _mm256_setr_epi8(0, -1, 0, -1, 0, -1, 0, -1, 1, -1, 1, -1, 1, -1, 1, -1,
                                        2, -1, 2, -1, 2, -1, 2, -1, 3, -1, 3, -1, 3, -1, 3, -1);
  return _mm256_shuffle_epi8(_mm256_set1_epi32(bytes), pick);
}

// Rows m0 .. m0 + R - 1 of x against super-block b of a weight row: acc[i] gains eight lanes
// whose sum is that row's part of the dot product. One row at a time, each with one chain of
// adds: with a chain per row interleaved, GCC summed the 8 x R products as a tree and spilled
// most of them to the stack.
template <int R>
TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) inline void DotRows(const KBlockAvx2& w,
                                                                       const Q8KRows& xq,
                                                                       int64 m0, int64 b,
                                                                       __m256* acc) {
  const __m256 d = _mm256_set1_ps(w.d), dm = _mm256_set1_ps(w.dm);
  for (int i = 0; i < R; ++i) {
    const int64 at = xq.Index(m0 + i, b);
    const int8_t* x = xq.Values(at);
    const uint8_t* multiples = xq.Multiples(at);
    __m256i sum = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * c));
      const __m256i m = ExpandMultiples(multiples + 4 * c);
      sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(w.q[c], qx),
                                                    _mm256_mullo_epi16(w.scale[c], m)));
    }
    const __m256i bsums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.Sums(at)));
    const __m256i mins = _mm256_madd_epi16(w.min, bsums);
    // d * sum + dm * mins, times dx
    const __m256 part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), dm,
                                        _mm256_mul_ps(_mm256_cvtepi32_ps(sum), d));
    acc[i] = _mm256_fmadd_ps(part, _mm256_broadcast_ss(&xq.d[at]), acc[i]);
  }
}

// How far ahead of the super-block in use the row kernel prefetches its weight stream.
constexpr int64 kKPrefetchBytes = 1024;

// Rows m0 .. m0 + R - 1 of x against one weight row, unpacking each super-block on the way.
template <class Type, int R>
TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) inline void KRowGroup(
    const Q8KRows& xq, int64 m0, const uint8_t* row, float* y, int64 ldy) {
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64 b = 0; b < xq.blocks; ++b) {
    const uint8_t* block = row + b * Type::kBytes;
    for (int line = 0; line < Type::kBytes; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(block) + kKPrefetchBytes + line, _MM_HINT_T0);
    }
    KBlockAvx2 w;
    UnpackAvx2<Type>(block, &w);
    DotRows<R>(w, xq, m0, b, acc);
  }
  for (int i = 0; i < R; ++i) y[(m0 + i) * ldy] = cpu::HorizontalSum(acc[i]);
}

// Rows m0 .. m0 + R - 1 of x against one weight row unpacked in `row`.
template <int R>
TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) inline void KBufferedGroup(
    const Q8KRows& xq, int64 m0, const KBlockAvx2* row, float* y, int64 ldy) {
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64 b = 0; b < xq.blocks; ++b) DotRows<R>(row[b], xq, m0, b, acc);
  for (int i = 0; i < R; ++i) y[(m0 + i) * ldy] = cpu::HorizontalSum(acc[i]);
}

// The groups of up to four rows of x that cover rows 0 .. M - 1: group(count, m0).
template <class Group>
TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) inline void ForRowGroups(int64 M,
                                                                            Group group) {
  int64 m = 0;
  for (; m + kKRowGroup <= M; m += kKRowGroup) group(std::integral_constant<int, 4>(), m);
  switch (M - m) {
    case 3: group(std::integral_constant<int, 3>(), m); break;
    case 2: group(std::integral_constant<int, 2>(), m); break;
    case 1: group(std::integral_constant<int, 1>(), m); break;
    default: break;
  }
}

// Output rows [n0, n0 + count): each weight row read once against up to four rows of x at a
// time (for M > 4, once per four: use KRowsBufferedAvx2 there).
template <class Type>
TOKENSERVE_GGUF_SIMD void KRowsAvx2(const Q8KRows& xq, int64 M, const uint8_t* w,
                                    int64 row_bytes, int64 n0, int64 count, Output out) {
  for (int64 n = n0; n < n0 + count; ++n) {
    const uint8_t* row = w + n * row_bytes;
    float* y = out.y + n;
    ForRowGroups(M, [&](auto rows, int64 m) TOKENSERVE_GGUF_SIMD {
      KRowGroup<Type, decltype(rows)::value>(xq, m, row, y, out.ldy);
    });
  }
}

// The same, each weight row unpacked once into `buffer` (a thread's own) for all rows of x.
template <class Type>
TOKENSERVE_GGUF_SIMD void KRowsBufferedAvx2(const Q8KRows& xq, int64 M, const uint8_t* w,
                                            int64 row_bytes, int64 n0, int64 count,
                                            std::vector<KBlockAvx2>* buffer, Output out) {
  buffer->resize(xq.blocks);
  KBlockAvx2* unpacked = buffer->data();
  for (int64 n = n0; n < n0 + count; ++n) {
    const uint8_t* row = w + n * row_bytes;
    for (int64 b = 0; b < xq.blocks; ++b) UnpackAvx2<Type>(row + b * Type::kBytes, &unpacked[b]);
    float* y = out.y + n;
    ForRowGroups(M, [&](auto rows, int64 m) TOKENSERVE_GGUF_SIMD {
      KBufferedGroup<decltype(rows)::value>(xq, m, unpacked, y, out.ldy);
    });
  }
}

#endif  // TOKENSERVE_CPU_X86

}  // namespace gguf
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_GGUF_KQUANTS_AVX2_H_
