// The int8 matmul for a whole call, y[M, N] = x @ dequant(q, scale).T (Int8MatmulRows): the
// instruction set an op runs, the checks of its weights, x quantized once, and the tiles of
// output channels spread over the threads, each dispatched to its kernel. What
// TokenserveInt8Matmul runs, and TokenserveInt8FinishBlock for each of its matrices.
//
// Internal linkage (an unnamed namespace): every op file that includes this compiles its own
// copy, so its calls stay direct and the compiler inlines and clones it within that file as
// it would the file's own code.
#ifndef TOKENSERVE_KERNELS_INT8_MATMUL_H_
#define TOKENSERVE_KERNELS_INT8_MATMUL_H_

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "tensorflow/core/platform/threadpool.h"
#include "chunks.h"
#include "cpu.h"
#include "int8_rows_avx2.h"
#include "int8_tiles.h"
#include "int8_tiles_avx2.h"
#include "int8_vnni.h"
#include "op_support.h"

namespace tokenserve {
namespace {

// The instruction set a call runs: chosen once per op from its `isa` attribute.
enum class Isa { kScalar, kAvx2, kAvx512Vnni };

Isa ChooseIsa(const std::string& attr) {
  if (attr == "scalar" || !cpu::HasAvx2Fma()) return Isa::kScalar;
  if (attr == "avx2" || !CpuHasAvx512Vnni()) return Isa::kAvx2;
  return Isa::kAvx512Vnni;
}

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Vnni: return "AVX512-VNNI";
    case Isa::kAvx2: return "AVX2+FMA";
    default: return "scalar (no AVX2+FMA)";
  }
}

// ---------------------------------------------------------------------------------------
// Dispatch over ISA and kernel variant.

// Whether the int8 kernel takes weight rows one at a time here (Int8RowsAvx2 or
// Int8RowsManyAvx2), which also needs |q| of the quantized rows. Also where the CPU has
// AVX512-VNNI: at a few rows of x the op streams weights rather than computes, and the VNNI
// tile's four interleaved weight streams read slower than one sequential stream. On a
// 2-core Zen 5 EPYC, GPT-2-small int8 decode of one sequence took 7.5-8.4 ms a step with
// the VNNI tile against 6.0-6.6 with the op built for AVX2 (docs/performance.md).
bool UsesRowKernel(const Geometry& g, Isa isa) {
  return isa != Isa::kScalar && g.M <= kRowKernelMaxRows;
}

// with_abs: also fill out->a (|q|) for the row kernel.
void QuantizeRows(const Geometry& g, const float* x, bool avx2, bool with_abs,
                  QuantizedRows* out) {
  const int64 nb = g.RowBlocks();
  out->q.resize(g.M * nb * kBlock);
  out->d.resize(g.M * nb);
  for (int64 m = 0; m < g.M; ++m) {
    for (int64 grp = 0; grp < g.G; ++grp) {
      for (int64 j = 0; j < g.blocks; ++j) {
        const int64 b = m * nb + grp * g.blocks + j;
        const float* src = x + m * g.K + grp * g.group + j * kBlock;
        int8_t* dst = out->q.data() + b * kBlock;
#ifdef TOKENSERVE_CPU_X86
        if (avx2) {
          out->d[b] = QuantizeBlockAvx2(src, g.BlockLen(j), dst);
          continue;
        }
#endif
        out->d[b] = QuantizeBlockScalar(src, g.BlockLen(j), dst);
      }
    }
  }
  if (with_abs) {
    out->a.resize(out->q.size());
    for (size_t i = 0; i < out->q.size(); ++i) {
      out->a[i] = static_cast<int8_t>(std::abs(out->q[i]));  // |q| <= 127: fits
    }
  }
}

void Int8Tile(const Geometry& g, const QuantizedRows& xq, const Tile& t, Isa isa, float* y) {
#ifdef TOKENSERVE_CPU_X86
  if (UsesRowKernel(g, isa)) {
    return g.M == 1 ? Int8RowsAvx2(g, xq, t, y) : Int8RowsManyAvx2(g, xq, t, y);
  }
#endif
#ifdef TOKENSERVE_VNNI
  if (isa == Isa::kAvx512Vnni) {
    if (t.count == kTile) return Int8TileVnni<kTile>(g, xq, t, y);
    for (int64 r = 0; r < t.count; ++r) {
      Int8TileVnni<1>(g, xq, Tile{t.q + r * g.K, t.scale + r * g.G, t.n0 + r, 1}, y);
    }
    return;
  }
#endif
#ifdef TOKENSERVE_CPU_X86
  if (isa != Isa::kScalar) {
    if (t.count == kTile) return Int8TileAvx2<kTile>(g, xq, t, y);
    for (int64 r = 0; r < t.count; ++r) {  // N % kTile leftovers, one channel at a time
      Int8TileAvx2<1>(g, xq, Tile{t.q + r * g.K, t.scale + r * g.G, t.n0 + r, 1}, y);
    }
    return;
  }
#endif
  Int8TileScalar(g, xq, t, y);
}

void FloatTile(const Geometry& g, const float* x, const Tile& t, bool avx2, float* buf,
               float* y) {
#ifdef TOKENSERVE_CPU_X86
  if (avx2) {
    if (t.count == kTile) return FloatTileAvx2<kTile>(g, x, t, buf, y);
    for (int64 r = 0; r < t.count; ++r) {
      FloatTileAvx2<1>(g, x, Tile{t.q + r * g.K, t.scale + r * g.G, t.n0 + r, 1}, buf, y);
    }
    return;
  }
#endif
  FloatTileScalar(g, x, t, buf, y);
}

