"""RemoteKVTier against a real redis-server, with a stand-in for the runner's cache rows."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from support.engines import prefix_engine_config
from tokenserve.engine.kv_tier import KVLoad, KVSave, RemoteKVTier
from tokenserve.engine.request import Request
from tokenserve.sampling import SamplingParams
from tokenserve.state.kv_store import RedisKVStore

BLOCK_SHAPE = (4, 2, 2, 8)  # [block_size, layers, K/V, kv width]


class Rows:
    """The part of the runner the tier uses: a block pool's rows, read and written by id."""

    def __init__(self, num_blocks: int):
        self.rows = np.arange(num_blocks * int(np.prod(BLOCK_SHAPE)), dtype=np.float16
                              ).reshape((num_blocks,) + BLOCK_SHAPE)

    def read_kv_blocks(self, block_ids):
        return self.rows[block_ids]

    def write_kv_blocks(self, block_ids, rows):
        self.rows[block_ids] = rows


def make_tier(url: str) -> RemoteKVTier:
    return RemoteKVTier(RedisKVStore(url, ttl_s=60), BLOCK_SHAPE, np.float16,
                        resave_after_s=30)


def test_close_with_wait_lets_queued_writes_reach_redis(redis_server):
    tier = make_tier(redis_server.url)
    hashes = [bytes([i]) * 32 for i in range(1, 9)]
    tier.apply(Rows(16), [KVSave(hashes, list(range(1, 9)))])
    tier.close(wait=True)
    assert redis_server.client().dbsize() == len(hashes)


def test_a_saved_block_is_loaded_back_exactly_and_only_the_chains_leading_hits_count(
        redis_server):
    source, target = Rows(8), Rows(8)
    writer, reader = make_tier(redis_server.url), make_tier(redis_server.url)
    first, second, missing = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
    writer.apply(source, [KVSave([first, second], [1, 2])])
    writer.close(wait=True)
    seq = Request("r", list(range(20)), SamplingParams()).seqs[0]
    found = []
    reader.on_ready = lambda: found.extend(reader.take_finished())
    reader.start_lookup(seq, 0, [first, missing, second], block_size=BLOCK_SHAPE[0])
    reader.close(wait=True)
    assert [lookup.num_found for lookup in found] == [1]  # `second` is past a miss
    assert found[0].rows[0].dtype == np.float16
    reader.apply(target, [KVLoad([5], found[0].rows)])
    np.testing.assert_array_equal(target.rows[5], source.rows[1])


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
def test_16_bit_blocks_go_from_one_runner_through_redis_into_another_bit_exactly(
        tiny_gpt2_dir, redis_server, kv_cache_dtype):
    """Every 16-bit pattern survives: NaN payloads, infinities, subnormals, negative zero
    (a round trip through float32 would canonicalize NaNs)."""
    from tokenserve.engine.llm import LLM

    config = prefix_engine_config(kv_cache_dtype=kv_cache_dtype, max_cache_tokens=256)
    source, target = (LLM(tiny_gpt2_dir, config).engine.runner for _ in range(2))
    shape = source.kv_block_shape
    bits = np.random.default_rng(0).integers(0, 1 << 16, (2, *shape), dtype=np.uint16)
    bits.reshape(-1)[:6] = [0x7FC1, 0xFFFF, 0x7C00, 0x0001, 0x8000, 0x7F81]
    source.write_kv_blocks([3, 5], bits.view(source.kv_dtype))
    np.testing.assert_array_equal(source.read_kv_blocks([3, 5]).view(np.uint16), bits)
    writer, reader = (RemoteKVTier(RedisKVStore(redis_server.url, ttl_s=60), shape,
                                   source.kv_dtype, resave_after_s=30) for _ in range(2))
    hashes = [b"\x0a" * 32, b"\x0b" * 32]
    writer.apply(source, [KVSave(hashes, [3, 5])])
    writer.close(wait=True)
    found = []
    reader.on_ready = lambda: found.extend(reader.take_finished())
    reader.start_lookup(Request("r", list(range(40)), SamplingParams()).seqs[0], 0, hashes,
                        block_size=shape[0])
    reader.close(wait=True)
    reader.apply(target, [KVLoad([7, 2], found[0].rows)])
    np.testing.assert_array_equal(target.read_kv_blocks([7, 2]).view(np.uint16), bits)


