// Dense layers for small decode batches, in graph mode (no XLA): float32 activations and
// arithmetic, float32 or bfloat16 weights (attribute T). A bfloat16 weight is widened as it
// is read (exact: its bits are a float32's upper half), so every kernel below does the same
// float32 math on either, and a bfloat16 matrix streams half the bytes.
//
// TokenserveDense     y = epilogue(x @ W + bias)            x [M, K], y [M, N] or [M, N / 2]
//   layout "kn": W is [K, N] (Keras' Dense kernel); "nk": W is [N, K] (a tied embedding used
//   as the LM head). bias: [N] or [0] (none). residual: [M, N] or [0, 0] (none), added last.
//   activation: "none"; "gelu_tanh" (GPT-2's); "swiglu": y[:, j] = silu(z[:, j]) * z[:, j + N/2]
//   (gate and up fused in one kernel, the output is N / 2 wide).
// TokenserveEpilogue  the same epilogue on a finished product z [M, N] (int8 weights' matmul).
// TokenserveNorm      LayerNorm (scale, bias) or RMSNorm (scale) over the last axis of [M, D].
// TokenserveFinishBlock  a transformer block's second half (output projection, residual,
//   MLP norm, MLP up and activation, MLP down, residual) in one op, optionally with the next
//   block's norm and QKV projection: the dense and norm code above, called in turn, so the
//   matrices stream back to back.
//
// Why these exist: a batch-1 decode step of GPT-2-small reads 498 MB of float32 weights.
// This machine streams about 45 GB/s with two cores, so the floor is about 11 ms, and the
// matmuls alone reach it; but XLA's CPU runtime spends several more milliseconds per step
// between its small fusions (norms, bias adds, GELU), and graph-mode TF spends ~10 us per
// op. Here each dense layer is one op with its bias, activation and residual fused, and a
// norm is one op, so a transformer block is about a dozen ops.
//
// Work split: "kn" with up to 8 rows of x (decode at batch 1-8, a sequence checking up to 7
// drafts) splits K, one contiguous range of weight rows per thread read front to back, into
// per-thread partial sums; from 9 rows with AVX2 it also splits K, into chunks of 64 weight
// rows by up to 1,024 columns, each packed and multiplied in register tiles
// (KnPackedAvx2); otherwise (scalar, or K too short to split) it splits N into 2 x threads
// column ranges, each walked row by row over K into float accumulators for up to 8 rows of
// x at a time, which stay in L1/L2; "nk" splits N
// into tiles of rows, a contiguous range of them per thread, each row a dot product with
// every row of x, or from 24 rows with AVX2 into blocks of 64 rows transposed into the same
// register tiles (NkPackedAvx2). Where a thread reads weights faster than it computes (up
// to 8 rows of x), it prefetches them into L2 well ahead of the hardware prefetcher.
// Accumulation is float32, in a different order from XLA's, so results match it to float
// rounding, not bit for bit.
//
// Two inner paths with the same math: AVX2+FMA (functions with target attributes, chosen at
// run time) and portable scalar C++ (also forced with isa="scalar" for tests).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TOKENSERVE_X86 1
#endif

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/platform/threadpool.h"
#include "chunks.h"
#include "cpu.h"
#include "widen.h"
#include "rowops.h"
#include "tensor_args.h"

