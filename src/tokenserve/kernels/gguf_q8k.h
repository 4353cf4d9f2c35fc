// The K-quant kernels' activations: x [M, K] (K a multiple of 256) quantized once per matmul
// into q8_K blocks, the type llama.cpp pairs Q4_K, Q5_K and Q6_K with (their vec_dot_type).
// A block holds 256 values: one float scale d = max|x| / 127 and 256 int8 q (q8_quantize.h,
// so x ~= d * q), and the sums of each 16 consecutive q (bsums; int16, |sum| <= 16 * 127).
// The weights' offsets (Q4_K/Q5_K's mins, Q6_K's -32) are constant over 16 or 32 values, so
// their part of a dot product is sum_j offset_j * bsums_j: the kernels never add up q for it.
// A block holding a NaN or an infinity gets q = 0 and d = NaN: the outputs it feeds are NaN.
#ifndef TOKENSERVE_KERNELS_GGUF_Q8K_H_
#define TOKENSERVE_KERNELS_GGUF_Q8K_H_

#include <cstdint>
#include <vector>

#include "cpu.h"
#include "q8_quantize.h"

namespace tokenserve {
namespace gguf {

using int64 = int64_t;

constexpr int kSuperBlock = 256;  // values a K-quant super-block, and a q8_K block
constexpr int kSixteens = kSuperBlock / 16;  // bsums a block

// Row m's block b is number i = m * blocks + b: its values at q[i * 256], its scale d[i], its
// sums bsums[i * 16 + j] (values 16 j .. 16 j + 15).
struct Q8KRows {
  int64 blocks = 0;  // per row: K / 256
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> bsums;
  int64 Index(int64 m, int64 b) const { return m * blocks + b; }
  const int8_t* Values(int64 i) const { return q.data() + i * kSuperBlock; }
  const int16_t* Sums(int64 i) const { return bsums.data() + i * kSixteens; }
};

// x [M, K] into `out`, every block of every row; simd: the AVX2 quantizer (the same bytes).
inline void QuantizeRowsK(const float* x, int64 M, int64 K, bool simd, Q8KRows* out) {
  out->blocks = K / kSuperBlock;
  const int64 count = M * out->blocks;
  out->q.resize(count * kSuperBlock);
  out->d.resize(count);
  out->bsums.resize(count * kSixteens);
  for (int64 i = 0; i < count; ++i) {
    const float* src = x + i * kSuperBlock;  // row m's block b is x[m * K + b * 256]
    int8_t* q = out->q.data() + i * kSuperBlock;
#ifdef TOKENSERVE_CPU_X86
    out->d[i] = simd ? q8::QuantizeAvx2(src, kSuperBlock, q)
                     : q8::QuantizeScalar(src, kSuperBlock, q);
#else
    out->d[i] = q8::QuantizeScalar(src, kSuperBlock, q);
#endif
    for (int j = 0; j < kSixteens; ++j) {
      int32_t sum = 0;
      for (int l = 0; l < 16; ++l) sum += q[16 * j + l];
      out->bsums[i * kSixteens + j] = static_cast<int16_t>(sum);
    }
  }
}

}  // namespace gguf
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_GGUF_Q8K_H_
