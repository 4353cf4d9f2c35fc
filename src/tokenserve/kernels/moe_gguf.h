// GGUF blocks for the grouped experts (moe_gguf_layer.cc): one expert's rows times its
// matrices as a GGUF file stores them, through the GGUF block matmul op's own kernels
// (gguf_matmul.h's Matmul and MatmulKQuant: gguf_kernels.h and gguf_tiles.h for Q4_0 / Q4_1 /
// Q8_0 against q8 activation blocks of 32, gguf_kquants*.h for Q4_K / Q5_K / Q6_K against
// q8_K blocks of 256).
//
//   y [M, N] = x [M, K] @ dequant(w [N, K / values * block bytes]).T
//
// The kernel choice is therefore gguf_matmul.h's: a few rows of x (an expert's share of a
// decode step) each weight row read once, front to back; more rows (prefill chunks, many
// streams on one expert) eight weight rows decoded at a time (or a K-quant row unpacked once)
// into a per-thread buffer that every row sweeps. The output rows are split over the pool's
// threads in contiguous ranges, so one expert's matrix is read once for all its rows, by the
// two threads between them. AVX2 + FMA + F16C integer dot products, else the portable scalar
// path. A decode step's experts run together in one dispatch (RunBlockJobs, below).
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
#include "gguf_matmul.h"
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

// y [m, w.n] = x [m, k] @ dequant(w).T; x quantized here (q8 blocks of 32, or q8_K of 256),
// then gguf_matmul.h's kernels for the type. simd: AVX2 + FMA + F16C, which the caller has
// checked the CPU has (never VNNI: the MoE ops pick AVX2 or scalar).
inline void BlockMatmul(tensorflow::thread::ThreadPool* pool, bool simd, const float* x,
                        int64 m, int64 k, const BlockMatrix& w, float* y) {
  const Isa isa = simd ? Isa::kAvx2 : Isa::kScalar;
  const Geometry g{m, k, w.n, w.row_bytes, w.n};
  if (IsKQuant(w.type)) {
    gguf::Q8KRows xq;
    gguf::QuantizeRowsK(x, m, k, simd, &xq);
    if (w.type == BlockType::kQ4_K) return MatmulKQuant<gguf::Q4_K>(pool, isa, g, xq, w.w, y);
    if (w.type == BlockType::kQ5_K) return MatmulKQuant<gguf::Q5_K>(pool, isa, g, xq, w.w, y);
    return MatmulKQuant<gguf::Q6_K>(pool, isa, g, xq, w.w, y);
  }
  if (w.type == BlockType::kQ4_0) return QuantizeAndMatmul<gguf::Q4_0>(pool, isa, g, x, w.w, y);
  if (w.type == BlockType::kQ4_1) return QuantizeAndMatmul<gguf::Q4_1>(pool, isa, g, x, w.w, y);
  QuantizeAndMatmul<gguf::Q8_0>(pool, isa, g, x, w.w, y);
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

// Whether m rows of x take the row kernels for this type (gguf_matmul.h's choice), the
// only kernels BlockJobs runs.
inline bool FitsRowKernel(BlockType t, int64 m) {
  switch (t) {
    case BlockType::kQ4_0: return m <= RowKernelMaxRows<gguf::Q4_0>();
    case BlockType::kQ4_1: return m <= RowKernelMaxRows<gguf::Q4_1>();
    case BlockType::kQ8_0: return m <= RowKernelMaxRows<gguf::Q8_0>();
    default: return m <= gguf::kKRowGroup;  // the K-quants (MatmulKQuant's row kernel)
  }
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
    // with Q4_0's lane sums whatever the type: gate and up share these blocks, and Q4_0 is
    // the one 32-value type of the experts with an integer offset (the others ignore them)
    gguf::QuantizeRows(x, m, k, true, xq, gguf::Q4_0::kIntOffset);
  }
}

}  // namespace
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_MOE_GGUF_H_
