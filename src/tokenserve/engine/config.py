"""Engine configuration: one typed, validated dataclass (server/config.py maps TF Serving's
batching-parameters file onto it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tokenserve.engine.kv_budget import KV_CACHE_DTYPES
from tokenserve.errors import ConfigError

PRECISIONS = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class EngineConfig:
    """How the continuous-batching engine schedules, caches and computes.

    Example:
        >>> EngineConfig(max_num_seqs=32, precision="bfloat16")
    """

    max_num_seqs: int = 32
    """Most sequences in the running batch (TF Serving's max_batch_size maps here)."""
    max_num_batched_tokens: int = 512
    """Token budget of one step: decode tokens first, the rest goes to prefill chunks."""
    block_size: int = 16
    """Positions per KV-cache block; sequences own whole blocks."""
    max_cache_tokens: int | None = None
    """KV-cache capacity in positions over all sequences; None: from kv_cache_memory_bytes or
    kv_cache_memory_fraction when set, else max_num_seqs * the context within a default
    budget (engine/kv_budget.py: 768 MiB, or an eighth of the memory limit if less)."""
    kv_cache_dtype: str = "auto"
    """KV-cache storage: auto (16 bits: float16 under float32 compute, else the compute
    dtype), float32, bfloat16 or float16. A float32 step widens 16-bit rows as it reads them."""
    kv_cache_memory_bytes: int | None = None
    """Size the KV pool to this many bytes (its token capacity is logged at load)."""
    kv_cache_lazy_pages: bool = True
    """Leave the KV pool's pages to the OS until a block is first written (they read as
    zeros), so resident memory grows with the blocks used rather than the pool's size
    (engine/step/kv_pool.py); False: the whole pool is resident from the start."""
    kv_cache_memory_fraction: float | None = None
    """Size the KV pool so the whole process uses this fraction of the memory it may use (the
    cgroup's limit, else RAM), as vLLM's gpu_memory_utilization: the pool gets the rest after
    the weights and runtime already resident."""
    max_queue_requests: int = 1024
    """Waiting requests beyond this are refused at once with QueueFullError (HTTP 429)."""
    max_queue_tokens: int = 1_000_000
    """Waiting prompt tokens beyond this are refused at once with QueueFullError."""
    preempt_for_priority: bool = False
    """Let a waiting request preempt (by recompute) running ones of lower priority."""
    batch_wait_s: float = 0.0
    """When idle, wait this long after the first arrival for others to join the first step
    (TF Serving's batch_timeout_micros)."""
    batch_sizes: tuple[int, ...] = ()
    """Decode batch sizes the runner pads to (TF Serving's allowed_batch_sizes); () pads none."""
    idle_trim_s: float | None = 1.0
    """Once the engine has had nothing to run for this long after a step, hand the heap the
    steps freed back to the OS (glibc's malloc_trim: 150-500 MiB after a burst on GPT-2-small,
    docs/memory.md); the next step pays the page faults. None: never."""
    precision: str = "auto"
    """Compute dtype: float32, bfloat16 (oneDNN/AMX), or auto (bfloat16 when the CPU has AMX
    or AVX512-BF16, as measured in benchmarks/throughput.py; else float32)."""
    max_fused_dense_tokens: int | None = None
    """Steps of at most this many tokens run the dense half as fused ops (kernels/dense.py)
    instead of XLA programs (float32 weights) or oneDNN's bf16 matmuls (bfloat16); 0 turns
    them off. None (auto): float32, 32 on a CPU without AVX-512, where XLA's dots are AVX2 as
    the ops are and the ops measured faster up to 32 tokens, 8 with AVX-512, where XLA caught
    up by 16 (benchmarks/fused_dense.py); bfloat16, 8 (docs/engine.md)."""
    max_screened_head_rows: int = 8
    """Float32 weights, and bfloat16 ones in steps through the fused ops: greedy steps with
    at most this many rows of logits run the LM head on a smaller copy of it
    (`head_screen`) and recompute in float32 only the entries that could be a row's argmax
    (engine/step/head.py): the same tokens, a quarter (int8) or half (float16) of a
    float32 head's bytes. Steps with a row that needs its distribution (sampling,
    penalties, logprobs, structured output) read the full head. 0: off."""
    head_screen: str = "int8"
    """The screened LM head's copy: "int8" (one float32 scale per row) or "float16" (float32
    heads only: a bfloat16 head is no larger)."""
    context_pad: int = 32
    """Decode context lengths are padded to a multiple of this: fewer distinct shapes, at the
    cost of reading up to this many padding rows per sequence."""
    max_decode_groups: int = 6
    """Decode rows are attended in at most this many groups of similar context length (one
    group would pad every sequence to the longest context in the batch). The graph attention
    path only: the fused attention op reads each sequence's own length, so with it all decode
    rows are one group."""
    decode_group_cost_rows: int = 128
    """A decode group's fixed cost (a gather, two matmuls per layer) in context rows read,
    which the split into groups weighs against padding."""
    enable_prefix_caching: bool = True
    """Share full KV blocks between sequences with a common prefix and keep them cached after
    use (transformers; the LSTM family has no blocks to share)."""
    kv_store: str | None = None
    """redis://HOST:PORT/DB: a KV tier shared by replicas; None: the local cache only."""
    kv_store_ttl_s: float = 3600.0
    """Lifetime of a block written to the KV store, refreshed when it is written again."""
    kv_store_timeout_s: float = 1.0
    """Longest wait for one KV-store call; a slower store counts as down (recompute)."""
    num_speculative_tokens: int = 0
    """Speculative decoding with n-gram drafts (engine/ngram.py, vLLM's "ngram" method): a
    sequence checks up to this many tokens copied from its own earlier text in each step, and
    keeps those the model agrees with (sampled: each with its probability), plus one of the
    model's own. Greedy output is the same tokens as without it, sampled output the same
    distribution; seeded sampled requests do not draft. 0: off."""
    speculative_ngram_min: int = 1
    """Shortest tail (in tokens) looked up in the sequence's earlier text for drafts."""
    speculative_ngram_max: int = 3
    """Longest tail looked up for drafts; the longest one found wins."""
    speculative_max_seqs: int = 2
    """Draft only while at most this many sequences run: a step of a few sequences reads
    the weights once whatever its tokens, a full batch computes every drafted token (as
    vLLM's disable_by_batch_size). In-process on a 2-core AVX2-only EPYC, 4 drafts: SmolLM2
    1.5x at 1-2 streams, 0.87-0.98x at 4; the built-in model 1.4-1.7x, and 1.13x at 4."""
    speculative_max_step_tokens: int = 8
    """Drafts stop where the running sequences' tokens and drafts would pass this many in
    one step: the fused dense op streams the weights once for up to 8 rows, and a larger
    step costs more than its drafts bring (SmolLM2 at 4 streams with 4 drafts each and no
    cap: 0.88x of plain decoding; docs/performance.md)."""
    max_loras: int = 0
    """LoRA adapters resident at once (slots of the step's adapter table, engine/step/
    lora.py); more registered adapters wait on disk and take a slot in LRU order when a
    request needs them. 0: no adapters (no table, no adapter steps)."""
    max_lora_rank: int = 16
    """Largest adapter rank a slot holds; an adapter above it is refused when loaded."""
    lora_experts: bool = True
    """On a mixture of experts, slots hold factors of the experts, shared expert and router
    too (engine/step/lora_moe.py): per slot about layers x experts x max_lora_rank x
    (3 hidden + 5 expert width) float32s (Qwen3-30B-A3B at rank 16: 3.9 GB a slot). False:
    adapters of the attention only, and the table that much smaller."""

    def __post_init__(self) -> None:
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ConfigError(f"max_loras must be >= 0 and max_lora_rank >= 1, got "
                              f"{self.max_loras} and {self.max_lora_rank}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size",
                     "max_queue_requests", "max_queue_tokens", "context_pad",
                     "max_decode_groups"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_cache_tokens is not None and self.max_cache_tokens < self.block_size:
            raise ConfigError(f"max_cache_tokens must hold at least one block "
                              f"({self.block_size}), got {self.max_cache_tokens}")
        sizes = [name for name in ("max_cache_tokens", "kv_cache_memory_bytes",
                                   "kv_cache_memory_fraction") if getattr(self, name) is not None]
        if len(sizes) > 1:
            raise ConfigError(f"set at most one of {', '.join(sizes)}: each sizes the KV cache")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got "
                              f"{self.kv_cache_dtype!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ConfigError(f"kv_cache_memory_bytes must be positive, got "
                              f"{self.kv_cache_memory_bytes}")
        fraction = self.kv_cache_memory_fraction
        if fraction is not None and not 0 < fraction <= 1:
            raise ConfigError(f"kv_cache_memory_fraction must lie in (0, 1], got "
                              f"{self.kv_cache_memory_fraction}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.kv_store is not None and not self.enable_prefix_caching:
            raise ConfigError("kv_store needs prefix caching (blocks are stored by prefix hash)")
        if self.kv_store is not None and not self.kv_store.startswith(("redis://", "rediss://",
                                                                       "unix://")):
            raise ConfigError(f"kv_store must be a redis:// URL, got {self.kv_store!r}")
        if self.kv_store_ttl_s <= 0 or self.kv_store_timeout_s <= 0:
            raise ConfigError("kv_store_ttl_s and kv_store_timeout_s must be positive")
        if self.max_fused_dense_tokens is not None and self.max_fused_dense_tokens < 0:
            raise ConfigError(f"max_fused_dense_tokens must be >= 0, got "
                              f"{self.max_fused_dense_tokens}")
        if self.max_screened_head_rows < 0:
            raise ConfigError(f"max_screened_head_rows must be >= 0, got "
                              f"{self.max_screened_head_rows}")
        if self.head_screen not in ("int8", "float16"):
            raise ConfigError(f"head_screen must be 'int8' or 'float16', got "
                              f"{self.head_screen!r}")
        if self.speculative_max_step_tokens < 1:
            raise ConfigError(f"speculative_max_step_tokens must be >= 1, got "
                              f"{self.speculative_max_step_tokens}")
        if self.num_speculative_tokens < 0 or self.speculative_max_seqs < 1:
            raise ConfigError(f"num_speculative_tokens must be >= 0 and speculative_max_seqs "
                              f">= 1, got {self.num_speculative_tokens}, "
                              f"{self.speculative_max_seqs}")
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max:
            raise ConfigError(f"need 1 <= speculative_ngram_min <= speculative_ngram_max, got "
                              f"{self.speculative_ngram_min}, {self.speculative_ngram_max}")
        if self.idle_trim_s is not None and self.idle_trim_s < 0:
            raise ConfigError(f"idle_trim_s must be >= 0 or None, got {self.idle_trim_s}")
        if self.batch_wait_s < 0:
            raise ConfigError(f"batch_wait_s must be >= 0, got {self.batch_wait_s}")
        object.__setattr__(self, "batch_sizes", tuple(sorted(self.batch_sizes)))
        if self.batch_sizes and self.batch_sizes[-1] < self.max_num_seqs:
            raise ConfigError(f"the largest allowed batch size {self.batch_sizes[-1]} is below "
                              f"max_num_seqs {self.max_num_seqs}")

    @property
    def max_logit_rows(self) -> int:
        """Most rows of logits a step returns: one per sequence, or a drafting sequence's
        tokens (each is checked)."""
        if not self.num_speculative_tokens:
            return self.max_num_seqs
        drafting_seqs = min(self.speculative_max_seqs, self.max_num_seqs)
        drafting = min(drafting_seqs * (self.num_speculative_tokens + 1),
                       self.speculative_max_step_tokens)
        return max(self.max_num_seqs, drafting)

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)