namespace tokenserve {
namespace {

using tensorflow::DEVICE_CPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::errors::InvalidArgument;
using tensorflow::shape_inference::DimensionHandle;
using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;
using int64 = int64_t;

constexpr int64 kRowsPerPass = 8;   // rows of x sharing one pass over the weights ("kn")
constexpr int64 kMaxRange = 1024;   // columns per work item at most ("kn"): 4 KB per row
constexpr int64 kTileRows = 256;    // weight rows per work item ("nk")
constexpr int64 kNkPrefetchRows = 8;  // "nk": how many weight rows ahead to prefetch
// "nk": and four rows this many ahead into L2, up to the end of the tile the worker takes
// next. GPT-2-small's head [50257, 768] alone, AVX2 code on a 2-core Zen 5, alternating
// processes, 3 rounds: M = 1 6.2-6.4 -> 4.6-5.7 ms, M = 4 7.4-7.6 -> 5.7-7.1, M = 8
// 9.1-9.3 -> 7.8-8.8, M = 16 12.6-13.1 -> 11.6-12.1. In the engine (one float32 sequence
// sampled at temperature 0.8, which reads this head every step) no change showed beyond the
// noise: 44.6-52.1 -> 41.5-51.9 tok/s, 5 alternating rounds.
constexpr int64 kNkPrefetchL2Rows = 24;
constexpr int64 kChunksPerWorker = 4;  // "kn" split-K chunks per thread (late threads take fewer)
// "kn" with at most this many rows of x splits K instead. GPT-2-small's float32 engine step
// on a 2-core AVX2-only EPYC, one sequence checking drafts (5 / 8 rows): 23.3 / 31.1 ms with
// K split, against 29.7 ms for the column-range walk at 5 and 39.0 packed at 8.
constexpr int64 kSplitKMaxRows = 8;
constexpr int64 kSplitKMinRows = 64;  // weight rows per thread at least, when K is split
// "kn" with bfloat16 weights and up to 8 rows of x: each of the four weight rows read at once
// is prefetched this many weights (2 KB) ahead. The float32 rows need no software prefetch,
// but the bfloat16 ones did: forty GPT-2-small MLP matrices [768, 3072] at one row of x on a
// 2-core Zen 5 EPYC, alternating processes, took 9.5-10.7 ms without it, 8.3 at 512 weights
// ahead, 7.2-8.0 at 1,024, 6.7-7.8 at 1,536 and 7.8-7.9 at 2,048 (float32: 10.3-13.4 ms).
constexpr int64 kBf16Ahead = 1024;
// "kn" with AVX2 and at least this many rows of x (and more than split K takes): packed
// chunks (in GPT-2-small's engine step the column-range walk was 9 % faster at 6 rows, the
// same at 8, slower from 16)
constexpr int64 kPackedMinRows = 8;

using rowops::Activation;
using tensor_args::CheckNextNorm;
using tensor_args::Data;
using tensor_args::IsVectorOrEmpty;
using rowops::FinishRow;

struct Geometry {
  int64 M, K, N;  // x [M, K]; z = x @ W: [M, N]
  int64 out;      // y's width: N, or N / 2 for swiglu
};

using tensorflow::bfloat16;
using widen::ToFloat;

// One call's operands; W: float or bfloat16 (the weights' storage; x, sums and y are
// float32).
template <typename W>
struct Args {
  const float* x;
  const W* w;
  const float* bias;      // nullptr: none
  const float* residual;  // nullptr: none; [M, out]
  float* y;               // [M, out]
  Activation act;
};

#ifdef TOKENSERVE_X86
#define AVX2_FN __attribute__((target("avx2,fma")))
using widen::Load8;  // eight weights as floats: float32, or bfloat16 widened

// "kn": acc[r, 0 .. width) = x[r, :] @ W[:, j0 .. j0 + width) for rows r of one pass.
// Four weight rows per iteration: each accumulator is loaded and stored once per four FMAs.
template <typename W>
AVX2_FN void KnRangeAvx2(const Geometry& g, const float* x, int64 rows, const W* w,
                         int64 j0, int64 width, float* acc) {
  std::fill(acc, acc + rows * width, 0.f);
  const int64 vec = width / 8 * 8;
  int64 k = 0;
  for (; k + 4 <= g.K; k += 4) {
    const W* w0 = w + k * g.N + j0;
    const W* w1 = w0 + g.N;
    const W* w2 = w1 + g.N;
    const W* w3 = w2 + g.N;
    if (k + 8 < g.K) {  // the rows after next: one line per 16 floats of the range
      const W* ahead = w0 + 8 * g.N;
      for (int64 j = 0; j < width; j += 16) {
        _mm_prefetch(reinterpret_cast<const char*>(ahead + j), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(ahead + g.N + j), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(ahead + 2 * g.N + j), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(ahead + 3 * g.N + j), _MM_HINT_T0);
      }
    }
    for (int64 r = 0; r < rows; ++r) {
      const float* xr = x + r * g.K + k;
      const __m256 x0 = _mm256_set1_ps(xr[0]), x1 = _mm256_set1_ps(xr[1]);
      const __m256 x2 = _mm256_set1_ps(xr[2]), x3 = _mm256_set1_ps(xr[3]);
      float* a = acc + r * width;
      int64 j = 0;
      for (; j < vec; j += 8) {
        __m256 s = _mm256_loadu_ps(a + j);
        s = _mm256_fmadd_ps(x0, Load8(w0 + j), s);
        s = _mm256_fmadd_ps(x1, Load8(w1 + j), s);
        s = _mm256_fmadd_ps(x2, Load8(w2 + j), s);
        s = _mm256_fmadd_ps(x3, Load8(w3 + j), s);
        _mm256_storeu_ps(a + j, s);
      }
      for (; j < width; ++j) {
        a[j] += xr[0] * ToFloat(w0[j]) + xr[1] * ToFloat(w1[j]) + xr[2] * ToFloat(w2[j]) +
                xr[3] * ToFloat(w3[j]);
      }
    }
  }
  for (; k < g.K; ++k) {
    const W* wk = w + k * g.N + j0;
    for (int64 r = 0; r < rows; ++r) {
      const float xv = x[r * g.K + k];
      float* a = acc + r * width;
      for (int64 j = 0; j < width; ++j) a[j] += xv * ToFloat(wk[j]);
    }
  }
}

// "kn" for up to 8 rows of x: acc[r, :] += x[r, k0 .. k1) @ W[k0 .. k1, :] with the whole
// width of W per weight row, so the rows [k0, k1) are read front to back. P weight rows per
// pass: each accumulator is loaded and stored once per P FMAs, not once per FMA. On a 2-core
// AVX2-only EPYC a standalone test of GPT-2-small's block matrices at batch 1 streamed them
// at 28-32 GB/s four rows at a time against 20-23 GB/s one row at a time (its plain read
// loop: 25-33 GB/s). Float32 weights take eight rows a pass: they feed the FMAs from
// memory (one row of x) or from eight registers (more rows, whose broadcasts of x are then
// read from the stack), so the accumulators' loads and stores halve again. On a 2-core
// Zen 5, one thread, standalone, medians of three: the [3072, 768] and [768, 3072] matrices
// read from memory at 17.0 and 19.9 GB/s against 14.3 and 18.5 with four at one row of x,
// 12.9 / 15.3 against 9.9 / 13.7 at two, 12.4 / 15.5 against 10.1 / 12.0 at four, 8.0 / 9.6
// against 7.5 / 7.2 at eight (its plain read loop: 20-25 GB/s). bfloat16 rows keep four:
// they are widened in registers, and eight measured 4 % slower (twelve GPT-2-small block
// ops at one row, native build). The FMAs into one accumulator run in k order either way,
// so the sums are the same bits. The hardware prefetcher follows the streams of float32
// rows, but not all the way: a prefetch of each row 8 weights ahead into L1 measured no
// better, while spreading a prefetch of the next pass's rows into L2 over this pass
// (`ahead`) brought the pass from 0.91-0.92 of a plain two-thread read loop to 0.98-0.99
// (benchmarks/kernels/kn_row_variants.cc: the 48 block matrices of GPT-2-small at one row
// of x, 2-core Zen 5 with AVX2 code, eight alternating rounds), and one float32 sequence in
// the engine 1.10x (alternating processes, 4 rounds, AVX2 cap). bfloat16 rows, four a pass,
// keep their prefetch into L1 and take the same one into L2 (one line a step): on the Zen 5
// without caps, one bfloat16 sequence 1.21x (1.15-1.29), eight 1.19x (1.14-1.33;
// alternating processes, 4 rounds). The prefetch changes no result.
template <int M, int P, typename W>
AVX2_FN inline void KnPassAvx2(const Geometry& g, const float* x, const W* w, int64 k,
                               float* acc, const W* ahead = nullptr) {
  const int64 vec = g.N / 8 * 8;
  const W* rows[P];
  __m256 xs[M][P];
  for (int i = 0; i < P; ++i) rows[i] = w + (k + i) * g.N;
  for (int r = 0; r < M; ++r) {
    for (int i = 0; i < P; ++i) xs[r][i] = _mm256_set1_ps(x[r * g.K + k + i]);
  }
  int64 j = 0;
  for (; j < vec; j += 8) {
    if constexpr (sizeof(W) == 2) {  // a line of each row, kBf16Ahead weights ahead
      if ((j & 31) == 0) {
        for (int i = 0; i < P; ++i) {
          _mm_prefetch(reinterpret_cast<const char*>(rows[i] + j + kBf16Ahead), _MM_HINT_T0);
        }
      }
    }
    if (ahead != nullptr) {  // the next pass's P rows into L2, 8 * P weights a step
      cpu::PrefetchL2(ahead + j * P, 8 * P * sizeof(W));
    }
    __m256 v[P];
    for (int i = 0; i < P; ++i) v[i] = Load8(rows[i] + j);
    for (int r = 0; r < M; ++r) {
      float* a = acc + r * g.N + j;
      __m256 s = _mm256_loadu_ps(a);
      for (int i = 0; i < P; ++i) s = _mm256_fmadd_ps(xs[r][i], v[i], s);
      _mm256_storeu_ps(a, s);
    }
  }
  for (; j < g.N; ++j) {
    for (int r = 0; r < M; ++r) {
      float s = acc[r * g.N + j];
      for (int i = 0; i < P; ++i) s = std::fma(x[r * g.K + k + i], ToFloat(rows[i][j]), s);
      acc[r * g.N + j] = s;
    }
  }
}

template <int M, typename W>
AVX2_FN void KnRowsAvx2(const Geometry& g, const float* x, const W* w, int64 k0, int64 k1,
                        float* acc) {
  int64 k = k0;
  if constexpr (sizeof(W) == 4) {
    for (; k + 8 <= k1; k += 8) {
      KnPassAvx2<M, 8>(g, x, w, k, acc, k + 16 <= k1 ? w + (k + 8) * g.N : nullptr);
    }
  }
  if constexpr (sizeof(W) == 2) {
    for (; k + 4 <= k1; k += 4) {
      KnPassAvx2<M, 4>(g, x, w, k, acc, k + 8 <= k1 ? w + (k + 4) * g.N : nullptr);
    }
  }
  for (; k + 4 <= k1; k += 4) KnPassAvx2<M, 4>(g, x, w, k, acc);
  for (; k < k1; ++k) KnPassAvx2<M, 1>(g, x, w, k, acc);
}

// "kn" for more rows of x (prefill, decode of many sequences): a register-tiled product
// over packed weight rows. The column-range walk (KnRangeAvx2) loads and stores its
// accumulators in memory once per four FMAs, and reads W a 4 KB page apart per row. Here a
// work item is kPackDepth weight rows by up to kPackWidth columns: its rows' slices (up to
// 4 KB each, front to back) are copied into panels of kPanel columns, each
// [kPackDepth, kPanel] contiguous (4 KB, in L1), and every panel then feeds kTileRowsX x
// kPanel accumulators held in registers, added into the worker's partial sums [M, N]. A
// standalone test on a 2-core AVX2-only EPYC, GPT-2-small's MLP matrices at 32 rows read
// from memory: 2.2-2.5 ms for both cores (60-69 GF/s); computing from W in place with
// software prefetch instead of packing, 2.9-4.7 ms; packing column blocks of 192 (each
// weight row's slice a new page and a cold stream) spent half the op's time in the copy.
//
// The copy still took 37 % of the op (32 rows, AVX2 stand-in on a Zen 5), for two reasons.
// Its loads waited on memory: each row's slice starts a new page, and the hardware
// prefetcher is idle while the panels compute. So each worker owns a range of work items
// (RunRanges), knows its next one, and prefetches that item's rows into L2 from inside the
// tile loops (LinePrefetch), so the reads spread over the compute. And its stores went 4 KB
// apart, one per panel, all into one L1 set: the panels are now kPanelPad floats further
// apart. Twelve GPT-2-small MLPs (up with GELU, down with the residual), in process,
// alternating per call, 20 rounds, medians of the ratios: 1.21-1.27x at 32 rows, 1.34x at
// 16; either change alone: the prefetch 1.08-1.18x, the padding 1.02-1.04x (the copy then
// still waited on its loads). Prefetching into L1 instead was 1.25-1.4x slower: it evicts
// the panel and the rows of x that the tiles are reading.
constexpr int64 kPanel = 16;      // columns of one packed panel: two ymm registers
constexpr int64 kTileRowsX = 6;   // rows of x per register tile
constexpr int64 kPackDepth = 64;  // weight rows per work item
constexpr int64 kPackWidth = 1024;  // columns per work item at most
constexpr int64 kPanelPad = 16;   // floats between packed panels (one cache line)
constexpr int64 kPanelStride = kPackDepth * kPanel + kPanelPad;  // floats per panel, at most

// out[r, 0 .. cols) (= or +=, `first`) x[r, 0 .. depth) @ panel for R rows of x (ldx
// apart); panel [depth, kPanel] contiguous. Twelve accumulators, two panel loads and six
// broadcasts per twelve FMAs: 15 of the 16 ymm registers. They are named, not an array:
// GCC kept a __m256 c[R][2] on the stack and stored it every iteration.
// lo += x * b0, hi += x * b1: one row of x in a register tile.
AVX2_FN __attribute__((always_inline)) inline void FmaRow(const float* x, __m256 b0, __m256 b1,
                                                          __m256& lo, __m256& hi) {
  const __m256 a = _mm256_broadcast_ss(x);
  lo = _mm256_fmadd_ps(a, b0, lo);
  hi = _mm256_fmadd_ps(a, b1, hi);
}

// The lines of a weight block (`rows` rows of `bytes` each, `stride` bytes apart) that a
// worker will read next, prefetched into L2 one line at a time from inside the tile loops:
// every 2^shift iterations of a tile's k loop issue one. A burst of prefetches, a whole
// weight row's 64 lines after each panel, stalled on the few line-fill buffers a core has
// (perf put half the packing function's samples on its prefetch loop, at 32 rows), while
// the FMAs waited; one line now and then keeps the loads in flight behind the compute.
struct LinePrefetch {
  const char* row = nullptr;  // the current row's start; nullptr: nothing (left) to fetch
  int64 offset = 0, bytes = 0, stride = 0, rows_left = 0;
  int64 mask = ~int64{0};     // issue when (k & mask) == mask; all ones: never

