// GGUF blocks for the grouped experts (moe_gguf_layer.cc): one expert's rows times its
// matrices as a GGUF file stores them, through the block kernels of the dense block op
// (gguf_kernels.h and gguf_tiles.h for Q4_0 / Q4_1 / Q8_0 against q8 activation blocks of 32,
// gguf_kquants*.h for Q4_K / Q5_K / Q6_K against q8_K blocks of 256), included as they are.
//
//   y [M, N] = x [M, K] @ dequant(w [N, K / values * block bytes]).T
//
// The kernel choice follows gguf_matmul.cc's: a few rows of x (an expert's share of a decode
// step) each weight row read once, front to back; more rows (prefill chunks, many streams on
// one expert) eight weight rows decoded at a time (or a K-quant row unpacked once) into a
// per-thread buffer that every row sweeps. The output rows are split over the pool's threads
// in contiguous ranges, so one expert's matrix is read once for all its rows, by the two
// threads between them. AVX2 + FMA + F16C integer dot products, else the portable scalar path.
//
// Internal linkage, as dense_compute.h: each op file that includes this has its own copy.
#ifndef TOKENSERVE_KERNELS_MOE_GGUF_H_
#define TOKENSERVE_KERNELS_MOE_GGUF_H_

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "chunks.h"
#include "cpu.h"
#include "gguf_blocks.h"
#include "gguf_kernels.h"
#include "gguf_kquants.h"
#include "gguf_kquants_avx2.h"
#include "gguf_q8k.h"
#include "gguf_tiles.h"
#include "op_support.h"

