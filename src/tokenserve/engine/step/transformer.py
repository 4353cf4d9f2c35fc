"""The transformer's compiled step over a block-pooled KV cache (design notes:
docs/engine.md).

The KV cache is two resource variables per layer (keys, values), each [rows, Hkv * Dh] with
rows = num_blocks * block_size, stored in the compute dtype or in 16 bits under float32
compute (`kv_dtype`: new rows are rounded as they are scattered, read rows widened after the
gather or inside the fused op). A step scatters only the new tokens' keys/values into it and
gathers only the rows of the live context (ResourceScatterUpdate / ResourceGather). Nothing
ever reads a cache variable densely: after a sparse update TF keeps a variable in
copy-on-read mode, and one dense read would copy the whole cache (0.2-2.8 s per step for a
2.4 GB cache). The cache never enters XLA either: an XLA cluster copies the resource
variables it touches in and out. So per-step memory traffic is the weights plus the live
context, independent of cache capacity (benchmarks/kv_capacity.py).

A step is the dense half of every block (graph_blocks.py through XLA, or fused_blocks.py's
fused ops for steps of a few tokens) around each layer's attention (attention.py), then the
LM head on each sequence's last row: inside the step, or, where the head has a screen
(head.py), a function of its own after it. Tokens of all sequences are packed into one [N]
axis (packing.py). One graph is traced per (number of decode groups, prefill or not, fused
dense ops or not), so a batch-1 decode step runs one group's attention and no prefill ops.
"""

from __future__ import annotations

import tensorflow as tf

from tokenserve.engine.step.attention import PagedAttention, PagedPrefill
from tokenserve.engine.step.flat_call import FlatCall, spec
from tokenserve.engine.step.fused_blocks import FusedBlocks, fused_dense_supports
from tokenserve.engine.step.graph_blocks import GraphBlocks
from tokenserve.engine.step.kv_pool import make_kv_pool
from tokenserve.engine.step.moe import ExpertLoad
from tokenserve.kernels import dense as kdense
from tokenserve.kernels import paged_attention
from tokenserve.engine.step.sequence_ends import sequence_ends
from tokenserve.model.rotary import layer_rope_angles
from tokenserve.model.precision import cpu_has_bf16
from tokenserve.model.transformer import TransformerLM


def block_weights(block) -> dict:
    """A Block's variables by role: what the dense functions take as explicit weights."""
    found = {"attn_norm": block.attn_norm.weights_dict(), "qkv": block.attn.qkv.weights_dict(),
             "out": block.attn.out.weights_dict(), "mlp_norm": block.mlp_norm.weights_dict(),
             **block.mlp_weights()}
    for name, layer in (("q_norm", block.attn.q_norm), ("k_norm", block.attn.k_norm),
                        ("post_attn_norm", block.post_attn_norm),
                        ("post_mlp_norm", block.post_mlp_norm)):
        if layer is not None:  # the families' extra norms (QK-norm, Gemma's post-norms)
            found[name] = layer.weights_dict()
    return found


