// TokenservePagedDecodeAttention: decode attention (one query per sequence) over a paged KV
// cache kept in two TF resource variables, read in place.
//
//   q        T [S, H, Dh]      the step's queries
//   key_cache, value_cache     resource handles of variables holding Tcache [R, Hkv * Dh]
//                              (Tcache: T, or a 16-bit type when T is float32: the cache is
//                              stored in 16 bits and widened to float32 as it is read)
//   rows     int32 [S, L]      cache row of each context position (all must lie in [0, R))
//   lengths  int32 [S]         positions 0 .. lengths[s] - 1 are attended to (0: zeros out)
//   out      T [S, H * Dh]     softmax(q . k * scale) . v per head, head h reading kv head
//                              h / (H / Hkv) (grouped-query attention)
//
// The graph path this replaces gathers the live rows into [S, L, Hkv * Dh] copies
// (ResourceGather), then runs batched matmuls, a softmax and transposes: at 32 sequences x
// 160 positions the copies alone are ~30 MB per layer, and at batch 1 the op overhead
// dominates. Here a work item on TF's intra-op pool is one sequence and `span` consecutive kv
// heads (all of them, span = Hkv, unless that leaves fewer than 4 items per thread):
//   1. the item's queries, scaled, into a float buffer;
//   2. scores q . k for every valid position, row by row: the span * Dh values of each key
//      row are read once, contiguously, for all the item's query heads (4 rows at a time);
//   3. softmax in float32 with max subtraction (vectorized exp), per head;
//   4. the weighted sum of the value rows, again one contiguous read per row.
// Reading whole rows matters: the engine's rows come in blocks of 16 consecutive cache rows,
// so a block is one contiguous run the hardware prefetcher streams (one kv head per item, i.e.
// Dh values of every 768, measured 1.5-2.8x slower at 32 x 1024). The jumps between blocks
// (random places in the cache) are software-prefetched a few rows ahead. Nothing of the cache
// is copied: the variables are looked up and read under a shared lock for the duration of the
// op, as ResourceGather does. The lock keeps the buffer from being replaced meanwhile (assign,
// or the one-time copy into copy-on-read mode, take it exclusively); it does NOT order the read
// against ResourceScatterUpdate, which writes POD dtypes under a shared lock too. That order
// comes from the graph: inside tf.function, automatic control dependencies make this op wait
// for earlier writes to the same variables (see paged_attention.py).
//
// TokenservePagedWriteDecodeAttention takes three more inputs, new_keys and new_values
// T [N, Hkv * Dh] and write_rows int32 [N], and stores those rows (cast to Tcache) before it
// attends, holding both locks exclusively: one op a layer where the engine's step ran a
// clip, a cast and a ResourceScatterUpdate per cache. Its writes follow
// ResourceScatterUpdate's rules (EnsureSparseVariableAccess): a buffer another tensor still
// references is replaced by a copy first, and the variable goes copy-on-read.
//
// Two inner paths with the same math: AVX2+FMA (functions with target attributes, chosen at
// run time with __builtin_cpu_supports, specialised for Dh = 32, 64, 128 so the loops over Dh
// unroll; any Dh that is a multiple of 8 up to 256 otherwise) and portable scalar C++ (any Dh;
// also forced with isa="scalar" for tests). Accumulation is float32 for every dtype: bfloat16
// and float16 values are widened exactly (float16 with F16C's vcvtph2ps on the AVX2 path) and
// a bfloat16 output is rounded to nearest even.

#include <algorithm>
#include <type_traits>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TOKENSERVE_X86 1
#endif

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/platform/mutex.h"
#include "tensorflow/core/platform/threadpool.h"
#include "chunks.h"
#include "cpu.h"
#include "widen.h"