namespace tokenserve {
namespace {

enum class BlockType { kQ4_0, kQ4_1, kQ8_0, kQ4_K, kQ5_K, kQ6_K, kUnknown };

inline BlockType ParseBlockType(const std::string& name) {
  if (name == "q4_0") return BlockType::kQ4_0;
  if (name == "q4_1") return BlockType::kQ4_1;
  if (name == "q8_0") return BlockType::kQ8_0;
  if (name == "q4_k") return BlockType::kQ4_K;
  if (name == "q5_k") return BlockType::kQ5_K;
  if (name == "q6_k") return BlockType::kQ6_K;
  return BlockType::kUnknown;
}

inline bool IsKQuant(BlockType t) {
  return t == BlockType::kQ4_K || t == BlockType::kQ5_K || t == BlockType::kQ6_K;
}

// Bytes of one row of K values (K a multiple of the type's block), or -1 where K does not
// divide into its blocks.
inline int64 BlockRowBytes(BlockType t, int64 k) {
  const int64 values = IsKQuant(t) ? gguf::kSuperBlock : gguf::kBlock;
  if (k % values) return -1;
  switch (t) {
    case BlockType::kQ4_0: return k / values * gguf::Q4_0::kBytes;
    case BlockType::kQ4_1: return k / values * gguf::Q4_1::kBytes;
    case BlockType::kQ8_0: return k / values * gguf::Q8_0::kBytes;
    case BlockType::kQ4_K: return k / values * gguf::Q4_K::kBytes;
    case BlockType::kQ5_K: return k / values * gguf::Q5_K::kBytes;
    case BlockType::kQ6_K: return k / values * gguf::Q6_K::kBytes;
    default: return -1;
  }
}

// A GGUF matrix of N output rows.
struct BlockMatrix {
  const uint8_t* w;
  int64 n, row_bytes;
  BlockType type;
};

template <class Type>
void Q8Matmul(tensorflow::thread::ThreadPool* pool, bool simd, const gguf::Q8Rows& xq, int64 m,
              const BlockMatrix& w, float* y) {
  const int64 workers = std::max(1, pool->NumThreads());
  const gguf::Output out{y, w.n};
#ifdef TOKENSERVE_CPU_X86
  if (simd && m <= (Type::kSigned ? 8 : 2)) {  // gguf_matmul.cc's RowKernelMaxRows
    const ChunkSplit split = SplitIntoChunks(w.n, xq.blocks * (8 + 6 * m));
    RunRanges(pool, workers, split.num_chunks, [&](int64 chunk, int64, int64) {
      const int64 n0 = chunk * split.per_chunk;
      gguf::RowsSimd<Type, gguf::MaddAvx2>(xq, m, w.w, w.row_bytes, n0,
                                           std::min(split.per_chunk, w.n - n0), out);
    });
    return;
  }
  if (simd) {
    const int64 tiles = (w.n + gguf::kTileRows - 1) / gguf::kTileRows;
    const ChunkSplit split = SplitIntoChunks(tiles, xq.blocks * (60 + 8 * m));
    std::vector<gguf::TileBuffer> buffers(workers);
    RunChunks(pool, workers, split.num_chunks, [&](int64 chunk, int64 worker) {
      const int64 end = std::min(tiles, (chunk + 1) * split.per_chunk);
      for (int64 tile = chunk * split.per_chunk; tile < end; ++tile) {
        const int64 n0 = tile * gguf::kTileRows;
        if (n0 + gguf::kTileRows <= w.n) {
          gguf::TileSimd<Type, gguf::MaddAvx2>(xq, m, w.w, w.row_bytes, n0, &buffers[worker],
                                               out);
        } else {  // N % 8 rows left over
          gguf::RowsSimd<Type, gguf::MaddAvx2>(xq, m, w.w, w.row_bytes, n0, w.n - n0, out);
        }
      }
    });
    return;
  }
#endif
  const ChunkSplit split = SplitIntoChunks(w.n, xq.blocks * 40 * (1 + m));
  RunChunks(pool, workers, split.num_chunks, [&](int64 chunk, int64) {
    const int64 n0 = chunk * split.per_chunk;
    gguf::RowsScalar<Type>(xq, m, w.w, w.row_bytes, n0, std::min(split.per_chunk, w.n - n0),
                           out);
  });
}

template <class Type>
void KMatmul(tensorflow::thread::ThreadPool* pool, bool simd, const gguf::Q8KRows& xq, int64 m,
             const BlockMatrix& w, float* y) {
  const int64 workers = std::max(1, pool->NumThreads());
  const gguf::Output out{y, w.n};
#ifdef TOKENSERVE_CPU_X86
  if (simd && m <= gguf::kKRowGroup) {
    const ChunkSplit split = SplitIntoChunks(w.n, xq.blocks * (60 + 40 * m));
    RunRanges(pool, workers, split.num_chunks, [&](int64 chunk, int64, int64) {
      const int64 n0 = chunk * split.per_chunk;
      gguf::KRowsAvx2<Type>(xq, m, w.w, w.row_bytes, n0, std::min(split.per_chunk, w.n - n0),
                            out);
    });
    return;
  }
  if (simd) {
    const ChunkSplit split = SplitIntoChunks(w.n, xq.blocks * (80 + 40 * m));
    std::vector<std::vector<gguf::KBlockAvx2>> buffers(workers);
    RunChunks(pool, workers, split.num_chunks, [&](int64 chunk, int64 worker) {
      const int64 n0 = chunk * split.per_chunk;
      gguf::KRowsBufferedAvx2<Type>(xq, m, w.w, w.row_bytes, n0,
                                    std::min(split.per_chunk, w.n - n0), &buffers[worker], out);
    });
    return;
  }
#endif
  const ChunkSplit split = SplitIntoChunks(w.n, xq.blocks * (1500 + 600 * m));
  RunChunks(pool, workers, split.num_chunks, [&](int64 chunk, int64) {
    const int64 n0 = chunk * split.per_chunk;
    gguf::KQuantRowsScalar<Type>(xq, m, w.w, w.row_bytes, n0,
                                 std::min(split.per_chunk, w.n - n0), y, w.n);
  });
}

// y [m, w.n] = x [m, k] @ dequant(w).T; x quantized here (q8 blocks of 32, or q8_K of 256).
// simd: AVX2 + FMA + F16C, which the caller has checked the CPU has.
inline void BlockMatmul(tensorflow::thread::ThreadPool* pool, bool simd, const float* x,
                        int64 m, int64 k, const BlockMatrix& w, float* y) {
  if (IsKQuant(w.type)) {
    gguf::Q8KRows xq;
    gguf::QuantizeRowsK(x, m, k, simd, &xq);
    if (w.type == BlockType::kQ4_K) return KMatmul<gguf::Q4_K>(pool, simd, xq, m, w, y);
    if (w.type == BlockType::kQ5_K) return KMatmul<gguf::Q5_K>(pool, simd, xq, m, w, y);
    return KMatmul<gguf::Q6_K>(pool, simd, xq, m, w, y);
  }
  gguf::Q8Rows xq;
  gguf::QuantizeRows(x, m, k, simd, &xq);
  if (w.type == BlockType::kQ4_0) return Q8Matmul<gguf::Q4_0>(pool, simd, xq, m, w, y);
  if (w.type == BlockType::kQ4_1) return Q8Matmul<gguf::Q4_1>(pool, simd, xq, m, w, y);
  Q8Matmul<gguf::Q8_0>(pool, simd, xq, m, w, y);
}

// ---- a decode step's experts in one dispatch -------------------------------------------------
// A few rows per expert (one decode stream: one row on each of k experts) make each matrix
// a short job, and a thread-team dispatch per matrix (k experts x 3) costs more than the
// matrix on a busy machine. BlockJobs runs several matrices' output rows as one list of
// ranges in one dispatch: the gate and up matrices of every expert with rows, then (after
// SwiGLU) every down matrix, two dispatches a layer. Each matrix is still read once, front
// to back, by whichever thread takes its rows.

// One product y [m, w.n] = x [m, K] @ dequant(w).T, x already quantized (xq for the 32-value
// types, xk for the K-quants).
struct BlockJob {
  BlockMatrix w;
  const gguf::Q8Rows* xq;
  const gguf::Q8KRows* xk;
  int64 m;
  float* y;
};

// Whether m rows of x take the row kernels for this type (gguf_matmul.cc's choice), the
// only kernels BlockJobs runs.
inline bool FitsRowKernel(BlockType t, int64 m) {
  if (IsKQuant(t)) return m <= gguf::kKRowGroup;
  return m <= (t == BlockType::kQ8_0 ? 8 : 2);
}

#ifdef TOKENSERVE_CPU_X86
template <class Type>
void JobRows(const BlockJob& j, int64 n0, int64 count) {
  const gguf::Output out{j.y, j.w.n};
  if constexpr (std::is_same_v<Type, gguf::Q4_K> || std::is_same_v<Type, gguf::Q5_K> ||
                std::is_same_v<Type, gguf::Q6_K>) {
    gguf::KRowsAvx2<Type>(*j.xk, j.m, j.w.w, j.w.row_bytes, n0, count, out);
  } else {
    gguf::RowsSimd<Type, gguf::MaddAvx2>(*j.xq, j.m, j.w.w, j.w.row_bytes, n0, count, out);
  }
}

// Every job's output rows in one dispatch (AVX2; every job's m fits the row kernels).
inline void RunBlockJobs(tensorflow::thread::ThreadPool* pool, const std::vector<BlockJob>& jobs) {
  struct Range {
    int64 job, n0, count;
  };
  std::vector<Range> ranges;
  for (int64 i = 0; i < static_cast<int64>(jobs.size()); ++i) {
    const BlockJob& j = jobs[i];
    const int64 blocks = IsKQuant(j.w.type) ? j.xk->blocks : j.xq->blocks;
    const int64 cost = IsKQuant(j.w.type) ? blocks * (60 + 40 * j.m) : blocks * (8 + 6 * j.m);
    const ChunkSplit split = SplitIntoChunks(j.w.n, cost);
    for (int64 c = 0; c < split.num_chunks; ++c) {
      const int64 n0 = c * split.per_chunk;
      ranges.push_back({i, n0, std::min(split.per_chunk, j.w.n - n0)});
    }
  }
  const int64 workers = std::max(1, pool->NumThreads());
  RunRanges(pool, workers, static_cast<int64>(ranges.size()), [&](int64 r, int64, int64) {
    const Range& range = ranges[r];
    const BlockJob& j = jobs[range.job];
    switch (j.w.type) {
      case BlockType::kQ4_0: return JobRows<gguf::Q4_0>(j, range.n0, range.count);
      case BlockType::kQ4_1: return JobRows<gguf::Q4_1>(j, range.n0, range.count);
      case BlockType::kQ8_0: return JobRows<gguf::Q8_0>(j, range.n0, range.count);
      case BlockType::kQ4_K: return JobRows<gguf::Q4_K>(j, range.n0, range.count);
      case BlockType::kQ5_K: return JobRows<gguf::Q5_K>(j, range.n0, range.count);
      case BlockType::kQ6_K: return JobRows<gguf::Q6_K>(j, range.n0, range.count);
      default: return;
    }
  });
}
#endif  // TOKENSERVE_CPU_X86

// x [m, k] quantized as `type` pairs with it: into *xq (32-value types) or *xk (K-quants).
inline void QuantizeFor(BlockType type, const float* x, int64 m, int64 k, gguf::Q8Rows* xq,
                        gguf::Q8KRows* xk) {
  if (IsKQuant(type)) {
    gguf::QuantizeRowsK(x, m, k, true, xk);
  } else {
    gguf::QuantizeRows(x, m, k, true, xq);
  }
}

}  // namespace
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_MOE_GGUF_H_
