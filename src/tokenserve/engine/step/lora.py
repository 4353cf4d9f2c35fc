"""LoRA adapters inside the step: a resident slot table, and the blocks that add each row's
low-rank delta (as S-LoRA and punica batch them: one step, rows of many adapters).

The table holds `max_loras` adapters (slots 1..max_loras; slot 0 is the base model) as one
variable per slot, role and factor:

    A[role][s - 1]  [layers, in, R_role]      R_role = max_rank x modules fused in the role
    B[role][s - 1]  [layers, R_role, out]     (Llama q/k/v: 3, gate/up: 2; GPT-2: 1), the
                                              scale folded in

and, per slot, `spans` [layers, 4, P, 4] int32: per layer and role the pieces of B that
the adapter fills (rank rows r0..r1 nonzero only in columns c0..c1: a fused QKV's q, k and v
pieces each on their own columns; none for a role or layer it leaves alone), so the ops read
no zeros of the table (kernels/lora_delta.h).

A slot is written whole by `assign` (never a sparse write, which would make every later read
of the variable copy it), so the step reads each variable in place: no per-step copy of the
table. A step with adapter rows takes two more inputs: `active` [K], the distinct slots of its
rows, and `token_slot` [N], each token's index into `active` (-1: the base model). From them
the step sorts its rows by slot once (`order` [N], `offsets` [S + 2]: slot s's rows are
order[offsets[s]:offsets[s + 1]]), shared by every layer, and each projection adds, per row
of slot s,

    delta = (x @ A_s[layer]) @ B_s[layer]

computed per slot on that slot's rows only (kernels/lora_delta.h: one call of the thread
team per projection), so rows of different adapters and of the base share the step, and the
step never splits by adapter. Steps with no adapter row run the base step unchanged (their
own traces).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tokenserve.config import TransformerConfig
from tokenserve.engine.lora_adapter import ROLES, role_ranks, role_shapes
from tokenserve.engine.step.lora_moe import MoeLoraRows, MoeLoraTable, lora_moe_mlp
from tokenserve.engine.step.moe import fused_moe, graph_moe
from tokenserve.kernels import dense as kdense

assert ROLES == kdense.LORA_ROLES  # the ops' spans index roles in this order
from tokenserve.model.layers import linear, norm


class LoraTable(tf.Module):
    """`max_loras` resident adapters of rank up to `max_rank`, slot 0 the base model."""

    def __init__(self, config: TransformerConfig, max_loras: int, max_rank: int,
                 experts: bool = True):
        super().__init__(name="lora_table")
        self.config, self.max_loras, self.max_rank = config, max_loras, max_rank
        self.widths = role_shapes(config)
        self.ranks = role_ranks(config, max_rank)
        layers = config.num_layers
        self.a = {role: [tf.Variable(tf.zeros([layers, w_in, self.ranks[role]]),
                                     trainable=False, name=f"lora_a_{role}_{slot}")
                         for slot in range(1, max_loras + 1)]
                  for role, (w_in, _) in self.widths.items()}
        self.b = {role: [tf.Variable(tf.zeros([layers, self.ranks[role], w_out]),
                                     trainable=False, name=f"lora_b_{role}_{slot}")
                         for slot in range(1, max_loras + 1)]
                  for role, (_, w_out) in self.widths.items()}
        self.spans = [tf.Variable(tf.zeros([layers, len(ROLES), kdense.LORA_PIECES, 4],
                                           tf.int32), trainable=False, name=f"lora_spans_{slot}")
                      for slot in range(1, max_loras + 1)]
        self.moe = (MoeLoraTable(config, max_loras, max_rank)
                    if config.num_experts and experts else None)
        """The experts', shared expert's and router's factors (lora_moe.py), on a MoE model
        (unless `experts` is False: EngineConfig.lora_experts)."""

    @property
    def num_bytes(self) -> int:
        """The whole table's bytes, the MoE factors' (`moe.num_bytes`) included."""
        return sum(int(np.prod(v.shape)) * 4 for slots in (*self.a.values(), *self.b.values())
                   for v in slots) + (self.moe.num_bytes if self.moe is not None else 0)

    def prepare(self, layers: list[dict] | None) -> list[tf.Tensor]:
        """An adapter's factors (per layer, role -> (A [in, r], B [r, out]) float32) as the
        slot variables' values, ROLES order, A then B: zeros where it has no factor, all
        zeros for None. Any thread (the server's, as it checks an adapter), so the engine's
        slot write between steps is only a copy."""
        values = []
        spans = np.zeros(self.spans[0].shape, np.int32)
        for j, role in enumerate(ROLES):
            (w_in, w_out), rank = self.widths[role], self.ranks[role]
            a = np.zeros([self.config.num_layers, w_in, rank], np.float32)
            b = np.zeros([self.config.num_layers, rank, w_out], np.float32)
            for i, layer in enumerate(layers or []):
                if role in layer:
                    fa, fb = layer[role]
                    a[i, :, :fa.shape[1]], b[i, :fb.shape[0]] = fa, fb
                    spans[i, j] = filled_pieces(fb, kdense.LORA_PIECES)
            values += [tf.constant(a), tf.constant(b)]
        values.append(tf.constant(spans))
        return values + (self.moe.prepare(layers) if self.moe is not None else [])

    def write_slot(self, slot: int, values: list[tf.Tensor]) -> None:
        """Puts prepared values (`prepare`'s) in `slot`. The engine writes between steps, on
        its thread, so a step never sees a slot half written; each variable is assigned
        whole (a dense write: the step's reads stay copy-free)."""
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"LoRA slot {slot} is outside 1..{self.max_loras}")
        values = iter(values)
        for role in ROLES:
            self.a[role][slot - 1].assign(next(values))
            self.b[role][slot - 1].assign(next(values))
        self.spans[slot - 1].assign(next(values))
        if self.moe is not None:
            self.moe.write_slot(slot, values)

    def bind(self, blocks, active, token_slot, dtype, moe_kind: int = 0) -> "LoraBlocks":
        """The step's blocks with the deltas of the `active` slots ([K]) on each token's
        slot (`token_slot` [N], -1: none), inside a trace; `moe_kind`: the most the rows'
        adapters change of a mixture of experts (lora_moe.py's MOE_* kinds). (The deltas
        compute in float32 whatever `dtype`, the step's activations', and are cast to it.)"""
        row_slot = tf.gather(tf.concat([[0], active], 0), token_slot + 1)  # [N], 0: none
        order = tf.argsort(row_slot, stable=True)                           # [N] by slot
        counts = tf.math.bincount(row_slot, minlength=self.max_loras + 1,
                                  maxlength=self.max_loras + 1)              # [S + 1]
        offsets = tf.concat([[0], tf.cumsum(counts)], 0)                    # [S + 2]
        factors = {role: ([v.value() for v in self.a[role]], [v.value() for v in self.b[role]])
                   for role in ROLES}
        spans = [v.value() for v in self.spans]
        moe = self.moe.bind(row_slot, moe_kind) if moe_kind and self.moe is not None else None
        return LoraBlocks(blocks, factors, (order, offsets), row_slot, spans, moe)


def filled_pieces(b: np.ndarray, max_pieces: int) -> np.ndarray:
    """The pieces of B [r, out] that are not zero, as [max_pieces, 4] int32 rows (r0, r1,
    c0, c1): rank rows r0..r1 whose nonzero columns all lie in c0..c1, consecutive rows
    whose nonzero columns fall in one range (a fused role's q, k, v or gate, up factor)
    sharing a piece; all-zero rows in none. Past max_pieces the last piece takes the rest
    of the rows, every column (exact, only wider)."""
    # each row's first and last nonzero column in whole-array calls: the check runs on a
    # server thread and holds the GIL the engine's thread needs between steps
    nonzero = b != 0
    firsts = nonzero.argmax(1).tolist()
    ends = (b.shape[1] - nonzero[:, ::-1].argmax(1)).tolist()
    pieces: list[list[int]] = []
    for k in np.flatnonzero(nonzero.any(1)).tolist():
        c0, c1 = firsts[k], ends[k]
        last = pieces[-1] if pieces else None
        # a row after its piece's last one, its columns overlapping the piece's: one piece
        if last is not None and last[1] == k and c0 < last[3] and last[2] < c1:
            last[1], last[2], last[3] = k + 1, min(last[2], c0), max(last[3], c1)
        else:
            pieces.append([k, k + 1, c0, c1])
    if len(pieces) > max_pieces:
        pieces[max_pieces - 1:] = [[pieces[max_pieces - 1][0], pieces[-1][1], 0, b.shape[1]]]
    out = np.zeros([max_pieces, 4], np.int32)
    if pieces:
        out[:len(pieces)] = pieces
    return out


class LoraBlocks:
    """enter, between and exit of the step's blocks (GraphBlocks or FusedBlocks) with each
    row's adapter delta on qkv, out, up and down; every weight dict carries `lora_layer`.

    The deltas need the inputs of each projection: a fused step's layers run the fused block
    op that computes them too (kernels/dense.py lora_finish_block: the block's second half and
    the next block's QKV, one op a layer as in the base step); the first block's QKV, graph
    steps and int8 layers run the projections one by one, each delta by the grouped op
    (kernels/dense.py lora_delta), or where no op is compiled by plain TF ops (every slot's
    product, masked to its rows)."""

    def __init__(self, blocks, factors: dict, groups: tuple, row_slot, spans: list,
                 moe: MoeLoraRows | None = None):
        self.blocks, self.factors, self.groups, self.row_slot = blocks, factors, groups, row_slot
        self.spans, self.moe = spans, moe
        self.config = blocks.model.config
        self.fused = hasattr(blocks, "linear")
        self.weights = [dict(w, lora_layer=i) for i, w in enumerate(blocks.weights)]

    def _add_delta(self, y, x, role: str, layer: int):
        """y [N, out] + each row's delta of `role` at `layer` from x [N, in], in y's dtype."""
        a, b = self.factors[role]
        x32 = tf.cast(x, tf.float32)
        if y.dtype == tf.float32:
            added = kdense.lora_delta(y, x32, self.groups, a, b, layer, self.spans, role)
            if added is not None:
                return added
        delta = kdense.lora_delta(tf.zeros([tf.shape(x)[0], b[0].shape[-1]]), x32,
                                  self.groups, a, b, layer, self.spans, role)
        if delta is None:  # stock TF: every slot's product, masked to its rows
            delta = tf.add_n([
                tf.matmul(tf.matmul(x32, a_s[layer]) * tf.cast(
                    tf.equal(self.row_slot, slot)[:, None], tf.float32), b_s[layer])
                for slot, (a_s, b_s) in enumerate(zip(a, b), start=1)])
        return y + tf.cast(delta, y.dtype)

    def _norm(self, x, w):
        c = self.config
        return self.blocks.norm(x, w) if self.fused else norm(x, w, c.norm, c.norm_eps)

    def _linear(self, x, w, role, layer, residual=None, activation="none"):
        """activation(x @ w + bias + the rows' delta) + residual."""
        if self.fused:
            if activation != "none":
                return kdense.epilogue(self._add_delta(self.blocks.linear(x, w), x, role, layer),
                                       activation=activation)
            return self._add_delta(self.blocks.linear(x, w, residual=residual), x, role, layer)
        y = self._add_delta(linear(x, w), x, role, layer)
        if activation in ("swiglu", "geglu"):
            gate, up = tf.split(y, 2, axis=-1)
            y = (tf.nn.silu(gate) if activation == "swiglu"
                 else tf.nn.gelu(gate, approximate=True)) * up
        elif activation == "gelu_tanh":
            y = tf.nn.gelu(y, approximate=True)
        return y if residual is None else y + residual

    def enter(self, x, rotary, w):
        h = self._norm(x, w["attn_norm"])
        qkv = self._linear(h, w["qkv"], "qkv", w["lora_layer"])
        return self.blocks._split_qkv(qkv, rotary, w)  # QK-norm (Qwen3, Gemma 3) there

    def _finish_block(self, x, attn, w):
        """GraphBlocks._finish_block with the deltas: post-norms (Gemma) on the attention's
        and the MLP's outputs where the layer has them."""
        i = w["lora_layer"]
        act = {"swiglu": "swiglu", "geglu": "geglu"}.get(self.config.mlp, "gelu_tanh")
        if "post_attn_norm" not in w:
            x = self._linear(attn, w["out"], "out", i, residual=x)
        else:
            x = x + self._norm(self._linear(attn, w["out"], "out", i), w["post_attn_norm"])
        if "moe" in w:  # a mixture of experts
            return self._moe(x, w)
        h = self._linear(self._norm(x, w["mlp_norm"]), w["up"], "up", i, activation=act)
        if "post_mlp_norm" not in w:
            return self._linear(h, w["down"], "down", i, residual=x)
        return x + self._norm(self._linear(h, w["down"], "down", i), w["post_mlp_norm"])

    def _moe(self, x, w):
        """x + the MoE MLP of x: with each row's expert, shared expert and router deltas
        (lora_moe.py's stock-TF MLP) where a row's slot holds any, else as the base step
        runs it (fused: the grouped experts' op; graph: engine/step/moe.py's graph_moe)."""
        h = self._norm(x, w["mlp_norm"])

        if self.moe is not None:
            return lora_moe_mlp(h, x, w["moe"], self.config, self.moe, w["lora_layer"])
        if self.fused:
            return fused_moe(h, x, w["moe"], self.config)
        return x + graph_moe(h, w["moe"], self.config)

    def _fused_finish(self, x, attn, w, w_next=None):
        """The block's second half (given w_next, with the next block's QKV: -> (x, qkv)) as
        one op with the deltas, or None where it does not apply: a graph step, int8 or MoE
        layers, or no compiled op."""
        if not self.fused or not all("kernel" in w.get(n, {}) for n in ("out", "up", "down")):
            return None
        if "post_attn_norm" in w or self.config.mlp == "geglu":  # not in the LoRA block op
            return None
        if w_next is not None and "kernel" not in w_next["qkv"]:
            return None
        following = {}
        if w_next is not None:
            following = dict(next_norm=w_next["attn_norm"], next_qkv=w_next["qkv"])
        act = "swiglu" if self.config.mlp == "swiglu" else "gelu_tanh"
        return kdense.lora_finish_block(attn, x, w["out"], w["mlp_norm"], w["up"], w["down"],
                                        self.groups, self.factors, w["lora_layer"], act,
                                        self.config.norm_eps, spans=self.spans, **following)

    def between(self, x, attn, rotary, w, w_next):
        fused = self._fused_finish(x, attn, w, w_next)
        if fused is not None:
            x, qkv = fused
            return (x, *self.blocks._split_qkv(qkv, rotary, w_next))
        x = self._finish_block(x, attn, w)
        return (x, *self.enter(x, rotary, w_next))

    def exit(self, x, attn, w):
        fused = self._fused_finish(x, attn, w)
        return fused if fused is not None else self._finish_block(x, attn, w)
