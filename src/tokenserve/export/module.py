"""The exported graph: every signature, compiled once with an explicit input signature.

Signatures (all inputs int32 unless noted):
  serving_default  input_ids [B, S] -> predicted_id [B]    greedy next token
  generate         input_ids [B, S], max_new_tokens [], temperature f32 [], top_k [],
                   top_p f32 [], seed [] -> output_ids [B, N], num_generated [B]
  init_state       batch_size [], max_len [] -> state
  prefill          token_ids [B, T], positions [B], num_tokens [B], state -> logits, state
  decode           token_ids [B, 1], positions [B], state -> logits, state

Prompts are right-padded with the pad token; a row's length is its count of
non-pad tokens. `generate` runs prefill and the whole decode loop in one XLA
program; its KV cache is loop state, so XLA updates it in place.
"""

from __future__ import annotations

import tensorflow as tf

from tokenserve.config import GenerationConfig, TransformerConfig
from tokenserve.model.base import DecoderLM
from tokenserve.model.sampling import sample

MIN_BUCKET = 16
MAX_INIT_STATE_BYTES = 1 << 30
"""The largest state `init_state` makes. Its two scalar inputs would otherwise let a request
of a few bytes allocate any amount of memory (a million rows of the built-in model's cache
are 6 GB), and the state is returned whole: a gRPC reply cannot pass 2 GiB anyway."""


def buckets(max_len: int) -> list[int]:
    """Static lengths that caches and prompts are padded to: 16, 32, ..., max_len."""
    sizes, size = [], MIN_BUCKET
    while size < max_len:
        sizes.append(size)
        size *= 2
    return sizes + [max_len]


