// The tile kernel of the GGUF-block matmul (gguf_matmul.cc), for many rows of x: a prefill
// chunk, or a decode step of many streams. Output rows [n0, n0 + 8) of y = x @ dequant(w).T.
//
// Eight weight rows are decoded once per call into a per-thread buffer (it stays in L1 for a
// few thousand K) and interleaved as llama.cpp's load-time repacking does (repack.cpp's
// 8-row layouts), except that here it happens per call, on the tile in use, and nothing is
// stored (Q4_0, Q4_1 and Q5_0 projections are repacked at load into the packed form of the
// same vectors, and gguf_packed.h reads those; this kernel serves Q8_0 and rows left plain): block b's 8 x 32 values become 8 vectors, vector j holding values 4j..4j+3 of row r
// in its int32 lane r. Against x's values 4j..4j+3 broadcast to every lane, one maddubs+madd
// (or dpbusd) then adds each row's products to its own lane, so after an activation group's
// vectors lane r holds row r's dot product with that group: one int-to-float conversion and
// one FMA with the eight rows' scales (a vector) times the group's finish it for all eight
// rows, and the offsets' term is one more FMA a block. No horizontal sums: a row of x ends as
// one 8-float store.
//
// Per block and row of x that is about 30 instructions for 256 multiply-adds, plus a madd,
// conversion and FMA for each of the activations' four 8-value groups but the last, where
// the row kernel (gguf_kernels.h) spends about 7 for 32 plus the block's decode.
#ifndef TOKENSERVE_KERNELS_GGUF_TILES_H_
#define TOKENSERVE_KERNELS_GGUF_TILES_H_

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu.h"
#include "gguf_blocks.h"
#include "gguf_kernels.h"

namespace tokenserve {
namespace gguf {

#ifdef TOKENSERVE_CPU_X86

constexpr int kTileRows = 8;  // weight rows a tile: one per float lane of a 256-bit vector

// One tile's rows decoded and interleaved, one buffer per thread, reused from tile to tile.
// Block b: the unsigned operands at u[(b * 8 + j) * 32] (vector j as above), for Q8_0 the
// values themselves at w[...] (their signs go onto x), and the rows' scales and offsets at
// d[b * 8 + r], c[b * 8 + r].
struct TileBuffer {
  std::vector<uint8_t> u;
  std::vector<int8_t> w;
  std::vector<float> d, c;
};

// v[r] holds eight int32 units of row r; afterwards v[j] holds unit j of every row, row r in
// lane r. The usual 8x8 float transpose, on the bits.
TOKENSERVE_GGUF_SIMD inline void Transpose8x8(__m256i v[8]) {
  __m256 r[8], t[8], s[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_castsi256_ps(v[i]);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    s[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_castps_si256(_mm256_permute2f128_ps(s[i], s[i + 4], 0x20));
    v[i + 4] = _mm256_castps_si256(_mm256_permute2f128_ps(s[i], s[i + 4], 0x31));
  }
}

// The eight rows at `rows` (row_bytes apart) into t.
template <class Type>
TOKENSERVE_GGUF_SIMD void DecodeTile(const uint8_t* rows, int64 row_bytes, int64 blocks,
                                     TileBuffer* t) {
  t->u.resize(blocks * kTileRows * kBlock);
  if (Type::kSigned) t->w.resize(blocks * kTileRows * kBlock);
  t->d.resize(blocks * kTileRows);
  t->c.resize(blocks * kTileRows);
  for (int64 b = 0; b < blocks; ++b) {
    __m256i u[kTileRows], w[kTileRows];
    for (int r = 0; r < kTileRows; ++r) {
      const uint8_t* block = rows + r * row_bytes + b * Type::kBytes;
      w[r] = LoadValues<Type>(block);
      u[r] = Unsigned<Type>(w[r]);
      t->d[b * kTileRows + r] = ScaleF16c(block);
      t->c[b * kTileRows + r] = LoadOffset<Type>(block, t->d[b * kTileRows + r]);
    }
    Transpose8x8(u);
    auto* ub = reinterpret_cast<__m256i*>(t->u.data() + b * kTileRows * kBlock);
    for (int j = 0; j < kTileRows; ++j) _mm256_storeu_si256(ub + j, u[j]);
    if constexpr (Type::kSigned) {
      Transpose8x8(w);
      auto* wb = reinterpret_cast<__m256i*>(t->w.data() + b * kTileRows * kBlock);
      for (int j = 0; j < kTileRows; ++j) _mm256_storeu_si256(wb + j, w[j]);
    }
  }
}

// Values 4j..4j+3 of an activation block in every int32 lane.
TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) inline __m256i Broadcast4(const int8_t* x) {
  int32_t four;
  std::memcpy(&four, x, sizeof(four));
  return _mm256_set1_epi32(four);
}

// The tile's eight dot products with values [4 j0, 4 j1) of one activation block x (32
// int8): lane r is row r's. u, w: the block's interleaved vectors in the tile buffer.
template <class Type, class Dot>
TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) inline __m256i TileDot(const uint8_t* u,
                                                                          const int8_t* w,
                                                                          const int8_t* x,
                                                                          int j0, int j1) {
  auto load = [](const void* p) TOKENSERVE_GGUF_SIMD {
    return _mm256_loadu_si256(static_cast<const __m256i*>(p));
  };
  if constexpr (Type::kMaxValue <= 15 && std::is_same_v<Dot, MaddAvx2>) {
    // 4-bit values: a maddubs pair is at most 2 * 15 * 127 = 3810, so a block's eight add up
    // in int16 (at most 30480) before one madd. (Not so for 5-bit values.)
    __m256i pairs = _mm256_setzero_si256();
    for (int j = j0; j < j1; ++j) {
      pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(load(u + j * kBlock),
                                                           Broadcast4(x + 4 * j)));
    }
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
  } else {
    __m256i dot = _mm256_setzero_si256();
    for (int j = j0; j < j1; ++j) {
      const __m256i xj = Broadcast4(x + 4 * j);
      dot = Dot::Accumulate(dot, load(u + j * kBlock), Signed<Type>(xj, load(w + j * kBlock)));
    }
    return dot;
  }
}

