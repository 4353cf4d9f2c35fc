// The GGUF-block matmul's kernels behind one call (GgufMatmulRows): the ISA choice, the
// shapes' checks and the dispatch over block types and row counts. TokenserveGgufMatmul
// (gguf_matmul.cc) and TokenserveGgufFinishBlock (gguf_finish_block.cc) both call it.
#ifndef TOKENSERVE_KERNELS_GGUF_MATMUL_H_
#define TOKENSERVE_KERNELS_GGUF_MATMUL_H_

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "chunks.h"
#include "cpu.h"
#include "gguf_blocks.h"
#include "gguf_kernels.h"
#include "gguf_kquants.h"
#include "gguf_kquants_avx2.h"
#include "gguf_packed.h"
#include "gguf_q8k.h"
#include "gguf_tiles.h"
#include "op_support.h"

// The block types the ops take, as an attr's values: the file's own, and those repacked at
// load into 8-row tiles (gguf_packed.h).
#define TOKENSERVE_GGUF_TYPES \
  "'q4_0', 'q4_1', 'q5_0', 'q8_0', 'q4_k', 'q5_k', 'q6_k', 'q4_0x8', 'q4_1x8', 'q5_0x8'"

namespace tokenserve {
namespace {

// Up to this many rows of x, one weight row at a time against all of them (RowsSimd): the
// weights are one sequential stream and each block is decoded once for every four rows of x.
// Above, the tile kernel, whose decode of eight rows is paid once for all rows of x. On a
// 2-core AVX2-only EPYC (one thread, builds alternated; a shared machine, so only ratios to
// the int8 op in the same run were steady): with 4-bit blocks the tile kernel was faster from
// 3 rows (576x1536 in cache, M = 3: 0.10-0.12 against 0.12-0.16 ms; from memory, M = 4 and
// 8: 0.74-0.86 of the int8 op's time against 0.81-0.98). Q8_0's tile moves x's sign per
// vector, and there the row kernel stayed faster through 8 rows (from memory 0.70-0.98 of
// the int8 op's time against 0.94-1.67).
template <class Type>
constexpr int64 RowKernelMaxRows() {
  return Type::kSigned ? 8 : 2;
}

enum class Isa { kScalar, kAvx2, kAvx512Vnni };

bool CpuHasVnni() {
#ifdef TOKENSERVE_GGUF_VNNI
  static const bool has = cpu::HasAvx2FmaF16c() && __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512vnni");
  return has;
#else
  return false;
#endif
}

Isa ChooseIsa(const std::string& attr) {
  if (attr == "scalar" || !cpu::HasAvx2FmaF16c()) return Isa::kScalar;
  if (attr == "avx2" || !CpuHasVnni()) return Isa::kAvx2;
  return Isa::kAvx512Vnni;
}

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Vnni: return "AVX512-VNNI";
    case Isa::kAvx2: return "AVX2+FMA+F16C";
    default: return "scalar (no AVX2+FMA+F16C)";
  }
}

// One call's shapes: x [M, K], blocks [N, row_bytes], y [M, N] with rows ldy apart (N, or
// wider where this call writes some columns of a larger y).
struct Geometry {
  int64 M, K, N, row_bytes, ldy;
};

// Whether `type` names weights repacked at load into 8-row tiles (gguf_packed.h): "q4_0x8",
// "q4_1x8", "q5_0x8". A row's bytes are as many as the type's own.
bool IsPacked(const std::string& type) {
  return type.size() == 6 && type.compare(4, 2, "x8") == 0;
}

int BlockBytes(const std::string& type) {
  if (type.compare(0, 4, "q4_0") == 0) return gguf::Q4_0::kBytes;
  if (type.compare(0, 4, "q4_1") == 0) return gguf::Q4_1::kBytes;
  if (type.compare(0, 4, "q5_0") == 0) return gguf::Q5_0::kBytes;
  if (type == "q4_k") return gguf::Q4_K::kBytes;
  if (type == "q5_k") return gguf::Q5_K::kBytes;
  if (type == "q6_k") return gguf::Q6_K::kBytes;
  return gguf::Q8_0::kBytes;
}

bool IsKQuant(const std::string& type) { return type.size() == 4 && type[3] == 'k'; }

