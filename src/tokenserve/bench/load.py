"""When requests are sent: Poisson or gamma (bursty) arrivals at a rate, all at once (rate
inf), and/or capped by a fixed number in flight. Same process as `vllm bench serve`."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

Request = TypeVar("Request")
Output = TypeVar("Output")


@dataclass(frozen=True)
class LoadConfig:
    """The arrival process of one benchmark run."""

    request_rate: float = math.inf
    """Mean requests per second; inf sends every request at once."""
    burstiness: float = 1.0
    """Gamma shape of the gaps: 1 is Poisson, below 1 burstier, above 1 more even."""
    max_concurrency: int | None = None
    """At most this many requests in flight (None: no limit)."""
    seed: int = 0
    """Seeds the arrival gaps."""

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request rate must be > 0, got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max concurrency must be >= 1, got {self.max_concurrency}")


def arrival_offsets(num_requests: int, config: LoadConfig) -> list[float]:
    """Seconds after the start at which each request is sent.

    Gaps are gamma(shape=burstiness, scale=1/(rate*burstiness)) (mean 1/rate), and the
    offsets are rescaled so the last one is num_requests/rate, which keeps the achieved rate
    steady across seeds (as vLLM does).
    """
    if math.isinf(config.request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(config.seed)
    if math.isinf(config.burstiness):
        gaps = np.full(num_requests, 1.0 / config.request_rate)
    else:
        gaps = rng.gamma(shape=config.burstiness,
                         scale=1.0 / (config.request_rate * config.burstiness),
                         size=num_requests)
    offsets = np.cumsum(gaps)
    if offsets[-1] > 0:
        offsets *= (num_requests / config.request_rate) / offsets[-1]
    return offsets.tolist()


async def run_load(requests: Sequence[Request], send: Callable[[Request], Awaitable[Output]],
                   config: LoadConfig,
                   on_done: Callable[[Output], None] | None = None) -> tuple[list[Output], float]:
    """Sends every request on schedule and waits for all of them.

    Args:
        requests: what to send, in order.
        send: sends one request and returns its output (it must not raise).
        config: the arrival process.
        on_done: called with each output as it completes (a progress bar).

    Returns:
        (outputs in request order, wall seconds from the first send to the last completion)
    """
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    offsets = arrival_offsets(len(requests), config)

    async def one(request: Request) -> Output:
        if limit is None:
            output = await send(request)
        else:
            async with limit:
                output = await send(request)
        if on_done is not None:
            on_done(output)
        return output

    started = time.perf_counter()
    tasks = []
    for request, offset in zip(requests, offsets):
        delay = started + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(request)))
    outputs = await asyncio.gather(*tasks)
    return list(outputs), time.perf_counter() - started
