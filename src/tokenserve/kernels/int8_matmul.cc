// TokenserveInt8Matmul: y[M, N] = x[M, K] @ dequant(q[N, K], scale[N, G]).T on the CPU.
//
// Built for LLM decode (M = 1..32): the run time is dominated by streaming the weights, so
// they are kept as int8 (one byte per weight, output-major so each output's K weights are
// contiguous) and read from memory once per call, software-prefetched a few tiles ahead.
// Every row of x is swept over a small tile of output channels while that tile's weights
// sit in L1; tiles are spread over TF's intra-op threads.
//
// Two inner kernels, both with an AVX2+FMA path and a portable scalar path (same math):
//   * int8 activations (llama.cpp's q8_0 idea): each row of x is quantized once per call to
//     int8 in blocks of 32 with one float scale per block, then 32-wide integer dot products
//     (_mm256_maddubs_epi16 + _mm256_madd_epi16) are scaled by the block scale. About half
//     the instructions per multiply-add of the float kernel; error ~1/254 of the block absmax.
//     With up to 8 rows of x (decode of a few sequences, or one checking drafts) the AVX2
//     path reads one weight row at a time, a single sequential stream, each block of it
//     loaded once for four (or five) rows of x; with more it sweeps every row of x over a tile of
//     four weight rows held in L1.
//   * float activations: a tile of weights is dequantized (scale folded in) into a small
//     float buffer once, then plain FMA dot products for every row of x. Exact up to float
//     rounding.
// The int8 kernel is the default: it measured about 2x faster than the float one at every
// shape of benchmarks/int8_matmul.py. The float kernel stays as an exact option
// (activations="float").
// Where the CPU has AVX512-VNNI (with AVX512BW and VL), the int8 kernel takes two 32-blocks
// per instruction instead: one vpdpbusd (u8 x s8, four products per int32 lane, no
// saturation) on 64 bytes replaces maddubs + madd on 32, and the two blocks' scales ride in
// the two halves of one float vector. Same integer dot products per block, so it differs
// from the AVX2 path only in float summation order.
//
// TokenserveInt8FinishBlock runs a transformer block's second half (output projection,
// residual, MLP norm, MLP up and activation, MLP down, residual) through the same kernel in
// one op, and optionally the next block's norm and QKV projection, so those three or four
// matrices stream back to back (see the op's class below).
//
// Scales: scale[n, g] applies to q[n, g*K/G : (g+1)*K/G]. Activation blocks never straddle a
// weight group (they restart at each group boundary), so any K and any group size work; a
// block shorter than 32 is zero-padded. q must lie in [-127, 127] (symmetric quantization,
// as quantize_weight produces): the AVX2 sign trick cannot negate -128.

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TOKENSERVE_X86 1
// The AVX512-VNNI path only where the build targets AVX-512 (-march=native on such a CPU):
// a build for AVX2 (TOKENSERVE_KERNELS_MARCH=avx2, what an AVX2-only CPU runs) stays AVX2.
#if defined(__AVX512F__)
#define TOKENSERVE_VNNI 1
#endif
#endif

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/platform/threadpool.h"
#include "chunks.h"
#include "cpu.h"
#include "rowops.h"
#include "tensor_args.h"

namespace tokenserve {
namespace {

using tensorflow::int64;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::errors::InvalidArgument;
using tensorflow::shape_inference::DimensionHandle;
using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;
using tensor_args::CheckNextNorm;
using tensor_args::Data;
using tensor_args::IsVectorOrEmpty;

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
// (benchmarks/kernels/int8_row_variants.cc, seven runs; the three distances within noise of
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

// Quantizes x[0, len) into q[0, 32) (zero-padded) and returns the block scale. A block with
// a NaN or infinity gets q = 0 and scale NaN, so the outputs it feeds become NaN (as in the
// float matmul) instead of finite garbage.
float QuantizeBlockScalar(const float* x, int64 len, int8_t* q) {
  float amax = 0.f;
  bool finite = true;
  for (int64 i = 0; i < len; ++i) {
    finite = finite && std::isfinite(x[i]);
    amax = std::max(amax, std::fabs(x[i]));
  }
  if (!finite) {
    std::memset(q, 0, kBlock);
    return NAN;
  }
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int64 i = 0; i < kBlock; ++i) {
    // nearbyint: round half to even, as _mm256_round_ps(_MM_FROUND_TO_NEAREST_INT) does.
    q[i] = i < len ? static_cast<int8_t>(std::nearbyint(x[i] * inv)) : 0;
  }
  return amax / 127.f;
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

// ---------------------------------------------------------------------------------------
// AVX2 + FMA path. Functions carry target attributes (rather than relying on -m flags) so the
// library still loads and runs the scalar path on a CPU without AVX2.
#ifdef TOKENSERVE_X86
#define AVX2_FN __attribute__((target("avx2,fma")))

AVX2_FN float QuantizeBlockAvx2(const float* x, int64 len, int8_t* q) {
  alignas(32) float padded[kBlock];
  if (len < kBlock) {  // rare: the last block of a group whose size is not a multiple of 32
    std::memset(padded, 0, sizeof(padded));
    std::memcpy(padded, x, len * sizeof(float));
    x = padded;
  }
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 largest = _mm256_set1_ps(FLT_MAX);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  __m256 bad = _mm256_setzero_ps();  // lanes that saw a NaN or an infinity
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    const __m256 a = _mm256_andnot_ps(sign, v[i]);
    amax = _mm256_max_ps(amax, a);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, largest, _CMP_NLE_UQ));
  }
  if (_mm256_movemask_ps(bad)) {  // as QuantizeBlockScalar: outputs become NaN
    std::memset(q, 0, kBlock);
    return NAN;
  }
  const float max_abs = cpu::HorizontalMax(amax);
  const __m256 inv = _mm256_set1_ps(max_abs > 0.f ? 127.f / max_abs : 0.f);
  __m256i i32[4];
  for (int i = 0; i < 4; ++i) {
    const __m256 scaled = _mm256_round_ps(_mm256_mul_ps(v[i], inv),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    i32[i] = _mm256_cvtps_epi32(scaled);
  }
  // Packing works per 128-bit lane; the final permute restores element order.
  const __m256i i16a = _mm256_packs_epi32(i32[0], i32[1]);
  const __m256i i16b = _mm256_packs_epi32(i32[2], i32[3]);
  const __m256i i8 = _mm256_packs_epi16(i16a, i16b);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(i8, order));
  return max_abs / 127.f;
}

