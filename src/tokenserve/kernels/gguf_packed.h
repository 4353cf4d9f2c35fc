// The GGUF-block matmul's kernel for weights repacked at load into 8-row tiles ("q4_0x8",
// "q4_1x8", "q5_0x8"; model/gguf_packing.py writes them, nothing is stored that way): the
// layout the tile kernel (gguf_tiles.h) builds per call in a decoded buffer, kept packed, so
// that a decode step of one or two rows of x gets the tile kernel's shared work without
// paying its decode. Prefill chunks take the same kernel.
//
// Why: the row kernel (gguf_kernels.h) takes one weight row at a time, and a 4- or 5-bit
// block costs it about twenty instructions for 32 multiply-adds: the nibbles' unpacking, the
// scale's conversion, a dot product, the activations' scales and an FMA. On a 2-core EPYC
// that read SmolLM2's and Gemma 3's Q4_1/Q5_0 layers at 7-7.5 GB/s a thread, about a third
// of the memory's rate. Eight rows side by side share each block's activation loads, scale
// conversions and FMAs, and their dot products land in one vector's lanes (lane r: row r),
// so a row of x ends as one 8-float store and no horizontal sums. llama.cpp repacks Q4_0
// the same way at load on AVX2 (its q4_0 8x8 layout). One thread, one row of x, on a Xeon
// with AVX-512: 2.5x the row kernel's rate where the weights stay in L2, 1.3x from L3 (about
// the one thread's read rate there; docs/gguf.md).
//
// A tile's block b (8 rows' block b, 8 x the type's bytes, in the same place the rows' own
// blocks b took, so a tile is still 8 x row_bytes and the tensor's shape does not change):
//   d        8 fp16 scales, row r's at byte 2r
//   m        Q4_1 only: 8 fp16 offsets
//   qh       Q5_0 only: 8 uint32, vector v's: bit 4r + k is row r's value 4v + k's fifth bit
//   nibbles  4 chunks of 32 bytes: chunk j holds row r's nibble bytes 4j .. 4j + 3 at 4r
// A row's nibble byte i holds value i (low half) and i + 16 (high half), so chunk j's low
// halves are vector j (values 4j .. 4j + 3 of each row, row r in int32 lane r) and its high
// halves vector j + 4: the tile kernel's vectors, with one AND and one shift each.
//
// The arithmetic per row of x is the tile kernel's: each 8-value activation group's int32
// dot product, converted, times the rows' scales times the group's, then Q4_1's offsets'
// term; Q4_0's and Q5_0's offsets are taken in the integers, as the row kernel takes them
// (the group's o * sum of q, made with the activations). Even and odd groups feed two FMA
// chains. It does not depend on how many rows of x a call has, so a row's outputs keep
// their bits alone or in a batch.
#ifndef TOKENSERVE_KERNELS_GGUF_PACKED_H_
#define TOKENSERVE_KERNELS_GGUF_PACKED_H_

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu.h"
#include "gguf_blocks.h"
#include "gguf_kernels.h"
#include "gguf_tiles.h"

