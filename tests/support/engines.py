"""Engine configs, prompts and a stream collector for the tests that run the engine on tiny
real models."""

from __future__ import annotations

from tokenserve.engine.config import EngineConfig
from tokenserve.sampling import SamplingParams

PROMPTS = ["def add(a, b):", "import os", "class Point:\n    def", "for item in items:\n",
           "x", "PATH = os.path.join('a', 'b')  # ünïcödé"]


def engine_config(**options) -> EngineConfig:
    """A roomy float32 engine; `options` override its fields."""
    # the fused dense ops' share pinned, so the same steps take each path on every CPU
    defaults = dict(max_num_seqs=8, max_num_batched_tokens=24, block_size=4, precision="float32",
                    max_fused_dense_tokens=4)
    return EngineConfig(**{**defaults, **options})


ASYNC_CONFIG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, block_size=4,
                            precision="float32")
"""The AsyncEngine tests' engine (on the OpenAI harness's tiny model)."""


async def collect(engine, max_tokens: int = 4, request_id: str | None = None):
    """Every output of one request of `max_tokens` tokens on an AsyncEngine."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [out async for out in engine.generate([5, 6, 7], params, request_id)]


BLOCK = 4
"""The prefix-caching and KV-tier tests' block size, in tokens."""


def prefix_engine_config(**options) -> EngineConfig:
    """An engine with blocks of BLOCK tokens for the prefix-caching and KV-tier tests."""
    defaults = dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=BLOCK,
                    precision="float32")
    return EngineConfig(**{**defaults, **options})
