// TokenserveMoeGgufLayer: TokenserveMoeLayer (moe_layer.cc) for experts kept in the blocks a
// GGUF file stores, the router included:
//
//   ids, gates = top_k(softmax(x @ router), k) (renormalised when `normalize`; moe_route.h)
//   y = residual + sum_j gates[:, j] * down_e(silu(gate_e(x)) * up_e(x)), e = ids[:, j]
//       (+ sigmoid(x @ shared_gate) * the shared expert's, where shared_gate is given)
//
//   x [M, D] float32; router [D, E], shared_gate [D, 1] or [0, 0] (float32 or bfloat16);
//   residual [M, D] or [0, 0]; gate[e], up[e]: uint8 [F_e, D / values * block bytes] and
//   down[e]: uint8 [D, F_e / values * block bytes], expert e's rows of llama.cpp's stacked
//   ffn_{gate,up,down}_exps (the shared expert's ffn_*_shexp as expert E, N = E + 1), their
//   types in gate_types / up_types / down_types (one a matrix: the stacked tensors' types
//   differ by role). Outputs y [M, D] and counts [E], the rows each routed expert ran on.
//
// Each expert with rows runs once on them (moe_grouped.h's grouping): its rows gathered,
// quantized into q8 blocks and multiplied by its gate and up blocks, SwiGLU, the product
// quantized again and multiplied by its down blocks (moe_gguf.h, the dense block op's
// kernels), then added into each row scaled by its gate. An expert without rows is not read.
// A decode step (few rows an expert) runs every expert's gate and up matrices in one thread
// dispatch and their down matrices in a second (moe_gguf.h's RunBlockJobs), not three each.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "moe_gguf.h"
#include "moe_grouped.h"
#include "moe_route.h"
#include "op_support.h"

namespace tokenserve {

REGISTER_OP("TokenserveMoeGgufLayer")
    .Input("x: float")            // [M, D]
    .Input("router: R")           // [D, E]
    .Input("residual: float")     // [M, D] or [0, 0]
    .Input("shared_gate: R")      // [D, 1] or [0, 0]
    .Input("gate: N * uint8")     // N x [F_e, D / values * block bytes]
    .Input("up: N * uint8")       // N x [F_e, D / values * block bytes]
    .Input("down: N * uint8")     // N x [D, F_e / values * block bytes]
    .Output("y: float")           // [M, D]
    .Output("counts: int32")      // [E] rows each routed expert ran on
    .Attr("gate_types: list({'q4_0', 'q4_1', 'q8_0', 'q4_k', 'q5_k', 'q6_k'})")
    .Attr("up_types: list({'q4_0', 'q4_1', 'q8_0', 'q4_k', 'q5_k', 'q6_k'})")
    .Attr("down_types: list({'q4_0', 'q4_1', 'q8_0', 'q4_k', 'q5_k', 'q6_k'})")
    .Attr("k: int >= 1")
    .Attr("normalize: bool")
    .Attr("N: int >= 1")
    .Attr("R: {float, bfloat16} = DT_FLOAT")
    .Attr("isa: {'auto', 'scalar'} = 'auto'")
    .SetShapeFn(LayerShape)
    .Doc("A mixture-of-experts MLP with its router, the experts' weights GGUF blocks as "
         "stored (Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K), grouped by expert.");

namespace {

struct BlockExpert {
  BlockMatrix gate, up, down;
};

struct BlockScratch {
  std::vector<float> rows, gate, up, product;  // [count, D], [count, F] twice, [count, D]
};

std::vector<BlockType> ParseTypes(const std::vector<std::string>& names) {
  std::vector<BlockType> types;
  for (const auto& name : names) types.push_back(ParseBlockType(name));
  return types;
}

}  // namespace

class MoeGgufLayerOp : public OpKernel {
 public:
  explicit MoeGgufLayerOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    simd_ = StringAttr(ctx, "isa") == "auto" && cpu::HasAvx2FmaF16c();
    OP_REQUIRES_OK(ctx, ctx->GetAttr("k", &k_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("normalize", &normalize_));
    std::vector<std::string> gate, up, down;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("gate_types", &gate));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("up_types", &up));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("down_types", &down));
    gate_types_ = ParseTypes(gate);
    up_types_ = ParseTypes(up);
    down_types_ = ParseTypes(down);
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& router = ctx->input(1);
    const Tensor& residual = ctx->input(2);
    const Tensor& shared_gate = ctx->input(3);
    OpInputList gate, up, down;
    OP_REQUIRES_OK(ctx, ctx->input_list("gate", &gate));
    OP_REQUIRES_OK(ctx, ctx->input_list("up", &up));
    OP_REQUIRES_OK(ctx, ctx->input_list("down", &down));
    int64 e = 0;
    CheckLayerInputs(ctx, x, router, residual, shared_gate, gate.size(), k_, &e);
    if (!ctx->status().ok()) return;
    const int64 m = x.dim_size(0), d = x.dim_size(1), n = gate.size();
    std::vector<BlockExpert> experts(n);
    for (int64 i = 0; i < n; ++i) {
      Matrices(ctx, i, d, gate[i], up[i], down[i], &experts[i]);
      if (!ctx->status().ok()) return;
    }
    float* y = nullptr;
    int32_t* counts = nullptr;
    StartOutputs(ctx, residual, m, d, e, &y, &counts);
    if (!ctx->status().ok()) return;
    const bool shared = shared_gate.NumElements() > 0;
    const int64 width = k_ + shared;  // pairs per row: the routed experts, then the shared one
    std::vector<int32_t> ids(m * width), all_counts(n);
    std::vector<float> gates(m * width);
    const float* xp = x.flat<float>().data();
    if (m > 0) {
      RouteRows(ctx, simd_, xp, m, d, e, k_, normalize_, router, shared_gate, ids.data(),
                gates.data());
    }
    const ExpertGroups groups = GroupByExpert(ids.data(), m, width, n, all_counts.data());
    std::copy(all_counts.begin(), all_counts.begin() + e, counts);
    auto* pool = WorkerPool(ctx);