// One 32-value activation block against the same block of NT weight rows (stride apart):
// acc[r] += d * (8 partial int32 sums of x . w_r).
template <int NT>
AVX2_FN __attribute__((always_inline)) inline void Int8BlockAvx2(const int8_t* x, float d,
                                                                 const int8_t* w, int64 stride,
                                                                 __m256* acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  // maddubs multiplies unsigned by signed bytes: use |x| and move x's sign onto w.
  // |x|, |w| <= 127, so a pair sum is at most 2 * 127 * 127 and never saturates.
  const __m256i ax = _mm256_sign_epi8(xv, xv);
  const __m256 dv = _mm256_set1_ps(d);
  for (int r = 0; r < NT; ++r) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * stride));
    const __m256i pairs = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv, xv));
    const __m256i sums = _mm256_madd_epi16(pairs, ones);
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), dv, acc[r]);
  }
}

// NT output channels x every row of x. The NT weight rows (NT * K bytes) stay in L1 while
// all M rows sweep over them.
template <int NT>
AVX2_FN void Int8TileAvx2(const Geometry& g, const QuantizedRows& xq, const Tile& t, float* y) {
  // Locals, so the compiler keeps them in registers across the stores to y.
  const int64 K = g.K, G = g.G, group = g.group, blocks = g.blocks, tail = g.tail;
  const int64 row_blocks = g.RowBlocks();
  // Blocks of a group that need no padding: all but a last block shorter than 32.
  const int64 full = tail == kBlock ? blocks : blocks - 1;
  alignas(32) int8_t padded[NT * kBlock] = {};  // a short last block's weights, zero-padded
  for (int64 m = 0; m < g.M; ++m) {
    const int8_t* xrow = xq.q.data() + m * row_blocks * kBlock;
    const float* drow = xq.d.data() + m * row_blocks;
    __m256 total[NT];
    for (int r = 0; r < NT; ++r) total[r] = _mm256_setzero_ps();
    for (int64 grp = 0; grp < G; ++grp) {
      const int8_t* xg = xrow + grp * blocks * kBlock;
      const float* dg = drow + grp * blocks;
      const int8_t* wg = t.q + grp * group;
      __m256 acc[NT];
      for (int r = 0; r < NT; ++r) acc[r] = _mm256_setzero_ps();
      for (int64 j = 0; j < full; ++j) {
        Int8BlockAvx2<NT>(xg + j * kBlock, dg[j], wg + j * kBlock, K, acc);
      }
      if (full < blocks) {  // copy rather than read past the end of q
        for (int r = 0; r < NT; ++r) {
          std::memcpy(padded + r * kBlock, wg + full * kBlock + r * K, tail);
        }
        Int8BlockAvx2<NT>(xg + full * kBlock, dg[full], padded, kBlock, acc);
      }
      if (G == 1) {
        for (int r = 0; r < NT; ++r) total[r] = acc[r];
      } else {
        for (int r = 0; r < NT; ++r) {
          total[r] = _mm256_fmadd_ps(acc[r], _mm256_set1_ps(t.scale[r * G + grp]), total[r]);
        }
      }
    }
    // Per-channel scale (G == 1) applied once, after the sum.
    for (int r = 0; r < NT; ++r) {
      y[m * g.N + t.n0 + r] = cpu::HorizontalSum(total[r]) * (G == 1 ? t.scale[r] : 1.f);
    }
  }
}

