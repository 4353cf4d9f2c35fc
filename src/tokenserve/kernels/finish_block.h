// What the float32/bfloat16 finish-block ops share (TokenserveFinishBlock, finish_block.cc,
// and TokenserveLoraFinishBlock, lora_finish_block.cc): the checks of their first fourteen
// inputs (the same inputs, refused with the same messages) and the block's arithmetic, with
// a hook that adds something to each projection's product (the LoRA op's deltas; the plain
// op passes NoDelta and keeps the activation fused into up's product).
//
// Inputs 0..13, as both ops register them:
//   0 attn [M, Da]   1 x [M, D]   2 out_w [Da, D]   3 out_bias [D] or [0]
//   4 norm_scale [D]   5 norm_bias [D] or [0]   6 up_w [D, F]   7 up_bias [F] or [0]
//   8 down_w [F or F / 2, D]   9 down_bias [D] or [0]
//   10 next_norm_scale [D] or [0]   11 next_norm_bias [D] or [0]   12 next_w [D, Nq] or
//   [0, 0]   13 next_bias [Nq] or [0]
#ifndef TOKENSERVE_KERNELS_FINISH_BLOCK_H_
#define TOKENSERVE_KERNELS_FINISH_BLOCK_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "dense_args.h"
#include "dense_compute.h"
#include "op_support.h"
#include "rowops.h"