  // Fetch `rows` rows of `row_bytes` from `first`, `row_stride` bytes apart, over about
  // `iterations` k iterations of tile loops: one line every 2^s of them, the largest s
  // (at most 6) that still issues them all.
  void Start(const void* first, int64 row_bytes, int64 row_stride, int64 rows,
             int64 iterations) {
    row = static_cast<const char*>(first);
    bytes = row_bytes;
    stride = row_stride;
    rows_left = rows;
    const int64 lines = rows * ((row_bytes + 63) / 64);
    int64 shift = 0;
    while (shift < 6 && (iterations >> (shift + 1)) >= lines) ++shift;
    mask = (int64{1} << shift) - 1;
  }

  AVX2_FN inline void Step() {
    if (row == nullptr) return;
    _mm_prefetch(row + offset, _MM_HINT_T1);
    offset += 64;
    if (offset >= bytes) {
      offset = 0;
      row = --rows_left > 0 ? row + stride : nullptr;
    }
  }
  // whatever the loops did not issue
  AVX2_FN void Rest() {
    while (row != nullptr) Step();
  }
};

template <int R>
AVX2_FN void PanelTileAvx2(int64 depth, const float* x, int64 ldx, const float* panel,
                           int64 cols, bool first, float* out, int64 ldo, LinePrefetch& pf) {
  static_assert(R >= 1 && R <= 6, "one to six rows of x");
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  const float* p = panel;
  const int64 mask = pf.mask;
  for (int64 k = 0; k < depth; ++k, p += kPanel) {
    const __m256 b0 = _mm256_loadu_ps(p), b1 = _mm256_loadu_ps(p + 8);
    const float* xk = x + k;
    FmaRow(xk, b0, b1, c00, c01);
    if constexpr (R > 1) FmaRow(xk + ldx, b0, b1, c10, c11);
    if constexpr (R > 2) FmaRow(xk + 2 * ldx, b0, b1, c20, c21);
    if constexpr (R > 3) FmaRow(xk + 3 * ldx, b0, b1, c30, c31);
    if constexpr (R > 4) FmaRow(xk + 4 * ldx, b0, b1, c40, c41);
    if constexpr (R > 5) FmaRow(xk + 5 * ldx, b0, b1, c50, c51);
    if ((k & mask) == mask) pf.Step();
  }
  const __m256 rows[6][2] = {{c00, c01}, {c10, c11}, {c20, c21},
                             {c30, c31}, {c40, c41}, {c50, c51}};
  for (int r = 0; r < R; ++r) {
    float* o = out + r * ldo;
    __m256 v0 = rows[r][0], v1 = rows[r][1];
    if (cols == kPanel) {
      if (!first) {
        v0 = _mm256_add_ps(_mm256_loadu_ps(o), v0);
        v1 = _mm256_add_ps(_mm256_loadu_ps(o + 8), v1);
      }
      _mm256_storeu_ps(o, v0);
      _mm256_storeu_ps(o + 8, v1);
    } else {  // W's last columns: only `cols` of them exist
      alignas(32) float tile[kPanel];
      _mm256_store_ps(tile, v0);
      _mm256_store_ps(tile + 8, v1);
      for (int64 j = 0; j < cols; ++j) o[j] = first ? tile[j] : o[j] + tile[j];
    }
  }
}

// out[r, 0 .. cols) (= or +=, `first`) x[r, 0 .. depth) @ panel for all m rows of x: tiles
// of kTileRowsX rows, then one tile of the rows left.
AVX2_FN void PanelRowsAvx2(int64 m, int64 depth, const float* x, int64 ldx, const float* panel,
                           int64 cols, bool first, float* out, int64 ldo, LinePrefetch& pf) {
  int64 r = 0;
  for (; r + kTileRowsX <= m; r += kTileRowsX) {
    PanelTileAvx2<kTileRowsX>(depth, x + r * ldx, ldx, panel, cols, first, out + r * ldo, ldo,
                              pf);
  }
  x += r * ldx;
  out += r * ldo;
  switch (m - r) {
    case 1: PanelTileAvx2<1>(depth, x, ldx, panel, cols, first, out, ldo, pf); break;
    case 2: PanelTileAvx2<2>(depth, x, ldx, panel, cols, first, out, ldo, pf); break;
    case 3: PanelTileAvx2<3>(depth, x, ldx, panel, cols, first, out, ldo, pf); break;
    case 4: PanelTileAvx2<4>(depth, x, ldx, panel, cols, first, out, ldo, pf); break;
    case 5: PanelTileAvx2<5>(depth, x, ldx, panel, cols, first, out, ldo, pf); break;
    default: break;
  }
}

// A work item of the packed kernel: weight rows [k0, k1) by columns [j0, j1) (none when
// k1 == k0).
struct PackedItem {
  int64 k0 = 0, k1 = 0, j0 = 0, j1 = 0;
};

// acc[:, j0 .. j1) (= or +=, `first`) x[:, k0 .. k1) @ W[k0 .. k1, j0 .. j1) for the bounds
// of `item`; acc is [M, N]. pack: ceil((j1 - j0) / kPanel) * kPanelStride floats of scratch.
// Prefetches the rows of `next` (the item this worker expects to take next) into L2 as it
// goes.
template <typename W>
AVX2_FN void KnPackedAvx2(const Geometry& g, const float* x, const W* w,
                          const PackedItem& item, bool first, float* pack, float* acc,
                          const PackedItem& next) {
  const int64 k0 = item.k0, k1 = item.k1, j0 = item.j0, j1 = item.j1;
  const int64 depth = k1 - k0, width = j1 - j0, panels = (width + kPanel - 1) / kPanel;
  const int64 stride = depth * kPanel + kPanelPad;
  for (int64 k = k0; k < k1; ++k) {  // the chunk's weight rows, front to back
    const W* src = w + k * g.N + j0;
    float* dst = pack + (k - k0) * kPanel;
    int64 p = 0;
    for (; (p + 1) * kPanel <= width; ++p, dst += stride) {
      _mm256_storeu_ps(dst, Load8(src + p * kPanel));
      _mm256_storeu_ps(dst + 8, Load8(src + p * kPanel + 8));
    }
    if (p < panels) {  // the range's last columns, zero-padded to a panel
      const int64 n = width - p * kPanel;
      for (int64 j = 0; j < n; ++j) dst[j] = ToFloat(src[p * kPanel + j]);
      std::fill(dst + n, dst + kPanel, 0.f);
    }
  }
  // the next item's rows, spread over this item's tile loops
  LinePrefetch pf;
  if (next.k1 > next.k0) {
    pf.Start(w + next.k0 * g.N + next.j0, (next.j1 - next.j0) * static_cast<int64>(sizeof(W)),
             g.N * static_cast<int64>(sizeof(W)), next.k1 - next.k0,
             panels * depth * ((g.M + kTileRowsX - 1) / kTileRowsX));
  }
  for (int64 p = 0; p < panels; ++p) {
    const float* panel = pack + p * stride;
    const int64 cols = std::min(kPanel, width - p * kPanel);
    PanelRowsAvx2(g.M, depth, x + k0, g.K, panel, cols, first, acc + j0 + p * kPanel, g.N, pf);
  }
  pf.Rest();
}

// "nk" (a tied embedding [N, K] as the LM head) for 24 or more rows of x: the same register
// tiles over W's rows transposed into panels. A work item is kNkPackRows consecutive rows of
// W (one contiguous block); each 16 of them are transposed, 8x8 floats at a time, into a
// panel [K, 16] (L2), and every panel feeds the 6x16 tiles over the full depth K, which store
// their sums into z directly: the output columns split between items, so no partial sums.
// GPT-2-small's head [50257, 768] on the AVX2-only EPYC, alternating processes: 32 rows
// 32-36 ms against the dot-product kernel's 53-55 (XLA 51-56); 24-28 rows a tie; 8-20 rows
// slower (17-32 against 19-37: the transposition is a fixed cost per call). The next
// panel's rows are prefetched into L2 a line at a time from the tile loops (LinePrefetch):
// the transposition's loads had waited on memory; the head alone, AVX2 stand-in on a
// Sapphire Rapids Xeon, 24 / 32 / 64 rows: 19.1 / 24.3 / 36.5 -> 16.4 / 20.0 / 34.7 ms.
constexpr int64 kNkPackRows = 64;  // rows of W per work item ("nk", packed)
constexpr int64 kNkPackedMinRows = 24;  // rows of x from which "nk" packs

// dst[i * ld + j] = src[j * lds + i] for an 8x8 block of floats.
template <typename W>
AVX2_FN inline void Transpose8x8(const W* src, int64 lds, float* dst, int64 ld) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = Load8(src + i * lds);
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    r[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * ld, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ld, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}

// z[:, n0 .. n1) = x @ W[n0 .. n1, :]^T (z is [M, N]); panel: K * kPanel floats of scratch.
// Rows of W up to `stream_end` (>= n1: the worker's next item, where it follows) are
// prefetched a panel ahead.
template <typename W>
AVX2_FN void NkPackedAvx2(const Geometry& g, const float* x, const W* w, int64 n0,
                          int64 n1, int64 stream_end, float* panel, float* z) {
  const int64 k8 = g.K / 8 * 8;
  for (int64 n = n0; n < n1; n += kPanel) {
    const int64 cols = std::min(kPanel, n1 - n);
    for (int64 half = 0; half < kPanel; half += 8) {  // panel columns [half, half + 8)
      const int64 rows = std::max<int64>(0, std::min<int64>(8, cols - half));
      const W* src = w + (n + half) * g.K;
      if (rows == 8) {
        for (int64 k = 0; k < k8; k += 8) {
          Transpose8x8(src + k, g.K, panel + k * kPanel + half, kPanel);
        }
      } else {  // W's last rows: the panel's missing columns are zeros
        for (int64 k = 0; k < k8; ++k) {
          for (int64 j = 0; j < 8; ++j) {
            panel[k * kPanel + half + j] = j < rows ? ToFloat(src[j * g.K + k]) : 0.f;
          }
        }
      }
      for (int64 k = k8; k < g.K; ++k) {  // K's tail
        for (int64 j = 0; j < 8; ++j) {
          panel[k * kPanel + half + j] = j < rows ? ToFloat(src[j * g.K + k]) : 0.f;
        }
      }
    }
    // the next panel's rows (one contiguous block of W) into L2 while this one computes, a
    // line at a time from the tile loops, as the "kn" packed kernel does
    LinePrefetch pf;
    const int64 next_rows = std::min(kPanel, stream_end - n - kPanel);
    if (next_rows > 0) {
      pf.Start(w + (n + kPanel) * g.K, next_rows * g.K * static_cast<int64>(sizeof(W)), 0, 1,
               g.K * ((g.M + kTileRowsX - 1) / kTileRowsX));
    }
    PanelRowsAvx2(g.M, g.K, x, g.K, panel, cols, true, z + n, g.N, pf);
    pf.Rest();
  }
}

// "nk": z[r, n] = W[n, :] . x[r, :] for weight rows [n0, n1) and every row r of x.
// Four weight rows at a time, each with its own accumulator per row of x, and up to three
// rows of x per pass, so each load of x feeds four FMAs and each load of W up to three; the
// first pass over the four rows software-prefetches the rows 8 ahead. GPT-2-small's tied LM
// head [50257, 768] on a 2-core AMX Xeon (AVX2 cap), in process, median: at M = 1, one row
// at a time 6.44 ms; four rows 5.51; four rows with the rows 4, 8 or 12 ahead prefetched
// 4.75, 4.68, 5.02 (numpy's sgemv: 3.9-4.7 in other runs of the same hour). At M = 8 and 16,
// one row of x per pass 12.4 and 18.4 ms, three 10.2 and 14.6.
// far (kPrefetch only): four rows further on, into L2 a line of each per line of these
// (nullptr: none).
template <int R, bool kPrefetch, typename W>
AVX2_FN inline void NkQuadAvx2(const Geometry& g, const float* x, const W* w0, float* z,
                               const W* far) {
  const int64 vec = g.K / 8 * 8;
  const int64 ahead = kNkPrefetchRows * g.K;  // floats
  const W* ws[4] = {w0, w0 + g.K, w0 + 2 * g.K, w0 + 3 * g.K};
  __m256 s[R][4];
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < 4; ++i) s[r][i] = _mm256_setzero_ps();
  }
  int64 k = 0;
  for (; k < vec; k += 8) {
    if (kPrefetch && (k & 15) == 0) {  // a cache line of each row kNkPrefetchRows ahead (past
      // the tile's or W's end too: a prefetch never faults)
      for (int i = 0; i < 4; ++i) {
        _mm_prefetch(reinterpret_cast<const char*>(ws[i] + ahead + k), _MM_HINT_T0);
      }
      if (far != nullptr) {
        for (int i = 0; i < 4; ++i) {
          _mm_prefetch(reinterpret_cast<const char*>(far + i * g.K + k), _MM_HINT_T1);
        }
      }
    }
    __m256 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + r * g.K + k);
    for (int i = 0; i < 4; ++i) {
      const __m256 wv = Load8(ws[i] + k);
      for (int r = 0; r < R; ++r) s[r][i] = _mm256_fmadd_ps(wv, xv[r], s[r][i]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float* xr = x + r * g.K;
    float sums[4];
    for (int i = 0; i < 4; ++i) {
      sums[i] = cpu::HorizontalSum(s[r][i]);
      for (int64 kk = k; kk < g.K; ++kk) sums[i] += ToFloat(ws[i][kk]) * xr[kk];
    }
    std::memcpy(z + r * g.N, sums, sizeof(sums));
  }
}

template <int R, typename W>
AVX2_FN inline void NkRowsAvx2(bool prefetch, const Geometry& g, const float* x, const W* w0,
                               float* z, const W* far) {
  prefetch ? NkQuadAvx2<R, true>(g, x, w0, z, far) : NkQuadAvx2<R, false>(g, x, w0, z, far);
}

template <typename W>
AVX2_FN void NkTileAvx2(const Geometry& g, const float* x, const W* w, int64 n0, int64 n1,
                        const W* prefetch_end, float* z) {
  int64 n = n0;
  for (; n + 4 <= n1; n += 4) {
    const W* w0 = w + n * g.K;
    // four rows further ahead, into L2: a line at a time from the first pass over these
    // (a burst of all their lines here stalled on the core's few line-fill buffers)
    const W* far = w0 + kNkPrefetchL2Rows * g.K;
    if (far + 4 * g.K > prefetch_end) far = nullptr;
    for (int64 r = 0; r < g.M; r += 3) {
      const float* xr = x + r * g.K;
      float* zr = z + r * g.N + n;
      const bool first = r == 0;  // reads the four rows from memory: prefetch ahead
      switch (std::min<int64>(3, g.M - r)) {
        case 1: NkRowsAvx2<1>(first, g, xr, w0, zr, far); break;
        case 2: NkRowsAvx2<2>(first, g, xr, w0, zr, far); break;
        default: NkRowsAvx2<3>(first, g, xr, w0, zr, far); break;
      }
    }
  }
  const int64 vec = g.K / 8 * 8;
  for (; n < n1; ++n) {  // the tile's last rows, one at a time
    const W* wn = w + n * g.K;
    for (int64 r = 0; r < g.M; ++r) {
      const float* xr = x + r * g.K;
      __m256 s = _mm256_setzero_ps();
      int64 k = 0;
      for (; k < vec; k += 8) s = _mm256_fmadd_ps(Load8(wn + k), _mm256_loadu_ps(xr + k), s);
      float sum = cpu::HorizontalSum(s);
      for (; k < g.K; ++k) sum += ToFloat(wn[k]) * xr[k];
      z[r * g.N + n] = sum;
    }
  }
}

#undef AVX2_FN
#endif  // TOKENSERVE_X86

template <typename W>
void KnRangeScalar(const Geometry& g, const float* x, int64 rows, const W* w, int64 j0,
                   int64 width, float* acc) {
  std::fill(acc, acc + rows * width, 0.f);
  for (int64 k = 0; k < g.K; ++k) {
    const W* wk = w + k * g.N + j0;
    for (int64 r = 0; r < rows; ++r) {
      const float xv = x[r * g.K + k];
      float* a = acc + r * width;
      for (int64 j = 0; j < width; ++j) a[j] += xv * ToFloat(wk[j]);
    }
  }
}

template <typename W>
void KnRowsScalar(const Geometry& g, const float* x, const W* w, int64 k0, int64 k1,
                  float* acc) {
  for (int64 k = k0; k < k1; ++k) {
    const W* wk = w + k * g.N;
    for (int64 r = 0; r < g.M; ++r) {
      const float xv = x[r * g.K + k];
      float* a = acc + r * g.N;
      for (int64 j = 0; j < g.N; ++j) a[j] += xv * ToFloat(wk[j]);
    }
  }
}

template <typename W>
void NkTileScalar(const Geometry& g, const float* x, const W* w, int64 n0, int64 n1,
                  float* z) {
  for (int64 n = n0; n < n1; ++n) {
    for (int64 r = 0; r < g.M; ++r) {
      float sum = 0.f;
      for (int64 k = 0; k < g.K; ++k) sum += ToFloat(w[n * g.K + k]) * x[r * g.K + k];
      z[r * g.N + n] = sum;
    }
  }
}

}  // namespace

