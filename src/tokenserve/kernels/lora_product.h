// The two halves of a LoRA delta as one product of up to kLoraRows rows, register-tiled:
//
//     sum[i][c] = (store == kAccumulate ? dest[i][c] : 0) + sum over k in [k0, k1) of
//                 left[i][k] * right[k * stride + c]        for c in [c0, c1)
//     dest[i][c] = store == kAdd ? dest[i][c] + sum[i][c] : sum[i][c]
//
// (in @ A: left the rows of in, right A, dest the scratch t; t @ B: left t, right B, dest
// y's rows). Each element is its own chain of fused multiply-adds in k order, whatever the
// rows beside it or the columns around it, so a row's delta has the same bits alone and in
// a batch. The AVX2 tiles keep up to 4 rows by up to 64 columns in registers, each right
// row read once per tile for all its rows (the old loops kept one row's sums in memory, a
// store and a load per multiply-add: about 10 GFLOP/s on two cores, against the dense
// kernels' 50).
#ifndef TOKENSERVE_KERNELS_LORA_PRODUCT_H_
#define TOKENSERVE_KERNELS_LORA_PRODUCT_H_

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu.h"
#include "op_support.h"

namespace tokenserve {
namespace {

constexpr int kLoraTileRows = 4;  // rows of one register tile

// What a product does with dest: overwrite it, continue its sums, or add its sums (from
// zero) to it.
enum class LoraStore { kSet, kAccumulate, kAdd };

#ifdef TOKENSERVE_CPU_X86
// One tile: NR rows by NV vectors of 8 columns from column c.
template <int NR, int NV>
TOKENSERVE_AVX2_FMA inline void LoraTileAvx2(const float* const* left, const float* right,
                                             int64 stride, int64 k0, int64 k1, int64 c,
                                             float* const* dest, LoraStore store, int64 ahead) {
  __m256 acc[NR][NV];
  for (int i = 0; i < NR; ++i) {
    for (int v = 0; v < NV; ++v) {
      acc[i][v] = store == LoraStore::kAccumulate ? _mm256_loadu_ps(dest[i] + c + 8 * v)
                                                  : _mm256_setzero_ps();
    }
  }
  for (int64 k = k0; k < k1; ++k) {
    const float* rk = right + k * stride + c;
    for (int v = 0; v < NV; v += 2) {
      _mm_prefetch(reinterpret_cast<const char*>(rk + ahead + 8 * v), _MM_HINT_T0);
    }
    __m256 w[NV];
    for (int v = 0; v < NV; ++v) w[v] = _mm256_loadu_ps(rk + 8 * v);
    for (int i = 0; i < NR; ++i) {
      const __m256 l = _mm256_broadcast_ss(left[i] + k);
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_fmadd_ps(l, w[v], acc[i][v]);
    }
  }
  for (int i = 0; i < NR; ++i) {
    for (int v = 0; v < NV; ++v) {
      float* out = dest[i] + c + 8 * v;
      _mm256_storeu_ps(out, store == LoraStore::kAdd ? _mm256_add_ps(_mm256_loadu_ps(out), acc[i][v])
                                                     : acc[i][v]);
    }
  }
}

// Columns [c, c1) of NR rows: tiles of NV vectors while they fit, then narrower ones, then
// the last columns one by one (std::fma: the same rounding as a vector lane's).
template <int NR, int NV>
TOKENSERVE_AVX2_FMA inline void LoraColumnsAvx2(const float* const* left, const float* right,
                                                int64 stride, int64 k0, int64 k1, int64 c,
                                                int64 c1, float* const* dest,
                                                LoraStore store, int64 ahead) {
  for (; c + 8 * NV <= c1; c += 8 * NV) {
    LoraTileAvx2<NR, NV>(left, right, stride, k0, k1, c, dest, store, ahead);
  }
  if constexpr (NV > 1) {
    LoraColumnsAvx2<NR, NV / 2>(left, right, stride, k0, k1, c, c1, dest, store, ahead);
  } else {
    for (; c < c1; ++c) {
      for (int i = 0; i < NR; ++i) {
        float acc = store == LoraStore::kAccumulate ? dest[i][c] : 0.f;
        for (int64 k = k0; k < k1; ++k) acc = std::fma(left[i][k], right[k * stride + c], acc);
        dest[i][c] = store == LoraStore::kAdd ? dest[i][c] + acc : acc;
      }
    }
  }
}

// Registers: NR x NV sums, NV right vectors and a broadcast, within AVX2's sixteen.
TOKENSERVE_AVX2_FMA inline void LoraProductAvx2(int64 n, const float* const* left,
                                                const float* right, int64 stride, int64 k0,
                                                int64 k1, int64 c0, int64 c1,
                                                float* const* dest, LoraStore store,
                                                int64 ahead) {
  for (int64 i = 0; i < n; i += kLoraTileRows) {
    const float* const* l = left + i;
    float* const* d = dest + i;
    switch (std::min<int64>(kLoraTileRows, n - i)) {
      case 1:
        LoraColumnsAvx2<1, 8>(l, right, stride, k0, k1, c0, c1, d, store, ahead);
        break;
      case 2:
        LoraColumnsAvx2<2, 4>(l, right, stride, k0, k1, c0, c1, d, store, ahead);
        break;
      case 3:
        LoraColumnsAvx2<3, 3>(l, right, stride, k0, k1, c0, c1, d, store, ahead);
        break;
      default:
        LoraColumnsAvx2<4, 2>(l, right, stride, k0, k1, c0, c1, d, store, ahead);
        break;
    }
  }
}
#endif  // TOKENSERVE_CPU_X86

// See the top of this file; left and dest hold n row pointers. Each right row read is
// prefetched `ahead` floats on (what a later tile reads: the factors come from memory, a
// few lines of 16 to 48 rows at a time, more streams than the hardware's prefetch follows).
inline void LoraProduct(int64 n, const float* const* left, const float* right, int64 stride,
                        int64 k0, int64 k1, int64 c0, int64 c1, float* const* dest,
                        LoraStore store, int64 ahead) {
  if (c0 >= c1) return;
#ifdef TOKENSERVE_CPU_X86
  if (cpu::HasAvx2Fma()) {
    LoraProductAvx2(n, left, right, stride, k0, k1, c0, c1, dest, store, ahead);
    return;
  }
#endif
  for (int64 i = 0; i < n; ++i) {
    float* __restrict di = dest[i];
    for (int64 c = c0; c < c1; ++c) {
      float acc = store == LoraStore::kAccumulate ? di[c] : 0.f;
      for (int64 k = k0; k < k1; ++k) acc += left[i][k] * right[k * stride + c];
      di[c] = store == LoraStore::kAdd ? di[c] + acc : acc;
    }
  }
}

}  // namespace
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_LORA_PRODUCT_H_