namespace tokenserve {
namespace {

using tensorflow::bfloat16;
using Half = Eigen::half;
using tensorflow::DataTypeToEnum;
using tensorflow::int64;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::Var;
using tensorflow::errors::FailedPrecondition;
using tensorflow::errors::InvalidArgument;
using tensorflow::shape_inference::DimensionHandle;
using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;

constexpr int kMaxVectors = 32;  // AVX2 path: Dh up to 256 (32 vectors of 8 floats)

constexpr int64 kAhead = 8;       // rows are prefetched this many positions ahead
constexpr int kItemsPerThread = 4;  // split rows into kv-head spans until there are this many

// What every work item needs to know. An item is one sequence and `span` consecutive kv
// heads (span * group query heads): it reads span * Dh contiguous values of each cache row.
struct Geometry {
  int64 S, H, Dh, L, R, Hkv, group, width;  // width = Hkv * Dh (a cache row)
  int64 span;                               // kv heads per item; divides Hkv
  float scale;
  int64 Heads() const { return span * group; }  // query heads per item
};

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

// ---------------------------------------------------------------------------------------
// AVX2 + FMA path. Target attributes rather than -m flags, so the library still loads and
// takes the scalar path on a CPU without AVX2.
#ifdef TOKENSERVE_X86
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
#endif  // TOKENSERVE_X86

// One item, dispatched over ISA and Dh.
template <typename T, typename C>
void Attend(const Geometry& g, bool avx2, const T* qs, const C* kc, const C* vc,
            const int32_t* rows, int64 len, Scratch* scratch, T* out) {
  if (len == 0) {  // nothing to attend to: zeros, as documented
    std::fill(out, out + g.Heads() * g.Dh, FromFloat<T>(0.f));
    return;
  }
#ifdef TOKENSERVE_X86
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

// A new cache value, converted as tf.cast converts (Eigen's round-to-nearest-even; a NaN
// stays a NaN); a half cache first saturates at +-65504, as the engine's graph path clips
// before its cast, so a rare large value does not become an infinity.
template <typename T, typename C>
inline C ToCache(T v) {
  if constexpr (std::is_same_v<T, C>) {
    return v;
  } else if constexpr (std::is_same_v<C, Half>) {
    float x = static_cast<float>(v);
    x = x > 65504.f ? 65504.f : (x < -65504.f ? -65504.f : x);  // NaN passes through
    return static_cast<Half>(x);
  } else {
    return static_cast<C>(static_cast<float>(v));
  }
}

}  // namespace

REGISTER_OP("TokenservePagedDecodeAttention")
    .Input("q: T")                  // [S, H, Dh]
    .Input("key_cache: resource")   // variable of Tcache [R, Hkv * Dh]
    .Input("value_cache: resource")  // variable of Tcache [R, Hkv * Dh]
    .Input("rows: int32")           // [S, L]
    .Input("lengths: int32")        // [S]
    .Output("out: T")               // [S, H * Dh]
    .Attr("scale: float")
    .Attr("T: {float, bfloat16}")
    .Attr("Tcache: {float, bfloat16, half}")  // T, or bfloat16 / half when T is float
    .Attr("isa: {'auto', 'scalar'} = 'auto'")
    .Attr("kv_heads_per_item: int = 0")  // 0: automatic (tests and tuning only)
    // Stateful, like ResourceGather: it reads variables, so it must never be constant-folded
    // or merged with an identical call across a write to the cache.
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle q, rows, lengths, unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &q));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 0, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 2, &rows));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(4), 1, &lengths));
      DimensionHandle s, width;
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(q, 0), c->Dim(rows, 0), &s));
      TF_RETURN_IF_ERROR(c->Merge(s, c->Dim(lengths, 0), &s));
      TF_RETURN_IF_ERROR(c->Multiply(c->Dim(q, 1), c->Dim(q, 2), &width));
      c->set_output(0, c->Matrix(s, width));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Decode attention over a paged KV cache, reading the cache variables in place.
out[s, h*Dh:(h+1)*Dh] = softmax_l(q[s, h] . K[rows[s, l], kv*Dh:(kv+1)*Dh] * scale) . V[...]
over l < lengths[s], kv = h / (H / Hkv); zeros where lengths[s] == 0.
)doc");

