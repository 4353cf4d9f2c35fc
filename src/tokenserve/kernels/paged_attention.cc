// TokenservePagedDecodeAttention: decode attention (one query per sequence) over a paged KV
// cache kept in two TF resource variables, read in place.
//
//   q        T [S, H, Dh]      the step's queries
//   key_cache, value_cache     resource handles of variables holding Tcache [R, Hkv * Dh]
//                              (Tcache: T, or a 16-bit type when T is float32: the cache is
//                              stored in 16 bits and widened to float32 as it is read)
//   rows     int32 [S, L]      cache row of each context position (all must lie in [0, R))
//   lengths  int32 [S]         positions 0 .. lengths[s] - 1 are attended to (0: zeros out)
//   out      T [S, H * Dh]     softmax(q . k * scale) . v per head, head h reading kv head
//                              h / (H / Hkv) (grouped-query attention)
//
// The graph path this replaces gathers the live rows into [S, L, Hkv * Dh] copies
// (ResourceGather), then runs batched matmuls, a softmax and transposes: at 32 sequences x
// 160 positions the copies alone are ~30 MB per layer, and at batch 1 the op overhead
// dominates. Here a work item on TF's intra-op pool is one sequence and `span` consecutive kv
// heads, which reads whole cache rows where they lie (paged_attend.h). Nothing of the cache
// is copied: the variables are looked up and read under a shared lock for the duration of the
// op, as ResourceGather does. The lock keeps the buffer from being replaced meanwhile (assign,
// or the one-time copy into copy-on-read mode, take it exclusively); it does NOT order the read
// against ResourceScatterUpdate, which writes POD dtypes under a shared lock too. That order
// comes from the graph: inside tf.function, automatic control dependencies make this op wait
// for earlier writes to the same variables (see paged_attention.py).
//
// TokenservePagedWriteDecodeAttention takes three more inputs, new_keys and new_values
// T [N, Hkv * Dh] and write_rows int32 [N], and stores those rows (cast to Tcache) before it
// attends, holding both locks exclusively: one op a layer where the engine's step ran a
// clip, a cast and a ResourceScatterUpdate per cache. Its writes follow
// ResourceScatterUpdate's rules (EnsureSparseVariableAccess): a buffer another tensor still
// references is replaced by a copy first, and the variable goes copy-on-read.
//
// The kernels: paged_attend.h (an item: scalar, and the dispatch), paged_attend_avx2.h
// (AVX2+FMA+F16C), paged_item.h (what an item needs); the writes: paged_write.h.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <utility>

#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/platform/mutex.h"
#include "chunks.h"
#include "cpu.h"
#include "op_support.h"
#include "paged_attend.h"
#include "paged_item.h"
#include "paged_write.h"

namespace tokenserve {
namespace {

using tensorflow::DataTypeToEnum;
using tensorflow::errors::FailedPrecondition;

}  // namespace

REGISTER_OP("TokenservePagedDecodeAttention")
    .Input("q: T")                  // [S, H, Dh]
    .Input("key_cache: resource")   // variable of Tcache [R, Hkv * Dh]
    .Input("value_cache: resource")  // variable of Tcache [R, Hkv * Dh]
    .Input("rows: int32")           // [S, L]
    .Input("lengths: int32")        // [S]
    .Output("out: T")               // [S, H * Dh]
    .Attr("scale: float")
    .Attr("softcap: float = 0")  // scores -> softcap * tanh(scores / softcap); 0: none
    .Attr("T: {float, bfloat16}")
    .Attr("Tcache: {float, bfloat16, half}")  // T, or bfloat16 / half when T is float
    .Attr("isa: {'auto', 'scalar'} = 'auto'")
    .Attr("kv_heads_per_item: int = 0")  // 0: automatic (tests and tuning only)
    // Stateful, like ResourceGather: it reads variables, so it must never be constant-folded
    // or merged with an identical call across a write to the cache.
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle q, rows, lengths, unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &q));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 0, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 2, &rows));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(4), 1, &lengths));
      DimensionHandle s, width;
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(q, 0), c->Dim(rows, 0), &s));
      TF_RETURN_IF_ERROR(c->Merge(s, c->Dim(lengths, 0), &s));
      TF_RETURN_IF_ERROR(c->Multiply(c->Dim(q, 1), c->Dim(q, 2), &width));
      c->set_output(0, c->Matrix(s, width));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Decode attention over a paged KV cache, reading the cache variables in place.
out[s, h*Dh:(h+1)*Dh] = softmax_l(q[s, h] . K[rows[s, l], kv*Dh:(kv+1)*Dh] * scale) . V[...]
over l < lengths[s], kv = h / (H / Hkv); zeros where lengths[s] == 0. With softcap > 0 the
scaled scores become softcap * tanh(score / softcap) before the softmax (Gemma 2).
)doc");

