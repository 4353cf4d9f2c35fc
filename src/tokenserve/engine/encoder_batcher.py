"""AsyncEncoder: embedding and scoring requests from many callers, run in shared batches on
one thread (plain Python; the TensorFlow is EncoderRunner's).

Each request's inputs queue one by one. A batch takes the oldest waiting input's length
bucket (encoder_shapes.length_bucket: 16, 24, 32, 48, ... tokens) and fills up, in arrival
order, with waiting inputs of the same bucket, to the largest row bucket (1, 4, 16, ...,
`max_batch_inputs`) they fill within `max_batch_tokens` padded tokens; the runner pads it to
its length bucket. Oldest first, so no bucket starves; one bucket a batch, so a one-line
query never pays for a neighbour's 256 tokens. Admission, stats and tracing are the generation engine's: a full
queue is QueueFullError (429), each batch a StepStats, each finished request a RequestStats
(queue and compute spans in its trace).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tokenserve.encoder_config import EncoderConfig, EncoderTask
from tokenserve.engine.encoder_batch_config import EncoderBatchConfig
from tokenserve.engine.encoder_shapes import length_bucket, row_buckets
from tokenserve.errors import (DeadlineExceededError, EngineDeadError,
                               InvalidRequestError, PromptTooLongError, QueueFullError)
from tokenserve.stats import RequestStats, StatsSink, StepStats

log = logging.getLogger(__name__)


@dataclass
class _Job:
    """One caller's request: its inputs' results gather here."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    num_inputs: int
    num_tokens: int
    arrival_time: float
    trace_context: dict
    results: list = field(default_factory=list)
    num_done: int = 0
    scheduled_time: float | None = None
    compute_s: float = 0.0


@dataclass
class _Input:
    job: _Job
    index: int
    token_ids: list[int]
    type_ids: list[int]