REGISTER_OP("TokenservePagedWriteDecodeAttention")
    .Input("q: T")                  // [Q, H, Dh], Q >= S: queries past S get zeros
    .Input("key_cache: resource")   // variable of Tcache [R, Hkv * Dh]
    .Input("value_cache: resource")  // variable of Tcache [R, Hkv * Dh]
    .Input("rows: int32")           // [S, L]
    .Input("lengths: int32")        // [S]
    .Input("new_keys: T")           // [N, Hkv * Dh]
    .Input("new_values: T")         // [N, Hkv * Dh]
    .Input("write_rows: int32")     // [N]
    .Output("out: T")               // [Q, H * Dh]
    .Attr("scale: float")
    .Attr("T: {float, bfloat16}")
    .Attr("Tcache: {float, bfloat16, half}")
    .Attr("isa: {'auto', 'scalar'} = 'auto'")
    .Attr("kv_heads_per_item: int = 0")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle q, rows, lengths, new_keys, new_values, write_rows, unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &q));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 0, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 2, &rows));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(4), 1, &lengths));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(5), 2, &new_keys));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(6), 2, &new_values));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(7), 1, &write_rows));
      TF_RETURN_IF_ERROR(c->Merge(new_keys, new_values, &unused));
      DimensionHandle s, n, width;
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(new_keys, 0), c->Dim(write_rows, 0), &n));
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(rows, 0), c->Dim(lengths, 0), &s));
      TF_RETURN_IF_ERROR(c->Multiply(c->Dim(q, 1), c->Dim(q, 2), &width));
      c->set_output(0, c->Matrix(c->Dim(q, 0), width));
      return absl::OkStatus();
    })
    .Doc(R"doc(
TokenservePagedDecodeAttention after writing new rows into the cache, in one op:
key_cache[write_rows[i]] = new_keys[i] and value_cache[write_rows[i]] = new_values[i] in
order (cast to Tcache as tf.cast does; a half cache saturates at +-65504), then attention
over rows[s, :lengths[s]] as TokenservePagedDecodeAttention for the first S queries of q;
queries past S (a step's padding) get zeros. The graph orders it as a write, so later
reads of the same variables run after it.
)doc");

REGISTER_OP("TokenservePagedDecodeAttentionInfo")
    .Output("info: string")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Scalar());
      return absl::OkStatus();
    })
    .Doc("Which instruction set the TokenservePagedDecodeAttention kernel uses on this CPU.");

