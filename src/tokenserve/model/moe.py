"""Mixture-of-experts feed-forward layers (Mixtral, Qwen-MoE, OLMoE): a router and routed experts.

Each row of the block's normed hidden states goes through the `num_experts_per_token`
experts its router ranks highest, and their outputs are summed, weighted by the router's
softmax probabilities (renormalised over the chosen experts where the family says so).
Qwen2-MoE adds a shared expert every row goes through, scaled by a sigmoid gate.

Rows are grouped by expert: every expert runs once, on the rows routed to it, and an
expert no row chose does no work. Each expert holds its own variables (`expert_{e}_up`,
`expert_{e}_down`; SwiGLU's gate and up fused in `up` as in layers.MLP), so the stock-TF path
below reads none of an expert without rows: a matmul with no rows reads no weights, where
slicing one expert out of a stacked [E, ...] variable would copy it every step. The engine
runs router and experts as one op a layer (engine/step/moe.py, kernels/moe.py), routing as
`route` does here, ties included (tf.math.top_k keeps the lower expert index).

Shapes: h [M, D] rows (the layer flattens [B, T, D]); expert_ids, gates [M, k].
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from tokenserve.config import TransformerConfig
from tokenserve.kernels.gguf_types import layer_format
from tokenserve.model.layers import _INIT_STD, Block, Dense, linear, mlp


def route(logits, k: int, normalize: bool):
    """Router logits [M, E] -> (expert_ids int32 [M, k], gates float32 [M, k]): the top-k of
    the float32 softmax, renormalised to sum to 1 when `normalize`."""
    probs = tf.nn.softmax(tf.cast(logits, tf.float32), axis=-1)
    gates, expert_ids = tf.math.top_k(probs, k=k, sorted=True)
    if normalize:
        gates = gates / tf.reduce_sum(gates, axis=-1, keepdims=True)
    return expert_ids, gates


def expert_counts(expert_ids, num_experts: int):
    """Rows routed to each expert: int32 [E] (a row counts once per expert it chose)."""
    return tf.math.bincount(tf.reshape(expert_ids, [-1]), minlength=num_experts,
                            maxlength=num_experts, dtype=tf.int32)


def grouped_experts(h, expert_ids, gates, experts: list[dict]):
    """sum_j gates[:, j] * expert_{expert_ids[:, j]}(h) in stock TF ops: h [M, D] -> [M, D].

    The (row, expert) pairs are split by expert (dynamic_partition); each expert runs once on
    its rows (a gather, its SwiGLU MLP, the gate), and the products are scatter-added back to
    their rows (unsorted_segment_sum). experts: [{"up": ..., "down": ...}] as `linear` takes
    them, one per expert index."""
    num_rows, k = tf.shape(h)[0], expert_ids.shape[-1]
    flat_ids = tf.reshape(expert_ids, [-1])                              # [M*k]
    pair_rows = tf.range(num_rows * k) // k                              # row of each pair
    flat_gates = tf.cast(tf.reshape(gates, [-1]), h.dtype)
    parts = tf.dynamic_partition(tf.range(num_rows * k), flat_ids, len(experts))
    outputs, rows = [], []
    for pairs, weights in zip(parts, experts):
        expert_rows = tf.gather(pair_rows, pairs)                        # [Me]
        y = mlp(tf.gather(h, expert_rows), weights["up"], weights["down"], "swiglu")
        outputs.append(y * tf.gather(flat_gates, pairs)[:, None])
        rows.append(expert_rows)
    return tf.math.unsorted_segment_sum(tf.concat(outputs, 0), tf.concat(rows, 0), num_rows)


def shared_expert(h, weights: dict):
    """Qwen2-MoE's shared expert: sigmoid(h @ gate) * mlp(h), [M, D] -> [M, D]."""
    gate = tf.sigmoid(tf.cast(linear(h, weights["gate"]), tf.float32))
    return mlp(h, weights["up"], weights["down"], "swiglu") * tf.cast(gate, h.dtype)


