"""The model runner: owns the model, its cache tensors and the compiled step.

It turns a SchedulerOutput (plain Python) into the step's index arrays, runs the step and
returns logits. This and the step package (engine/step/) are the engine's only TensorFlow
code.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from tokenserve.config import GenerationConfig, TransformerConfig
from tokenserve.engine.cache_accounting import BlockAllocator, SlotAllocator
from tokenserve.engine.config import EngineConfig
from tokenserve.engine.kv_budget import plan_kv_cache
from tokenserve.engine.prefix_cache import PrefixCachingAllocator
from tokenserve.engine.scheduler_output import SchedulerOutput
from tokenserve.engine.step.packing import bucket_size, pack_tokens, xla_shapes
from tokenserve.host.cpu_quota import applied_quota, schedulable_cpus, usable_cpus

log = logging.getLogger(__name__)


def lora_inputs(slots: list[int], token_seqs: list[int], num_padded: int) -> tuple:
    """The LoRA step inputs for sequences on resident slots `slots` (0: the base model) and
    packed tokens of sequences `token_seqs`: (active [K] distinct slots, token_slot
    [num_padded] each token's index into active, -1 for the base and padding), or () when no
    row has an adapter (the base step)."""
    active = sorted({s for s in slots if s})
    if not active:
        return ()
    where = {slot: i for i, slot in enumerate(active)}
    token_slot = np.full([num_padded], -1, np.int32)
    token_slot[:len(token_seqs)] = [where.get(slots[i], -1) for i in token_seqs]
    return np.asarray(active, np.int32), token_slot


class ModelRunner:
    """Runs scheduled tokens through a DecoderLM over a paged KV cache or LSTM state slots."""

    def __init__(self, model, config: GenerationConfig, engine_config: EngineConfig):
        from tokenserve.engine.step.head import ScreenedHead, build_screen, screen_weights
        from tokenserve.engine.step.lstm import LSTMStep
        from tokenserve.engine.step.transformer import TransformerStep

        self.model, self.config, self.engine_config = model, config, engine_config
        self.is_transformer = isinstance(config.model, TransformerConfig)
        self.vocab_size = config.model.vocab_size
        if self.is_transformer:
            c = config.model
            if c.weight_format == "gguf":
                from tokenserve.model.gguf_packing import pack_for_decode

                pack_for_decode(model)
            # the LM head's screen copy is made after the pool is sized: a fraction counts it
            screen = screen_weights(model, config.model.weight_format, engine_config)
            reserved = (ScreenedHead.bytes_for(screen[0].shape, screen[1],
                                               engine_config.head_screen) if screen else 0)
            self.kv_plan = plan_kv_cache(
                engine_config, num_layers=c.num_layers, kv_width=c.num_kv_heads * c.head_dim,
                compute_dtype=model.compute_dtype, max_seq_len=config.max_seq_len,
                reserved_bytes=reserved)
            log.info("%s", self.kv_plan.describe(config.max_seq_len))
            if (quota := applied_quota()) is not None:
                log.info("threads: a CPU quota of %.2g CPUs (%s) on %d schedulable: TensorFlow's "
                         "pools sized to %d", quota.cpus, quota.cgroup, schedulable_cpus(),
                         quota.threads)
            num_blocks, block_size = self.kv_plan.num_blocks, self.kv_plan.block_size
            if engine_config.enable_prefix_caching:  # its hash namespace is set by the engine
                self.cache = PrefixCachingAllocator(num_blocks, block_size)
            else:
                self.cache = BlockAllocator(num_blocks, block_size)
            windows = [config.model.layer_window(i) for i in range(config.model.num_layers)]
            if all(windows):  # every layer windowed: blocks behind the widest are given back
                self.cache.window = max(windows)
            # XLA's float32 dense code beats oneDNN's at every batch size here, but oneDNN's
            # bf16 matmuls beat XLA's, and the int8 kernel is a TF op that XLA cannot compile
            self.step = TransformerStep(
                model, num_blocks * block_size,
                jit_dense=model.compute_dtype == "float32"
                and config.model.weight_format == "float" and not c.num_experts,
                kv_dtype=self.kv_plan.dtype,
                kv_lazy_pages=engine_config.kv_cache_lazy_pages)
            self.max_fused_dense_tokens = 0
            if self.step.kernel_dense and not self.step.fused_every_step:
                from tokenserve.model.precision import choose_fused_dense_tokens

                self.max_fused_dense_tokens, why = choose_fused_dense_tokens(
                    engine_config.max_fused_dense_tokens, model.compute_dtype)
                # one head row per sequence (or drafted token): with no more rows than the fused
                # ops take, steps through XLA run the head as the fused op too, and need no
                # head programs (bfloat16 steps above them have bfloat16 rows: their own head)
                self.step.fused_head = (self.step.jit_dense and engine_config.max_logit_rows
                                        <= self.max_fused_dense_tokens)
                log.info("dense layers: fused ops for steps of up to %d tokens, %s above (%s)%s",
                         self.max_fused_dense_tokens,
                         "XLA" if self.step.jit_dense else "oneDNN's bf16 matmuls", why,
                         "; the LM head always fused" if self.step.fused_head else "")
            if self.step.fused_every_step and model.compute_dtype == "bfloat16":
                log.info("dense layers: fused ops for every step, on the bfloat16 weights in "
                         "float32 (oneDNN has no bf16 matmul on this CPU)")
            # a screen reads raw logits: none under Gemma 2's soft-capped ones
            self.step.screened_head = (None if config.model.final_softcap
                                       else build_screen(screen, engine_config))
            if engine_config.max_loras:
                from tokenserve.engine.step.lora import LoraTable

                self.step.lora_table = LoraTable(config.model, engine_config.max_loras,
                                                 engine_config.max_lora_rank,
                                                 experts=engine_config.lora_experts)
                table = self.step.lora_table
                log.info("LoRA: %d adapter slots of rank up to %d (%.1f MiB%s)",
                         engine_config.max_loras, engine_config.max_lora_rank,
                         table.num_bytes / 2**20, "" if table.moe is None else
                         f", of which {table.moe.num_bytes / 2**20:.1f} MiB for the experts', "
                         f"shared expert's and router's factors")
            self.num_screened_steps = 0  # steps whose LM head ran the screen
            self.num_sampled_screened_steps = 0  # of those, steps with sampled rows
            if config.model.weight_format == "int8":
                from tokenserve.kernels.int8_matmul import kernel_status

                log.info("int8 weights: %s", kernel_status())
            elif config.model.weight_format == "gguf":
                from tokenserve.kernels.gguf_matmul import kernel_status

                log.info("GGUF blocks as stored: %s", kernel_status())
        else:
            self.cache = SlotAllocator(engine_config.max_num_seqs)
            self.step = LSTMStep(model, engine_config.max_num_seqs + 1)

    @classmethod
    def from_model_dir(cls, version_dir: str | Path, engine_config: EngineConfig):
        """(runner, tokenizer) for an exported tokenserve model version."""
        from tokenserve.export.restore import load_language_model

        model, tokenizer, config, _ = load_language_model(version_dir, engine_config.precision)
        return cls(model, config, engine_config), tokenizer

    @property
    def precision(self) -> str:
        return self.model.compute_dtype

    def execute(self, out: SchedulerOutput) -> np.ndarray:
        """Computes the scheduled tokens; float32 logits, a row per scheduled sequence (its
        last token's) or, for one checking drafts, a row per token: [sum of num_logits,
        vocab] in scheduled order."""
        if self.is_transformer:
            return self._execute_transformer(out)
        return self._execute_lstm(out)

    def _execute_transformer(self, out: SchedulerOutput) -> np.ndarray:
        knobs = self.engine_config
        # The fused attention op reads each sequence's own context length, never the
        # padding of its row table: all decode rows are one group (one op per layer, one step
        # graph per kind). The graph path pads every row to its group's longest context.
        max_groups = 1 if self.step.fused_attention else knobs.max_decode_groups
        packed = pack_tokens(out.scheduled, self.cache.block_size, max_groups,
                             knobs.decode_group_cost_rows, knobs.context_pad)
        token_ids, positions, write_rows, decode_groups, prefill_inputs, last, seqs = packed
        num_tokens = len(token_ids)
        # a step of a few tokens runs the dense half as fused ops, which take any number of
        # rows: only XLA's programs need the tokens padded to a bucket
        fused = self.step.kernel_dense and (self.step.fused_every_step
                                            or num_tokens <= self.max_fused_dense_tokens)
        xla = self.step.jit_dense and not fused
        num_padded = bucket_size(num_tokens, knobs.batch_sizes, not prefill_inputs, xla)
        padding = [0] * (num_padded - num_tokens)  # token 0 at position 0, written to row 0
        # the XLA LM head runs on one row per sequence: padded too, so XLA sees few shapes
        num_wanted = len(last)
        num_rows = bucket_size(num_wanted, knobs.batch_sizes, False,
                               xla and not self.step.fused_head)
        last = np.concatenate([last, np.zeros([num_rows - num_wanted], np.int32)])
        # greedy rows need only each row's argmax, and plainly sampled ones the argmax of
        # logits + their noise (engine/sampler/draw.py): the head's screen gives either exactly
        # (a bfloat16 model's after fused steps, whose head computes in float32 as the
        # screen does: its graph steps' head computes in bfloat16)
        screened = (self.step.screened_head is not None
                    and num_wanted <= knobs.max_screened_head_rows
                    and self.step.float32_rows(fused)
                    and all(s.seq.request.params.needs_only_argmax
                            or (s.seq.request.params.needs_only_noisy_argmax
                                and not s.draft_ids)
                            for s in out.scheduled))
        self.num_screened_steps += screened
        noise = self._noise(out, num_rows) if screened else None
        self.num_sampled_screened_steps += noise is not None
        lora = lora_inputs([s.seq.request.lora_slot for s in out.scheduled], seqs, num_padded)
        moe = self.step.lora_table.moe if lora else None
        step = self.step.step_function(len(decode_groups), bool(prefill_inputs), fused,
                                       bool(lora), moe.kind_of(lora[0]) if moe else 0)
        out = step(np.asarray(token_ids + padding, np.int32),
                   np.asarray(positions + padding, np.int32),
                   np.asarray(write_rows + padding, np.int32), decode_groups,
                   prefill_inputs, last, lora)
        return self.step.logits(out, fused, screened, noise).numpy()[:num_wanted]

    def prepare_lora_slot(self, layers: list[dict] | None) -> list:
        """An adapter's factors (LoraWeights.layers; None: zeros) as a slot's values, made
        on any thread ahead of write_lora_slot."""
        return self._lora_table().prepare(layers)

    def write_lora_slot(self, slot: int, values: list) -> None:
        """Puts prepared values (prepare_lora_slot's) in resident slot `slot` (1..
        max_loras). Called between steps, on the engine's thread."""
        self._lora_table().write_slot(slot, values)

    def _lora_table(self):
        if not self.is_transformer or self.step.lora_table is None:
            raise ValueError("this runner holds no LoRA slots (max_loras is 0)")
        return self.step.lora_table

    def _noise(self, out: SchedulerOutput, num_rows: int) -> np.ndarray | None:
        """[num_rows, vocab] float32: the noise of each sampled row the engine draws from
        after this step (SequenceSampler.noise_for_step), zeros elsewhere; None when no
        row samples. Takes the noise from the samplers: called once the step is sure to
        screen its head with it."""
        rows, row = [], 0
        for item in out.scheduled:
            row += item.num_logits
            if item.samples and item.seq.request.params.samples_by_noise:
                rows.append((row - 1, item.seq.state.sampler))
        if not rows:
            return None
        noise = np.zeros([num_rows, self.vocab_size], np.float32)
        for row, sampler in rows:
            noise[row] = sampler.noise_for_step()
        return noise

    def expert_load(self) -> np.ndarray | None:
        """int64 [layers, experts]: rows routed to each expert since the runner started
        (a mixture of experts' steps count them), or None for a model without experts."""
        load = getattr(self.step, "expert_load", None)
        return None if load is None else load.read()

    def prompt_logits(self, token_ids: list[int], lora_layers: list | None = None
                      ) -> np.ndarray:
        """float32 [len(token_ids), vocab]: the logits after each prompt token, from one full
        forward pass outside the paged cache (prompt logprobs, which a step does not keep:
        it computes the LM head on each sequence's last row only). lora_layers: an adapter's
        factors (LoraWeights.layers), added to the projections of that pass."""
        from tokenserve.engine.lora_adapter import block_factors
        from tokenserve.model.layers import lora_factors

        with lora_factors(block_factors(self.model.blocks, lora_layers or [])):
            logits = self.model(np.asarray([token_ids], np.int32))
        return np.asarray(logits, np.float32)[0]

    def warm_up_heads(self) -> None:
        """Traces and runs once every LM head a step can end in (TransformerStep.
        head_function), so the first request whose rows need another head than the
        warmup's (a sampled one after greedy warmup requests) pays no trace."""
        if not self.is_transformer or self.step.screened_head is None:
            return  # every step runs its own head
        import tensorflow as tf

        step = self.step
        for fused in ({True} if step.fused_every_step else {False, step.kernel_dense}):
            # the rows as such a step leaves them (a bfloat16 graph step's in bfloat16, and
            # never screened)
            float32 = step.float32_rows(fused)
            hidden = tf.ones([1, self.config.model.hidden_size],
                             tf.float32 if float32 else self.model.compute_dtype)
            if float32:  # greedy rows, and plainly sampled ones with their noise
                step.head_function(fused, True)(hidden).numpy()
                step.head_function(fused, True, noisy=True)(
                    hidden, tf.zeros([1, self.vocab_size], tf.float32)).numpy()
            step.head_function(fused)(hidden).numpy()

    def xla_programs(self) -> list[tuple[int, int]]:
        """The (tokens, LM-head rows) shapes whose XLA programs the steps can run: every token
        bucket above what the fused dense ops take, and the head's bucket of rows for each
        number of sequences such a step can have (rows 0: no head program, where the head
        is always fused). Steps the fused ops take need none."""
        if not (self.is_transformer and self.step.jit_dense):
            return []
        knobs = self.engine_config
        return xla_shapes(max(knobs.max_num_batched_tokens, knobs.max_num_seqs),
                          knobs.max_logit_rows, self.max_fused_dense_tokens,
                          self.step.fused_head)

    def compile_buckets(self) -> int:
        """Compiles the XLA programs of xla_programs(), so no live step stalls on a compile
        (about 0.3 s each for GPT-2-small), a thread per core. Returns how many shapes ran.

        Each shape runs the dense functions on one layer (TransformerStep.dense_programs),
        not a whole step: running GPT-2-small's 12-layer step at every shape was 2 of 6 s
        of compiling on a first start, and most of a second start's (persistent cache)."""
        shapes = self.xla_programs()
        if not shapes:
            return 0
        programs = self.step.dense_programs()

        def compile_one(shape):
            tokens, rows = shape
            zeros = np.zeros([tokens], np.int32)
            programs(zeros, zeros, np.zeros([rows], np.int32)).numpy()

        compile_one(shapes[0])  # the smallest bucket's programs, before the threads start
        # XLA compiles a program on one core: a first start (empty persistent cache) compiles
        # on all of them, largest first so the longest compiles do not come last
        with ThreadPoolExecutor(max(1, min(usable_cpus(), 8))) as pool:
            list(pool.map(compile_one, sorted(shapes[1:], reverse=True)))
        return len(shapes)

    def _execute_lstm(self, out: SchedulerOutput) -> np.ndarray:
        count = max(s.num_new_tokens for s in out.scheduled)
        token_ids = np.full([len(out.scheduled), count], self.config.pad_token_id, np.int32)
        num_tokens = np.zeros([len(out.scheduled)], np.int32)
        slots = np.zeros([len(out.scheduled)], np.int32)
        fresh = np.zeros([len(out.scheduled)], bool)
        for i, scheduled in enumerate(out.scheduled):
            token_ids[i, :scheduled.num_new_tokens] = scheduled.token_ids
            num_tokens[i], slots[i] = scheduled.num_new_tokens, scheduled.block_ids[0]
            fresh[i] = scheduled.start == 0
        return self.step.step(token_ids, num_tokens, slots, fresh).numpy()

    def memory_bytes(self) -> dict[str, int]:
        """Bytes the runner holds: {"weights": the model's variables, "kv_cache": the KV
        pool's resident part (an LSTM: its state slots)}, and "head_screen": the LM head's
        screen copy where greedy steps screen it. Exact sizes of what was allocated, but for
        a lazily paged pool (engine/step/kv_pool.py): the blocks written so far."""
        import tensorflow as tf

        def size(variable) -> int:
            return int(np.prod(variable.shape)) * tf.as_dtype(variable.dtype).size

        caches = ([v for pair in self.step.caches for v in pair] if self.is_transformer
                  else [self.step.states])
        parts = {"weights": sum(size(w) for w in self.model.weights),
                 "kv_cache": sum(size(v) for v in caches)}
        if self.is_transformer and self.engine_config.kv_cache_lazy_pages:
            written = self.cache.num_blocks_written / self.cache.num_blocks
            parts["kv_cache"] = int(parts["kv_cache"] * written)
        screen = getattr(self.step, "screened_head", None)
        if screen is not None:
            parts["head_screen"] = screen.nbytes
        return parts

    # -- KV blocks in and out (the remote tier) ---------------------------------------------
    @property
    def kv_block_shape(self) -> tuple[int, ...]:
        """One block's rows as read_kv_blocks returns them: [block_size, layers, 2, Hkv*Dh]."""
        return (self.cache.block_size, len(self.step.caches), 2, self.step.kv_width)

    @property
    def kv_dtype(self):
        return self.step.caches[0][0].dtype.as_numpy_dtype

    def _block_rows(self, block_ids: list[int]) -> np.ndarray:
        size = self.cache.block_size
        return (np.asarray(block_ids, np.int32)[:, None] * size + np.arange(size)).ravel()

    def read_kv_blocks(self, block_ids: list[int]) -> np.ndarray:
        """[n, *kv_block_shape]: the K/V rows of every layer of these blocks."""
        rows = self.step.read_rows(self._block_rows(block_ids)).numpy()
        return rows.reshape((len(block_ids),) + self.kv_block_shape)

    def write_kv_blocks(self, block_ids: list[int], rows: np.ndarray) -> None:
        """Writes [n, *kv_block_shape] rows into these blocks, in the cache dtype (rows of
        another dtype are converted first): the stored bits, not a float32 round trip."""
        values = rows.astype(self.kv_dtype, copy=False).reshape((-1,) + self.kv_block_shape[1:])
        self.step.write_rows(self._block_rows(block_ids), values)

