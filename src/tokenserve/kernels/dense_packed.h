// The dense kernels for more rows of x: weights packed into panels that feed register
// tiles, for "kn" (KnPackedAvx2) and "nk" (NkPackedAvx2), AVX2+FMA only.
//
// Internal linkage (an unnamed namespace): every op file that includes this compiles its own
// copy, so its calls stay direct and the compiler inlines and clones it within that file as
// it would the file's own code.
#ifndef TOKENSERVE_KERNELS_DENSE_PACKED_H_
#define TOKENSERVE_KERNELS_DENSE_PACKED_H_

#include <algorithm>
#include <cstdint>

#include "cpu.h"
#include "dense_args.h"

namespace tokenserve {
namespace {

#ifdef TOKENSERVE_CPU_X86
#define AVX2_FN __attribute__((target("avx2,fma")))

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
AVX2_FN void KnPackedAvx2(const DenseGeometry& g, const float* x, const W* w,
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
AVX2_FN void NkPackedAvx2(const DenseGeometry& g, const float* x, const W* w, int64 n0,
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

#undef AVX2_FN
#endif  // TOKENSERVE_CPU_X86

}  // namespace
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_DENSE_PACKED_H_
