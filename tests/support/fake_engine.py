"""An in-process EngineClient double for testing the frontends above the engine.

It honours the contract in engine/protocol.py (errors before the first output, deltas,
n sequences, stop strings and ids, logprobs, timeouts and aborts ending with ABORT, closing
the iterator aborting the request) with made-up tokens: greedy picks a token from the prompt
and step, a seed drives a NumPy random stream. It is a unit-test double only; the integration
tests run the real AsyncEngine.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from tokenserve.config import GenerationConfig
from tokenserve.engine.outputs import CompletionOutput, FinishReason, RequestOutput, TokenLogprob
from tokenserve.errors import (EngineDeadError, InvalidRequestError, PromptTooLongError,
                               QueueFullError)
from tokenserve.sampling import SamplingParams


class FakeEngine:
    """EngineClient with a bounded number of concurrent requests and a fixed step time."""

    def __init__(self, tokenizer, config: GenerationConfig, step_s: float = 0.002,
                 max_requests: int = 8):
        self._tokenizer = tokenizer
        self.config = config
        self.step_s = step_s
        self.max_requests = max_requests
        self.ready = True
        self.running: set[str] = set()
        self.aborted: list[str] = []
        self.requests: list[tuple[list[int], SamplingParams, str, float | None]] = []
        self._abort_flags: dict[str, bool] = {}
        self.fail_after: int | None = None
        self.trace_contexts: list[dict | None] = []
        """When set, generate raises EngineDeadError after this many outputs."""

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self.config.max_seq_len

    def is_ready(self) -> bool:
        return self.ready

    def abort(self, request_id: str) -> None:
        if request_id in self._abort_flags:
            self._abort_flags[request_id] = True

    def _next_token(self, rng, prompt_ids: list[int], step: int, index: int,
                    params: SamplingParams) -> int:
        vocab = self.config.model.vocab_size
        if params.temperature == 0.0 and params.seed is None:
            token = (sum(prompt_ids) * 7 + step * 13 + index) % vocab
        else:
            token = int(rng.integers(0, vocab))
        while token in (self.config.eos_token_id, self.config.pad_token_id,
                        self.config.bos_token_id) and not params.stop_token_ids:
            token = (token + 1) % vocab
        return token

    async def generate(self, prompt_ids, params, request_id, priority=0, timeout_s=None,
                       trace_context=None, final_only=False):
        if not prompt_ids:
            raise InvalidRequestError("prompt must not be empty")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise PromptTooLongError(f"prompt ({len(prompt_ids)}) + max_tokens "
                                     f"({params.max_tokens}) > {self.max_model_len}")
        if len(self.running) >= self.max_requests:
            raise QueueFullError(f"engine queue is full ({self.max_requests} requests)")
        self.requests.append((list(prompt_ids), params, request_id, timeout_s))
        self.trace_contexts.append(trace_context)
        self.running.add(request_id)
        self._abort_flags[request_id] = False
        started = time.monotonic()
        rngs = [np.random.default_rng([params.seed or 0, i]) for i in range(params.n)]
        ids: list[list[int]] = [[] for _ in range(params.n)]
        texts = [""] * params.n
        done = [False] * params.n
        try:
            step = 0
            while not all(done):
                await asyncio.sleep(self.step_s)
                expired = timeout_s is not None and time.monotonic() - started > timeout_s
                outputs = []
                for i in range(params.n):
                    if done[i]:
                        continue
                    if expired or self._abort_flags[request_id]:
                        done[i] = True
                        outputs.append(CompletionOutput(i, "", [], None, FinishReason.ABORT))
                        continue
                    outputs.append(self._step(rngs[i], prompt_ids, step, i, params, ids[i],
                                              texts, done))
                step += 1
                if self.fail_after is not None and step > self.fail_after:
                    raise EngineDeadError("the engine loop has stopped")
                yield RequestOutput(request_id, list(prompt_ids), outputs, all(done),
                                    num_generated_tokens=sum(len(x) for x in ids))
        finally:
            if not all(done):
                self.aborted.append(request_id)
            self.running.discard(request_id)
            self._abort_flags.pop(request_id, None)

    def _step(self, rng, prompt_ids, step, i, params, seq_ids, texts, done) -> CompletionOutput:
        token = self._next_token(rng, prompt_ids, step, i, params)
        seq_ids.append(token)
        logprobs = None
        if params.logprobs is not None:
            top = tuple((int((token + k) % self.config.model.vocab_size), -0.5 - k)
                        for k in range(params.logprobs))
            logprobs = [TokenLogprob(token, -0.5, top)]
        full = self._tokenizer.decode(seq_ids)
        delta, reason, stop_reason = full[len(texts[i]):], None, None
        for stop in params.stop:
            at = full.find(stop)
            if at >= 0:
                delta, reason, stop_reason = full[len(texts[i]):at], FinishReason.STOP, stop
                break
        if reason is None and token in params.stop_token_ids:
            reason, stop_reason = FinishReason.STOP, token
        if reason is None and len(seq_ids) >= params.max_tokens:
            reason = FinishReason.LENGTH
        texts[i] += delta
        done[i] = reason is not None
        return CompletionOutput(i, delta, [token], logprobs, reason, stop_reason)
