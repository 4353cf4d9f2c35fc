// Row-wise epilogues and norms shared by the dense and int8 ops: an activation (GPT-2's tanh
// GELU, SwiGLU, Gemma's GeGLU) with a residual add on a finished product row, and LayerNorm /
// RMSNorm of a row. One definition, so a fused int8 block (int8_finish_block.cc) computes exactly what the
// separate TokenserveEpilogue and TokenserveNorm ops (row_ops.cc) compute, bit for bit.
// AVX2+FMA versions (target attributes, chosen at run time) and portable scalar ones.
#ifndef TOKENSERVE_KERNELS_ROWOPS_H_
#define TOKENSERVE_KERNELS_ROWOPS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TOKENSERVE_ROWOPS_X86 1
#endif

namespace tokenserve {
namespace rowops {

using int64 = int64_t;

enum class Activation { kNone, kGeluTanh, kSwiglu, kGeglu };

// A gated activation reads [gate, up] halves of its row and writes half as many values:
// SwiGLU silu(gate) * up, GeGLU gelu_tanh(gate) * up.
inline bool Gated(Activation act) {
  return act == Activation::kSwiglu || act == Activation::kGeglu;
}

// ---- activations (scalar) ---------------------------------------------------------------
inline float Sigmoid(float v) { return 1.f / (1.f + std::exp(-v)); }
// GPT-2's tanh GELU: 0.5 v (1 + tanh(c (v + 0.044715 v^3))) == v * sigmoid(2 c (...))
inline float GeluTanh(float v) {
  return v * Sigmoid(1.5957691216057308f * (v + 0.044715f * v * v * v));
}

// Epilogue of `out` values of a finished row z (already + bias), written to y_row; a gated
// activation multiplies by the up half, `up` (z + N / 2).
inline void FinishRowScalar(int64 out, Activation act, const float* z, const float* up,
                            const float* res, float* y_row) {
  for (int64 j = 0; j < out; ++j) {
    float v = z[j];
    if (act == Activation::kGeluTanh) v = GeluTanh(v);
    if (act == Activation::kSwiglu) v = v * Sigmoid(v) * up[j];
    if (act == Activation::kGeglu) v = GeluTanh(v) * up[j];
    if (res) v += res[j];
    y_row[j] = v;
  }
}

inline void NormRowScalar(int64 d, const float* x, const float* scale, const float* bias,
                          bool layernorm, float eps, float* y) {
  double sum = 0.0, sumsq = 0.0;
  for (int64 j = 0; j < d; ++j) {
    sum += x[j];
    sumsq += static_cast<double>(x[j]) * x[j];
  }
  const double mean = layernorm ? sum / d : 0.0;
  const float inv =
      static_cast<float>(1.0 / std::sqrt(std::max(sumsq / d - mean * mean, 0.0) + eps));
  for (int64 j = 0; j < d; ++j) {
    y[j] = (x[j] - static_cast<float>(mean)) * inv * scale[j] + (bias ? bias[j] : 0.f);
  }
}

#ifdef TOKENSERVE_ROWOPS_X86
#define TOKENSERVE_ROWOPS_AVX2 __attribute__((target("avx2,fma")))

// exp(x), Cephes' polynomial (relative error ~1e-7; inputs clamped to +-88).
TOKENSERVE_ROWOPS_AVX2 inline __m256 Exp(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                              _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i n = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(n));
}

TOKENSERVE_ROWOPS_AVX2 inline __m256 Sigmoid8(__m256 v) {
  const __m256 one = _mm256_set1_ps(1.f);
  return _mm256_div_ps(one, _mm256_add_ps(one, Exp(_mm256_sub_ps(_mm256_setzero_ps(), v))));
}

TOKENSERVE_ROWOPS_AVX2 inline void FinishRowAvx2(int64 out, Activation act, const float* z,
                                                 const float* up, const float* res,
                                                 float* y_row) {
  int64 j = 0;
  for (; j + 8 <= out; j += 8) {
    __m256 v = _mm256_loadu_ps(z + j);
    if (act == Activation::kGeluTanh || act == Activation::kGeglu) {
      const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(v, v), v);
      const __m256 inner = _mm256_fmadd_ps(cube, _mm256_set1_ps(0.044715f), v);
      v = _mm256_mul_ps(v, Sigmoid8(_mm256_mul_ps(inner, _mm256_set1_ps(1.5957691216057308f))));
      if (act == Activation::kGeglu) v = _mm256_mul_ps(v, _mm256_loadu_ps(up + j));
    } else if (act == Activation::kSwiglu) {
      v = _mm256_mul_ps(_mm256_mul_ps(v, Sigmoid8(v)), _mm256_loadu_ps(up + j));
    }
    if (res) v = _mm256_add_ps(v, _mm256_loadu_ps(res + j));
    _mm256_storeu_ps(y_row + j, v);
  }
  if (j < out) {  // the tail, through the scalar code
    FinishRowScalar(out - j, act, z + j, up ? up + j : nullptr, res ? res + j : nullptr,
                    y_row + j);
  }
}

