// The K-quant kernels' activations: x [M, K] (K a multiple of 256) quantized once per matmul
// into q8_K blocks of 256 values, the type llama.cpp pairs Q4_K, Q5_K and Q6_K with (their
// vec_dot_type), with one change: each group of 8 values has its own step.
//
// llama.cpp's q8_K has one step per 256 values, d = max|x| / 127. A residual stream's few
// large channels then set the step of the whole block, and the rest round to a level or two
// (on Gemma 3's Q4_K_M file: +0.7 % perplexity against the dequantized float32 product). Here
// a group's step is an integer multiple of the block's unit d = max|x| / (127 * kMaxMultiple):
//   x ~= d * m_g * q,  m_g = ceil(max|x in g| * (kMaxMultiple / max|x|)) in [1, 16]
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
#include <cfloat>
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
constexpr int kStepGroups = kSuperBlock / kStepGroup;  // steps a block

// Row m's block b is number i = m * blocks + b: its values at q[i * 256], its unit d[i], its
// sums bsums[i * 16 + j] (values 16 j .. 16 j + 15), and its groups' step multiples m_g at
// multiple[i * 32 + g] (values 8 g .. 8 g + 7), one byte each: the kernels read 256 bytes of
// q and 32 of multiples a block and row, so a prefill sweep of x stays about q8_K's size.
struct Q8KRows {
  int64 blocks = 0;  // per row: K / 256
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> bsums;
  std::vector<uint8_t> multiple;
  int64 Index(int64 m, int64 b) const { return m * blocks + b; }
  const int8_t* Values(int64 i) const { return q.data() + i * kSuperBlock; }
  const int16_t* Sums(int64 i) const { return bsums.data() + i * kSixteens; }
  const uint8_t* Multiples(int64 i) const { return multiple.data() + i * kStepGroups; }
};

// max|x| over one block, NaN when a value is not finite.
inline float BlockMax(const float gmax[kStepGroups]) {
  float amax = 0.f;
  for (int g = 0; g < kStepGroups; ++g) {
    if (std::isnan(gmax[g])) return NAN;
    amax = std::max(amax, gmax[g]);
  }
  return amax;
}

// A block holding a NaN or an infinity: q = 0, multiples 1, d = NaN (returned).
inline float NonFiniteBlock(int8_t* q, uint8_t* multiple, int16_t* bsums) {
  std::memset(q, 0, kSuperBlock);
  std::fill(multiple, multiple + kStepGroups, uint8_t{1});
  std::fill(bsums, bsums + kSixteens, int16_t{0});
  return NAN;
}

// The multiples as stored, and the sums of each sixteen's m * q.
inline void MultiplesAndSums(const int8_t* q, const int m[kStepGroups], uint8_t* multiple,
                             int16_t* bsums) {
  for (int g = 0; g < kStepGroups; ++g) multiple[g] = static_cast<uint8_t>(m[g]);
  for (int j = 0; j < kSixteens; ++j) {
    int32_t sum = 0;
    for (int l = 16 * j; l < 16 * j + 16; ++l) sum += q[l] * m[l / kStepGroup];
    bsums[j] = static_cast<int16_t>(sum);
  }
}

// One block of 256 values: q, multiples and bsums; returns d. The reference for the AVX2
// version, which does the same float operations on eight groups at once: r = 16 / max|x|,
// m_g = min(max(ceil(max|x in g| * r), 1), 16) (ceil, so |x| / (d * m_g) <= 127 up to float
// rounding, which rounds to 127), one multiply by 1 / (d * m_g) and round half to even.
inline float QuantizeBlockKScalar(const float* x, int8_t* q, uint8_t* multiple,
                                  int16_t* bsums) {
  float gmax[kStepGroups];
  for (int g = 0; g < kStepGroups; ++g) {
    gmax[g] = q8::AbsMaxScalar(x + g * kStepGroup, kStepGroup);
  }
  const float amax = BlockMax(gmax);
  if (std::isnan(amax)) return NonFiniteBlock(q, multiple, bsums);
  const float unit = amax / (127.f * kMaxMultiple);
  const float r = amax > 0.f ? kMaxMultiple / amax : 0.f;
  int m[kStepGroups];
  for (int g = 0; g < kStepGroups; ++g) {
    const float multiple_g =
        std::min(std::max(std::ceil(gmax[g] * r), 1.f), float{kMaxMultiple});
    m[g] = static_cast<int>(multiple_g);
    const float inv = amax > 0.f ? 1.f / (unit * multiple_g) : 0.f;
    // nearbyint: round half to even, as _mm256_round_ps(_MM_FROUND_TO_NEAREST_INT) does
    for (int l = g * kStepGroup; l < (g + 1) * kStepGroup; ++l) {
      q[l] = static_cast<int8_t>(std::nearbyint(x[l] * inv));
    }
  }
  MultiplesAndSums(q, m, multiple, bsums);
  return unit;
}