// Rows m0 .. m0 + R - 1 of x against the tile; y points at output row n0 of row 0 of x.
template <class Type, class Dot, int R>
TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) inline void TileRows(
    const Q8Rows& xq, int64 m0, const TileBuffer& t, float* y, int64 ldy) {
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64 b = 0; b < xq.blocks; ++b) {
    const uint8_t* u = t.u.data() + b * kTileRows * kBlock;
    const int8_t* w = Type::kSigned ? t.w.data() + b * kTileRows * kBlock : nullptr;
    const __m256 d = _mm256_loadu_ps(t.d.data() + b * kTileRows);
    for (int i = 0; i < R; ++i) {
      const int64 at = xq.Index(m0 + i, b);
      for (int g = 0; g < kGroups; ++g) {  // each group's products, then its scale
        constexpr int kVectors = kGroup / 4;  // tile vectors a group: four values each
        const __m256i dot = TileDot<Type, Dot>(u, w, xq.q.data() + at * kBlock, g * kVectors,
                                               (g + 1) * kVectors);
        const float dx = xq.GroupScale(at, g);
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_set1_ps(dx)),
                                 acc[i]);
      }
      if constexpr (Type::kHasOffset) {
        acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(t.c.data() + b * kTileRows),
                                 _mm256_broadcast_ss(&xq.s[at]), acc[i]);
      }
    }
  }
  for (int i = 0; i < R; ++i) _mm256_storeu_ps(y + (m0 + i) * ldy, acc[i]);
}

// Output rows [n0, n0 + 8) for every row of x, two rows of x at a time (two independent
// chains of FMAs, and each tile vector loaded once for both).
template <class Type, class Dot>
TOKENSERVE_GGUF_SIMD void TileSimd(const Q8Rows& xq, int64 M, const uint8_t* w, int64 row_bytes,
                                   int64 n0, TileBuffer* t, Output out) {
  DecodeTile<Type>(w + n0 * row_bytes, row_bytes, xq.blocks, t);
  float* y = out.y + n0;
  int64 m = 0;
  for (; m + 2 <= M; m += 2) TileRows<Type, Dot, 2>(xq, m, *t, y, out.ldy);
  if (m < M) TileRows<Type, Dot, 1>(xq, m, *t, y, out.ldy);
}

#endif  // TOKENSERVE_CPU_X86

}  // namespace gguf
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_GGUF_TILES_H_