// One 32-value activation block against the same block of one weight row, added to acc:
// acc += d * (8 partial int32 sums of x . w). ax is |x| (maddubs takes it as unsigned).
AVX2_FN __attribute__((always_inline)) inline __m256 Int8DotAvx2(const int8_t* x,
                                                                const int8_t* ax, float d,
                                                                const int8_t* w, __m256 acc) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ax));
  const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i pairs = _mm256_maddubs_epi16(av, _mm256_sign_epi8(wv, xv));
  const __m256i sums = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(d), acc);
}

// The tile's output channels one at a time, each weight row read front to back against every
// row of x, with four accumulators over consecutive blocks (so the FMA latency does not chain
// them). The weights are then one sequential stream through memory, which the hardware
// prefetcher follows at full bandwidth: sweeping four rows at once (Int8TileAvx2, four
// streams 768 bytes apart that each end after a dozen cache lines) needed software prefetch
// and still streamed ~1.3-1.5x slower on a 2-core AVX2-only EPYC (docs/performance.md).
AVX2_FN void Int8RowsAvx2(const Geometry& g, const QuantizedRows& xq, const Tile& t, float* y) {
  const int64 K = g.K, G = g.G, group = g.group, blocks = g.blocks, tail = g.tail;
  const int64 row_blocks = g.RowBlocks();
  const int64 full = tail == kBlock ? blocks : blocks - 1;
  alignas(32) int8_t padded[kBlock] = {};  // a short last block's weights, zero-padded
  for (int64 r = 0; r < t.count; ++r) {
    const int8_t* w = t.q + r * K;
    const float* scale = t.scale + r * G;
    for (int64 m = 0; m < g.M; ++m) {
      const int8_t* xrow = xq.q.data() + m * row_blocks * kBlock;
      const int8_t* arow = xq.a.data() + m * row_blocks * kBlock;
      const float* drow = xq.d.data() + m * row_blocks;
      __m256 total = _mm256_setzero_ps();
      for (int64 grp = 0; grp < G; ++grp) {
        const int64 b0 = grp * blocks;  // the group's first activation block
        const int8_t* xg = xrow + b0 * kBlock;
        const int8_t* ag = arow + b0 * kBlock;
        const float* dg = drow + b0;
        const int8_t* wg = w + grp * group;
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                         _mm256_setzero_ps()};
        int64 j = 0;
        for (; j + 4 <= full; j += 4) {
          // the two cache lines kRowPrefetch bytes ahead (past the row's end: the next
          // row's, the stream's continuation; a prefetch past q's end does not fault)
          const char* ahead = reinterpret_cast<const char*>(wg + j * kBlock) + kRowPrefetch;
          _mm_prefetch(ahead, _MM_HINT_T0);
          _mm_prefetch(ahead + 64, _MM_HINT_T0);
          const int8_t* far = wg + j * kBlock + kRowPrefetchL2;
          if (far < t.prefetch_end) {
            _mm_prefetch(reinterpret_cast<const char*>(far), _MM_HINT_T1);
            _mm_prefetch(reinterpret_cast<const char*>(far) + 64, _MM_HINT_T1);
          }
          for (int i = 0; i < 4; ++i) {
            const int64 o = (j + i) * kBlock;
            acc[i] = Int8DotAvx2(xg + o, ag + o, dg[j + i], wg + o, acc[i]);
          }
        }
        for (; j < full; ++j) {
          const int64 o = j * kBlock;
          acc[j & 3] = Int8DotAvx2(xg + o, ag + o, dg[j], wg + o, acc[j & 3]);
        }
        if (full < blocks) {  // copy rather than read past the end of q
          std::memcpy(padded, wg + full * kBlock, tail);
          const int64 o = full * kBlock;
          acc[0] = Int8DotAvx2(xg + o, ag + o, dg[full], padded, acc[0]);
        }
        const __m256 sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]),
                                         _mm256_add_ps(acc[2], acc[3]));
        total = G == 1 ? sum : _mm256_fmadd_ps(sum, _mm256_set1_ps(scale[grp]), total);
      }
      y[m * g.N + t.n0 + r] = cpu::HorizontalSum(total) * (G == 1 ? scale[0] : 1.f);
    }
  }
}

