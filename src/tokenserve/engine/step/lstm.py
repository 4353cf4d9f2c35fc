"""The LSTM's step: each sequence's (h, c) lives in one row of a state pool."""

from __future__ import annotations

import tensorflow as tf

from tokenserve.engine.step.flat_call import spec
from tokenserve.model.lstm import LSTMLM


class LSTMStep(tf.Module):
    """Slot step for an LSTMLM: each sequence's (h, c) lives in one row of a state pool."""

    def __init__(self, model: LSTMLM, num_slots: int):
        super().__init__(name="lstm_step")
        self.model = model
        c = model.config
        self.states = tf.Variable(tf.zeros([num_slots, c.num_layers, 2, c.hidden_size],
                                           tf.float32), trainable=False, name="lstm_states")
        self.step = tf.function(self._step, input_signature=[
            spec([None, None]),    # token_ids  [S, T] right-padded
            spec([None]),          # num_tokens [S]
            spec([None]),          # slots      [S]
            spec([None], tf.bool),  # fresh     [S] start from a zero state
        ])

    def _step(self, token_ids, num_tokens, slots, fresh):
        state = tf.gather(self.states, slots)                              # [S, layers, 2, H]
        state = tf.where(fresh[:, None, None, None], tf.zeros_like(state), state)
        state = tf.transpose(state, [1, 2, 0, 3])                          # [layers, 2, S, H]
        logits, state = self.model.step(token_ids, state, tf.zeros_like(num_tokens), num_tokens)
        self.states.scatter_update(tf.IndexedSlices(tf.transpose(state, [2, 0, 1, 3]), slots))
        return logits
