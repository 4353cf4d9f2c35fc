"""The engine's compiled steps, one family each (design notes: docs/engine.md).

Transformer: the KV cache is two resource variables per layer (keys, values), each
[rows, Hkv * Dh] with rows = num_blocks * block_size, stored in the compute dtype or in 16
bits under float32 compute (`kv_dtype`: new rows are rounded as they are scattered, read
rows widened after the gather or inside the fused op). A step scatters only the new tokens'
keys/values into it and gathers only the rows of the live context (ResourceScatterUpdate /
ResourceGather). Nothing ever reads a cache variable densely: after a sparse update TF keeps
a variable in copy-on-read mode, and one dense read would copy the whole cache (0.2-2.8 s
per step for a 2.4 GB cache). The cache never enters XLA either: an XLA cluster copies the
resource variables it touches in and out. So per-step memory traffic is the weights plus
the live context, independent of cache capacity (benchmarks/kv_capacity.py).

What does go through XLA (float32 weights only) is the dense half of every block: norms,
projections, MLP and the LM head, as functions of explicit weights, so one program per
token bucket serves all layers (the head only where it gets more rows than the fused ops
take: `fused_head`). XLA's float32 dot code beats oneDNN's at every batch size
on these CPUs, while oneDNN's bf16 matmuls beat XLA's, and the int8 kernel is a TF op that
XLA cannot compile: those run the same functions in graph mode.

Tokens of all sequences are packed into one [N] axis for the dense layers: decode tokens
group by group, then prefill tokens, then padding to a bucket size. Attention runs per
decode group (sequences of similar context length, so a short context is not padded to a
long one; one query each) and for the prefill chunks. One graph is traced per (number of
decode groups, prefill or not), so a batch-1 decode step runs one group's attention and no
prefill ops; with the fused attention op (kernels/paged_attention.py), which reads each
sequence's own length, the runner makes one group of all decode rows. With that op each
prefill token is one more decode query, over its own sequence's rows up to its position, so
a layer's prefill attention is one op too. The graph path, where the op cannot be built, gathers the
rows: decode attention reads them in their stored layout with no transposes (each head's
query spread over the kv-head columns, zero elsewhere; two batched matmuls give scores
[S, H, L] and outputs), prefill attention runs a masked attention per chunk.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import tensorflow as tf

from tokenserve.kernels import dense as kdense
from tokenserve.kernels import paged_attention
from tokenserve.kernels.int8_matmul import int8_finish_block, int8_matmul
from tokenserve.model.layers import apply_rope, attend, linear, mlp, norm, rope_angles
from tokenserve.model.precision import cpu_has_bf16
from tokenserve.model.lstm import LSTMLM
from tokenserve.model.transformer import TransformerLM

I32 = tf.int32


def _spec(shape, dtype=I32):
    return tf.TensorSpec(shape, dtype)


class PagedPrefill(NamedTuple):
    """A step's prefill tokens as decode queries of the paged attention op: each token's
    context rows [Np, Lp] (its sequence's) and length [Np] (its position + 1)."""
    rows: tf.Tensor
    lengths: tf.Tensor


class FlatCall:
    """Calls a traced step's concrete function with its inputs already flat, on TF's
    single-threaded executor.

    A concrete function's own call binds the nested arguments (lists of tuples of arrays)
    to its signature and casts each against its TensorSpec: 0.2-0.8 ms a step on a 2-core
    VM, measured against this call with the same inputs (about 6 % of an int8 GPT-2-small
    step at batch 1). Every step input is int32, built by the runner, so the binding checks
    nothing the graph would not. Without `_call_flat` (a TensorFlow that renamed it), it
    falls back to the public call.

    The executor: TF's default one hands ready nodes between threads and keeps per-node
    bookkeeping for that; a step is a chain of 500-800 nodes with no control flow (no
    AutoGraph), each op already parallel inside, so SINGLE_THREADED_EXECUTOR runs it in
    order on the calling thread. Two LLMs on one GPT-2-small export in one process,
    alternating (AVX2 cap): int8 one stream 1.17x, 4 prompts 1.08x; float32 1.11x and 1.11x;
    the same greedy tokens (docs/performance.md)."""

    EXECUTOR = "SINGLE_THREADED_EXECUTOR"

    def __init__(self, concrete, int32_inputs: bool = True):
        self.concrete = concrete
        self.int32_inputs = int32_inputs  # False: the inputs are tensors already
        self._call_flat = getattr(concrete, "_call_flat", None)
        self._captured = concrete.captured_inputs if self._call_flat else None
        self._num_inputs = len(tf.nest.flatten(concrete.structured_input_signature))

    def __call__(self, *args):
        with tf.experimental.function_executor_type(self.EXECUTOR):
            if self._call_flat is None:
                return self.concrete(*args)
            inputs = tf.nest.flatten(args)
            if self.int32_inputs:
                inputs = [tf.constant(x, I32) for x in inputs]
            if len(inputs) != self._num_inputs:  # the runner picked the wrong step: say so
                raise ValueError(f"step called with {len(inputs)} inputs, traced for "
                                 f"{self._num_inputs}")
            return self._call_flat(inputs, self._captured)


class TransformerStep(tf.Module):
    """Paged-attention step for a TransformerLM over a block-pooled KV cache.

    Packed token order (the runner's job): decode tokens group by group, then prefill
    tokens, then padding up to the step's bucket size. One graph is traced per (number of
    decode groups, with or without prefill), so a decode-only step at batch 1 runs only what
    it needs: one group's attention and no prefill ops.
    """

    def __init__(self, model: TransformerLM, num_rows: int, jit_dense: bool = False,
                 kv_dtype: str | None = None):
        super().__init__(name="transformer_step")
        self.model = model
        c = model.config
        self.kv_width = c.num_kv_heads * c.head_dim
        self.kv_dtype = tf.as_dtype(kv_dtype or model.compute_dtype)
        self.caches = [tuple(tf.Variable(tf.zeros([num_rows, self.kv_width], self.kv_dtype),
                                         trainable=False, name=f"{kind}_cache_{i}")
                             for kind in ("key", "value"))
                       for i in range(c.num_layers)]
        group = c.num_heads // c.num_kv_heads
        # head h reads kv head h // group: [H, Hkv], with the 1/sqrt(Dh) score scale folded in
        self.head_to_kv = tf.one_hot(tf.range(c.num_heads) // group, c.num_kv_heads,
                                     dtype=model.compute_dtype)
        self.scaled_head_to_kv = self.head_to_kv * (1.0 / math.sqrt(c.head_dim))
        # The blocks' weights as tensors read once here, not as variables: a traced step
        # then takes them as captured inputs instead of running a ReadVariableOp per weight
        # per step (about 200 of a GPT-2-small step's nodes). An eager read aliases the
        # variable's buffer (no copy), and nothing assigns to serving weights afterwards.
        self.layer_weights = [tf.nest.map_structure(tf.convert_to_tensor, block_weights(block))
                              for block in model.blocks]
        # the fused op reads K/V rows in place (no gathered copies, one op per layer); the
        # graph path below does the same math where the op could not be built
        self.fused_attention = paged_attention.is_compiled()
        self.jit_dense = jit_dense
        # The dense half of each block (norms, projections, MLP) as functions of explicit
        # weights, so one XLA program per token bucket serves every layer. The KV cache never
        # enters them: XLA would copy the cache variables in and out on every call.
        dense = ((lambda fn: tf.function(fn, jit_compile=True, autograph=False)) if jit_dense
                 else (lambda fn: fn))
        self._enter, self._between, self._exit, self._head = (
            dense(self._enter_fn), dense(self._between_fn), dense(self._exit_fn),
            dense(self.model.head_logits))  # the head on one row per sequence: its own bucket
        # The dense half as fused ops (kernels/dense.py): one op per layer with its bias,
        # activation and residual, one per norm. For float32 weights, steps of a few tokens
        # run them instead of the XLA programs (XLA's matmuls are as fast, but its runtime
        # spends milliseconds a step between the small fusions around them); int8 weights,
        # which XLA cannot take, run them at every size.
        # bfloat16 weights run them too, for steps of a few tokens: the ops widen each weight
        # as they read it and compute in float32, so a batch-1 step streams half of float32's
        # bytes, where oneDNN's bf16 matmuls at one row read far below the memory's rate.
        # Their activations are float32 (the KV cache stays bfloat16, which the attention op
        # reads under a float32 query), so a fused bfloat16 step needs that op too.
        int8 = model.config.weight_format == "int8"
        bf16 = (model.compute_dtype == "bfloat16" and model.config.weight_format == "float"
                and self.fused_attention)
        self.kernel_dense = kdense.is_compiled() and (
            model.compute_dtype == "float32" and (jit_dense or int8) or bf16)
        # bfloat16 on a CPU whose oneDNN has no bf16 matmul (no AVX512-BF16 or AMX, or capped
        # below them): every step through the fused ops, as int8, since the graph's bf16
        # matmuls would be emulated there, or refused by oneDNN (a process abort)
        self.fused_every_step = self.kernel_dense and (int8 or bf16 and not cpu_has_bf16())
        # the fused steps' weights: the matrices as stored, the vectors (norms, biases) in
        # float32, cast once here rather than in every step
        self.fused_weights = self.layer_weights
        self._fused_final_norm = model.final_norm.weights_dict()
        self._fused_head_weights = (model.head.weights_dict() if model.head is not None
                                    else None)
        if self.kernel_dense and model.compute_dtype != "float32":
            self.fused_weights = [tf.nest.map_structure(_float32_vector, w)
                                  for w in self.layer_weights]
            self._fused_final_norm = tf.nest.map_structure(_float32_vector,
                                                           self._fused_final_norm)
            if self._fused_head_weights is not None:
                self._fused_head_weights = tf.nest.map_structure(_float32_vector,
                                                                 self._fused_head_weights)
        # Whether steps through XLA's dense programs run the LM head as the fused op: set
        # by the runner, before any step is traced, where the head never gets more rows
        # (one per sequence) than the fused ops take as fast as XLA. Then no head program
        # is compiled, per token bucket or per row bucket.
        self.fused_head = False
        # The LM head through an int8 or float16 screen (engine/screened_head.py) for steps
        # whose rows need only an argmax (greedy, or plainly sampled with their noise): set
        # by the runner before any step is traced, float32 or (after fused steps) bfloat16
        # weights.
        self.screened_head = None
        self._write_rows = None  # write_rows' traced scatter, made on first use
        self._dense_programs = None  # dense_programs' graph, made on first use
        self._steps: dict[tuple[int, bool, bool],
                          tf.types.experimental.PolymorphicFunction] = {}
        self._concrete: dict[tuple[int, bool, bool], FlatCall] = {}
        self._heads: dict[str, FlatCall] = {}  # head_function's, by kind

    # -- the dense half, XLA-compiled when jit_dense ------------------------------------------
    def _qkv(self, x, rotary, w):
        """x: [N, D] -> q [N, H, Dh], k, v [N, Hkv*Dh] (RoPE applied)."""
        c = self.model.config
        qkv = linear(norm(x, w["attn_norm"], c.norm, c.norm_eps), w["qkv"])
        return self._split_qkv(qkv, rotary)

    def rotary(self, positions, dtype=None):
        """The step's rotary cos and sin ([1, N, 1, Dh] each, in `dtype`, default the compute
        dtype), computed once for every layer, or None for a model without RoPE."""
        c = self.model.config
        if c.position != "rope":
            return None
        return rope_angles(positions[None], c.head_dim, c.rope_theta,
                           dtype or self.model.compute_dtype, c.rope_freq_factors)

    def _split_qkv(self, qkv, rotary):
        c = self.model.config
        # static shapes with -1 for the tokens: no Shape/StridedSlice/Pack ops per layer
        q, k, v = tf.split(qkv, [c.num_heads * c.head_dim, self.kv_width, self.kv_width], -1)
        q = tf.reshape(q, [-1, c.num_heads, c.head_dim])
        if rotary is not None:
            q = apply_rope(q[None], *rotary)[0]
            k = tf.reshape(apply_rope(tf.reshape(k, [1, -1, c.num_kv_heads, c.head_dim]),
                                      *rotary), [-1, self.kv_width])
        return q, k, v

    def _finish_block(self, x, attn, w):
        c = self.model.config
        x = x + linear(attn, w["out"])
        return x + mlp(norm(x, w["mlp_norm"], c.norm, c.norm_eps), w["up"], w["down"], c.mlp)

    def _enter_fn(self, x, rotary, w):
        return self._qkv(x, rotary, w)

    def _between_fn(self, x, attn, rotary, w, w_next):
        x = self._finish_block(x, attn, w)
        return (x, *self._qkv(x, rotary, w_next))

    def _exit_fn(self, x, attn, w):
        return self._finish_block(x, attn, w)

    # -- the dense half as fused ops, for steps of a few tokens (graph mode) -----------------
    def _norm_k(self, x, w):
        return kdense.layer_norm(x, w["scale"], w.get("bias"), self.model.config.norm_eps)

    @staticmethod
    def _linear_k(x, w, residual=None, activation="none"):
        if "q" in w:  # int8 weights: the int8 op, then the same epilogue
            return kdense.epilogue(int8_matmul(x, w["q"], w["scale"]), w.get("bias"), residual,
                                   activation)
        return kdense.dense(x, w["kernel"], w.get("bias"), residual, activation=activation)

    def _qkv_k(self, x, rotary, w):
        return self._split_qkv_k(self._linear_k(self._norm_k(x, w["attn_norm"]), w["qkv"]),
                                 rotary)

    def _split_qkv_k(self, qkv, rotary):
        """_split_qkv in one op (kernels/dense.py split_rope); rotary: (cos, sin) [N, Dh]
        each (_step flattens them once a step) or None."""
        c = self.model.config
        return kdense.split_rope(qkv, c.num_heads, c.num_kv_heads, c.head_dim, rotary)

    def _finish_block_k(self, x, attn, w, w_next=None):
        """The block's second half -> (x, the next block's QKV projection or None).

        With one weight format throughout, a single op takes the block's three matrices and,
        given w_next, the next block's norm and QKV matrix too, back to back; else the
        separate ops (None: the caller projects the next block's QKV itself)."""
        act = "swiglu" if self.model.config.mlp == "swiglu" else "gelu_tanh"
        eps = self.model.config.norm_eps
        for key, fused in (("q", int8_finish_block), ("kernel", kdense.finish_block)):
            if not all(key in w[name] for name in ("out", "up", "down")):
                continue
            following = {}
            if w_next is not None and key in w_next["qkv"]:
                following = dict(next_norm=w_next["attn_norm"], next_qkv=w_next["qkv"])
            y = fused(attn, x, w["out"], w["mlp_norm"], w["up"], w["down"], act, eps,
                      **following)  # None: the op is not compiled
            if y is not None:
                return y if following else (y, None)
        x = self._linear_k(attn, w["out"], residual=x)
        h = self._linear_k(self._norm_k(x, w["mlp_norm"]), w["up"], activation=act)
        return self._linear_k(h, w["down"], residual=x), None

    def _enter_k(self, x, rotary, w):
        return self._qkv_k(x, rotary, w)

    def _between_k(self, x, attn, rotary, w, w_next):
        x, qkv = self._finish_block_k(x, attn, w, w_next)
        if qkv is None:
            return (x, *self._qkv_k(x, rotary, w_next))
        return (x, *self._split_qkv_k(qkv, rotary))

    def _exit_k(self, x, attn, w):
        return self._finish_block_k(x, attn, w)[0]

    def _head_k(self, x):
        m = self.model
        x = self._norm_k(x, self._fused_final_norm)
        if m.head is not None:
            return self._linear_k(x, self._fused_head_weights)
        if m.config.weight_format == "int8":  # tied: the token embedding [vocab, D]
            return int8_matmul(x, m.token_embedding_q, m.token_embedding_scale)
        return kdense.dense(x, m.token_embedding, layout="nk")

    def _head_screened(self, x):
        return self._head_screened_noisy(x, None)

    def _head_screened_noisy(self, x, noise):
        m = self.model
        if self.kernel_dense:  # float32 x (a bfloat16 model's only after fused steps)
            x = self._norm_k(x, self._fused_final_norm)
        else:
            c = m.config
            x = norm(x, m.final_norm.weights_dict(), c.norm, c.norm_eps)
        return self.screened_head(x, noise)

    # -- attention over the paged cache (graph mode, never XLA) ------------------------------
    def _gather_kv(self, rows, cache):
        """rows [S, L] -> keys, values [S, L, Hkv*Dh] in the compute dtype (a 16-bit cache is
        widened after the gather: only the live rows, never the whole cache)."""
        dtype = self.model.compute_dtype
        return tuple(tf.cast(tf.gather(variable, rows), dtype) for variable in cache)

    def _decode_attention(self, q, rows, bias, cache, write=None):
        """q: [S, H, Dh]; rows: [S, L]; bias: [S, 1, L] (0 or -max) -> [S, H*Dh].

        With the fused op, `bias` is the lengths [S] of the contexts instead, and `write`
        (new keys, new values, their cache rows) or None: the layer's new rows, which the
        op stores before it attends; q may then have rows past S (padding: zeros out)."""
        c = self.model.config
        if self.fused_attention:
            scale = 1.0 / math.sqrt(c.head_dim)
            if write is not None:
                return paged_attention.paged_write_decode_attention(
                    q, cache[0], cache[1], rows, bias, *write, scale)
            return paged_attention.paged_decode_attention(q, cache[0], cache[1], rows, bias,
                                                          scale)
        keys, values = self._gather_kv(rows, cache)
        num_seqs = tf.shape(q)[0]
        # each head's query spread over all kv-head columns, zero outside its own: one
        # batched matmul against the keys in their stored [L, Hkv*Dh] layout, no transposes
        # (an einsum here cost 0.1 ms a layer in op overhead at batch 1)
        q_rows = tf.reshape(q[:, :, None, :] * self.scaled_head_to_kv[None, :, :, None],
                            [num_seqs, c.num_heads, self.kv_width])
        scores = tf.matmul(q_rows, keys, transpose_b=True)                # [S, H, L]
        probs = tf.nn.softmax(tf.cast(scores, tf.float32) + bias)
        out = tf.matmul(tf.cast(probs, values.dtype), values)              # [S, H, Hkv*Dh]
        if c.num_kv_heads > 1:  # keep each head's own kv head
            out = tf.reshape(out, [num_seqs, c.num_heads, c.num_kv_heads, c.head_dim])
            out = tf.reduce_sum(out * self.head_to_kv[None, :, :, None], axis=2)
        return tf.reshape(out, [num_seqs, c.num_heads * c.head_dim])

    def _prefill_attention(self, q, index, rows, mask, cache):
        """q: [Np + 1, H, Dh] (row Np: padding); index: [S, T]; rows: [S, L];
        mask: [S, T, L] -> [S, T, H*Dh]."""
        c = self.model.config
        keys, values = self._gather_kv(rows, cache)
        shape = tf.concat([tf.shape(rows), [c.num_kv_heads, c.head_dim]], 0)
        return attend(tf.gather(q, index), tf.reshape(keys, shape), tf.reshape(values, shape),
                      mask)

    def _attention_layout(self, decode_groups, num_prefill, num_tokens, dtype):
        """Where each part of the packed tokens goes, the same for every layer, so it is built
        once per step rather than once per layer (each op in the step costs several
        microseconds of executor time): q's split sizes (one per decode group, then the rest),
        the number of prefill tokens (0 without prefill) and the zero rows that stand for the
        bucket padding."""
        sizes = [tf.shape(rows)[0] for rows, _ in decode_groups]
        num_decode = tf.add_n(sizes) if sizes else tf.constant(0)
        split_sizes = tf.stack(sizes + [num_tokens - num_decode])
        c = self.model.config
        padding = tf.zeros([num_tokens - num_decode - num_prefill, c.num_heads * c.head_dim],
                           dtype)
        return split_sizes, num_prefill, padding

    def _layer_attention(self, q, decode_groups, biases, prefill, cache, layout, write=None):
        """q: [N, H, Dh] in packed order -> attention output [N, H*Dh]. write: the layer's
        new (keys, values, cache rows) for the fused op's first call to store (the graph
        orders the later calls, reads of the same variables, after it); None: stored
        already."""
        c = self.model.config
        width = c.num_heads * c.head_dim
        if write is not None and len(decode_groups) == 1 and prefill is None:
            # every query but the bucket padding is the group's, in order: the op attends
            # them and writes the padding's zeros itself (no split of q, no concat)
            (rows, _), = decode_groups
            return self._decode_attention(q, rows, biases[0], cache, write)
        split_sizes, num_prefill, padding = layout
        pieces = tf.split(q, split_sizes, num=len(decode_groups) + 1)
        outputs = []
        for piece, (rows, _), bias in zip(pieces, decode_groups, biases):
            outputs.append(self._decode_attention(piece, rows, bias, cache, write))
            write = None
        if isinstance(prefill, PagedPrefill):
            outputs.append(self._decode_attention(pieces[-1][:num_prefill], prefill.rows,
                                                  prefill.lengths, cache, write))
            write = None
        elif prefill is not None:
            index, rows, mask, unpack = prefill
            q_prefill = tf.concat([pieces[-1][:num_prefill], tf.zeros_like(q[:1])], 0)
            prefilled = self._prefill_attention(q_prefill, index, rows, mask, cache)
            outputs.append(tf.gather(tf.reshape(prefilled, [-1, width]), unpack))
        if write is not None:  # _step passes rows only where a fused call takes them
            raise AssertionError("the layer's new K/V rows were not stored")
        outputs.append(padding)  # bucket padding
        return tf.concat(outputs, 0)

    # -- the step -------------------------------------------------------------------------
    def step_function(self, num_groups: int, with_prefill: bool, fused_dense: bool = False):
        """The traced step for `num_groups` decode groups, with or without prefill rows;
        `fused_dense`: the dense half through kernels/dense.py (only when kernel_dense)."""
        fused_dense = fused_dense and self.kernel_dense
        key = (num_groups, with_prefill, fused_dense)
        if key not in self._steps:
            signature = [
                _spec([None]),          # token_ids  [N]  packed, padded to a bucket
                _spec([None]),          # positions  [N]
                _spec([None]),          # write_rows [N]  cache row of each token (padding: 0)
                [(_spec([None, None]),  # rows [Sg, Lg] context rows (padding: row 0)
                  _spec([None]))        # pos  [Sg]     query position
                 ] * num_groups,
                (_spec([None, None]),   # prefill index [Sp, Tp] into the prefill rows
                                        #   (padding: Np, a zero row)
                 _spec([None, None]),   # prefill rows  [Sp, Lp]
                 _spec([None, None]),   # prefill pos   [Sp, Tp] (padding: -1)
                 _spec([None])) if with_prefill else (),  # unpack [Np] into [Sp * Tp]
                _spec([None]),          # last_tokens [S] packed index whose logits we need
            ]
            dense = ((self._enter_k, self._between_k, self._exit_k) if fused_dense
                     else (self._enter, self._between, self._exit))
            # without a screen there is one head per step kind: inside the step, no second
            # call (head_function)
            head = None if self.screened_head is not None else self._head_fn(fused_dense)
            dense = (*dense, head)

            def step(token_ids, positions, write_rows, decode_groups, prefill, last_tokens):
                return self._step(dense, fused_dense, token_ids, positions, write_rows,
                                  decode_groups, prefill, last_tokens)
            # No AutoGraph: the step's loops and branches are over Python values (layers, the
            # config), and converting them cost 2.4 s of the first trace on a 2-core VM
            # (0.5 s without), and about a fifth of every later one.
            self._steps[key] = tf.function(step, input_signature=signature, autograph=False)
            # Steps call the concrete function: the tf.function's own call (matching the
            # arguments against its signature on every call) measured 0.3-0.75 ms more per
            # call on a 2-core VM, for the same graph.
            self._concrete[key] = FlatCall(self._steps[key].get_concrete_function())
        return self._concrete[key]

    def _head_fn(self, fused_dense: bool):
        """The unscreened LM head after a step with or without the fused dense ops: the
        fused op there, else XLA's program (or the fused op where `fused_head`)."""
        fused = self.kernel_dense and (fused_dense or self.fused_head)
        return self._head_k if fused else self._head

    def float32_rows(self, fused_dense: bool) -> bool:
        """Whether a step leaves float32 hidden rows for its head (the screen takes only
        those): the fused ops' activations are float32 whatever the weights; a bfloat16
        graph step's are bfloat16."""
        return fused_dense or self.model.compute_dtype == "float32"

    def logits(self, step_output, fused_dense: bool, screened: bool = False, noise=None):
        """A step's output as float32 logits [S, vocab]: the step's own where it ran its
        head, else its hidden rows through head_function. noise: float32 [S, vocab] or
        None, added to a screened head's logits (ScreenedHead)."""
        if self.screened_head is None:
            return step_output
        if screened and noise is not None:
            return self.head_function(fused_dense, True, noisy=True)(
                step_output, tf.constant(noise, tf.float32))
        return self.head_function(fused_dense, screened)(step_output)

    def head_function(self, fused_dense: bool, screened: bool = False, noisy: bool = False):
        """With a screen, the LM head a step's hidden rows go through: [S, D] -> float32
        logits [S, vocab].

        A function of its own, called after the step on its output (a tensor, never a
        NumPy copy): which head runs depends on the rows' sampling, not on the step's
        kind, so one trace per head serves every step graph, where heads inside the step
        would trace every step kind twice. `screened`: rows that need only an argmax,
        through `screened_head`; `noisy`: that head with a second input, noise [S, vocab]
        added to the logits (sampled rows' draws)."""
        if screened and noisy and self.screened_head is not None:
            kind, head = "screened-noisy", self._head_screened_noisy
        elif screened and self.screened_head is not None:
            kind, head = "screened", self._head_screened
        else:
            head = self._head_fn(fused_dense)
            kind = "fused" if head == self._head_k else "xla"
        if kind not in self._heads:
            # the rows as the step leaves them: float32 after the fused ops, whatever the
            # weights; a bfloat16 graph step's (the "xla" kind there) in bfloat16
            dtype = self.model.compute_dtype if kind == "xla" else tf.float32
            specs = [tf.TensorSpec([None, self.model.config.hidden_size], dtype)]
            if kind == "screened-noisy":
                specs.append(tf.TensorSpec([None, None], tf.float32))
            traced = tf.function(head, input_signature=specs, autograph=False)
            self._heads[kind] = FlatCall(traced.get_concrete_function(), int32_inputs=False)
        return self._heads[kind]

    def _step(self, dense, fused, token_ids, positions, write_rows, decode_groups, prefill,
              last_tokens):
        enter, between, exit_, head = dense
        m = self.model
        num_tokens = tf.shape(token_ids)[0]
        # masks are shared by all layers: build them once
        if self.fused_attention:  # context lengths [Sg]
            biases = [pos + 1 for _, pos in decode_groups]
        else:
            biases = [tf.where(tf.range(tf.shape(rows)[1])[None, None, :] <= pos[:, None, None],
                               0.0, tf.float32.min) for rows, pos in decode_groups]  # [Sg,1,Lg]
        num_prefill = tf.shape(prefill[3])[0] if prefill else tf.constant(0)
        if prefill and self.fused_attention:
            # Prefill token j of a sequence attends to its sequence's rows up to its own
            # position: a decode query with that context. Each token's context rows and
            # length, built once per step, make every layer's prefill attention one op
            # reading the rows in place, where the gathered path below runs about 50 ops
            # per layer on widened copies: 1.4-3.8x faster per layer for chunks of 32 to 512
            # tokens (benchmarks/prefill_attention.py, GPT-2-small sizes, 2-core EPYC), and
            # the step traces in half the time.
            index, rows, pos, unpack = prefill
            sequence = unpack // tf.shape(index)[1]                          # [Np]
            prefill = PagedPrefill(rows=tf.gather(rows, sequence),           # [Np, Lp]
                                   lengths=tf.gather(tf.reshape(pos, [-1]), unpack) + 1)
        elif prefill:
            index, rows, pos, unpack = prefill
            mask = tf.range(tf.shape(rows)[1])[None, None, :] <= pos[:, :, None]  # [S, T, L]
            prefill = (index, rows, mask, unpack)
        else:
            prefill = None
        # the fused ops' activations are float32 whatever the weights' dtype
        dtype = tf.float32 if fused else m.compute_dtype
        layout = self._attention_layout(decode_groups, num_prefill, num_tokens, dtype)
        x = m.embed(token_ids, positions, dtype)                           # [N, D]
        weights = self.fused_weights if fused else self.layer_weights
        rotary = self.rotary(positions, dtype)
        if fused and rotary is not None:  # split_rope takes [N, Dh] rows
            rotary = tuple(tf.reshape(t, [-1, m.config.head_dim]) for t in rotary)
        q, k, v = enter(x, rotary, weights[0])
        # the layer's first fused attention op stores its new rows (a decode group's, else
        # the paged prefill's), where a scatter per cache would add eight small ops a layer
        fused_write = self.fused_attention and bool(decode_groups
                                                    or isinstance(prefill, PagedPrefill))
        for i, cache in enumerate(self.caches):
            if fused_write:
                write = (k, v, write_rows)
            else:
                write = None
                paged_attention.scatter_rows(*cache, k, v, write_rows)
            attn = self._layer_attention(q, decode_groups, biases, prefill, cache, layout,
                                         write)
            if i + 1 < len(self.caches):
                x, q, k, v = between(x, attn, rotary, weights[i], weights[i + 1])
        x = tf.gather(exit_(x, attn, weights[-1]), last_tokens)            # [S, D]
        return x if head is None else head(x)                              # [S, vocab] f32

    def dense_programs(self):
        """A graph that calls each XLA dense function once, on one layer's weights:
        (token_ids [N], positions [N], head_rows [R]) -> a scalar. Running it at a shape
        compiles the XLA programs a step of that shape runs, for about two layers' compute
        instead of every layer's: a call from any graph finds the programs another graph's
        call compiled, as long as both call the same traced function (an eager call does
        not, measured). So a step is traced first and this graph calls the dense functions
        with the step's argument types: they reuse the step's traces (tests check that each
        is traced once). That step is the prefill step through XLA, which a server's first
        long prompt runs anyway (an empty step, traced only for this, cost 0.45 s of a start
        on a 2-core VM). With `fused_head`, head_rows are ignored: no head program."""
        if self._dense_programs is None:
            self.step_function(0, True)
            weights, c = self.layer_weights, self.model.config

            @tf.function(input_signature=[_spec([None]), _spec([None]), _spec([None])],
                         autograph=False)
            def run(token_ids, positions, head_rows):
                x = self.model.embed(token_ids, positions)                     # [N, D]
                rotary = self.rotary(positions)
                q, _, _ = self._enter(x, rotary, weights[0])
                attn = tf.reshape(q, [-1, c.num_heads * c.head_dim])           # [N, H*Dh]
                outputs = [self._exit(x, attn, weights[-1])]
                if len(weights) > 1:
                    outputs.append(self._between(x, attn, rotary, weights[0], weights[1])[0])
                if not self.fused_head:
                    outputs.append(self._head(tf.gather(outputs[0], head_rows)))
                return tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32)) for t in outputs])
            self._dense_programs = run.get_concrete_function()
        return self._dense_programs

    # -- KV rows in and out (prefix caching's remote tier): sparse, as the step ------------
    @tf.function(input_signature=[_spec([None])], autograph=False)
    def read_rows(self, rows):
        """rows: [R] -> [R, layers, 2, Hkv*Dh]: a gather, never a dense read of the cache."""
        return tf.stack([tf.stack([tf.gather(variable, rows) for variable in cache], 1)
                         for cache in self.caches], 1)

    def write_rows(self, rows, values):
        """rows: [R]; values: [R, layers, 2, Hkv*Dh] in the cache dtype: the stored bits are
        scattered as they are (no float32 round trip), sparse, as the step writes."""
        if self._write_rows is None:  # traced once, for the cache dtype of this step
            @tf.function(input_signature=[_spec([None]), _spec([None, None, 2, None],
                                                               self.kv_dtype)],
                         autograph=False)
            def write(rows, values):
                for i, cache in enumerate(self.caches):
                    for j, variable in enumerate(cache):
                        variable.scatter_update(tf.IndexedSlices(values[:, i, j], rows))
            self._write_rows = write
        return self._write_rows(rows, values)