// Rows m0 .. m0 + R - 1 of x against one weight row w (output channel n), written to y. Each
// 32-byte block of w is loaded once for all R rows, and the R accumulators are independent
// chains. Measured and not kept: two weight rows at a time, sharing each block of x too (ran
// out of registers, 1.1-1.6x slower); two accumulators per row of x when R < 3, and groups
// of 3 + 2 rather than 4 + 1 (both ties or 1-10 % slower).
template <int R>
AVX2_FN __attribute__((always_inline)) inline void Int8RowGroupAvx2(
    const Geometry& g, const QuantizedRows& xq, int64 m0, const int8_t* w, const float* scale,
    int64 n, const int8_t* prefetch_end, float* y) {
  const int64 G = g.G, group = g.group, blocks = g.blocks, tail = g.tail;
  const int64 row_blocks = g.RowBlocks();
  const int64 full = tail == kBlock ? blocks : blocks - 1;
  const __m256i ones = _mm256_set1_epi16(1);
  alignas(32) int8_t padded[kBlock] = {};  // a short last block's weights, zero-padded
  const int8_t* xrow[R];
  const int8_t* arow[R];
  const float* drow[R];
  __m256 total[R];
  for (int i = 0; i < R; ++i) {
    xrow[i] = xq.q.data() + (m0 + i) * row_blocks * kBlock;
    arow[i] = xq.a.data() + (m0 + i) * row_blocks * kBlock;
    drow[i] = xq.d.data() + (m0 + i) * row_blocks;
    total[i] = _mm256_setzero_ps();
  }
  // acc[i] += d * (x_i . w) over activation block b, whose weights start at wb. Written out
  // rather than calling Int8DotAvx2 per row: that loads wb per row, and at five rows it
  // measured 1.5x slower (23.5-24.7 against 14.9-16.1 ms over GPT-2-small's matrices).
  auto block = [&](const int8_t* wb, int64 b, __m256* acc) AVX2_FN {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb));
    for (int i = 0; i < R; ++i) {
      const __m256i xv =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xrow[i] + b * kBlock));
      const __m256i av =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(arow[i] + b * kBlock));
      const __m256i pairs = _mm256_maddubs_epi16(av, _mm256_sign_epi8(wv, xv));
      const __m256i sums = _mm256_madd_epi16(pairs, ones);
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_broadcast_ss(drow[i] + b),
                               acc[i]);
    }
  };
  for (int64 grp = 0; grp < G; ++grp) {
    const int64 b0 = grp * blocks;
    const int8_t* wg = w + grp * group;
    __m256 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
    for (int64 j = 0; j < full; ++j) {
      if (!(j & 1)) {  // one cache line per two blocks, into L1 and further ahead into L2
        _mm_prefetch(reinterpret_cast<const char*>(wg + j * kBlock + kRowPrefetch), _MM_HINT_T0);
        const int8_t* far = wg + j * kBlock + kRowPrefetchL2;
        if (far < prefetch_end) _mm_prefetch(reinterpret_cast<const char*>(far), _MM_HINT_T1);
      }
      block(wg + j * kBlock, b0 + j, acc);
    }
    if (full < blocks) {  // copy rather than read past the end of q
      std::memcpy(padded, wg + full * kBlock, tail);
      block(padded, b0 + full, acc);
    }
    for (int i = 0; i < R; ++i) {
      total[i] = G == 1 ? acc[i] : _mm256_fmadd_ps(acc[i], _mm256_set1_ps(scale[grp]), total[i]);
    }
  }
  for (int i = 0; i < R; ++i) {
    y[(m0 + i) * g.N + n] = cpu::HorizontalSum(total[i]) * (G == 1 ? scale[0] : 1.f);
  }
}

// The tile's output channels one at a time, as Int8RowsAvx2 (one sequential weight stream),
// each weight row against the rows of x four at a time: the weight row's blocks are loaded
// once per four rows of x, and while the row is in L1 every group of rows sweeps it. Five
// rows go as one group (GPT-2-small's int8 matrices, alternating in one process: 20.1 ->
// 18.5 ms against 4 + 1, whose one-row pass is a single FMA chain).
AVX2_FN void Int8RowsManyAvx2(const Geometry& g, const QuantizedRows& xq, const Tile& t,
                              float* y) {
  for (int64 r = 0; r < t.count; ++r) {
    const int8_t* w = t.q + r * g.K;
    const float* scale = t.scale + r * g.G;
    const int64 n = t.n0 + r;
    int64 m = 0;
    if (g.M == 5) {  // one sequence checking four drafts: one group of five, not 4 + 1
      Int8RowGroupAvx2<5>(g, xq, 0, w, scale, n, t.prefetch_end, y);
      continue;
    }
    for (; m + 4 <= g.M; m += 4) Int8RowGroupAvx2<4>(g, xq, m, w, scale, n, t.prefetch_end, y);
    switch (g.M - m) {
      case 3: Int8RowGroupAvx2<3>(g, xq, m, w, scale, n, t.prefetch_end, y); break;
      case 2: Int8RowGroupAvx2<2>(g, xq, m, w, scale, n, t.prefetch_end, y); break;
      case 1: Int8RowGroupAvx2<1>(g, xq, m, w, scale, n, t.prefetch_end, y); break;
      default: break;
    }
  }
}

AVX2_FN void DequantizeTileAvx2(const Geometry& g, const Tile& t, float* buf) {
  for (int64 r = 0; r < t.count; ++r) {
    const int8_t* w = t.q + r * g.K;
    float* out = buf + r * g.padded;
    for (int64 grp = 0; grp < g.G; ++grp) {
      const float s = t.scale[r * g.G + grp];
      const __m256 sv = _mm256_set1_ps(s);
      const int64 begin = grp * g.group, end = begin + g.group;
      int64 k = begin;
      for (; k + 8 <= end; k += 8) {
        const __m128i w8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k));
        const __m256 wf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(w8));
        _mm256_storeu_ps(out + k, _mm256_mul_ps(wf, sv));
      }
      for (; k < end; ++k) out[k] = static_cast<float>(w[k]) * s;
    }
    for (int64 k = g.K; k < g.padded; ++k) out[k] = 0.f;
  }
}

