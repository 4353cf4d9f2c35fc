"""The one decoder-state interface that every model family implements.

A family's state is a single float tensor (a stacked KV cache for the
Transformer, stacked (h, c) for the LSTM), so exported signatures, the engine
and the session store can move it without knowing which family made it.
"""

from __future__ import annotations

import abc

import keras
import tensorflow as tf


class DecoderLM(keras.Model, abc.ABC):
    """A causal language model with an explicit, functional decoder state.

    `call(token_ids)` is the full forward pass used for training and scoring.
    `step(token_ids, state, positions, num_tokens)` continues generation from
    `state`; prefill, chunked prefill and decode are all this one call.
    """

    @abc.abstractmethod
    def state_shape(self, batch_size, max_len) -> list:
        """Shape of the state tensor for `batch_size` rows of up to `max_len` tokens."""

    def init_state(self, batch_size, max_len) -> tf.Tensor:
        """A fresh (all-zero) state."""
        return tf.zeros(self.state_shape(batch_size, max_len), dtype=self.compute_dtype)

    @abc.abstractmethod
    def step(self, token_ids, state, positions, num_tokens=None):
        """Runs new tokens through the model on top of `state`.

        Args:
            token_ids: int32 [B, T], right-padded new tokens for each row.
            state: the family's state tensor, from `init_state` or a prior `step`.
            positions: int32 [B], position of each row's first new token
                (= tokens already in its state). Needs positions + T <= max_len.
            num_tokens: int32 [B], how many of the T tokens are real (default T).

        Returns:
            (logits [B, vocab] at each row's last real token, new state).
        """

    def split_state(self, state) -> list:
        """The state as a list of per-layer pieces, which a loop can carry cheaply."""
        return [state]

    def join_state(self, layer_states) -> tf.Tensor:
        return layer_states[0]

    def step_layers(self, token_ids, layer_states, positions, num_tokens=None):
        """`step` on `split_state` pieces; returns (logits, new pieces)."""
        logits, state = self.step(token_ids, self.join_state(layer_states), positions, num_tokens)
        return logits, self.split_state(state)

    @staticmethod
    def _num_tokens(token_ids, num_tokens):
        if num_tokens is None:
            shape = tf.shape(token_ids)
            return tf.fill([shape[0]], shape[1])
        return tf.cast(num_tokens, tf.int32)

    @staticmethod
    def _gather_last(hidden, num_tokens):
        # hidden: [B, T, D] -> [B, D] at index num_tokens - 1 of each row
        return tf.gather(hidden, tf.maximum(num_tokens - 1, 0), axis=1, batch_dims=1)