def _float32_vector(t):
    """A norm's or bias's vector in float32 (what the fused ops take); matrices as they are."""
    return tf.cast(t, tf.float32) if t.shape.rank == 1 else t


def block_weights(block) -> dict:
    """A Block's variables by role: what the dense functions take as explicit weights."""
    return {"attn_norm": block.attn_norm.weights_dict(), "qkv": block.attn.qkv.weights_dict(),
            "out": block.attn.out.weights_dict(), "mlp_norm": block.mlp_norm.weights_dict(),
            "up": block.mlp.up.weights_dict(), "down": block.mlp.down.weights_dict()}


class LSTMStep(tf.Module):
    """Slot step for an LSTMLM: each sequence's (h, c) lives in one row of a state pool."""

    def __init__(self, model: LSTMLM, num_slots: int):
        super().__init__(name="lstm_step")
        self.model = model
        c = model.config
        self.states = tf.Variable(tf.zeros([num_slots, c.num_layers, 2, c.hidden_size],
                                           tf.float32), trainable=False, name="lstm_states")
        self.step = tf.function(self._step, input_signature=[
            _spec([None, None]),    # token_ids  [S, T] right-padded
            _spec([None]),          # num_tokens [S]
            _spec([None]),          # slots      [S]
            _spec([None], tf.bool),  # fresh     [S] start from a zero state
        ])

    def _step(self, token_ids, num_tokens, slots, fresh):
        state = tf.gather(self.states, slots)                              # [S, layers, 2, H]
        state = tf.where(fresh[:, None, None, None], tf.zeros_like(state), state)
        state = tf.transpose(state, [1, 2, 0, 3])                          # [layers, 2, S, H]
        logits, state = self.model.step(token_ids, state, tf.zeros_like(num_tokens), num_tokens)
        self.states.scatter_update(tf.IndexedSlices(tf.transpose(state, [2, 0, 1, 3]), slots))
        return logits