template <int NT>
AVX2_FN void FloatTileAvx2(const Geometry& g, const float* x, const Tile& t, float* buf,
                           float* y) {
  DequantizeTileAvx2(g, t, buf);
  const int64 K = g.K, padded = g.padded, full = g.K / 8 * 8;
  // Lanes of the last, partial 8-vector of x (the buffer is zero-padded there).
  alignas(32) int32_t mask_lanes[8];
  for (int i = 0; i < 8; ++i) mask_lanes[i] = full + i < K ? -1 : 0;
  const __m256i mask = _mm256_load_si256(reinterpret_cast<const __m256i*>(mask_lanes));
  for (int64 m = 0; m < g.M; ++m) {
    const float* xrow = x + m * K;
    __m256 acc[NT];
    for (int r = 0; r < NT; ++r) acc[r] = _mm256_setzero_ps();
    for (int64 k = 0; k < full; k += 8) {
      const __m256 xv = _mm256_loadu_ps(xrow + k);
      for (int r = 0; r < NT; ++r) {
        acc[r] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(buf + r * padded + k), acc[r]);
      }
    }
    if (full < K) {
      const __m256 xv = _mm256_maskload_ps(xrow + full, mask);
      for (int r = 0; r < NT; ++r) {
        acc[r] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(buf + r * padded + full), acc[r]);
      }
    }
    for (int r = 0; r < NT; ++r) y[m * g.N + t.n0 + r] = cpu::HorizontalSum(acc[r]);
  }
}
#undef AVX2_FN

#endif  // TOKENSERVE_X86

#ifdef TOKENSERVE_VNNI
// AVX512-VNNI path of the int8 kernel. Functions carry their own target, as above.
#define VNNI_FN __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")))

// One 32-value block against the same block of NT weight rows (the odd block of a group):
// acc[r] += d * (8 int32 partial sums), in 256-bit registers.
template <int NT>
VNNI_FN __attribute__((always_inline)) inline void Int8BlockVnni256(
    const int8_t* x, float d, const int8_t* w, int64 stride, __m256* acc) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i ax = _mm256_abs_epi8(xv);
  const __m256 dv = _mm256_set1_ps(d);
  for (int r = 0; r < NT; ++r) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * stride));
    const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ax,
                                            _mm256_sign_epi8(wv, xv));
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), dv, acc[r]);
  }
}

// Two adjacent 32-value blocks (64 bytes) against the same blocks of NT weight rows:
// lanes 0-7 hold block j's partial sums and 8-15 block j + 1's, scaled by d0 and d1.
template <int NT>
VNNI_FN __attribute__((always_inline)) inline void Int8PairVnni(
    const int8_t* x, float d0, float d1, const int8_t* w, int64 stride, __m512* acc) {
  const __m512i xv = _mm512_loadu_si512(x);
  const __m512i ax = _mm512_abs_epi8(xv);
  const __mmask64 negative = _mm512_movepi8_mask(xv);  // x < 0: move its sign onto w
  const __m512 dv = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d0), _mm512_set1_ps(d1));
  const __m512i zero = _mm512_setzero_si512();
  for (int r = 0; r < NT; ++r) {
    const __m512i wv = _mm512_loadu_si512(w + r * stride);
    const __m512i sw = _mm512_mask_sub_epi8(wv, negative, zero, wv);
    const __m512i dot = _mm512_dpbusd_epi32(zero, ax, sw);
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), dv, acc[r]);
  }
}

// As Int8TileAvx2, two blocks per step.
template <int NT>
VNNI_FN void Int8TileVnni(const Geometry& g, const QuantizedRows& xq, const Tile& t, float* y) {
  const int64 K = g.K, G = g.G, group = g.group, blocks = g.blocks, tail = g.tail;
  const int64 row_blocks = g.RowBlocks();
  const int64 full = tail == kBlock ? blocks : blocks - 1;
  const int64 pairs = full / 2;
  alignas(32) int8_t padded[NT * kBlock] = {};
  for (int64 m = 0; m < g.M; ++m) {
    const int8_t* xrow = xq.q.data() + m * row_blocks * kBlock;
    const float* drow = xq.d.data() + m * row_blocks;
    __m512 total[NT];
    for (int r = 0; r < NT; ++r) total[r] = _mm512_setzero_ps();
    for (int64 grp = 0; grp < G; ++grp) {
      const int8_t* xg = xrow + grp * blocks * kBlock;
      const float* dg = drow + grp * blocks;
      const int8_t* wg = t.q + grp * group;
      __m512 acc[NT];
      __m256 odd[NT];
      for (int r = 0; r < NT; ++r) {
        acc[r] = _mm512_setzero_ps();
        odd[r] = _mm256_setzero_ps();
      }
      for (int64 p = 0; p < pairs; ++p) {
        const int64 j = 2 * p;
        Int8PairVnni<NT>(xg + j * kBlock, dg[j], dg[j + 1], wg + j * kBlock, K, acc);
      }
      if (full % 2) {
        const int64 j = full - 1;
        Int8BlockVnni256<NT>(xg + j * kBlock, dg[j], wg + j * kBlock, K, odd);
      }
      if (full < blocks) {  // copy rather than read past the end of q
        for (int r = 0; r < NT; ++r) {
          std::memcpy(padded + r * kBlock, wg + full * kBlock + r * K, tail);
        }
        Int8BlockVnni256<NT>(xg + full * kBlock, dg[full], padded, kBlock, odd);
      }
      for (int r = 0; r < NT; ++r) {
        const __m512 sum = _mm512_add_ps(acc[r], _mm512_zextps256_ps512(odd[r]));
        total[r] = G == 1 ? sum
                          : _mm512_fmadd_ps(sum, _mm512_set1_ps(t.scale[r * G + grp]), total[r]);
      }
    }
    for (int r = 0; r < NT; ++r) {
      y[m * g.N + t.n0 + r] = _mm512_reduce_add_ps(total[r]) * (G == 1 ? t.scale[r] : 1.f);
    }
  }
}
#undef VNNI_FN
#endif  // TOKENSERVE_VNNI

