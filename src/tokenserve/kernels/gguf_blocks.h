// GGUF weight blocks as a file stores them, and the q8 activation blocks that their integer
// dot products pair with (llama.cpp's vec_dot_type idea).
//
// ggml stores a weight [out, in] with `in` contiguous: each output's row is a run of blocks.
// The block types read here hold 32 values each:
//   Q4_0  18 bytes: fp16 d, 16 bytes of nibbles            w = d * (nibble - 8)
//   Q4_1  20 bytes: fp16 d, fp16 m, 16 bytes of nibbles    w = d * nibble + m
//   Q5_0  22 bytes: fp16 d, 32 high bits, 16 bytes of nibbles  w = d * (nibble + 16 bit - 16)
//   Q8_0  34 bytes: fp16 d, 32 int8 q                      w = d * q
// A nibble byte j holds value j in its low half and value j + 16 in its high half; Q5_0's
// bit j (of a little-endian uint32) is value j's fifth bit.
//
// Each type decodes to the same form: 32 small integers v (0..15 unsigned for the 4-bit types,
// 0..31 for Q5_0, -128..127 for Q8_0), a scale d and an offset c, with w = d * v + c for the
// whole block (Q4_0: c = -8 d; Q4_1: c = m; Q5_0: c = -16 d; Q8_0: c = 0). Activations are
// quantized once per matmul into Q8 blocks of 32 with a float scale dx and the float sum
// sx = dx * sum(qx) (llama.cpp's Q8_1, with float fields), so one block's contribution to an
// output is
//   sum_j w_j x_j ~= d * dx * sum_j v_j qx_j + c * sx
// one integer dot product (maddubs/madd, or dpbusd) and two float multiply-adds. One activation
// format serves every type: Q8_0 weights ignore sx.
//
// The K-quants (super-blocks of 256, gguf_kquants.h) pair with q8_K activations instead, one
// scale per 256 values, as llama.cpp pairs them (gguf_q8k.h).
#ifndef TOKENSERVE_KERNELS_GGUF_BLOCKS_H_
#define TOKENSERVE_KERNELS_GGUF_BLOCKS_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu.h"
#include "q8_quantize.h"

namespace tokenserve {
namespace gguf {

using int64 = int64_t;

constexpr int kBlock = 32;  // values per block of every type here, and per activation block

// IEEE half (the blocks' fp16 fields) to float, exactly; what F16C's vcvtph2ps computes.
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) {  // infinity or NaN
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float f = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -f : f;
  } else {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t LoadHalfBits(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));  // blocks are 18, 20 or 34 bytes apart: unaligned
  return h;
}

// ---- block types --------------------------------------------------------------------------
// Each: kBytes a block, kSigned (v signed: the dot product needs the sign trick), kHasOffset
// (c != 0 can occur: the sx term is needed), kHighBits (where Q5_0's fifth bits sit, else 0),
// kMaxValue (v's largest: what int16 sums of products can hold), and Offset: c from the
// block and its scale d.
// The scale d is every type's first two bytes (Scale); DecodeValues and LoadValues give v.

struct Q4_0 {
  static constexpr const char* kName = "q4_0";
  static constexpr int kBytes = 18;
  static constexpr int kNibbles = 2;  // where the nibbles start in the block
  static constexpr int kHighBits = 0, kMaxValue = 15;
  static constexpr bool kSigned = false, kHasOffset = true;
  static float Offset(const uint8_t*, float d) { return -8.f * d; }
};

struct Q4_1 {
  static constexpr const char* kName = "q4_1";
  static constexpr int kBytes = 20;
  static constexpr int kNibbles = 4;
  static constexpr int kHighBits = 0, kMaxValue = 15;
  static constexpr bool kSigned = false, kHasOffset = true;
  static float Offset(const uint8_t* block, float) { return HalfToFloat(LoadHalfBits(block + 2)); }
};

struct Q5_0 {
  static constexpr const char* kName = "q5_0";
  static constexpr int kBytes = 22;
  static constexpr int kNibbles = 6;
  static constexpr int kHighBits = 2, kMaxValue = 31;
  static constexpr bool kSigned = false, kHasOffset = true;
  static float Offset(const uint8_t*, float d) { return -16.f * d; }
};

struct Q8_0 {
  static constexpr const char* kName = "q8_0";
  static constexpr int kBytes = 34;
  static constexpr int kHighBits = 0, kMaxValue = 127;
  static constexpr bool kSigned = true, kHasOffset = false;
  static float Offset(const uint8_t*, float) { return 0.f; }
};

inline float Scale(const uint8_t* block) { return HalfToFloat(LoadHalfBits(block)); }