class TransformerStep(tf.Module):
    """Paged-attention step for a TransformerLM over a block-pooled KV cache.

    Packed token order (the runner's job): decode tokens group by group, then prefill
    tokens, then padding up to the step's bucket size. One graph is traced per (number of
    decode groups, with or without prefill), so a decode-only step at batch 1 runs only what
    it needs: one group's attention and no prefill ops.
    """

    def __init__(self, model: TransformerLM, num_rows: int, jit_dense: bool = False,
                 kv_dtype: str | None = None, kv_lazy_pages: bool = True):
        super().__init__(name="transformer_step")
        self.model = model
        c = model.config
        self.kv_width = c.num_kv_heads * c.head_dim
        self.kv_dtype = tf.as_dtype(kv_dtype or model.compute_dtype)
        self.caches = make_kv_pool(c.num_layers, num_rows, self.kv_width, self.kv_dtype,
                                   lazy_pages=kv_lazy_pages)
        # the fused op reads K/V rows in place (no gathered copies, one op per layer; Gemma
        # 2's soft-capped scores too); the graph path does the same math where the op could
        # not be built
        self.fused_attention = paged_attention.is_compiled()
        self.windows = sorted({c.layer_window(i) for i in range(c.num_layers)})
        self.attention = PagedAttention(c, self.kv_width, model.compute_dtype,
                                        self.fused_attention)
        # The blocks' weights as tensors read once here, not as variables: a traced step
        # then takes them as captured inputs instead of running a ReadVariableOp per weight
        # per step (about 200 of a GPT-2-small step's nodes). An eager read aliases the
        # variable's buffer (no copy), and nothing assigns to serving weights afterwards.
        self.layer_weights = [tf.nest.map_structure(tf.convert_to_tensor, block_weights(block))
                              for block in model.blocks]
        self.jit_dense = jit_dense
        self.graph_blocks = GraphBlocks(model, self.layer_weights, self.kv_width, jit_dense)
        # the graph blocks' functions, whose traces tests count
        self._enter, self._between, self._exit, self._head = (
            self.graph_blocks.enter, self.graph_blocks.between, self.graph_blocks.exit,
            self.graph_blocks.head)
        # The fused ops run steps of a few tokens for float32 weights, every step for int8
        # weights, and steps of a few tokens for bfloat16 weights too, whose activations
        # there are float32 (the KV cache stays bfloat16, which the attention op reads
        # under a float32 query): so a fused bfloat16 step needs that op too.
        # int8 and GGUF blocks (int8 where a type has no kernel) alike: ops XLA cannot take
        int8 = model.config.weight_format in ("int8", "gguf")
        bf16 = (model.compute_dtype == "bfloat16" and model.config.weight_format == "float"
                and self.fused_attention)
        # a mixture of experts never runs under XLA (its row groups have data-dependent
        # shapes): every step through the fused ops, whose grouped-experts op reads only
        # the experts with rows (engine/step/moe.py)
        moe = c.num_experts > 0
        self.kernel_dense = kdense.is_compiled() and fused_dense_supports(c) and (
            model.compute_dtype == "float32" and (jit_dense or int8 or moe) or bf16)
        # bfloat16 on a CPU whose oneDNN has no bf16 matmul (no AVX512-BF16 or AMX, or capped
        # below them): every step through the fused ops, as int8, since the graph's bf16
        # matmuls would be emulated there, or refused by oneDNN (a process abort)
        self.fused_every_step = self.kernel_dense and (int8 or moe
                                                       or bf16 and not cpu_has_bf16())
        self.fused_blocks = (FusedBlocks(model, self.layer_weights) if self.kernel_dense
                             else None)
        self.expert_load = ExpertLoad(c.num_layers, c.num_experts) if moe else None
        if moe:  # each layer's routing counts its rows per expert into the step's counters
            self.expert_load.attach(self.layer_weights)
            if self.fused_blocks is not None:
                self.expert_load.attach(self.fused_blocks.weights)
        # Whether steps through XLA's dense programs run the LM head as the fused op: set
        # by the runner, before any step is traced, where the head never gets more rows
        # (one per sequence) than the fused ops take as fast as XLA. Then no head program
        # is compiled, per token bucket or per row bucket.
        self.fused_head = False
        # The LM head through an int8 or float16 screen (head.py) for steps whose rows need
        # only an argmax (greedy, or plainly sampled with their noise): set by the runner
        # before any step is traced, float32 or (after fused steps) bfloat16 weights.
        self.screened_head = None
        # The resident LoRA adapters (lora.py's LoraTable), set by the runner before any
        # step is traced where the engine serves adapters; None: no adapter steps.
        self.lora_table = None
        self._write_rows = None  # write_rows' traced scatter, made on first use
        self._dense_programs = None  # dense_programs' graph, made on first use
        self._steps: dict[tuple, tf.types.experimental.PolymorphicFunction] = {}
        self._concrete: dict[tuple, FlatCall] = {}
        self._heads: dict[str, FlatCall] = {}  # head_function's, by kind

    def rotary(self, positions, dtype=None, layer: int = 0, ends=None):
        """The step's rotary cos and sin for `layer` ([1, N, 1, Dh] each, in `dtype`, default
        the compute dtype), or None for a model without RoPE; ends: [N] each token's
        sequence's furthest position in the step (LongRoPE's choice; sequence_ends.py)."""
        c = self.model.config
        if c.position != "rope":
            return None
        return layer_rope_angles(c, layer, positions[None], dtype or self.model.compute_dtype,
                                 None if ends is None else ends[None])

    def layer_rotaries(self, positions, dtype, decode_groups=(), prefill=()) -> list:
        """rotary() of every layer, computed once per distinct RoPE (Gemma 3's local and
        global layers turn at different bases)."""
        c = self.model.config
        ends = (sequence_ends(positions, decode_groups, prefill) if c.rope_long_freq_factors
                else None)
        by_rope = {}
        for i in range(c.num_layers):
            if c.layer_rope(i) not in by_rope:
                by_rope[c.layer_rope(i)] = self.rotary(positions, dtype, i, ends)
        return [by_rope[c.layer_rope(i)] for i in range(c.num_layers)]

    # -- the step -------------------------------------------------------------------------
    def step_function(self, num_groups: int, with_prefill: bool, fused_dense: bool = False,
                      lora: bool = False, lora_moe: int = 0):
        """The traced step for `num_groups` decode groups, with or without prefill rows;
        `fused_dense`: the dense half through kernels/dense.py (only when kernel_dense);
        `lora`: rows with adapters (lora_table), two more inputs (lora.py); `lora_moe`: the
        most a row's adapter changes of a mixture of experts (lora_moe.py's MOE_* kinds)."""
        fused_dense = fused_dense and self.kernel_dense
        lora = lora and self.lora_table is not None
        lora_moe = lora_moe if lora and self.lora_table.moe is not None else 0
        # (adapter steps' keys gain a fourth element, and a fifth for MoE factors: base
        # steps keep their keys)
        key = (num_groups, with_prefill, fused_dense) + (
            ("lora",) + ((), ("moe-around",), ("experts",))[lora_moe] if lora else ())
        if key not in self._steps:
            signature = [
                spec([None]),          # token_ids  [N]  packed, padded to a bucket
                spec([None]),          # positions  [N]
                spec([None]),          # write_rows [N]  cache row of each token (padding: 0)
                [(spec([None, None]),  # rows [Sg, Lg] context rows (padding: row 0)
                  spec([None]))        # pos  [Sg]     query position
                 ] * num_groups,
                (spec([None, None]),   # prefill index [Sp, Tp] into the prefill rows
                                       #   (padding: Np, a zero row)
                 spec([None, None]),   # prefill rows  [Sp, Lp]
                 spec([None, None]),   # prefill pos   [Sp, Tp] (padding: -1)
                 spec([None])) if with_prefill else (),  # unpack [Np] into [Sp * Tp]
                spec([None]),          # last_tokens [S] packed index whose logits we need
                (spec([None]),         # active     [K] the LoRA slots of the step's rows
                 spec([None])) if lora else (),  # token_slot [N] index into active (-1: none)
            ]
            blocks = self.fused_blocks if fused_dense else self.graph_blocks
            # without a screen there is one head per step kind: inside the step, no second
            # call (head_function)
            head = None if self.screened_head is not None else self._head_fn(fused_dense)

            def step(token_ids, positions, write_rows, decode_groups, prefill, last_tokens,
                     lora_inputs=()):
                return self._step(blocks, head, fused_dense, token_ids, positions, write_rows,
                                  decode_groups, prefill, last_tokens, lora_inputs,
                                  lora_moe)
            # No AutoGraph: the step's loops and branches are over Python values (layers, the
            # config), and converting them cost 2.4 s of the first trace on a 2-core VM
            # (0.5 s without), and about a fifth of every later one.
            self._steps[key] = tf.function(step, input_signature=signature, autograph=False)
            # Steps call the concrete function: the tf.function's own call (matching the
            # arguments against its signature on every call) measured 0.3-0.75 ms more per
            # call on a 2-core VM, for the same graph.
            self._concrete[key] = FlatCall(self._steps[key].get_concrete_function())
        return self._concrete[key]

    def _step(self, blocks, head, fused, token_ids, positions, write_rows, decode_groups,
              prefill, last_tokens, lora_inputs=(), lora_moe=0):
        m = self.model
        num_tokens = tf.shape(token_ids)[0]
        # masks (and windowed row tables) are shared by all layers of a window: built once
        inputs = {window: self.attention.step_inputs(decode_groups, prefill, window)
                  for window in self.windows}
        num_prefill = inputs[self.windows[0]][2]
        # the fused ops' activations are float32 whatever the weights' dtype
        dtype = tf.float32 if fused else m.compute_dtype
        layout = self.attention.layout(decode_groups, num_prefill, num_tokens, dtype)
        x = m.embed(token_ids, positions, dtype)                           # [N, D]
        if lora_inputs:  # each row's adapter delta on every projection
            blocks = self.lora_table.bind(blocks, *lora_inputs, dtype, lora_moe)
        weights = blocks.weights
        rotary = self.layer_rotaries(positions, dtype, decode_groups, prefill)
        if fused and rotary[0] is not None:  # split_rope takes [N, rotary_dim] rows
            rotary = [tuple(tf.reshape(t, [-1, m.config.rotary_dim]) for t in r) for r in rotary]
        q, k, v = blocks.enter(x, rotary[0], weights[0])
        # the layer's first fused attention op stores its new rows (a decode group's, else
        # the paged prefill's), where a scatter per cache would add eight small ops a layer
        fused_write = self.fused_attention and bool(
            decode_groups or isinstance(inputs[self.windows[0]][3], PagedPrefill))
        for i, cache in enumerate(self.caches):
            if fused_write:
                write = (k, v, write_rows)
            else:
                write = None
                paged_attention.scatter_rows(*cache, k, v, write_rows)
            groups, biases, _, layer_prefill = inputs[m.config.layer_window(i)]
            attn = self.attention.layer(q, groups, biases, layer_prefill, cache, layout, write)
            if i + 1 < len(self.caches):
                x, q, k, v = blocks.between(x, attn, rotary[i + 1], weights[i], weights[i + 1])
        x = tf.gather(blocks.exit(x, attn, weights[-1]), last_tokens)      # [S, D]
        return x if head is None else head(x)                              # [S, vocab] f32

    # -- the LM head ----------------------------------------------------------------------
    def _head_fn(self, fused_dense: bool):
        """The unscreened LM head after a step with or without the fused dense ops: the
        fused op there, else XLA's program (or the fused op where `fused_head`)."""
        fused = self.kernel_dense and (fused_dense or self.fused_head)
        return self.fused_blocks.head if fused else self.graph_blocks.head

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
            kind, head = "screened-noisy", self._screened_noisy
        elif screened and self.screened_head is not None:
            kind, head = "screened", self._screened
        else:
            head = self._head_fn(fused_dense)
            kind = "xla" if head == self.graph_blocks.head else "fused"
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

    def _screened(self, x):
        return self._screened_noisy(x, None)

    def _screened_noisy(self, x, noise):
        """x [S, D] float32 -> the screened head's logits (+ noise [S, vocab], or None)."""
        # float32 x (a bfloat16 model's only after fused steps)
        blocks = self.fused_blocks if self.kernel_dense else self.graph_blocks
        return self.screened_head(blocks.final_norm(x), noise)

    # -- XLA's programs, compiled ahead -----------------------------------------------------
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
            blocks, c = self.graph_blocks, self.model.config
            weights = blocks.weights

            @tf.function(input_signature=[spec([None]), spec([None]), spec([None])],
                         autograph=False)
            def run(token_ids, positions, head_rows):
                x = self.model.embed(token_ids, positions)                     # [N, D]
                rotary = self.rotary(positions)
                q, _, _ = blocks.enter(x, rotary, weights[0])
                attn = tf.reshape(q, [-1, c.num_heads * c.head_dim])           # [N, H*Dh]
                outputs = [blocks.exit(x, attn, weights[-1])]
                if len(weights) > 1:
                    outputs.append(blocks.between(x, attn, rotary, weights[0], weights[1])[0])
                if not self.fused_head:
                    outputs.append(blocks.head(tf.gather(outputs[0], head_rows)))
                return tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32)) for t in outputs])
            self._dense_programs = run.get_concrete_function()
        return self._dense_programs

    # -- KV rows in and out (prefix caching's remote tier): sparse, as the step ------------
    @tf.function(input_signature=[spec([None])], autograph=False)
    def read_rows(self, rows):
        """rows: [R] -> [R, layers, 2, Hkv*Dh]: a gather, never a dense read of the cache."""
        return tf.stack([tf.stack([tf.gather(variable, rows) for variable in cache], 1)
                         for cache in self.caches], 1)

    def write_rows(self, rows, values):
        """rows: [R]; values: [R, layers, 2, Hkv*Dh] in the cache dtype: the stored bits are
        scattered as they are (no float32 round trip), sparse, as the step writes."""
        if self._write_rows is None:  # traced once, for the cache dtype of this step
            @tf.function(input_signature=[spec([None]), spec([None, None, 2, None],
                                                             self.kv_dtype)],
                         autograph=False)
            def write(rows, values):
                for i, cache in enumerate(self.caches):
                    for j, variable in enumerate(cache):
                        variable.scatter_update(tf.IndexedSlices(values[:, i, j], rows))
            self._write_rows = write
        return self._write_rows(rows, values)