bool CpuHasAvx512Vnni() {
#ifdef TOKENSERVE_VNNI
  static const bool has = cpu::HasAvx2Fma() && __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512vnni");
  return has;
#else
  return false;
#endif
}

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
#ifdef TOKENSERVE_X86
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
#ifdef TOKENSERVE_X86
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
#ifdef TOKENSERVE_X86
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
#ifdef TOKENSERVE_X86
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

}  // namespace

REGISTER_OP("TokenserveInt8Matmul")
    .Input("x: float")       // [M, K]
    .Input("q: int8")        // [N, K], values in [-127, 127]
    .Input("scale: float")   // [N, G], G divides K
    .Output("y: float")      // [M, N]
    .Attr("activations: {'int8', 'float'} = 'int8'")
    .Attr("isa: {'auto', 'avx2', 'scalar'} = 'auto'")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle x, q, scale;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &x));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &q));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 2, &scale));
      DimensionHandle k, n;
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(x, 1), c->Dim(q, 1), &k));
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(q, 0), c->Dim(scale, 0), &n));
      c->set_output(0, c->Matrix(c->Dim(x, 0), n));
      return absl::OkStatus();
    })
    .Doc("y = x @ (q * scale expanded over K / G columns per group).T; int8 weights.");

REGISTER_OP("TokenserveInt8FinishBlock")
    .Input("attn: float")        // [M, Da] attention output
    .Input("x: float")           // [M, D] the residual stream
    .Input("out_q: int8")        // [D, Da]
    .Input("out_scale: float")   // [D, G]
    .Input("out_bias: float")    // [D] or [0]
    .Input("norm_scale: float")  // [D]
    .Input("norm_bias: float")   // [D] (LayerNorm) or [0] (RMSNorm)
    .Input("up_q: int8")         // [F, D]
    .Input("up_scale: float")    // [F, G]
    .Input("up_bias: float")     // [F] or [0]
    .Input("down_q: int8")       // [D, F] (F / 2 for swiglu)
    .Input("down_scale: float")  // [D, G]
    .Input("down_bias: float")   // [D] or [0]
    // the next block's first half, optional (all empty: none): its norm and QKV projection
    .Input("next_norm_scale: float")  // [D] or [0]
    .Input("next_norm_bias: float")   // [D] (LayerNorm), or [0] (RMSNorm, or no next)
    .Input("next_q: int8")            // [Nq, D] or [0, 0]
    .Input("next_scale: float")       // [Nq, G] or [0, 0]
    .Input("next_bias: float")        // [Nq] or [0]
    .Output("y: float")          // [M, D]
    .Output("next: float")       // [M, Nq], or [M, 0] without a next block
    .Attr("activation: {'gelu_tanh', 'swiglu'} = 'gelu_tanh'")
    .Attr("eps: float = 1e-5")
    .Attr("isa: {'auto', 'avx2', 'scalar'} = 'auto'")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle x, next_q;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &x));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(15), 2, &next_q));
      c->set_output(0, x);
      c->set_output(1, c->Matrix(c->Dim(x, 0), c->Dim(next_q, 0)));
      return absl::OkStatus();
    })
    .Doc("x1 = attn @ dequant(out).T + out_bias + x; "
         "y = dequant(down) applied to act(norm(x1) @ dequant(up).T + up_bias), + down_bias + x1; "
         "next = next_norm(y) @ dequant(next_q).T + next_bias.");

REGISTER_OP("TokenserveInt8MatmulInfo")
    .Output("info: string")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Scalar());
      return absl::OkStatus();
    })
    .Doc("Which instruction set the TokenserveInt8Matmul kernel uses on this CPU.");

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

