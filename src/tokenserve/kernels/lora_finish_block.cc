// The LoRA ops: TokenserveLoraFinishBlock, TokenserveFinishBlock (finish_block.cc) with each
// row's LoRA delta on its four projections (output, MLP up, MLP down, the next block's QKV),
// so a step with adapter rows keeps the base step's one op per layer; and TokenserveLoraDelta,
// one projection's deltas added to its product (the step's first QKV, graph steps).
//
// Each delta is the row's own adapter's low-rank product, rows grouped by adapter and read
// from the slot table's variables in place (lora_delta.h): no product for other adapters'
// columns, no copy of the table, one call of the thread team per projection. `in` is the
// projection's own input (attn, the MLP norm's rows, the activation's rows, the next norm's
// rows), all of which the block op holds; up's product is finished (bias, delta) and only
// then activated. The next block's QKV reads layer + 1.
//
// Float32 arithmetic; the block's matrices float32 or bfloat16 (attribute T), the factors
// float32.

#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "finish_block.h"
#include "lora_delta.h"
#include "op_support.h"

namespace tokenserve {

REGISTER_OP("TokenserveLoraFinishBlock")
    .Input("attn: float")             // [M, Da]
    .Input("x: float")                // [M, D]
    .Input("out_w: T")                // [Da, D]
    .Input("out_bias: float")         // [D] or [0]
    .Input("norm_scale: float")       // [D]
    .Input("norm_bias: float")        // [D] or [0]
    .Input("up_w: T")                 // [D, F]
    .Input("up_bias: float")          // [F] or [0]
    .Input("down_w: T")               // [F, D] (F / 2 rows for swiglu)
    .Input("down_bias: float")        // [D] or [0]
    .Input("next_norm_scale: float")  // [D] or [0]
    .Input("next_norm_bias: float")   // [D] or [0]
    .Input("next_w: T")               // [D, Nq] or [0, 0]
    .Input("next_bias: float")        // [Nq] or [0]
    .Input("order: int32")            // [M] the rows sorted by slot
    .Input("offsets: int32")          // [S + 2] slot s's rows: order[offsets[s]:offsets[s+1]]
    .Input("out_a: num_slots * float")   // S x [L, Da, Ro]
    .Input("out_b: num_slots * float")   // S x [L, Ro, D]
    .Input("up_a: num_slots * float")    // S x [L, D, Ru]
    .Input("up_b: num_slots * float")    // S x [L, Ru, F]
    .Input("down_a: num_slots * float")  // S x [L, F or F / 2, Rd]
    .Input("down_b: num_slots * float")  // S x [L, Rd, D]
    .Input("next_a: num_slots * float")  // S x [L, D, Rq] (read only with next_w)
    .Input("next_b: num_slots * float")  // S x [L, Rq, Nq]
    .Input("spans: num_slots * int32")   // S x [L, 4, P, 4] what each slot fills (lora_delta.h)
    .Output("y: float")               // [M, D]
    .Output("next: float")            // [M, Nq], or [M, 0] without a next block
    .Attr("num_slots: int >= 1")
    .Attr("layer: int >= 0")          // this block's layer of the factors
    .Attr("activation: {'gelu_tanh', 'swiglu'} = 'gelu_tanh'")
    .Attr("T: {float, bfloat16} = DT_FLOAT")
    .Attr("eps: float = 1e-5")
    .Attr("isa: {'auto', 'scalar'} = 'auto'")
    .SetShapeFn(FinishBlockShape<12, 1>)  // Nq: next_w's (input 12) columns
    .Doc("TokenserveFinishBlock with each row's LoRA delta (in @ A_s) @ B_s on out, up, "
         "down and next, rows grouped by slot s.");

// RunFinishBlock's hook: each projection's deltas. A few adapter rows' run beside the
// projection's product (FewLoraDeltas, as ComputeDense's `side`) and are added after it;
// more rows' run after it, in a call of the thread team of their own.
struct LoraDeltas {
  static constexpr bool kAdds = true;
  struct Side {  // one projection's deltas computed beside its product
    FewLoraDeltas few;
    const LoraFactor* factor = nullptr;
    const LoraGroups* groups = nullptr;
    const float* in = nullptr;
    bool pending = false;
    std::function<void()> work = [this] { few.Compute(*factor, *groups, in); };
  };
  tensorflow::thread::ThreadPool* pool;
  const LoraGroups* groups;
  const LoraFactor* factors;  // [4], by Projection
  Side* beside;               // [4], by Projection

  const std::function<void()>* Beside(Projection projection, const float* in) const {
    Side& side = beside[static_cast<int>(projection)];
    side.factor = &factors[static_cast<int>(projection)];
    side.groups = groups;
    side.in = in;
    side.pending = side.few.Plan(*groups, *side.factor);
    return side.pending ? &side.work : nullptr;
  }

