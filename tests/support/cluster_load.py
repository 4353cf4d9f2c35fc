"""Load for the local cluster: streaming clients that record what happened to each request.

Each worker thread streams OpenAI completions (or Responses-API conversations) through the
gateway back to back until told to stop, and keeps one `Outcome` per attempt: which replica
answered (the gateway's `X-Tokenserve-Upstream`), when it started and ended, and how it
failed. A failed attempt is retried, as a client would, and the retry is its own Outcome.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

MAX_RETRIES = 3


@dataclass
class Outcome:
    """One HTTP attempt."""

    worker: int
    attempt: int  # 0: first try; 1..: retries of the same request
    started: float  # time.monotonic()
    ended: float = 0.0
    status: int | None = None
    upstream: str = ""
    error: str = ""  # "" on success; else the error a client saw
    num_events: int = 0
    body: dict | None = None  # the final object (a Responses-API response)

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass
class Load:
    """Worker threads running `task(worker, client, outcomes)` in a loop until `stop()`."""

    base_url: str
    num_workers: int
    task: Callable[["Load", int, httpx.Client], None]
    keepalive: bool = True
    """Reuse connections to the gateway. Off, every request opens its own: an nginx reload
    closes idle keep-alive connections, and a POST a client sends on one just then fails
    without reaching any replica (clients retry it; the rolling-restart test, which reloads
    nginx to stand in for Kubernetes' endpoint updates, counts only what replicas do)."""
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> "Load":
        for worker in range(self.num_workers):
            thread = threading.Thread(target=self._run, args=(worker,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _run(self, worker: int) -> None:
        limits = httpx.Limits() if self.keepalive else httpx.Limits(max_keepalive_connections=0)
        with httpx.Client(base_url=self.base_url, timeout=httpx.Timeout(120, connect=5),
                          limits=limits) as c:
            while not self._stop.is_set():
                self.task(self, worker, c)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def record(self, outcome: Outcome) -> None:
        with self._lock:
            self.outcomes.append(outcome)

    def stop(self, timeout_s: float = 180) -> list[Outcome]:
        """Lets every worker finish its current request (and its retries), then returns."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout_s)
        return sorted(self.outcomes, key=lambda o: o.started)


def sse_events(response: httpx.Response):
    """The `data:` payloads of an SSE response, as strings."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: "):]


def stream_once(client: httpx.Client, path: str, body: dict, worker: int,
                attempt: int, done: Callable[[str], dict | None]) -> Outcome:
    """One streamed request; `done(payload)` returns the final object (or {}) at the stream's
    last event and None before it. A stream that ends without it has failed."""
    outcome = Outcome(worker, attempt, time.monotonic())
    try:
        with client.stream("POST", path, json=body) as response:
            outcome.status = response.status_code
            outcome.upstream = response.headers.get("x-tokenserve-upstream", "")
            if response.status_code != 200:
                response.read()
                outcome.error = f"HTTP {response.status_code}"
            else:
                for payload in sse_events(response):
                    outcome.num_events += 1
                    final = done(payload)
                    if final is not None:
                        outcome.body = final
                if outcome.body is None:
                    outcome.error = "stream ended without its last event"
    except httpx.HTTPError as error:
        outcome.error = f"{type(error).__name__}: {error}"
    outcome.ended = time.monotonic()
    return outcome


def completions_task(max_tokens: int = 64) -> Callable[[Load, int, httpx.Client], None]:
    """A streamed completion, retried up to MAX_RETRIES times when it fails."""
    def task(load: Load, worker: int, client: httpx.Client) -> None:
        body = {"model": "builtin", "prompt": f"def worker_{worker}(items):",
                "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
        for attempt in range(MAX_RETRIES + 1):
            outcome = stream_once(client, "/v1/completions", body, worker, attempt,
                                  lambda p: {} if p == "[DONE]" else None)
            load.record(outcome)
            if outcome.ok:
                return
    return task


def _response_completed(payload: str) -> dict | None:
    if payload == "[DONE]":
        return None
    event = json.loads(payload)
    if event.get("type") in ("response.completed", "response.incomplete"):
        return event["response"]  # incomplete: stopped at max_output_tokens
    return None


def conversation_task(num_turns: int = 4, max_output_tokens: int = 12):
    """A Responses-API conversation: each turn continues the previous one by
    `previous_response_id`; a failed turn is retried with the same previous id."""
    def task(load: Load, worker: int, client: httpx.Client) -> None:
        previous = None
        for turn in range(num_turns):
            body = {"model": "builtin", "input": f"turn {turn} of worker {worker}",
                    "max_output_tokens": max_output_tokens, "stream": True,
                    "previous_response_id": previous}
            if previous is None:
                del body["previous_response_id"]
            for attempt in range(MAX_RETRIES + 1):
                outcome = stream_once(client, "/v1/responses", body, worker, attempt,
                                      _response_completed)
                outcome.body = {**(outcome.body or {}), "_turn": turn,
                                "_sent_previous": previous}
                load.record(outcome)
                if outcome.ok:
                    previous = outcome.body["id"]
                    break
            else:
                return  # the turn was lost; the test counts it
            if load.stopping and turn + 1 < num_turns:
                continue  # finish the conversation before stopping
    return task
