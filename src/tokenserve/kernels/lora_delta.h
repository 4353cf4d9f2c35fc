// Each row's LoRA delta, rows grouped by adapter (as punica's SGMV and S-LoRA batch them):
//
//     y[rows of slot s] += (in[rows of slot s] @ A_s[layer]) @ B_s[layer]
//
// for the resident slots s = 1..S; slot 0's rows (the base model, padding) get nothing.
// The rows come sorted by slot once a step (engine/step/lora.py, shared by every layer):
// `order` [M] the row indices by slot, `offsets` [S + 2] where slot s's rows are
// order[offsets[s]:offsets[s + 1]]. A_s [L, in, R] and B_s [L, R, out] are the slot table's
// own variables, read in place (no per-step copy). Each projection's delta is summed from
// zero and then added to y, whichever path computes it, so a row's bits are the same alone
// and in a batch. A few adapter rows (decode of a stream or two) run on one thread
// (FewLoraDeltas), in the fused block as one more chunk of the projection's own product;
// more rows are one call of the thread team: work items of up to kLoraRows rows of one
// slot by a range of out's columns, each item its rows' in @ A_s (kept in per-worker
// scratch) and then @ B_s's columns; few items split out's columns further so both
// threads work (the repeated in @ A_s is R / (columns per item) of the item's work).
// Both products run register-tiled (lora_product.h): up to 4 rows by 64 columns in AVX2
// registers, each factor row read once per tile for all its rows.
//
// Only what an adapter fills is read: each slot's `spans` [L, 4, P, 4] (int32, one row per
// layer and role: qkv, out, up, down) give up to P pieces of each factor, rank rows
// [r0, r1) of B that are nonzero only in out's columns [c0, c1) (a fused QKV's q, k and v
// each fill their own columns; a rank-8 adapter in a rank-16 slot leaves rows 8..16 zero).
// A role or layer the adapter leaves alone has no piece, and costs nothing; in @ A_s
// computes only the rank rows a piece reads.
//
// Float32 throughout; each delta is summed in a fixed order per row, whatever the batch.
#ifndef TOKENSERVE_KERNELS_LORA_DELTA_H_
#define TOKENSERVE_KERNELS_LORA_DELTA_H_

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "chunks.h"
#include "lora_product.h"
#include "op_support.h"

