"""AsyncEngine: the engine loop on its own thread, streaming to asyncio callers.

TensorFlow releases the GIL while a step computes, so the HTTP and gRPC servers' event
loops stay responsive. Callers touch the scheduler only under `_lock`, which the loop
holds while scheduling and updating but not while the step computes.

A failed step fails the requests it was running (they end with ABORT) and the engine goes
on. A failure that cannot be pinned on running requests (the step failed and there were none
to fail, or failing them failed) leaves the engine's state unknown: the engine is then dead.
It logs that once, fails every request it holds with EngineDeadError (HTTP 503, gRPC
UNAVAILABLE), refuses new ones the same way and reports not ready, instead of leaving
streams waiting on a loop that is gone (or spinning on a step that fails every time).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from tokenserve.engine.config import EngineConfig
from tokenserve.engine.core import LLMEngine
from tokenserve.engine.lora_adapter import LoraRequest
from tokenserve.engine.outputs import RequestOutput, TokenLogprob
from tokenserve.engine.warmup import warm_up
from tokenserve.engine.sampler.draw import token_logprob
from tokenserve.errors import EngineDeadError, InvalidRequestError
from tokenserve.observability.memory import (freeze_python_heap, release_freed_memory,
                                             thaw_python_heap)
from tokenserve.sampling import SamplingParams
from tokenserve.stats import StatsSink

log = logging.getLogger(__name__)
# prompt logprobs hold a prompt's whole [tokens, vocab] float32 logits at once
PROMPT_LOGITS_BYTES = 512 << 20


class AsyncEngine:
    """Implements `tokenserve.engine.protocol.EngineClient` over an LLMEngine.

    Example:
        >>> engine = AsyncEngine.from_model_dir("models/builtin", EngineConfig())
        >>> async for out in engine.generate(ids, SamplingParams(max_tokens=16), "req-1"):
        ...     print(out.outputs[0].text, end="")
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.config = engine.config
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        # request id -> (caller's loop, its queue, outputs held back for a final_only caller)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue,
                                       list | None]] = {}
        self._stopped = False
        self._ready = False
        self._last_step_ok = True
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="tokenserve-engine", daemon=True)
        if engine.scheduler.kv_tier is not None:  # a finished KV lookup wakes the loop
            engine.scheduler.kv_tier.on_ready = self._notify

    @classmethod
    def from_model_dir(cls, path: str | Path, engine_config: EngineConfig = EngineConfig(),
                       stats: StatsSink | None = None, model_name: str | None = None,
                       version: str = "", start: bool = True) -> "AsyncEngine":
        from tokenserve.engine.runner import ModelRunner

        runner, tokenizer = ModelRunner.from_model_dir(path, engine_config)
        engine = cls(LLMEngine(runner, tokenizer, engine_config, stats, model_name, version))
        if start:
            engine.start()
        return engine

    # -- EngineClient ---------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def is_ready(self) -> bool:
        return (self._ready and self._error is None and self._last_step_ok
                and self._thread.is_alive())

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting)

    @property
    def num_unfinished(self) -> int:
        return len(self.engine.scheduler.requests)

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str | None = None, priority: int = 0,
                       timeout_s: float | None = None, trace_context: dict | None = None,
                       final_only: bool = False, lora: LoraRequest | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Streams RequestOutput deltas; see EngineClient.generate.

        final_only: the same deltas, handed to the caller's event loop all at once when the
        request finishes, not one wake-up per token (as vLLM's FINAL_ONLY output kind, for
        callers that answer only at the end: unstreamed HTTP requests). One unstreamed int8
        GPT-2-small stream spent about 9 % more per token through the server than in process,
        each token crossing to the event loop and through two queues."""
        request = self.engine.make_request(prompt_ids, params, request_id or uuid.uuid4().hex,
                                           priority, timeout_s, trace_context, lora)
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            # Checked under the lock that shutdown() and _die() hold while they sweep the
            # requests, so a request is either swept (and ended) or refused here, never left
            # queued on a loop that has stopped.
            self._check_alive()
            self.engine.add_request(request)   # QueueFullError propagates before any output
            self._streams[request.request_id] = (asyncio.get_running_loop(), queue,
                                                 [] if final_only else None)
            self._wake.notify()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # the caller left early: a disconnect or a cancelled call
                self.abort(request.request_id)

    def prompt_logprobs(self, prompt_ids: list[int], num_top: int,
                        lora: LoraRequest | None = None) -> list[TokenLogprob]:
        """The log-probability of each prompt token after the ones before it (so one entry
        fewer than the prompt: the first token has none), with `num_top` alternatives, as
        vLLM's prompt_logprobs. One full forward pass over the prompt, beside the engine's
        steps rather than inside them (TF runs both; the weights are only read), with
        `lora`'s deltas where given (its checked weights, from the host cache or its
        files). Blocking.

        Raises:
            InvalidRequestError: the logits would take more than PROMPT_LOGITS_BYTES.
            LoraAdapterError: `lora`'s files no longer load.
        """
        vocab = self.config.model.vocab_size
        if len(prompt_ids) * vocab * 4 > PROMPT_LOGITS_BYTES:
            raise InvalidRequestError(
                f"prompt logprobs of {len(prompt_ids)} tokens over a {vocab}-token vocabulary "
                f"would take {len(prompt_ids) * vocab * 4 >> 20} MiB of logits; at most "
                f"{PROMPT_LOGITS_BYTES >> 20} MiB", "logprobs")
        self._check_alive()
        layers = None
        if lora is not None:
            if self.engine.loras is None:
                raise InvalidRequestError("this model serves no LoRA adapters (max_loras is 0)")
            layers = self.engine.loras.weights_of(lora).layers
        logits = self.engine.runner.prompt_logits(prompt_ids, layers)
        return [token_logprob(logits[i - 1], prompt_ids[i], num_top)
                for i in range(1, len(prompt_ids))]

    @property
    def loras(self):
        """The engine's LoRA slots (lora_slots.py); None: no adapters (max_loras 0)."""
        return self.engine.loras

    def abort(self, request_id: str) -> None:
        with self._lock:
            if self._error is not None:  # dead: its state is not to be trusted or touched
                self._streams.pop(request_id, None)
                return
            output = self.engine.abort(request_id)
            if output is not None:
                self._deliver([output])

    def _check_alive(self) -> None:
        """Raises EngineDeadError once the engine has died or shut down (caller holds _lock)."""
        if self._error is not None:
            raise EngineDeadError(str(self._error))
        if self._stopped:
            raise EngineDeadError("the engine has stopped: shut down")

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        warm_up(self.engine)
        self._ready = True
        # start-up's objects out of the cycle collector's way: otherwise a full collection
        # (hundreds of ms) falls due on the first requests (freeze_python_heap)
        freeze_python_heap()
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the loop; unfinished requests end with finish_reason ABORT."""
        with self._lock:
            self._stopped = True
            if self._error is None:  # a dead engine has failed its requests already
                for request_id in list(self.engine.scheduler.requests):
                    output = self.engine.abort(request_id)
                    if output is not None:
                        self._deliver([output])
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():  # a loop still running may still use the tier
            self.engine.close()
        # this engine's objects become collectable again once dropped (the next engine to
        # start freezes what is left)
        thaw_python_heap()

    close = shutdown

    def _loop(self) -> None:
        try:
            self._run()
        except BaseException as error:  # noqa: BLE001 - the thread must not die silently
            self._die(error)

    def _run(self) -> None:
        wait_s = self.engine.engine_config.batch_wait_s
        trim_after_s = self.engine.engine_config.idle_trim_s
        trim_pending = False  # steps ran since the heap was last trimmed
        while True:
            trim_now = False
            with self._lock:
                # sequences waiting only for the remote KV tier wake the loop when loaded
                while not self._stopped and not self.engine.scheduler.has_runnable_work:
                    if trim_pending and trim_after_s is not None:
                        # idle trim_after_s after the last step: trim below, off the lock
                        if not self._wake.wait(trim_after_s):
                            trim_now = True
                            break
                    else:
                        self._wake.wait()
                    if wait_s and self.engine.has_work:  # let more arrivals join the first step
                        self._wake.wait(wait_s)
                if self._stopped:
                    return
            if trim_now:
                # the steps' freed temporaries, kept by malloc until reused (measured in
                # docs/memory.md); a burst starting now waits at most for the trim itself
                release_freed_memory()
                trim_pending = False
                continue
            trim_pending = True
            try:
                outputs = self._step()
                self._last_step_ok = True
            except Exception as error:  # a failed step fails its requests, not the server
                log.exception("engine step failed")
                self._last_step_ok = False
                outputs = self._fail_running(error)
                if not outputs:  # nothing to pin it on: the next step would fail the same way
                    raise EngineDeadError(f"the engine has stopped: a step failed with no "
                                          f"running request to fail ({type(error).__name__}: "
                                          f"{error})") from error
            with self._lock:
                self._deliver(outputs)

    def _notify(self) -> None:
        with self._lock:
            self._wake.notify()

    def _die(self, error: BaseException) -> None:
        """The loop cannot go on: log once, fail every stream, refuse new requests."""
        dead = error if isinstance(error, EngineDeadError) else EngineDeadError(
            f"the engine has stopped: {type(error).__name__}: {error}")
        log.critical("engine loop stopped; failing every request: %s", dead,
                     exc_info=(type(error), error, error.__traceback__))
        with self._lock:
            self._error = dead
            streams, self._streams = self._streams, {}
        for loop, queue, _ in streams.values():
            try:
                loop.call_soon_threadsafe(queue.put_nowait, EngineDeadError(str(dead)))
            except RuntimeError:  # the caller's event loop is closed
                pass

    def _step(self) -> list[RequestOutput]:
        engine = self.engine
        with self._lock:
            outputs, scheduled = engine.schedule()
        if scheduled.is_empty:
            return outputs
        output = engine.execute(scheduled)  # no lock: callers may enqueue or abort
        with self._lock:
            return outputs + engine.update(scheduled, output)

    def _fail_running(self, error: Exception) -> list[RequestOutput]:
        with self._lock:
            running = {s.request.request_id for s in self.engine.scheduler.running}
            outputs = [self.engine.abort(r) for r in running]
        return [o for o in outputs if o is not None]

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hands outputs to their callers' event loops (caller holds _lock).

        One wake-up per event loop and step, not one per output: each call_soon_threadsafe
        writes to the loop's self-pipe, and at 32 streams that was 32 wake-ups a step."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for output in outputs:
            target = self._streams.get(output.request_id)
            if target is None:
                continue
            loop, queue, held = target
            if held is not None and not output.finished:
                held.append(output)  # a final_only caller: handed over when it finishes
                continue
            if output.finished:
                del self._streams[output.request_id]
            items = by_loop.setdefault(loop, [])
            if held:
                items.extend((queue, earlier) for earlier in held)
            items.append((queue, output))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the caller's event loop is closed
                pass


def _put_all(items: list) -> None:
    for queue, output in items:
        queue.put_nowait(output)
