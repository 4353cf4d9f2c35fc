// x @ W and its epilogue for one dense call, the work split between threads by layout and
// number of rows (ComputeDense): what TokenserveDense runs, and TokenserveFinishBlock for
// each of its matrices.
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
// Internal linkage (an unnamed namespace): every op file that includes this compiles its own
// copy, so its calls stay direct and the compiler inlines and clones it within that file as
// it would the file's own code.
#ifndef TOKENSERVE_KERNELS_DENSE_COMPUTE_H_
#define TOKENSERVE_KERNELS_DENSE_COMPUTE_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "tensorflow/core/platform/threadpool.h"
#include "chunks.h"
#include "dense_args.h"
#include "dense_kn.h"
#include "dense_nk.h"
#include "dense_packed.h"
#include "rowops.h"

namespace tokenserve {
namespace {

constexpr int64 kRowsPerPass = 8;   // rows of x sharing one pass over the weights ("kn")
constexpr int64 kMaxRange = 1024;   // columns per work item at most ("kn"): 4 KB per row
constexpr int64 kTileRows = 256;    // weight rows per work item ("nk")
constexpr int64 kChunksPerWorker = 4;  // "kn" split-K chunks per thread (late threads take fewer)
// "kn" with at most this many rows of x splits K instead. GPT-2-small's float32 engine step
// on a 2-core AVX2-only EPYC, one sequence checking drafts (5 / 8 rows): 23.3 / 31.1 ms with
// K split, against 29.7 ms for the column-range walk at 5 and 39.0 packed at 8.
constexpr int64 kSplitKMaxRows = 8;
constexpr int64 kSplitKMinRows = 64;  // weight rows per thread at least, when K is split
// "kn" with AVX2 and at least this many rows of x (and more than split K takes): packed
// chunks (in GPT-2-small's engine step the column-range walk was 9 % faster at 6 rows, the
// same at 8, slower from 16)
constexpr int64 kPackedMinRows = 8;

using rowops::FinishRow;

#ifdef TOKENSERVE_CPU_X86
// More rows of x with AVX2: work items of kPackDepth weight rows by at most kPackWidth
// columns (KnPackedAvx2), one contiguous range of them per worker (RunRanges), into
// per-worker partial sums that the epilogue adds up (as ComputeKnSplitK below). A whole
// row of a wide W (3072 columns) made a 768 KB pack that, with the partial sums,
// overflowed L2.
template <typename W>
void ComputeKnPacked(const DenseGeometry& g, const Args<W>& a,
                     tensorflow::thread::ThreadPool* pool) {
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
#endif  // TOKENSERVE_CPU_X86

// Column ranges of W, 2 per thread (at most kMaxRange wide, a multiple of 8 where possible);
// each range runs its own epilogue, except a gated activation's, whose halves live in
// different ranges.
template <typename W>
void ComputeKn(const DenseGeometry& g, const Args<W>& a, tensorflow::thread::ThreadPool* pool,
               bool avx2) {
  const bool gated = rowops::Gated(a.act);
  const int64 threads = std::max(1, pool->NumThreads());
  int64 items = std::max<int64>(2 * threads, (g.N + kMaxRange - 1) / kMaxRange);
  int64 width = (g.N + items - 1) / items;
  width = std::max<int64>(8, (width + 7) / 8 * 8);
  items = (g.N + width - 1) / width;
  std::vector<float> z;  // the whole of x @ W + bias (gated only: pairs cross ranges)
  if (gated) z.resize(g.M * g.N);
    std::vector<std::vector<float>> accs(threads);  // one per worker
  RunChunks(pool, threads, items, [&](int64 item, int64 worker) {
    std::vector<float>& acc = accs[worker];
    if (acc.empty()) acc.resize(kRowsPerPass * width);
    const int64 j0 = item * width, cols = std::min(width, g.N - j0);
    for (int64 r0 = 0; r0 < g.M; r0 += kRowsPerPass) {
      const int64 rows = std::min(kRowsPerPass, g.M - r0);
#ifdef TOKENSERVE_CPU_X86
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
        if (gated) {
          std::memcpy(z.data() + (r0 + r) * g.N + j0, zr, cols * sizeof(float));
          continue;
        }
        const float* res = a.residual ? a.residual + (r0 + r) * g.out + j0 : nullptr;
        FinishRow(avx2, cols, a.act, zr, nullptr, res, a.y + (r0 + r) * g.out + j0);
      }
    }
  });
  if (gated) {
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
// `side`, when given, is one more chunk of the same call of the thread team (the first
// taken), so its memory reads overlap the weights' stream (ComputeDense).
template <typename W>
void ComputeKnSplitK(const DenseGeometry& g, const Args<W>& a, tensorflow::thread::ThreadPool* pool,
                     bool avx2, const std::function<void()>* side) {
  const int64 workers = std::max(1, pool->NumThreads());
  const int64 chunks = std::max<int64>(1, std::min(kChunksPerWorker * workers,
                                                   g.K / kSplitKMinRows));
  const int64 rows_per_chunk = (g.K + chunks - 1) / chunks;
  std::vector<float> partial(workers * g.M * g.N);
  std::vector<char> used(workers, 0);
  const int64 sides = side != nullptr ? 1 : 0;
  RunChunks(pool, workers, chunks + sides, [&](int64 item, int64 worker) {
    if (item < sides) {
      (*side)();
      return;
    }
    const int64 chunk = item - sides;
    const int64 k0 = chunk * rows_per_chunk, k1 = std::min(g.K, k0 + rows_per_chunk);
    float* acc = partial.data() + worker * g.M * g.N;
    used[worker] = 1;  // partial sums start at zero (the vector is value-initialized)
#ifdef TOKENSERVE_CPU_X86
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
void ComputeNk(const DenseGeometry& g, const Args<W>& a, tensorflow::thread::ThreadPool* pool,
               bool avx2) {
  const bool direct = a.act == Activation::kNone && !a.bias && !a.residual;
  std::vector<float> z;
  float* zp = a.y;
  if (!direct) {
    z.resize(g.M * g.N);
    zp = z.data();
  }
#ifdef TOKENSERVE_CPU_X86
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
#ifdef TOKENSERVE_CPU_X86
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
// `side` (nullptr: none) is independent work run before the call returns: with few rows
// of x ("kn" split K), as one more chunk of the thread team beside the weights' chunks,
// so a small product of other memory (a LoRA delta's factors) streams while the weights
// do instead of after them, on one thread; otherwise first, on this thread.
template <typename W>
void ComputeDense(const DenseGeometry& g, const Args<W>& a, bool kn,
                  tensorflow::thread::ThreadPool* pool, bool avx2,
                  const std::function<void()>* side = nullptr) {
  if (kn && g.M <= kSplitKMaxRows && g.K >= 2 * kSplitKMinRows) {
    ComputeKnSplitK(g, a, pool, avx2, side);
    return;
  }
  if (side != nullptr) (*side)();
#ifdef TOKENSERVE_CPU_X86
  if (kn && avx2 && g.M >= kPackedMinRows) {
    ComputeKnPacked(g, a, pool);
    return;
  }
#endif
  if (kn) {
    ComputeKn(g, a, pool, avx2);
  } else {
    ComputeNk(g, a, pool, avx2);
  }
}

}  // namespace
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_DENSE_COMPUTE_H_
