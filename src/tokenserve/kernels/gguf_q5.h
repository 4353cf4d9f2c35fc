// GGUF's Q5_0 blocks for the block matmul (gguf_matmul.cc), on the same kernels as Q4_0.
//
//   Q5_0  22 bytes: fp16 d, 4 bytes qh, 16 bytes of nibbles    w = d * (v - 16)
//
// A value v (0..31) is a nibble (byte j: value j in its low half, value j + 16 in its high
// half, as Q4_0) with its fifth bit from qh, read as a little-endian uint32 whose bit j is
// value j's. ggml writes Q5_0 where a row's K does not divide into the K-quants' 256-value
// super-blocks (Gemma 3 270M's K = 640 q/k and gate/up projections in its Q4_K_M file).
//
// In the common form of gguf_blocks.h (w = d * v + c) that is c = -16 d, v unsigned: the
// dot products pair it with the same Q8 activations as Q4_0 (maddubs pairs of at most
// 2 * 31 * 127 = 7874). Only the decode of a block's values is its own: DecodeValues and
// LoadValues specialised below; kMaxValue keeps the tile kernel from summing eight maddubs
// pairs in int16, which 5-bit values would overflow.
#ifndef TOKENSERVE_KERNELS_GGUF_Q5_H_
#define TOKENSERVE_KERNELS_GGUF_Q5_H_

#include <cstdint>
#include <cstring>

#include "cpu.h"
#include "gguf_blocks.h"

namespace tokenserve {
namespace gguf {

struct Q5_0 {
  static constexpr const char* kName = "q5_0";
  static constexpr int kBytes = 22;
  static constexpr int kHighBits = 2;  // where qh starts in the block
  static constexpr int kNibbles = 6;   // where the nibbles start
  static constexpr bool kSigned = false, kHasOffset = true;
  static float Offset(const uint8_t*, float d) { return -16.f * d; }
};

template <>
inline constexpr int kMaxValue<Q5_0> = 31;

inline uint32_t LoadHighBits(const uint8_t* block) {
  uint32_t qh;
  std::memcpy(&qh, block + Q5_0::kHighBits, sizeof(qh));  // little-endian, as ggml writes it
  return qh;
}

template <>
inline void DecodeValues<Q5_0>(const uint8_t* block, int8_t* v) {
  const uint32_t qh = LoadHighBits(block);
  const uint8_t* nibbles = block + Q5_0::kNibbles;
  for (int j = 0; j < kBlock / 2; ++j) {
    v[j] = static_cast<int8_t>((nibbles[j] & 0x0f) | (((qh >> j) & 1) << 4));
    v[j + kBlock / 2] = static_cast<int8_t>((nibbles[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
  }
}

#ifdef TOKENSERVE_CPU_X86
template <>
TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) inline __m256i LoadValues<Q5_0>(
    const uint8_t* block) {
  const __m128i packed =
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + Q5_0::kNibbles));
  const __m256i low = _mm256_and_si256(
      _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(0x0f));
  // byte j of a vector gets qh's byte j / 8, then bit j % 8 of it tested: 0x10 where set
  // (llama.cpp's bytes_from_bits_32)
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(LoadHighBits(block))),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_or_si256(low, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
}
#endif  // TOKENSERVE_CPU_X86

}  // namespace gguf
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_GGUF_Q5_H_
