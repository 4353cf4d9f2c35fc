// The int8 weights' matmul, y[M, N] = x[M, K] @ dequant(q[N, K], scale[N, G]).T: its
// shapes (how K splits into weight groups and activation blocks), the quantized rows of x,
// a tile of output channels, and the portable scalar kernels. The AVX2 kernels are in
// int8_tiles_avx2.h and int8_rows_avx2.h, the AVX512-VNNI one in int8_vnni.h, the dispatch
// in int8_matmul.h.
//
// Internal linkage (an unnamed namespace): every op file that includes this compiles its own
// copy, so its calls stay direct and the compiler inlines and clones it within that file as
// it would the file's own code.
#ifndef TOKENSERVE_KERNELS_INT8_TILES_H_
#define TOKENSERVE_KERNELS_INT8_TILES_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu.h"
#include "op_support.h"
#include "q8_quantize.h"

// The AVX512-VNNI path only where the build targets AVX-512 (-march=native on such a CPU):
// a build for AVX2 (TOKENSERVE_KERNELS_MARCH=avx2, what an AVX2-only CPU runs) stays AVX2.
#if defined(TOKENSERVE_CPU_X86) && defined(__AVX512F__)
#define TOKENSERVE_VNNI 1
#endif

namespace tokenserve {
namespace {

constexpr int kBlock = 32;  // activation quantization block (one float scale per block)
constexpr int kTile = 4;    // output channels per micro-kernel call
constexpr int kPrefetchTiles = 2;  // how far ahead weights are prefetched (1..8 measured)
// Up to this many rows of x, the AVX2 int8 kernel reads one weight row at a time (one
// sequential stream: Int8RowsAvx2 for one row of x, Int8RowsManyAvx2 for 2..8); with more,
// the tile kernel's reuse of each x block across four weight rows wins. On a 2-core
// AVX2-only EPYC, alternating in one process: the row kernel took the LM head at M = 1 in
// 0.77-0.82x the tile kernel's time, the block matrices 0.86-0.95x; a GPT-2-small's int8
// matrices at M = 2 / 3 / 8 took 9.2 / 10.8 / 21.3-25.1 ms with Int8RowsManyAvx2 against the
// tile kernel's 9.6 / 14.9 / 25.2-25.7 (M = 2 then used the one-row kernel per row of x);
// at M = 12 they tied and at M = 24 the tile kernel was 1.1x faster (x no longer fits L1).
constexpr int64_t kRowKernelMaxRows = 8;
// The row kernels also prefetch their weight stream this many bytes ahead, a cache line at a
// time as they go. On a 2-core AVX2-only EPYC (GPT-2-small's int8 matrices, distances
// alternated in one process, 12 rounds): M = 1 10.25 -> 9.07 ms (768 bytes 9.31, 1,536
// 9.53), M = 2 17.4 -> 15.9, M = 4 and 8 1-3 % faster; engine decode of one sequence
// 92-101 -> 105-111 tok/s. The hardware prefetcher alone kept each core's stream at about
// 8 GB/s, against 12 for a plain numpy sum. (Prefetching a whole tile ahead at once, tried
// before, was slower: docs/performance.md.)
constexpr int64_t kRowPrefetch = 1024;
// And into L2 this many bytes ahead, as far as the worker's next chunk reaches
// (Tile::prefetch_end). The stream into L1 alone left the row kernel at 0.70-0.78 of a plain
// two-thread read loop over GPT-2's int8 LM head on a 2-core Zen 5 (AVX2 code; 27-31 against
// 38-41 GB/s); with the L2 prefetch 16, 32 or 64 KB ahead, 0.81-1.04, most runs 0.92-0.99
// (benchmarks/experiments/kernels/int8_row_variants.cc, seven runs; the three distances within noise of
// each other). In the engine, one int8 sequence 1.16x (1.09-1.19; alternating processes,
// 5 rounds, AVX2 cap), 8-32 sequences 1.01-1.02x.
constexpr int64_t kRowPrefetchL2 = 32768;

// Shapes of one call and how K splits into weight groups and activation blocks.
struct Geometry {
  int64 M, K, N, G;
  int64 group;   // K / G: weights sharing one scale
  int64 blocks;  // activation blocks per group: ceil(group / 32)
  int64 tail;    // length of the last block of each group, 1..32
  int64 padded;  // K rounded up to 8 (float kernel's buffer stride)
  int64 RowBlocks() const { return G * blocks; }
  int64 BlockLen(int64 j) const { return j == blocks - 1 ? tail : kBlock; }
};

// Quantized activations: row m, block b has 32 int8 values at q[(m*RowBlocks + b)*32]
// (zero-padded) and its scale at d[m*RowBlocks + b]; x ~= q * d.
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<int8_t> a;  // |q| (the AVX2 row kernel's unsigned operand), only for it
  std::vector<float> d;
};

// A tile of output channels: rows [n0, n0 + count) of q and scale.
struct Tile {
  const int8_t* q;      // q + n0 * K
  const float* scale;   // scale + n0 * G
  int64 n0, count;
  // the row kernels prefetch weights into L2 up to here (the end of what this worker reads
  // next); nullptr: not at all
  const int8_t* prefetch_end = nullptr;
};

// ---------------------------------------------------------------------------------------
// Portable scalar path. Same operations in the same order per block as the AVX2 path, so
// quantized activations are bit-identical and results differ only by float summation order.

// Quantizes x[0, len) into q[0, 32) (zero-padded) and returns the block scale
// (q8_quantize.h: a block with a NaN or infinity gets q = 0 and scale NaN).
float QuantizeBlockScalar(const float* x, int64 len, int8_t* q) {
  const float d = q8::QuantizeScalar(x, len, q);
  std::memset(q + len, 0, kBlock - len);
  return d;
}

void Int8TileScalar(const Geometry& g, const QuantizedRows& xq, const Tile& t, float* y) {
  const int64 nb = g.RowBlocks();
  for (int64 m = 0; m < g.M; ++m) {
    const int8_t* xrow = xq.q.data() + m * nb * kBlock;
    const float* drow = xq.d.data() + m * nb;
    for (int64 r = 0; r < t.count; ++r) {
      const int8_t* w = t.q + r * g.K;
      float total = 0.f;
      for (int64 grp = 0; grp < g.G; ++grp) {
        float acc = 0.f;
        for (int64 j = 0; j < g.blocks; ++j) {
          const int64 b = grp * g.blocks + j;
          const int8_t* wb = w + grp * g.group + j * kBlock;
          const int8_t* xb = xrow + b * kBlock;
          int32_t dot = 0;
          for (int64 i = 0; i < g.BlockLen(j); ++i) dot += int32_t{xb[i]} * int32_t{wb[i]};
          acc += static_cast<float>(dot) * drow[b];
        }
        total += acc * t.scale[r * g.G + grp];
      }
      y[m * g.N + t.n0 + r] = total;
    }
  }
}

// Dequantizes the tile's weights (scale folded in) into buf[count][padded], zero-padded.
void DequantizeTileScalar(const Geometry& g, const Tile& t, float* buf) {
  for (int64 r = 0; r < t.count; ++r) {
    float* out = buf + r * g.padded;
    for (int64 k = 0; k < g.K; ++k) {
      out[k] = static_cast<float>(t.q[r * g.K + k]) * t.scale[r * g.G + k / g.group];
    }
    for (int64 k = g.K; k < g.padded; ++k) out[k] = 0.f;
  }
}

void FloatTileScalar(const Geometry& g, const float* x, const Tile& t, float* buf, float* y) {
  DequantizeTileScalar(g, t, buf);
  for (int64 m = 0; m < g.M; ++m) {
    const float* xrow = x + m * g.K;
    for (int64 r = 0; r < t.count; ++r) {
      const float* w = buf + r * g.padded;
      float acc = 0.f;
      for (int64 k = 0; k < g.K; ++k) acc += xrow[k] * w[k];
      y[m * g.N + t.n0 + r] = acc;
    }
  }
}

}  // namespace
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_INT8_TILES_H_
