"""The engine as the servers see it. OpenAI, TF Serving and gRPC frontends code against this
Protocol; `tokenserve.engine.async_engine.AsyncEngine` implements it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from tokenserve.config import GenerationConfig
from tokenserve.engine.outputs import RequestOutput
from tokenserve.sampling import SamplingParams


class EngineClient(Protocol):
    """A running engine for one model version."""

    config: GenerationConfig
    """The model's generation config: max_seq_len, special token ids, chat template."""

    @property
    def tokenizer(self):
        """`tokenserve.model.tokenizer.Tokenizer` of the model (encode, decode, stream)."""

    @property
    def max_model_len(self) -> int:
        """Prompt plus generated tokens may not exceed this."""

    def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                 priority: int = 0, timeout_s: float | None = None
                 ) -> AsyncIterator[RequestOutput]:
        """Queues a request and streams its outputs (deltas) until one with `finished`.

        Raises, before the first output: `InvalidRequestError` (empty prompt, unknown token id),
        `PromptTooLongError` (prompt + max_tokens beyond the context), `QueueFullError`
        (queue at its request or token limit), `EngineDeadError`. A request past `timeout_s`
        ends with finish_reason ABORT. Closing the iterator early (client gone, call
        cancelled) aborts the request and frees its cache at the next step.
        """

    def prompt_logprobs(self, prompt_ids: list[int], num_top: int, lora=None) -> list:
        """`TokenLogprob` of each prompt token after the first, given the tokens before it
        (completions' `echo` with `logprobs`), on the LoraRequest `lora`'s adapter where
        given. Blocking.

        Raises: `InvalidRequestError` (a prompt whose logits would be too large)."""

    def abort(self, request_id: str) -> None:
        """Stops a request; its stream ends with finish_reason ABORT."""

    def is_ready(self) -> bool:
        """True once warmed up and the last engine step succeeded."""