namespace tokenserve {
namespace {

constexpr int64 kLoraRows = 8;        // rows of one slot per work item
constexpr int64 kLoraSerialRows = 4;  // adapter rows at most that the calling thread does alone
constexpr int64 kLoraMinCols = 256;   // columns per work item at least, when columns split
constexpr int64 kLoraColBlock = 64;   // columns per block of a column split

// The step's rows by slot (the op's `order` and `offsets` inputs), checked.
struct LoraGroups {
  const int32_t* order;    // [M]
  const int32_t* offsets;  // [S + 2]
  int64 num_slots;         // S
};

constexpr int64 kLoraPieces = 3;      // pieces of one role's factor at most (q, k, v)

// Rank rows [r0, r1) of a factor whose B is nonzero only in columns [c0, c1); empty when
// r0 == r1.
struct LoraPiece {
  int32_t r0, r1, c0, c1;
};

// One projection's factors for every slot at one layer: a[s - 1] = &A_s[layer] [in, R],
// b[s - 1] = &B_s[layer] [R, out], pieces[s - 1] what of them the slot fills, used[s - 1]
// the rank rows its pieces read (the end of the last; 0: the slot adds nothing).
struct LoraFactor {
  std::vector<const float*> a, b;
  std::vector<std::array<LoraPiece, kLoraPieces>> pieces;
  std::vector<int32_t> used;
  int64 width, rank, out;
};

// Checks order [M] and offsets [S + 2] (inputs `order_index` and the next) and reads them;
// sets ctx's status and returns false when they do not describe M rows sorted into S + 1
// slots.
inline bool ReadLoraGroups(OpKernelContext* ctx, int order_index, int64 m, int64 num_slots,
                           LoraGroups* groups) {
  auto fail = [ctx](const absl::Status& status) {
    ctx->CtxFailure(__FILE__, __LINE__, status);
    return false;
  };
  const Tensor& order = ctx->input(order_index);
  const Tensor& offsets = ctx->input(order_index + 1);
  if (!(order.dims() == 1 && order.dim_size(0) == m)) {
    return fail(InvalidArgument("order must be [M] with M = ", m, ", got ",
                                order.shape().DebugString()));
  }
  if (!(offsets.dims() == 1 && offsets.dim_size(0) == num_slots + 2)) {
    return fail(InvalidArgument("offsets must be [S + 2] with S = ", num_slots, ", got ",
                                offsets.shape().DebugString()));
  }
  const int32_t* o = offsets.flat<int32_t>().data();
  const int32_t* rows = order.flat<int32_t>().data();
  if (o[0] != 0 || o[num_slots + 1] != m) {
    return fail(InvalidArgument("offsets must run from 0 to M = ", m));
  }
  for (int64 s = 0; s <= num_slots; ++s) {
    if (o[s] > o[s + 1]) return fail(InvalidArgument("offsets must not decrease"));
  }
  // a permutation: work items write their rows of y at once
  std::vector<char> seen(m, 0);
  for (int64 i = 0; i < m; ++i) {
    if (rows[i] < 0 || rows[i] >= m || seen[rows[i]]) {
      return fail(InvalidArgument("order must be a permutation of 0..", m - 1, ", order[", i,
                                  "] = ", rows[i]));
    }
    seen[rows[i]] = 1;
  }
  *groups = {rows, o, num_slots};
  return true;
}

// Reads S slots' factors of one projection from the inputs [a_index, a_index + S) (A_s
// [L, in, R]) and the S after them (B_s [L, R, out]) at `layer`, and their pieces from the
// inputs [spans_index, spans_index + S) (spans_s [L, 4, P, 4]) at `layer` and `role`; sets
// ctx's status and returns false when a shape or a piece does not fit (in, out given; R and
// L the slots' own, alike).
inline bool ReadLoraFactor(OpKernelContext* ctx, int a_index, int spans_index, int64 num_slots,
                           int64 layer, int64 role, int64 width, int64 out, const char* name,
                           LoraFactor* factor) {
  const Tensor& first = ctx->input(a_index);
  const int64 layers = first.dims() == 3 ? first.dim_size(0) : 0;
  const int64 rank = first.dims() == 3 ? first.dim_size(2) : -1;
  factor->a.clear();
  factor->b.clear();
  factor->pieces.clear();
  factor->used.clear();
  factor->width = width;
  factor->rank = rank;
  factor->out = out;
  for (int64 s = 0; s < num_slots; ++s) {
    const Tensor& a = ctx->input(a_index + s);
    const Tensor& b = ctx->input(a_index + num_slots + s);
    if (!(a.dims() == 3 && a.dim_size(0) == layers && a.dim_size(1) == width &&
          a.dim_size(2) == rank && b.dims() == 3 && b.dim_size(0) == layers &&
          b.dim_size(1) == rank && b.dim_size(2) == out && layer < layers)) {
      ctx->CtxFailure(__FILE__, __LINE__,
                      InvalidArgument("LoRA factors of ", name, " must be [L, ", width,
                                      ", R] and [L, R, ", out, "] alike for every slot, with ",
                                      "layer ", layer, " < L; slot ", s + 1, " has ",
                                      a.shape().DebugString(), " and ",
                                      b.shape().DebugString()));
      return false;
    }
    factor->a.push_back(a.flat<float>().data() + layer * width * rank);
    factor->b.push_back(b.flat<float>().data() + layer * rank * out);
    const Tensor& spans = ctx->input(spans_index + s);
    if (!(spans.dims() == 4 && spans.dim_size(0) == layers && spans.dim_size(1) == 4 &&
          spans.dim_size(2) == kLoraPieces && spans.dim_size(3) == 4 && role < 4)) {
      ctx->CtxFailure(__FILE__, __LINE__,
                      InvalidArgument("LoRA spans must be [L, 4, ", kLoraPieces, ", 4] with L = ",
                                      layers, "; slot ", s + 1, " has ",
                                      spans.shape().DebugString()));
      return false;
    }
    const int32_t* p = spans.flat<int32_t>().data() + (layer * 4 + role) * kLoraPieces * 4;
    std::array<LoraPiece, kLoraPieces> pieces;
    int32_t used = 0;
    for (int64 i = 0; i < kLoraPieces; ++i, p += 4) {
      pieces[i] = {p[0], p[1], p[2], p[3]};
      if (!(0 <= p[0] && p[0] <= p[1] && p[1] <= rank && 0 <= p[2] && p[2] <= p[3] &&
            p[3] <= out)) {
        ctx->CtxFailure(__FILE__, __LINE__,
                        InvalidArgument("LoRA span of ", name, " (slot ", s + 1, ", layer ",
                                        layer, ") must be rows 0 <= r0 <= r1 <= ", rank,
                                        " and columns 0 <= c0 <= c1 <= ", out, ", got [", p[0],
                                        ", ", p[1], ", ", p[2], ", ", p[3], "]"));
        return false;
      }
      if (p[0] < p[1] && p[2] < p[3]) used = std::max(used, p[1]);
    }
    factor->pieces.push_back(pieces);
    factor->used.push_back(used);
  }
  return true;
}

// y[rows[i], j0:j1] += d[i, j0:j1] for the n rows (d [n, out]).
inline void AddLoraRows(int64 n, const int32_t* rows, const float* d, int64 out, int64 j0,
                        int64 j1, float* y) {
  for (int64 i = 0; i < n; ++i) {
    float* __restrict yi = y + rows[i] * out;
    const float* __restrict di = d + i * out;
    for (int64 c = j0; c < j1; ++c) yi[c] += di[c];
  }
}

// The rows' delta on columns [j0, j1), summed from zero and added to y's rows (t: scratch
// [n, R]): in @ A_s on the rank rows of the pieces that reach those columns, then each such
// piece's product on its columns within them. With y nullptr the delta is left in d
// ([n, out], row i's columns [j0, j1) written; zeros where no piece reaches) for the caller
// to add (AddLoraRows). Pieces on columns of their own add their sums straight into y's
// rows; pieces that share columns (a factor past kLoraPieces: LoraPiecesShareColumns) sum
// in d first, so a row's bits are the same either way. False, nothing written, when no
// piece reaches.
inline bool LoraRowsDelta(const LoraFactor& factor, int64 slot, int64 n, const int32_t* rows,
                          const float* in, int64 j0, int64 j1, float* t, float* d, float* y) {
  const auto& pieces = factor.pieces[slot - 1];
  std::array<std::array<int64, 4>, kLoraPieces> reached;  // r0, r1, c0, c1 within [j0, j1)
  int64 num_reached = 0;
  int64 k0 = factor.rank, k1 = 0;
  bool disjoint = true;
  for (const LoraPiece& p : pieces) {
    const int64 c0 = std::max<int64>(p.c0, j0), c1 = std::min<int64>(p.c1, j1);
    if (p.r0 >= p.r1 || c0 >= c1) continue;
    for (int64 i = 0; i < num_reached; ++i) {
      disjoint = disjoint && (c1 <= reached[i][2] || reached[i][3] <= c0);
    }
    reached[num_reached++] = {p.r0, p.r1, c0, c1};
    k0 = std::min<int64>(k0, p.r0);
    k1 = std::max<int64>(k1, p.r1);
  }
  if (num_reached == 0) return false;
  const int64 r = factor.rank;
  const bool direct = y != nullptr && disjoint;
  std::array<const float*, kLoraRows> x_rows, t_rows;
  std::array<float*, kLoraRows> dest, t_out;
  for (int64 i = 0; i < n; ++i) {
    x_rows[i] = in + rows[i] * factor.width;
    dest[i] = direct ? y + rows[i] * factor.out : d + i * factor.out;
    if (!direct) std::fill(dest[i] + j0, dest[i] + j1, 0.f);
    t_out[i] = t + i * r;
    t_rows[i] = t_out[i];
  }
  // t[:, k0:k1] = in[rows] @ A_s[:, k0:k1], A's rows prefetched 16 on; then B's columns 128
  // on (at 32 rows over 4 adapters the prefetches made the deltas about 10% faster)
  LoraProduct(n, x_rows.data(), factor.a[slot - 1], r, 0, factor.width, k0, k1, t_out.data(),
              LoraStore::kSet, 16 * r);
  for (int64 i = 0; i < num_reached; ++i) {  // each piece: t[:, r0:r1] @ B_s[r0:r1, c0:c1]
    const auto& [p0, p1, c0, c1] = reached[i];
    LoraProduct(n, t_rows.data(), factor.b[slot - 1], factor.out, p0, p1, c0, c1, dest.data(),
                direct ? LoraStore::kAdd : LoraStore::kAccumulate, 128);
  }
  if (y != nullptr && !direct) AddLoraRows(n, rows, d, factor.out, j0, j1, y);
  return true;
}

// Whether two of `slot`'s pieces of `factor` share a column (a factor past kLoraPieces).
inline bool LoraPiecesShareColumns(const LoraFactor& factor, int64 slot) {
  const auto& pieces = factor.pieces[slot - 1];
  for (int64 i = 0; i < kLoraPieces; ++i) {
    for (int64 j = 0; j < i; ++j) {
      const LoraPiece &a = pieces[i], &b = pieces[j];
      if (a.r0 < a.r1 && b.r0 < b.r1 && std::max(a.c0, b.c0) < std::min(a.c1, b.c1)) {
        return true;
      }
    }
  }
  return false;
}

// Rows of one slot, order[begin:begin + count].
struct LoraRows {
  int64 slot, begin, count;
};

// The rows whose slot has a piece of `factor` (the others add nothing here), in chunks of
// up to kLoraRows rows of one slot; *num_rows: their rows.
inline std::vector<LoraRows> LoraChunks(const LoraGroups& groups, const LoraFactor& factor,
                                        int64* num_rows) {
  std::vector<LoraRows> chunks;
  *num_rows = 0;
  if (factor.rank == 0) return chunks;
  for (int64 s = 1; s <= groups.num_slots; ++s) {
    if (factor.used[s - 1] == 0) continue;  // no piece of this role at this layer
    *num_rows += groups.offsets[s + 1] - groups.offsets[s];
    for (int64 i = groups.offsets[s]; i < groups.offsets[s + 1]; i += kLoraRows) {
      chunks.push_back({s, i, std::min<int64>(kLoraRows, groups.offsets[s + 1] - i)});
    }
  }
  return chunks;
}

// A few rows' deltas (at most kLoraSerialRows: decode of a stream or two) on one thread:
// each slot's in @ A_s once and @ B_s whole, into a buffer of their own (Compute), then
// added to the product (AddTo). Their delta is tens of microseconds a projection, less
// than splitting it gains: the columns' split repeats in @ A_s per item, and each call of
// the team is one more point where a thread waits on a helper (on a loaded machine, a
// descheduled one). Compute needs only the projection's input, so the fused block runs it
// as one more chunk of the projection's own product (ComputeDense's `side`): the factors'
// reads then overlap the weights' stream on the other thread instead of following it.
// The sums are the team path's, so a row's delta has the same bits either way.
struct FewLoraDeltas {
  std::vector<LoraRows> chunks;
  std::vector<float> t, d;   // [kLoraRows, R] scratch; [rows, out] the deltas, chunk order
  std::vector<char> filled;  // per chunk: a piece reached its rows