// Checks q [N, K] and scale [N, G] against x's [M, K] (`what` names the weights in
// errors) and fills g; false (with the error set on ctx) when they do not fit.
bool CheckInt8Args(OpKernelContext* ctx, const char* what, int64 M, int64 K, const Tensor& q,
                   const Tensor& scale, Geometry* g) {
  auto fail = [ctx](const absl::Status& status) {
    ctx->CtxFailure(__FILE__, __LINE__, status);
    return false;
  };
  if (q.dims() != 2) {
    return fail(InvalidArgument(what, ": q must be [N, K], got shape ", q.shape().DebugString()));
  }
  if (scale.dims() != 2) {
    return fail(InvalidArgument(what, ": scale must be [N, G], got shape ",
                                scale.shape().DebugString()));
  }
  g->M = M;
  g->K = K;
  g->N = q.dim_size(0);
  g->G = scale.dim_size(1);
  if (q.dim_size(1) != g->K) {
    return fail(InvalidArgument(what, ": x is [M, K] with K = ", g->K, " but q is ",
                                q.shape().DebugString(), ", expected [N, K]"));
  }
  if (scale.dim_size(0) != g->N) {
    return fail(InvalidArgument(what, ": q has N = ", g->N, " rows but scale is ",
                                scale.shape().DebugString(), ", expected [N, G]"));
  }
  if (g->G < 1 || g->K % g->G != 0) {
    return fail(InvalidArgument(what, ": scale's group count G = ", g->G,
                                " must be >= 1 and divide K = ", g->K));
  }
  g->group = g->K / g->G;
  g->blocks = (g->group + kBlock - 1) / kBlock;
  g->tail = g->group - (g->blocks - 1) * kBlock;
  g->padded = (g->K + 7) / 8 * 8;
  return true;
}

// y[M, N] = x @ dequant(q).T for a checked geometry with M, N, K > 0; tiles of output
// channels spread over the pool's threads.
void Int8MatmulRows(tensorflow::thread::ThreadPool* pool, const Geometry& g, const float* xp,
                    const int8_t* qp, const float* sp, bool int8, Isa isa, bool avx2, float* y) {
  const bool row_kernel = int8 && UsesRowKernel(g, isa);
  QuantizedRows xq;
  // Once per call, before the parallel loop: every tile reuses the quantized rows.
  if (int8) QuantizeRows(g, xp, avx2, row_kernel, &xq);
  // Cost of one tile in cycles, roughly (measured per core: ~16 int8 multiply-adds and
  // ~7 weight bytes from DRAM per cycle). Chunks of about kChunkCycles each: a small call
  // stays one chunk on the calling thread, a large one is shared (chunks.h).
  const int64 cost = kTile * g.K * (g.M + 3) / 16;
  const int64 tiles = (g.N + kTile - 1) / kTile;
  const ChunkSplit split = SplitIntoChunks(tiles, cost);
  const int64 tiles_per_chunk = split.per_chunk, num_chunks = split.num_chunks;
  const int64 workers = std::max(1, pool->NumThreads());
  // float kernel's dequantized tile, one per worker
  std::vector<std::vector<float>> bufs(int8 ? 0 : workers);
  auto body = [&](int64 chunk, int64 worker, int64 next) {
    std::vector<float>* buf = int8 ? nullptr : &bufs[worker];
    if (buf && buf->empty()) buf->resize(kTile * g.padded);
    const int64 end = std::min(tiles, (chunk + 1) * tiles_per_chunk);
    const int64 stream_end = std::min(tiles, RangeStreamEnd(chunk, next) * tiles_per_chunk);
    const int8_t* prefetch_end = qp + std::min(g.N, stream_end * kTile) * g.K;
    for (int64 tile = chunk * tiles_per_chunk; tile < end; ++tile) {
      const int64 n0 = tile * kTile;
      // Software prefetch of the weights kPrefetchTiles tiles ahead: with the hardware
      // prefetcher alone a core streamed about half the bandwidth oneDNN's float32 matmul
      // reaches (measured 14 vs 25 GB/s on the LM head at M = 1, and M = 8 was 1.8x slower).
      // Not for the AVX2 row kernel, whose single stream the hardware prefetcher follows.
      const int64 ahead = n0 + kPrefetchTiles * kTile;
      if (ahead < g.N && !row_kernel) {
        const char* p = reinterpret_cast<const char*>(qp + ahead * g.K);
        const int64 bytes = std::min<int64>(kTile, g.N - ahead) * g.K;
        for (int64 off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
      }
      const Tile t{qp + n0 * g.K, sp + n0 * g.G, n0, std::min<int64>(kTile, g.N - n0),
                   prefetch_end};
      if (int8) {
        Int8Tile(g, xq, t, isa, y);
      } else {
        FloatTile(g, xp, t, avx2, buf->data(), y);
      }
    }
  };
  // For the row kernels each worker takes a contiguous range of chunks front to back
  // (RunRanges), so its weights are one stream across its chunks, and they prefetch into L2
  // to the end of the chunk it takes next when that one follows this one. The tile kernels
  // keep the shared counter: on the Zen 5 with AVX512-VNNI, int8 decode of 16 and 32
  // sequences measured 0.98x with ranges (4 alternating rounds), and they gain nothing
  // from them.
  if (row_kernel) {
    RunRanges(pool, workers, num_chunks, body);
  } else {
    RunChunks(pool, workers, num_chunks,
              [&](int64 chunk, int64 worker) { body(chunk, worker, -1); });
  }
}

}  // namespace
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_INT8_MATMUL_H_