REGISTER_OP("TokenservePagedWriteDecodeAttention")
    .Input("q: T")                  // [Q, H, Dh], Q >= S: queries past S get zeros
    .Input("key_cache: resource")   // variable of Tcache [R, Hkv * Dh]
    .Input("value_cache: resource")  // variable of Tcache [R, Hkv * Dh]
    .Input("rows: int32")           // [S, L]
    .Input("lengths: int32")        // [S]
    .Input("new_keys: T")           // [N, Hkv * Dh]
    .Input("new_values: T")         // [N, Hkv * Dh]
    .Input("write_rows: int32")     // [N]
    .Output("out: T")               // [Q, H * Dh]
    .Attr("scale: float")
    .Attr("softcap: float = 0")  // scores -> softcap * tanh(scores / softcap); 0: none
    .Attr("T: {float, bfloat16}")
    .Attr("Tcache: {float, bfloat16, half}")
    .Attr("isa: {'auto', 'scalar'} = 'auto'")
    .Attr("kv_heads_per_item: int = 0")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle q, rows, lengths, new_keys, new_values, write_rows, unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 3, &q));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 0, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 2, &rows));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(4), 1, &lengths));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(5), 2, &new_keys));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(6), 2, &new_values));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(7), 1, &write_rows));
      TF_RETURN_IF_ERROR(c->Merge(new_keys, new_values, &unused));
      DimensionHandle s, n, width;
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(new_keys, 0), c->Dim(write_rows, 0), &n));
      TF_RETURN_IF_ERROR(c->Merge(c->Dim(rows, 0), c->Dim(lengths, 0), &s));
      TF_RETURN_IF_ERROR(c->Multiply(c->Dim(q, 1), c->Dim(q, 2), &width));
      c->set_output(0, c->Matrix(c->Dim(q, 0), width));
      return absl::OkStatus();
    })
    .Doc(R"doc(
TokenservePagedDecodeAttention after writing new rows into the cache, in one op:
key_cache[write_rows[i]] = new_keys[i] and value_cache[write_rows[i]] = new_values[i] in
order (cast to Tcache as tf.cast does; a half cache saturates at +-65504), then attention
over rows[s, :lengths[s]] as TokenservePagedDecodeAttention for the first S queries of q;
queries past S (a step's padding) get zeros. The graph orders it as a write, so later
reads of the same variables run after it.
)doc");

REGISTER_OP("TokenservePagedDecodeAttentionInfo")
    .Output("info: string")
    .SetShapeFn(tensorflow::shape_inference::ScalarShape)
    .Doc("Which instruction set the TokenservePagedDecodeAttention kernel uses on this CPU.");

template <typename T, typename C, bool kWrite>
class PagedDecodeAttentionOp : public OpKernel {
 public:
  explicit PagedDecodeAttentionOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("scale", &scale_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("softcap", &softcap_));
    OP_REQUIRES(ctx, softcap_ >= 0.f, InvalidArgument("softcap must be >= 0, got ", softcap_));
    const bool avx2 = Avx2Attr(ctx, cpu::HasAvx2FmaF16c);
    OP_REQUIRES_OK(ctx, ctx->GetAttr("kv_heads_per_item", &span_));
    OP_REQUIRES(ctx, span_ >= 0, InvalidArgument("kv_heads_per_item must be >= 0"));
    avx2_ = avx2;
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& q = ctx->input(0);
    const Tensor& rows = ctx->input(3);
    const Tensor& lengths = ctx->input(4);
    OP_REQUIRES(ctx, q.dims() == 3,
                InvalidArgument("q must be [S, H, Dh], got shape ", q.shape().DebugString()));
    OP_REQUIRES(ctx, rows.dims() == 2,
                InvalidArgument("rows must be [S, L], got shape ", rows.shape().DebugString()));
    OP_REQUIRES(ctx, lengths.dims() == 1,
                InvalidArgument("lengths must be [S], got shape ",
                                lengths.shape().DebugString()));
    Geometry g;
    // The writing op attends the first S = rows' queries of q and leaves the rest (the
    // step's bucket padding) zero; the reading op takes exactly S.
    const int64 num_queries = q.dim_size(0);
    g.S = kWrite ? rows.dim_size(0) : num_queries;
    g.H = q.dim_size(1);
    g.Dh = q.dim_size(2);
    g.L = rows.dim_size(1);
    g.scale = scale_;
    g.softcap = softcap_;
    OP_REQUIRES(ctx, rows.dim_size(0) == g.S && lengths.dim_size(0) == g.S && g.S <= num_queries,
                InvalidArgument("q has ", num_queries, " queries but rows is ",
                                rows.shape().DebugString(), " and lengths ",
                                lengths.shape().DebugString()));
    OP_REQUIRES(ctx, g.Dh > 0, InvalidArgument("q's head size Dh must be positive"));

    // Lengths and rows first (they need no lock); the row bound R comes from the variable.
    const int32_t* len_p = lengths.flat<int32_t>().data();
    for (int64 s = 0; s < g.S; ++s) {
      OP_REQUIRES(ctx, len_p[s] >= 0 && len_p[s] <= g.L,
                  InvalidArgument("lengths[", s, "] = ", len_p[s], " is not in [0, L = ", g.L,
                                  "]"));
    }
    const int32_t* rows_p = rows.flat<int32_t>().data();
    const int64 num_rows = g.S * g.L;
    int32_t lo = 0, hi = 0;  // min and max row (a vectorizable pass; the slow search on error)
    if (num_rows > 0) {
      lo = hi = rows_p[0];
      for (int64 i = 1; i < num_rows; ++i) {
        lo = std::min(lo, rows_p[i]);
        hi = std::max(hi, rows_p[i]);
      }
    }

    tensorflow::core::RefCountPtr<Var> key_var, value_var;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 1), &key_var));
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 2), &value_var));
    // Shared locks for the whole computation, as ResourceGather holds its lock for the whole
    // gather: no reference to the (multi-GB) buffer is taken, so nothing ever copies it, and
    // the buffer cannot be replaced under us. Scatters, which also
    // hold the lock shared, are ordered by the graph, not here. Several variables are locked
    // in order of increasing mu() address (resource_var.h).
    tensorflow::mutex* first = key_var->mu();
    tensorflow::mutex* second = value_var->mu();
    if (second < first) std::swap(first, second);
    // The writing op holds both locks exclusively (it may replace a shared buffer, below).
    std::optional<tensorflow::tf_shared_lock> first_shared, second_shared;
    std::optional<tensorflow::mutex_lock> first_exclusive, second_exclusive;
    if (kWrite) {
      first_exclusive.emplace(*first);
      if (second != first) second_exclusive.emplace(*second);
    } else {
      first_shared.emplace(*first);
      if (second != first) second_shared.emplace(*second);
    }

    const Tensor* keys = key_var->tensor();
    const Tensor* values = value_var->tensor();
    for (const auto& [name, var] : {std::pair<const char*, Var*>{"key_cache", key_var.get()},
                                    {"value_cache", value_var.get()}}) {
      OP_REQUIRES(ctx, var->is_initialized,
                  FailedPrecondition(name, ": attempting to use an uninitialized variable"));
      const Tensor* t = var->tensor();
      OP_REQUIRES(ctx, t->dtype() == DataTypeToEnum<C>::v(),
                  InvalidArgument(name, " holds ", tensorflow::DataTypeString(t->dtype()),
                                  " but Tcache is ",
                                  tensorflow::DataTypeString(DataTypeToEnum<C>::v())));
      OP_REQUIRES(ctx, t->dims() == 2,
                  InvalidArgument(name, " must be [R, Hkv * Dh], got shape ",
                                  t->shape().DebugString()));
    }
    OP_REQUIRES(ctx, keys->shape() == values->shape(),
                InvalidArgument("key_cache ", keys->shape().DebugString(),
                                " and value_cache ", values->shape().DebugString(),
                                " differ in shape"));
    g.R = keys->dim_size(0);
    g.width = keys->dim_size(1);
    OP_REQUIRES(ctx, g.width % g.Dh == 0 && g.width > 0,
                InvalidArgument("cache rows hold ", g.width, " values, not a positive multiple of"
                                " q's head size Dh = ", g.Dh));
    g.Hkv = g.width / g.Dh;
    OP_REQUIRES(ctx, g.H % g.Hkv == 0,
                InvalidArgument("q's H = ", g.H, " heads are not a multiple of the cache's Hkv = ",
                                g.Hkv, " kv heads (", g.width, " / Dh = ", g.Dh, ")"));
    g.group = g.H / g.Hkv;
    if (num_rows > 0 && (lo < 0 || hi >= g.R)) {
      for (int64 i = 0; i < num_rows; ++i) {
        OP_REQUIRES(ctx, rows_p[i] >= 0 && rows_p[i] < g.R,
                    InvalidArgument("rows[", i / g.L, ", ", i % g.L, "] = ", rows_p[i],
                                    " is not in [0, ", g.R, ")"));
      }
    }

    if (kWrite) {
      WriteRows<T, C>(ctx, g, key_var.get(), value_var.get());
      if (!ctx->status().ok()) return;
      keys = key_var->tensor();  // a shared buffer was replaced by its copy
      values = value_var->tensor();
    }

    Tensor* out_tensor = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({num_queries, g.H * g.Dh}),
                                             &out_tensor));
    if (num_queries > g.S) {  // zeros (of float and bfloat16 alike)
      std::memset(out_tensor->flat<T>().data() + g.S * g.H * g.Dh, 0,
                  (num_queries - g.S) * g.H * g.Dh * sizeof(T));
    }
    if (g.S == 0 || g.H == 0) return;

    const T* qp = q.flat<T>().data();
    const C* kp = keys->flat<C>().data();
    const C* vp = values->flat<C>().data();
    T* op = out_tensor->flat<T>().data();
    const bool avx2 = avx2_;
    // Items: a sequence and `span` consecutive kv heads. Whole rows (span = Hkv) read the
    // cache most efficiently (a block of consecutive rows is one contiguous run, which the
    // hardware prefetcher streams); smaller spans where needed for enough parallel items
    // (kItemsPerThread; one kv head per item at the least).
    OP_REQUIRES(ctx, span_ == 0 || g.Hkv % span_ == 0,
                InvalidArgument("kv_heads_per_item = ", span_, " does not divide Hkv = ",
                                g.Hkv));
    const int threads = ctx->device()->tensorflow_cpu_worker_threads()->num_threads;
    g.span = g.Hkv;
    while (g.span > 1 && g.S * (g.Hkv / g.span) < kItemsPerThread * std::max(threads, 1)) {
      do --g.span; while (g.Hkv % g.span);
    }
    if (span_ > 0) g.span = span_;
    const int64 parts = g.Hkv / g.span;
    auto work = [&](int64 begin, int64 end) {
      Scratch scratch(g);
      for (int64 item = begin; item < end; ++item) {
        const int64 s = item / parts, kv = (item % parts) * g.span;
        const int64 head = kv * g.group;  // the item's first query head
        Attend<T, C>(g, avx2, qp + (s * g.H + head) * g.Dh, kp + kv * g.Dh, vp + kv * g.Dh,
                  rows_p + s * g.L, len_p[s], &scratch, op + (s * g.H + head) * g.Dh);
      }
    };
    // Cycles per item, roughly: the key and value values read (~2 cycles each from memory)
    // plus 2 FMAs per value and query head, 8 per cycle. Chunks of about kChunkCycles each:
    // a small call stays one chunk on the calling thread, a big one is shared with the
    // ops' helper team (chunks.h), which is awake during generation where a pool thread
    // woken by ParallelFor is not.
    const int64 cost = g.L * g.span * g.Dh * (4 + g.group / 2) + 500;
    const int64 items = g.S * parts;
    const ChunkSplit split = SplitIntoChunks(items, cost);
    RunChunks(WorkerPool(ctx), std::max(threads, 1),
              split.num_chunks, [&](int64 chunk, int64) {
                work(chunk * split.per_chunk, std::min(items, (chunk + 1) * split.per_chunk));
              });
  }

 private:
  float scale_ = 1.f;
  float softcap_ = 0.f;
  int64 span_ = 0;  // kv heads per item; 0: automatic
  bool avx2_ = false;
};

