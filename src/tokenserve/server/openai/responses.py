"""The OpenAI Responses API: conversations kept on the server.

The routes are in routes_responses.py: POST /v1/responses (SSE with `stream: true`), GET and
DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items. A response made with
`store: true` (the default) keeps the whole conversation, so the next turn sends only its new
input and `previous_response_id`. The prompt of every turn is the chat template over the whole
conversation (this turn's `instructions` first; earlier instructions are not carried, as in
OpenAI's API), so the prefix cache skips the part an earlier turn computed. Ids are
random (192 bits); with API keys, a response is visible only to the key that created it,
and to any other key it does not exist (404: responses_stored.py).

Function tools go the way chat completions' do (tools.py): the template renders them,
calls are parsed out of the text as it streams and become function_call output items, and
"required" or a named tool_choice constrains decoding to valid calls. The client's results
come back as function_call_output input items, which become tool messages.

Here: `ResponseRun`, one request from its input to its output items. Beside it:
responses_input.py (input items to chat messages), responses_options.py (the request's
options checked), responses_events.py (the streamed events), responses_stored.py (stored
responses by owner).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from tokenserve.engine.guided import check_structured
from tokenserve.engine.outputs import FinishReason
from tokenserve.engine.protocol import EngineClient
from tokenserve.errors import PromptTooLongError
from tokenserve.sampling import SamplingParams

from .chat_prompt import chat_prompt
from .config import OpenAIServerConfig
from .formatting import chat_logprobs
from .params import bad_request, max_new_tokens, request_timeout
from .reasoning import reasoning_format
from .reply_stream import ReplyStream
from .responses_events import response_events
from .responses_input import drop_oldest_turn, input_messages, new_id
from .responses_options import LOGPROBS_INCLUDE, chat_tools, check_unsupported, text_format
from .responses_schemas import (InputTokensDetails, OutputFunctionCall, OutputMessage,
                                OutputReasoning, OutputText, ReasoningText,
                                ResponseCreateRequest, ResponseObject, ResponseUsage,
                                TextFormat)
from .schemas import ChatMessage, NamedToolChoice
from .streams import MergedOutputs
from .tools import (ToolCallFormat, forced_call_grammar, keeps_special_tokens, template_tools,
                    tool_choice_of)


class ResponseRun:
    """One POST /v1/responses from validation to its stored result.

    Output items come in the order the model wrote them: a thinking model's reasoning item,
    a message with its text, then one function_call item per call (reply_stream.py finds
    them in the text as it streams; text after the calls is dropped, as in chat
    completions). A response with reasoning or calls and no text has no message; one with
    none of them, one empty message."""

    def __init__(self, body: ResponseCreateRequest, engine: EngineClient, model_id: str,
                 config: OpenAIServerConfig, previous, owner: str,
                 trace: dict[str, str] | None = None):
        """Builds the prompt from the stored conversation and the new input. Blocking.

        Raises:
            InvalidRequestError / PromptTooLongError: the request cannot be served.
        """
        check_unsupported(body)
        self.body, self.model_id, self.owner = body, model_id, owner
        self.response_id, self.message_id = new_id("resp"), new_id("msg")
        self.reasoning_id = new_id("rs")
        self.history = list(previous.conversation) if previous is not None else []
        thinking = reasoning_format(config.reasoning_parser, engine.config.chat_template)
        self.new_messages, self.input_items = input_messages(body, self.history,
                                                             thinking is not None)
        tools, choice = chat_tools(body)
        self.tool_choice = tool_choice_of(tools, choice)
        tool_format = ToolCallFormat.of_template(engine.config.chat_template)
        forced = forced_call_grammar(tools, self.tool_choice, tool_format,
                                     body.parallel_tool_calls)
        check_structured(forced, "tools")
        structured = text_format(body)
        if forced is not None and structured is not None:
            raise bad_request("A required or named tool_choice cannot be combined with a "
                              "text.format constraint.", "tool_choice")
        wants_logprobs = LOGPROBS_INCLUDE in (body.include or ()) or bool(body.top_logprobs)
        if wants_logprobs and self.tool_choice != "none":
            raise bad_request("Logprobs together with tools are not served: the text the calls "
                              "are parsed from is not the message's.", "include",
                              "unsupported_parameter")
        if wants_logprobs and thinking is not None:
            raise bad_request("Logprobs are not served for a model whose replies carry "
                              "reasoning: the message's text is not the whole output.",
                              "include", "unsupported_parameter")
        self.tokenizer = engine.tokenizer
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        conversation = self.history + self.new_messages
        while True:
            messages = [ChatMessage.model_validate(m) for m in system + conversation]
            try:
                prompt = chat_prompt(messages, engine, tools=template_tools(tools))
                self.prompt_ids = prompt.token_ids
                max_tokens = max_new_tokens(body.max_output_tokens, "max_output_tokens",
                                            len(self.prompt_ids), engine.max_model_len,
                                            default=None)
                break
            except PromptTooLongError:
                if body.truncation != "auto" or len(conversation) < 2:
                    raise
                conversation = drop_oldest_turn(conversation)
        self.params = SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if body.temperature is None
            else body.temperature, top_p=1.0 if body.top_p is None else body.top_p,
            structured=forced or structured,
            logprobs=(body.top_logprobs or 0) if wants_logprobs else None,
            skip_special_tokens=not keeps_special_tokens(tool_format, self.tool_choice))
        timeout_s = request_timeout(None, config.request_timeout_s)
        self.outputs = MergedOutputs(engine, [self.prompt_ids], self.params, self.response_id,
                                     timeout_s=timeout_s, trace_context=trace,
                                     final_only=not body.stream)
        self.created_at = time.time()
        self.output_ids, self.finish_reason = [], None
        self.reasoning = ""  # the reasoning item's text: the think block's
        self.content = ""  # the message's text: what the model wrote outside calls
        self.logprobs: list[dict] = []  # the message's tokens', with logprobs asked for
        self._pending: list[dict] = []  # logprobs of tokens whose text is not out yet
        self.calls: list[dict] = []  # {"id", "call_id", "name", "arguments"} as written
        self.reply = None  # the text is the message's as it is
        if thinking is not None or self.tool_choice != "none":
            # a constraint applies from the first token, so what it writes is the answer
            in_reasoning = (thinking is not None and self.params.structured is None
                            and thinking.opens_in_reasoning(prompt.text))
            self.reply = ReplyStream(thinking, in_reasoning,
                                     tool_format if self.tool_choice != "none" else None)

    @property
    def has_message(self) -> bool:
        return bool(self.content) or not (self.calls or self.reasoning)

    def reasoning_item(self, status: str) -> OutputReasoning:
        return OutputReasoning(id=self.reasoning_id, status=status,
                               content=[ReasoningText(text=self.reasoning)])

    def message_item(self, status: str) -> OutputMessage:
        return OutputMessage(id=self.message_id, status=status,
                             content=[OutputText(text=self.content, logprobs=self.logprobs)])

    def call_item(self, index: int, status: str = "completed") -> OutputFunctionCall:
        return OutputFunctionCall(status=status, **self.calls[index])

    def _echoed_tool_choice(self) -> str | dict:
        if isinstance(self.tool_choice, NamedToolChoice):
            return {"type": "function", "name": self.tool_choice.function.name}
        return self.tool_choice

    def response_object(self, status: str) -> ResponseObject:
        done = status != "in_progress"
        output = []
        if done:
            # the item max_output_tokens cut off is incomplete; those before it are not
            cut = status == "incomplete" and self.calls \
                and not self.reply.tools.calls[-1]["done"]
            if self.reasoning:
                output.append(self.reasoning_item(
                    "incomplete" if status == "incomplete" and not (self.content or self.calls)
                    else "completed"))
            if self.has_message:
                output.append(self.message_item(
                    "completed" if self.calls or status == "completed" else "incomplete"))
            output += [self.call_item(i, "incomplete" if cut and i == len(self.calls) - 1
                                      else "completed") for i in range(len(self.calls))]
        body = self.body
        return ResponseObject(
            id=self.response_id, created_at=self.created_at, status=status, model=self.model_id,
            output=output, instructions=body.instructions,
            previous_response_id=body.previous_response_id,
            max_output_tokens=body.max_output_tokens, temperature=self.params.temperature,
            top_p=self.params.top_p, store=body.store, metadata=body.metadata or {},
            incomplete_details={"reason": "max_output_tokens"} if status == "incomplete"
            else None, parallel_tool_calls=body.parallel_tool_calls,
            tool_choice=self._echoed_tool_choice(),
            tools=[tool.model_dump() for tool in body.tools or ()],
            text={"format": (body.text.format if body.text is not None else TextFormat(
                type="text")).model_dump(by_alias=True, exclude_none=True)},
            truncation=body.truncation or "disabled",
            usage=ResponseUsage(input_tokens=len(self.prompt_ids),
                                input_tokens_details=InputTokensDetails(
                                    cached_tokens=self.outputs.num_cached_tokens),
                                output_tokens=len(self.output_ids),
                                total_tokens=len(self.prompt_ids) + len(self.output_ids))
            if done else None)

    async def _deltas(self) -> AsyncIterator[str]:
        """Text deltas of the one sequence; records its tokens, their logprobs (held in
        _pending until text comes out with them) and its finish reason."""
        async for _, output in self.outputs:
            for seq in output.outputs:
                self.output_ids += seq.token_ids
                if seq.logprobs:
                    self._pending += [entry.model_dump() for entry in
                                      chat_logprobs(self.tokenizer, seq.logprobs)]
                if seq.finish_reason is not None:
                    if self.outputs.deadline_passed(seq.finish_reason):
                        raise self.outputs.deadline_error()
                    self.finish_reason = seq.finish_reason
                if seq.text:
                    yield seq.text

    def take_logprobs(self) -> list[dict]:
        taken, self._pending = self._pending, []
        self.logprobs += taken
        return taken

    async def pieces(self) -> AsyncIterator[tuple[str, int, str]]:
        """The output as it streams: ("reasoning", 0, delta) for the reasoning item, ("text",
        0, delta) for the message and ("call", index, arguments delta) for call `index`, whose
        first piece opens it (self.calls grows)."""
        async for delta in self._deltas():
            for piece in self._split(delta):
                yield piece
        for piece in self._split(None):  # what the parser held back, at the end
            yield piece

    def _split(self, delta: str | None) -> list[tuple[str, int, str]]:
        """The pieces of a text delta (None: the end of the text)."""
        if self.reply is None:
            reasoning, content, calls = "", delta or "", []
        else:
            piece = self.reply.feed(delta or "", final=delta is None)
            reasoning, content, calls = piece.reasoning, piece.content, piece.calls
        self.reasoning += reasoning
        self.content += content
        if self.reply is None and delta is None:  # the last tokens' logprobs, text or not
            self.take_logprobs()
        pieces = [("reasoning", 0, reasoning)] if reasoning else []
        pieces += [("text", 0, content)] if content else []
        for call in calls:
            if call.id is not None:
                self.calls.append({"id": new_id("fc"), "call_id": call.id,
                                   "name": call.function.name, "arguments": ""})
            arguments = call.function.arguments or ""
            self.calls[call.index]["arguments"] += arguments
            pieces.append(("call", call.index, arguments))
        return pieces

    def final(self) -> ResponseObject:
        return self.response_object("incomplete" if self.finish_reason is FinishReason.LENGTH
                                    else "completed")

    def stored(self, response: ResponseObject):
        from tokenserve.state.response_store import StoredResponse

        reply = {"role": "assistant", "content": self.content}
        if self.reasoning:  # for templates that show the thinking of a turn's tool calls
            reply["reasoning_content"] = self.reasoning
        if self.calls:
            reply["tool_calls"] = [{"id": call["call_id"], "type": "function",
                                    "function": {"name": call["name"],
                                                 "arguments": call["arguments"]}}
                                   for call in self.calls]
        return StoredResponse(id=self.response_id, owner=self.owner,
                              response=response.model_dump(), input_items=self.input_items,
                              conversation=self.history + self.new_messages + [reply],
                              token_ids=self.prompt_ids + self.output_ids)

    async def response(self) -> ResponseObject:
        async for _ in self.pieces():
            pass
        return self.final()

    def events(self, save) -> AsyncIterator[str]:
        """The typed SSE events of this response streamed (responses_events.py)."""
        return response_events(self, save)