namespace tokenserve {
namespace gguf {

constexpr int kPackRows = 8;  // weight rows a packed tile

// Where a packed tile-block's fields start.
template <class Type>
struct Packed {
  static constexpr int kOffsets = 16;                                     // Q4_1's m
  static constexpr int kHigh = std::is_same_v<Type, Q4_1> ? 32 : 16;     // Q5_0's qh
  static constexpr int kNibbles = kHigh + (Type::kHighBits > 0 ? 32 : 0);
  static constexpr int kBytes = kPackRows * Type::kBytes;
  static_assert(kNibbles + 128 == kBytes, "a packed block is eight of the type's");
};

// ---- scalar ---------------------------------------------------------------------------------
// Row r of a packed tile-block as the type's own block (what the scalar path and the tests
// read): the layout above, undone.
template <class Type>
void UnpackBlock(const uint8_t* packed, int r, uint8_t* block) {
  std::memcpy(block, packed + 2 * r, 2);
  if constexpr (std::is_same_v<Type, Q4_1>) {
    std::memcpy(block + 2, packed + Packed<Type>::kOffsets + 2 * r, 2);
  }
  if constexpr (Type::kHighBits > 0) {
    uint32_t high = 0;
    for (int v = 0; v < 8; ++v) {
      uint32_t bits;
      std::memcpy(&bits, packed + Packed<Type>::kHigh + 4 * v, sizeof(bits));
      high |= ((bits >> (4 * r)) & 0xfu) << (4 * v);
    }
    std::memcpy(block + Type::kHighBits, &high, sizeof(high));
  }
  for (int j = 0; j < 4; ++j) {
    std::memcpy(block + Type::kNibbles + 4 * j, packed + Packed<Type>::kNibbles + 32 * j + 4 * r,
                4);
  }
}

// Output rows [n0, n0 + count) (n0 and count multiples of 8) from packed tiles, each tile's
// rows unpacked to the type's own blocks and run through the scalar row kernel.
template <class Type>
void PackedRowsScalar(const Q8Rows& xq, int64 M, const uint8_t* w, int64 row_bytes, int64 n0,
                      int64 count, Output out) {
  std::vector<uint8_t> rows(kPackRows * row_bytes);
  for (int64 t = n0; t < n0 + count; t += kPackRows) {
    const uint8_t* tile = w + t * row_bytes;
    for (int64 b = 0; b < xq.blocks; ++b) {
      for (int r = 0; r < kPackRows; ++r) {
        UnpackBlock<Type>(tile + b * Packed<Type>::kBytes, r,
                          rows.data() + r * row_bytes + b * Type::kBytes);
      }
    }
    RowsScalar<Type>(xq, M, rows.data(), row_bytes, 0, kPackRows, Output{out.y + t, out.ldy});
  }
}

#ifdef TOKENSERVE_CPU_X86
// ---- SIMD -------------------------------------------------------------------------------------

// The eight vectors of a packed tile-block (vector v: values 4v .. 4v + 3 of row r in lane r).
template <class Type>
TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) inline void UnpackVectors(
    const uint8_t* packed, __m256i u[8]) {
  const __m256i low = _mm256_set1_epi8(0x0f);
  for (int j = 0; j < 4; ++j) {
    const __m256i raw = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(packed + Packed<Type>::kNibbles + 32 * j));
    u[j] = _mm256_and_si256(raw, low);
    u[j + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
  }
  if constexpr (Type::kHighBits > 0) {  // vector v's uint32: bit i is byte i's fifth bit
    for (int v = 0; v < 8; ++v) {
      u[v] = _mm256_or_si256(u[v], FifthBits(packed + Packed<Type>::kHigh + 4 * v));
    }
  }
}

// Activation group g's int32 dot products with the tile's rows: lane r is row r's.
template <class Type, class Dot>
TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) inline __m256i GroupDot(const __m256i u[8],
                                                                            const int8_t* x,
                                                                            int g) {
  const __m256i x0 = Broadcast4(x + 8 * g), x1 = Broadcast4(x + 8 * g + 4);
  if constexpr (Type::kMaxValue <= 15 && std::is_same_v<Dot, MaddAvx2>) {
    // 4-bit values: two maddubs pairs add up in int16 (at most 4 * 15 * 127), then one madd
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u[2 * g], x0),
                                           _mm256_maddubs_epi16(u[2 * g + 1], x1));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
  } else {
    return Dot::Accumulate(Dot::Dot(u[2 * g], x0), u[2 * g + 1], x1);
  }
}

