"""Stored Responses-API responses: the conversation any replica can continue.

A stored response keeps its own input items, its output, the whole conversation up to and
including it (as plain messages) and its token ids. `MemoryResponseStore` is an in-process
LRU (the default); `RedisResponseStore` (`--state_store redis://...`) is shared by
replicas. Both are blocking: servers call them off their event loop.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass, field


@dataclass
class StoredResponse:
    id: str
    owner: str
    """Digest of the API key that created it ("" without API keys): only it may read it."""
    response: dict
    """The Response object as the API returned it."""
    input_items: list[dict] = field(default_factory=list)
    """This response's own input items (GET /v1/responses/{id}/input_items)."""
    conversation: list[dict] = field(default_factory=list)
    """Every message so far, this response's output included: [{"role", "content"}]."""
    token_ids: list[int] = field(default_factory=list)
    """The last prompt's token ids followed by the generated ones."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> "StoredResponse":
        return cls(**json.loads(text))


class MemoryResponseStore:
    """An in-process LRU of stored responses (lost on restart, not shared)."""

    def __init__(self, max_responses: int = 10_000):
        self.max_responses = max_responses
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, stored: StoredResponse) -> None:
        with self._lock:
            self._items[stored.id] = stored
            self._items.move_to_end(stored.id)
            while len(self._items) > self.max_responses:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._items.get(response_id)
            if stored is not None:
                self._items.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None


class RedisResponseStore:
    """Stored responses in Redis under `tokenserve:response:{id}`, each with a TTL.

    Unlike the KV tier (a cache), this is state: when Redis is down, calls raise
    ServableUnavailableError (HTTP 503) instead of answering as if nothing were stored.
    """

    KEY_PREFIX = "tokenserve:response:"

    def __init__(self, url: str, ttl_s: float = 30 * 24 * 3600, timeout_s: float = 2.0):
        import redis

        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                            socket_connect_timeout=timeout_s)
        self._errors = (redis.RedisError, OSError)
        self.ttl_s = int(ttl_s)

    def _call(self, fn, *args, **kwargs):
        from tokenserve.errors import ServableUnavailableError

        try:
            return fn(*args, **kwargs)
        except self._errors as error:
            raise ServableUnavailableError(f"the response store is unavailable: {error}") from error

    def put(self, stored: StoredResponse) -> None:
        self._call(self._client.set, self.KEY_PREFIX + stored.id, stored.to_json(),
                   ex=self.ttl_s)

    def get(self, response_id: str) -> StoredResponse | None:
        text = self._call(self._client.get, self.KEY_PREFIX + response_id)
        return None if text is None else StoredResponse.from_json(text)

    def delete(self, response_id: str) -> bool:
        return bool(self._call(self._client.delete, self.KEY_PREFIX + response_id))


def open_response_store(url: str | None):
    """A RedisResponseStore for a redis:// URL, else the in-process LRU."""
    return RedisResponseStore(url) if url else MemoryResponseStore()
