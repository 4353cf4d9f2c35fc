"""Calling a traced step: int32 input specs, and the call that skips the signature binding."""

from __future__ import annotations

import tensorflow as tf

I32 = tf.int32


def spec(shape, dtype=I32) -> tf.TensorSpec:
    return tf.TensorSpec(shape, dtype)


class FlatCall:
    """Calls a traced step's concrete function with its inputs already flat, on TF's
    single-threaded executor.

    A concrete function's own call binds the nested arguments (lists of tuples of arrays)
    to its signature and casts each against its TensorSpec: 0.2-0.8 ms a step on a 2-core
    VM, measured against this call with the same inputs (about 6 % of an int8 GPT-2-small
    step at batch 1). Every step input is int32, built by the runner, so the binding checks
    nothing the graph would not. Without `_call_flat` (a TensorFlow that renamed it), it
    falls back to the public call.

    The executor: TF's default one hands ready nodes between threads and keeps per-node
    bookkeeping for that; a step is a chain of 500-800 nodes with no control flow (no
    AutoGraph), each op already parallel inside, so SINGLE_THREADED_EXECUTOR runs it in
    order on the calling thread. Two LLMs on one GPT-2-small export in one process,
    alternating (AVX2 cap): int8 one stream 1.17x, 4 prompts 1.08x; float32 1.11x and 1.11x;
    the same greedy tokens (docs/performance.md)."""

    EXECUTOR = "SINGLE_THREADED_EXECUTOR"

    def __init__(self, concrete, int32_inputs: bool = True):
        self.concrete = concrete
        self.int32_inputs = int32_inputs  # False: the inputs are tensors already
        self._call_flat = getattr(concrete, "_call_flat", None)
        self._captured = concrete.captured_inputs if self._call_flat else None
        self._num_inputs = len(tf.nest.flatten(concrete.structured_input_signature))

    def __call__(self, *args):
        with tf.experimental.function_executor_type(self.EXECUTOR):
            if self._call_flat is None:
                return self.concrete(*args)
            inputs = tf.nest.flatten(args)
            if self.int32_inputs:
                inputs = [tf.constant(x, I32) for x in inputs]
            if len(inputs) != self._num_inputs:  # the runner picked the wrong step: say so
                raise ValueError(f"step called with {len(inputs)} inputs, traced for "
                                 f"{self._num_inputs}")
            return self._call_flat(inputs, self._captured)
