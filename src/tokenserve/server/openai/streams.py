"""Runs one engine request per prompt and merges their output streams.

`MergedOutputs.start()` waits until every prompt has its first output, so errors the engine
raises before the first output (queue full, prompt too long) surface before a frontend has
committed to a status line or a stream. `aclose()` closes every engine iterator, which aborts
the requests still running: frontends call it when a client disconnects or cancels.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from tokenserve.engine.outputs import FinishReason, RequestOutput
from tokenserve.engine.protocol import EngineClient
from tokenserve.errors import DeadlineExceededError
from tokenserve.sampling import SamplingParams

_END = object()


class MergedOutputs:
    """Outputs of `len(prompts)` engine requests, as (prompt index, RequestOutput) pairs.

    Example:
        outputs = MergedOutputs(engine, [ids], params, "cmpl-1", timeout_s=30.0)
        try:
            await outputs.start()
            async for prompt_index, output in outputs: ...
        finally:
            await outputs.aclose()
    """

    def __init__(self, engine: EngineClient, prompts: list[list[int]], params: SamplingParams,
                 request_id: str, priority: int = 0, timeout_s: float | None = None,
                 trace_context: dict[str, str] | None = None, final_only: bool = False):
        self.engine, self.prompts, self.params = engine, prompts, params
        self.request_ids = ([request_id] if len(prompts) == 1 else
                            [f"{request_id}-{i}" for i in range(len(prompts))])
        self.priority, self.timeout_s = priority, timeout_s
        # W3C trace headers; passed only when present, as an engine extension beyond the
        # EngineClient protocol (AsyncEngine.generate accepts `trace_context`).
        self._extra = {"trace_context": trace_context} if trace_context else {}
        # the caller answers only at the end (an unstreamed request): the engine may hand over
        # every output at once (AsyncEngine.generate's final_only)
        if final_only:
            self._extra["final_only"] = True
        self.started_at = time.monotonic()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._buffer: list[tuple[int, RequestOutput]] = []
        self._num_open = len(prompts)
        self._num_cached = [0] * len(prompts)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens the prefix cache served, over every prompt (the usage's
        `cached_tokens`)."""
        return sum(self._num_cached)

    async def _pump(self, index: int) -> None:
        stream = None
        try:
            stream = self.engine.generate(self.prompts[index], self.params,
                                          self.request_ids[index], self.priority, self.timeout_s,
                                          **self._extra)
            async for output in stream:
                self._num_cached[index] = max(self._num_cached[index], output.num_cached_tokens)
                await self._queue.put((index, output))
                if output.finished:
                    break
        except Exception as error:  # handed to the consumer, which raises it
            await self._queue.put((index, error))
        finally:
            aclose = getattr(stream, "aclose", None)  # None for a plain AsyncIterator
            if aclose is not None:
                await aclose()  # aborts the engine request if it is still running
            await self._queue.put((index, _END))

    async def start(self) -> None:
        """Queues every prompt and waits for each one's first output.

        Raises:
            Whatever the engine raised for any prompt (the other requests are then aborted).
        """
        self._tasks = [asyncio.create_task(self._pump(i)) for i in range(len(self.prompts))]
        have_first: set[int] = set()
        while len(have_first) < len(self.prompts):
            index, item = await self._queue.get()
            if isinstance(item, Exception):
                await self.aclose()
                raise item
            if item is _END:
                self._num_open -= 1
            else:
                self._buffer.append((index, item))
            have_first.add(index)

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        for pair in self._buffer:
            yield pair
        self._buffer.clear()
        while self._num_open:
            index, item = await self._queue.get()
            if item is _END:
                self._num_open -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item

    def deadline_passed(self, reason: FinishReason | None) -> bool:
        """True if an ABORT finish is the engine enforcing this request's timeout."""
        return (reason == FinishReason.ABORT and self.timeout_s is not None
                and time.monotonic() - self.started_at >= self.timeout_s * 0.999)

    def deadline_error(self) -> DeadlineExceededError:
        return DeadlineExceededError(f"The request did not finish within its timeout of "
                                     f"{self.timeout_s:g} s.")

    async def aclose(self) -> None:
        """Cancels the pumps; their `finally` closes the engine iterators (abort)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


TRACE_HEADERS = ("traceparent", "tracestate")


def trace_context(pairs) -> dict[str, str]:
    """W3C trace headers from HTTP headers (a mapping) or gRPC metadata (key/value pairs)."""
    items = pairs.items() if hasattr(pairs, "items") else pairs or ()
    found = {}
    for key, value in items:
        if key.lower() in TRACE_HEADERS:
            found[key.lower()] = value.decode() if isinstance(value, bytes) else str(value)
    return found
