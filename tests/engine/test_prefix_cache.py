"""Automatic prefix caching: block accounting with no TF, then exactness on tiny real models."""

from __future__ import annotations

import pytest

from support.engines import BLOCK, prefix_engine_config
from tokenserve.engine.config import EngineConfig
from tokenserve.engine.outputs import FinishReason
from tokenserve.engine.prefix_cache import PrefixCachingAllocator, hash_namespace
from tokenserve.engine.request import Request
from tokenserve.errors import ConfigError
from tokenserve.sampling import SamplingParams

def allocator(num_blocks: int = 16) -> PrefixCachingAllocator:
    return PrefixCachingAllocator(num_blocks, BLOCK, hash_namespace("m", "1", "float", "f32"))


def computed(cache: PrefixCachingAllocator, prompt: list[int]) -> Request:
    """A request whose prompt was matched, reserved and fully computed."""
    request = Request("r", prompt, SamplingParams())
    seq = request.seqs[0]
    cache.match_prefix(seq)
    assert cache.reserve(seq, seq.num_pending_tokens)
    seq.num_computed_tokens = seq.num_tokens
    cache.cache_computed(seq)
    return request


def test_a_finished_prefix_is_found_again_but_the_last_token_is_always_computed():
    cache = allocator()
    first = computed(cache, list(range(10)))  # blocks [0..3] [4..7] full, [8, 9] partial
    cache.free(first.seqs[0])
    again = Request("b", list(range(10)) + [99], SamplingParams()).seqs[0]
    assert cache.match_prefix(again) == 8
    exact = Request("c", list(range(8)), SamplingParams()).seqs[0]
    assert cache.match_prefix(exact) == 4  # 8 tokens: the second block holds the last one
    other = Request("d", [1] + list(range(1, 10)), SamplingParams()).seqs[0]
    assert cache.match_prefix(other) == 0  # the chain covers every earlier token


def test_a_reset_forgets_unused_blocks_and_keeps_those_in_use():
    cache = allocator()
    done = computed(cache, list(range(10))).seqs[0]
    running = computed(cache, list(range(50, 59))).seqs[0]  # two full blocks, still in use
    cache.free(done)
    free_before = cache.num_free_blocks
    assert cache.reset_prefix_cache() == 2  # done's two full blocks; its partial one was free
    assert cache.num_free_blocks == free_before  # cached-but-unused blocks counted as free
    assert cache.num_cached_blocks == 2  # running's blocks keep their hashes
    assert cache.match_prefix(Request("x", list(range(10)), SamplingParams()).seqs[0]) == 0
    assert cache.match_prefix(Request("y", list(range(50, 60)), SamplingParams()).seqs[0]) == 8
    evicted = []
    cache.on_evict = lambda hash_, block: evicted.append(block)
    others = [computed(cache, [1000 + i] * 4).seqs[0] for i in range(cache.num_free_blocks)]
    assert len(others) == 16 - 1 - 3 and evicted == []  # forgotten blocks were plain free


def test_namespaces_never_share_blocks():
    int8 = PrefixCachingAllocator(16, BLOCK, hash_namespace("m", "1", "int8", "float32"))
    f32 = PrefixCachingAllocator(16, BLOCK, hash_namespace("m", "1", "float", "float32"))
    seq_a = Request("a", list(range(9)), SamplingParams()).seqs[0]
    seq_b = Request("b", list(range(9)), SamplingParams()).seqs[0]
    assert int8.block_hashes(seq_a, 2) != f32.block_hashes(seq_b, 2)


def test_shared_blocks_are_reference_counted_and_freed_by_the_last_sharer():
    cache = allocator()
    a = computed(cache, list(range(12))).seqs[0]
    b = Request("b", list(range(12)) + [7], SamplingParams()).seqs[0]
    assert cache.match_prefix(b) == 12
    assert b.block_ids == a.block_ids
    free_before = cache.num_free_blocks
    cache.free(a)  # the sharer ends: b's blocks stay in use
    assert cache.num_free_blocks == free_before
    c = Request("c", list(range(12)) + [8], SamplingParams()).seqs[0]
    assert cache.match_prefix(c) == 12 and c.block_ids == b.block_ids
    cache.free(b)
    cache.free(c)
    assert cache.num_free_blocks == cache.num_usable_blocks
    assert cache.num_cached_blocks == 3  # cached, free for reuse