#ifdef TOKENSERVE_CPU_X86
    if (FitRowKernels(groups, experts)) {  // a decode step: two dispatches for all experts
      return RunTogether(pool, xp, d, gates.data(), experts, groups, width, y);
    }
#endif
    BlockScratch scratch;  // per call: TF may run one kernel's Compute on two threads at once
    for (int64 i = 0; i < n; ++i) {
      if (groups.Count(i) == 0) continue;  // no rows: never read
      RunExpert(pool, xp, d, gates.data(), experts[i], groups.pairs.data() + groups.start[i],
                groups.Count(i), width, y, scratch);
    }
  }

 private:
  // Expert i's three matrices, checked against their types and D; sets ctx's status otherwise.
  void Matrices(OpKernelContext* ctx, int64 i, int64 d, const Tensor& gate, const Tensor& up,
                const Tensor& down, BlockExpert* out) {
    OP_REQUIRES(ctx, static_cast<int64>(gate_types_.size()) > i &&
                         static_cast<int64>(up_types_.size()) > i &&
                         static_cast<int64>(down_types_.size()) > i,
                InvalidArgument("gate_types, up_types and down_types need one type per expert "
                                "(", gate_types_.size(), ", ", up_types_.size(), ", ",
                                down_types_.size(), " for ", i + 1, " or more experts)"));
    OP_REQUIRES(ctx, gate.dims() == 2 && gate.dim_size(0) > 0,
                InvalidArgument("gate[", i, "] must be [F, bytes a row], got ",
                                gate.shape().DebugString()));
    const int64 f = gate.dim_size(0);
    const int64 gate_bytes = BlockRowBytes(gate_types_[i], d);
    const int64 up_bytes = BlockRowBytes(up_types_[i], d);
    const int64 down_bytes = BlockRowBytes(down_types_[i], f);
    OP_REQUIRES(ctx, gate_bytes > 0 && IsMatrix(gate, f, gate_bytes),
                InvalidArgument("gate[", i, "] must hold ", f, " rows of D = ", d,
                                " values in its blocks (", gate_bytes, " bytes a row), got ",
                                gate.shape().DebugString()));
    OP_REQUIRES(ctx, up_bytes > 0 && IsMatrix(up, f, up_bytes),
                InvalidArgument("up[", i, "] must be [", f, ", ", up_bytes, "] (F rows of D = ",
                                d, " values), got ", up.shape().DebugString()));
    OP_REQUIRES(ctx, down_bytes > 0 && IsMatrix(down, d, down_bytes),
                InvalidArgument("down[", i, "] must be [", d, ", ", down_bytes, "] (D rows of F = ",
                                f, " values), got ", down.shape().DebugString()));
    *out = {{gate.flat<uint8_t>().data(), f, gate_bytes, gate_types_[i]},
            {up.flat<uint8_t>().data(), f, up_bytes, up_types_[i]},
            {down.flat<uint8_t>().data(), d, down_bytes, down_types_[i]}};
  }

  // One expert on its `count` pairs: gather, gate and up, SwiGLU, down, gated scatter-add.
  void RunExpert(tensorflow::thread::ThreadPool* pool, const float* x, int64 d,
                 const float* gates, const BlockExpert& w, const int64* pairs, int64 count,
                 int64 k, float* y, BlockScratch& s) const {
    const int64 f = w.gate.n;
    s.rows.resize(count * d);
    s.gate.resize(count * f);
    s.up.resize(count * f);
    s.product.resize(count * d);
    GatherRows(x, d, pairs, count, k, s.rows.data());
    BlockMatmul(pool, simd_, s.rows.data(), count, d, w.gate, s.gate.data());
    BlockMatmul(pool, simd_, s.rows.data(), count, d, w.up, s.up.data());
    for (int64 i = 0; i < count * f; ++i) {  // silu(g) * u, as tf.nn.silu: g * sigmoid(g)
      const float g = s.gate[i];
      s.gate[i] = g / (1.f + std::exp(-g)) * s.up[i];
    }
    BlockMatmul(pool, simd_, s.gate.data(), count, f, w.down, s.product.data());
    ScatterAdd(s.product.data(), d, gates, pairs, count, k, y);
  }