namespace tokenserve {
namespace {

// The block's sizes, read from its inputs by CheckFinishBlockInputs.
struct BlockDims {
  int64 m, d, da, f, inner, nq;  // rows, model width, attn width, up width, down rows, QKV
  bool has_next;                 // the next block's norm and QKV follow
  // post-norms (Gemma 2 and 3): RMSNorm scales [D] of the attention and MLP branches'
  // outputs, applied before each residual add; the plain op's inputs 14 and 15, or none
  const float* post_attn = nullptr;
  const float* post_mlp = nullptr;
};

// z [m, d] <- residual + RMSNorm(z) * scale, row by row (the graph's x + norm(h): the norm
// rounded to float32 before the add). NormRow may write over its input.
inline void NormAddRows(bool avx2, int64 m, int64 d, const float* scale, float eps,
                        const float* residual, float* z) {
  for (int64 r = 0; r < m; ++r) {
    float* row = z + r * d;
    rowops::NormRow(avx2, d, row, scale, nullptr, eps, row);
    const float* res = residual + r * d;
    for (int64 j = 0; j < d; ++j) row[j] += res[j];
  }
}

// The four projections, in the order the block computes them (a delta hook's first
// argument).
enum class Projection { kOut = 0, kUp = 1, kDown = 2, kNext = 3 };

// The plain block: nothing added to any product.
struct NoDelta {
  static constexpr bool kAdds = false;
  const std::function<void()>* Beside(Projection, const float*) const { return nullptr; }
  void operator()(Projection, const float*, float*) const {}
};

// Checks inputs 0..13 for activation `act`; sets ctx's status and returns false when one
// does not fit.
inline bool CheckFinishBlockInputs(OpKernelContext* ctx, rowops::Activation act,
                                   BlockDims* dims) {
  auto fail = [ctx](const absl::Status& status) {
    ctx->CtxFailure(__FILE__, __LINE__, status);
    return false;
  };
  const Tensor& attn = ctx->input(0);
  const Tensor& x = ctx->input(1);
  const Tensor& out_w = ctx->input(2);
  const Tensor& norm_scale = ctx->input(4);
  const Tensor& up_w = ctx->input(6);
  const Tensor& down_w = ctx->input(8);
  if (!(attn.dims() == 2 && x.dims() == 2 && attn.dim_size(0) == x.dim_size(0))) {
    return fail(InvalidArgument("attn and x must be [M, Da] and [M, D], got ",
                                attn.shape().DebugString(), " and ", x.shape().DebugString()));
  }
  const int64 m = x.dim_size(0), d = x.dim_size(1), da = attn.dim_size(1);
  if (!IsMatrix(out_w, da, d)) {
    return fail(InvalidArgument("out_w must be [Da, D] = [", da, ", ", d, "], got ",
                                out_w.shape().DebugString()));
  }
  if (!CheckVector(ctx, "norm_scale", norm_scale, d)) return false;
  if (!(up_w.dims() == 2 && up_w.dim_size(0) == d && up_w.dim_size(1) > 0)) {
    return fail(InvalidArgument("up_w must be [D, F] with D = ", d, ", got ",
                                up_w.shape().DebugString()));
  }
  const int64 f = up_w.dim_size(1);
  const bool gated = rowops::Gated(act);
  if (gated && f % 2 != 0) {
    return fail(InvalidArgument(GatedName(act), " needs an even up width, got ", f));
  }
  const int64 inner = gated ? f / 2 : f;
  if (!IsMatrix(down_w, inner, d)) {
    return fail(InvalidArgument("down_w must be [", inner, ", ", d, "], got ",
                                down_w.shape().DebugString()));
  }
  const int64 widths[] = {d, d, f, d};  // out_bias, norm_bias, up_bias, down_bias
  const char* names[] = {"out_bias", "norm_bias", "up_bias", "down_bias"};
  for (int i = 0; i < 4; ++i) {
    if (!CheckVectorOrEmpty(ctx, names[i], ctx->input(3 + 2 * i), widths[i])) return false;
  }
  // the next block's norm and QKV: all given, or all empty
  const Tensor& next_w = ctx->input(12);
  const Tensor& next_bias = ctx->input(13);
  const bool has_next = next_w.NumElements() > 0;
  const int64 nq = has_next ? next_w.dim_size(1) : 0;
  if (has_next && !(next_w.dims() == 2 && next_w.dim_size(0) == d)) {
    return fail(InvalidArgument("next_w must be [D, Nq] with D = ", d, ", got ",
                                next_w.shape().DebugString()));
  }
  if (!CheckNextNorm(ctx, has_next, "next_w", d, ctx->input(10), ctx->input(11), next_bias)) {
    return false;
  }
  if (!CheckVectorOrEmpty(ctx, "next_bias", next_bias, nq)) return false;
  *dims = {m, d, da, f, inner, nq, has_next};
  return true;
}

// The block's arithmetic once its inputs are checked (W: the matrices' storage type), into
// y [M, D] and next [M, Nq]. `delta(projection, in, z)` adds to each product z [M, width]
// computed from its input rows in [M, width_in] before the product's activation (up's
// product is finished, delta added, then activated); NoDelta keeps the activation inside
// up's product, as the plain op always did. `delta.Beside(projection, in)` is work the
// product runs beside its own before delta() is called (ComputeDense's `side`), or nullptr.
template <typename W, typename Delta>
void RunFinishBlock(OpKernelContext* ctx, const BlockDims& s, rowops::Activation act,
                    float eps, bool avx2, float* y, float* next, const Delta& delta) {
  using rowops::Activation;
  auto* pool = WorkerPool(ctx);
  auto in = [ctx](int i) { return ctx->input(i).flat<float>().data(); };
  auto weights = [ctx](int i) { return ctx->input(i).flat<W>().data(); };
  const int64 m = s.m, d = s.d, f = s.f, inner = s.inner;
  std::vector<float> x1(m * d), h(m * d), u(m * inner);
  // x1 = attn @ out_w + out_bias + x (post-norm: x + rms(attn @ out_w + out_bias))
  ComputeDense<W>({m, s.da, d, d}, {in(0), weights(2), Data(ctx->input(3)),
                                    s.post_attn ? nullptr : in(1), x1.data(),
                                    Activation::kNone},
                  true, pool, avx2, delta.Beside(Projection::kOut, in(0)));
  delta(Projection::kOut, in(0), x1.data());
  if (s.post_attn) NormAddRows(avx2, m, d, s.post_attn, eps, in(1), x1.data());
  // h = norm(x1)
  for (int64 r = 0; r < m; ++r) {
    rowops::NormRow(avx2, d, x1.data() + r * d, in(4), Data(ctx->input(5)), eps,
                    h.data() + r * d);
  }
  // u = act(h @ up_w + up_bias (+ delta))
  if constexpr (Delta::kAdds) {
    std::vector<float> z(m * f);
    ComputeDense<W>({m, d, f, f}, {h.data(), weights(6), Data(ctx->input(7)), nullptr,
                                   z.data(), Activation::kNone},
                    true, pool, avx2, delta.Beside(Projection::kUp, h.data()));
    delta(Projection::kUp, h.data(), z.data());
    rowops::FinishRows(avx2, m, f, inner, act, z.data(), nullptr, nullptr, u.data());
  } else {
    ComputeDense<W>({m, d, f, inner}, {h.data(), weights(6), Data(ctx->input(7)), nullptr,
                                       u.data(), act},
                    true, pool, avx2);
  }
  // y = u @ down_w + down_bias + x1 (post-norm: x1 + rms(u @ down_w + down_bias))
  ComputeDense<W>({m, inner, d, d}, {u.data(), weights(8), Data(ctx->input(9)),
                                     s.post_mlp ? nullptr : x1.data(), y, Activation::kNone},
                  true, pool, avx2, delta.Beside(Projection::kDown, u.data()));
  delta(Projection::kDown, u.data(), y);
  if (s.post_mlp) NormAddRows(avx2, m, d, s.post_mlp, eps, x1.data(), y);
  if (!s.has_next) return;
  // next = next_norm(y) @ next_w + next_bias (the norm's rows reuse h)
  for (int64 r = 0; r < m; ++r) {
    rowops::NormRow(avx2, d, y + r * d, in(10), Data(ctx->input(11)), eps, h.data() + r * d);
  }
  ComputeDense<W>({m, d, s.nq, s.nq}, {h.data(), weights(12), Data(ctx->input(13)), nullptr,
                                       next, Activation::kNone},
                  true, pool, avx2, delta.Beside(Projection::kNext, h.data()));
  delta(Projection::kNext, h.data(), next);
}

}  // namespace
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_FINISH_BLOCK_H_
