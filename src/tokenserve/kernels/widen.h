// Float32 and bfloat16 values as float32, one at a time or eight at a time (AVX2): the
// widening shared by every op that reads bfloat16, the KV caches of the paged attention ops
// and the weights of the dense ops. A bfloat16 is the top half of a float32, so widening it
// is a zero-extend and a shift, exact.
#ifndef TOKENSERVE_KERNELS_WIDEN_H_
#define TOKENSERVE_KERNELS_WIDEN_H_

#include <cstdint>
#include <cstring>

#include "tensorflow/core/framework/numeric_types.h"
#include "cpu.h"

namespace tokenserve {
namespace widen {

inline float ToFloat(float x) { return x; }
inline float ToFloat(tensorflow::bfloat16 x) {
  uint16_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t wide = uint32_t{bits} << 16;
  float f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}

#ifdef TOKENSERVE_CPU_X86
// Eight values from p as floats; call only after cpu::HasAvx2Fma().
TOKENSERVE_AVX2_FMA inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
TOKENSERVE_AVX2_FMA inline __m256 Load8(const tensorflow::bfloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif  // TOKENSERVE_CPU_X86

}  // namespace widen
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_WIDEN_H_
