"""LoRA on a mixture of experts inside the step: the slot table of the experts', shared
expert's and router's factors, and the MoE MLP that adds them per (row, expert) pair.

The table holds, per adapter slot, role (engine/lora_moe.py's MOE_ROLES) and layer, one
variable per factor:

    A[role][s - 1][layer]  [in, n R]        n: factor pairs a layer (E experts, else 1)
    B[role][s - 1][layer]  [n, R, out]      R: moe_role_ranks (gate and up: 2 x max rank)

so a slot costs layers x (E r (3 D + 5 F) + the router's and shared expert's) float32s
(r: max_lora_rank; Qwen3-30B-A3B at rank 16: 3.9 GB): `num_bytes`, which the runner logs.
One variable per layer, so the step reads a layer's factors in place (a slice of a
[layers, ...] variable would copy it).

A step whose rows include one of a slot holding MoE factors (`slot_kinds`: each kind its
own trace) runs each MoE layer as `lora_moe_mlp`: the router's logits plus each row's
delta, the top-k; then, where an adapter changes the routed experts (MOE_EXPERTS), per
(row, expert) pair the expert's gate|up and down plus the row's slot's delta for that
expert, (x @ A_s[:, e R:(e + 1) R]) @ B_s[e], in stock TF ops; else the grouped experts'
op on that routing; and the shared expert with its deltas per row. Other steps (base rows,
adapters of the attention only) keep the one op a layer. Each pair gathers its expert's B
([pairs, R, out], a transient the size of the step's pairs: stock TF has no grouped
matmul); folding the deltas into the grouped experts' op would remove it and the stock-TF
grouping's cost.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tokenserve.config import TransformerConfig
from tokenserve.engine.lora_moe import EXPERT_ROLES, moe_role_ranks, moe_role_shapes
from tokenserve.kernels import moe as kmoe
from tokenserve.model.layers import linear
from tokenserve.model.moe import expert_counts, grouped_experts, route


MOE_NONE, MOE_AROUND, MOE_EXPERTS = 0, 1, 2
"""What an adapter changes of a mixture of experts: nothing; the router or the shared expert
only (around the routed experts, which keep their grouped op given the routing); the
routed experts (their MLP in stock TF ops)."""


class MoeLoraTable(tf.Module):
    """The MoE factors of `max_loras` slots (slot 0, the base, has none)."""

    def __init__(self, config: TransformerConfig, max_loras: int, max_rank: int):
        super().__init__(name="lora_moe_table")
        self.config = config
        self.shapes = moe_role_shapes(config)
        self.ranks = moe_role_ranks(config, max_rank)
        self.layers = [i for i in range(config.num_layers) if config.layer_has_experts(i)]
        self.a, self.b = {}, {}
        for role, (count, w_in, w_out) in self.shapes.items():
            r = self.ranks[role]
            self.a[role] = [{i: tf.Variable(tf.zeros([w_in, count * r]), trainable=False,
                                            name=f"lora_a_{role}_{slot}_{i}")
                             for i in self.layers} for slot in range(1, max_loras + 1)]
            self.b[role] = [{i: tf.Variable(tf.zeros([count, r, w_out]), trainable=False,
                                            name=f"lora_b_{role}_{slot}_{i}")
                             for i in self.layers} for slot in range(1, max_loras + 1)]
        self.slot_kinds = [MOE_NONE] * (max_loras + 1)
        """Per slot (0: the base): its adapter's MOE_* kind (host side: the runner picks the
        step's trace by it)."""

    @property
    def num_bytes(self) -> int:
        return sum(int(np.prod(v.shape)) * 4 for side in (self.a, self.b)
                   for slots in side.values() for slot in slots for v in slot.values())

    def kind_of(self, slots) -> int:
        """The most the adapters in `slots` change of a mixture of experts (MOE_*)."""
        return max((self.slot_kinds[int(s)] for s in slots), default=MOE_NONE)

    def prepare(self, layers: list[dict] | None) -> list:
        """The slot's values (roles in table order, per layer A then B, then its MOE_* kind)
        from LoraWeights.layers: zeros where the adapter has no factor."""
        values, kind = [], MOE_NONE
        for role, (count, w_in, w_out) in self.shapes.items():
            r = self.ranks[role]
            for i in self.layers:
                a = np.zeros([w_in, count, r], np.float32)
                b = np.zeros([count, r, w_out], np.float32)
                pair = layers[i].get(role) if layers else None
                if pair is not None:
                    fa, fb = pair if role in EXPERT_ROLES else (pair[0][None], pair[1][None])
                    a[:, :, :fa.shape[2]] = fa.transpose(1, 0, 2)        # [in, E, r]
                    b[:, :fb.shape[1]] = fb
                    kind = max(kind, MOE_EXPERTS if role in EXPERT_ROLES else MOE_AROUND)
                values += [tf.constant(a.reshape(w_in, count * r)), tf.constant(b)]
        return values + [kind]

    def write_slot(self, slot: int, values) -> None:
        """Assigns `prepare`'s values to `slot` (1..max_loras), each variable whole."""
        values = iter(values)
        for role in self.shapes:
            for i in self.layers:
                self.a[role][slot - 1][i].assign(next(values))
                self.b[role][slot - 1][i].assign(next(values))
        self.slot_kinds[slot] = next(values)

    def bind(self, row_slot, kind: int) -> "MoeLoraRows":
        """The step's view: row_slot [N], each row's slot (0: the base); kind: the most its
        rows' adapters change (MOE_*)."""
        return MoeLoraRows(self, row_slot, kind)


