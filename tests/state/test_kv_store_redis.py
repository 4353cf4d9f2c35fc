"""The Redis KV tier on a real redis-server and tiny real models."""

from __future__ import annotations

import threading
import time

import pytest

from support.engines import BLOCK, prefix_engine_config
from support.redis_server import RedisServer
from tokenserve.engine.kv_tier import RemoteKVTier
from tokenserve.engine.scheduler import Scheduler
from tokenserve.sampling import SamplingParams

PROMPT = ("def add(a, b):\n    return a + b\nclass Point:\n    def __init__(self, x, y):\n"
          "        self.x = x\n        self.y = y\n")
MORE = "for item in items:\n    if item is None:\n"
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def cold(tiny_gpt2_dir):
    from tokenserve.engine.llm import LLM

    llm = LLM(tiny_gpt2_dir, prefix_engine_config(enable_prefix_caching=False))
    return lambda prompts: [o.outputs[0].token_ids
                            for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


def generate(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


def wait_for_keys(server: RedisServer, minimum: int = 1, timeout_s: float = 30.0) -> int:
    client = server.client()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        count = client.dbsize()
        if count >= minimum:
            return count
        time.sleep(0.05)
    raise TimeoutError("no KV blocks reached Redis")


def test_replica_b_loads_the_blocks_replica_a_computed(tiny_gpt2_dir, cold, redis_server):
    from tokenserve.engine.llm import LLM

    config = prefix_engine_config(kv_store=redis_server.url, kv_store_ttl_s=60)
    replica_a, replica_b = LLM(tiny_gpt2_dir, config), LLM(tiny_gpt2_dir, config)
    assert generate(replica_a, [PROMPT]) == cold([PROMPT])
    num_blocks = (len(replica_a.tokenizer.encode(PROMPT)) - 1) // BLOCK
    wait_for_keys(redis_server, num_blocks)
    assert 0 < redis_server.client().ttl(redis_server.client().keys("tokenserve:kv:*")[0]) <= 60
    assert generate(replica_b, [PROMPT + MORE]) == cold([PROMPT + MORE])
    stats = replica_b.engine.prefix_cache_stats()
    assert stats.num_hit_tokens == 0  # nothing local on B ...
    assert stats.num_remote_hit_tokens >= num_blocks * BLOCK  # ... all of A's blocks loaded
    assert stats.num_remote_errors == 0
    # each prompt is one query, however many times it waited for a lookup
    assert replica_a.engine.prefix_cache_stats().num_query_tokens == len(
        replica_a.tokenizer.encode(PROMPT))
    assert stats.num_query_tokens == len(replica_b.tokenizer.encode(PROMPT + MORE))


def test_killing_redis_mid_run_loses_no_request_and_the_store_reconnects(
        tiny_gpt2_dir, cold, tmp_path):
    from tokenserve.engine.llm import LLM

    server = RedisServer(tmp_path)
    server.start()
    try:
        llm = LLM(tiny_gpt2_dir, prefix_engine_config(kv_store=server.url))
        prompts = [PROMPT + MORE, MORE + PROMPT, PROMPT]
        assert generate(llm, prompts[:1]) == cold(prompts[:1])
        server.kill()
        fresh = LLM(tiny_gpt2_dir, prefix_engine_config(kv_store=server.url))  # must look up
        assert generate(fresh, prompts) == cold(prompts)
        assert fresh.engine.prefix_cache_stats().num_remote_errors >= 1
        server.start()  # same port: the store reconnects by itself
        errors = fresh.engine.prefix_cache_stats().num_remote_errors
        later = MORE * 3
        assert generate(fresh, [later]) == cold([later])
        wait_for_keys(server)
        assert fresh.engine.prefix_cache_stats().num_remote_errors == errors
    finally:
        server.kill()


class GatedStore:
    """A store whose lookups wait for a gate (a slow Redis), and find nothing."""

    def __init__(self):
        self.gate, self.num_errors, self.num_lookups = threading.Event(), 0, 0

    def get_blocks(self, hashes):
        self.num_lookups += 1
        self.gate.wait(30)
        return [None] * len(hashes)

    def put_blocks(self, items):
        pass


def test_a_sequence_waiting_for_its_lookup_does_not_stall_other_sequences(tiny_gpt2_dir,
                                                                          cold):
    from tokenserve.engine.llm import LLM

    llm = LLM(tiny_gpt2_dir, prefix_engine_config())
    engine = llm.engine
    store = GatedStore()
    tier = RemoteKVTier(store, engine.runner.kv_block_shape, engine.runner.kv_dtype, 60.0)
    engine.scheduler = Scheduler(engine.engine_config, engine.runner.cache, tier)
    short = engine.make_request(llm.tokenizer.encode("x"), PARAMS, "short")  # no full block
    long = engine.make_request(llm.tokenizer.encode(PROMPT), PARAMS, "long")
    engine.add_request(short)
    engine.add_request(long)
    outputs: dict = {}
    for _ in range(PARAMS.max_tokens):
        for delta in engine.step():
            LLM._accumulate(outputs, delta)
    assert outputs["short"].finished and tier.is_loading(long.seqs[0])
    assert long.seqs[0].num_computed_tokens == 0 and "long" not in outputs
    store.gate.set()
    while engine.has_work:
        for delta in engine.step():
            LLM._accumulate(outputs, delta)
    assert outputs["long"].outputs[0].token_ids == cold([PROMPT])[0]
    assert outputs["short"].outputs[0].token_ids == cold(["x"])[0]
    assert store.num_lookups == 1


def test_blocks_of_a_still_running_sequence_are_readable_by_a_second_engine(
        tiny_gpt2_dir, cold, redis_server):
    """Full blocks are written as they fill, not when their sequence ends."""
    from tokenserve.engine.llm import LLM

    config = prefix_engine_config(kv_store=redis_server.url)
    replica_a, replica_b = LLM(tiny_gpt2_dir, config), LLM(tiny_gpt2_dir, config)
    engine = replica_a.engine
    ids = replica_a.tokenizer.encode(PROMPT)
    running = engine.make_request(ids, SamplingParams(max_tokens=80, ignore_eos=True), "a")
    engine.add_request(running)
    num_blocks = (len(ids) - 1) // BLOCK
    while running.seqs[0].num_computed_tokens < len(ids) + BLOCK:  # the prompt and a block
        engine.step()
    wait_for_keys(redis_server, num_blocks)
    assert not running.is_finished
    assert generate(replica_b, [PROMPT]) == cold([PROMPT])
    assert replica_b.engine.prefix_cache_stats().num_remote_hit_tokens == num_blocks * BLOCK
    engine.abort("a")


def test_a_sequence_whose_lookup_answered_while_it_queued_is_admitted_at_the_next_step(
        tiny_gpt2_dir, cold, redis_server):
    """The lookup starts when the request arrives, so the first step after its answer
    prefills with the loaded blocks; the greedy tokens are a cold run's."""
    from tokenserve.engine.llm import LLM

    config = prefix_engine_config(kv_store=redis_server.url)
    replica_a, replica_b = LLM(tiny_gpt2_dir, config), LLM(tiny_gpt2_dir, config)
    generate(replica_a, [PROMPT])
    num_blocks = (len(replica_a.tokenizer.encode(PROMPT)) - 1) // BLOCK
    wait_for_keys(redis_server, num_blocks)
    engine = replica_b.engine
    request = engine.make_request(replica_b.tokenizer.encode(PROMPT + MORE), PARAMS, "b")
    engine.add_request(request)
    tier = engine.scheduler.kv_tier
    deadline = time.monotonic() + 30
    while not tier.has_finished and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tier.has_finished
    outputs: dict = {}
    for delta in engine.step():
        LLM._accumulate(outputs, delta)
    seq = request.seqs[0]
    assert seq.num_cached_tokens >= num_blocks * BLOCK  # admitted with the loaded blocks
    assert seq.num_computed_tokens > seq.num_cached_tokens  # and prefilled in that step
    while engine.has_work:
        for delta in engine.step():
            LLM._accumulate(outputs, delta)
    assert outputs["b"].outputs[0].token_ids == cold([PROMPT + MORE])[0]