class Int8MatmulOp : public OpKernel {
 public:
  explicit Int8MatmulOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string isa;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("activations", &activations_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("isa", &isa));
    isa_ = ChooseIsa(isa);
    avx2_ = isa_ != Isa::kScalar;  // quantizing x and the float kernel: AVX2 at most
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    OP_REQUIRES(ctx, x.dims() == 2,
                InvalidArgument("x must be [M, K], got shape ", x.shape().DebugString()));
    Geometry g;
    if (!CheckInt8Args(ctx, "matmul", x.dim_size(0), x.dim_size(1), ctx->input(1), ctx->input(2),
                       &g)) {
      return;
    }
    Tensor* y_tensor = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({g.M, g.N}), &y_tensor));
    float* y = y_tensor->flat<float>().data();
    if (g.M == 0 || g.N == 0) return;
    if (g.K == 0) {  // empty sum
      std::fill(y, y + g.M * g.N, 0.f);
      return;
    }
    Int8MatmulRows(ctx->device()->tensorflow_cpu_worker_threads()->workers, g,
                   x.flat<float>().data(), ctx->input(1).flat<int8_t>().data(),
                   ctx->input(2).flat<float>().data(), activations_ == "int8", isa_, avx2_, y);
  }

 private:
  std::string activations_;
  Isa isa_ = Isa::kScalar;
  bool avx2_ = false;
};