template <typename T, typename C, bool kWrite>
class PagedDecodeAttentionOp : public OpKernel {
 public:
  explicit PagedDecodeAttentionOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string isa;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("scale", &scale_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("isa", &isa));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("kv_heads_per_item", &span_));
    OP_REQUIRES(ctx, span_ >= 0, InvalidArgument("kv_heads_per_item must be >= 0"));
    avx2_ = isa == "auto" && cpu::HasAvx2FmaF16c();
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& q = ctx->input(0);
    const Tensor& rows = ctx->input(3);
    const Tensor& lengths = ctx->input(4);
    OP_REQUIRES(ctx, q.dims() == 3,
                InvalidArgument("q must be [S, H, Dh], got shape ", q.shape().DebugString()));
    OP_REQUIRES(ctx, rows.dims() == 2,
                InvalidArgument("rows must be [S, L], got shape ", rows.shape().DebugString()));
    OP_REQUIRES(ctx, lengths.dims() == 1,
                InvalidArgument("lengths must be [S], got shape ",
                                lengths.shape().DebugString()));
    Geometry g;
    // The writing op attends the first S = rows' queries of q and leaves the rest (the
    // step's bucket padding) zero; the reading op takes exactly S.
    const int64 num_queries = q.dim_size(0);
    g.S = kWrite ? rows.dim_size(0) : num_queries;
    g.H = q.dim_size(1);
    g.Dh = q.dim_size(2);
    g.L = rows.dim_size(1);
    g.scale = scale_;
    OP_REQUIRES(ctx, rows.dim_size(0) == g.S && lengths.dim_size(0) == g.S && g.S <= num_queries,
                InvalidArgument("q has ", num_queries, " queries but rows is ",
                                rows.shape().DebugString(), " and lengths ",
                                lengths.shape().DebugString()));
    OP_REQUIRES(ctx, g.Dh > 0, InvalidArgument("q's head size Dh must be positive"));

    // Lengths and rows first (they need no lock); the row bound R comes from the variable.
    const int32_t* len_p = lengths.flat<int32_t>().data();
    for (int64 s = 0; s < g.S; ++s) {
      OP_REQUIRES(ctx, len_p[s] >= 0 && len_p[s] <= g.L,
                  InvalidArgument("lengths[", s, "] = ", len_p[s], " is not in [0, L = ", g.L,
                                  "]"));
    }
    const int32_t* rows_p = rows.flat<int32_t>().data();
    const int64 num_rows = g.S * g.L;
    int32_t lo = 0, hi = 0;  // min and max row (a vectorizable pass; the slow search on error)
    if (num_rows > 0) {
      lo = hi = rows_p[0];
      for (int64 i = 1; i < num_rows; ++i) {
        lo = std::min(lo, rows_p[i]);
        hi = std::max(hi, rows_p[i]);
      }
    }

    tensorflow::core::RefCountPtr<Var> key_var, value_var;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 1), &key_var));
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 2), &value_var));
    // Shared locks for the whole computation, as ResourceGather holds its lock for the whole
    // gather: no reference to the (multi-GB) buffer is taken, so nothing ever copies it, and
    // the buffer cannot be replaced under us. Scatters, which also
    // hold the lock shared, are ordered by the graph, not here. Several variables are locked
    // in order of increasing mu() address (resource_var.h).
    tensorflow::mutex* first = key_var->mu();
    tensorflow::mutex* second = value_var->mu();
    if (second < first) std::swap(first, second);
    // The writing op holds both locks exclusively (it may replace a shared buffer, below).
    std::optional<tensorflow::tf_shared_lock> first_shared, second_shared;
    std::optional<tensorflow::mutex_lock> first_exclusive, second_exclusive;
    if (kWrite) {
      first_exclusive.emplace(*first);
      if (second != first) second_exclusive.emplace(*second);
    } else {
      first_shared.emplace(*first);
      if (second != first) second_shared.emplace(*second);
    }

    const Tensor* keys = key_var->tensor();
    const Tensor* values = value_var->tensor();
    for (const auto& [name, var] : {std::pair<const char*, Var*>{"key_cache", key_var.get()},
                                    {"value_cache", value_var.get()}}) {
      OP_REQUIRES(ctx, var->is_initialized,
                  FailedPrecondition(name, ": attempting to use an uninitialized variable"));
      const Tensor* t = var->tensor();
      OP_REQUIRES(ctx, t->dtype() == DataTypeToEnum<C>::v(),
                  InvalidArgument(name, " holds ", tensorflow::DataTypeString(t->dtype()),
                                  " but Tcache is ",
                                  tensorflow::DataTypeString(DataTypeToEnum<C>::v())));
      OP_REQUIRES(ctx, t->dims() == 2,
                  InvalidArgument(name, " must be [R, Hkv * Dh], got shape ",
                                  t->shape().DebugString()));
    }
    OP_REQUIRES(ctx, keys->shape() == values->shape(),
                InvalidArgument("key_cache ", keys->shape().DebugString(),
                                " and value_cache ", values->shape().DebugString(),
                                " differ in shape"));
    g.R = keys->dim_size(0);
    g.width = keys->dim_size(1);
    OP_REQUIRES(ctx, g.width % g.Dh == 0 && g.width > 0,
                InvalidArgument("cache rows hold ", g.width, " values, not a positive multiple of"
                                " q's head size Dh = ", g.Dh));
    g.Hkv = g.width / g.Dh;
    OP_REQUIRES(ctx, g.H % g.Hkv == 0,
                InvalidArgument("q's H = ", g.H, " heads are not a multiple of the cache's Hkv = ",
                                g.Hkv, " kv heads (", g.width, " / Dh = ", g.Dh, ")"));
    g.group = g.H / g.Hkv;
    if (num_rows > 0 && (lo < 0 || hi >= g.R)) {
      for (int64 i = 0; i < num_rows; ++i) {
        OP_REQUIRES(ctx, rows_p[i] >= 0 && rows_p[i] < g.R,
                    InvalidArgument("rows[", i / g.L, ", ", i % g.L, "] = ", rows_p[i],
                                    " is not in [0, ", g.R, ")"));
      }
    }

    if (kWrite) {
      WriteRows(ctx, g, key_var.get(), value_var.get());
      if (!ctx->status().ok()) return;
      keys = key_var->tensor();  // a shared buffer was replaced by its copy
      values = value_var->tensor();
    }

    Tensor* out_tensor = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({num_queries, g.H * g.Dh}),
                                             &out_tensor));
    if (num_queries > g.S) {  // zeros (of float and bfloat16 alike)
      std::memset(out_tensor->flat<T>().data() + g.S * g.H * g.Dh, 0,
                  (num_queries - g.S) * g.H * g.Dh * sizeof(T));
    }
    if (g.S == 0 || g.H == 0) return;

    const T* qp = q.flat<T>().data();
    const C* kp = keys->flat<C>().data();
    const C* vp = values->flat<C>().data();
    T* op = out_tensor->flat<T>().data();
    const bool avx2 = avx2_;
    // Items: a sequence and `span` consecutive kv heads. Whole rows (span = Hkv) read the
    // cache most efficiently (a block of consecutive rows is one contiguous run, which the
    // hardware prefetcher streams); smaller spans where needed for enough parallel items
    // (kItemsPerThread; one kv head per item at the least).
    OP_REQUIRES(ctx, span_ == 0 || g.Hkv % span_ == 0,
                InvalidArgument("kv_heads_per_item = ", span_, " does not divide Hkv = ",
                                g.Hkv));
    const int threads = ctx->device()->tensorflow_cpu_worker_threads()->num_threads;
    g.span = g.Hkv;
    while (g.span > 1 && g.S * (g.Hkv / g.span) < kItemsPerThread * std::max(threads, 1)) {
      do --g.span; while (g.Hkv % g.span);
    }
    if (span_ > 0) g.span = span_;
    const int64 parts = g.Hkv / g.span;
    auto work = [&](int64 begin, int64 end) {
      Scratch scratch(g);
      for (int64 item = begin; item < end; ++item) {
        const int64 s = item / parts, kv = (item % parts) * g.span;
        const int64 head = kv * g.group;  // the item's first query head
        Attend<T, C>(g, avx2, qp + (s * g.H + head) * g.Dh, kp + kv * g.Dh, vp + kv * g.Dh,
                  rows_p + s * g.L, len_p[s], &scratch, op + (s * g.H + head) * g.Dh);
      }
    };
    // Cycles per item, roughly: the key and value values read (~2 cycles each from memory)
    // plus 2 FMAs per value and query head, 8 per cycle. Chunks of about kChunkCycles each:
    // a small call stays one chunk on the calling thread, a big one is shared with the
    // ops' helper team (chunks.h), which is awake during generation where a pool thread
    // woken by ParallelFor is not.
    const int64 cost = g.L * g.span * g.Dh * (4 + g.group / 2) + 500;
    const int64 items = g.S * parts;
    const ChunkSplit split = SplitIntoChunks(items, cost);
    RunChunks(ctx->device()->tensorflow_cpu_worker_threads()->workers, std::max(threads, 1),
              split.num_chunks, [&](int64 chunk, int64) {
                work(chunk * split.per_chunk, std::min(items, (chunk + 1) * split.per_chunk));
              });
  }

 private:
  // The new rows into both caches (the lock held exclusively), as ResourceScatterUpdate
  // would write them: a buffer that another tensor still references is first replaced by a
  // copy, and the variable is put in copy-on-read mode, as TF's sparse writes do
  // (EnsureSparseVariableAccess), so a later dense read copies rather than aliasing a buffer
  // written in place. Duplicate rows: the last write wins (the engine's padding rows all
  // write the same values to row 0).
  void WriteRows(OpKernelContext* ctx, const Geometry& g, Var* key_var, Var* value_var) {
    const Tensor& new_keys = ctx->input(5);
    const Tensor& new_values = ctx->input(6);
    const Tensor& write_rows = ctx->input(7);
    OP_REQUIRES(ctx, write_rows.dims() == 1,
                InvalidArgument("write_rows must be [N], got shape ",
                                write_rows.shape().DebugString()));
    const int64 n = write_rows.dim_size(0);
    for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"new_keys", &new_keys},
                                  {"new_values", &new_values}}) {
      OP_REQUIRES(ctx, t->dims() == 2 && t->dim_size(0) == n && t->dim_size(1) == g.width,
                  InvalidArgument(name, " must be [N = ", n, ", ", g.width, "], got shape ",
                                  t->shape().DebugString()));
    }
    const int32_t* where = write_rows.flat<int32_t>().data();
    for (int64 i = 0; i < n; ++i) {
      OP_REQUIRES(ctx, where[i] >= 0 && where[i] < g.R,
                  InvalidArgument("write_rows[", i, "] = ", where[i], " is not in [0, ", g.R,
                                  ")"));
    }
    for (Var* var : {key_var, value_var}) {
      if (var->copy_on_read_mode.load()) continue;
      if (!var->tensor()->RefCountIsOne()) {
        Tensor copy;
        OP_REQUIRES_OK(ctx, ctx->allocate_temp(var->tensor()->dtype(), var->tensor()->shape(),
                                               &copy));
        std::memcpy(copy.data(), var->tensor()->data(), var->tensor()->TotalBytes());
        *var->tensor() = copy;
      }
      var->copy_on_read_mode.store(true);
    }
    const std::pair<Var*, const Tensor*> writes[] = {{key_var, &new_keys},
                                                      {value_var, &new_values}};
    for (const std::pair<Var*, const Tensor*>& write : writes) {
      const T* src = write.second->template flat<T>().data();
      C* dst = write.first->tensor()->template flat<C>().data();
      for (int64 i = 0; i < n; ++i) {
        C* row = dst + static_cast<int64>(where[i]) * g.width;
        const T* from = src + i * g.width;
        for (int64 j = 0; j < g.width; ++j) row[j] = ToCache<T, C>(from[j]);
      }
    }
  }

  float scale_ = 1.f;
  int64 span_ = 0;  // kv heads per item; 0: automatic
  bool avx2_ = false;
};

