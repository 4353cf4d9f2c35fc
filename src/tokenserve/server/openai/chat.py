"""POST /v1/chat/completions: messages through the chat template, then the engine."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from tokenserve.engine.guided import check_structured
from tokenserve.engine.protocol import EngineClient

from .chat_template import render_chat
from .config import OpenAIServerConfig
from .formatting import SSE_DONE, chat_logprobs, sse
from .params import (bad_request, check_prompt_chars, check_unsupported, encode_text,
                     max_new_tokens, request_timeout, sampling_params,
                     structured_output)
from .schemas import (CHAT_ROLES, AssistantMessage, ChatChoice, ChatChunkChoice,
                      ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                      ChatLogprobs, ChatMessage, DeltaMessage, PromptTokensDetails, Usage)
from .streams import MergedOutputs
from .tools import (ToolCallFormat, ToolCallStream, forced_call_grammar, parse_tool_calls,
                    template_tools, tool_choice_of)


def message_text(message: ChatMessage, param: str) -> str:
    """The text of one message, refusing roles and content parts that are not served.

    Raises:
        InvalidRequestError: naming the message field.
    """
    if message.role not in CHAT_ROLES:
        raise bad_request(f"{param}.role: role '{message.role}' is not supported; use one of "
                          f"{', '.join(CHAT_ROLES)}.",
                          f"{param}.role", "unsupported_parameter")
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        text = message.content
    else:
        for j, part in enumerate(message.content):
            if part.type != "text":
                raise bad_request(f"{param}.content.{j}: content of type '{part.type}' is not "
                                  f"supported; this server takes text only.",
                                  f"{param}.content.{j}", "unsupported_parameter")
            if part.text is None:
                raise bad_request(f"{param}.content.{j}.text: a content part of type 'text' "
                                  f"needs a 'text' string.", f"{param}.content.{j}.text",
                                  "invalid_type")
        text = "".join(part.text for part in message.content)
    return text


def _template_message(message: ChatMessage, text: str) -> dict:
    """A message as HF chat templates take it: tool calls with their arguments parsed."""
    plain = {"role": message.role, "content": text}
    if message.name:
        plain["name"] = message.name
    if message.tool_call_id is not None:
        plain["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            try:
                arguments = json.loads(call.function.arguments)
            except (ValueError, RecursionError):  # not JSON (or an int over 4,300 digits,
                arguments = call.function.arguments  # or nested too deeply): the text
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": arguments}})
        plain["tool_calls"] = calls
    return plain


def chat_prompt_ids(messages: list[ChatMessage], engine: EngineClient,
                    add_generation_prompt: bool = True, check_length: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
    """Renders `messages` with the model's chat template (or the default) and tokenizes it.
    Blocking: servers call it off their event loop.

    Args:
        check_length: refuse a rendered prompt with more characters than the context can
            hold before tokenizing it (off for /tokenize, which counts any text).

    Raises:
        InvalidRequestError: bad text in a message, or the template refuses the messages.
        PromptTooLongError: the rendered prompt cannot fit the context (`check_length`).
    """
    plain = [_template_message(message, message_text(message, f"messages.{i}"))
             for i, message in enumerate(messages)]
    tokenizer = engine.tokenizer
    prompt = render_chat(engine.config.chat_template, plain,
                         add_generation_prompt=add_generation_prompt,
                         bos_token=tokenizer.decode([engine.config.bos_token_id],
                                                    skip_special_tokens=False),
                         eos_token=tokenizer.decode([engine.config.eos_token_id],
                                                    skip_special_tokens=False),
                         tools=tools)
    if check_length:
        check_prompt_chars(prompt, tokenizer, engine.max_model_len, "messages")
    ids = encode_text(tokenizer, prompt)
    if not ids:
        raise bad_request("messages render to an empty prompt.", "messages", "empty_prompt")
    return ids


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
        prompt_ids = chat_prompt_ids(request.messages, engine, request.add_generation_prompt,
                                     tools=template_tools(request.tools))
        if request.max_completion_tokens is not None:
            requested, param = request.max_completion_tokens, "max_completion_tokens"
        else:
            requested, param = request.max_tokens, "max_tokens"
        max_tokens = max_new_tokens(requested, param, len(prompt_ids), engine.max_model_len,
                                    default=None)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        self.params = sampling_params(request, max_tokens, logprobs, forced or structured)
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
            if self.uses_tools:
                content, calls = parse_tool_calls(texts[i], self.tool_format)
                message = AssistantMessage(content=content, tool_calls=calls or None)
                reason = "tool_calls" if calls and reason == "stop" else reason
            choices.append(ChatChoice(index=i, message=message, logprobs=logprobs[i],
                                      finish_reason=reason, stop_reason=reasons[i][1]))
        return ChatCompletionResponse(id=self.request_id, model=self.model_id, choices=choices,
                                      usage=self._usage())

    def _chunk(self, choice: ChatChunkChoice | None, usage: Usage | None = None) -> str:
        return sse(ChatCompletionChunk(id=self.request_id, model=self.model_id,
                                       choices=[choice] if choice else [], usage=usage))

    async def events(self) -> AsyncIterator[str]:
        """SSE events: a role chunk per choice, content deltas, the usage chunk if asked,
        [DONE]. A deadline ends the affected choices with finish_reason "abort"."""
        options = self.request.stream_options
        per_chunk = options is not None and options.continuous_usage_stats
        for index in range(self.params.n):
            yield self._chunk(ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant",
                                                                              content="")))
        parsers = [ToolCallStream(self.tool_format) for _ in range(self.params.n)]
        async for seq in self._sequences():
            logprobs = None
            if self.params.logprobs is not None:
                logprobs = ChatLogprobs(content=chat_logprobs(self.tokenizer, seq.logprobs or []))
            reason = seq.finish_reason.value if seq.finish_reason is not None else None
            delta = DeltaMessage(content=seq.text)
            if self.uses_tools:
                parser = parsers[seq.index]
                content, calls = parser.feed(seq.text)
                if reason is not None:
                    content += parser.finish()
                    if parser.calls and reason == "stop":
                        reason = "tool_calls"
                if not (content or calls or reason or logprobs):
                    continue  # held back: it may be the start of a call
                delta = DeltaMessage(content=content or None, tool_calls=calls or None)
            choice = ChatChunkChoice(index=seq.index, delta=delta,
                                     logprobs=logprobs, finish_reason=reason,
                                     stop_reason=seq.stop_reason)
            yield self._chunk(choice, self._usage() if per_chunk else None)
        if options is not None and options.include_usage:
            yield self._chunk(None, self._usage())
        yield SSE_DONE
