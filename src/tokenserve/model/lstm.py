"""Stacked-LSTM language model; its decoder state is (h, c) per layer."""

from __future__ import annotations

import keras
import tensorflow as tf

from tokenserve.config import LSTMConfig
from tokenserve.model.base import DecoderLM
from tokenserve.model.layers import _normal


class LSTMLM(DecoderLM):
    """Embedding, `num_layers` LSTM layers, LM head (tied to the embedding or not) plus bias.

    State: float [num_layers, 2, B, hidden] (2 = h, c). It has no length axis,
    so `max_len` only bounds positions; the state costs the same at any length.
    """

    def __init__(self, config: LSTMConfig, **kwargs):
        kwargs.setdefault("name", "lstm")
        super().__init__(**kwargs)
        self.config = config

    def build(self, input_shape=None):
        c = self.config
        # Unit-scale embeddings (PyTorch's default): with GPT-2's 0.02 the LSTM's gates
        # barely saw their input, and it never got past unigram statistics.
        self.token_embedding = self.add_weight(name="token_embedding",
                                               shape=(c.vocab_size, c.hidden_size),
                                               initializer=_normal(1.0))
        self.kernels, self.biases = [], []
        for i in range(c.num_layers):
            # gates i, f, g, o from concat(x, h): [2 * hidden, 4 * hidden]
            self.kernels.append(self.add_weight(
                name=f"lstm_{i}_kernel", shape=(2 * c.hidden_size, 4 * c.hidden_size),
                initializer=keras.initializers.GlorotUniform()))
            bias = [0.0] * c.hidden_size + [1.0] * c.hidden_size + [0.0] * (2 * c.hidden_size)
            self.biases.append(self.add_weight(  # forget-gate bias 1 (Jozefowicz et al.)
                name=f"lstm_{i}_bias", shape=(4 * c.hidden_size,),
                initializer=keras.initializers.Constant(bias)))
        if not c.tie_embeddings:
            self.head_kernel = self.add_weight(name="head_kernel",
                                               shape=(c.hidden_size, c.vocab_size),
                                               initializer=_normal())
        # h is bounded in (-1, 1), so the unigram prior needs a bias of its own.
        self.head_bias = self.add_weight(name="head_bias", shape=(c.vocab_size,),
                                         initializer="zeros")
        self.built = True

    def state_shape(self, batch_size, max_len) -> list:
        return [self.config.num_layers, 2, batch_size, self.config.hidden_size]

    def init_state(self, batch_size, max_len):
        # (h, c) stay float32 even under a bf16 policy: the recurrence accumulates error.
        return tf.zeros(self.state_shape(batch_size, max_len), tf.float32)

    def _cell(self, x, h, c, layer: int):
        """One LSTM step; the matmul runs in the compute dtype, the gates in float32."""
        inputs = tf.concat([x, tf.cast(h, x.dtype)], -1)
        gates = tf.cast(tf.matmul(inputs, tf.cast(self.kernels[layer], x.dtype)), tf.float32)
        i, f, g, o = tf.split(gates + tf.cast(self.biases[layer], tf.float32), 4, axis=-1)
        c = tf.sigmoid(f) * c + tf.sigmoid(i) * tf.tanh(g)
        return tf.sigmoid(o) * tf.tanh(c), c

    def _run(self, token_ids, state, num_tokens):
        """Runs the stack over T steps; rows stop updating after num_tokens."""
        x = tf.gather(tf.cast(self.token_embedding, self.compute_dtype), token_ids)
        length = tf.shape(token_ids)[1]
        live = tf.range(length)[:, None] < num_tokens[None, :]  # [T, B]

        def one_step(carry, inputs):
            layer_state, _ = carry  # layer_state: [num_layers, 2, B, H]
            x_t, live_t = inputs
            new_layers = []
            for layer in range(self.config.num_layers):
                h, c = self._cell(x_t, layer_state[layer, 0], layer_state[layer, 1], layer)
                new_layers.append(tf.stack([h, c]))
                x_t = tf.cast(h, x.dtype)
            new_state = tf.where(live_t[None, None, :, None], tf.stack(new_layers), layer_state)
            return new_state, x_t

        initial = (state, tf.zeros_like(state[0, 0], dtype=x.dtype))
        states, outputs = tf.scan(one_step, (tf.transpose(x, [1, 0, 2]), live), initial)
        return states[-1], tf.transpose(outputs, [1, 0, 2])  # [B, T, H]

    def _logits(self, hidden):
        if self.config.tie_embeddings:
            kernel = tf.transpose(tf.cast(self.token_embedding, hidden.dtype))
        else:
            kernel = tf.cast(self.head_kernel, hidden.dtype)
        return tf.cast(tf.matmul(hidden, kernel), tf.float32) + tf.cast(self.head_bias, tf.float32)

    def call(self, token_ids):
        """Full forward pass: int32 [B, T] -> float32 logits [B, T, vocab]."""
        token_ids = tf.cast(token_ids, tf.int32)
        batch, length = tf.shape(token_ids)[0], tf.shape(token_ids)[1]
        state = self.init_state(batch, 0)
        _, hidden = self._run(token_ids, state, tf.fill([batch], length))
        return self._logits(hidden)

    def step(self, token_ids, state, positions, num_tokens=None):
        token_ids = tf.cast(token_ids, tf.int32)
        num_tokens = self._num_tokens(token_ids, num_tokens)
        state, hidden = self._run(token_ids, tf.cast(state, tf.float32), num_tokens)
        return self._logits(self._gather_last(hidden, num_tokens)), state
