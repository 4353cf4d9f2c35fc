// What the ops' files repeat, written once: TensorFlow's names, the `isa` and `activation`
// attributes, the thread pool, the info op that says which instruction set a library's
// kernels take on this CPU, the finish-block ops' shape function, and the checks and
// accessors of inputs (an empty tensor stands for "none"), so ops that take the same inputs
// (the float32 and int8 finish-block ops) accept and refuse them with the same messages.
#ifndef TOKENSERVE_KERNELS_OP_SUPPORT_H_
#define TOKENSERVE_KERNELS_OP_SUPPORT_H_

#include <cstdint>
#include <string>

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/platform/threadpool.h"
#include "cpu.h"
#include "rowops.h"

namespace tokenserve {

using int64 = int64_t;
using tensorflow::DEVICE_CPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::errors::InvalidArgument;
using tensorflow::shape_inference::DimensionHandle;
using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;

// ---- attributes ---------------------------------------------------------------------------

// A string attribute; "" with ctx failed when it cannot be read.
inline std::string StringAttr(OpKernelConstruction* ctx, const char* name) {
  std::string value;
  const absl::Status status = ctx->GetAttr(name, &value);
  if (!status.ok()) ctx->CtxFailure(__FILE__, __LINE__, status);
  return value;
}

// The `isa` attribute: true (the AVX2 path) for "auto" where the CPU has what `cpu_has`
// checks; "scalar" takes the portable path (tests).
inline bool Avx2Attr(OpKernelConstruction* ctx, bool (*cpu_has)() = cpu::HasAvx2Fma) {
  return StringAttr(ctx, "isa") == "auto" && cpu_has();
}

// The `activation` attribute: "none", "gelu_tanh", "swiglu" or "geglu".
inline rowops::Activation ActivationAttr(OpKernelConstruction* ctx) {
  const std::string activation = StringAttr(ctx, "activation");
  return activation == "gelu_tanh" ? rowops::Activation::kGeluTanh
       : activation == "swiglu"    ? rowops::Activation::kSwiglu
       : activation == "geglu"     ? rowops::Activation::kGeglu
                                   : rowops::Activation::kNone;
}

// A gated activation's name, for messages ("swiglu needs an even up width").
inline const char* GatedName(rowops::Activation act) {
  return act == rowops::Activation::kGeglu ? "geglu" : "swiglu";
}

// TF's intra-op threads, which the ops share their work with (chunks.h).
inline tensorflow::thread::ThreadPool* WorkerPool(OpKernelContext* ctx) {
  return ctx->device()->tensorflow_cpu_worker_threads()->workers;
}

// ---- the info op --------------------------------------------------------------------------

// Each library's info op (registered with one string output and ScalarShape): the
// instruction set its kernels take on this CPU, as `describe` names it. kernel_status()
// reports it.
template <const char* (*describe)()>
class IsaInfoOp : public OpKernel {
 public:
  explicit IsaInfoOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}
  void Compute(OpKernelContext* ctx) override {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &out));
    out->scalar<tensorflow::tstring>()() = describe();
  }
};

// ---- shape functions ----------------------------------------------------------------------

// A finish-block op's outputs: y like x (input 1, [M, D]) and next [M, Nq], Nq the dimension
// kNqAxis of the next block's QKV weights (input kNextWeights; [0, 0] without a next block).
template <int kNextWeights, int kNqAxis>
absl::Status FinishBlockShape(InferenceContext* c) {
  ShapeHandle x, next_w;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &x));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(kNextWeights), 2, &next_w));
  c->set_output(0, x);
  c->set_output(1, c->Matrix(c->Dim(x, 0), c->Dim(next_w, kNqAxis)));
  return absl::OkStatus();
}

// ---- inputs (an empty tensor stands for "none" where one is optional) ---------------------

// A [rows, cols] matrix.
inline bool IsMatrix(const Tensor& t, int64 rows, int64 cols) {
  return t.dims() == 2 && t.dim_size(0) == rows && t.dim_size(1) == cols;
}

// A [n] vector, or an empty tensor standing for "none".
inline bool IsVectorOrEmpty(const Tensor& t, int64 n) {
  return t.NumElements() == 0 || (t.dims() == 1 && t.dim_size(0) == n);
}

// Whether input `name` is a [n] vector; sets ctx's status and returns false otherwise.
inline bool CheckVector(OpKernelContext* ctx, const char* name, const Tensor& t, int64 n) {
  if (t.dims() == 1 && t.dim_size(0) == n) return true;
  ctx->CtxFailure(__FILE__, __LINE__, InvalidArgument(name, " must be [", n, "], got ",
                                                      t.shape().DebugString()));
  return false;
}

// Whether optional input `name` is a [n] vector or empty; sets ctx's status and returns
// false otherwise.
inline bool CheckVectorOrEmpty(OpKernelContext* ctx, const char* name, const Tensor& t,
                               int64 n) {
  if (IsVectorOrEmpty(t, n)) return true;
  ctx->CtxFailure(__FILE__, __LINE__, InvalidArgument(name, " must be [", n, "] or empty, got ",
                                                      t.shape().DebugString()));
  return false;
}

// An optional float input's data, or nullptr when it is empty.
inline const float* Data(const Tensor& t) {
  return t.NumElements() ? t.flat<float>().data() : nullptr;
}

// A finish-block op's optional next-block norm: with the next block's QKV weights given
// (`has_next`; `weights` names that input in messages), scale [d] and bias [d] or empty
// (RMSNorm); without them, these and the QKV bias (`qkv_bias`) all empty. Sets ctx's status
// and returns false otherwise. The QKV bias's width is the caller's to check.
inline bool CheckNextNorm(OpKernelContext* ctx, bool has_next, const char* weights, int64 d,
                          const Tensor& scale, const Tensor& bias, const Tensor& qkv_bias) {
  auto fail = [ctx](const absl::Status& status) {
    ctx->CtxFailure(__FILE__, __LINE__, status);
    return false;
  };
  if (!has_next) {
    if (scale.NumElements() == 0 && bias.NumElements() == 0 && qkv_bias.NumElements() == 0) {
      return true;
    }
    return fail(InvalidArgument("next_norm_scale, next_norm_bias and next_bias need ", weights));
  }
  if (scale.dims() != 1 || scale.dim_size(0) != d) {
    return fail(InvalidArgument("next_norm_scale must be [", d, "] with ", weights,
                                " given, got ", scale.shape().DebugString()));
  }
  return CheckVectorOrEmpty(ctx, "next_norm_bias", bias, d);
}

}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_OP_SUPPORT_H_