  // Takes the rows of `factor`; false (nothing to add, or too many rows for one thread)
  // leaves the chunks empty.
  bool Plan(const LoraGroups& groups, const LoraFactor& factor) {
    int64 num_rows = 0;
    chunks = LoraChunks(groups, factor, &num_rows);
    if (num_rows == 0 || num_rows > kLoraSerialRows) {
      chunks.clear();
      return false;
    }
    t.resize(kLoraRows * factor.rank);
    d.resize(num_rows * factor.out);
    filled.assign(chunks.size(), 0);
    return true;
  }

  void Compute(const LoraFactor& factor, const LoraGroups& groups, const float* in) {
    float* di = d.data();
    for (size_t c = 0; c < chunks.size(); ++c) {
      const LoraRows& rows = chunks[c];
      filled[c] = LoraRowsDelta(factor, rows.slot, rows.count, groups.order + rows.begin, in,
                                0, factor.out, t.data(), di, nullptr);
      di += rows.count * factor.out;
    }
  }

  void AddTo(const LoraFactor& factor, const LoraGroups& groups, float* y) const {
    const float* di = d.data();
    for (size_t c = 0; c < chunks.size(); ++c) {
      const LoraRows& rows = chunks[c];
      if (filled[c]) {
        AddLoraRows(rows.count, groups.order + rows.begin, di, factor.out, 0, factor.out, y);
      }
      di += rows.count * factor.out;
    }
  }
};

// y [M, out] += each row's delta from in [M, width] (see the top of this file): a few rows
// on this thread (FewLoraDeltas), more in one call of the thread team.
inline void AddLoraDelta(tensorflow::thread::ThreadPool* pool, const LoraGroups& groups,
                         const LoraFactor& factor, const float* in, float* y) {
  FewLoraDeltas few;
  if (few.Plan(groups, factor)) {
    few.Compute(factor, groups, in);
    few.AddTo(factor, groups, y);
    return;
  }
  int64 num_rows = 0;
  const std::vector<LoraRows> chunks = LoraChunks(groups, factor, &num_rows);
  if (chunks.empty()) return;
  const int64 r = factor.rank;
  const int64 workers = pool == nullptr ? 1 : std::max(1, pool->NumThreads());
  const int64 num_chunks = static_cast<int64>(chunks.size());
  // column ranges per row chunk (whole blocks): enough items for every worker twice, none
  // too narrow
  const int64 blocks = (factor.out + kLoraColBlock - 1) / kLoraColBlock;
  const int64 wanted = (2 * workers + num_chunks - 1) / num_chunks;
  const int64 col_ranges = std::max<int64>(1, std::min(wanted, factor.out / kLoraMinCols));
  std::vector<float> t_scratch(workers * kLoraRows * r);
  // a buffer for the deltas only where a slot's pieces share columns (LoraRowsDelta)
  std::vector<char> shared(groups.num_slots + 1, 0);
  for (int64 s = 1; s <= groups.num_slots; ++s) shared[s] = LoraPiecesShareColumns(factor, s);
  std::vector<std::vector<float>> d_scratch(workers);
  RunChunks(pool, workers, num_chunks * col_ranges, [&](int64 item, int64 worker) {
    const LoraRows& rows = chunks[item / col_ranges];
    const int64 range = item % col_ranges;
    const int64 j0 = blocks * range / col_ranges * kLoraColBlock;
    const int64 j1 = std::min(factor.out, blocks * (range + 1) / col_ranges * kLoraColBlock);
    float* d = nullptr;
    if (shared[rows.slot]) {
      d_scratch[worker].resize(kLoraRows * factor.out);
      d = d_scratch[worker].data();
    }
    LoraRowsDelta(factor, rows.slot, rows.count, groups.order + rows.begin, in, j0, j1,
                  t_scratch.data() + worker * kLoraRows * r, d, y);
  });
}

}  // namespace
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_LORA_DELTA_H_