def moe_mlp(h, weights: dict, config: TransformerConfig):
    """The mixture of experts on rows h [M, D] -> [M, D], in stock TF ops.

    weights: {"router": ..., "experts": [...], and "shared" where the family has one}, as
    MoE.weights_dict gives them; with "load" (the engine's counter: assign_add takes int64
    [E]), the rows routed to each expert are added to it."""
    expert_ids, gates = route(linear(h, weights["router"]), config.num_experts_per_token,
                              config.normalize_expert_weights)
    if "load" in weights:
        weights["load"].assign_add(tf.cast(expert_counts(expert_ids, config.num_experts),
                                           tf.int64))
    y = grouped_experts(h, expert_ids, gates, weights["experts"])
    if "shared" in weights:
        y += shared_expert(h, weights["shared"])
    return y


class MoE(keras.layers.Layer):
    """A router (float weights whatever the format: routing decides which weights are
    read), `num_experts` SwiGLU experts and, where the family has one, a gated shared
    expert. Variables: router/kernel [D, E]; expert_{e}_up [D, 2F], expert_{e}_down [F, D];
    shared_up, shared_down, shared_gate [D, 1]. A GGUF import that keeps blocks as stored
    gives each expert's projections their own blocks spec (layer_format of
    "{block}/expert_{e}_up", ...: the gate's rows and the up's rows two parts)."""

    def __init__(self, config: TransformerConfig, block: str = "", **kwargs):
        super().__init__(**kwargs)
        self.config = c = config
        down_std = _INIT_STD / math.sqrt(2 * c.num_layers)
        formats = lambda name: layer_format(c, f"{block}/{name}")  # noqa: E731
        self.router = Dense(c.num_experts, False, name="router")
        self.experts = [
            (Dense(2 * c.expert_intermediate_size, False,
                   weight_format=formats(f"expert_{e}_up"), name=f"expert_{e}_up"),
             Dense(c.hidden_size, False, std=down_std,
                   weight_format=formats(f"expert_{e}_down"), name=f"expert_{e}_down"))
            for e in range(c.num_experts)]
        self.shared = None
        if c.shared_expert_size:
            self.shared = (
                Dense(2 * c.shared_expert_size, False, weight_format=formats("shared_up"),
                      name="shared_up"),
                Dense(c.hidden_size, False, std=down_std, weight_format=formats("shared_down"),
                      name="shared_down"),
                Dense(1, False, name="shared_gate"))

    def build_sublayers(self, input_shape):
        """Builds every variable, in the enclosing block's name scope (block_{i}/router/...)."""
        c = self.config
        self.router.build(input_shape)
        for up, down in self.experts:
            up.build(input_shape)
            down.build((None, None, c.expert_intermediate_size))
        if self.shared is not None:
            self.shared[0].build(input_shape)
            self.shared[1].build((None, None, c.shared_expert_size))
            self.shared[2].build(input_shape)

    def weights_dict(self) -> dict:
        """The variables by role, for `moe_mlp` (the engine passes them explicitly)."""
        found = {"router": self.router.weights_dict(),
                 "experts": [{"up": up.weights_dict(), "down": down.weights_dict()}
                             for up, down in self.experts]}
        if self.shared is not None:
            up, down, gate = self.shared
            found["shared"] = {"up": up.weights_dict(), "down": down.weights_dict(),
                               "gate": gate.weights_dict()}
        return found

    def call(self, x):
        """x [..., D] -> [..., D]."""
        rows = tf.reshape(x, [-1, self.config.hidden_size])
        return tf.reshape(moe_mlp(rows, self.weights_dict(), self.config), tf.shape(x))


class MoEBlock(Block):
    """A pre-norm block whose feed-forward layer is a mixture of experts."""

    def make_mlp(self, config: TransformerConfig):
        return MoE(config, block=self.name, name="mlp")

    def build_mlp(self, input_shape):
        self.mlp.build_sublayers(input_shape)

    def mlp_weights(self) -> dict:
        return {"moe": self.mlp.weights_dict()}
