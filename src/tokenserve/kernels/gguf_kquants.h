// GGUF K-quant super-blocks (256 values each) as a file stores them, the one form every type
// decodes to for the integer dot product with q8_K activations (gguf_q8k.h), and the portable
// scalar kernel: the reference for the AVX2 kernels (gguf_kquants_avx2.h), which compute the
// same integer sums and the same float formula, and the path of CPUs without AVX2.
//
// Layouts (ggml's block_q4_K, block_q5_K, block_q6_K; fp16 fields little-endian):
//   Q4_K 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes nibbles
//   Q5_K 176 bytes: as Q4_K, then 32 bytes of high bits (qh), then 128 bytes of nibbles
//   Q6_K 210 bytes: 128 bytes low nibbles (ql), 64 bytes of 2-bit highs (qh),
//                   16 int8 scales, fp16 d (last)
// Q4_K/Q5_K: 8 sub-blocks of 32, w = d * scale_j * v - dmin * min_j. Sub-blocks 2i and 2i + 1
// are the low and high nibbles of nibble bytes [32 i, 32 i + 32); Q5_K's bit 4 of sub-block j
// is bit j of qh[l]. Q6_K: two halves of 128, each from 64 ql bytes and 32 qh bytes; its 16
// sub-blocks of 16 take w = d * scale_j * (v - 32) in value order.
//
// The one form (KBlock): for value i of the super-block,
//   w_i = d * scale[i / 16] * q_i + dm * min[i / 16],   q_i unsigned (0..63), scale, min int16
// Q4_K/Q5_K: each sub-block's scale and min repeated for its two sixteens, dm = -dmin.
// Q6_K: q = v (0..63) and its -32 moved into the offset: min = -32 * scale, dm = d.
// Against a q8_K block (x ~= dx * m_i * qx_i, m_i the step multiple of value i's group of
// 8, bsums the sums of m_i * qx_i over each sixteen; gguf_q8k.h):
//   sum_i w_i x_i ~= dx * (d * sum_j scale_j * sum_{i in j} q_i m_i qx_i
//                          + dm * sum_j min_j bsums_j)
// two integer sums and two float multiply-adds a super-block and row of x. The AVX2 kernels
// sum the first in eight int32 lanes, each over 32 values of the block: at most
// 32 * 63 * 127 * 128 * 16 = 5.2e8 (Q6_K's widest), and the second per pair of sixteens:
// 2 * 4096 * 32512 = 2.7e8; the scalar kernel sums in int64.
#ifndef TOKENSERVE_KERNELS_GGUF_KQUANTS_H_
#define TOKENSERVE_KERNELS_GGUF_KQUANTS_H_

#include <cstdint>
#include <cstring>

#include "gguf_blocks.h"
#include "gguf_q8k.h"

