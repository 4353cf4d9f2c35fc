"""POST /v1/completions: validate, run through the engine, answer as one JSON body or as SSE.

Choice indexes follow vLLM for batched prompts: choice = prompt_index * n + sequence index.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from tokenserve.engine.protocol import EngineClient
from tokenserve.errors import PromptTooLongError

from .config import OpenAIServerConfig
from .formatting import SSE_DONE, CompletionLogprobsBuilder, sse, token_text
from .params import (bad_request, check_unsupported, max_new_tokens, prompt_token_ids,
                     request_timeout, sampling_params, structured_output)
from .schemas import (CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
                      PromptTokensDetails, Usage)
from .streams import MergedOutputs


class _NothingToGenerate:
    """MergedOutputs' stand-in when no sequence runs (echo with max_tokens 0)."""

    num_cached_tokens = 0

    async def start(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


class CompletionRun:
    """One /v1/completions request from validation to its last chunk."""

    def __init__(self, request: CompletionRequest, engine: EngineClient, model_id: str,
                 config: OpenAIServerConfig, trace: dict[str, str] | None = None):
        """Checks the request and builds the engine inputs. Blocking (it tokenizes): the app
        builds it off the event loop.

        Raises:
            InvalidRequestError / PromptTooLongError: the request cannot be served.
        """
        check_unsupported(request)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        self.request, self.model_id, self.request_id = request, model_id, request_id
        self.tokenizer = engine.tokenizer
        prompts = prompt_token_ids(request.prompt, self.tokenizer,
                                   engine.config.model.vocab_size, config.max_prompts,
                                   engine.max_model_len)
        # echo with max_tokens 0 (OpenAI's legacy API, vLLM): the prompt back, scored when
        # logprobs are asked for, and nothing generated; the engine is not involved
        self.prompt_only = bool(request.echo) and request.max_tokens == 0
        if self.prompt_only:
            for ids in prompts:
                if len(ids) > engine.max_model_len:
                    raise bad_request(
                        f"This model's maximum context length is {engine.max_model_len} "
                        f"tokens. However, you requested {len(ids)} tokens in the prompt.",
                        "prompt", "context_length_exceeded", PromptTooLongError)
            max_tokens = 1  # only to validate the sampling parameters
        else:
            max_tokens = min(max_new_tokens(request.max_tokens, "max_tokens", len(ids),
                                            engine.max_model_len,
                                            config.default_completion_max_tokens)
                             for ids in prompts)
        self.params = sampling_params(request, max_tokens, request.logprobs,
                                      structured_output(request))
        self.num_prompt_tokens = sum(len(ids) for ids in prompts)
        self.prompt_texts = [self.tokenizer.decode(ids) if request.echo else "" for ids in prompts]
        # echo with logprobs: the prompt's tokens lead each choice's logprobs, as in OpenAI's
        # legacy completions and vLLM (how lm-evaluation-harness scores a continuation)
        self.prompt_logprobs = [self._prompt_part(ids, engine.prompt_logprobs(
            ids, request.logprobs)) for ids in prompts] \
            if request.echo and request.logprobs is not None else None
        timeout_s = request_timeout(request.timeout_s, config.request_timeout_s)
        self.outputs = _NothingToGenerate() if self.prompt_only else MergedOutputs(
            engine, prompts, self.params, request_id, request.priority, timeout_s,
            trace_context=trace, final_only=not request.stream)
        self._num_generated: dict[int, int] = {}

    def _usage(self) -> Usage:
        completion = sum(self._num_generated.values())
        return Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=completion,
                     total_tokens=self.num_prompt_tokens + completion,
                     prompt_tokens_details=PromptTokensDetails(
                         cached_tokens=self.outputs.num_cached_tokens))

    def _choices(self) -> AsyncIterator:
        """(choice index, CompletionOutput) for every sequence delta, tracking usage."""
        async def choices():
            async for prompt_index, output in self.outputs:
                self._num_generated[prompt_index] = max(
                    output.num_generated_tokens,
                    self._num_generated.get(prompt_index, 0)
                    + sum(len(o.token_ids) for o in output.outputs))
                for seq in output.outputs:
                    yield prompt_index, prompt_index * self.params.n + seq.index, seq
        return choices()

    def _prompt_part(self, ids: list[int], logprobs: list) -> CompletionLogprobs:
        """The prompt's tokens in completions format: the first with no logprob (nothing came
        before it), then each after the ones before it."""
        first = token_text(self.tokenizer, ids[0])
        part = CompletionLogprobs(tokens=[first], token_logprobs=[None], top_logprobs=[None],
                                  text_offset=[0])
        CompletionLogprobsBuilder.extend(
            part, CompletionLogprobsBuilder(self.tokenizer, len(first)).delta(logprobs))
        return part

    def _leading_logprobs(self, prompt_index: int) -> CompletionLogprobs:
        """What a choice's logprobs start with: the prompt's, with echo, else nothing."""
        if self.prompt_logprobs is None:
            return CompletionLogprobs()
        return self.prompt_logprobs[prompt_index].model_copy(deep=True)

    def _prompt_only_choices(self) -> list[CompletionChoice]:
        """Echo with max_tokens 0: each prompt as its choices' whole text, with the prompt's
        logprobs when asked for; finished by length, as OpenAI's legacy API answered."""
        n = self.params.n
        return [CompletionChoice(
            index=i, text=self.prompt_texts[i // n], finish_reason="length",
            logprobs=self._leading_logprobs(i // n) if self.params.logprobs is not None
            else None) for i in range(len(self.prompt_texts) * n)]

    def _new_logprobs(self, prompt_index: int) -> CompletionLogprobsBuilder:
        return CompletionLogprobsBuilder(self.tokenizer, len(self.prompt_texts[prompt_index]))

    async def response(self) -> CompletionResponse:
        """Collects every sequence into one response.

        Raises:
            DeadlineExceededError: the engine aborted a sequence at the request's deadline.
        """
        num_choices = len(self.prompt_texts) * self.params.n
        choices = [CompletionChoice(index=i, text=self.prompt_texts[i // self.params.n])
                   for i in range(num_choices)]
        if self.prompt_only:
            return CompletionResponse(id=self.request_id, model=self.model_id,
                                      choices=self._prompt_only_choices(), usage=self._usage())
        builders: dict[int, CompletionLogprobsBuilder] = {}
        async for prompt_index, index, seq in self._choices():
            choice = choices[index]
            choice.text += seq.text
            if self.params.logprobs is not None:
                builder = builders.setdefault(index, self._new_logprobs(prompt_index))
                choice.logprobs = choice.logprobs or self._leading_logprobs(prompt_index)
                builder.extend(choice.logprobs, builder.delta(seq.logprobs or []))
            if seq.finish_reason is not None:
                if self.outputs.deadline_passed(seq.finish_reason):
                    raise self.outputs.deadline_error()
                choice.finish_reason = seq.finish_reason.value
                choice.stop_reason = seq.stop_reason
        return CompletionResponse(id=self.request_id, model=self.model_id, choices=choices,
                                  usage=self._usage())

    async def events(self) -> AsyncIterator[str]:
        """SSE events: one chunk per sequence delta, the usage chunk if asked, [DONE].

        A deadline ends the affected choices with finish_reason "abort".
        """
        options = self.request.stream_options
        per_chunk_usage = options is not None and options.continuous_usage_stats
        if self.prompt_only:
            for choice in self._prompt_only_choices():
                yield sse(CompletionResponse(id=self.request_id, model=self.model_id,
                                             choices=[choice],
                                             usage=self._usage() if per_chunk_usage else None))
            if options is not None and options.include_usage:
                yield sse(CompletionResponse(id=self.request_id, model=self.model_id,
                                             choices=[], usage=self._usage()))
            yield SSE_DONE
            return
        echoed: set[int] = set()
        builders: dict[int, CompletionLogprobsBuilder] = {}
        async for prompt_index, index, seq in self._choices():
            text = seq.text
            first = self.request.echo and index not in echoed
            if first:
                echoed.add(index)
                text = self.prompt_texts[prompt_index] + text
            logprobs = None
            if self.params.logprobs is not None:
                builder = builders.setdefault(index, self._new_logprobs(prompt_index))
                logprobs = self._leading_logprobs(prompt_index) if first \
                    else CompletionLogprobs()
                builder.extend(logprobs, builder.delta(seq.logprobs or []))
            reason = seq.finish_reason.value if seq.finish_reason is not None else None
            chunk = CompletionResponse(
                id=self.request_id, model=self.model_id,
                choices=[CompletionChoice(index=index, text=text, logprobs=logprobs,
                                          finish_reason=reason, stop_reason=seq.stop_reason)],
                usage=self._usage() if per_chunk_usage else None)
            yield sse(chunk)
        if options is not None and options.include_usage:
            yield sse(CompletionResponse(id=self.request_id, model=self.model_id, choices=[],
                                         usage=self._usage()))
        yield SSE_DONE

