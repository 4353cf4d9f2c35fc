"""LoRA adapters inside the step: a resident slot table, and the blocks that add each row's
low-rank delta (as S-LoRA and punica batch them: one step, rows of many adapters).

The table holds `max_loras` adapters (slots 1..max_loras; slot 0 stays zeros: no adapter)
as one variable per role and factor, slot-major so a step reads the slots it uses with one
gather each (never a dense read, which after a slot's sparse write would copy the table):

    A[role]  [S + 1, layers, in, R_role]      R_role = max_rank x modules fused in the role
    B[role]  [S + 1, layers, R_role, out]     (Llama q/k/v: 3, gate/up: 2; GPT-2: 1), the
                                           scale folded in

A step with adapter rows takes two more inputs: `active` [K], the distinct slots of its rows,
and `token_slot` [N], each token's index into `active` (-1: the base model). Each projection
then adds, per token row,

    delta = ((x @ A_k) * mask) @ B_k       A_k [in, K*R] (the K slots side by side),
                                           B_k [K*R, out], mask [N, K*R]: 1 on the row's slot

so rows of different adapters and of the base share every matmul, grouped by adapter in the
K*R axis, and the step never splits by adapter. Steps with no adapter row run the base step
unchanged (their own traces).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tokenserve.config import TransformerConfig
from tokenserve.engine.lora_adapter import ROLES, role_ranks, role_shapes
from tokenserve.errors import ConfigError
from tokenserve.kernels import dense as kdense
from tokenserve.model.layers import linear, norm


class LoraTable(tf.Module):
    """`max_loras` resident adapters of rank up to `max_rank`, slot 0 the base model."""

    def __init__(self, config: TransformerConfig, max_loras: int, max_rank: int):
        super().__init__(name="lora_table")
        if config.qk_norm or config.post_norms or config.mlp == "geglu":
            # LoraBlocks computes Llama's and GPT-2's blocks only
            raise ConfigError("LoRA adapters on models with QK-norm, post-norms or GeGLU "
                              "(Qwen3, Gemma) are not supported yet")
        self.config, self.max_loras, self.max_rank = config, max_loras, max_rank
        self.widths = role_shapes(config)
        self.ranks = role_ranks(config, max_rank)
        slots, layers = max_loras + 1, config.num_layers
        self.a = {role: tf.Variable(tf.zeros([slots, layers, w_in, self.ranks[role]]),
                                    trainable=False, name=f"lora_a_{role}")
                  for role, (w_in, _) in self.widths.items()}
        self.b = {role: tf.Variable(tf.zeros([slots, layers, self.ranks[role], w_out]),
                                    trainable=False, name=f"lora_b_{role}")
                  for role, (_, w_out) in self.widths.items()}
        self._write = None

    @property
    def num_bytes(self) -> int:
        return sum(int(np.prod(v.shape)) * 4 for v in (*self.a.values(), *self.b.values()))

    def write_slot(self, slot: int, layers: list[dict] | None) -> None:
        """Puts an adapter (per layer, role -> (A [in, r], B [r, out]) float32) in `slot`,
        zeros where it has no factor; None clears the slot. One traced call writes every
        role, so a step never sees a slot half written (the engine writes between steps)."""
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"LoRA slot {slot} is outside 1..{self.max_loras}")
        values = []
        for role in ROLES:
            (w_in, w_out), rank = self.widths[role], self.ranks[role]
            a = np.zeros([1, self.config.num_layers, w_in, rank], np.float32)
            b = np.zeros([1, self.config.num_layers, rank, w_out], np.float32)
            for i, layer in enumerate(layers or []):
                if role in layer:
                    fa, fb = layer[role]
                    a[0, i, :, :fa.shape[1]], b[0, i, :fb.shape[0]] = fa, fb
            values += [a, b]
        if self._write is None:  # traced once: one slot's shapes, never the whole table
            specs = [tf.TensorSpec([], tf.int32)] + [
                tf.TensorSpec([1, *v.shape[1:]], tf.float32) for role in ROLES
                for v in (self.a[role], self.b[role])]

            @tf.function(input_signature=specs, autograph=False)
            def write(slot, *values):
                for j, role in enumerate(ROLES):
                    for variable, value in ((self.a[role], values[2 * j]),
                                            (self.b[role], values[2 * j + 1])):
                        variable.scatter_update(tf.IndexedSlices(value, slot[None]))
            self._write = write
        self._write(tf.constant(slot, tf.int32), *values)

    def bind(self, blocks, active, token_slot, dtype) -> "LoraBlocks":
        """The step's blocks with the deltas of the `active` slots ([K]) on each token's
        slot (`token_slot` [N], -1: none), inside a trace."""
        num_active = tf.shape(active)[0]
        factors = {}
        for role in ROLES:
            rank, (w_in, w_out) = self.ranks[role], self.widths[role]
            a = tf.gather(self.a[role], active)                       # [K, L, in, R]
            a = tf.reshape(tf.transpose(a, [1, 2, 0, 3]),
                           [self.config.num_layers, w_in, num_active * rank])
            b = tf.gather(self.b[role], active)                       # [K, L, R, out]
            b = tf.reshape(tf.transpose(b, [1, 0, 2, 3]),
                           [self.config.num_layers, num_active * rank, w_out])
            factors[role] = (tf.unstack(tf.cast(a, dtype)), tf.unstack(tf.cast(b, dtype)))
        one_hot = tf.one_hot(token_slot, num_active, dtype=dtype)      # [N, K]; -1: zeros
        masks = {rank: tf.repeat(one_hot, rank, axis=1)                # [N, K*R]
                 for rank in set(self.ranks.values())}
        return LoraBlocks(blocks, factors, {r: masks[self.ranks[r]] for r in ROLES}, one_hot)


class LoraBlocks:
    """enter, between and exit of the step's blocks (GraphBlocks or FusedBlocks) with each
    row's adapter delta on qkv, out, up and down; every weight dict carries `lora_layer`.

    The deltas need the inputs of each projection: a fused step's layers run the fused block
    op that computes them too (kernels/dense.py lora_finish_block: the block's second half and
    the next block's QKV, one op a layer as in the base step); the first block's QKV, graph
    steps and int8 layers run the projections one by one (the fused ops' `linear` and `norm`
    where the step is fused, plain TF ops otherwise: no XLA program per number of active
    slots)."""

    def __init__(self, blocks, factors: dict, masks: dict, one_hot):
        self.blocks, self.factors, self.masks, self.one_hot = blocks, factors, masks, one_hot
        self.config = blocks.model.config
        self.fused = hasattr(blocks, "linear")
        self.weights = [dict(w, lora_layer=i) for i, w in enumerate(blocks.weights)]

    def _delta(self, x, role: str, layer: int):
        a, b = self.factors[role][0][layer], self.factors[role][1][layer]
        return tf.matmul(tf.matmul(x, a) * self.masks[role], b)

    def _norm(self, x, w):
        c = self.config
        return self.blocks.norm(x, w) if self.fused else norm(x, w, c.norm, c.norm_eps)

    def _linear(self, x, w, role, layer, residual=None, activation="none"):
        """activation(x @ w + bias + the rows' delta) + residual. Fused, the delta rides the
        op's residual input (after the activation there, so up's goes through the epilogue
        op with its activation): no separate adds."""
        delta = self._delta(x, role, layer)
        if self.fused:
            if activation != "none":
                return kdense.epilogue(self.blocks.linear(x, w, residual=delta),
                                       activation=activation)
            return self.blocks.linear(x, w, residual=delta if residual is None
                                      else residual + delta)
        y = linear(x, w) + delta
        if activation == "swiglu":
            gate, up = tf.split(y, 2, axis=-1)
            y = tf.nn.silu(gate) * up
        elif activation == "gelu_tanh":
            y = tf.nn.gelu(y, approximate=True)
        return y if residual is None else y + residual

    def enter(self, x, rotary, w):
        h = self._norm(x, w["attn_norm"])
        return self.blocks._split_qkv(self._linear(h, w["qkv"], "qkv", w["lora_layer"]), rotary)

    def _finish_block(self, x, attn, w):
        i = w["lora_layer"]
        x = self._linear(attn, w["out"], "out", i, residual=x)
        act = "swiglu" if self.config.mlp == "swiglu" else "gelu_tanh"
        h = self._linear(self._norm(x, w["mlp_norm"]), w["up"], "up", i, activation=act)
        return self._linear(h, w["down"], "down", i, residual=x)

    def _fused_finish(self, x, attn, w, w_next=None):
        """The block's second half (given w_next, with the next block's QKV: -> (x, qkv)) as
        one op with the deltas, or None where it does not apply: a graph step, int8 or MoE
        layers, or no compiled op."""
        if not self.fused or not all("kernel" in w.get(n, {}) for n in ("out", "up", "down")):
            return None
        if w_next is not None and "kernel" not in w_next["qkv"]:
            return None
        i = w["lora_layer"]
        factors = {r: (self.factors[r][0][i], self.factors[r][1][i]) for r in ("out", "up",
                                                                             "down")}
        following = {}
        if w_next is not None:
            j = w_next["lora_layer"]
            factors["qkv"] = (self.factors["qkv"][0][j], self.factors["qkv"][1][j])
            following = dict(next_norm=w_next["attn_norm"], next_qkv=w_next["qkv"])
        act = "swiglu" if self.config.mlp == "swiglu" else "gelu_tanh"
        return kdense.lora_finish_block(attn, x, w["out"], w["mlp_norm"], w["up"], w["down"],
                                        self.one_hot, factors, act, self.config.norm_eps,
                                        **following)

    def between(self, x, attn, rotary, w, w_next):
        fused = self._fused_finish(x, attn, w, w_next)
        if fused is not None:
            x, qkv = fused
            return (x, *self.blocks._split_qkv(qkv, rotary))
        x = self._finish_block(x, attn, w)
        return (x, *self.enter(x, rotary, w_next))

    def exit(self, x, attn, w):
        fused = self._fused_finish(x, attn, w)
        return fused if fused is not None else self._finish_block(x, attn, w)