class MoeLoraRows:
    """A step's rows' slots (row_slot [N], 0: the base) and the most their adapters change
    (MOE_*), for `lora_moe_mlp`."""

    def __init__(self, table: MoeLoraTable, row_slot, kind: int):
        self.table, self.row_slot, self.kind = table, row_slot, kind
        self.num_slots = len(table.slot_kinds) - 1

    def delta(self, role: str, layer: int, x, slots, experts=None):
        """Each row's delta of `role` at `layer`: x [P, in], slots [P] (0: none), experts
        [P] (expert roles) -> float32 [P, out]. Per slot, on its rows only: (x @ A) picks
        the row's expert's R columns, then times that expert's B."""
        count, _, w_out = self.table.shapes[role]
        r = self.table.ranks[role]
        x = tf.cast(x, tf.float32)
        parts = tf.dynamic_partition(tf.range(tf.shape(x)[0]), slots, self.num_slots + 1)
        outs = [tf.zeros([tf.shape(parts[0])[0], w_out])]
        for s in range(1, self.num_slots + 1):
            a = self.table.a[role][s - 1][layer].value()                  # [in, n R]
            b = self.table.b[role][s - 1][layer].value()                  # [n, R, out]
            rows = parts[s]
            t = tf.matmul(tf.gather(x, rows), a)                          # [Ps, n R]
            if count == 1:
                outs.append(tf.matmul(t, b[0]))
                continue
            ids = tf.gather(experts, rows)                                # [Ps]
            t = tf.gather(tf.reshape(t, [-1, count, r]), ids, batch_dims=1)  # [Ps, R]
            outs.append(tf.einsum("pr,pro->po", t, tf.gather(b, ids)))
        return tf.dynamic_stitch(parts, outs)


def _swiglu(y):
    gate, up = tf.split(y, 2, axis=-1)
    return tf.nn.silu(gate) * up


def lora_moe_mlp(h, residual, w: dict, config: TransformerConfig, rows: MoeLoraRows,
                 layer: int):
    """residual + moe(h) with each row's adapter deltas, h, residual [M, D] -> [M, D].

    The router's logits gain each row's delta before the top-k. The routed experts then run
    as stock TF ops with each (row, expert) pair's deltas where a row's adapter changes them
    (MOE_EXPERTS), else, given that routing, as the grouped experts' op (kernels/moe.py
    moe_experts; stock TF where it does not apply). The shared expert is a dense MLP: its
    deltas per row. w: the layer's MoE weights (MoE.weights_dict's, with the engine's
    "load" counter)."""
    k, num_experts = config.num_experts_per_token, config.num_experts
    dtype = h.dtype
    add = lambda y, role, x, slots, experts=None: y + tf.cast(  # noqa: E731
        rows.delta(role, layer, x, slots, experts), y.dtype)
    logits = add(linear(h, w["router"]), "router", h, rows.row_slot)
    expert_ids, gates = route(logits, k, config.normalize_expert_weights)    # [M, k]
    y = None
    if rows.kind != MOE_EXPERTS and dtype == tf.float32 and all(
            "kernel" in e["up"] and "kernel" in e["down"] for e in w["experts"]):
        out = kmoe.moe_experts(h, expert_ids, gates, [e["up"]["kernel"] for e in w["experts"]],
                               [e["down"]["kernel"] for e in w["experts"]], residual,
                               with_counts=True)
        if out is not None:
            y, counts = out
            if "load" in w:
                w["load"].assign_add(tf.cast(counts, tf.int64))
    if y is None:
        if "load" in w:
            w["load"].assign_add(tf.cast(expert_counts(expert_ids, num_experts), tf.int64))
        y = residual + (_routed_experts(h, expert_ids, gates, w["experts"], rows, add)
                        if rows.kind == MOE_EXPERTS
                        else grouped_experts(h, expert_ids, gates, w["experts"]))
    if "shared" in w:
        shared, slots = w["shared"], rows.row_slot
        act = _swiglu(add(linear(h, shared["up"]), "shared_up", h, slots))
        out = add(linear(act, shared["down"]), "shared_down", act, slots)
        gate = add(linear(h, shared["gate"]), "shared_gate", h, slots)
        y += out * tf.cast(tf.sigmoid(tf.cast(gate, tf.float32)), dtype)
    return y


def _routed_experts(h, expert_ids, gates, experts: list, rows: MoeLoraRows, add):
    """sum_j gates[:, j] * expert_{expert_ids[:, j]}(h) with each (row, expert) pair's
    deltas, in stock TF ops: h [M, D] -> [M, D] (model/moe.py's grouped_experts where no
    row's adapter changes the experts)."""
    num_rows, k = tf.shape(h)[0], expert_ids.shape[-1]
    pair_experts = tf.reshape(expert_ids, [-1])                               # [P = M k]
    pair_rows = tf.range(num_rows * k) // k
    pair_slots = tf.gather(rows.row_slot, pair_rows)
    x = tf.gather(h, pair_rows)                                               # [P, D]
    by_expert = tf.dynamic_partition(tf.range(num_rows * k), pair_experts, len(experts))

    def experts_linear(x, role):  # each expert's matmul on its pairs, in pair order
        return tf.dynamic_stitch(by_expert, [
            linear(tf.gather(x, pairs), e[role]) for pairs, e in zip(by_expert, experts)])
    up = add(experts_linear(x, "up"), "expert_up", x, pair_slots, pair_experts)
    act = _swiglu(up)
    down = add(experts_linear(act, "down"), "expert_down", act, pair_slots, pair_experts)
    return tf.math.unsorted_segment_sum(down * tf.cast(tf.reshape(gates, [-1, 1]), h.dtype),
                                        pair_rows, num_rows)