namespace {

const char* PagedAttentionIsa() {
  return cpu::HasAvx2FmaF16c() ? "AVX2+FMA" : "scalar (no AVX2+FMA)";
}

}  // namespace

// (q, cache) dtypes: the same, or a float32 step over a 16-bit cache.
#define REGISTER(T, C)                                                   \
  REGISTER_KERNEL_BUILDER(Name("TokenservePagedDecodeAttention")        \
                              .Device(DEVICE_CPU)            \
                              .TypeConstraint<T>("T")                    \
                              .TypeConstraint<C>("Tcache"),              \
                          PagedDecodeAttentionOp<T, C, false>);          \
  REGISTER_KERNEL_BUILDER(Name("TokenservePagedWriteDecodeAttention")   \
                              .Device(DEVICE_CPU)            \
                              .TypeConstraint<T>("T")                    \
                              .TypeConstraint<C>("Tcache"),              \
                          PagedDecodeAttentionOp<T, C, true>);
REGISTER(float, float)
REGISTER(bfloat16, bfloat16)
REGISTER(float, bfloat16)
REGISTER(float, Half)
#undef REGISTER
REGISTER_KERNEL_BUILDER(Name("TokenservePagedDecodeAttentionInfo").Device(DEVICE_CPU),
                        IsaInfoOp<PagedAttentionIsa>);

}  // namespace tokenserve