#ifdef TOKENSERVE_CPU_X86
// [max a[0], ..., max a[7]]: eight vectors' maxes at once (pairs interleaved, then halves).
TOKENSERVE_AVX2_FMA inline __m256 Maxes8(const __m256 a[8]) {
  __m256 quarter[2];
  for (int h = 0; h < 2; ++h) {
    const __m256* v = a + 4 * h;
    const __m256 t0 = _mm256_max_ps(_mm256_unpacklo_ps(v[0], v[1]), _mm256_unpackhi_ps(v[0], v[1]));
    const __m256 t1 = _mm256_max_ps(_mm256_unpacklo_ps(v[2], v[3]), _mm256_unpackhi_ps(v[2], v[3]));
    // per 128 bits: [v0, v1, v2, v3]'s maxes over that half
    quarter[h] = _mm256_max_ps(_mm256_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm256_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  return _mm256_max_ps(_mm256_permute2f128_ps(quarter[0], quarter[1], 0x20),
                       _mm256_permute2f128_ps(quarter[0], quarter[1], 0x31));
}

// QuantizeBlockKScalar's bytes, multiples, sums and d.
TOKENSERVE_AVX2_FMA inline float QuantizeBlockKAvx2(const float* x, int8_t* q, uint8_t* multiple,
                                                    int16_t* bsums) {
  const __m256 sign = _mm256_set1_ps(-0.f), largest = _mm256_set1_ps(FLT_MAX);
  __m256 gmax[4], bad = _mm256_setzero_ps();  // gmax[v]: groups 8v .. 8v + 7
  for (int v = 0; v < 4; ++v) {
    __m256 a[8];
    for (int i = 0; i < 8; ++i) {
      a[i] = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 64 * v + 8 * i));
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(a[i], largest, _CMP_NLE_UQ));
    }
    gmax[v] = Maxes8(a);
  }
  if (_mm256_movemask_ps(bad)) return NonFiniteBlock(q, multiple, bsums);
  const float amax = cpu::HorizontalMax(
      _mm256_max_ps(_mm256_max_ps(gmax[0], gmax[1]), _mm256_max_ps(gmax[2], gmax[3])));
  const float unit = amax / (127.f * kMaxMultiple);
  const __m256 r = _mm256_set1_ps(amax > 0.f ? kMaxMultiple / amax : 0.f);
  const __m256 one = _mm256_set1_ps(1.f), most = _mm256_set1_ps(float{kMaxMultiple});
  const __m256i ones8 = _mm256_set1_epi8(1);
  __m256i sixteens[2][4];  // per chunk: m * q summed over four values, in int32 lanes
  for (int v = 0; v < 4; ++v) {
    const __m256 need = _mm256_round_ps(_mm256_mul_ps(gmax[v], r),
                                        _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC);
    const __m256 m = _mm256_min_ps(_mm256_max_ps(need, one), most);
    const __m256 inv = amax > 0.f ? _mm256_div_ps(one, _mm256_mul_ps(_mm256_set1_ps(unit), m))
                                  : _mm256_setzero_ps();
    const __m256i mi = _mm256_cvttps_epi32(m);
    alignas(32) int32_t stored[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(stored), mi);
    for (int g = 0; g < 8; ++g) multiple[8 * v + g] = static_cast<uint8_t>(stored[g]);
    for (int h = 0; h < 2; ++h) {  // chunk c = 2 v + h: groups 4h .. 4h + 3 of this vector
      const int c = 2 * v + h;
      __m256 steps[4];
      for (int g = 0; g < 4; ++g) {
        steps[g] = _mm256_permutevar8x32_ps(inv, _mm256_set1_epi32(4 * h + g));
      }
      q8::Round32Avx2(x + 32 * c, steps, q + 32 * c);
      // int32 lane p covers values 4p .. 4p + 3: group 4h + p / 2; both its int16 halves m
      const __m256i pick = _mm256_setr_epi32(4 * h, 4 * h, 4 * h + 1, 4 * h + 1, 4 * h + 2,
                                             4 * h + 2, 4 * h + 3, 4 * h + 3);
      __m256i pairs = _mm256_permutevar8x32_epi32(mi, pick);
      pairs = _mm256_or_si256(pairs, _mm256_slli_epi32(pairs, 16));
      const __m256i qc = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * c));
      sixteens[c / 4][c % 4] = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, qc), pairs);
    }
  }
  // chunk c's lanes 0..3 are sixteen 2c, 4..7 sixteen 2c + 1: two hadds give, for chunks
  // 4k .. 4k + 3, [2c ...| 2c + 1 ...]; packed (|sum| <= 32512, no saturation) and interleaved
  __m256i half[2];
  for (int k = 0; k < 2; ++k) {
    half[k] = _mm256_hadd_epi32(_mm256_hadd_epi32(sixteens[k][0], sixteens[k][1]),
                                _mm256_hadd_epi32(sixteens[k][2], sixteens[k][3]));
  }
  const __m256i packed = _mm256_packs_epi32(half[0], half[1]);  // [even 0..7 | odd 0..7]
  const __m128i even = _mm256_castsi256_si128(packed), odd = _mm256_extracti128_si256(packed, 1);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(bsums), _mm_unpacklo_epi16(even, odd));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(bsums + 8), _mm_unpackhi_epi16(even, odd));
  return unit;
}
#endif  // TOKENSERVE_CPU_X86

// x [M, K] into `out`, every block of every row; simd: the AVX2 version (the same bytes).
inline void QuantizeRowsK(const float* x, int64 M, int64 K, bool simd, Q8KRows* out) {
  out->blocks = K / kSuperBlock;
  const int64 count = M * out->blocks;
  out->q.resize(count * kSuperBlock);
  out->d.resize(count);
  out->bsums.resize(count * kSixteens);
  out->multiple.resize(count * kStepGroups);
  for (int64 i = 0; i < count; ++i) {
    const float* src = x + i * kSuperBlock;  // row m's block b is x[m * K + b * 256]
    int8_t* q = out->q.data() + i * kSuperBlock;
    uint8_t* multiple = out->multiple.data() + i * kStepGroups;
    int16_t* bsums = out->bsums.data() + i * kSixteens;
#ifdef TOKENSERVE_CPU_X86
    if (simd) {
      out->d[i] = QuantizeBlockKAvx2(src, q, multiple, bsums);
      continue;
    }
#endif
    out->d[i] = QuantizeBlockKScalar(src, q, multiple, bsums);
  }
}

}  // namespace gguf
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_GGUF_Q8K_H_