  void operator()(Projection projection, const float* in, float* z) const {
    const int p = static_cast<int>(projection);
    if (beside[p].pending) {
      beside[p].few.AddTo(factors[p], *groups, z);
      beside[p].pending = false;
      return;
    }
    AddLoraDelta(pool, *groups, factors[p], in, z);
  }
};

class LoraFinishBlockOp : public OpKernel {
 public:
  explicit LoraFinishBlockOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    act_ = ActivationAttr(ctx);
    OP_REQUIRES_OK(ctx, ctx->GetAttr("eps", &eps_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_slots", &num_slots_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("layer", &layer_));
    avx2_ = Avx2Attr(ctx);
  }

  void Compute(OpKernelContext* ctx) override {
    BlockDims s;
    if (!CheckFinishBlockInputs(ctx, act_, &s)) return;
    LoraGroups groups;
    if (!ReadLoraGroups(ctx, 14, s.m, num_slots_, &groups)) return;
    // each projection's factors at this layer (the next block's at the next layer)
    const int first = 16, per = 2 * num_slots_, spans = first + 4 * per;
    struct {
      int64 width, out, layer, role;  // role: the spans' (qkv, out, up, down)
      const char* name;
    } shapes[] = {{s.da, s.d, layer_, 1, "out"}, {s.d, s.f, layer_, 2, "up"},
                  {s.inner, s.d, layer_, 3, "down"}, {s.d, s.nq, layer_ + 1, 0, "next"}};
    LoraFactor factors[4];
    for (int i = 0; i < (s.has_next ? 4 : 3); ++i) {
      if (!ReadLoraFactor(ctx, first + i * per, spans, num_slots_, shapes[i].layer,
                          shapes[i].role, shapes[i].width, shapes[i].out, shapes[i].name,
                          &factors[i])) {
        return;
      }
    }
    Tensor* y_tensor = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({s.m, s.d}), &y_tensor));
    Tensor* next_tensor = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({s.m, s.nq}), &next_tensor));
    if (s.m == 0 || s.d == 0) return;
    LoraDeltas::Side beside[4];
    const LoraDeltas deltas{WorkerPool(ctx), &groups, factors, beside};
    float* y = y_tensor->flat<float>().data();
    float* next = next_tensor->flat<float>().data();
    if (ctx->input(2).dtype() == tensorflow::DT_BFLOAT16) {
      RunFinishBlock<bfloat16>(ctx, s, act_, eps_, avx2_, y, next, deltas);
    } else {
      RunFinishBlock<float>(ctx, s, act_, eps_, avx2_, y, next, deltas);
    }
  }

 private:
  Activation act_ = Activation::kGeluTanh;
  float eps_ = 1e-5f;
  int num_slots_ = 1;
  int64 layer_ = 0;
  bool avx2_ = false;
};

REGISTER_KERNEL_BUILDER(Name("TokenserveLoraFinishBlock").Device(DEVICE_CPU),
                        LoraFinishBlockOp);

REGISTER_OP("TokenserveLoraDelta")
    .Input("y: float")                // [M, out] the projection's product
    .Input("x: float")                // [M, in] its input
    .Input("order: int32")            // [M] the rows sorted by slot
    .Input("offsets: int32")          // [S + 2]
    .Input("a: num_slots * float")    // S x [L, in, R]
    .Input("b: num_slots * float")    // S x [L, R, out]
    .Input("spans: num_slots * int32")  // S x [L, 4, P, 4] what each slot fills (lora_delta.h)
    .Output("z: float")               // [M, out] y + each row's delta
    .Attr("num_slots: int >= 1")
    .Attr("layer: int >= 0")
    .Attr("role: int >= 0 = 0")       // the spans' role: 0 qkv, 1 out, 2 up, 3 down
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(0));
      return absl::OkStatus();
    })
    .Doc("y + each row's LoRA delta (x @ A_s[layer]) @ B_s[layer], rows grouped by slot s.");

class LoraDeltaOp : public OpKernel {
 public:
  explicit LoraDeltaOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_slots", &num_slots_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("layer", &layer_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("role", &role_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& y = ctx->input(0);
    const Tensor& x = ctx->input(1);
    OP_REQUIRES(ctx, y.dims() == 2 && x.dims() == 2 && y.dim_size(0) == x.dim_size(0),
                InvalidArgument("y and x must be [M, out] and [M, in], got ",
                                y.shape().DebugString(), " and ", x.shape().DebugString()));
    const int64 m = x.dim_size(0);
    LoraGroups groups;
    if (!ReadLoraGroups(ctx, 2, m, num_slots_, &groups)) return;
    LoraFactor factor;
    if (!ReadLoraFactor(ctx, 4, 4 + 2 * num_slots_, num_slots_, layer_, role_, x.dim_size(1),
                        y.dim_size(1), "x", &factor)) {
      return;
    }
    Tensor* z = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 0, y.shape(), &z));
    float* out = z->flat<float>().data();
    if (out != y.flat<float>().data() && y.NumElements() > 0) {
      std::memcpy(out, y.flat<float>().data(), y.NumElements() * sizeof(float));
    }
    if (m == 0) return;
    AddLoraDelta(WorkerPool(ctx), groups, factor, x.flat<float>().data(), out);
  }

 private:
  int num_slots_ = 1;
  int64 layer_ = 0;
  int64 role_ = 0;
};

REGISTER_KERNEL_BUILDER(Name("TokenserveLoraDelta").Device(DEVICE_CPU), LoraDeltaOp);

}  // namespace tokenserve
