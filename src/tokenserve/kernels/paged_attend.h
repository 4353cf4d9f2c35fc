// One work item of paged decode attention: one sequence and `span` consecutive kv heads
// (all of them, span = Hkv, unless that leaves fewer than 4 items per thread):
//   1. the item's queries, scaled, into a float buffer;
//   2. scores q . k for every valid position, row by row: the span * Dh values of each key
//      row are read once, contiguously, for all the item's query heads (4 rows at a time);
//   3. softmax in float32 with max subtraction (vectorized exp), per head;
//   4. the weighted sum of the value rows, again one contiguous read per row.
// Reading whole rows matters: the engine's rows come in blocks of 16 consecutive cache rows,
// so a block is one contiguous run the hardware prefetcher streams (one kv head per item, i.e.
// Dh values of every 768, measured 1.5-2.8x slower at 32 x 1024). The jumps between blocks
// (random places in the cache) are software-prefetched a few rows ahead (PrefetchRows).
//
// Attend dispatches an item to the AVX2 path (paged_attend_avx2.h) or the portable scalar
// one below (any Dh; also forced with isa="scalar" for tests). Accumulation is float32 for
// every dtype: bfloat16 and float16 values are widened exactly (float16 with F16C's
// vcvtph2ps on the AVX2 path) and a bfloat16 output is rounded to nearest even.
//
// Internal linkage (an unnamed namespace): every op file that includes this compiles its own
// copy, so its calls stay direct and the compiler inlines and clones it within that file as
// it would the file's own code.
#ifndef TOKENSERVE_KERNELS_PAGED_ATTEND_H_
#define TOKENSERVE_KERNELS_PAGED_ATTEND_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu.h"
#include "paged_attend_avx2.h"
#include "paged_item.h"

namespace tokenserve {
namespace {

// ---------------------------------------------------------------------------------------
// Portable scalar path. qs, out: the item's first query head; kc, vc: the caches offset to the
// item's first kv head.

template <typename T, typename C>
void AttendScalar(const Geometry& g, const T* qs, const C* kc, const C* vc, const int32_t* rows,
                  int64 len, Scratch* scratch, T* out) {
  const int64 Dh = g.Dh, G = g.group, heads = g.Heads(), width = g.width;
  const int64 bytes = g.span * Dh * static_cast<int64>(sizeof(C));
  float* q = scratch->q.data();
  float* scores = scratch->scores.data();
  float* acc = scratch->acc.data();
  float* inv = scratch->inv.data();
  for (int64 i = 0; i < heads * Dh; ++i) q[i] = ToFloat(qs[i]) * g.scale;
  for (int64 l = 0; l < len; ++l) {
    PrefetchRows(kc, rows, l + kAhead, l + kAhead + 1, len, width, bytes);
    const C* k = kc + rows[l] * width;
    for (int64 h = 0; h < heads; ++h) {
      const C* kh = k + (h / G) * Dh;
      float dot = 0.f;
      for (int64 d = 0; d < Dh; ++d) dot += q[h * Dh + d] * ToFloat(kh[d]);
      scores[h * len + l] = dot;
    }
  }
  SoftCapScores(g.softcap, scores, heads * len);
  for (int64 h = 0; h < heads; ++h) {
    float* s = scores + h * len;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64 l = 0; l < len; ++l) mx = std::max(mx, s[l]);
    float sum = 0.f;
    for (int64 l = 0; l < len; ++l) {
      s[l] = std::exp(s[l] - mx);
      sum += s[l];
    }
    inv[h] = 1.f / sum;
  }
  std::fill(acc, acc + heads * Dh, 0.f);
  for (int64 l = 0; l < len; ++l) {
    PrefetchRows(vc, rows, l + kAhead, l + kAhead + 1, len, width, bytes);
    const C* v = vc + rows[l] * width;
    for (int64 h = 0; h < heads; ++h) {
      const C* vh = v + (h / G) * Dh;
      const float p = scores[h * len + l];
      for (int64 d = 0; d < Dh; ++d) acc[h * Dh + d] += p * ToFloat(vh[d]);
    }
  }
  for (int64 h = 0; h < heads; ++h) {
    for (int64 d = 0; d < Dh; ++d) out[h * Dh + d] = FromFloat<T>(acc[h * Dh + d] * inv[h]);
  }
}

// One item, dispatched over ISA and Dh.
template <typename T, typename C>
void Attend(const Geometry& g, bool avx2, const T* qs, const C* kc, const C* vc,
            const int32_t* rows, int64 len, Scratch* scratch, T* out) {
  if (len == 0) {  // nothing to attend to: zeros, as documented
    std::fill(out, out + g.Heads() * g.Dh, FromFloat<T>(0.f));
    return;
  }
#ifdef TOKENSERVE_CPU_X86
  if (avx2 && g.Dh % 8 == 0 && g.Dh / 8 <= kMaxVectors) {
    switch (g.Dh) {
      case 32: return AttendAvx2<T, C, 4>(g, qs, kc, vc, rows, len, scratch, out);
      case 64: return AttendAvx2<T, C, 8>(g, qs, kc, vc, rows, len, scratch, out);
      case 128: return AttendAvx2<T, C, 16>(g, qs, kc, vc, rows, len, scratch, out);
      default: return AttendAvx2<T, C, 0>(g, qs, kc, vc, rows, len, scratch, out);
    }
  }
#endif
  AttendScalar<T, C>(g, qs, kc, vc, rows, len, scratch, out);
}

}  // namespace
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_PAGED_ATTEND_H_