class GenerationModule(tf.Module):
    """Wraps a DecoderLM in the tf.functions that go into the SavedModel."""

    def __init__(self, model: DecoderLM, config: GenerationConfig, jit_compile: bool = True):
        super().__init__(name="tokenserve")
        # Track the Keras model's underlying tf.Variables, not the Keras objects: Keras 3
        # saves each of its variables as a second resource that the functions never read, so
        # a TF1-style loader (TF Serving's SavedModelBundle, a Session) restored one handle
        # while the graph read the other ("Could not find variable ..." on every call).
        object.__setattr__(self, "model", model)
        self.model_variables = [weight.value for weight in model.weights]
        self.config = config
        self.jit_compile = jit_compile
        self.pad_id = config.pad_token_id
        self.eos_id = config.eos_token_id
        self.max_len = config.max_seq_len
        # An LSTM's state has no length axis: one cache size serves every request.
        is_transformer = isinstance(config.model, TransformerConfig)
        self.cache_buckets = buckets(self.max_len) if is_transformer else [self.max_len]
        state_dtype = model.init_state(1, 1).dtype  # the compute dtype; an LSTM's is float32
        self.state_spec = tf.TensorSpec(model.state_shape(None, None), state_dtype, name="state")
        # One XLA loop per cache bucket, each with a static cache length.
        self._loops = [self._make_loop(size) for size in self.cache_buckets]

        ids = tf.TensorSpec([None, None], tf.int32, name="input_ids")
        scalar_i = lambda name: tf.TensorSpec([], tf.int32, name=name)  # noqa: E731
        scalar_f = lambda name: tf.TensorSpec([], tf.float32, name=name)  # noqa: E731
        vector = lambda name: tf.TensorSpec([None], tf.int32, name=name)  # noqa: E731
        self.serving_default = tf.function(self._serving_default, input_signature=[ids])
        self.generate = tf.function(self._generate, input_signature=[
            ids, scalar_i("max_new_tokens"), scalar_f("temperature"), scalar_i("top_k"),
            scalar_f("top_p"), scalar_i("seed")])
        self.init_state = tf.function(self._init_state, input_signature=[
            scalar_i("batch_size"), scalar_i("max_len")])
        self._step = tf.function(self.model.step, jit_compile=jit_compile, input_signature=[
            tf.TensorSpec([None, None], tf.int32), self.state_spec,
            tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], tf.int32)])
        self.prefill = tf.function(self._prefill, input_signature=[
            tf.TensorSpec([None, None], tf.int32, name="token_ids"), vector("positions"),
            vector("num_tokens"), self.state_spec])
        self.decode = tf.function(self._decode, input_signature=[
            tf.TensorSpec([None, 1], tf.int32, name="token_ids"), vector("positions"),
            self.state_spec])

    def signatures(self) -> dict:
        return {"serving_default": self.serving_default, "generate": self.generate,
                "init_state": self.init_state, "prefill": self.prefill, "decode": self.decode}

    # -- helpers ------------------------------------------------------------------------------
    def _lengths(self, input_ids):
        return tf.reduce_sum(tf.cast(tf.not_equal(input_ids, self.pad_id), tf.int32), axis=1)

    @staticmethod
    def _checked(*tensors):
        """Rejects a tensor whose shape breaks the signature, naming it.

        Signature wrappers of a loaded SavedModel do not check shapes, so a
        rank-1 `input_ids` would otherwise fail deep inside with an opaque error.
        """
        return [tf.ensure_shape(t, t.shape, name=f"check_{t.name.split(':')[0]}")
                for t in tensors]

    def _check_fits(self, num_tokens, what: str):
        # int64: a prompt's length plus max_new_tokens near 2**31 must not wrap and pass
        return tf.debugging.assert_less_equal(
            tf.cast(num_tokens, tf.int64), tf.constant(self.max_len, tf.int64),
            message=f"{what} exceeds the model's context length of {self.max_len} tokens")

    def _check_ids(self, ids, name: str):
        """Every token id must be in the vocabulary: the XLA step's gather clamps one that is
        not, and the answer would be computed from another token without a word."""
        vocab = self.config.model.vocab_size
        return tf.debugging.assert_equal(
            tf.reduce_all(tf.logical_and(ids >= 0, ids < vocab)), True,
            message=f"{name} holds a token id outside the vocabulary [0, {vocab})")

    @staticmethod
    def _check_number(value, name: str):
        return tf.debugging.assert_equal(tf.math.is_finite(value), True,
                                         message=f"{name} must be a finite number")

    # -- signatures ---------------------------------------------------------------------------
    def _serving_default(self, input_ids):
        (input_ids,) = self._checked(input_ids)
        length = tf.shape(input_ids)[1]
        with tf.control_dependencies([self._check_fits(length, "input_ids length"),
                                      self._check_ids(input_ids, "input_ids")]):
            batch = tf.shape(input_ids)[0]
            state = self.model.init_state(batch, tf.maximum(length, 1))
            logits, _ = self.model.step(input_ids, state, tf.zeros([batch], tf.int32),
                                        self._lengths(input_ids))
        return {"predicted_id": tf.argmax(logits, axis=-1, output_type=tf.int32)}

    def _init_state(self, batch_size, max_len):
        batch_size, max_len = self._checked(batch_size, max_len)
        # float64: the product of two int32s and the per-token size can pass int64
        num_bytes = tf.cast(self.state_spec.dtype.size, tf.float64)
        for size in self.model.state_shape(batch_size, max_len):
            num_bytes *= tf.cast(size, tf.float64)
        checks = [self._check_fits(max_len, "max_len"),
                  tf.debugging.assert_positive(batch_size, message="batch_size must be positive"),
                  tf.debugging.assert_less_equal(
                      num_bytes, tf.constant(float(MAX_INIT_STATE_BYTES), tf.float64),
                      message=f"the state for batch_size x max_len would be over "
                              f"{MAX_INIT_STATE_BYTES} bytes: ask for fewer rows or a "
                              f"shorter max_len")]
        with tf.control_dependencies(checks):
            return {"state": self.model.init_state(batch_size, max_len)}

    def _check_room(self, token_ids, positions, state):
        """Every row's new tokens must land inside the state (a cache write past it is lost)."""
        if not isinstance(self.config.model, TransformerConfig):
            return tf.no_op()
        end = tf.reduce_max(positions) + tf.shape(token_ids)[1]
        return tf.debugging.assert_less_equal(
            end, tf.shape(state)[3], message="positions plus new tokens exceed the length of the state")

    def _prefill(self, token_ids, positions, num_tokens, state):
        token_ids, positions, num_tokens, state = self._checked(token_ids, positions, num_tokens,
                                                                state)
        with tf.control_dependencies([self._check_room(token_ids, positions, state),
                                      self._check_ids(token_ids, "token_ids")]):
            logits, state = self._step(token_ids, state, positions, num_tokens)
        return {"logits": logits, "state": state}

    def _decode(self, token_ids, positions, state):
        token_ids, positions, state = self._checked(token_ids, positions, state)
        with tf.control_dependencies([self._check_room(token_ids, positions, state),
                                      self._check_ids(token_ids, "token_ids")]):
            logits, state = self._step(token_ids, state, positions, tf.ones_like(positions))
        return {"logits": logits, "state": state}

    def _generate(self, input_ids, max_new_tokens, temperature, top_k, top_p, seed):
        input_ids, max_new_tokens, temperature, top_k, top_p, seed = self._checked(
            input_ids, max_new_tokens, temperature, top_k, top_p, seed)
        prompt_len = tf.shape(input_ids)[1]
        checks = [
            self._check_fits(tf.cast(prompt_len, tf.int64) + tf.cast(max_new_tokens, tf.int64),
                             "prompt length plus max_new_tokens"),
            tf.debugging.assert_positive(max_new_tokens, message="max_new_tokens must be >= 1"),
            tf.debugging.assert_greater(prompt_len, 0, message="input_ids must not be empty"),
            self._check_ids(input_ids, "input_ids"),
            self._check_number(temperature, "temperature"),
            self._check_number(top_p, "top_p")]
        with tf.control_dependencies(checks):
            total = prompt_len + max_new_tokens  # within the context: checked above
            sizes = tf.constant(self.cache_buckets)
            bucket = tf.reduce_min(tf.where(sizes >= total))  # smallest cache that fits
            cache_len = tf.gather(sizes, bucket)
            # Pad the prompt to a bucket too, so XLA compiles per bucket, not per length.
            padded_len = tf.minimum(tf.gather(sizes, tf.reduce_min(tf.where(sizes >= prompt_len))),
                                    cache_len)
            ids = tf.pad(input_ids, [[0, 0], [0, padded_len - prompt_len]],
                         constant_values=self.pad_id)
            args = (ids, self._lengths(input_ids), max_new_tokens, temperature, top_k, top_p,
                    seed)
            output_ids, num_generated = tf.switch_case(
                tf.cast(bucket, tf.int32), [lambda loop=loop: loop(*args) for loop in self._loops])
        return {"output_ids": output_ids[:, :max_new_tokens], "num_generated": num_generated}

    def _make_loop(self, cache_len: int):
        """Prefill plus the decode loop for caches of `cache_len` tokens."""
        model, eos, pad = self.model, self.eos_id, self.pad_id

        def loop(ids, lengths, max_new_tokens, temperature, top_k, top_p, seed):
            batch = tf.shape(ids)[0]
            states = model.split_state(model.init_state(batch, cache_len))
            logits, states = model.step_layers(ids, states, tf.zeros([batch], tf.int32), lengths)
            token = sample(logits, temperature, top_k, top_p, seed, 0)
            rows = tf.range(batch)
            # output: [B, cache_len], a static bound on max_new_tokens
            output = tf.fill([batch, cache_len], pad)
            output = tf.tensor_scatter_nd_update(output, tf.stack([rows, tf.zeros_like(rows)], 1),
                                                 token)
            done = tf.equal(token, eos)
            num_generated = tf.ones([batch], tf.int32)

            def body(step, token, states, output, done, num_generated):
                # token: [B], generated at `step - 1`, sits at position lengths + step - 1
                positions = tf.minimum(lengths + step - 1, cache_len - 1)
                logits, states = model.step_layers(token[:, None], states, positions)
                token = sample(logits, temperature, top_k, top_p, seed, step)
                token = tf.where(done, pad, token)
                output = tf.tensor_scatter_nd_update(
                    output, tf.stack([rows, tf.fill([batch], step)], 1), token)
                num_generated += tf.cast(tf.logical_not(done), tf.int32)
                done = tf.logical_or(done, tf.equal(token, eos))
                return step + 1, token, states, output, done, num_generated

            def cond(step, token, states, output, done, num_generated):
                return tf.logical_and(step < max_new_tokens, tf.logical_not(tf.reduce_all(done)))

            _, _, _, output, _, num_generated = tf.while_loop(
                cond, body, (tf.constant(1), token, states, output, done, num_generated),
                maximum_iterations=cache_len)
            return output, num_generated

        return tf.function(loop, jit_compile=self.jit_compile, input_signature=[
            tf.TensorSpec([None, None], tf.int32), tf.TensorSpec([None], tf.int32),
            tf.TensorSpec([], tf.int32), tf.TensorSpec([], tf.float32),
            tf.TensorSpec([], tf.int32), tf.TensorSpec([], tf.float32),
            tf.TensorSpec([], tf.int32)])