class CountingStore(RedisKVStore):
    """A real RedisKVStore that counts the keys asked for and holds its first lookup until
    `gate` is set (so a second lookup starts while the first is in flight)."""

    def __init__(self, url: str):
        super().__init__(url, ttl_s=60)
        self.gate, self.num_keys_asked = threading.Event(), 0

    def get_blocks(self, hashes):
        first = self.num_keys_asked == 0
        self.num_keys_asked += len(hashes)
        if first:
            self.gate.wait(30)
        return super().get_blocks(hashes)


def test_concurrent_lookups_of_a_shared_prefix_fetch_it_once(redis_server):
    source = Rows(8)
    writer = make_tier(redis_server.url)
    shared, own_a, own_b = [bytes([i]) * 32 for i in (1, 2, 3)], b"\x0a" * 32, b"\x0b" * 32
    writer.apply(source, [KVSave(shared + [own_a, own_b], [1, 2, 3, 4, 5])])
    writer.close(wait=True)
    store = CountingStore(redis_server.url)
    reader = RemoteKVTier(store, BLOCK_SHAPE, np.float16, resave_after_s=30)
    seq_a, seq_b = (Request(name, list(range(24)), SamplingParams()).seqs[0]
                    for name in ("a", "b"))
    reader.start_lookup(seq_a, 0, shared + [own_a], block_size=BLOCK_SHAPE[0])
    reader.start_lookup(seq_b, 0, shared + [own_b], block_size=BLOCK_SHAPE[0])
    store.gate.set()
    reader.close(wait=True)
    found = {lookup.seq.seq_id: lookup for lookup in reader.take_finished()}
    assert store.num_keys_asked == 5  # the shared three once, and each one's own block
    for seq, last in ((seq_a, 4), (seq_b, 5)):
        rows = np.stack(found[seq.seq_id].rows)
        np.testing.assert_array_equal(rows, source.rows[[1, 2, 3, last]])


class GatedStore:
    """A store that finds nothing and holds lookups of `held` hashes until `gate` is set."""

    num_errors = 0

    def __init__(self, held: bytes):
        self.held, self.gate = held, threading.Event()

    def get_blocks(self, hashes):
        if self.held in hashes:
            self.gate.wait(30)
        return [None] * len(hashes)

    def close(self):
        pass


def test_an_answered_lookup_waits_for_those_in_flight_at_most_gather_s():
    """An idle engine does not start a step for the first answer while other lookups of the
    same burst are in flight, and a timer wakes it when the wait is over."""
    slow, fast = b"\x01" * 32, b"\x02" * 32
    store = GatedStore(held=slow)
    tier = RemoteKVTier(store, BLOCK_SHAPE, np.float16, resave_after_s=30, gather_s=0.2)
    woken = threading.Event()
    tier.on_ready = woken.set
    seq_slow, seq_fast = (Request(name, list(range(8)), SamplingParams()).seqs[0]
                          for name in ("slow", "fast"))
    tier.start_lookup(seq_slow, 0, [slow], block_size=BLOCK_SHAPE[0])
    tier.start_lookup(seq_fast, 0, [fast], block_size=BLOCK_SHAPE[0])
    assert woken.wait(5)  # the fast one answered
    assert tier.has_finished and tier.is_gathering
    woken.clear()
    assert woken.wait(5)  # the timer, gather_s later
    assert not tier.is_gathering and tier.num_loading == 2
    store.gate.set()
    tier.close(wait=True)
    assert {lookup.seq.seq_id for lookup in tier.take_finished()} == {seq_slow.seq_id,
                                                                     seq_fast.seq_id}
    assert not tier.is_gathering