TOKENSERVE_ROWOPS_AVX2 inline float RowSum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Norm of one row: LayerNorm (layernorm) or RMSNorm.
TOKENSERVE_ROWOPS_AVX2 inline void NormRowAvx2(int64 d, const float* x, const float* scale,
                                               const float* bias, bool layernorm, float eps,
                                               float* y) {
  const int64 vec = d / 8 * 8;
  __m256 s = _mm256_setzero_ps(), ss = s;
  int64 j = 0;
  for (; j < vec; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    s = _mm256_add_ps(s, v);
    ss = _mm256_fmadd_ps(v, v, ss);
  }
  double sum = RowSum8(s), sumsq = RowSum8(ss);
  for (; j < d; ++j) {
    sum += x[j];
    sumsq += static_cast<double>(x[j]) * x[j];
  }
  const double mean = layernorm ? sum / d : 0.0;
  const double var = sumsq / d - mean * mean;
  const float inv = static_cast<float>(1.0 / std::sqrt(std::max(var, 0.0) + eps));
  const __m256 mv = _mm256_set1_ps(static_cast<float>(mean)), iv = _mm256_set1_ps(inv);
  for (j = 0; j < vec; j += 8) {
    __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), mv), iv),
                             _mm256_loadu_ps(scale + j));
    if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + j));
    _mm256_storeu_ps(y + j, v);
  }
  for (; j < d; ++j) {
    y[j] = (x[j] - static_cast<float>(mean)) * inv * scale[j] + (bias ? bias[j] : 0.f);
  }
}
#undef TOKENSERVE_ROWOPS_AVX2
#endif  // TOKENSERVE_ROWOPS_X86

// The epilogue of `out` values of a finished row z (bias already added) into y_row;
// a gated activation multiplies by the up half `up` (z + N / 2); res: the residual row or nullptr.
inline void FinishRow(bool avx2, int64 out, Activation act, const float* z, const float* up,
                      const float* res, float* y_row) {
#ifdef TOKENSERVE_ROWOPS_X86
  if (avx2) return FinishRowAvx2(out, act, z, up, res, y_row);
#endif
  FinishRowScalar(out, act, z, up, res, y_row);
}

// The epilogue of m finished rows z [m, n]: bias [n] (or nullptr) is added to z in place,
// then each row's epilogue goes to y [m, out]; residual: [m, out] or nullptr.
inline void FinishRows(bool avx2, int64 m, int64 n, int64 out, Activation act, float* z,
                       const float* bias, const float* residual, float* y) {
  for (int64 r = 0; r < m; ++r) {
    float* zr = z + r * n;
    if (bias) {
      for (int64 j = 0; j < n; ++j) zr[j] += bias[j];
    }
    FinishRow(avx2, out, act, zr, zr + out, residual ? residual + r * out : nullptr,
              y + r * out);
  }
}

// LayerNorm of one row (bias given) or RMSNorm (bias nullptr).
inline void NormRow(bool avx2, int64 d, const float* x, const float* scale, const float* bias,
                    float eps, float* y) {
  const bool layernorm = bias != nullptr;
#ifdef TOKENSERVE_ROWOPS_X86
  if (avx2) return NormRowAvx2(d, x, scale, bias, layernorm, eps, y);
#endif
  NormRowScalar(d, x, scale, bias, layernorm, eps, y);
}

}  // namespace rowops
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_ROWOPS_H_