// Why N rows of `type` cannot be its weights, or "" when they can: packed tiles hold 8 rows.
std::string RowsMismatch(const std::string& type, int64 N) {
  if (!IsPacked(type) || N % gguf::kPackRows == 0) return "";
  return type + " weights come in tiles of " + std::to_string(gguf::kPackRows) +
         " rows, but blocks has " + std::to_string(N);
}

int BlockValues(const std::string& type) {
  return IsKQuant(type) ? gguf::kSuperBlock : gguf::kBlock;
}

// Why blocks [n, row_bytes] of `type` cannot hold rows of K values, or "" when they can.
std::string BlocksMismatch(const std::string& type, int64 K, int64 row_bytes) {
  const int values = BlockValues(type);
  if (K % values != 0) {
    return "x's K = " + std::to_string(K) + " does not divide into " + type + " blocks of " +
           std::to_string(values) + " values";
  }
  const int64 want = K / values * BlockBytes(type);
  if (row_bytes != want) {
    return type + " weights for K = " + std::to_string(K) + " need " + std::to_string(want) +
           " bytes a row (" + std::to_string(K / values) + " blocks of " +
           std::to_string(BlockBytes(type)) + "), but blocks has " + std::to_string(row_bytes);
  }
  return "";
}

// y = x @ dequant(w).T for one block type and dot product, rows split over the pool.
template <class Type, class Dot>
void MatmulSimd(tensorflow::thread::ThreadPool* pool, const Geometry& g, const gguf::Q8Rows& xq,
                const uint8_t* w, float* y) {
#ifdef TOKENSERVE_CPU_X86
  if constexpr (Type::kIntOffset > 0) {  // the row kernel reads the lane sums it was made with
    CHECK_EQ(xq.sums.size(), xq.q.size() / 4) << "activations quantized without lane sums";
  }
  const int64 workers = std::max(1, pool->NumThreads());
  const gguf::Output out{y, g.ldy};
  if (g.M <= RowKernelMaxRows<Type>()) {
    // cycles a weight row, roughly: a block's decode, and its dot product per row of x
    const ChunkSplit split = SplitIntoChunks(g.N, xq.blocks * (8 + 6 * g.M));
    RunRanges(pool, workers, split.num_chunks, [&](int64 chunk, int64, int64) {
      const int64 n0 = chunk * split.per_chunk;
      gguf::RowsSimd<Type, Dot>(xq, g.M, w, g.row_bytes, n0,
                                std::min(split.per_chunk, g.N - n0), out);
    });
    return;
  }
  const int64 tiles = (g.N + gguf::kTileRows - 1) / gguf::kTileRows;
  // cycles a tile, roughly: its decode, and about 8 per block and row of x
  const ChunkSplit split = SplitIntoChunks(tiles, xq.blocks * (60 + 8 * g.M));
  std::vector<gguf::TileBuffer> buffers(workers);
  RunChunks(pool, workers, split.num_chunks, [&](int64 chunk, int64 worker) {
    const int64 end = std::min(tiles, (chunk + 1) * split.per_chunk);
    for (int64 tile = chunk * split.per_chunk; tile < end; ++tile) {
      const int64 n0 = tile * gguf::kTileRows;
      if (n0 + gguf::kTileRows <= g.N) {
        gguf::TileSimd<Type, Dot>(xq, g.M, w, g.row_bytes, n0, &buffers[worker], out);
      } else {  // N % 8 rows left over
        gguf::RowsSimd<Type, Dot>(xq, g.M, w, g.row_bytes, n0, g.N - n0, out);
      }
    }
  });
#endif
}

template <class Type>
void MatmulScalar(tensorflow::thread::ThreadPool* pool, const Geometry& g,
                  const gguf::Q8Rows& xq, const uint8_t* w, float* y) {
  const int64 workers = std::max(1, pool->NumThreads());
  const ChunkSplit split = SplitIntoChunks(g.N, xq.blocks * 40 * (1 + g.M));
  RunChunks(pool, workers, split.num_chunks, [&](int64 chunk, int64) {
    const int64 n0 = chunk * split.per_chunk;
    gguf::RowsScalar<Type>(xq, g.M, w, g.row_bytes, n0, std::min(split.per_chunk, g.N - n0),
                           gguf::Output{y, g.ldy});
  });
}