#ifdef TOKENSERVE_CPU_X86
  // Whether every expert with rows has few enough for the row kernels (moe_gguf.h).
  bool FitRowKernels(const ExpertGroups& groups, const std::vector<BlockExpert>& experts) const {
    if (!simd_) return false;
    for (int64 i = 0; i < static_cast<int64>(experts.size()); ++i) {
      const int64 c = groups.Count(i);
      const BlockExpert& w = experts[i];
      if (c && !(FitsRowKernel(w.gate.type, c) && FitsRowKernel(w.up.type, c) &&
                 FitsRowKernel(w.down.type, c))) {
        return false;
      }
    }
    return true;
  }

  // RunExpert for every expert with rows at once: their gate and up matrices in one
  // dispatch, SwiGLU, their down matrices in a second (RunBlockJobs).
  void RunTogether(tensorflow::thread::ThreadPool* pool, const float* x, int64 d,
                   const float* gates, const std::vector<BlockExpert>& experts,
                   const ExpertGroups& groups, int64 k, float* y) const {
    struct Work {
      int64 expert, count;
      std::vector<float> rows, gate, up, product;
      gguf::Q8Rows xq, hq;
      gguf::Q8KRows xk, hk;
    };
    std::vector<Work> work;
    for (int64 i = 0; i < static_cast<int64>(experts.size()); ++i) {
      if (groups.Count(i)) work.push_back({i, groups.Count(i)});
    }
    std::vector<BlockJob> jobs;
    for (Work& w : work) {
      const BlockExpert& e = experts[w.expert];
      const int64 f = e.gate.n;
      w.rows.resize(w.count * d);
      w.gate.resize(w.count * f);
      w.up.resize(w.count * f);
      w.product.resize(w.count * d);
      GatherRows(x, d, groups.pairs.data() + groups.start[w.expert], w.count, k, w.rows.data());
      QuantizeFor(e.gate.type, w.rows.data(), w.count, d, &w.xq, &w.xk);
      if (IsKQuant(e.up.type) != IsKQuant(e.gate.type)) {  // the other activation blocks too
        QuantizeFor(e.up.type, w.rows.data(), w.count, d, &w.xq, &w.xk);
      }
      jobs.push_back({e.gate, &w.xq, &w.xk, w.count, w.gate.data()});
      jobs.push_back({e.up, &w.xq, &w.xk, w.count, w.up.data()});
    }
    RunBlockJobs(pool, jobs);
    jobs.clear();
    for (Work& w : work) {
      const BlockExpert& e = experts[w.expert];
      const int64 f = e.gate.n;
      for (int64 i = 0; i < w.count * f; ++i) {  // silu(g) * u, as RunExpert
        const float g = w.gate[i];
        w.gate[i] = g / (1.f + std::exp(-g)) * w.up[i];
      }
      QuantizeFor(e.down.type, w.gate.data(), w.count, f, &w.hq, &w.hk);
      jobs.push_back({e.down, &w.hq, &w.hk, w.count, w.product.data()});
    }
    RunBlockJobs(pool, jobs);
    for (const Work& w : work) {
      ScatterAdd(w.product.data(), d, gates, groups.pairs.data() + groups.start[w.expert],
                 w.count, k, y);
    }
  }
#endif

  bool simd_ = false;
  int64 k_ = 1;
  bool normalize_ = false;
  std::vector<BlockType> gate_types_, up_types_, down_types_;
};

REGISTER_KERNEL_BUILDER(Name("TokenserveMoeGgufLayer").Device(DEVICE_CPU), MoeGgufLayerOp);

}  // namespace tokenserve
