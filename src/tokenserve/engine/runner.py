"""The model runner: owns the model, its cache tensors and the compiled step.

It turns a SchedulerOutput (plain Python) into the step's index arrays, runs the step and
returns logits. This, tf_step.py and screened_head.py are the engine's only TensorFlow code.
"""

from __future__ import annotations

import itertools
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from tokenserve.config import GenerationConfig, TransformerConfig
from tokenserve.host.cpu_quota import applied_quota, schedulable_cpus, usable_cpus
from tokenserve.engine.cache_accounting import BlockAllocator, SlotAllocator
from tokenserve.engine.config import EngineConfig
from tokenserve.engine.kv_budget import plan_kv_cache
from tokenserve.engine.prefix_cache import PrefixCachingAllocator
from tokenserve.engine.scheduler import SchedulerOutput

log = logging.getLogger(__name__)

def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _token_buckets():
    """1, 2, 4, ... 64, then steps of 64: padding stays under 2x for small steps and under
    64 tokens for large ones, with a few dozen shapes in all."""
    size = 1
    while size < 64:
        yield size
        size *= 2
    while True:
        yield size
        size += 64


def _token_buckets_upto(limit: int) -> list[int]:
    return [b for b in itertools.takewhile(lambda b: b <= limit, _token_buckets())]


def split_by_context(decode: list, max_groups: int, group_cost: int,
                     pad: int = EngineConfig.context_pad) -> list[list]:
    """Splits decode rows into at most `max_groups` groups of similar context length.

    Each group is padded to its longest context, so one group would pad every sequence to the
    longest in the batch (prompts of 16..512 tokens read about 2x the rows they need). The
    split minimizes the rows read plus `group_cost` rows per group (each group adds a gather
    and two matmuls per layer), by dynamic programming over the sorted, padded lengths."""
    if len(decode) < 2 or max_groups < 2:
        return [decode]
    ordered = sorted(decode, key=lambda g: len(g[1]))
    lengths = [_round_up(len(g[1]), pad) for g in ordered]
    # a group only ever ends where the padded length changes
    ends = [i + 1 for i in range(len(lengths))
            if i + 1 == len(lengths) or lengths[i + 1] != lengths[i]]
    # cost[e], cuts[e]: the cheapest split of the first ends[e] rows found so far
    cost = [end * lengths[end - 1] + group_cost for end in ends]
    cuts = [[end] for end in ends]
    for _ in range(1, max_groups):
        new_cost, new_cuts = list(cost), list(cuts)
        for e, end in enumerate(ends):
            for p in range(e):
                candidate = cost[p] + (end - ends[p]) * lengths[end - 1] + group_cost
                if candidate < new_cost[e]:
                    new_cost[e], new_cuts[e] = candidate, cuts[p] + [end]
        cost, cuts = new_cost, new_cuts
    bounds = [0] + cuts[-1]
    return [ordered[start:end] for start, end in zip(bounds, bounds[1:])]