// The second half of a transformer block with int8 weights, in one op:
//   x1 = attn @ out.T + out_bias + x
//   y  = down(act(norm(x1) @ up.T + up_bias)) + down_bias + x1
// the same arithmetic as TokenserveInt8Matmul followed by dense.cc's TokenserveEpilogue and
// TokenserveNorm (rowops.h), so the result is the separate ops' bit for bit. Why: at batch 1
// the three matrices then stream back to back. Between separate ops a decode step spends
// 30-100 us on other work, and after such a pause the weights' stream restarts slowly (on a
// 2-core VM, two threads read GPT-2-small's block matrices at 26-32 GB/s back to back and at
// 10-15 with 100 us between them; docs/performance.md), and the step runs six fewer ops a
// layer. With next_q given, the next block's norm and QKV projection follow in the same op
//   next = next_norm(y) @ next_q.T + next_bias
// (again the separate ops' arithmetic): four matrices back to back, three ops fewer.
class Int8FinishBlockOp : public OpKernel {
 public:
  explicit Int8FinishBlockOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string isa, activation;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("activation", &activation));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("eps", &eps_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("isa", &isa));
    act_ = activation == "swiglu" ? rowops::Activation::kSwiglu : rowops::Activation::kGeluTanh;
    isa_ = ChooseIsa(isa);
    avx2_ = isa_ != Isa::kScalar;
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& attn = ctx->input(0);
    const Tensor& x = ctx->input(1);
    OP_REQUIRES(ctx, attn.dims() == 2,
                InvalidArgument("attn must be [M, Da], got ", attn.shape().DebugString()));
    Geometry out, up, down;
    if (!CheckInt8Args(ctx, "out", attn.dim_size(0), attn.dim_size(1), ctx->input(2),
                       ctx->input(3), &out)) {
      return;
    }
    OP_REQUIRES(ctx, x.dims() == 2 && x.dim_size(0) == out.M && x.dim_size(1) == out.N,
                InvalidArgument("x must be [M, D] = [", out.M, ", ", out.N, "], got ",
                                x.shape().DebugString()));
    const int64 m = out.M, d = out.N;
    const Tensor& out_bias = ctx->input(4);
    const Tensor& norm_scale = ctx->input(5);
    const Tensor& norm_bias = ctx->input(6);
    OP_REQUIRES(ctx, IsVectorOrEmpty(out_bias, d),
                InvalidArgument("out_bias must be [", d, "] or empty, got ",
                                out_bias.shape().DebugString()));
    OP_REQUIRES(ctx, norm_scale.dims() == 1 && norm_scale.dim_size(0) == d,
                InvalidArgument("norm_scale must be [", d, "], got ",
                                norm_scale.shape().DebugString()));
    OP_REQUIRES(ctx, IsVectorOrEmpty(norm_bias, d),
                InvalidArgument("norm_bias must be [", d, "] or empty (RMSNorm), got ",
                                norm_bias.shape().DebugString()));
    if (!CheckInt8Args(ctx, "up", m, d, ctx->input(7), ctx->input(8), &up)) return;
    const Tensor& up_bias = ctx->input(9);
    OP_REQUIRES(ctx, IsVectorOrEmpty(up_bias, up.N),
                InvalidArgument("up_bias must be [", up.N, "] or empty, got ",
                                up_bias.shape().DebugString()));
    const bool swiglu = act_ == rowops::Activation::kSwiglu;
    OP_REQUIRES(ctx, !swiglu || up.N % 2 == 0,
                InvalidArgument("swiglu needs an even up width, got ", up.N));
    const int64 inner = swiglu ? up.N / 2 : up.N;
    if (!CheckInt8Args(ctx, "down", m, inner, ctx->input(10), ctx->input(11), &down)) return;
    OP_REQUIRES(ctx, down.N == d,
                InvalidArgument("down must have D = ", d, " rows, got ",
                                ctx->input(10).shape().DebugString()));
    const Tensor& down_bias = ctx->input(12);
    OP_REQUIRES(ctx, IsVectorOrEmpty(down_bias, d),
                InvalidArgument("down_bias must be [", d, "] or empty, got ",
                                down_bias.shape().DebugString()));
    // the next block's norm and QKV: all given, or all empty
    const Tensor& next_norm_scale = ctx->input(13);
    const Tensor& next_norm_bias = ctx->input(14);
    const Tensor& next_bias = ctx->input(17);
    const bool has_next = ctx->input(15).NumElements() > 0;
    Geometry next{};
    if (!CheckNextNorm(ctx, has_next, "next_q", d, next_norm_scale, next_norm_bias, next_bias)) {
      return;
    }
    if (has_next) {
      if (!CheckInt8Args(ctx, "next", m, d, ctx->input(15), ctx->input(16), &next)) return;
      OP_REQUIRES(ctx, IsVectorOrEmpty(next_bias, next.N),
                  InvalidArgument("next_bias must be [", next.N, "] or empty, got ",
                                  next_bias.shape().DebugString()));
    }
    Tensor* y_tensor = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({m, d}), &y_tensor));
    Tensor* next_tensor = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({m, has_next ? next.N : 0}),
                                             &next_tensor));
    if (m == 0 || d == 0) return;
    OP_REQUIRES(ctx, out.K > 0 && up.N > 0 && inner > 0,
                InvalidArgument("out's K and up's width must be positive"));

    auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    const bool int8 = true;
    float* y = y_tensor->flat<float>().data();
    const float* xp = x.flat<float>().data();
    std::vector<float> z(m * std::max(d, up.N)), x1(m * d), h(m * d), u(m * inner);
    // x1 = attn @ out.T + out_bias + x
    Int8MatmulRows(pool, out, attn.flat<float>().data(), ctx->input(2).flat<int8_t>().data(),
                   ctx->input(3).flat<float>().data(), int8, isa_, avx2_, z.data());
    rowops::FinishRows(avx2_, m, d, d, rowops::Activation::kNone, z.data(), Data(out_bias), xp,
                       x1.data());
    // h = norm(x1)
    for (int64 r = 0; r < m; ++r) {
      rowops::NormRow(avx2_, d, x1.data() + r * d, norm_scale.flat<float>().data(),
                      Data(norm_bias), eps_, h.data() + r * d);
    }
    // u = act(h @ up.T + up_bias)
    Int8MatmulRows(pool, up, h.data(), ctx->input(7).flat<int8_t>().data(),
                   ctx->input(8).flat<float>().data(), int8, isa_, avx2_, z.data());
    rowops::FinishRows(avx2_, m, up.N, inner, act_, z.data(), Data(up_bias), nullptr, u.data());
    // y = u @ down.T + down_bias + x1
    Int8MatmulRows(pool, down, u.data(), ctx->input(10).flat<int8_t>().data(),
                   ctx->input(11).flat<float>().data(), int8, isa_, avx2_, z.data());
    rowops::FinishRows(avx2_, m, d, d, rowops::Activation::kNone, z.data(), Data(down_bias),
                       x1.data(), y);
    if (has_next) {  // next = next_norm(y) @ next_q.T + next_bias, into h as the norm's rows
      for (int64 r = 0; r < m; ++r) {
        rowops::NormRow(avx2_, d, y + r * d, next_norm_scale.flat<float>().data(),
                        Data(next_norm_bias), eps_, h.data() + r * d);
      }
      z.resize(m * next.N);
      Int8MatmulRows(pool, next, h.data(), ctx->input(15).flat<int8_t>().data(),
                     ctx->input(16).flat<float>().data(), int8, isa_, avx2_, z.data());
      rowops::FinishRows(avx2_, m, next.N, next.N, rowops::Activation::kNone, z.data(),
                         Data(next_bias), nullptr, next_tensor->flat<float>().data());
    }
  }

 private:

  rowops::Activation act_ = rowops::Activation::kGeluTanh;
  float eps_ = 1e-5f;
  Isa isa_ = Isa::kScalar;
  bool avx2_ = false;
};

class Int8MatmulInfoOp : public OpKernel {
 public:
  explicit Int8MatmulInfoOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  void Compute(OpKernelContext* ctx) override {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<tensorflow::tstring>()() = IsaName(ChooseIsa("auto"));
  }
};

REGISTER_KERNEL_BUILDER(Name("TokenserveInt8Matmul").Device(tensorflow::DEVICE_CPU),
                        Int8MatmulOp);
REGISTER_KERNEL_BUILDER(Name("TokenserveInt8MatmulInfo").Device(tensorflow::DEVICE_CPU),
                        Int8MatmulInfoOp);
REGISTER_KERNEL_BUILDER(Name("TokenserveInt8FinishBlock").Device(tensorflow::DEVICE_CPU),
                        Int8FinishBlockOp);

}  // namespace tokenserve