REGISTER_OP("TokenserveDense")
    .Input("x: float")         // [M, K]
    .Input("w: T")             // [K, N] ("kn") or [N, K] ("nk"); float32 or bfloat16
    .Input("bias: float")      // [N] or [0]
    .Input("residual: float")  // [M, out] or [0, 0]
    .Output("y: float")        // [M, out]; out = N, or N / 2 for swiglu
    .Attr("layout: {'kn', 'nk'} = 'kn'")
    .Attr("T: {float, bfloat16} = DT_FLOAT")
    .Attr("activation: {'none', 'gelu_tanh', 'swiglu'} = 'none'")
    .Attr("isa: {'auto', 'scalar'} = 'auto'")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle x, w;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &x));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &w));
      std::string layout, activation;
      TF_RETURN_IF_ERROR(c->GetAttr("layout", &layout));
      TF_RETURN_IF_ERROR(c->GetAttr("activation", &activation));
      DimensionHandle k, n = c->Dim(w, layout == "kn" ? 1 : 0);
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(x, 1), c->Dim(w, layout == "kn" ? 0 : 1), &k));
      if (activation == "swiglu") TF_RETURN_IF_ERROR(c->Divide(n, 2, true, &n));
      c->set_output(0, c->Matrix(c->Dim(x, 0), n));
      return absl::OkStatus();
    })
    .Doc("y = activation(x @ W + bias) + residual, float32, for small M.");

