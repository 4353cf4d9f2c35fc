"""A mixture of experts in the engine's step: routing, the grouped experts, expert load.

A step's rows (decode rows and prefill chunks alike, packed into one [N] axis) go through
the router together; each expert then runs once on the rows that chose it. For float32 rows
and float experts that is one op a layer, on the fused and the graph path alike (kernels/
moe.py: the router's matmul, softmax, top-k and renormalisation, then the grouped experts,
reading only those with rows); experts kept as a GGUF file's blocks take the same one op in
its blocks form (kernels/moe_gguf_layer.cc, q8 activations as the dense block op's); int8
experts, bfloat16 rows and exported SavedModels take model/moe.py's stock-TF routing and
grouping, which reads no more. Qwen2-MoE's shared expert rides along as one more expert that
every row chooses, its gate the sigmoid of its own projection.

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
from tokenserve.model.gguf_linear import gguf_parts
from tokenserve.model.moe import (expert_counts, grouped_experts, moe_mlp, route,
                                  shared_expert)


class ExpertLoad:
    """Rows routed to each expert of each layer since the step was built: one int64
    [layers, experts] variable, a row of which each layer's routing adds to (a sparse
    update), read in one copy."""

    def __init__(self, num_layers: int, num_experts: int):
        self.counts = tf.Variable(tf.zeros([num_layers, num_experts], tf.int64),
                                  trainable=False, name="expert_tokens")

    def attach(self, layer_weights: list[dict]) -> None:
        """Hands each MoE layer its row's counter (weights["moe"]["load"]: counts [E] ->
        None); a dense layer's row stays zero."""
        for i, weights in enumerate(layer_weights):
            if "moe" in weights:
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
    """residual + moe(h) for float32 rows h, residual [M, D]: one op (the router, its top-k
    and the grouped experts), or, for int8 experts or without the op, the router through the
    dense op and the stock-TF routing and grouping (whose matmuls are the int8 op's for int8
    weights)."""
    y = _moe_op(h, residual, w, config)
    if y is not None:
        return y
    logits = kdense.dense(h, w["router"]["kernel"])  # the router's weights are never int8
    expert_ids, gates = route(logits, config.num_experts_per_token,
                              config.normalize_expert_weights)
    if "load" in w:
        w["load"].assign_add(tf.cast(expert_counts(expert_ids, config.num_experts), tf.int64))
    y = residual + grouped_experts(h, expert_ids, gates, w["experts"])
    return y if "shared" not in w else y + shared_expert(h, w["shared"])


def graph_moe(h, w: dict, config: TransformerConfig):
    """moe(h) for the graph path's rows h [M, D]: the one op for float32 rows and float
    experts, else model/moe.py's stock-TF ops (bfloat16 rows, int8 experts, no op)."""
    if h.dtype == tf.float32:
        y = _moe_op(h, None, w, config)
        if y is not None:
            return y
    return moe_mlp(h, w, config)


def _moe_op(h, residual, w: dict, config: TransformerConfig):
    """residual + moe(h) as kernels/moe.py's one op (which also counts each expert's rows
    into w["load"]), or None where it does not apply: int8 experts, or the op unavailable.
    The shared expert rides along as one more expert with its sigmoid gate."""
    experts, shared = w["experts"], w.get("shared")
    if not all("kernel" in e["up"] and "kernel" in e["down"] for e in experts):
        return _moe_gguf_op(h, residual, w, config)
    ups = [e["up"]["kernel"] for e in experts]
    downs = [e["down"]["kernel"] for e in experts]
    shared_gate = None
    if shared is not None:
        ups.append(shared["up"]["kernel"])
        downs.append(shared["down"]["kernel"])
        shared_gate = shared["gate"]["kernel"]
    out = kmoe.moe_layer(h, w["router"]["kernel"], ups, downs, config.num_experts_per_token,
                         config.normalize_expert_weights, residual, shared_gate)
    if out is None:
        return None
    if "load" in w:  # the op's own grouping counted the rows: no bincount here
        w["load"].assign_add(tf.cast(out[1], tf.int64))
    return out[0]


def _moe_gguf_op(h, residual, w: dict, config: TransformerConfig):
    """residual + moe(h) with every expert's gate, up and down GGUF blocks (a GGUF import
    that keeps them as stored: up holds two parts, the gate's rows and the up's) as
    kernels/moe.py's one op, or None (an int8 expert, or the op unavailable)."""
    every = list(w["experts"]) + ([w["shared"]] if "shared" in w else [])
    experts = []
    for expert in every:
        up, down = gguf_parts(expert["up"]), gguf_parts(expert["down"])
        if len(up) != 2 or len(down) != 1:
            return None
        experts.append((up[0], up[1], down[0]))
    shared_gate = w["shared"]["gate"]["kernel"] if "shared" in w else None
    out = kmoe.moe_gguf_layer(h, w["router"]["kernel"], experts,
                              config.num_experts_per_token, config.normalize_expert_weights,
                              residual, shared_gate)
    if out is None:
        return None
    if "load" in w:
        w["load"].assign_add(tf.cast(out[1], tf.int64))
    return out[0]
