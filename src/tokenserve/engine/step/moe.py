"""A mixture of experts in the engine's step: routing, the grouped experts, expert load.

A step's rows (decode rows and prefill chunks alike, packed into one [N] axis) go through
the router together; each expert then runs once on the rows that chose it. On the fused
path that is one op a layer (kernels/moe.py, which reads only the experts with rows); the
graph path and exported SavedModels take model/moe.py's stock-TF grouping, which reads no
more. Qwen2-MoE's shared expert rides along as one more expert that every row chooses, its
gate the sigmoid of its own projection.

Each MoE layer counts the rows routed to each of its experts into its row of an int64
[layers, experts] variable inside the step (ExpertLoad): no extra output of the step; the
runner reads the running totals when asked (the engine's step stats, once a step).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tokenserve.config import TransformerConfig
from tokenserve.kernels import dense as kdense
from tokenserve.kernels import moe as kmoe
from tokenserve.model.moe import expert_counts, grouped_experts, route, shared_expert


class ExpertLoad:
    """Rows routed to each expert of each layer since the step was built: one int64
    [layers, experts] variable, a row of which each layer's routing adds to (a sparse
    update), read in one copy."""

    def __init__(self, num_layers: int, num_experts: int):
        self.counts = tf.Variable(tf.zeros([num_layers, num_experts], tf.int64),
                                  trainable=False, name="expert_tokens")

    def attach(self, layer_weights: list[dict]) -> None:
        """Hands each layer its row's counter (weights["moe"]["load"]: counts [E] -> None)."""
        for i, weights in enumerate(layer_weights):
            weights["moe"]["load"] = _LayerCounter(self.counts, i)

    def read(self) -> np.ndarray:
        """int64 [layers, experts]: the running totals."""
        return self.counts.numpy()


class _LayerCounter:
    """One layer's row of ExpertLoad's variable: assign_add(counts [E]) adds to it."""

    def __init__(self, counts: tf.Variable, layer: int):
        self.counts, self.layer = counts, layer

    def assign_add(self, counts):
        self.counts.scatter_add(tf.IndexedSlices(counts[None], tf.constant([self.layer])))


def fused_moe(h, residual, w: dict, config: TransformerConfig):
    """residual + moe(h) for float32 rows h, residual [M, D]: the router through the dense
    op, the experts through the grouped op (int8 experts, or no op: the stock-TF grouping,
    whose matmuls are the int8 op's for int8 weights)."""
    logits = kdense.dense(h, w["router"]["kernel"])  # the router's weights are never int8
    expert_ids, gates = route(logits, config.num_experts_per_token,
                              config.normalize_expert_weights)
    experts, shared = w["experts"], w.get("shared")
    if all("kernel" in e["up"] for e in experts):
        ups = [e["up"]["kernel"] for e in experts]
        downs = [e["down"]["kernel"] for e in experts]
        ids, weights = expert_ids, gates
        if shared is not None:  # one more expert, chosen by every row with its own gate
            gate = tf.sigmoid(kdense.dense(h, shared["gate"]["kernel"]))          # [M, 1]
            ids = tf.concat([ids, tf.fill(tf.shape(gate), len(experts))], 1)
            weights = tf.concat([weights, gate], 1)
            ups.append(shared["up"]["kernel"])
            downs.append(shared["down"]["kernel"])
        out = kmoe.moe_experts(h, ids, weights, ups, downs, residual, with_counts=True)
        if out is not None:
            if "load" in w:  # the op's own grouping counted the rows: no bincount here
                w["load"].assign_add(tf.cast(out[1][:len(experts)], tf.int64))
            return out[0]
    if "load" in w:
        w["load"].assign_add(tf.cast(expert_counts(expert_ids, config.num_experts), tf.int64))
    y = residual + grouped_experts(h, expert_ids, gates, experts)
    return y if shared is None else y + shared_expert(h, shared)
