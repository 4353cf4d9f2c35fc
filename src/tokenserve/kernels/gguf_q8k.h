// The K-quant kernels' activations: x [M, K] (K a multiple of 256) quantized once per matmul
// into q8_K blocks of 256 values, the type llama.cpp pairs Q4_K, Q5_K and Q6_K with (their
// vec_dot_type), with one change: each group of 8 values has its own step.
//
// llama.cpp's q8_K has one step per 256 values, d = max|x| / 127. A residual stream's few
// large channels then set the step of the whole block, and the rest round to a level or two
// (on Gemma 3's Q4_K_M file: +0.7 % perplexity against the dequantized float32 product). Here
// a group's step is an integer multiple of the block's unit d = max|x| / (127 * kMaxMultiple):
//   x ~= d * m_g * q,  m_g = ceil(kMaxMultiple * max|x in g| / max|x|) in [1, kMaxMultiple]
// so a group holding the block's largest value keeps q8_K's step, and a group of small values
// gets one up to kMaxMultiple times finer. The kernels fold m_g into the integer madd operand
// that already carries the weights' sub-block scales (scale_j * m_g, gguf_kquants_avx2.h): the
// dot product stays one integer sum a super-block, at one extra int16 multiply per 32 values.
// The sums of each 16 consecutive m_g * q (bsums) give the weights' offsets' part (Q4_K/Q5_K's
// mins, Q6_K's -32), which are constant over 16 or 32 values: sum_j offset_j * bsums_j.
//
// kMaxMultiple = 16 keeps every integer in range: |bsums| <= 16 * 127 * 16 = 32512 (int16),
// and scale_j * m_g <= 128 * 16 (int16); the int32 lanes' sums are bounded in gguf_kquants.h.
// A block holding a NaN or an infinity gets q = 0 and d = NaN: the outputs it feeds are NaN.
#ifndef TOKENSERVE_KERNELS_GGUF_Q8K_H_
#define TOKENSERVE_KERNELS_GGUF_Q8K_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu.h"
#include "q8_quantize.h"

