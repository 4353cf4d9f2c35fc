// One work item of paged decode attention (paged_item.h) with AVX2+FMA+F16C: scores, a
// float32 softmax and the weighted sum of the values, specialised for Dh = 32, 64, 128 so
// the loops over Dh unroll (any Dh that is a multiple of 8 up to 256 otherwise).
//
// Internal linkage (an unnamed namespace): every op file that includes this compiles its own
// copy, so its calls stay direct and the compiler inlines and clones it within that file as
// it would the file's own code.
#ifndef TOKENSERVE_KERNELS_PAGED_ATTEND_AVX2_H_
#define TOKENSERVE_KERNELS_PAGED_ATTEND_AVX2_H_

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "cpu.h"
#include "paged_item.h"
#include "widen.h"

namespace tokenserve {
namespace {

// ---------------------------------------------------------------------------------------
// AVX2 + FMA path. Target attributes rather than -m flags, so the library still loads and
// takes the scalar path on a CPU without AVX2.
#ifdef TOKENSERVE_CPU_X86
#define AVX2_FN __attribute__((target("avx2,fma,f16c")))

using widen::Load8;  // float, bfloat16 (widen.h)
AVX2_FN inline __m256 Load8(const Half* p) {  // F16C: exact
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The sums of four vectors as one [a, b, c, d] vector.
AVX2_FN inline __m128 HorizontalSum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 ab = _mm256_hadd_ps(a, b);      // a01 a23 b01 b23 | a45 a67 b45 b67
  const __m256 cd = _mm256_hadd_ps(c, d);
  const __m256 abcd = _mm256_hadd_ps(ab, cd);  // a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 ...
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// exp(x) for x <= 0 (after max subtraction; larger x are clamped), Cephes' polynomial:
// relative error ~1e-7 over the range, exp(0) == 1 exactly, ~1e-38 at and below -87.3.
AVX2_FN inline __m256 Exp(__m256 x) {
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365447505531f));
  // x = n ln2 + r, |r| <= ln2 / 2 (ln2 split in two for precision)
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                                   _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  // * 2^n, built in the exponent bits (n >= -126 after the clamp: a normal number)
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// In place: s[l] = exp(s[l] - max(s)); returns 1 / sum.
AVX2_FN float SoftmaxAvx2(float* s, int64 len) {
  int64 l = 0;
  __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (; l + 8 <= len; l += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + l));
  float mx = cpu::HorizontalMax(mv);
  for (; l < len; ++l) mx = std::max(mx, s[l]);
  const __m256 mb = _mm256_set1_ps(mx);
  __m256 sv = _mm256_setzero_ps();
  l = 0;
  for (; l + 8 <= len; l += 8) {
    const __m256 e = Exp(_mm256_sub_ps(_mm256_loadu_ps(s + l), mb));
    _mm256_storeu_ps(s + l, e);
    sv = _mm256_add_ps(sv, e);
  }
  float sum = cpu::HorizontalSum(sv);
  for (; l < len; ++l) {
    s[l] = _mm256_cvtss_f32(Exp(_mm256_set1_ps(s[l] - mx)));
    sum += s[l];
  }
  return 1.f / sum;
}

// Scores of rows r[0..R) (R = 1 or 4) for every head of the item, row-major: each row's
// span * Dh values are read once, contiguously, for all heads.
template <typename C, int NV, int R>
AVX2_FN __attribute__((always_inline)) inline void ScoreRows(const Geometry& g, int nv,
                                                             const float* q, const C* const* k,
                                                             float* scores, int64 len,
                                                             int64 l) {
  const int64 Dh = g.Dh, G = g.group, heads = g.Heads();
  for (int64 h = 0; h < heads; ++h) {
    const float* qh = q + h * Dh;
    const int64 off = (h / G) * Dh;
    __m256 a[R];
    for (int r = 0; r < R; ++r) a[r] = _mm256_setzero_ps();
    for (int j = 0; j < (NV > 0 ? NV : nv); ++j) {
      const __m256 qv = _mm256_loadu_ps(qh + 8 * j);
      for (int r = 0; r < R; ++r) a[r] = _mm256_fmadd_ps(qv, Load8(k[r] + off + 8 * j), a[r]);
    }
    if constexpr (R == 4) {
      _mm_storeu_ps(scores + h * len + l, HorizontalSum4(a[0], a[1], a[2], a[3]));
    } else {
      scores[h * len + l] = cpu::HorizontalSum(a[0]);
    }
  }
}

// acc[h] += sum over rows r of p[h][l + r] * v[r] for every head of the item.
template <typename C, int NV, int R>
AVX2_FN __attribute__((always_inline)) inline void AccumulateRows(const Geometry& g, int nv,
                                                                  const C* const* v,
                                                                  const float* scores,
                                                                  float* acc, int64 len,
                                                                  int64 l) {
  const int64 Dh = g.Dh, G = g.group, heads = g.Heads();
  for (int64 h = 0; h < heads; ++h) {
    const int64 off = (h / G) * Dh;
    __m256 p[R];
    for (int r = 0; r < R; ++r) p[r] = _mm256_set1_ps(scores[h * len + l + r]);
    float* ah = acc + h * Dh;
    for (int j = 0; j < (NV > 0 ? NV : nv); ++j) {
      __m256 x = _mm256_loadu_ps(ah + 8 * j);
      for (int r = 0; r < R; ++r) x = _mm256_fmadd_ps(p[r], Load8(v[r] + off + 8 * j), x);
      _mm256_storeu_ps(ah + 8 * j, x);
    }
  }
}

// NV > 0: Dh = 8 * NV known at compile time (the loops over Dh unroll); NV == 0: Dh = 8 * nv
// at run time, nv <= kMaxVectors.
template <typename T, typename C, int NV>
AVX2_FN void AttendAvx2(const Geometry& g, const T* qs, const C* kc, const C* vc,
                        const int32_t* rows, int64 len, Scratch* scratch, T* out) {
  const int64 Dh = g.Dh, heads = g.Heads(), width = g.width;
  const int64 bytes = g.span * Dh * static_cast<int64>(sizeof(C));
  const int nv = NV > 0 ? NV : static_cast<int>(Dh / 8);
  float* q = scratch->q.data();
  float* scores = scratch->scores.data();
  float* acc = scratch->acc.data();
  float* inv = scratch->inv.data();

  const __m256 scale = _mm256_set1_ps(g.scale);
  for (int64 i = 0; i < heads * Dh; i += 8) {
    _mm256_storeu_ps(q + i, _mm256_mul_ps(Load8(qs + i), scale));
  }

  const int64 len4 = len / 4 * 4;
  const C* r4[4];
  for (int64 l = 0; l < len4; l += 4) {
    PrefetchRows(kc, rows, l + kAhead, l + kAhead + 4, len, width, bytes);
    for (int r = 0; r < 4; ++r) r4[r] = kc + rows[l + r] * width;
    ScoreRows<C, NV, 4>(g, nv, q, r4, scores, len, l);
  }
  for (int64 l = len4; l < len; ++l) {
    r4[0] = kc + rows[l] * width;
    ScoreRows<C, NV, 1>(g, nv, q, r4, scores, len, l);
  }

  SoftCapScores(g.softcap, scores, heads * len);
  for (int64 h = 0; h < heads; ++h) inv[h] = SoftmaxAvx2(scores + h * len, len);

  std::fill(acc, acc + heads * Dh, 0.f);
  for (int64 l = 0; l < len4; l += 4) {
    PrefetchRows(vc, rows, l + kAhead, l + kAhead + 4, len, width, bytes);
    for (int r = 0; r < 4; ++r) r4[r] = vc + rows[l + r] * width;
    AccumulateRows<C, NV, 4>(g, nv, r4, scores, acc, len, l);
  }
  for (int64 l = len4; l < len; ++l) {
    r4[0] = vc + rows[l] * width;
    AccumulateRows<C, NV, 1>(g, nv, r4, scores, acc, len, l);
  }

  for (int64 h = 0; h < heads; ++h) {
    const __m256 s = _mm256_set1_ps(inv[h]);
    for (int j = 0; j < nv; ++j) {
      const __m256 o = _mm256_mul_ps(_mm256_loadu_ps(acc + h * Dh + 8 * j), s);
      if constexpr (std::is_same<T, float>::value) {
        _mm256_storeu_ps(out + h * Dh + 8 * j, o);
      } else {
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, o);
        for (int i = 0; i < 8; ++i) out[h * Dh + 8 * j + i] = FromFloat<T>(tmp[i]);
      }
    }
  }
}
#undef AVX2_FN
#endif  // TOKENSERVE_CPU_X86

}  // namespace
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_PAGED_ATTEND_AVX2_H_