namespace tokenserve {
namespace gguf {

struct KBlock {
  uint8_t q[kSuperBlock];
  int16_t scale[kSixteens], min[kSixteens];
  float d, dm;
};

// Q4_K/Q5_K's 12 packed bytes -> the 8 sub-blocks' 6-bit scales and mins (ggml's
// get_scale_min_k4, four sub-blocks a 32-bit word): sub-blocks 0..3 are the low 6 bits of
// bytes 0..3 (scales) and 4..7 (mins); 4..7 are the nibbles of bytes 8..11 (low: scale, high:
// min) with bits 4-5 from the top two bits of bytes 0..3 (scales) and 4..7 (mins).
inline void UnpackScalesMins(const uint8_t* packed, uint8_t scales[8], uint8_t mins[8]) {
  uint32_t a, b, c;
  std::memcpy(&a, packed, 4);
  std::memcpy(&b, packed + 4, 4);
  std::memcpy(&c, packed + 8, 4);
  const uint32_t scales_low = a & 0x3f3f3f3fu, mins_low = b & 0x3f3f3f3fu;
  const uint32_t scales_high = (c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u);
  const uint32_t mins_high = ((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u);
  std::memcpy(scales, &scales_low, 4);
  std::memcpy(scales + 4, &scales_high, 4);
  std::memcpy(mins, &mins_low, 4);
  std::memcpy(mins + 4, &mins_high, 4);
}

// Q4_K's and Q5_K's common part: d, dmin, scales and mins, and the nibbles of sub-block
// pairs from `nibbles` (128 bytes).
inline void DecodeQ4KLike(const uint8_t* block, const uint8_t* nibbles, KBlock* out) {
  uint8_t scales[8], mins[8];
  UnpackScalesMins(block + 4, scales, mins);
  for (int j = 0; j < kSixteens; ++j) {
    out->scale[j] = scales[j / 2];
    out->min[j] = mins[j / 2];
  }
  out->d = HalfToFloat(LoadHalfBits(block));
  out->dm = -HalfToFloat(LoadHalfBits(block + 2));
  for (int i = 0; i < 4; ++i) {
    for (int l = 0; l < 32; ++l) {
      out->q[64 * i + l] = nibbles[32 * i + l] & 0x0f;
      out->q[64 * i + 32 + l] = nibbles[32 * i + l] >> 4;
    }
  }
}

struct Q4_K {
  static constexpr const char* kName = "q4_k";
  static constexpr int kBytes = 144;
  static void Decode(const uint8_t* block, KBlock* out) { DecodeQ4KLike(block, block + 16, out); }
};

struct Q5_K {
  static constexpr const char* kName = "q5_k";
  static constexpr int kBytes = 176;
  static void Decode(const uint8_t* block, KBlock* out) {
    DecodeQ4KLike(block, block + 48, out);
    const uint8_t* qh = block + 16;
    for (int j = 0; j < 8; ++j) {
      for (int l = 0; l < 32; ++l) out->q[32 * j + l] |= ((qh[l] >> j) & 1) << 4;
    }
  }
};

struct Q6_K {
  static constexpr const char* kName = "q6_k";
  static constexpr int kBytes = 210;
  static void Decode(const uint8_t* block, KBlock* out) {
    const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
    for (int j = 0; j < kSixteens; ++j) {
      out->scale[j] = scales[j];
      out->min[j] = static_cast<int16_t>(-32 * scales[j]);
    }
    out->d = out->dm = HalfToFloat(LoadHalfBits(block + 208));
    for (int half = 0; half < 2; ++half) {
      const uint8_t* ql = block + 64 * half;
      const uint8_t* qh = block + 128 + 32 * half;
      uint8_t* q = out->q + 128 * half;
      for (int l = 0; l < 32; ++l) {  // value 32 g + l of the half: qh's bits 2g, 2g + 1
        q[l] = (ql[l] & 0x0f) | ((qh[l] & 3) << 4);
        q[l + 32] = (ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4);
        q[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
        q[l + 96] = (ql[l + 32] >> 4) | ((qh[l] >> 6) << 4);
      }
    }
  }
};

// One super-block's dot product with one q8_K block: the formula above.
inline float DotScalar(const KBlock& w, const int8_t* qx, const int16_t* bsums,
                       const uint8_t* multiples, float dx) {
  int64_t sum_q = 0, sum_min = 0;
  for (int j = 0; j < kSixteens; ++j) {
    int32_t dot = 0;
    for (int g = 2 * j; g < 2 * j + 2; ++g) {  // a sixteen's two groups of 8
      int32_t group = 0;
      for (int l = 8 * g; l < 8 * g + 8; ++l) group += int32_t{w.q[l]} * int32_t{qx[l]};
      dot += int32_t{multiples[g]} * group;
    }
    sum_q += int64_t{w.scale[j]} * dot;
    sum_min += int64_t{w.min[j]} * int64_t{bsums[j]};
  }
  return (w.d * dx) * static_cast<float>(sum_q) + (w.dm * dx) * static_cast<float>(sum_min);
}

// Output rows [n0, n0 + count) of y[M, N] = x @ dequant(w).T (y[m * ldy + n]), each weight
// row read once, each super-block decoded once for all M rows of x.
template <class Type>
void KQuantRowsScalar(const Q8KRows& xq, int64 M, const uint8_t* w, int64 row_bytes, int64 n0,
                      int64 count, float* y, int64 ldy) {
  KBlock decoded;
  for (int64 n = n0; n < n0 + count; ++n) {
    const uint8_t* row = w + n * row_bytes;
    for (int64 m = 0; m < M; ++m) y[m * ldy + n] = 0.f;
    for (int64 b = 0; b < xq.blocks; ++b) {
      Type::Decode(row + b * Type::kBytes, &decoded);
      for (int64 m = 0; m < M; ++m) {
        const int64 i = xq.Index(m, b);
        y[m * ldy + n] += DotScalar(decoded, xq.Values(i), xq.Sums(i), xq.Multiples(i),
                                     xq.d[i]);
      }
    }
  }
}

}  // namespace gguf
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_GGUF_KQUANTS_H_