REGISTER_OP("TokenserveEpilogue")
    .Input("z: float")         // [M, N], a matmul's output (int8 weights: TokenserveInt8Matmul)
    .Input("bias: float")      // [N] or [0]
    .Input("residual: float")  // [M, out] or [0, 0]
    .Output("y: float")        // [M, out]; out = N, or N / 2 for swiglu
    .Attr("activation: {'none', 'gelu_tanh', 'swiglu'} = 'none'")
    .Attr("isa: {'auto', 'scalar'} = 'auto'")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle z;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &z));
      std::string activation;
      TF_RETURN_IF_ERROR(c->GetAttr("activation", &activation));
      DimensionHandle n = c->Dim(z, 1);
      if (activation == "swiglu") TF_RETURN_IF_ERROR(c->Divide(n, 2, true, &n));
      c->set_output(0, c->Matrix(c->Dim(z, 0), n));
      return absl::OkStatus();
    })
    .Doc("TokenserveDense's epilogue alone: activation(z + bias) + residual.");

REGISTER_OP("TokenserveNorm")
    .Input("x: float")      // [M, D]
    .Input("scale: float")  // [D]
    .Input("bias: float")   // [D] (layernorm) or [0] (rmsnorm)
    .Output("y: float")
    .Attr("eps: float")
    .Attr("isa: {'auto', 'scalar'} = 'auto'")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle x;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &x));
      c->set_output(0, x);
      return absl::OkStatus();
    })
    .Doc("LayerNorm (bias given) or RMSNorm (bias empty) over the last axis, float32.");

REGISTER_OP("TokenserveSplitRope")
    .Input("qkv: float")  // [N, (H + 2 * Hkv) * Dh]
    .Input("cos: float")  // [N, Dh], or [0]: no rotation
    .Input("sin: float")  // [N, Dh], or [0]
    .Output("q: float")   // [N, H, Dh]
    .Output("k: float")   // [N, Hkv * Dh]
    .Output("v: float")   // [N, Hkv * Dh]
    .Attr("num_heads: int >= 1")
    .Attr("num_kv_heads: int >= 1")
    .Attr("head_dim: int >= 2")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle qkv;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &qkv));
      int64_t h, hkv, dh;
      TF_RETURN_IF_ERROR(c->GetAttr("num_heads", &h));
      TF_RETURN_IF_ERROR(c->GetAttr("num_kv_heads", &hkv));
      TF_RETURN_IF_ERROR(c->GetAttr("head_dim", &dh));
      DimensionHandle n = c->Dim(qkv, 0);
      c->set_output(0, c->MakeShape({n, c->MakeDim(h), c->MakeDim(dh)}));
      c->set_output(1, c->Matrix(n, hkv * dh));
      c->set_output(2, c->Matrix(n, hkv * dh));
      return absl::OkStatus();
    })
    .Doc(R"doc(
A fused QKV projection's output split into q, k and v, with rotary position embedding
applied to q and k (rotate-half convention): x * cos + rotate_half(x) * sin per head, where
rotate_half(x) = concat(-x[Dh/2:], x[:Dh/2]); each product and the sum rounded to float32
separately, as the graph's Mul, Mul and AddV2 round them.
)doc");

REGISTER_OP("TokenserveFinishBlock")
    .Input("attn: float")        // [M, Da] attention output
    .Input("x: float")           // [M, D] the residual stream
    .Input("out_w: T")           // [Da, D]
    .Input("out_bias: float")    // [D] or [0]
    .Input("norm_scale: float")  // [D]
    .Input("norm_bias: float")   // [D] (LayerNorm) or [0] (RMSNorm)
    .Input("up_w: T")            // [D, F]
    .Input("up_bias: float")     // [F] or [0]
    .Input("down_w: T")          // [F, D] (F / 2 rows for swiglu)
    .Input("down_bias: float")   // [D] or [0]
    // the next block's first half, optional (all empty: none): its norm and QKV projection
    .Input("next_norm_scale: float")  // [D] or [0]
    .Input("next_norm_bias: float")   // [D] (LayerNorm), or [0] (RMSNorm, or no next)
    .Input("next_w: T")               // [D, Nq] or [0, 0]
    .Input("next_bias: float")        // [Nq] or [0]
    .Output("y: float")          // [M, D]
    .Output("next: float")       // [M, Nq], or [M, 0] without a next block
    .Attr("activation: {'gelu_tanh', 'swiglu'} = 'gelu_tanh'")
    .Attr("T: {float, bfloat16} = DT_FLOAT")  // the four matrices' dtype
    .Attr("eps: float = 1e-5")
    .Attr("isa: {'auto', 'scalar'} = 'auto'")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle x, next_w;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &x));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(12), 2, &next_w));
      c->set_output(0, x);
      c->set_output(1, c->Matrix(c->Dim(x, 0), c->Dim(next_w, 1)));
      return absl::OkStatus();
    })
    .Doc("x1 = attn @ out_w + out_bias + x; "
         "y = act(norm(x1) @ up_w + up_bias) @ down_w + down_bias + x1; "
         "next = next_norm(y) @ next_w + next_bias. Float32, small M.");

REGISTER_OP("TokenserveDenseInfo")
    .Output("info: string")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Scalar());
      return absl::OkStatus();
    })
    .Doc("Which instruction set the TokenserveDense and TokenserveNorm kernels use here.");

