"""Decoder-only Transformer: GPT-2 and the Llama family from one config."""

from __future__ import annotations

import keras
import tensorflow as tf

from tokenserve.config import TransformerConfig
from tokenserve.model.base import DecoderLM
from tokenserve.kernels.gguf_types import INT8, layer_format, parse_spec, row_bytes
from tokenserve.model.gguf_linear import blocks_entries, gguf_embedding
from tokenserve.model.layers import (Block, Dense, Norm, _normal, int8_linear, linear,
                                     soft_cap, visible)
from tokenserve.model.moe import MoEBlock


class TransformerLM(DecoderLM):
    """Token embedding, `num_layers` pre-norm blocks, final norm, LM head.

    State: the KV cache, float [num_layers, 2, B, L, Hkv, Dh] (2 = keys, values).
    """

    def __init__(self, config: TransformerConfig, **kwargs):
        kwargs.setdefault("name", "transformer")
        super().__init__(**kwargs)
        self.config = config
        self.blocks = [(MoEBlock if config.layer_has_experts(i) else Block)(
            config, i, name=f"block_{i}") for i in range(config.num_layers)]
        self.final_norm = Norm(config.norm, config.norm_eps, name="final_norm")
        self.head = None if config.tie_embeddings else Dense(
            config.vocab_size, False, weight_format=layer_format(config, "head"), name="head")
        # "float", "int8" or a GGUF blocks spec of one type (the embedding's rows)
        self.embedding_format = layer_format(config, "token_embedding")

    @property
    def embedding_blocks(self) -> str | None:
        """The GGUF block type the token embedding is stored in, or None."""
        return None if self.embedding_format in ("float", INT8) else self.embedding_format

    def build(self, input_shape=None):
        c = self.config
        if self.embedding_blocks:  # [vocab, D] as the GGUF file's rows of blocks
            [(name, _)] = parse_spec(self.embedding_blocks, c.vocab_size)
            self.token_embedding_blocks = self.add_weight(
                name="token_embedding_blocks", shape=(c.vocab_size, row_bytes(name, c.hidden_size)),
                dtype="uint8", initializer="zeros", trainable=False)
        elif self.embedding_format == INT8:  # [vocab, D] rows are also the tied head's outputs
            self.token_embedding_q = self.add_weight(
                name="token_embedding_q", shape=(c.vocab_size, c.hidden_size), dtype="int8",
                initializer="zeros", trainable=False)
            self.token_embedding_scale = self.add_weight(
                name="token_embedding_scale", shape=(c.vocab_size, 1), dtype="float32",
                initializer="ones", trainable=False)
        else:
            self.token_embedding = self.add_weight(name="token_embedding",
                                                   shape=(c.vocab_size, c.hidden_size),
                                                   initializer=_normal())
        if c.position == "learned":
            self.position_embedding = self.add_weight(name="position_embedding",
                                                      shape=(c.max_seq_len, c.hidden_size),
                                                      initializer=_normal(0.01))
        hidden_shape = (None, None, c.hidden_size)
        for block in self.blocks:
            block.build(hidden_shape)
        self.final_norm.build(hidden_shape)
        if self.head is not None:
            self.head.build(hidden_shape)
        self.built = True

    def embed(self, token_ids, positions, dtype=None):
        """Token (and learned position) embeddings: int32 ids and positions [...] -> [..., D]
        in `dtype` (default the compute dtype; the engine's fused steps take float32 rows
        of bfloat16 weights, summed in float32). Only the gathered rows are cast."""
        dtype = dtype or self.compute_dtype
        if self.embedding_blocks:  # only the looked-up rows are dequantized
            x = tf.cast(gguf_embedding(self.token_embedding_blocks, self.embedding_blocks,
                                       token_ids), dtype)
        elif self.embedding_format == INT8:
            rows = tf.cast(tf.gather(self.token_embedding_q, token_ids), tf.float32)
            x = tf.cast(rows * tf.gather(self.token_embedding_scale, token_ids), dtype)
        else:
            x = tf.cast(tf.gather(self.token_embedding, token_ids), dtype)
        if self.config.embedding_multiplier != 1.0:  # Gemma: sqrt(D), in the weights' dtype
            x *= tf.cast(tf.cast(self.config.embedding_multiplier, self.compute_dtype), dtype)
        if self.config.position == "learned":
            x += tf.cast(tf.gather(self.position_embedding, positions), dtype)
        return x

    def head_logits(self, hidden):
        """Final norm and LM head: hidden states [..., D] -> float32 logits [..., vocab]."""
        hidden = self.final_norm(hidden)
        if self.head is None and self.embedding_blocks:
            logits = linear(hidden, self.tied_head_weights())
        elif self.head is None and self.embedding_format == INT8:
            logits = int8_linear(hidden, self.token_embedding_q.value,
                                 self.token_embedding_scale.value)
        elif self.head is None:
            logits = tf.matmul(hidden, tf.cast(self.token_embedding, hidden.dtype),
                               transpose_b=True)
        else:
            logits = self.head(hidden)
        return soft_cap(tf.cast(logits, tf.float32), self.config.final_softcap)

    def tied_head_weights(self) -> dict:
        """A tied head's weights as `linear` takes them, for a GGUF-blocks embedding."""
        return blocks_entries([self.embedding_blocks], [self.token_embedding_blocks.value])

    def call(self, token_ids):
        """Full forward pass: int32 [B, T] -> float32 logits [B, T, vocab]."""
        token_ids = tf.cast(token_ids, tf.int32)
        batch, length = tf.shape(token_ids)[0], tf.shape(token_ids)[1]
        positions = tf.broadcast_to(tf.range(length)[None, :], [batch, length])
        query, key = tf.range(length)[:, None], tf.range(length)[None, :]
        masks = {window: tf.broadcast_to(visible(key, query, window)[None],
                                         [batch, length, length])
                 for window in self._windows()}                          # [B, T, T] each
        x = self.embed(token_ids, positions)
        for i, block in enumerate(self.blocks):
            x = block(x, positions, masks[self.config.layer_window(i)])
        return self.head_logits(x)

    def _windows(self) -> set[int]:
        return {self.config.layer_window(i) for i in range(self.config.num_layers)}


    def state_shape(self, batch_size, max_len) -> list:
        c = self.config
        return [c.num_layers, 2, batch_size, max_len, c.num_kv_heads, c.head_dim]

    def split_state(self, state) -> list:
        """[num_layers, ...] -> a list of per-layer [2, B, L, Hkv, Dh] caches."""
        return tf.unstack(state, num=self.config.num_layers, axis=0)

    def join_state(self, layer_states) -> tf.Tensor:
        return tf.stack(layer_states, axis=0)

    def step(self, token_ids, state, positions, num_tokens=None):
        logits, layer_states = self.step_layers(token_ids, self.split_state(state), positions,
                                                num_tokens)
        return logits, self.join_state(layer_states)

    def step_layers(self, token_ids, layer_states, positions, num_tokens=None):
        """`step` on per-layer caches, so a loop can carry them without restacking."""
        token_ids = tf.cast(token_ids, tf.int32)
        num_tokens = self._num_tokens(token_ids, num_tokens)
        length = tf.shape(token_ids)[1]
        cache_len = tf.shape(layer_states[0])[2]
        token_positions = tf.cast(positions, tf.int32)[:, None] + tf.range(length)[None, :]
        # key j is visible to the query at position p when j <= p (and in its window): [B, T, L]
        masks = {window: visible(tf.range(cache_len)[None, None, :],
                                       token_positions[:, :, None], window)
                 for window in self._windows()}
        x = self.embed(token_ids, token_positions)
        new_states = []
        for i, (block, cache) in enumerate(zip(self.blocks, layer_states)):
            x, cache = block.call_cached(x, token_positions, masks[self.config.layer_window(i)],
                                         cache)
            new_states.append(cache)
        return self.head_logits(self._gather_last(x, num_tokens)), new_states