template <class Type>
void Matmul(tensorflow::thread::ThreadPool* pool, Isa isa, const Geometry& g,
            const gguf::Q8Rows& xq, const uint8_t* w, float* y) {
#ifdef TOKENSERVE_GGUF_VNNI
  if (isa == Isa::kAvx512Vnni) return MatmulSimd<Type, gguf::DpbusdVnni>(pool, g, xq, w, y);
#endif
#ifdef TOKENSERVE_CPU_X86
  if (isa != Isa::kScalar) return MatmulSimd<Type, gguf::MaddAvx2>(pool, g, xq, w, y);
#endif
  MatmulScalar<Type>(pool, g, xq, w, y);
}

// Weights repacked into 8-row tiles (gguf_packed.h): tiles split over the pool in contiguous
// ranges, every row count through the same kernel.
template <class Type>
void MatmulPacked(tensorflow::thread::ThreadPool* pool, Isa isa, const Geometry& g,
                  const gguf::Q8Rows& xq, const uint8_t* w, float* y) {
  const int64 workers = std::max(1, pool->NumThreads());
  const gguf::Output out{y, g.ldy};
  const int64 tiles = g.N / gguf::kPackRows;
#ifdef TOKENSERVE_CPU_X86
  if (isa != Isa::kScalar) {
    if constexpr (Type::kIntOffset > 0) {  // the kernel reads the group sums it was made with
      CHECK_EQ(xq.group_sums.size(), xq.q.size() / gguf::kGroup)
          << "activations quantized without group sums";
    }
    // cycles a tile, roughly: its blocks' unpacking, and about 40 per block and row of x
    const ChunkSplit split = SplitIntoChunks(tiles, xq.blocks * (20 + 40 * g.M));
    RunRanges(pool, workers, split.num_chunks, [&](int64 chunk, int64, int64) {
      const int64 t0 = chunk * split.per_chunk, count = std::min(split.per_chunk, tiles - t0);
#ifdef TOKENSERVE_GGUF_VNNI
      if (isa == Isa::kAvx512Vnni) {
        return gguf::PackedRowsSimd<Type, gguf::DpbusdVnni>(
            xq, g.M, w, g.row_bytes, t0 * gguf::kPackRows, count * gguf::kPackRows, out);
      }
#endif
      gguf::PackedRowsSimd<Type, gguf::MaddAvx2>(xq, g.M, w, g.row_bytes, t0 * gguf::kPackRows,
                                                 count * gguf::kPackRows, out);
    });
    return;
  }
#endif
  const ChunkSplit split = SplitIntoChunks(tiles, xq.blocks * 320 * (1 + g.M));
  RunChunks(pool, workers, split.num_chunks, [&](int64 chunk, int64) {
    const int64 t0 = chunk * split.per_chunk, count = std::min(split.per_chunk, tiles - t0);
    gguf::PackedRowsScalar<Type>(xq, g.M, w, g.row_bytes, t0 * gguf::kPackRows,
                                 count * gguf::kPackRows, out);
  });
}

template <class Type>
void QuantizeAndMatmulPacked(tensorflow::thread::ThreadPool* pool, Isa isa, const Geometry& g,
                             const float* x, const uint8_t* w, float* y) {
  // the SIMD kernel folds Q4_0's and Q5_0's offsets with group sums; the scalar one takes
  // them as a float term and needs no sums
  const bool simd = isa != Isa::kScalar;
  gguf::Q8Rows xq;
  gguf::QuantizeRows(x, g.M, g.K, simd, &xq, simd ? Type::kIntOffset : 0, /*group_sums=*/simd);
  MatmulPacked<Type>(pool, isa, g, xq, w, y);
}

