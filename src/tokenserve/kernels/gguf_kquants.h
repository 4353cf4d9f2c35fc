// GGUF K-quant super-blocks (256 values each) as a file stores them, and the simplest kernel
// that reads them as stored: each super-block is decoded to 256 floats once per weight row and
// multiplied into every row of x in float32 (FMA). No activation quantization, so the results
// equal a float matmul by gguf's dequantized weights up to float summation order.
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
#ifndef TOKENSERVE_KERNELS_GGUF_KQUANTS_H_
#define TOKENSERVE_KERNELS_GGUF_KQUANTS_H_

#include <cstdint>

#include "cpu.h"
#include "gguf_blocks.h"

namespace tokenserve {
namespace gguf {

constexpr int kSuperBlock = 256;

// Sub-block j's 6-bit scale and min from Q4_K/Q5_K's 12 packed bytes (ggml's get_scale_min_k4).
inline void ScaleMinK4(int j, const uint8_t* q, int* scale, int* min) {
  if (j < 4) {
    *scale = q[j] & 63;
    *min = q[j + 4] & 63;
  } else {
    *scale = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
    *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

struct Q4_K {
  static constexpr const char* kName = "q4_k";
  static constexpr int kBytes = 144;
  static void Decode(const uint8_t* block, float* w) {
    const float d = HalfToFloat(LoadHalfBits(block)), dmin = HalfToFloat(LoadHalfBits(block + 2));
    const uint8_t* scales = block + 4;
    const uint8_t* qs = block + 16;
    for (int i = 0; i < 4; ++i, qs += 32, w += 64) {
      int s0, m0, s1, m1;
      ScaleMinK4(2 * i, scales, &s0, &m0);
      ScaleMinK4(2 * i + 1, scales, &s1, &m1);
      const float d0 = d * s0, c0 = dmin * m0, d1 = d * s1, c1 = dmin * m1;
      for (int l = 0; l < 32; ++l) {
        w[l] = d0 * (qs[l] & 0x0f) - c0;
        w[l + 32] = d1 * (qs[l] >> 4) - c1;
      }
    }
  }
};

struct Q5_K {
  static constexpr const char* kName = "q5_k";
  static constexpr int kBytes = 176;
  static void Decode(const uint8_t* block, float* w) {
    const float d = HalfToFloat(LoadHalfBits(block)), dmin = HalfToFloat(LoadHalfBits(block + 2));
    const uint8_t* scales = block + 4;
    const uint8_t* qh = block + 16;
    const uint8_t* qs = block + 48;
    for (int i = 0; i < 4; ++i, qs += 32, w += 64) {
      int s0, m0, s1, m1;
      ScaleMinK4(2 * i, scales, &s0, &m0);
      ScaleMinK4(2 * i + 1, scales, &s1, &m1);
      const float d0 = d * s0, c0 = dmin * m0, d1 = d * s1, c1 = dmin * m1;
      for (int l = 0; l < 32; ++l) {
        const int h0 = (qh[l] >> (2 * i)) & 1, h1 = (qh[l] >> (2 * i + 1)) & 1;
        w[l] = d0 * ((qs[l] & 0x0f) | (h0 << 4)) - c0;
        w[l + 32] = d1 * ((qs[l] >> 4) | (h1 << 4)) - c1;
      }
    }
  }
};

struct Q6_K {
  static constexpr const char* kName = "q6_k";
  static constexpr int kBytes = 210;
  static void Decode(const uint8_t* block, float* w) {
    const uint8_t* ql = block;
    const uint8_t* qh = block + 128;
    const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
    const float d = HalfToFloat(LoadHalfBits(block + 208));
    for (int half = 0; half < 2; ++half, ql += 64, qh += 32, scales += 8, w += 128) {
      for (int s = 0; s < 2; ++s) {  // sub-blocks of 16: value 32 g + l takes scale 2 g + l / 16
        const float d0 = d * scales[s], d1 = d * scales[s + 2], d2 = d * scales[s + 4],
                    d3 = d * scales[s + 6];
        for (int l = 16 * s; l < 16 * s + 16; ++l) {  // fixed scales: the loop vectorizes
          const int q0 = ((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
          const int q1 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
          const int q2 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
          const int q3 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
          w[l] = d0 * q0;
          w[l + 32] = d1 * q1;
          w[l + 64] = d2 * q2;
          w[l + 96] = d3 * q3;
        }
      }
    }
  }
};

// sum_j w[j] * x[j] over 256 values, eight float accumulators (the AVX2 version's order).
inline float Dot256Scalar(const float* w, const float* x) {
  float acc[8] = {};
  for (int j = 0; j < kSuperBlock; j += 8) {
    for (int i = 0; i < 8; ++i) acc[i] += w[j + i] * x[j + i];
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

#ifdef TOKENSERVE_CPU_X86
TOKENSERVE_GGUF_SIMD inline float Dot256Avx2(const float* w, const float* x) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (int j = 0; j < kSuperBlock; j += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + j), _mm256_loadu_ps(x + j), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + j + 8), _mm256_loadu_ps(x + j + 8), acc1);
  }
  return cpu::HorizontalSum(_mm256_add_ps(acc0, acc1));
}
#endif

// Output rows [n0, n0 + count) of y[M, N] = x[M, K] @ dequant(w).T: each weight row read once,
// front to back, each super-block decoded once for all M rows of x.
template <class Type>
void KQuantRows(const float* x, int64 M, int64 K, const uint8_t* w, int64 row_bytes, int64 n0,
                int64 count, bool simd, float* y, int64 ldy) {
  alignas(32) float decoded[kSuperBlock];
  const int64 blocks = K / kSuperBlock;
  for (int64 r = 0; r < count; ++r) {
    const uint8_t* row = w + (n0 + r) * row_bytes;
    for (int64 m = 0; m < M; ++m) y[m * ldy + n0 + r] = 0.f;
    for (int64 b = 0; b < blocks; ++b) {
      Type::Decode(row + b * Type::kBytes, decoded);
      for (int64 m = 0; m < M; ++m) {
        const float* xb = x + m * K + b * kSuperBlock;
#ifdef TOKENSERVE_CPU_X86
        if (simd) {
          y[m * ldy + n0 + r] += Dot256Avx2(decoded, xb);
          continue;
        }
#endif
        y[m * ldy + n0 + r] += Dot256Scalar(decoded, xb);
      }
    }
  }
}

}  // namespace gguf
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_GGUF_KQUANTS_H_