namespace {

#ifdef TOKENSERVE_X86
// More rows of x with AVX2: work items of kPackDepth weight rows by at most kPackWidth
// columns (KnPackedAvx2), one contiguous range of them per worker (RunRanges), into
// per-worker partial sums that the epilogue adds up (as ComputeKnSplitK below). A whole
// row of a wide W (3072 columns) made a 768 KB pack that, with the partial sums,
// overflowed L2.
template <typename W>
void ComputeKnPacked(const Geometry& g, const Args<W>& a, tensorflow::thread::ThreadPool* pool) {
  const int64 workers = std::max(1, pool->NumThreads());
  const int64 chunks = (g.K + kPackDepth - 1) / kPackDepth;
  const int64 blocks = (g.N + kPackWidth - 1) / kPackWidth;
  const int64 width = (g.N + blocks - 1) / blocks;  // at most kPackWidth
  const int64 pack_floats = (width + kPanel - 1) / kPanel * kPanelStride;
  std::vector<std::unique_ptr<float[]>> partial(workers), pack(workers);
  // started[worker * blocks + b]: the worker's sums hold column block b (a first item stores
  // its sums, so the buffers need no zeroing)
  std::vector<char> started(workers * blocks, 0);
  auto bounds = [&](int64 item) {
    const int64 chunk = item / blocks, block = item % blocks;
    PackedItem b;
    b.k0 = chunk * kPackDepth;
    b.k1 = std::min(g.K, b.k0 + kPackDepth);
    b.j0 = block * width;
    b.j1 = std::min(g.N, b.j0 + width);
    return b;
  };
  RunRanges(pool, workers, chunks * blocks, [&](int64 item, int64 worker, int64 next) {
    if (!partial[worker]) {
      partial[worker].reset(new float[g.M * g.N]);
      pack[worker].reset(new float[pack_floats]);
    }
    char& seen = started[worker * blocks + item % blocks];
    KnPackedAvx2(g, a.x, a.w, bounds(item), !seen, pack[worker].get(), partial[worker].get(),
                 next >= 0 ? bounds(next) : PackedItem());
    seen = 1;
  });
  // worker 0's buffer (made here if it took no item) collects every column block
  if (!partial[0]) partial[0].reset(new float[g.M * g.N]);
  float* z = partial[0].get();
  for (int64 b = 0; b < blocks; ++b) {
    const int64 j0 = b * width, j1 = std::min(g.N, j0 + width);
    bool have = started[b];
    for (int64 w = 1; w < workers; ++w) {
      if (!started[w * blocks + b]) continue;
      const float* other = partial[w].get();
      for (int64 r = 0; r < g.M; ++r) {
        float* zr = z + r * g.N;
        const float* o = other + r * g.N;
        if (have) {
          for (int64 j = j0; j < j1; ++j) zr[j] += o[j];
        } else {
          std::memcpy(zr + j0, o + j0, (j1 - j0) * sizeof(float));
        }
      }
      have = true;
    }
    if (!have) {  // K = 0: x @ W is zeros
      for (int64 r = 0; r < g.M; ++r) std::fill(z + r * g.N + j0, z + r * g.N + j1, 0.f);
    }
  }
  rowops::FinishRows(true, g.M, g.N, g.out, a.act, z, a.bias, a.residual, a.y);
}
#endif  // TOKENSERVE_X86

// Column ranges of W, 2 per thread (at most kMaxRange wide, a multiple of 8 where possible);
// each range runs its own epilogue, except swiglu, whose halves live in different ranges.
template <typename W>
void ComputeKn(const Geometry& g, const Args<W>& a, tensorflow::thread::ThreadPool* pool,
               bool avx2) {
  const bool swiglu = a.act == Activation::kSwiglu;
  const int64 threads = std::max(1, pool->NumThreads());
  int64 items = std::max<int64>(2 * threads, (g.N + kMaxRange - 1) / kMaxRange);
  int64 width = (g.N + items - 1) / items;
  width = std::max<int64>(8, (width + 7) / 8 * 8);
  items = (g.N + width - 1) / width;
  std::vector<float> z;  // the whole of x @ W + bias (swiglu only: pairs cross ranges)
  if (swiglu) z.resize(g.M * g.N);
    std::vector<std::vector<float>> accs(threads);  // one per worker
  RunChunks(pool, threads, items, [&](int64 item, int64 worker) {
    std::vector<float>& acc = accs[worker];
    if (acc.empty()) acc.resize(kRowsPerPass * width);
    const int64 j0 = item * width, cols = std::min(width, g.N - j0);
    for (int64 r0 = 0; r0 < g.M; r0 += kRowsPerPass) {
      const int64 rows = std::min(kRowsPerPass, g.M - r0);
#ifdef TOKENSERVE_X86
      if (avx2) {
        KnRangeAvx2(g, a.x + r0 * g.K, rows, a.w, j0, cols, acc.data());
      } else
#endif
      {
        KnRangeScalar(g, a.x + r0 * g.K, rows, a.w, j0, cols, acc.data());
      }
      for (int64 r = 0; r < rows; ++r) {
        float* zr = acc.data() + r * cols;
        if (a.bias) {
          for (int64 j = 0; j < cols; ++j) zr[j] += a.bias[j0 + j];
        }
        if (swiglu) {
          std::memcpy(z.data() + (r0 + r) * g.N + j0, zr, cols * sizeof(float));
          continue;
        }
        const float* res = a.residual ? a.residual + (r0 + r) * g.out + j0 : nullptr;
        FinishRow(avx2, cols, a.act, zr, nullptr, res, a.y + (r0 + r) * g.out + j0);
      }
    }
  });
  if (swiglu) {
    for (int64 r = 0; r < g.M; ++r) {
      const float* zr = z.data() + r * g.N;
      FinishRow(avx2, g.out, a.act, zr, zr + g.out,
                a.residual ? a.residual + r * g.out : nullptr, a.y + r * g.out);
    }
  }
}

// Up to 8 rows of x (a decode step of up to 8 sequences, or one checking drafts): K is cut
// into chunks of whole weight rows, each read front to back as one sequential stream (the
// prefetcher follows one stream far better than several strided ones: 43-45 GB/s for the
// pair of threads on this kind of VM, where column ranges walked row by row reached 31-34),
// into per-worker partial sums that the epilogue adds up. In the GPT-2-small engine step this
// beat the column ranges below by ~10 % at 3 rows and ~6 % at 4, and by 21 % at 5 rows
// (measured when drafts made 5-8-row steps common; see kSplitKMaxRows).
template <typename W>
void ComputeKnSplitK(const Geometry& g, const Args<W>& a, tensorflow::thread::ThreadPool* pool,
                     bool avx2) {
  const int64 workers = std::max(1, pool->NumThreads());
  const int64 chunks = std::max<int64>(1, std::min(kChunksPerWorker * workers,
                                                   g.K / kSplitKMinRows));
  const int64 rows_per_chunk = (g.K + chunks - 1) / chunks;
  std::vector<float> partial(workers * g.M * g.N);
  std::vector<char> used(workers, 0);
    RunChunks(pool, workers, chunks, [&](int64 chunk, int64 worker) {
    const int64 k0 = chunk * rows_per_chunk, k1 = std::min(g.K, k0 + rows_per_chunk);
    float* acc = partial.data() + worker * g.M * g.N;
    used[worker] = 1;  // partial sums start at zero (the vector is value-initialized)
#ifdef TOKENSERVE_X86
    if (avx2) {
      switch (g.M) {
        case 1: KnRowsAvx2<1>(g, a.x, a.w, k0, k1, acc); break;
        case 2: KnRowsAvx2<2>(g, a.x, a.w, k0, k1, acc); break;
        case 3: KnRowsAvx2<3>(g, a.x, a.w, k0, k1, acc); break;
        case 4: KnRowsAvx2<4>(g, a.x, a.w, k0, k1, acc); break;
        case 5: KnRowsAvx2<5>(g, a.x, a.w, k0, k1, acc); break;
        case 6: KnRowsAvx2<6>(g, a.x, a.w, k0, k1, acc); break;
        case 7: KnRowsAvx2<7>(g, a.x, a.w, k0, k1, acc); break;
        default: KnRowsAvx2<8>(g, a.x, a.w, k0, k1, acc); break;
      }
      return;
    }
#endif
    KnRowsScalar(g, a.x, a.w, k0, k1, acc);
  });
  float* z = partial.data();  // worker 0's sums collect the others' (zeros if it took none)
  for (int64 w = 1; w < workers; ++w) {
    if (!used[w]) continue;
    const float* other = partial.data() + w * g.M * g.N;
    for (int64 i = 0; i < g.M * g.N; ++i) z[i] += other[i];
  }
  rowops::FinishRows(avx2, g.M, g.N, g.out, a.act, z, a.bias, a.residual, a.y);
}

template <typename W>
void ComputeNk(const Geometry& g, const Args<W>& a, tensorflow::thread::ThreadPool* pool,
               bool avx2) {
  const bool direct = a.act == Activation::kNone && !a.bias && !a.residual;
  std::vector<float> z;
  float* zp = a.y;
  if (!direct) {
    z.resize(g.M * g.N);
    zp = z.data();
  }
#ifdef TOKENSERVE_X86
  if (avx2 && g.M >= kNkPackedMinRows) {
    const int64 workers = std::max(1, pool->NumThreads());
    std::vector<std::unique_ptr<float[]>> panels(workers);
    const int64 items = (g.N + kNkPackRows - 1) / kNkPackRows;
    // contiguous item ranges per worker, so the prefetch may run on into the next item
    RunRanges(pool, workers, items, [&](int64 item, int64 worker, int64 next) {
      if (!panels[worker]) panels[worker].reset(new float[g.K * kPanel]);
      const int64 n0 = item * kNkPackRows, n1 = std::min(g.N, n0 + kNkPackRows);
      const int64 end = std::min(g.N, RangeStreamEnd(item, next) * kNkPackRows);
      NkPackedAvx2(g, a.x, a.w, n0, n1, end, panels[worker].get(), zp);
    });
    if (!direct) rowops::FinishRows(avx2, g.M, g.N, g.out, a.act, zp, a.bias, a.residual, a.y);
    return;
  }
#endif
  const int64 tiles = (g.N + kTileRows - 1) / kTileRows;
  // contiguous tile ranges per worker, so the L2 prefetch may run on into the next tile
  RunRanges(pool, std::max(1, pool->NumThreads()), tiles, [&](int64 tile, int64, int64 next) {
    const int64 n0 = tile * kTileRows, n1 = std::min(g.N, n0 + kTileRows);
#ifdef TOKENSERVE_X86
    if (avx2) {
      const int64 end = std::min(g.N, RangeStreamEnd(tile, next) * kTileRows);
      NkTileAvx2(g, a.x, a.w, n0, n1, a.w + end * g.K, zp);
      return;
    }
#endif
    NkTileScalar(g, a.x, a.w, n0, n1, zp);
  });
  if (direct) return;
  rowops::FinishRows(avx2, g.M, g.N, g.out, a.act, zp, a.bias, a.residual, a.y);
}

// x @ W and its epilogue for one TokenserveDense call (or one matrix of
// TokenserveFinishBlock): the work split by layout and number of rows (top of this file).
template <typename W>
void ComputeDense(const Geometry& g, const Args<W>& a, bool kn,
                  tensorflow::thread::ThreadPool* pool, bool avx2) {
  if (kn && g.M <= kSplitKMaxRows && g.K >= 2 * kSplitKMinRows) {
    ComputeKnSplitK(g, a, pool, avx2);
#ifdef TOKENSERVE_X86
  } else if (kn && avx2 && g.M >= kPackedMinRows) {
    ComputeKnPacked(g, a, pool);
#endif
  } else if (kn) {
    ComputeKn(g, a, pool, avx2);
  } else {
    ComputeNk(g, a, pool, avx2);
  }
}

}  // namespace