class PagedDecodeAttentionInfoOp : public OpKernel {
 public:
  explicit PagedDecodeAttentionInfoOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  void Compute(OpKernelContext* ctx) override {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<tensorflow::tstring>()() = cpu::HasAvx2FmaF16c() ? "AVX2+FMA" : "scalar (no AVX2+FMA)";
  }
};

// (q, cache) dtypes: the same, or a float32 step over a 16-bit cache.
#define REGISTER(T, C)                                                   \
  REGISTER_KERNEL_BUILDER(Name("TokenservePagedDecodeAttention")        \
                              .Device(tensorflow::DEVICE_CPU)            \
                              .TypeConstraint<T>("T")                    \
                              .TypeConstraint<C>("Tcache"),              \
                          PagedDecodeAttentionOp<T, C, false>);          \
  REGISTER_KERNEL_BUILDER(Name("TokenservePagedWriteDecodeAttention")   \
                              .Device(tensorflow::DEVICE_CPU)            \
                              .TypeConstraint<T>("T")                    \
                              .TypeConstraint<C>("Tcache"),              \
                          PagedDecodeAttentionOp<T, C, true>);
REGISTER(float, float)
REGISTER(bfloat16, bfloat16)
REGISTER(float, bfloat16)
REGISTER(float, Half)
#undef REGISTER
REGISTER_KERNEL_BUILDER(Name("TokenservePagedDecodeAttentionInfo").Device(tensorflow::DEVICE_CPU),
                        PagedDecodeAttentionInfoOp);

}  // namespace tokenserve