namespace tokenserve {
namespace gguf {

using int64 = int64_t;

constexpr int kSuperBlock = 256;             // values a K-quant super-block, and a q8_K block
constexpr int kSixteens = kSuperBlock / 16;  // bsums a block
constexpr int kStepGroup = 8;                // values sharing one step
constexpr int kMaxMultiple = 16;             // a group's step is d * m_g, m_g in [1, 16]
constexpr int kPairs = kSuperBlock / 2;      // multiples stored a block: one a pair of values

// Row m's block b is number i = m * blocks + b: its values at q[i * 256], its unit d[i], its
// sums bsums[i * 16 + j] (values 16 j .. 16 j + 15), and its step multiples as the kernels
// read them, one int16 a pair of values: multiple[i * 128 + p] is m_g of values 2p, 2p + 1
// (the layout of maddubs's int16 lanes, so 32 values' multiples are one vector load).
struct Q8KRows {
  int64 blocks = 0;  // per row: K / 256
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> bsums;
  std::vector<int16_t> multiple;
  int64 Index(int64 m, int64 b) const { return m * blocks + b; }
  const int8_t* Values(int64 i) const { return q.data() + i * kSuperBlock; }
  const int16_t* Sums(int64 i) const { return bsums.data() + i * kSixteens; }
  const int16_t* Multiples(int64 i) const { return multiple.data() + i * kPairs; }
};

// Each group's max |x| (NaN for a group holding a NaN or an infinity); exact either way.
inline void GroupMaxes(const float* x, bool simd, float gmax[kSuperBlock / kStepGroup]) {
  for (int g = 0; g < kSuperBlock / kStepGroup; ++g) {
#ifdef TOKENSERVE_CPU_X86
    if (simd) {
      gmax[g] = q8::AbsMaxAvx2(x + g * kStepGroup, kStepGroup);
      continue;
    }
#endif
    gmax[g] = q8::AbsMaxScalar(x + g * kStepGroup, kStepGroup);
  }
}

// A block's unit d (returned) from its groups' maxes, and each group's m_g and 1 / (d * m_g)
// (the multiply the rounding uses). The scalar and AVX2 roundings do the same float multiply
// and round half to even (q8_quantize.h), so they give the same bytes.
inline float BlockSteps(float amax, const float gmax[kSuperBlock / kStepGroup],
                        int m[kSuperBlock / kStepGroup], float inv[kSuperBlock / kStepGroup]) {
  const float unit = amax / (127.f * kMaxMultiple);
  for (int g = 0; g < kSuperBlock / kStepGroup; ++g) {
    // ceil, so max|x in g| / (d * m_g) <= 127 up to float rounding (which rounds to 127)
    const float need = amax > 0.f ? std::ceil(gmax[g] * kMaxMultiple / amax) : 1.f;
    m[g] = static_cast<int>(std::min<float>(std::max(need, 1.f), kMaxMultiple));
    inv[g] = amax > 0.f ? 1.f / (unit * static_cast<float>(m[g])) : 0.f;
  }
  return unit;
}

// x [M, K] into `out`, every block of every row; simd: the AVX2 rounding (the same bytes).
inline void QuantizeRowsK(const float* x, int64 M, int64 K, bool simd, Q8KRows* out) {
  constexpr int kGroupsA = kSuperBlock / kStepGroup;
  out->blocks = K / kSuperBlock;
  const int64 count = M * out->blocks;
  out->q.resize(count * kSuperBlock);
  out->d.resize(count);
  out->bsums.resize(count * kSixteens);
  out->multiple.resize(count * kPairs);
#ifndef TOKENSERVE_CPU_X86
  simd = false;
#endif
  for (int64 i = 0; i < count; ++i) {
    const float* src = x + i * kSuperBlock;  // row m's block b is x[m * K + b * 256]
    int8_t* q = out->q.data() + i * kSuperBlock;
    int16_t* multiple = out->multiple.data() + i * kPairs;
    float gmax[kGroupsA], amax = 0.f;
    GroupMaxes(src, simd, gmax);
    for (int g = 0; g < kGroupsA; ++g) {
      if (std::isnan(gmax[g])) {
        amax = NAN;
        break;
      }
      amax = std::max(amax, gmax[g]);
    }
    if (std::isnan(amax)) {
      std::memset(q, 0, kSuperBlock);
      std::fill(multiple, multiple + kPairs, int16_t{1});
      std::fill(out->bsums.begin() + i * kSixteens, out->bsums.begin() + (i + 1) * kSixteens, 0);
      out->d[i] = NAN;
      continue;
    }
    int m[kGroupsA];
    float inv[kGroupsA];
    out->d[i] = BlockSteps(amax, gmax, m, inv);
#ifdef TOKENSERVE_CPU_X86
    if (simd) {
      for (int c = 0; c < kSuperBlock / 32; ++c) {
        const __m256 chunk[4] = {_mm256_set1_ps(inv[4 * c]), _mm256_set1_ps(inv[4 * c + 1]),
                                 _mm256_set1_ps(inv[4 * c + 2]), _mm256_set1_ps(inv[4 * c + 3])};
        q8::Round32Avx2(src + 32 * c, chunk, q + 32 * c);
      }
    }
#endif
    if (!simd) {
      // nearbyint: round half to even, as _mm256_round_ps(_MM_FROUND_TO_NEAREST_INT) does
      for (int l = 0; l < kSuperBlock; ++l) {
        q[l] = static_cast<int8_t>(std::nearbyint(src[l] * inv[l / kStepGroup]));
      }
    }
    for (int p = 0; p < kPairs; ++p) multiple[p] = static_cast<int16_t>(m[2 * p / kStepGroup]);
    for (int j = 0; j < kSixteens; ++j) {
      int32_t sum = 0;
      for (int l = 16 * j; l < 16 * j + 16; ++l) sum += q[l] * m[l / kStepGroup];
      out->bsums[i * kSixteens + j] = static_cast<int16_t>(sum);
    }
  }
}

}  // namespace gguf
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_GGUF_Q8K_H_
