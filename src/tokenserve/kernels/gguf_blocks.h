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
// quantized once per matmul into Q8 blocks of 32 with a float scale dx for each group of
// kGroup values and the float sum sx = sum_g dx_g * sum(qx in g), so one block's contribution
// to an output is
//   sum_j w_j x_j ~= d * sum_g dx_g * sum_{j in g} v_j qx_j + c * sx
// integer dot products (maddubs/madd, or dpbusd) and a float multiply-add per group. One
// activation format serves every type: Q8_0 weights ignore sx.
//
// llama.cpp's q8_0/q8_1 keep one scale per 32 values. A residual stream's few large channels
// then set the step of every value in their block: on SmolLM2's Q4_1 file that cost +0.37 %
// perplexity and 2.5 % of greedy tokens against the dequantized model, where a scale per 16
// values measured +0.20 % and 98.1 %, per 8 values +0.04 % and 98.8 % (8,192 tokens, the
// activation-error experiment in benchmarks/experiments). A scale per 8 costs the row kernels
// nothing: their int32 lanes already hold groups of four values apart (lane l: values
// 4l..4l+3), so the scales are a vector of lanes in place of a broadcast one. The tile
// kernel (gguf_tiles.h) finishes each group on its own, about a quarter more work.
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
  static constexpr int kIntOffset = 8;  // the offset is -kIntOffset * d
  static float Offset(const uint8_t*, float d) { return -8.f * d; }
};

struct Q4_1 {
  static constexpr const char* kName = "q4_1";
  static constexpr int kBytes = 20;
  static constexpr int kNibbles = 4;
  static constexpr int kHighBits = 0, kMaxValue = 15;
  static constexpr bool kSigned = false, kHasOffset = true;
  static constexpr int kIntOffset = 0;  // none: a float offset of its own (block + 2)
  static float Offset(const uint8_t* block, float) { return HalfToFloat(LoadHalfBits(block + 2)); }
};

struct Q5_0 {
  static constexpr const char* kName = "q5_0";
  static constexpr int kBytes = 22;
  static constexpr int kNibbles = 6;
  static constexpr int kHighBits = 2, kMaxValue = 31;
  static constexpr bool kSigned = false, kHasOffset = true;
  static constexpr int kIntOffset = 16;
  static float Offset(const uint8_t*, float d) { return -16.f * d; }
};

struct Q8_0 {
  static constexpr const char* kName = "q8_0";
  static constexpr int kBytes = 34;
  static constexpr int kHighBits = 0, kMaxValue = 127;
  static constexpr bool kSigned = true, kHasOffset = false;
  static constexpr int kIntOffset = 0;
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

constexpr int kGroup = 8;                // activation values a scale
constexpr int kGroups = kBlock / kGroup;  // scales an activation block
constexpr int kLanes = 8;                 // int32 lanes of a block's dot product: 4 values each

#ifdef TOKENSERVE_CPU_X86
// q8::QuantizeAvx2's bytes and scales for each group of kGroup values: q[0, 32) and the
// groups' scales d (the scalar path's too: q8::QuantizeScalar per group).
TOKENSERVE_AVX2_FMA inline void QuantizeGroupsAvx2(const float* x, int8_t* q, float* d) {
  __m256 inv[4];
  bool bad = false;
  for (int g = 0; g < kGroups; ++g) {
    const float amax = q8::AbsMaxAvx2(x + g * kGroup, kGroup);
    bad = bad || std::isnan(amax);
    d[g] = amax / 127.f;  // NaN with amax
    const __m256 value = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);  // 0 for NaN
    for (int i = 0; i < kGroup / 8; ++i) inv[g * (kGroup / 8) + i] = value;
  }
  q8::Round32Avx2(x, inv, q);
  if (bad) {  // a group with a NaN or an infinity: q = 0 there, as QuantizeScalar leaves it
    for (int g = 0; g < kGroups; ++g) {
      if (std::isnan(d[g])) std::memset(q + g * kGroup, 0, kGroup);
    }
  }
}
#endif

