// TokenservePagedWriteDecodeAttention's writes: a step's new K/V rows stored into the cache
// variables before the op attends, converted as tf.cast converts.
//
// Internal linkage (an unnamed namespace): every op file that includes this compiles its own
// copy, so its calls stay direct and the compiler inlines and clones it within that file as
// it would the file's own code.
#ifndef TOKENSERVE_KERNELS_PAGED_WRITE_H_
#define TOKENSERVE_KERNELS_PAGED_WRITE_H_

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "tensorflow/core/framework/resource_var.h"
#include "op_support.h"
#include "paged_item.h"

namespace tokenserve {
namespace {

using tensorflow::Var;

// A new cache value, converted as tf.cast converts (Eigen's round-to-nearest-even; a NaN
// stays a NaN); a half cache first saturates at +-65504, as the engine's graph path clips
// before its cast, so a rare large value does not become an infinity.
template <typename T, typename C>
inline C ToCache(T v) {
  if constexpr (std::is_same_v<T, C>) {
    return v;
  } else if constexpr (std::is_same_v<C, Half>) {
    float x = static_cast<float>(v);
    x = x > 65504.f ? 65504.f : (x < -65504.f ? -65504.f : x);  // NaN passes through
    return static_cast<Half>(x);
  } else {
    return static_cast<C>(static_cast<float>(v));
  }
}

// The op's new rows (inputs 5-7: new_keys and new_values T [N, width], write_rows [N]) into
// both caches (the locks held exclusively), as ResourceScatterUpdate would write them: a
// buffer that another tensor still references is first replaced by a copy, and the variable
// is put in copy-on-read mode, as TF's sparse writes do (EnsureSparseVariableAccess), so a
// later dense read copies rather than aliasing a buffer written in place. Duplicate rows:
// the last write wins (the engine's padding rows all write the same values to row 0).
template <typename T, typename C>
void WriteRows(OpKernelContext* ctx, const Geometry& g, Var* key_var, Var* value_var) {
  const Tensor& new_keys = ctx->input(5);
  const Tensor& new_values = ctx->input(6);
  const Tensor& write_rows = ctx->input(7);
  OP_REQUIRES(ctx, write_rows.dims() == 1,
              InvalidArgument("write_rows must be [N], got shape ",
                              write_rows.shape().DebugString()));
  const int64 n = write_rows.dim_size(0);
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"new_keys", &new_keys},
                                {"new_values", &new_values}}) {
    OP_REQUIRES(ctx, t->dims() == 2 && t->dim_size(0) == n && t->dim_size(1) == g.width,
                InvalidArgument(name, " must be [N = ", n, ", ", g.width, "], got shape ",
                                t->shape().DebugString()));
  }
  const int32_t* where = write_rows.flat<int32_t>().data();
  for (int64 i = 0; i < n; ++i) {
    OP_REQUIRES(ctx, where[i] >= 0 && where[i] < g.R,
                InvalidArgument("write_rows[", i, "] = ", where[i], " is not in [0, ", g.R,
                                ")"));
  }
  for (Var* var : {key_var, value_var}) {
    if (var->copy_on_read_mode.load()) continue;
    if (!var->tensor()->RefCountIsOne()) {
      Tensor copy;
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(var->tensor()->dtype(), var->tensor()->shape(),
                                             &copy));
      std::memcpy(copy.data(), var->tensor()->data(), var->tensor()->TotalBytes());
      *var->tensor() = copy;
    }
    var->copy_on_read_mode.store(true);
  }
  const std::pair<Var*, const Tensor*> writes[] = {{key_var, &new_keys},
                                                    {value_var, &new_values}};
  for (const std::pair<Var*, const Tensor*>& write : writes) {
    const T* src = write.second->template flat<T>().data();
    C* dst = write.first->tensor()->template flat<C>().data();
    for (int64 i = 0; i < n; ++i) {
      C* row = dst + static_cast<int64>(where[i]) * g.width;
      const T* from = src + i * g.width;
      for (int64 j = 0; j < g.width; ++j) row[j] = ToCache<T, C>(from[j]);
    }
  }
}

}  // namespace
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_PAGED_WRITE_H_