// Block b of a tile against rows m0 .. m0 + R - 1 of x, into even and odd (per row of x).
// unpacked: the block's eight vectors already unpacked (UnpackTile), or null to unpack them
// here from the packed bytes.
template <class Type, class Dot, int R>
TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) inline void PackedBlockStep(
    const Q8Rows& xq, int64 m0, const uint8_t* packed, const __m256i* unpacked, int64 b,
    __m256* even, __m256* odd) {
  __m256i u[8];
  if (unpacked == nullptr) {
    _mm_prefetch(reinterpret_cast<const char*>(packed) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(packed) + kPrefetchBytes + 64, _MM_HINT_T0);
    UnpackVectors<Type>(packed, u);
  } else {
    for (int v = 0; v < 8; ++v) u[v] = _mm256_loadu_si256(unpacked + v);
  }
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(packed)));
  __m256 m;  // Q4_1's offsets
  if constexpr (std::is_same_v<Type, Q4_1>) {
    m = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + Packed<Type>::kOffsets)));
  }
  for (int i = 0; i < R; ++i) {
    const int64 at = xq.Index(m0 + i, b);
    const int8_t* x = xq.q.data() + at * kBlock;
    for (int g = 0; g < kGroups; ++g) {
      __m256i dot = GroupDot<Type, Dot>(u, x, g);
      // Q4_0's and Q5_0's v - o, exactly, in the integers: (v - o) . q = v . q - o * sum(q)
      if constexpr (Type::kIntOffset > 0) {
        dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(xq.GroupSums(at)[g]));
      }
      const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(xq.GroupScale(at, g)));
      __m256& acc = (g % 2 == 0) ? even[i] : odd[i];
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc);
    }
    if constexpr (std::is_same_v<Type, Q4_1>) {
      odd[i] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(&xq.s[at]), odd[i]);
    }
  }
}

template <class Type, class Dot, int R>
TOKENSERVE_GGUF_SIMD __attribute__((always_inline)) inline void PackedTileRows(
    const Q8Rows& xq, int64 m0, const uint8_t* tile, const __m256i* unpacked, float* y,
    int64 ldy) {
  __m256 even[R], odd[R];
  for (int i = 0; i < R; ++i) even[i] = odd[i] = _mm256_setzero_ps();
  for (int64 b = 0; b < xq.blocks; ++b) {
    PackedBlockStep<Type, Dot, R>(xq, m0, tile + b * Packed<Type>::kBytes,
                                  unpacked == nullptr ? nullptr : unpacked + b * 8, b, even,
                                  odd);
  }
  for (int i = 0; i < R; ++i) _mm256_storeu_ps(y + (m0 + i) * ldy, _mm256_add_ps(even[i], odd[i]));
}

// Every block's eight vectors of a tile, into `unpacked` (blocks x 8).
template <class Type>
TOKENSERVE_GGUF_SIMD void UnpackTile(const uint8_t* tile, int64 blocks, __m256i* unpacked) {
  for (int64 b = 0; b < blocks; ++b) {
    __m256i u[8];
    UnpackVectors<Type>(tile + b * Packed<Type>::kBytes, u);
    for (int v = 0; v < 8; ++v) _mm256_storeu_si256(unpacked + b * 8 + v, u[v]);
  }
}

// Output rows [n0, n0 + count) (multiples of 8): each tile against every row of x, up to
// four rows of x a pass over the tile. With more than four rows of x (a prefill chunk, many
// streams) each tile is unpacked once into a buffer that every pass reads (it stays in L1
// for a few thousand K): Q5_0's fifth bits cost more to place than a pass's dot products.
// The vectors are the same either way, and so are the outputs' bits.
template <class Type, class Dot>
TOKENSERVE_GGUF_SIMD void PackedRowsSimd(const Q8Rows& xq, int64 M, const uint8_t* w,
                                         int64 row_bytes, int64 n0, int64 count, Output out) {
  std::vector<uint8_t> buffer(M > 4 ? xq.blocks * 8 * sizeof(__m256i) : 0);
  __m256i* unpacked = M > 4 ? reinterpret_cast<__m256i*>(buffer.data()) : nullptr;
  for (int64 t = n0; t < n0 + count; t += kPackRows) {
    const uint8_t* tile = w + t * row_bytes;
    if (M > 4) UnpackTile<Type>(tile, xq.blocks, unpacked);
    float* y = out.y + t;
    int64 m = 0;
    for (; m + 4 <= M; m += 4) PackedTileRows<Type, Dot, 4>(xq, m, tile, unpacked, y, out.ldy);
    switch (M - m) {
      case 3: PackedTileRows<Type, Dot, 3>(xq, m, tile, unpacked, y, out.ldy); break;
      case 2: PackedTileRows<Type, Dot, 2>(xq, m, tile, unpacked, y, out.ldy); break;
      case 1: PackedTileRows<Type, Dot, 1>(xq, m, tile, unpacked, y, out.ldy); break;
      default: break;
    }
  }
}

#endif  // TOKENSERVE_CPU_X86

}  // namespace gguf
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_GGUF_PACKED_H_
