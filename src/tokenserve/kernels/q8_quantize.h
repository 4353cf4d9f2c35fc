// Activations as int8 blocks, what the int8 and GGUF ops' integer dot products take: a block
// of n floats is scaled by 127 / max|x| and rounded half to even into q, with one float scale
// d = max|x| / 127, so x ~= d * q and |q| <= 127 (never -128: the AVX2 kernels move signs
// with _mm256_sign_epi8, which cannot negate it). A block holding a NaN or an infinity gets
// q = 0 and d = NaN, so the outputs it feeds become NaN (as a float matmul's would) rather
// than finite garbage.
//
// The scalar and AVX2 versions do the same float operations (one multiply by 127 / amax, then
// round half to even), so both give the same bytes and scales. Block sizes: 32 (the int8 op,
// the GGUF 32-value types' q8 blocks) and 256 (q8_K, the K-quants' activations).
#ifndef TOKENSERVE_KERNELS_Q8_QUANTIZE_H_
#define TOKENSERVE_KERNELS_Q8_QUANTIZE_H_

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu.h"

namespace tokenserve {
namespace q8 {

// max |x| over x[0, n), or NaN when a value is not finite.
inline float AbsMaxScalar(const float* x, int64_t n) {
  float amax = 0.f;
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) {
    finite = finite && std::isfinite(x[i]);
    amax = std::max(amax, std::fabs(x[i]));
  }
  return finite ? amax : NAN;
}

// q[0, n) from x[0, n) and n's block scale d (returned); a non-finite block as above.
inline float QuantizeScalar(const float* x, int64_t n, int8_t* q) {
  const float amax = AbsMaxScalar(x, n);
  if (std::isnan(amax)) {
    std::memset(q, 0, n);
    return NAN;
  }
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  // nearbyint: round half to even, as _mm256_round_ps(_MM_FROUND_TO_NEAREST_INT) does
  for (int64_t i = 0; i < n; ++i) q[i] = static_cast<int8_t>(std::nearbyint(x[i] * inv));
  return amax / 127.f;
}

#ifdef TOKENSERVE_CPU_X86
// max |x| over x[0, n), n a multiple of 8, or NaN when a value is not finite.
TOKENSERVE_AVX2_FMA inline float AbsMaxAvx2(const float* x, int64_t n) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 largest = _mm256_set1_ps(FLT_MAX);
  __m256 amax = _mm256_setzero_ps();
  __m256 bad = _mm256_setzero_ps();  // lanes that saw a NaN or an infinity
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i));
    amax = _mm256_max_ps(amax, a);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, largest, _CMP_NLE_UQ));
  }
  return _mm256_movemask_ps(bad) ? NAN : cpu::HorizontalMax(amax);
}

// 32 values rounded into q[0, 32), values 8i..8i+7 times inv[i].
TOKENSERVE_AVX2_FMA inline void Round32Avx2(const float* x, const __m256 inv[4], int8_t* q) {
  __m256i i32[4];
  for (int i = 0; i < 4; ++i) {
    i32[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i),
                                                              inv[i]),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  // packing works per 128-bit lane; the permute restores element order
  const __m256i i8 = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]),
                                        _mm256_packs_epi32(i32[2], i32[3]));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(i8, order));
}

// 32 values times one inv, rounded, into q[0, 32).
TOKENSERVE_AVX2_FMA inline void Round32Avx2(const float* x, __m256 inv, int8_t* q) {
  const __m256 all[4] = {inv, inv, inv, inv};
  Round32Avx2(x, all, q);
}

// QuantizeScalar's result for n a multiple of 32.
TOKENSERVE_AVX2_FMA inline float QuantizeAvx2(const float* x, int64_t n, int8_t* q) {
  const float amax = AbsMaxAvx2(x, n);
  if (std::isnan(amax)) {
    std::memset(q, 0, n);
    return NAN;
  }
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  for (int64_t i = 0; i < n; i += 32) Round32Avx2(x + i, inv, q + i);
  return amax / 127.f;
}
#endif  // TOKENSERVE_CPU_X86

}  // namespace q8
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_Q8_QUANTIZE_H_
