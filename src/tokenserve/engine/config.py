"""Engine configuration: one typed, validated dataclass, and the TF Serving batching mapping."""

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
    kv_cache_memory_fraction when set, else max_num_seqs * the context."""
    kv_cache_dtype: str = "auto"
    """KV-cache storage: auto (16 bits: float16 under float32 compute, else the compute
    dtype), float32, bfloat16 or float16. A float32 step widens 16-bit rows as it reads them."""
    kv_cache_memory_bytes: int | None = None
    """Size the KV pool to this many bytes (its token capacity is logged at load)."""
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
    precision: str = "auto"
    """Compute dtype: float32, bfloat16 (oneDNN/AMX), or auto (bfloat16 when the CPU has AMX
    or AVX512-BF16, as measured in benchmarks/throughput.py; else float32)."""
    max_fused_dense_tokens: int = 4
    """Steps of at most this many tokens (float32 weights) run the dense half as fused ops
    (kernels/dense.py) instead of XLA programs: on GPT-2-small (AVX2) a decode step takes
    12 % less time at 1 sequence and 14 % less at 4; XLA catches up by 8. 0 turns it off."""
    context_pad: int = 32
    """Decode context lengths are padded to a multiple of this: fewer distinct shapes, at the
    cost of reading up to this many padding rows per sequence."""
    max_decode_groups: int = 6
    """Decode rows are attended in at most this many groups of similar context length (one
    group would pad every sequence to the longest context in the batch)."""
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

    def __post_init__(self) -> None:
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
        if self.max_fused_dense_tokens < 0:
            raise ConfigError(f"max_fused_dense_tokens must be >= 0, got "
                              f"{self.max_fused_dense_tokens}")
        if self.batch_wait_s < 0:
            raise ConfigError(f"batch_wait_s must be >= 0, got {self.batch_wait_s}")
        object.__setattr__(self, "batch_sizes", tuple(sorted(self.batch_sizes)))
        if self.batch_sizes and self.batch_sizes[-1] < self.max_num_seqs:
            raise ConfigError(f"the largest allowed batch size {self.batch_sizes[-1]} is below "
                              f"max_num_seqs {self.max_num_seqs}")

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


def from_batching_parameters(text: str, base: EngineConfig = EngineConfig()) -> EngineConfig:
    """Applies a TF Serving `--batching_parameters_file` (text BatchingParameters) to `base`.

    Mapping (continuous batching has no batches to enqueue, so the limits become queue and
    batch limits):
      max_batch_size       -> max_num_seqs
      batch_timeout_micros -> batch_wait_s
      max_enqueued_batches -> max_queue_requests = max_enqueued_batches * max_batch_size
      allowed_batch_sizes  -> batch_sizes (decode batches are padded up to one of them)
      num_batch_threads    -> ignored: one engine loop; TensorFlow's intra-op threads do the
                              parallel work
    """
    from google.protobuf import text_format

    params = _batching_parameters_class()()
    try:
        text_format.Parse(text, params)
    except text_format.ParseError as error:
        raise ConfigError(f"cannot parse batching parameters: {error}") from error
    changes: dict = {}
    if params.HasField("max_batch_size"):
        changes["max_num_seqs"] = params.max_batch_size.value
    if params.HasField("batch_timeout_micros"):
        changes["batch_wait_s"] = params.batch_timeout_micros.value / 1e6
    if params.HasField("max_enqueued_batches"):
        batch = changes.get("max_num_seqs", base.max_num_seqs)
        changes["max_queue_requests"] = params.max_enqueued_batches.value * batch
    if params.allowed_batch_sizes:
        changes["batch_sizes"] = tuple(params.allowed_batch_sizes)
    return base.replace(**changes)


def _batching_parameters_class():
    """TF Serving's BatchingParameters message, built from its schema at run time.

    tensorflow-serving-api does not ship session_bundle_config.proto, so the message is
    declared here field for field (same names, numbers and wrapper types), which lets
    protobuf's own text_format parse the files TF Serving users already have.
    """
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, wrappers_pb2

    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(wrappers_pb2.DESCRIPTOR.serialized_pb)
    file = descriptor_pb2.FileDescriptorProto(
        name="tokenserve/batching_parameters.proto", package="tensorflow.serving",
        dependency=["google/protobuf/wrappers.proto"], syntax="proto3")
    message = file.message_type.add(name="BatchingParameters")
    Field = descriptor_pb2.FieldDescriptorProto
    fields = [("max_batch_size", 1, ".google.protobuf.Int64Value"),
              ("batch_timeout_micros", 2, ".google.protobuf.Int64Value"),
              ("max_enqueued_batches", 3, ".google.protobuf.Int64Value"),
              ("num_batch_threads", 4, ".google.protobuf.Int64Value"),
              ("thread_pool_name", 5, ".google.protobuf.StringValue"),
              ("pad_variable_length_inputs", 7, None),
              ("enable_large_batch_splitting", 8, ".google.protobuf.BoolValue"),
              ("max_execution_batch_size", 9, ".google.protobuf.Int64Value"),
              ("batch_padding_policy", 10, ".google.protobuf.StringValue")]
    for name, number, type_name in fields:
        if type_name is None:
            message.field.add(name=name, number=number, type=Field.TYPE_BOOL,
                              label=Field.LABEL_OPTIONAL)
        else:
            message.field.add(name=name, number=number, type=Field.TYPE_MESSAGE,
                              type_name=type_name, label=Field.LABEL_OPTIONAL)
    message.field.add(name="allowed_batch_sizes", number=6, type=Field.TYPE_INT64,
                      label=Field.LABEL_REPEATED)
    pool.Add(file)
    return message_factory.GetMessageClass(
        pool.FindMessageTypeByName("tensorflow.serving.BatchingParameters"))