class ModelRunner:
    """Runs scheduled tokens through a DecoderLM over a paged KV cache or LSTM state slots."""

    def __init__(self, model, config: GenerationConfig, engine_config: EngineConfig):
        from tokenserve.engine.screened_head import ScreenedHead
        from tokenserve.engine.tf_step import LSTMStep, TransformerStep

        self.model, self.config, self.engine_config = model, config, engine_config
        self.is_transformer = isinstance(config.model, TransformerConfig)
        self.vocab_size = config.model.vocab_size
        if self.is_transformer:
            c = config.model
            # the LM head's screen copy is made after the pool is sized: a fraction counts it
            screen = self._screen_weights(engine_config)
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
            # XLA's float32 dense code beats oneDNN's at every batch size here, but oneDNN's
            # bf16 matmuls beat XLA's, and the int8 kernel is a TF op that XLA cannot compile
            self.step = TransformerStep(
                model, num_blocks * block_size,
                jit_dense=model.compute_dtype == "float32"
                and config.model.weight_format == "float", kv_dtype=self.kv_plan.dtype)
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
            self.step.screened_head = self._screened_head(engine_config, screen)
            self.num_screened_steps = 0  # steps whose LM head ran the screen
            self.num_sampled_screened_steps = 0  # of those, steps with sampled rows
            if config.model.weight_format == "int8":
                from tokenserve.kernels.int8_matmul import kernel_status

                log.info("int8 weights: %s", kernel_status())
        else:
            self.cache = SlotAllocator(engine_config.max_num_seqs)
            self.step = LSTMStep(model, engine_config.max_num_seqs + 1)

    def _screen_weights(self, engine_config: EngineConfig):
        """(weight, layout, bias) of a float32 or bfloat16 LM head that greedy steps screen,
        or None (int8 weights, max_screened_head_rows 0, or no compiled screen matmul op).
        Read before the KV pool is sized, so a memory fraction counts the screen's copy."""
        model = self.model
        if (not engine_config.max_screened_head_rows
                or model.compute_dtype not in ("float32", "bfloat16")
                or self.config.model.weight_format != "float"):
            return None
        from tokenserve.kernels import dense as kdense
        from tokenserve.kernels import half_matmul

        if not half_matmul.is_compiled():  # its fallback writes a float32 copy: no gain
            log.info("LM head: no screen (%s)", half_matmul.kernel_status())
            return None
        if model.compute_dtype == "bfloat16":
            # greedy steps through the fused ops screen the head those ops would run: the
            # bfloat16 weights widened, float32 arithmetic (without the ops, none does)
            if engine_config.head_screen != "int8" or not kdense.is_compiled():
                log.info("LM head: no screen (%s)", "a float16 copy is as large as the "
                         "bfloat16 head" if kdense.is_compiled() else kdense.kernel_status())
                return None
        if model.head is None:  # tied: the token embedding [vocab, D]
            return model.token_embedding, "nk", None
        weights = model.head.weights_dict()
        return weights["kernel"], "kn", weights.get("bias")

    def _screened_head(self, engine_config: EngineConfig, screen):
        """The screen of the head `_screen_weights` chose, or None."""
        from tokenserve.engine.screened_head import ScreenedHead

        if screen is None:
            return None
        head = ScreenedHead(*screen, dtype=engine_config.head_screen)
        log.info("LM head: greedy steps of up to %d rows screen it in %s (%.1f MB more), "
                 "then compute in float32 only the entries that could be a row's argmax",
                 engine_config.max_screened_head_rows, engine_config.head_screen,
                 head.nbytes / 1e6)
        return head

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
        block_size = self.cache.block_size
        offsets = np.arange(block_size)
        decode, prefill = [], []  # (scheduled index, context rows, start position, count)
        # the copies taken when the step was scheduled, never the live sequences: an abort
        # may free their blocks while this runs (ScheduledSeq)
        for index, scheduled in enumerate(out.scheduled):
            start, count = scheduled.start, scheduled.num_new_tokens
            rows = (np.asarray(scheduled.block_ids)[:, None] * block_size + offsets).ravel()
            (decode if count == 1 else prefill).append((index, rows[:start + count], start, count))
        knobs = self.engine_config
        # The fused attention op reads each sequence's own context length, never the
        # padding of its row table: all decode rows are one group (one op per layer, one step
        # graph per kind). The graph path pads every row to its group's longest context.
        max_groups = 1 if self.step.fused_attention else knobs.max_decode_groups
        groups = split_by_context(decode, max_groups, knobs.decode_group_cost_rows,
                                  knobs.context_pad) if decode else []

        # packed order: decode tokens group by group, then prefill tokens, then bucket padding
        token_ids, positions, write_rows = [], [], []
        # logits rows, in scheduled order: each sequence's last token, or all of them where
        # it checks drafts
        num_logits = [scheduled.num_logits for scheduled in out.scheduled]
        first_row = np.cumsum([0] + num_logits[:-1])
        last = np.zeros([sum(num_logits)], np.int32)
        for item in [g for group in groups for g in group] + prefill:
            index, rows, start, count = item
            token_ids.extend(out.scheduled[index].token_ids)
            positions.extend(range(start, start + count))
            write_rows.extend(rows[start:start + count])
            wanted = num_logits[index]
            last[first_row[index]:first_row[index] + wanted] = np.arange(
                len(token_ids) - wanted, len(token_ids))
        num_tokens = len(token_ids)
        # a step of a few tokens runs the dense half as fused ops, which take any number of
        # rows: only XLA's programs need the tokens padded to a bucket
        fused = self.step.kernel_dense and (self.step.fused_every_step
                                            or num_tokens <= self.max_fused_dense_tokens)
        xla = self.step.jit_dense and not fused
        num_padded = self._bucket(num_tokens, only_decode=not prefill, xla=xla)
        padding = [0] * (num_padded - num_tokens)  # token 0 at position 0, written to row 0

        def context(group):
            length = _round_up(max((len(g[1]) for g in group), default=1), knobs.context_pad)
            rows = np.zeros([len(group), length], np.int32)
            for i, (_, ctx, _, _) in enumerate(group):
                rows[i, :len(ctx)] = ctx
            return rows

        decode_groups = [(context(g), np.asarray([s for _, _, s, _ in g], np.int32))
                         for g in groups]
        prefill_inputs = ()
        if prefill:
            chunk = max(g[3] for g in prefill)
            num_prefill = sum(g[3] for g in prefill)
            index = np.full([len(prefill), chunk], num_prefill, np.int32)
            pos = np.full([len(prefill), chunk], -1, np.int32)
            unpack, first = [], 0
            for i, (_, _, start, count) in enumerate(prefill):
                index[i, :count] = np.arange(first, first + count)
                pos[i, :count] = np.arange(start, start + count)
                unpack.extend(range(i * chunk, i * chunk + count))
                first += count
            prefill_inputs = (index, context(prefill), pos, np.asarray(unpack, np.int32))
        # the XLA LM head runs on one row per sequence: padded too, so XLA sees few shapes
        num_wanted = len(last)
        num_rows = self._bucket(num_wanted, only_decode=False,
                                xla=xla and not self.step.fused_head)
        last = np.concatenate([last, np.zeros([num_rows - num_wanted], np.int32)])
        # greedy rows need only each row's argmax, and plainly sampled ones the argmax of
        # logits + their noise (engine/sampler.py): the head's screen gives either exactly
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
        step = self.step.step_function(len(decode_groups), bool(prefill), fused)
        out = step(np.asarray(token_ids + padding, np.int32),
                   np.asarray(positions + padding, np.int32),
                   np.asarray(write_rows + padding, np.int32), decode_groups,
                   prefill_inputs, last)
        return self.step.logits(out, fused, screened, noise).numpy()[:num_wanted]

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

    def prompt_logits(self, token_ids: list[int]) -> np.ndarray:
        """float32 [len(token_ids), vocab]: the logits after each prompt token, from one full
        forward pass outside the paged cache (prompt logprobs, which a step does not keep:
        it computes the LM head on each sequence's last row only)."""
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
        max_tokens = max(knobs.max_num_batched_tokens, knobs.max_num_seqs)
        max_rows = self._bucket(knobs.max_logit_rows, only_decode=False, xla=True)
        sizes = []
        for size in _token_buckets():
            if size > self.max_fused_dense_tokens:
                sizes.append(size)
            if size >= max_tokens:
                break
        if not sizes:
            return []
        if self.step.fused_head:
            return [(size, 0) for size in sizes]
        shapes = [(size, min(size, max_rows)) for size in sizes]
        heads = {rows for _, rows in shapes}
        # the other head sizes ride along with the smallest token bucket's (compiled first)
        shapes += [(sizes[0], rows) for rows in _token_buckets_upto(max_rows)
                   if rows not in heads]
        return shapes

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

    def _bucket(self, num_tokens: int, only_decode: bool, xla: bool) -> int:
        """How many tokens (or head rows) the step computes for `num_tokens` real ones.

        TF Serving's allowed_batch_sizes pad decode batches; XLA compiles one program per
        shape, so a step through XLA is padded to a few bucket sizes."""
        sizes = self.engine_config.batch_sizes
        if only_decode and sizes:
            return next((s for s in sizes if s >= num_tokens), num_tokens)
        if xla:
            return next(b for b in _token_buckets() if b >= num_tokens)
        return num_tokens

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
        """Bytes the runner allocated: {"weights": the model's variables, "kv_cache": the
        KV pool (an LSTM: its state slots)}, and "head_screen": the LM head's screen copy
        where greedy steps screen it. Exact sizes, not resident-memory estimates."""
        import tensorflow as tf

        def size(variable) -> int:
            return int(np.prod(variable.shape)) * tf.as_dtype(variable.dtype).size

        caches = ([v for pair in self.step.caches for v in pair] if self.is_transformer
                  else [self.step.states])
        parts = {"weights": sum(size(w) for w in self.model.weights),
                 "kv_cache": sum(size(v) for v in caches)}
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