def test_lru_eviction_under_pressure_takes_the_least_recently_used_prefix_first():
    cache = allocator(num_blocks=9)  # 8 usable blocks
    evicted = []
    cache.on_evict = lambda hash_, block: evicted.append(block)
    old = computed(cache, [1] * 12 + [0]).seqs[0]      # 3 full blocks + 1
    new = computed(cache, [2] * 12 + [0]).seqs[0]
    old_blocks, new_blocks = old.block_ids[:3], new.block_ids[:3]
    cache.free(old)
    cache.free(new)
    big = Request("big", [3] * 20, SamplingParams()).seqs[0]
    assert cache.match_prefix(big) == 0
    assert cache.reserve(big, 20)  # 5 blocks: 2 never-cached ones, then the 3 oldest
    assert sorted(evicted) == sorted(old_blocks)
    assert cache.match_prefix(Request("x", [1] * 13, SamplingParams()).seqs[0]) == 0
    assert cache.match_prefix(Request("y", [2] * 13, SamplingParams()).seqs[0]) == 12
    assert not set(new_blocks) & set(big.block_ids)


def test_remote_tier_needs_prefix_caching_and_a_redis_url():
    with pytest.raises(ConfigError):
        EngineConfig(enable_prefix_caching=False, kv_store="redis://127.0.0.1:1/0")
    with pytest.raises(ConfigError):
        EngineConfig(kv_store="memcached://x")


# -- on a tiny real model ------------------------------------------------------------------
SYSTEM = "def add(a, b):\n    return a + b\nclass Point:\n    def __init__(self, x, y):\n"
TURNS = ["        self.x = x\n", "for item in items:\n", "import os\nimport sys\n"]


def test_prefix_hits_give_exactly_the_greedy_tokens_of_a_cold_run(tiny_gpt2_dir):
    from tokenserve.engine.llm import LLM

    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [SYSTEM + turn for turn in TURNS]
    cold = LLM(tiny_gpt2_dir, prefix_engine_config(enable_prefix_caching=False))
    warm = LLM(tiny_gpt2_dir, prefix_engine_config())
    expected = [o.outputs[0].token_ids for o in cold.generate(prompts, params, use_tqdm=False)]
    first = [o.outputs[0].token_ids for o in warm.generate(prompts[:1], params, use_tqdm=False)]
    again = warm.generate(prompts, params, use_tqdm=False)
    rest = [o.outputs[0].token_ids for o in again]
    assert first == expected[:1] and rest == expected
    encoded = [warm.tokenizer.encode(p) for p in prompts]
    common = next(i for i, ids in enumerate(zip(*encoded)) if len(set(ids)) > 1)
    stats = warm.engine.prefix_cache_stats()
    # the repeated prompt hits all its full blocks but the last token's; the others, the
    # shared prefix's full blocks
    repeated = (len(encoded[0]) - 1) // BLOCK * BLOCK
    assert stats.num_hit_tokens == repeated + 2 * (common // BLOCK * BLOCK)
    # each request reports its own hits (the OpenAI usage's cached_tokens)
    assert [o.num_cached_tokens for o in again] == [repeated] + 2 * [common // BLOCK * BLOCK]
    assert cold.engine.prefix_cache_stats().num_query_tokens == 0


def test_shared_blocks_survive_one_sharers_abort(tiny_gpt2_dir):
    from tokenserve.engine.core import LLMEngine
    from tokenserve.engine.llm import LLM

    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompt = SYSTEM + TURNS[0]
    llm = LLM(tiny_gpt2_dir, prefix_engine_config())
    expected = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    engine: LLMEngine = llm.engine
    ids = llm.tokenizer.encode(prompt)
    a, b = (engine.make_request(ids, params, name) for name in ("a", "b"))
    engine.add_request(a)
    engine.add_request(b)
    outputs: dict = {}
    for step in range(40):
        for delta in engine.step():
            LLM._accumulate(outputs, delta)
        if step == 3:
            shared = set(a.seqs[0].block_ids) & set(b.seqs[0].block_ids)
            assert shared  # both hold the cached prompt blocks
            engine.abort("a")
        if not engine.has_work:
            break
    assert a.seqs[0].finish_reason is FinishReason.ABORT
    assert outputs["b"].outputs[0].token_ids == expected