class DenseOp : public OpKernel {
 public:
  explicit DenseOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string layout, activation, isa;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("layout", &layout));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("activation", &activation));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("isa", &isa));
    kn_ = layout == "kn";
    act_ = activation == "gelu_tanh" ? Activation::kGeluTanh
         : activation == "swiglu"    ? Activation::kSwiglu
                                     : Activation::kNone;
    avx2_ = isa == "auto" && cpu::HasAvx2Fma();
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& w = ctx->input(1);
    const Tensor& bias = ctx->input(2);
    const Tensor& residual = ctx->input(3);
    OP_REQUIRES(ctx, x.dims() == 2 && w.dims() == 2,
                InvalidArgument("x and w must be matrices, got ", x.shape().DebugString(),
                                " and ", w.shape().DebugString()));
    Geometry g;
    g.M = x.dim_size(0);
    g.K = x.dim_size(1);
    g.N = w.dim_size(kn_ ? 1 : 0);
    OP_REQUIRES(ctx, w.dim_size(kn_ ? 0 : 1) == g.K,
                InvalidArgument("x is [M, K] with K = ", g.K, " but w is ",
                                w.shape().DebugString(), kn_ ? ", expected [K, N]" : ", expected [N, K]"));
    OP_REQUIRES(ctx, act_ != Activation::kSwiglu || g.N % 2 == 0,
                InvalidArgument("swiglu needs an even N, got ", g.N));
    g.out = act_ == Activation::kSwiglu ? g.N / 2 : g.N;
    OP_REQUIRES(ctx, bias.NumElements() == 0 || (bias.dims() == 1 && bias.dim_size(0) == g.N),
                InvalidArgument("bias must be [N] = [", g.N, "] or empty, got ",
                                bias.shape().DebugString()));
    OP_REQUIRES(ctx, residual.NumElements() == 0 ||
                         (residual.dims() == 2 && residual.dim_size(0) == g.M &&
                          residual.dim_size(1) == g.out),
                InvalidArgument("residual must be [M, out] = [", g.M, ", ", g.out,
                                "] or empty, got ", residual.shape().DebugString()));
    Tensor* y_tensor = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({g.M, g.out}), &y_tensor));
    if (g.M == 0 || g.out == 0) return;
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    const float* b = bias.NumElements() ? bias.flat<float>().data() : nullptr;
    const float* res = residual.NumElements() ? residual.flat<float>().data() : nullptr;
    float* y = y_tensor->flat<float>().data();
    const float* xp = x.flat<float>().data();
    if (w.dtype() == tensorflow::DT_BFLOAT16) {
      ComputeDense<bfloat16>(g, {xp, w.flat<bfloat16>().data(), b, res, y, act_}, kn_, pool,
                             avx2_);
    } else {
      ComputeDense<float>(g, {xp, w.flat<float>().data(), b, res, y, act_}, kn_, pool, avx2_);
    }
  }

 private:
  bool kn_ = true;
  Activation act_ = Activation::kNone;
  bool avx2_ = false;
};

// A transformer block's second half (output projection and residual, MLP norm, MLP up and
// activation, MLP down and residual) as one op: the same ComputeDense and NormRow calls as
// three TokenserveDense ops and a TokenserveNorm, so the three matrices stream back to back
// instead of with the executor's gaps between them (docs/performance.md, "Between the ops"),
// and a layer runs three fewer ops. With next_w given, the next block's norm and QKV
// projection follow in the same op (next = next_norm(y) @ next_w + next_bias): four
// matrices back to back, two ops fewer. int8_matmul.cc has the int8 weights' twin.
class FinishBlockOp : public OpKernel {
 public:
  explicit FinishBlockOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string activation, isa;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("activation", &activation));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("eps", &eps_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("isa", &isa));
    act_ = activation == "swiglu" ? Activation::kSwiglu : Activation::kGeluTanh;
    avx2_ = isa == "auto" && cpu::HasAvx2Fma();
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& attn = ctx->input(0);
    const Tensor& x = ctx->input(1);
    const Tensor& out_w = ctx->input(2);
    const Tensor& norm_scale = ctx->input(4);
    const Tensor& up_w = ctx->input(6);
    const Tensor& down_w = ctx->input(8);
    OP_REQUIRES(ctx, attn.dims() == 2 && x.dims() == 2 && attn.dim_size(0) == x.dim_size(0),
                InvalidArgument("attn and x must be [M, Da] and [M, D], got ",
                                attn.shape().DebugString(), " and ", x.shape().DebugString()));
    const int64 m = x.dim_size(0), d = x.dim_size(1), da = attn.dim_size(1);
    OP_REQUIRES(ctx, IsMatrix(out_w, da, d),
                InvalidArgument("out_w must be [Da, D] = [", da, ", ", d, "], got ",
                                out_w.shape().DebugString()));
    OP_REQUIRES(ctx, norm_scale.dims() == 1 && norm_scale.dim_size(0) == d,
                InvalidArgument("norm_scale must be [", d, "], got ",
                                norm_scale.shape().DebugString()));
    OP_REQUIRES(ctx, up_w.dims() == 2 && up_w.dim_size(0) == d && up_w.dim_size(1) > 0,
                InvalidArgument("up_w must be [D, F] with D = ", d, ", got ",
                                up_w.shape().DebugString()));
    const int64 f = up_w.dim_size(1);
    const bool swiglu = act_ == Activation::kSwiglu;
    OP_REQUIRES(ctx, !swiglu || f % 2 == 0,
                InvalidArgument("swiglu needs an even up width, got ", f));
    const int64 inner = swiglu ? f / 2 : f;
    OP_REQUIRES(ctx, IsMatrix(down_w, inner, d),
                InvalidArgument("down_w must be [", inner, ", ", d, "], got ",
                                down_w.shape().DebugString()));
    const int64 widths[] = {d, d, f, d};  // out_bias, norm_bias, up_bias, down_bias
    const char* names[] = {"out_bias", "norm_bias", "up_bias", "down_bias"};
    for (int i = 0; i < 4; ++i) {
      const Tensor& t = ctx->input(3 + 2 * i);
      OP_REQUIRES(ctx, IsVectorOrEmpty(t, widths[i]),
                  InvalidArgument(names[i], " must be [", widths[i], "] or empty, got ",
                                  t.shape().DebugString()));
    }
    // the next block's norm and QKV: all given, or all empty
    const Tensor& next_norm_scale = ctx->input(10);
    const Tensor& next_norm_bias = ctx->input(11);
    const Tensor& next_w = ctx->input(12);
    const Tensor& next_bias = ctx->input(13);
    const bool has_next = next_w.NumElements() > 0;
    const int64 nq = has_next ? next_w.dim_size(1) : 0;
    if (has_next) {
      OP_REQUIRES(ctx, next_w.dims() == 2 && next_w.dim_size(0) == d,
                  InvalidArgument("next_w must be [D, Nq] with D = ", d, ", got ",
                                  next_w.shape().DebugString()));
    }
    if (!CheckNextNorm(ctx, has_next, "next_w", d, next_norm_scale, next_norm_bias, next_bias)) {
      return;
    }
    OP_REQUIRES(ctx, IsVectorOrEmpty(next_bias, nq),
                InvalidArgument("next_bias must be [", nq, "] or empty, got ",
                                next_bias.shape().DebugString()));
    Tensor* y_tensor = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({m, d}), &y_tensor));
    Tensor* next_tensor = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({m, nq}), &next_tensor));
    if (m == 0 || d == 0) return;

    if (out_w.dtype() == tensorflow::DT_BFLOAT16) {
      Run<bfloat16>(ctx, m, d, da, f, inner, nq, has_next, y_tensor, next_tensor);
    } else {
      Run<float>(ctx, m, d, da, f, inner, nq, has_next, y_tensor, next_tensor);
    }
  }

  // The op's arithmetic, once the shapes are checked: W is the matrices' storage type.
  template <typename W>
  void Run(OpKernelContext* ctx, int64 m, int64 d, int64 da, int64 f, int64 inner, int64 nq,
           bool has_next, Tensor* y_tensor, Tensor* next_tensor) {
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    auto in = [ctx](int i) { return ctx->input(i).flat<float>().data(); };
    auto weights = [ctx](int i) { return ctx->input(i).flat<W>().data(); };
    std::vector<float> x1(m * d), h(m * d), u(m * inner);
    // x1 = attn @ out_w + out_bias + x
    ComputeDense<W>({m, da, d, d}, {in(0), weights(2), Data(ctx->input(3)), in(1),
                                    x1.data(), Activation::kNone},
                    true, pool, avx2_);
    // h = norm(x1)
    for (int64 r = 0; r < m; ++r) {
      rowops::NormRow(avx2_, d, x1.data() + r * d, in(4), Data(ctx->input(5)), eps_,
                      h.data() + r * d);
    }
    // u = act(h @ up_w + up_bias)
    ComputeDense<W>({m, d, f, inner}, {h.data(), weights(6), Data(ctx->input(7)),
                                       nullptr, u.data(), act_},
                    true, pool, avx2_);
    // y = u @ down_w + down_bias + x1
    float* y = y_tensor->flat<float>().data();
    ComputeDense<W>({m, inner, d, d}, {u.data(), weights(8), Data(ctx->input(9)),
                                       x1.data(), y, Activation::kNone},
                    true, pool, avx2_);
    if (!has_next) return;
    // next = next_norm(y) @ next_w + next_bias (the norm's rows reuse h)
    for (int64 r = 0; r < m; ++r) {
      rowops::NormRow(avx2_, d, y + r * d, in(10), Data(ctx->input(11)), eps_, h.data() + r * d);
    }
    ComputeDense<W>({m, d, nq, nq}, {h.data(), weights(12), Data(ctx->input(13)),
                                     nullptr, next_tensor->flat<float>().data(),
                                     Activation::kNone},
                    true, pool, avx2_);
  }

 private:
  static bool IsMatrix(const Tensor& t, int64 rows, int64 cols) {
    return t.dims() == 2 && t.dim_size(0) == rows && t.dim_size(1) == cols;
  }

  Activation act_ = Activation::kGeluTanh;
  float eps_ = 1e-5f;
  bool avx2_ = false;
};

