// Input checks and accessors shared by the float32 and int8 ops (dense.cc, int8_matmul.cc):
// one definition of an optional [n] vector, and of the checks on the next block's norm that
// both finish-block ops take, so the two ops accept and refuse the same inputs with the same
// messages.
#ifndef TOKENSERVE_KERNELS_TENSOR_ARGS_H_
#define TOKENSERVE_KERNELS_TENSOR_ARGS_H_

#include <cstdint>

#include "tensorflow/core/framework/op_kernel.h"

namespace tokenserve {
namespace tensor_args {

// A [n] vector, or an empty tensor standing for "none".
inline bool IsVectorOrEmpty(const tensorflow::Tensor& t, int64_t n) {
  return t.NumElements() == 0 || (t.dims() == 1 && t.dim_size(0) == n);
}

// An optional float input's data, or nullptr when it is empty.
inline const float* Data(const tensorflow::Tensor& t) {
  return t.NumElements() ? t.flat<float>().data() : nullptr;
}

// A finish-block op's optional next-block norm: with the next block's QKV weights given
// (`has_next`; `weights` names that input in messages), scale [d] and bias [d] or empty
// (RMSNorm); without them, these and the QKV bias (`qkv_bias`) all empty. Sets ctx's status
// and returns false otherwise. The QKV bias's width is the caller's to check.
inline bool CheckNextNorm(tensorflow::OpKernelContext* ctx, bool has_next, const char* weights,
                          int64_t d, const tensorflow::Tensor& scale,
                          const tensorflow::Tensor& bias, const tensorflow::Tensor& qkv_bias) {
  using tensorflow::errors::InvalidArgument;
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
  if (!IsVectorOrEmpty(bias, d)) {
    return fail(InvalidArgument("next_norm_bias must be [", d, "] or empty, got ",
                                bias.shape().DebugString()));
  }
  return true;
}

}  // namespace tensor_args
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_TENSOR_ARGS_H_
