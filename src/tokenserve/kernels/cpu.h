// What every op asks of the CPU: its features (checked once, at run time, so one library
// built with -march=native still loads and takes the scalar path on a CPU without them) and
// the AVX2 reductions of an 8-float vector to one float. One definition for all the ops.
#ifndef TOKENSERVE_KERNELS_CPU_H_
#define TOKENSERVE_KERNELS_CPU_H_

#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define TOKENSERVE_CPU_X86 1
#endif

namespace tokenserve {
namespace cpu {

// AVX2 and FMA: every AVX2 kernel of the ops needs both.
inline bool HasAvx2Fma() {
#ifdef TOKENSERVE_CPU_X86
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
#else
  return false;
#endif
}

// F16C (float16 <-> float32 conversion), read from CPUID: older compilers' cpu_supports
// does not know the name. Every AVX2 CPU made has it.
inline bool HasF16c() {
#ifdef TOKENSERVE_CPU_X86
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  static const bool has = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
  return has;
#else
  return false;
#endif
}

// The AVX2 kernels that read float16 (caches, the LM head's screen) need all three.
inline bool HasAvx2FmaF16c() { return HasAvx2Fma() && HasF16c(); }

#ifdef TOKENSERVE_CPU_X86
// A function compiled for AVX2+FMA whatever the build's -m flags; call it only after
// HasAvx2Fma(). A caller compiled for more (F16C too) may inline it.
#define TOKENSERVE_AVX2_FMA __attribute__((target("avx2,fma")))

TOKENSERVE_AVX2_FMA inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Every cache line of [p, p + bytes) into L2 (not L1: a stream prefetched far ahead would
// evict what the kernel is reading now). A prefetch never faults, so p may run past the end
// of an array.
inline void PrefetchL2(const void* p, int64_t bytes) {
  const char* line = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(line + off, _MM_HINT_T1);
}

TOKENSERVE_AVX2_FMA inline float HorizontalMax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif  // TOKENSERVE_CPU_X86

}  // namespace cpu
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_CPU_H_