class EpilogueOp : public OpKernel {
 public:
  explicit EpilogueOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string activation, isa;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("activation", &activation));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("isa", &isa));
    act_ = activation == "gelu_tanh" ? Activation::kGeluTanh
         : activation == "swiglu"    ? Activation::kSwiglu
                                     : Activation::kNone;
    avx2_ = isa == "auto" && cpu::HasAvx2Fma();
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& z = ctx->input(0);
    const Tensor& bias = ctx->input(1);
    const Tensor& residual = ctx->input(2);
    OP_REQUIRES(ctx, z.dims() == 2, InvalidArgument("z must be [M, N], got ",
                                                    z.shape().DebugString()));
    const int64 m = z.dim_size(0), n = z.dim_size(1);
    OP_REQUIRES(ctx, act_ != Activation::kSwiglu || n % 2 == 0,
                InvalidArgument("swiglu needs an even N, got ", n));
    const int64 out = act_ == Activation::kSwiglu ? n / 2 : n;
    OP_REQUIRES(ctx, bias.NumElements() == 0 || (bias.dims() == 1 && bias.dim_size(0) == n),
                InvalidArgument("bias must be [N] = [", n, "] or empty, got ",
                                bias.shape().DebugString()));
    OP_REQUIRES(ctx, residual.NumElements() == 0 ||
                         (residual.dims() == 2 && residual.dim_size(0) == m &&
                          residual.dim_size(1) == out),
                InvalidArgument("residual must be [M, out] = [", m, ", ", out,
                                "] or empty, got ", residual.shape().DebugString()));
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({m, out}), &y));
    const float* zp = z.flat<float>().data();
    const float* bp = bias.NumElements() ? bias.flat<float>().data() : nullptr;
    const float* rp = residual.NumElements() ? residual.flat<float>().data() : nullptr;
    float* yp = y->flat<float>().data();
    const bool avx2 = avx2_;
    const Activation act = act_;
    auto work = [&](int64 begin, int64 end) {
      std::vector<float> row(bp ? n : 0);
      for (int64 r = begin; r < end; ++r) {
        const float* zr = zp + r * n;
        if (bp) {
          for (int64 j = 0; j < n; ++j) row[j] = zr[j] + bp[j];
          zr = row.data();
        }
        FinishRow(avx2, out, act, zr, zr + out, rp ? rp + r * out : nullptr, yp + r * out);
      }
    };
    // ~cycles per row: an exp per value for the activations, a few ops otherwise
    const int64 cost = n * (act == Activation::kNone ? 2 : 20);
    ctx->device()->tensorflow_cpu_worker_threads()->workers->ParallelFor(
        m, tensorflow::thread::ThreadPool::SchedulingParams::Adaptive(cost), work);
  }

 private:
  Activation act_ = Activation::kNone;
  bool avx2_ = false;
};

class NormOp : public OpKernel {
 public:
  explicit NormOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string isa;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("eps", &eps_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("isa", &isa));
    avx2_ = isa == "auto" && cpu::HasAvx2Fma();
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& scale = ctx->input(1);
    const Tensor& bias = ctx->input(2);
    OP_REQUIRES(ctx, x.dims() == 2, InvalidArgument("x must be [M, D], got ",
                                                    x.shape().DebugString()));
    const int64 m = x.dim_size(0), d = x.dim_size(1);
    OP_REQUIRES(ctx, scale.dims() == 1 && scale.dim_size(0) == d,
                InvalidArgument("scale must be [D] = [", d, "], got ", scale.shape().DebugString()));
    const bool layernorm = bias.NumElements() > 0;  // else RMSNorm
    OP_REQUIRES(ctx, !layernorm || (bias.dims() == 1 && bias.dim_size(0) == d),
                InvalidArgument("bias must be [D] = [", d, "] or empty, got ",
                                bias.shape().DebugString()));
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &y));
    const float* xp = x.flat<float>().data();
    const float* sp = scale.flat<float>().data();
    const float* bp = layernorm ? bias.flat<float>().data() : nullptr;
    float* yp = y->flat<float>().data();
    for (int64 r = 0; r < m; ++r) {  // a few rows of ~1k values: not worth a thread handoff
      rowops::NormRow(avx2_, d, xp + r * d, sp, bp, eps_, yp + r * d);
    }
  }

 private:
  float eps_ = 1e-5f;
  bool avx2_ = false;
};

// One op where the graph ran a split, a reshape and, for each of q and k, a reshape, a
// split, a negation, a concat, two products and a sum: about eighteen small ops a layer, each
// starting on caches the weight streams have just flushed (docs/performance.md). A step of a
// few tokens moves a few KB here, so one thread does it.
class SplitRopeOp : public OpKernel {
 public:
  explicit SplitRopeOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_heads", &h_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_kv_heads", &hkv_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("head_dim", &dh_));
    OP_REQUIRES(ctx, dh_ % 2 == 0, InvalidArgument("head_dim must be even, got ", dh_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& qkv = ctx->input(0);
    const Tensor& cos = ctx->input(1);
    const Tensor& sin = ctx->input(2);
    const int64 width = (h_ + 2 * hkv_) * dh_;
    OP_REQUIRES(ctx, qkv.dims() == 2 && qkv.dim_size(1) == width,
                InvalidArgument("qkv must be [N, ", width, "], got ", qkv.shape().DebugString()));
    const int64 n = qkv.dim_size(0);
    const bool rotate = cos.NumElements() > 0;
    for (const Tensor* t : {&cos, &sin}) {
      OP_REQUIRES(ctx, rotate ? (t->dims() == 2 && t->dim_size(0) == n && t->dim_size(1) == dh_)
                              : t->NumElements() == 0,
                  InvalidArgument("cos and sin must both be [N, Dh] = [", n, ", ", dh_,
                                  "] or both empty, got ", cos.shape().DebugString(), " and ",
                                  sin.shape().DebugString()));
    }
    Tensor *q = nullptr, *k = nullptr, *v = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, h_, dh_}), &q));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({n, hkv_ * dh_}), &k));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({n, hkv_ * dh_}), &v));
    const float* in = qkv.flat<float>().data();
    float* outs[3] = {q->flat<float>().data(), k->flat<float>().data(),
                      v->flat<float>().data()};
    const int64 heads[3] = {h_, hkv_, hkv_};
    for (int64 i = 0; i < n; ++i) {
      const float* row = in + i * width;
      const float* c = rotate ? cos.flat<float>().data() + i * dh_ : nullptr;
      const float* s = rotate ? sin.flat<float>().data() + i * dh_ : nullptr;
      for (int part = 0; part < 3; ++part) {
        const int64 span = heads[part] * dh_;
        float* out = outs[part] + i * span;
        if (!rotate || part == 2) {
          std::memcpy(out, row, span * sizeof(float));
        } else {
          for (int64 head = 0; head < heads[part]; ++head) {
            RotateHalf(row + head * dh_, c, s, out + head * dh_);
          }
        }
        row += span;
      }
    }
  }

 private:
  // No fused multiply-add: the graph rounds both products before their sum.
  __attribute__((optimize("fp-contract=off"))) void RotateHalf(
      const float* x, const float* c, const float* s, float* out) const {
    const int64 half = dh_ / 2;
    for (int64 d = 0; d < half; ++d) {
      const float a = x[d] * c[d];
      const float b = -x[d + half] * s[d];
      out[d] = a + b;
    }
    for (int64 d = half; d < dh_; ++d) {
      const float a = x[d] * c[d];
      const float b = x[d - half] * s[d];
      out[d] = a + b;
    }
  }

  int64 h_ = 1, hkv_ = 1, dh_ = 2;
};

class DenseInfoOp : public OpKernel {
 public:
  explicit DenseInfoOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  void Compute(OpKernelContext* ctx) override {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<tensorflow::tstring>()() = cpu::HasAvx2Fma() ? "AVX2+FMA" : "scalar (no AVX2+FMA)";
  }
};

REGISTER_KERNEL_BUILDER(Name("TokenserveDense").Device(DEVICE_CPU), DenseOp);
REGISTER_KERNEL_BUILDER(Name("TokenserveEpilogue").Device(DEVICE_CPU), EpilogueOp);
REGISTER_KERNEL_BUILDER(Name("TokenserveNorm").Device(DEVICE_CPU), NormOp);
REGISTER_KERNEL_BUILDER(Name("TokenserveFinishBlock").Device(DEVICE_CPU), FinishBlockOp);
REGISTER_KERNEL_BUILDER(Name("TokenserveSplitRope").Device(DEVICE_CPU), SplitRopeOp);
REGISTER_KERNEL_BUILDER(Name("TokenserveDenseInfo").Device(DEVICE_CPU), DenseInfoOp);

}  // namespace tokenserve
