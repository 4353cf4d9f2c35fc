"""RemoteKVTier against a real redis-server, with a stand-in for the runner's cache rows."""

from __future__ import annotations

import numpy as np
from redis_server import redis_server  # noqa: F401  (fixture)

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


def test_close_with_wait_lets_queued_writes_reach_redis(redis_server):  # noqa: F811
    tier = make_tier(redis_server.url)
    hashes = [bytes([i]) * 32 for i in range(1, 9)]
    tier.apply(Rows(16), [KVSave(hashes, list(range(1, 9)))])
    tier.close(wait=True)
    assert redis_server.client().dbsize() == len(hashes)


def test_a_saved_block_is_loaded_back_exactly_and_only_the_chains_leading_hits_count(
        redis_server):  # noqa: F811
    source, target = Rows(8), Rows(8)
    writer, reader = make_tier(redis_server.url), make_tier(redis_server.url)
    first, second, missing = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
    writer.apply(source, [KVSave([first, second], [1, 2])])
    writer.close(wait=True)
    seq = Request("r", list(range(20)), SamplingParams()).seqs[0]
    found = []
    reader.on_ready = lambda: found.extend(reader.take_finished())
    reader.start_lookup(seq, [first, missing, second], block_size=BLOCK_SHAPE[0])
    reader.close(wait=True)
    assert [len(payloads) for _, _, payloads in found] == [1]  # `second` is past a miss
    _, _, payloads = found[0]
    reader.apply(target, [KVLoad([5], payloads)])
    np.testing.assert_array_equal(target.rows[5], source.rows[1])
