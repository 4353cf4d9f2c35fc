// What every work item of the paged attention ops needs: its geometry and scratch, the
// widening of q and cache values to float32 and back, and the prefetch of the cache rows it
// jumps to.
//
// Internal linkage (an unnamed namespace): every op file that includes this compiles its own
// copy, so its calls stay direct and the compiler inlines and clones it within that file as
// it would the file's own code.
#ifndef TOKENSERVE_KERNELS_PAGED_ITEM_H_
#define TOKENSERVE_KERNELS_PAGED_ITEM_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "tensorflow/core/framework/numeric_types.h"
#include "op_support.h"
#include "widen.h"

namespace tokenserve {
namespace {

using tensorflow::bfloat16;
using Half = Eigen::half;

constexpr int kMaxVectors = 32;  // AVX2 path: Dh up to 256 (32 vectors of 8 floats)

constexpr int64 kAhead = 8;       // rows are prefetched this many positions ahead
constexpr int kItemsPerThread = 4;  // split rows into kv-head spans until there are this many

// What every work item needs to know. An item is one sequence and `span` consecutive kv
// heads (span * group query heads): it reads span * Dh contiguous values of each cache row.
struct Geometry {
  int64 S, H, Dh, L, R, Hkv, group, width;  // width = Hkv * Dh (a cache row)
  int64 span;                               // kv heads per item; divides Hkv
  float scale;
  float softcap = 0.f;                      // Gemma 2's score cap (SoftCapScores); 0: none
  int64 Heads() const { return span * group; }  // query heads per item
};

// Gemma 2's soft cap on one item's scaled scores [n], before the softmax: cap * tanh(s / cap),
// as the graph's soft_cap computes it (float32 division, tanh and product).
inline void SoftCapScores(float cap, float* scores, int64 n) {
  if (cap <= 0.f) return;
  for (int64 i = 0; i < n; ++i) scores[i] = cap * std::tanh(scores[i] / cap);
}

// Per-shard scratch: scaled queries [heads, Dh], scores [heads, L], accumulators
// [heads, Dh], 1 / softmax denominators [heads].
struct Scratch {
  std::vector<float> q, scores, acc, inv;
  explicit Scratch(const Geometry& g)
      : q(g.Heads() * g.Dh), scores(g.Heads() * std::max<int64>(g.L, 1)),
        acc(g.Heads() * g.Dh), inv(g.Heads()) {}
};

using widen::ToFloat;  // float, bfloat16 (widen.h)
inline float ToFloat(Half x) { return static_cast<float>(x); }  // exact
template <typename T>
inline T FromFloat(float x) {
  return static_cast<T>(x);  // bfloat16: Eigen rounds to nearest even
}

// Prefetches the slices (bytes from base + row * width) of the rows at positions
// [from, to) (clipped to len), skipping a row that continues the previous position's row: the
// engine's rows come in blocks of consecutive rows, which the hardware prefetcher streams by
// itself, while the jumps between blocks (to random places in the cache) it cannot guess.
// Measured at 32 x 1024 with paged and with random rows, prefetching every row, only the
// jumps, or nothing were within noise of each other on an EPYC; the jumps are kept for CPUs
// with a weaker prefetcher.
template <typename T>
inline void PrefetchRows(const T* base, const int32_t* rows, int64 from, int64 to, int64 len,
                         int64 width, int64 bytes) {
  for (int64 a = from; a < std::min(to, len); ++a) {
    if (a > 0 && rows[a] == rows[a - 1] + 1) continue;
    const char* c = reinterpret_cast<const char*>(base + rows[a] * width);
    for (int64 off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 1);
  }
}

}  // namespace
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_PAGED_ITEM_H_