class AsyncEncoder:
    """Embeds or scores inputs in batches shared by every caller.

    Example:
        >>> encoder = AsyncEncoder.from_model_dir("models/minilm/1", EncoderBatchConfig())
        >>> vectors = await encoder.encode([encoder.tokenizer.encode("hello")])  # [1, D]
    """

    def __init__(self, runner, tokenizer, batch: EncoderBatchConfig = EncoderBatchConfig(),
                 stats: StatsSink | None = None, model_name: str | None = None,
                 version: str = ""):
        self.runner, self.tokenizer, self.batch = runner, tokenizer, batch
        self.config: EncoderConfig = runner.config
        self.stats = stats or StatsSink()
        self.model_name, self.version = model_name or self.config.name, version
        self._waiting: deque[_Input] = deque()
        self._num_queued_tokens = 0
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stopped = False
        self._ready = False
        self._thread = threading.Thread(target=self._loop, name="tokenserve-encoder",
                                        daemon=True)

    @classmethod
    def from_model_dir(cls, path: str | Path, batch: EncoderBatchConfig = EncoderBatchConfig(),
                       stats: StatsSink | None = None, model_name: str | None = None,
                       version: str = "", start: bool = True) -> "AsyncEncoder":
        from tokenserve.engine.encoder_runner import EncoderRunner

        runner, tokenizer = EncoderRunner.from_model_dir(path, batch.max_batch_inputs)
        encoder = cls(runner, tokenizer, batch, stats, model_name, version)
        if start:
            encoder.start()
        return encoder

    @property
    def task(self) -> EncoderTask:
        return self.config.task

    @property
    def max_model_len(self) -> int:
        return self.config.max_seq_len

    @property
    def num_unfinished(self) -> int:
        return len(self._jobs)

    def is_ready(self) -> bool:
        return self._ready and not self._stopped and self._thread.is_alive()

    async def encode(self, inputs: list, request_id: str | None = None,
                     timeout_s: float | None = None, trace_context: dict | None = None
                     ) -> np.ndarray:
        """`EncodedInput`s -> float32 embeddings [N, D] (embed) or scores [N] (score).

        Raises, before anything queues: InvalidRequestError (no inputs, an empty input, a
        token id outside the vocabulary), PromptTooLongError (an input past max_model_len),
        QueueFullError,
        EngineDeadError. DeadlineExceededError past `timeout_s`. A cancelled call takes its
        waiting inputs out of the queue.
        """
        self._check(inputs)
        loop = asyncio.get_running_loop()
        job = _Job(request_id or uuid.uuid4().hex, loop, loop.create_future(), len(inputs),
                   sum(len(i.token_ids) for i in inputs), time.time(), trace_context or {},
                   results=[None] * len(inputs))
        with self._lock:
            if self._stopped:
                raise EngineDeadError("the encoder has stopped: shut down")
            if len(self._jobs) >= self.batch.max_queue_requests or (
                    self._num_queued_tokens + job.num_tokens > self.batch.max_queue_tokens):
                raise QueueFullError(f"the encoder queue is full ({len(self._jobs)} requests, "
                                     f"{self._num_queued_tokens} tokens waiting)")
            self._jobs[job.request_id] = job
            self._num_queued_tokens += job.num_tokens
            self._waiting.extend(_Input(job, i, list(x.token_ids), list(x.type_ids))
                                 for i, x in enumerate(inputs))
            self._wake.notify()
        try:
            return await asyncio.wait_for(asyncio.shield(job.future), timeout_s)
        except asyncio.TimeoutError:
            self._abort(job)
            raise DeadlineExceededError(f"the request took longer than {timeout_s}s") from None
        except asyncio.CancelledError:
            self._abort(job)
            raise

    def _check(self, inputs: list) -> None:
        if not inputs:
            raise InvalidRequestError("The input is empty.", "input")
        vocab = self.config.vocab_size
        for index, x in enumerate(inputs):
            if not x.token_ids:
                raise InvalidRequestError(f"Input {index} has no tokens.", "input")
            if len(x.token_ids) > self.max_model_len:
                raise PromptTooLongError(
                    f"Input {index} has {len(x.token_ids)} tokens; this model reads at most "
                    f"{self.max_model_len}. Shorten it, or set truncate_prompt_tokens.",
                    "input", "context_length_exceeded")
            bad = next((t for t in x.token_ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequestError(f"Input {index} has token id {bad}, outside the "
                                          f"vocabulary (size {vocab}).", "input")

    def _abort(self, job: _Job) -> None:
        with self._lock:
            if self._jobs.pop(job.request_id, None) is None:
                return
            self._num_queued_tokens -= job.num_tokens
            self._waiting = deque(x for x in self._waiting if x.job is not job)

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        if self.batch.warm_up:
            seconds = self.runner.warm_up()
            log.info("%s encoder warmed up in %.2fs", self.model_name, seconds)
        self._ready = True
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the loop; requests still waiting fail with EngineDeadError."""
        with self._lock:
            self._stopped = True
            jobs, self._jobs = list(self._jobs.values()), {}
            self._waiting.clear()
            self._wake.notify()
        for job in jobs:
            _settle(job, EngineDeadError("the encoder has stopped: shut down"))
        if self._thread.is_alive():
            self._thread.join(timeout)

    close = shutdown

    # -- the loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopped and not self._waiting:
                    self._wake.wait()
                    if self.batch.batch_wait_s and self._waiting:
                        self._wake.wait(self.batch.batch_wait_s)
                if self._stopped:
                    return
                batch = self._take_batch()
                num_waiting = len(self._waiting)
            self._run(batch, num_waiting)

    def _take_batch(self) -> list[_Input]:
        """The oldest input's length bucket, filled in arrival order to a row bucket (caller
        holds _lock). A full row bucket wastes no padded rows: 26 waiting one-liners run as 16,
        then the rest with whatever arrived meanwhile, not as 26 padded to 64."""
        bucket = length_bucket(len(self._waiting[0].token_ids))
        limit = max(1, min(self.batch.max_batch_inputs,
                           self.batch.max_batch_tokens // bucket))
        same = [x for x in self._waiting if length_bucket(len(x.token_ids)) == bucket]
        rows = max(b for b in row_buckets(self.batch.max_batch_inputs)
                   if b <= min(len(same), limit))
        taken = same[:rows]
        chosen = {id(x) for x in taken}
        self._waiting = deque(x for x in self._waiting if id(x) not in chosen)
        return taken

    def _run(self, batch: list[_Input], num_waiting: int) -> None:
        started, wall = time.perf_counter(), time.time()
        longest = max(len(x.token_ids) for x in batch)
        ids = np.full((len(batch), longest), self.config.pad_token_id, np.int32)
        mask = np.zeros_like(ids)
        types = np.zeros_like(ids)
        for row, x in enumerate(batch):
            ids[row, :len(x.token_ids)] = x.token_ids
            mask[row, :len(x.token_ids)] = 1
            types[row, :len(x.type_ids)] = x.type_ids
            if x.job.scheduled_time is None:
                x.job.scheduled_time = wall
        try:
            rows = self.runner.run(ids, mask, types)
            error = None
        except Exception as failure:  # noqa: BLE001 - a failed batch fails its requests only
            log.exception("encoder batch failed")
            rows, error = None, failure
        duration = time.perf_counter() - started
        num_tokens = int(mask.sum())
        self.stats.on_step(StepStats(
            model=self.model_name, version=self.version, time=time.time(), duration_s=duration,
            num_running=len(batch), num_waiting=num_waiting, num_batched_tokens=num_tokens,
            num_prefill_tokens=num_tokens, num_decode_tokens=0, cache_usage=0.0))
        with self._lock:
            finished = []
            for row, x in enumerate(batch):
                job = x.job
                if self._jobs.get(job.request_id) is not job:
                    continue  # aborted, or failed by an earlier row of this batch
                job.compute_s += duration
                if error is not None:
                    self._jobs.pop(job.request_id)
                    self._num_queued_tokens -= job.num_tokens
                    self._waiting = deque(w for w in self._waiting if w.job is not job)
                    finished.append((job, error))
                    continue
                job.results[x.index] = rows[row]
                job.num_done += 1
                if job.num_done == job.num_inputs:
                    self._jobs.pop(job.request_id)
                    self._num_queued_tokens -= job.num_tokens
                    finished.append((job, np.stack(job.results)))
        for job, result in finished:
            if not isinstance(result, BaseException):
                self._report(job)  # before the caller wakes: its answer implies its stats
            _settle(job, result)

    def _report(self, job: _Job) -> None:
        self.stats.on_request(RequestStats(
            request_id=job.request_id, model=self.model_name, version=self.version,
            arrival_time=job.arrival_time, scheduled_time=job.scheduled_time,
            first_token_time=None, finish_time=time.time(), num_prompt_tokens=job.num_tokens,
            prefill_time_s=job.compute_s, finish_reason="stop",
            trace_context=job.trace_context))


def _settle(job: _Job, result) -> None:
    """Hands a result (or an error) to the caller's event loop."""
    def settle() -> None:
        if job.future.done():
            return
        if isinstance(result, BaseException):
            job.future.set_exception(result)
        else:
            job.future.set_result(result)
    try:
        job.loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the caller's event loop is closed
        pass
