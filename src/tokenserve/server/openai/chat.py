"""POST /v1/chat/completions: messages through the chat template, then the engine.

A reply is split (reply_stream.py) into the reasoning of a thinking model
(`reasoning_content`), its content and its tool calls, whole or as it streams.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator

from tokenserve.engine.guided import check_structured
from tokenserve.engine.protocol import EngineClient

from .chat_prompt import chat_prompt
from .config import OpenAIServerConfig
from .formatting import SSE_DONE, chat_logprobs, sse
from .params import (bad_request, check_unsupported, max_new_tokens, request_timeout,
                     sampling_params, structured_output)
from .reasoning import reasoning_format
from .reply_stream import ReplyStream, parse_reply
from .schemas import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                      ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs,
                      DeltaMessage, PromptTokensDetails, Usage)
from .streams import MergedOutputs
from .tools import (ToolCallFormat, forced_call_grammar, keeps_special_tokens, template_tools,
                    tool_choice_of)


class ChatRun:
    """One /v1/chat/completions request from validation to its last chunk."""

    def __init__(self, request: ChatCompletionRequest, engine: EngineClient, model_id: str,
                 config: OpenAIServerConfig, trace: dict[str, str] | None = None):
        """Checks the request and builds the engine inputs. Blocking (it renders and
        tokenizes): the app builds it off the event loop.

        Raises:
            InvalidRequestError / PromptTooLongError: the request cannot be served.
        """
        check_unsupported(request)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        self.request, self.model_id, self.request_id = request, model_id, request_id
        self.tokenizer = engine.tokenizer
        self.tool_choice = tool_choice_of(request.tools, request.tool_choice)
        self.tool_format = ToolCallFormat.of_template(engine.config.chat_template)
        structured = structured_output(request)
        forced = forced_call_grammar(request.tools, self.tool_choice, self.tool_format,
                                     request.parallel_tool_calls)
        check_structured(forced, "tools")
        if forced is not None and structured is not None:
            raise bad_request("A required or named tool_choice cannot be combined with another "
                              "output constraint.", "tool_choice")
        prompt = chat_prompt(request.messages, engine, request.add_generation_prompt,
                             tools=template_tools(request.tools),
                             template_kwargs=request.chat_template_kwargs)
        prompt_ids = prompt.token_ids
        if request.max_completion_tokens is not None:
            requested, param = request.max_completion_tokens, "max_completion_tokens"
        else:
            requested, param = request.max_tokens, "max_tokens"
        max_tokens = max_new_tokens(requested, param, len(prompt_ids), engine.max_model_len,
                                    default=None)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        self.params = sampling_params(request, max_tokens, logprobs, forced or structured)
        if keeps_special_tokens(self.tool_format, self.tool_choice):
            self.params = dataclasses.replace(self.params, skip_special_tokens=False)
        self.reasoning = reasoning_format(config.reasoning_parser, engine.config.chat_template)
        # a constraint applies from the first token, so what it writes is the answer
        self.in_reasoning = (self.reasoning is not None and self.params.structured is None
                             and self.reasoning.opens_in_reasoning(prompt.text))
        self.num_prompt_tokens = len(prompt_ids)
        timeout_s = request_timeout(request.timeout_s, config.request_timeout_s)
        self.outputs = MergedOutputs(engine, [prompt_ids], self.params, request_id,
                                     request.priority, timeout_s, trace_context=trace,
                                     final_only=not request.stream)
        self.num_generated = 0

    @property
    def uses_tools(self) -> bool:
        """Outputs are parsed for tool calls (tools given and tool_choice is not "none")."""
        return self.tool_choice != "none"

    def _reply_stream(self) -> ReplyStream | None:
        """A choice's parser, or None where the text is the content as it is."""
        if self.reasoning is None and not self.uses_tools:
            return None
        return ReplyStream(self.reasoning, self.in_reasoning,
                           self.tool_format if self.uses_tools else None)

    def _usage(self) -> Usage:
        return Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=self.num_generated,
                     total_tokens=self.num_prompt_tokens + self.num_generated,
                     prompt_tokens_details=PromptTokensDetails(
                         cached_tokens=self.outputs.num_cached_tokens))

    def _sequences(self) -> AsyncIterator:
        async def sequences():
            async for _, output in self.outputs:
                self.num_generated = max(output.num_generated_tokens, self.num_generated
                                         + sum(len(o.token_ids) for o in output.outputs))
                for seq in output.outputs:
                    yield seq
        return sequences()

    async def response(self) -> ChatCompletionResponse:
        """Collects every sequence into one response.

        Raises:
            DeadlineExceededError: the engine aborted a sequence at the request's deadline.
        """
        texts = [""] * self.params.n
        logprobs: list[ChatLogprobs | None] = [None] * self.params.n
        reasons: list[tuple[str | None, str | int | None]] = [(None, None)] * self.params.n
        async for seq in self._sequences():
            texts[seq.index] += seq.text
            if self.params.logprobs is not None:
                logprobs[seq.index] = logprobs[seq.index] or ChatLogprobs(content=[])
                logprobs[seq.index].content += chat_logprobs(self.tokenizer, seq.logprobs or [])
            if seq.finish_reason is not None:
                if self.outputs.deadline_passed(seq.finish_reason):
                    raise self.outputs.deadline_error()
                reasons[seq.index] = (seq.finish_reason.value, seq.stop_reason)
        choices = []
        for i in range(self.params.n):
            message, reason = AssistantMessage(content=texts[i]), reasons[i][0]
            stream = self._reply_stream()
            if stream is not None:
                reasoning, content, calls = parse_reply(texts[i], stream)
                message = AssistantMessage(
                    content=(content or None) if calls or reasoning else content,
                    reasoning_content=reasoning or None, tool_calls=calls or None)
                reason = "tool_calls" if calls and reason == "stop" else reason
            choices.append(ChatChoice(index=i, message=message, logprobs=logprobs[i],
                                      finish_reason=reason, stop_reason=reasons[i][1]))
        return ChatCompletionResponse(id=self.request_id, model=self.model_id, choices=choices,
                                      usage=self._usage())

    def _chunk(self, choice: ChatChunkChoice | None, usage: Usage | None = None) -> str:
        return sse(ChatCompletionChunk(id=self.request_id, model=self.model_id,
                                       choices=[choice] if choice else [], usage=usage))

    async def events(self) -> AsyncIterator[str]:
        """SSE events: a role chunk per choice, reasoning and content deltas, the usage chunk
        if asked, [DONE]. A deadline ends the affected choices with finish_reason "abort"."""
        options = self.request.stream_options
        per_chunk = options is not None and options.continuous_usage_stats
        for index in range(self.params.n):
            yield self._chunk(ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant",
                                                                              content="")))
        replies = [self._reply_stream() for _ in range(self.params.n)]
        async for seq in self._sequences():
            logprobs = None
            if self.params.logprobs is not None:
                logprobs = ChatLogprobs(content=chat_logprobs(self.tokenizer, seq.logprobs or []))
            reason = seq.finish_reason.value if seq.finish_reason is not None else None
            delta, reply = DeltaMessage(content=seq.text), replies[seq.index]
            if reply is not None:
                piece = reply.feed(seq.text, final=reason is not None)
                if reply.has_calls and reason == "stop":
                    reason = "tool_calls"
                if not (piece or reason or logprobs):
                    continue  # held back: it may be the start of a tag or a call
                delta = DeltaMessage(content=piece.content or None,
                                     reasoning_content=piece.reasoning or None,
                                     tool_calls=piece.calls or None)
            choice = ChatChunkChoice(index=seq.index, delta=delta,
                                     logprobs=logprobs, finish_reason=reason,
                                     stop_reason=seq.stop_reason)
            yield self._chunk(choice, self._usage() if per_chunk else None)
        if options is not None and options.include_usage:
            yield self._chunk(None, self._usage())
        yield SSE_DONE
