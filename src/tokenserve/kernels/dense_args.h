// One dense call's operands, as every float32-activation dense kernel takes them
// (dense_kn.h, dense_nk.h, dense_packed.h, dense_compute.h): float32 activations, sums and
// outputs; weights W float32 or bfloat16. A bfloat16 weight is widened as it is read
// (exact: its bits are a float32's upper half, widen.h), so every kernel does the same
// float32 math on either, and a bfloat16 matrix streams half the bytes.
//
// Internal linkage (an unnamed namespace): every op file that includes this compiles its own
// copy, so its calls stay direct and the compiler inlines and clones it within that file as
// it would the file's own code.
#ifndef TOKENSERVE_KERNELS_DENSE_ARGS_H_
#define TOKENSERVE_KERNELS_DENSE_ARGS_H_

#include <cstdint>

#include "op_support.h"
#include "rowops.h"
#include "widen.h"

namespace tokenserve {
namespace {

using rowops::Activation;

struct DenseGeometry {
  int64 M, K, N;  // x [M, K]; z = x @ W: [M, N]
  int64 out;      // y's width: N, or N / 2 for a gated activation
};

using tensorflow::bfloat16;
using widen::ToFloat;

// One call's operands; W: float or bfloat16 (the weights' storage; x, sums and y are
// float32).
template <typename W>
struct Args {
  const float* x;
  const W* w;
  const float* bias;      // nullptr: none
  const float* residual;  // nullptr: none; [M, out]
  float* y;               // [M, out]
  Activation act;
};

#ifdef TOKENSERVE_CPU_X86
using widen::Load8;  // eight weights as floats: float32, or bfloat16 widened
#endif

}  // namespace
}  // namespace tokenserve

#endif  // TOKENSERVE_KERNELS_DENSE_ARGS_H_
