"""RedisKVStore: full KV blocks in Redis, keyed by their prefix hash, with a TTL.

Every call returns instead of raising when Redis is down or slow: a lookup finds nothing
and a write is dropped, so requests are served by recomputing. A failure is counted and
logged once per outage; redis-py reconnects on the next call by itself.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)

KEY_PREFIX = "tokenserve:kv:"


class RedisKVStore:
    """Args:
        url: redis://HOST:PORT/DB.
        ttl_s: lifetime of a written block.
        timeout_s: longest wait for connecting and for one call.
    """

    def __init__(self, url: str, ttl_s: float, timeout_s: float = 1.0):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.url, self.ttl_ms = url, max(1, int(ttl_s * 1000))
        # no retries: a lookup that fails is recomputed at once, not retried on the clock
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                            socket_connect_timeout=timeout_s,
                                            retry=Retry(NoBackoff(), 0))
        self._errors = (redis.RedisError, OSError)
        self._lock = threading.Lock()
        self._down = False
        self.num_errors = 0

    def get_blocks(self, hashes: list[bytes]) -> list[bytes | None]:
        """The payloads stored under `hashes` (None where missing), in one round trip."""
        if not hashes:
            return []
        try:
            pipe = self._client.pipeline(transaction=False)
            for hash_ in hashes:
                pipe.get(KEY_PREFIX + hash_.hex())
            found = pipe.execute()
        except self._errors as error:
            self._failed(error)
            return [None] * len(hashes)
        self._ok()
        return found

    def put_blocks(self, items: list[tuple[bytes, bytes]]) -> None:
        """Writes (hash, payload) pairs with the TTL, in one round trip."""
        if not items:
            return
        try:
            pipe = self._client.pipeline(transaction=False)
            for hash_, payload in items:
                pipe.set(KEY_PREFIX + hash_.hex(), payload, px=self.ttl_ms)
            pipe.execute()
        except self._errors as error:
            self._failed(error)
            return
        self._ok()

    def _failed(self, error: BaseException) -> None:
        with self._lock:
            self.num_errors += 1
            first = not self._down
            self._down = True
        if first:
            log.warning("KV store %s is unavailable (%s: %s); recomputing instead until it "
                        "is back", self.url, type(error).__name__, error)

    def _ok(self) -> None:
        if self._down:
            with self._lock:
                self._down = False
            log.info("KV store %s is reachable again", self.url)

    def close(self) -> None:
        self._client.close()