// The K-quants against q8_K activations (gguf_kquants.h, gguf_kquants_avx2.h): up to four
// rows of x, each weight row read once and unpacked on the way; above, each weight row
// unpacked once into a per-thread buffer that every row of x sweeps.
template <class Type>
void MatmulKQuant(tensorflow::thread::ThreadPool* pool, Isa isa, const Geometry& g,
                  const gguf::Q8KRows& xq, const uint8_t* w, float* y) {
  const int64 workers = std::max(1, pool->NumThreads());
  const gguf::Output out{y, g.ldy};
#ifdef TOKENSERVE_CPU_X86
  if (isa != Isa::kScalar && g.M <= gguf::kKRowGroup) {
    // cycles a weight row, roughly: a super-block's unpacking, and its dot product per row
    const ChunkSplit split = SplitIntoChunks(g.N, xq.blocks * (60 + 40 * g.M));
    RunRanges(pool, workers, split.num_chunks, [&](int64 chunk, int64, int64) {
      const int64 n0 = chunk * split.per_chunk;
      gguf::KRowsAvx2<Type>(xq, g.M, w, g.row_bytes, n0, std::min(split.per_chunk, g.N - n0),
                            out);
    });
    return;
  }
  if (isa != Isa::kScalar) {
    const ChunkSplit split = SplitIntoChunks(g.N, xq.blocks * (80 + 40 * g.M));
    std::vector<std::vector<gguf::KBlockAvx2>> buffers(workers);
    RunChunks(pool, workers, split.num_chunks, [&](int64 chunk, int64 worker) {
      const int64 n0 = chunk * split.per_chunk;
      gguf::KRowsBufferedAvx2<Type>(xq, g.M, w, g.row_bytes, n0,
                                    std::min(split.per_chunk, g.N - n0), &buffers[worker], out);
    });
    return;
  }
#endif
  const ChunkSplit split = SplitIntoChunks(g.N, xq.blocks * (1500 + 600 * g.M));
  RunChunks(pool, workers, split.num_chunks, [&](int64 chunk, int64) {
    const int64 n0 = chunk * split.per_chunk;
    gguf::KQuantRowsScalar<Type>(xq, g.M, w, g.row_bytes, n0,
                                 std::min(split.per_chunk, g.N - n0), y, g.ldy);
  });
}

// The same for x still float32: quantized here for Type (with its integer offset's sums).
template <class Type>
void QuantizeAndMatmul(tensorflow::thread::ThreadPool* pool, Isa isa, const Geometry& g,
                       const float* x, const uint8_t* w, float* y) {
  gguf::Q8Rows xq;
  gguf::QuantizeRows(x, g.M, g.K, isa != Isa::kScalar, &xq, Type::kIntOffset);
  Matmul<Type>(pool, isa, g, xq, w, y);
}

// y = x @ dequant(w).T for x [g.M, g.K] float32 and w the weight rows of `type`: x is
// quantized here, once (q8 blocks of 32, or q8_K blocks of 256 for the K-quants).
// g.K must divide into the type's blocks (BlocksMismatch) and be positive, and g.N into a
// packed type's tiles (RowsMismatch).
inline void GgufMatmulRows(tensorflow::thread::ThreadPool* pool, Isa isa,
                           const std::string& type, const Geometry& g, const float* x,
                           const uint8_t* w, float* y) {
  if (IsKQuant(type)) {
    gguf::Q8KRows xq;
    gguf::QuantizeRowsK(x, g.M, g.K, isa != Isa::kScalar, &xq);
    if (type == "q4_k") return MatmulKQuant<gguf::Q4_K>(pool, isa, g, xq, w, y);
    if (type == "q5_k") return MatmulKQuant<gguf::Q5_K>(pool, isa, g, xq, w, y);
    return MatmulKQuant<gguf::Q6_K>(pool, isa, g, xq, w, y);
  }
  if (type == "q4_0x8") return QuantizeAndMatmulPacked<gguf::Q4_0>(pool, isa, g, x, w, y);
  if (type == "q4_1x8") return QuantizeAndMatmulPacked<gguf::Q4_1>(pool, isa, g, x, w, y);
  if (type == "q5_0x8") return QuantizeAndMatmulPacked<gguf::Q5_0>(pool, isa, g, x, w, y);
  if (type == "q4_0") return QuantizeAndMatmul<gguf::Q4_0>(pool, isa, g, x, w, y);
  if (type == "q4_1") return QuantizeAndMatmul<gguf::Q4_1>(pool, isa, g, x, w, y);
  if (type == "q5_0") return QuantizeAndMatmul<gguf::Q5_0>(pool, isa, g, x, w, y);
  QuantizeAndMatmul<gguf::Q8_0>(pool, isa, g, x, w, y);
}

}  // namespace
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_GGUF_MATMUL_H_