// x [M, K] (K a multiple of 32) as Q8 blocks: row m's block b is number i = m * blocks + b,
// its 32 int8 at q[i * 32], its group scales as lanes at d[i * 8 + l] (lane l holds values
// 4l..4l+3; the lanes of a group repeat its scale), sx at s[i], and for a weight type with an
// integer offset o (Q4_0, Q5_0) each lane's o * sum of its four q at sums[i * 8 + l] (the row
// kernels fold the offset into the integer dot product: (v - o) . q = v . q - o * sum(q)).
// x ~= q * d. A group holding a NaN or an infinity gets q = 0 and d = NaN, so the outputs it
// feeds become NaN (as a float matmul's would) rather than finite garbage. With group sums
// asked for, each group's o * sum of its q too, at group_sums[i * 4 + g] (the packed kernel's
// form of the same fold, gguf_packed.h).
struct Q8Rows {
  int64 blocks = 0;  // per row: K / 32
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> sums, group_sums;
  const int8_t* Values(int64 m, int64 b) const { return q.data() + (m * blocks + b) * kBlock; }
  int64 Index(int64 m, int64 b) const { return m * blocks + b; }
  const float* Lanes(int64 i) const { return d.data() + i * kLanes; }
  const int32_t* LaneSums(int64 i) const { return sums.data() + i * kLanes; }
  const int32_t* GroupSums(int64 i) const { return group_sums.data() + i * kGroups; }
  float GroupScale(int64 i, int g) const { return d[i * kLanes + g * (kGroup / 4)]; }
};

// One block: each group's q and d as q8_quantize.h makes them (SIMD or not, the same bytes
// and scales), the scales spread over their lanes, s = sum_g d_g * sum(q_g), and with an
// integer offset the lanes' sums of q times it.
inline void QuantizeBlock(const float* x, bool simd, int8_t* q, float* lanes, float* s,
                          int32_t offset, int32_t* sums) {
  float d[kGroups];
#ifdef TOKENSERVE_CPU_X86
  if (simd) QuantizeGroupsAvx2(x, q, d);
#else
  simd = false;
#endif
  if (!simd) {
    for (int g = 0; g < kGroups; ++g) {
      d[g] = q8::QuantizeScalar(x + g * kGroup, kGroup, q + g * kGroup);
    }
  }
  float sum = 0.f;
  for (int g = 0; g < kGroups; ++g) {
    int32_t total = 0;
    for (int i = 0; i < kGroup; ++i) total += q[g * kGroup + i];
    sum += d[g] * static_cast<float>(total);  // NaN with d
    for (int l = 0; l < kGroup / 4; ++l) lanes[g * (kGroup / 4) + l] = d[g];
  }
  *s = sum;
  if (offset == 0) return;
  for (int l = 0; l < kLanes; ++l) {
    sums[l] = offset * (q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3]);
  }
}

#ifdef TOKENSERVE_CPU_X86
// What every SIMD function here and in gguf_kernels.h is compiled for (on top of the build's
// flags); call them only after cpu::HasAvx2FmaF16c().
#define TOKENSERVE_GGUF_SIMD __attribute__((target("avx2,fma,f16c")))

TOKENSERVE_GGUF_SIMD inline float ScaleF16c(const uint8_t* block) {
  return _cvtsh_ss(LoadHalfBits(block));
}

// 16 in byte j where bit j of the uint32 at `at` is set, else 0: Q5_0's fifth bits as values
// to OR onto the nibbles (bit j to byte j as llama.cpp's bytes_from_bits_32).
TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) inline __m256i FifthBits(
    const uint8_t* at) {
  uint32_t bits;
  std::memcpy(&bits, at, sizeof(bits));
  const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                            0x0101010101010101, 0x0000000000000000);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), shuffle);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  bytes = _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));  // 0xff where bit j is set
  return _mm256_and_si256(bytes, _mm256_set1_epi8(0x10));
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
    } else {
      return _mm256_or_si256(low, FifthBits(block + Type::kHighBits));
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

// x [M, K] into `out`, every block of every row (K a multiple of 32), for weights whose
// integer offset is `offset` (Type::kIntOffset; 0: none, and no sums), with the offset's sums
// per group (group_sums) or per lane.
inline void QuantizeRows(const float* x, int64 M, int64 K, bool simd, Q8Rows* out,
                         int32_t offset, bool group_sums = false) {
  out->blocks = K / kBlock;
  out->q.resize(M * K);
  out->d.resize(M * out->blocks * kLanes);
  out->s.resize(M * out->blocks);
  out->sums.resize(offset == 0 ? 0 : M * out->blocks * kLanes);
  for (int64 i = 0; i < M * out->blocks; ++i) {
    // row m's block b is x[m * K + b * 32]: contiguous
    QuantizeBlock(x + i * kBlock, simd, out->q.data() + i * kBlock, out->d.data() + i * kLanes,
                  &out->s[i], offset, out->sums.data() + (offset == 0 ? 0 : i * kLanes));
  }
  if (offset == 0 || !group_sums) return;
  out->group_sums.resize(M * out->blocks * kGroups);
  for (int64 i = 0; i < M * out->blocks * kGroups; ++i) {
    constexpr int kLanesAGroup = kGroup / 4;
    out->group_sums[i] = 0;
    for (int l = 0; l < kLanesAGroup; ++l) out->group_sums[i] += out->sums[i * kLanesAGroup + l];
  }
  out->sums.clear();
}

}  // namespace gguf
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_GGUF_BLOCKS_H_
