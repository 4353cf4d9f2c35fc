"""How big the KV pool is: its dtype and its number of blocks, from a token count or a memory
budget. Plain Python (no TensorFlow): the runner applies the plan, tests check it directly.

Sizing by memory works as vLLM's `gpu_memory_utilization` does: with
`kv_cache_memory_fraction=f` the whole process may use f of the memory it is allowed (the
cgroup's limit in a container, else the machine's RAM); the pool gets what is left of that
after what the process already holds once its weights are loaded.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from tokenserve.errors import ConfigError
from tokenserve.observability.memory import resident_bytes

log = logging.getLogger(__name__)

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_KV_CACHE_BYTES = 768 << 20
"""Without a size flag the pool holds max_num_seqs full contexts, but at most this much, or an
eighth of the memory the process may use if that is less (and at least one full context).
Sequences take blocks as they grow and most stop far below the context, so a pool for every
slot at its full length is mostly empty: SmolLM2-135M's 32 x 8,192 positions were 5.6 GiB of
a 7 GB process. A sequence that finds no free block preempts the newest (recomputed later).
768 MiB rather than 1 GiB: with traffic through every block of a 1 GiB pool, a server of
SmolLM2's Q4_1 file with 32 slots of 2,048 held 1.11-1.13x the RSS of llama.cpp's server
with the same slots (its f16 cache for all of them, 1,440 MiB; our runtime besides the pool
is about 600 MiB more than its). 768 MiB still holds about 35,000 of SmolLM2's positions,
17 full contexts (docs/memory.md)."""
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def resolve_kv_dtype(kv_cache_dtype: str, compute_dtype: str) -> str:
    """The dtype the KV pool is stored in.

    auto: 16 bits whatever the compute dtype: a 16-bit step's own dtype, and float16 under
    float32 compute (as llama.cpp's default f16 cache: half of float32's memory, and 10
    mantissa bits against bfloat16's 7; values beyond float16's range are clipped to it as
    they are written). A cache narrower than the compute dtype is widened as it is read; one
    of another 16-bit type, or wider, under a bfloat16 step is not supported.
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                          f"got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto":
        return "float16" if compute_dtype == "float32" else compute_dtype
    dtype = kv_cache_dtype
    if compute_dtype != "float32" and dtype != compute_dtype:
        raise ConfigError(f"kv_cache_dtype {dtype} with {compute_dtype} compute: a 16-bit "
                          f"step keeps its cache in its own dtype (use auto or {compute_dtype})")
    return dtype


@dataclass(frozen=True)
class KVCachePlan:
    """The pool the runner allocates."""

    dtype: str
    """float32, bfloat16 or float16."""
    num_blocks: int
    """Blocks in the pool, the reserved padding block included."""
    block_size: int
    bytes_per_token: int
    """Keys and values of every layer for one position."""
    source: str
    """What decided the size, for the log."""

    @property
    def num_tokens(self) -> int:
        """Positions that sequences can use (the padding block excluded)."""
        return (self.num_blocks - 1) * self.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.bytes_per_token

    def describe(self, max_seq_len: int) -> str:
        return (f"KV cache: {self.num_tokens:,} tokens ({self.num_blocks - 1:,} blocks of "
                f"{self.block_size}) in {self.dtype}, {self.num_bytes / 2**20:,.1f} MiB, "
                f"{self.bytes_per_token:,} bytes per token; {self.num_tokens / max_seq_len:.1f}"
                f" sequences at the full context of {max_seq_len} (sized by {self.source})")


def plan_kv_cache(engine_config, *, num_layers: int, kv_width: int, compute_dtype: str,
                  max_seq_len: int, used_bytes: int | None = None,
                  limit_bytes: int | None = None, reserved_bytes: int = 0) -> KVCachePlan:
    """Sizes the pool from, in order: max_cache_tokens, kv_cache_memory_bytes,
    kv_cache_memory_fraction, else max_num_seqs * max_seq_len tokens within the default
    budget (DEFAULT_KV_CACHE_BYTES, or an eighth of the memory limit if less).

    Args:
        num_layers, kv_width: the model's layers and Hkv * Dh (one K or V row).
        used_bytes, limit_bytes: the process's resident memory now and the memory it may
            use; read from /proc and the cgroup when None (only the fraction needs them).
        reserved_bytes: what the runner allocates after the pool is sized (the LM head's
            float16 copy), counted as in use by the fraction.
    """
    dtype = resolve_kv_dtype(engine_config.kv_cache_dtype, compute_dtype)
    bytes_per_token = num_layers * 2 * kv_width * _ITEMSIZE[dtype]
    block_size = engine_config.block_size
    block_bytes = block_size * bytes_per_token
    if engine_config.max_cache_tokens is not None:
        tokens, source = engine_config.max_cache_tokens, "kv_cache_tokens"
        num_blocks = -(-tokens // block_size) + 1  # + the reserved padding block
    elif engine_config.kv_cache_memory_bytes is not None:
        budget = engine_config.kv_cache_memory_bytes
        num_blocks = budget // block_bytes
        source = f"kv_cache_memory_bytes={budget:,}"
    elif engine_config.kv_cache_memory_fraction is not None:
        fraction = engine_config.kv_cache_memory_fraction
        limit = memory_limit_bytes() if limit_bytes is None else limit_bytes
        used = (resident_bytes() if used_bytes is None else used_bytes) + reserved_bytes
        budget = int(fraction * limit) - used
        num_blocks = max(budget, 0) // block_bytes
        source = (f"kv_cache_memory_fraction={fraction}: {fraction} x {limit / 2**30:.2f} GiB "
                  f"allowed - {used / 2**30:.2f} GiB in use = {budget / 2**30:.2f} GiB")
    else:
        tokens = engine_config.max_num_seqs * max_seq_len
        num_blocks = -(-tokens // block_size) + 1
        source = f"max_num_seqs={engine_config.max_num_seqs} x {max_seq_len} tokens"
        limit = memory_limit_bytes() if limit_bytes is None else limit_bytes
        budget = min(DEFAULT_KV_CACHE_BYTES, limit // 8)
        one_context = -(-max_seq_len // block_size) + 1
        if num_blocks * block_bytes > budget:
            num_blocks = max(budget // block_bytes, one_context)
            source += (f" capped by the default budget of "
                       f"min({DEFAULT_KV_CACHE_BYTES / 2**20:,.0f} MiB, 1/8 of "
                       f"{limit / 2**30:.1f} GiB allowed) = {budget / 2**20:,.0f} MiB; "
                       f"--kv_cache_memory_bytes sets another")
    if num_blocks < 2:
        raise ConfigError(f"the KV-cache budget ({source}) holds {max(num_blocks - 1, 0)} "
                          f"blocks of {block_size} tokens ({block_bytes:,} bytes each in "
                          f"{dtype}); at least one is needed")
    return KVCachePlan(dtype, num_blocks, block_size, bytes_per_token, source)


def memory_limit_bytes() -> int:
    """The memory this process may use: the cgroup's limit (v2, then v1) when it has one,
    else the machine's RAM."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            return int(text)
    return total