// The block's 32 values v (as int8: 0..15 or -128..127).
template <class Type>
void DecodeValues(const uint8_t* block, int8_t* v) {
  if constexpr (Type::kSigned) {
    std::memcpy(v, block + 2, kBlock);
  } else {
    const uint8_t* nibbles = block + Type::kNibbles;
    for (int j = 0; j < kBlock / 2; ++j) {
      v[j] = static_cast<int8_t>(nibbles[j] & 0x0f);
      v[j + kBlock / 2] = static_cast<int8_t>(nibbles[j] >> 4);
    }
    if constexpr (Type::kHighBits > 0) {
      uint32_t high;
      std::memcpy(&high, block + Type::kHighBits, sizeof(high));
      for (int j = 0; j < kBlock; ++j) v[j] = static_cast<int8_t>(v[j] | ((high >> j) & 1) << 4);
    }
  }
}

// ---- activations ----------------------------------------------------------------------------

// x [M, K] (K a multiple of 32) as Q8 blocks: row m's block b holds 32 int8 at
// q[(m * blocks + b) * 32], its scale at d[m * blocks + b] and dx * sum(qx) at s[...].
// x ~= q * d. A block holding a NaN or an infinity gets q = 0 and d = s = NaN, so the outputs
// it feeds become NaN (as a float matmul's would) rather than finite garbage.
struct Q8Rows {
  int64 blocks = 0;  // per row: K / 32
  std::vector<int8_t> q;
  std::vector<float> d, s;
  const int8_t* Values(int64 m, int64 b) const { return q.data() + (m * blocks + b) * kBlock; }
  int64 Index(int64 m, int64 b) const { return m * blocks + b; }
};

// One block: q and d as q8_quantize.h makes them (SIMD or not, the same bytes and scale),
// and s = d * sum(q).
inline void QuantizeBlock(const float* x, bool simd, int8_t* q, float* d, float* s) {
#ifdef TOKENSERVE_CPU_X86
  *d = simd ? q8::QuantizeAvx2(x, kBlock, q) : q8::QuantizeScalar(x, kBlock, q);
#else
  *d = q8::QuantizeScalar(x, kBlock, q);
#endif
  int32_t sum = 0;
  for (int i = 0; i < kBlock; ++i) sum += q[i];
  *s = *d * static_cast<float>(sum);  // NaN with d
}

#ifdef TOKENSERVE_CPU_X86
// What every SIMD function here and in gguf_kernels.h is compiled for (on top of the build's
// flags); call them only after cpu::HasAvx2FmaF16c().
#define TOKENSERVE_GGUF_SIMD __attribute__((target("avx2,fma,f16c")))

TOKENSERVE_GGUF_SIMD inline float ScaleF16c(const uint8_t* block) {
  return _cvtsh_ss(LoadHalfBits(block));
}

// The block's 32 values in order, one byte each (0..15, or Q8_0's int8).
template <class Type>
TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) inline __m256i LoadValues(
    const uint8_t* block) {
  if constexpr (Type::kSigned) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
  } else {
    const __m128i packed =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + Type::kNibbles));
    // low halves are values 0..15 (lower 128 bits), high halves 16..31 (upper 128 bits)
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
    const __m256i low = _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
    if constexpr (Type::kHighBits == 0) {
      return low;
    } else {  // bit j of the uint32 to byte j (as llama.cpp's bytes_from_bits_32), then 16
      uint32_t high;
      std::memcpy(&high, block + Type::kHighBits, sizeof(high));
      const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                0x0101010101010101, 0x0000000000000000);
      __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(high)), shuffle);
      const __m256i bit = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
      bytes = _mm256_or_si256(bytes, bit);  // 0xff where bit j is set
      bytes = _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
      return _mm256_or_si256(low, _mm256_and_si256(bytes, _mm256_set1_epi8(0x10)));
    }
  }
}

template <class Type>
TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) inline float LoadOffset(const uint8_t* block,
                                                                           float d) {
  if constexpr (std::is_same_v<Type, Q4_1>) return _cvtsh_ss(LoadHalfBits(block + 2));
  return Type::Offset(block, d);
}

#endif  // TOKENSERVE_CPU_X86

// x [M, K] into `out`, every block of every row (K a multiple of 32).
inline void QuantizeRows(const float* x, int64 M, int64 K, bool simd, Q8Rows* out) {
  out->blocks = K / kBlock;
  out->q.resize(M * K);
  out->d.resize(M * out->blocks);
  out->s.resize(M * out->blocks);
  for (int64 i = 0; i < M * out->blocks; ++i) {
    // row m's block b is x[m * K + b * 32]: contiguous
    QuantizeBlock(x + i * kBlock, simd, out->q.data() + i * kBlock, &out->d[i], &out->s[i]);
  }
}

}  // namespace gguf
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_GGUF_BLOCKS_H_
