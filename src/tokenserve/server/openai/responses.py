"""The OpenAI Responses API: conversations kept on the server.

The routes are in routes_responses.py: POST /v1/responses (SSE with `stream: true`), GET and
DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items. A response made with `store: true` (the default) keeps
the whole conversation, so the next turn sends only its new input and
`previous_response_id`. The prompt of every turn is the chat template over the whole
conversation (this turn's `instructions` first; earlier instructions are not carried, as in
OpenAI's API), so the prefix cache skips the part an earlier turn computed. Ids are
random (192 bits); with API keys, a response is visible only to the key that created it,
and to any other key it does not exist (404).

Function tools go the way chat completions' do (tools.py): the template renders them,
calls are parsed out of the text as it streams and become function_call output items, and
"required" or a named tool_choice constrains decoding to valid calls. The client's results
come back as function_call_output input items, which become tool messages.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import AsyncIterator

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from tokenserve.engine.guided import check_structured
from tokenserve.engine.outputs import FinishReason
from tokenserve.engine.protocol import EngineClient
from tokenserve.errors import ModelNotFoundError, PromptTooLongError
from tokenserve.sampling import GuideKind, SamplingParams, StructuredOutput

from .chat import chat_prompt_ids
from .config import OpenAIServerConfig
from .formatting import chat_logprobs
from .http import validated
from .params import JSON_OBJECT_SCHEMA, bad_request, max_new_tokens, request_timeout
from .responses_schemas import (INPUT_ITEMS, INPUT_ROLES, FunctionCallInput,
                                FunctionCallOutputInput, FunctionToolChoice, InputItemList,
                                InputTokensDetails, OutputFunctionCall, OutputMessage,
                                OutputText, ResponseCreateRequest, ResponseObject,
                                ResponseUsage, TextFormat)
from .schemas import ChatMessage, FunctionDefinition, NamedFunction, NamedToolChoice, Tool
from .streams import MergedOutputs
from .tools import (ToolCallFormat, ToolCallStream, forced_call_grammar, template_tools,
                    tool_choice_of)


class ResponseNotFoundError(ModelNotFoundError):
    """A response id that does not exist, expired, or belongs to another API key (404)."""

    code = "not_found"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def key_owner(request: Request, config: OpenAIServerConfig) -> str:
    """A digest of the caller's API key ("" without API keys): what a response belongs to."""
    if not config.api_keys.enabled:
        return ""
    authorization = request.headers.get("authorization", "")
    return hashlib.sha256(authorization.removeprefix("Bearer ").strip().encode()).hexdigest()


def _text_parts(content, where: str) -> list[dict]:
    """A message's or a call output's content as text parts.

    Raises:
        InvalidRequestError: a part that is not text.
    """
    parts = ([{"type": "input_text", "text": content}] if isinstance(content, str) else
             [part.model_dump(exclude_none=True) for part in content])
    for j, part in enumerate(parts):
        if part["type"] not in ("input_text", "output_text", "text") or \
                not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.{j}: only text content is served.", f"{where}.{j}",
                              "unsupported_parameter")
    return parts


def _call_ids(messages: list[dict]) -> set[str]:
    return {call["id"] for m in messages for call in m.get("tool_calls") or ()}


def input_messages(body: ResponseCreateRequest, history: list[dict] = ()
                   ) -> tuple[list[dict], list[dict]]:
    """(chat messages, input items as the API lists them) of a request's `input`.

    Messages are plain dicts as chat templates take them: {"role", "content"}, with
    "tool_calls" on an assistant message (function_call items, consecutive ones merged into
    one message, as chat completions send them) and "tool_call_id" on a tool message
    (function_call_output). `history` is the stored conversation the input continues.

    Raises:
        InvalidRequestError: an item of a type not served, an unsupported role or content
            part, or a function_call_output whose call_id no call in the conversation has.
    """
    if isinstance(body.input, str):
        body_items = [{"role": "user", "content": body.input}]
    else:
        body_items = body.input
    messages, listed = [], []
    known_calls = _call_ids(history)
    for i, raw in enumerate(body_items):
        if not isinstance(raw, dict):
            raise bad_request(f"input.{i}: an input item must be an object.", f"input.{i}",
                              "invalid_type")
        kind = raw.get("type", "message")
        if kind not in INPUT_ITEMS:
            raise bad_request(f"input.{i}.type: input items of type '{kind}' are not served; "
                              f"use one of {', '.join(INPUT_ITEMS)}.", f"input.{i}.type",
                              "unsupported_parameter")
        item = validated(INPUT_ITEMS[kind], raw, f"input.{i}")
        if isinstance(item, FunctionCallInput):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            known_calls.add(item.call_id)
            listed.append({"id": item.id or new_id("fc"), "type": "function_call",
                           "call_id": item.call_id, "name": item.name,
                           "arguments": item.arguments, "status": "completed"})
            continue
        if isinstance(item, FunctionCallOutputInput):
            if item.call_id not in known_calls:
                raise bad_request(f"input.{i}.call_id: no function call with call_id "
                                  f"'{item.call_id}' in this conversation.",
                                  f"input.{i}.call_id")
            parts = _text_parts(item.output, f"input.{i}.output")
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": "".join(part["text"] for part in parts)})
            listed.append({"id": item.id or new_id("fco"), "type": "function_call_output",
                           "call_id": item.call_id, "output": item.output if isinstance(
                               item.output, str) else parts, "status": "completed"})
            continue
        if item.role not in INPUT_ROLES:
            raise bad_request(f"input.{i}.role: role '{item.role}' is not supported; use "
                              f"one of {', '.join(INPUT_ROLES)}.", f"input.{i}.role")
        parts = _text_parts(item.content, f"input.{i}.content")
        messages.append({"role": "system" if item.role == "developer" else item.role,
                         "content": "".join(part["text"] for part in parts)})
        listed.append({"id": new_id("msg"), "type": "message", "status": "completed",
                       "role": item.role, "content": parts})
    return messages, listed


LOGPROBS_INCLUDE = "message.output_text.logprobs"
# include values served: the logprobs, and those that only add what a served response holds
# anyway or name tools that run on OpenAI's side (so there is nothing of theirs to include)
_SERVED_INCLUDES = {LOGPROBS_INCLUDE, "reasoning.encrypted_content", "file_search_call.results",
                    "web_search_call.results", "web_search_call.action.sources",
                    "message.input_image.image_url", "computer_call_output.output.image_url",
                    "code_interpreter_call.outputs"}


def drop_oldest_turn(conversation: list[dict]) -> list[dict]:
    """The conversation without its oldest turn (truncation "auto"): the first message, then
    every message before the next user message, so that no tool result is left without its
    call and the templates that want turns to alternate still get a user message first. The
    last message always stays."""
    kept = conversation[1:]
    while len(kept) > 1 and kept[0]["role"] != "user":
        kept = kept[1:]
    return kept


def check_unsupported(body: ResponseCreateRequest) -> None:
    """Refuses fields that would change the answer and are not served here.

    Raises:
        InvalidRequestError: naming the first such field (code unsupported_parameter).
    """
    refused = [("conversation", body.conversation is not None,
                "Conversations are not served; continue with previous_response_id."),
               ("prompt", body.prompt is not None, "Stored prompt templates are not served."),
               ("background", bool(body.background), "Background mode is not served."),
               ("max_tool_calls", body.max_tool_calls is not None,
                "max_tool_calls is not served; parallel_tool_calls: false allows one call.")]
    for name, is_set, why in refused:
        if is_set:
            raise bad_request(f"'{name}' is not supported by this server. {why}", name,
                              "unsupported_parameter")
    for i, value in enumerate(body.include or ()):
        if value not in _SERVED_INCLUDES:
            raise bad_request(f"include.{i}: '{value}' is not supported by this server.",
                              f"include.{i}", "unsupported_parameter")


def text_format(body: ResponseCreateRequest) -> StructuredOutput | None:
    """The output constraint of text.format (json_object or json_schema), checked.

    Raises:
        InvalidRequestError: a json_schema format without a name or a schema, or a schema
            the guide cannot take.
    """
    spec = body.text.format if body.text is not None else None
    if spec is None or spec.type == "text":
        return None
    if spec.type == "json_object":
        structured, param = StructuredOutput(GuideKind.JSON_SCHEMA, JSON_OBJECT_SCHEMA), \
            "text.format"
    else:
        for field, value in (("name", spec.name), ("schema", spec.schema_)):
            if value is None:
                raise bad_request(f"text.format.{field}: a format of type 'json_schema' needs "
                                  f"a '{field}'.", f"text.format.{field}", "invalid_type")
        structured, param = StructuredOutput(GuideKind.JSON_SCHEMA,
                                             json.dumps(spec.schema_)), "text.format.schema"
    check_structured(structured, param)
    return structured


def chat_tools(body: ResponseCreateRequest) -> tuple[list[Tool] | None, object]:
    """The request's function tools and tool_choice in chat completions' shape (tools.py
    takes that one)."""
    tools = None if body.tools is None else [
        Tool(type="function", function=FunctionDefinition(
            name=t.name, description=t.description, parameters=t.parameters, strict=t.strict))
        for t in body.tools]
    choice = body.tool_choice
    if isinstance(choice, FunctionToolChoice):
        choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    return tools, choice


class ResponseRun:
    """One POST /v1/responses from validation to its stored result.

    Output items come in the order the model wrote them: a message with its text, then one
    function_call item per call (tools.py finds calls in the text as it streams; text after
    the calls is dropped, as in chat completions). A response with calls and no text has only
    the calls; one with neither, one empty message."""

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
        self.history = list(previous.conversation) if previous is not None else []
        self.new_messages, self.input_items = input_messages(body, self.history)
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
        self.tokenizer = engine.tokenizer
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        conversation = self.history + self.new_messages
        while True:
            messages = [ChatMessage.model_validate(m) for m in system + conversation]
            try:
                self.prompt_ids = chat_prompt_ids(messages, engine,
                                                  tools=template_tools(tools))
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
            logprobs=(body.top_logprobs or 0) if wants_logprobs else None)
        timeout_s = request_timeout(None, config.request_timeout_s)
        self.outputs = MergedOutputs(engine, [self.prompt_ids], self.params, self.response_id,
                                     timeout_s=timeout_s, trace_context=trace,
                                     final_only=not body.stream)
        self.created_at = time.time()
        self.output_ids, self.finish_reason = [], None
        self.content = ""  # the message's text: what the model wrote outside calls
        self.logprobs: list[dict] = []  # the message's tokens', with logprobs asked for
        self._pending: list[dict] = []  # logprobs of tokens whose text is not out yet
        self.calls: list[dict] = []  # {"id", "call_id", "name", "arguments"} as written
        self.parser = ToolCallStream(tool_format) if self.tool_choice != "none" else None

    @property
    def has_message(self) -> bool:
        return bool(self.content) or not self.calls

    def _message(self, status: str) -> OutputMessage:
        return OutputMessage(id=self.message_id, status=status,
                             content=[OutputText(text=self.content, logprobs=self.logprobs)])

    def _call(self, index: int, status: str = "completed") -> OutputFunctionCall:
        return OutputFunctionCall(status=status, **self.calls[index])

    def _echoed_tool_choice(self) -> str | dict:
        if isinstance(self.tool_choice, NamedToolChoice):
            return {"type": "function", "name": self.tool_choice.function.name}
        return self.tool_choice

    def _response(self, status: str) -> ResponseObject:
        done = status != "in_progress"
        output = []
        if done:
            # a call cut off by max_output_tokens is incomplete; the message before it is not
            cut = status == "incomplete" and self.parser is not None and self.calls \
                and not self.parser.calls[-1]["done"]
            if self.has_message:
                output.append(self._message("completed" if self.calls or status == "completed"
                                            else "incomplete"))
            output += [self._call(i, "incomplete" if cut and i == len(self.calls) - 1
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

    def _take_logprobs(self) -> list[dict]:
        taken, self._pending = self._pending, []
        self.logprobs += taken
        return taken

    async def _pieces(self) -> AsyncIterator[tuple[str, int, str]]:
        """The output as it streams: ("text", 0, delta) for the message and ("call", index,
        arguments delta) for call `index`, whose first piece opens it (self.calls grows)."""
        async for delta in self._deltas():
            for piece in self._split(delta):
                yield piece
        for piece in self._split(None):  # what the parser held back, at the end
            yield piece

    def _split(self, delta: str | None) -> list[tuple[str, int, str]]:
        if self.parser is None:
            content, calls = delta or "", []
        elif delta is None:
            content, calls = self.parser.finish(), []
        else:
            content, calls = self.parser.feed(delta)
        self.content += content
        if self.parser is None and delta is None:  # the last tokens' logprobs, text or not
            self._take_logprobs()
        pieces = [("text", 0, content)] if content else []
        for call in calls:
            if call.id is not None:
                self.calls.append({"id": new_id("fc"), "call_id": call.id,
                                   "name": call.function.name, "arguments": ""})
            arguments = call.function.arguments or ""
            self.calls[call.index]["arguments"] += arguments
            pieces.append(("call", call.index, arguments))
        return pieces

    def _final(self) -> ResponseObject:
        return self._response("incomplete" if self.finish_reason is FinishReason.LENGTH
                              else "completed")

    def stored(self, response: ResponseObject):
        from tokenserve.state.response_store import StoredResponse

        reply = {"role": "assistant", "content": self.content}
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
        async for _ in self._pieces():
            pass
        return self._final()

    async def events(self, save) -> AsyncIterator[str]:
        """The typed SSE events of a streamed response, as OpenAI sends them: each output
        item added, its deltas, its done events, then the next item."""
        number = iter(range(1 << 62))

        def event(kind: str, **fields) -> str:
            data = {"type": kind, "sequence_number": next(number), **fields}
            return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

        message_place = {"item_id": self.message_id, "output_index": 0, "content_index": 0}

        def open_message() -> list[str]:
            item = {"id": self.message_id, "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            return [event("response.output_item.added", output_index=0, item=item),
                    event("response.content_part.added", part=part, **message_place)]

        def close_message(status: str) -> list[str]:
            message = self._message(status).model_dump()
            return [event("response.output_text.done", text=self.content,
                          logprobs=self.logprobs, **message_place),
                    event("response.content_part.done", part=message["content"][0],
                          **message_place),
                    event("response.output_item.done", output_index=0, item=message)]

        def close_call(index: int, status: str = "completed") -> list[str]:
            item = self._call(index, status).model_dump()
            place = {"item_id": item["id"], "output_index": index + bool(self.content)}
            return [event("response.function_call_arguments.done",
                          arguments=item["arguments"], name=item["name"], **place),
                    event("response.output_item.done", output_index=place["output_index"],
                          item=item)]

        started = self._response("in_progress").model_dump()
        yield event("response.created", response=started)
        yield event("response.in_progress", response=started)
        opened = None  # the open item: "message" or a call's index
        async for kind, index, delta in self._pieces():
            if kind == "text":
                if opened is None:
                    opened = "message"
                    for text in open_message():
                        yield text
                yield event("response.output_text.delta", delta=delta,
                            logprobs=self._take_logprobs(), **message_place)
                continue
            if opened != index:  # a call begins: the item before it is complete
                for text in (close_message("completed") if opened == "message" else
                             close_call(opened) if opened is not None else []):
                    yield text
                opened = index
                # the call as it opens: its arguments come in the deltas (the first one
                # already in self.calls)
                item = {**self._call(index, "in_progress").model_dump(), "arguments": ""}
                yield event("response.output_item.added",
                            output_index=index + bool(self.content), item=item)
            if delta:
                yield event("response.function_call_arguments.delta", delta=delta,
                            item_id=self.calls[index]["id"],
                            output_index=index + bool(self.content))
        final = self._final()
        if opened is None:  # no text and no call: one empty message
            for text in open_message():
                yield text
            opened = "message"
        statuses = {item.id: item.status for item in final.output}
        last = close_message(statuses[self.message_id]) if opened == "message" else \
            close_call(opened, statuses[self.calls[opened]["id"]])
        for text in last:
            yield text
        await save(final)
        kind = "response.completed" if final.status == "completed" else "response.incomplete"
        yield event(kind, response=final.model_dump())


async def owned_response(store, request: Request, config: OpenAIServerConfig,
                         response_id: str, param: str | None = None):
    """The stored response `response_id` if the caller's key owns it.

    Raises:
        ResponseNotFoundError: it does not exist, expired, or belongs to another key (404,
            naming `param`, e.g. previous_response_id, when given).
    """
    stored = await run_in_threadpool(store.get, response_id)
    if stored is None or stored.owner != key_owner(request, config):
        what = "Previous response" if param else "Response"
        raise ResponseNotFoundError(f"{what} with id '{response_id}' not found. It may "
                                    f"have expired, been deleted, or never been stored.",
                                    param)
    return stored


def input_items_page(items: list[dict], order: str, limit: int,
                     after: str | None) -> InputItemList:
    """One page of a stored response's input items, OpenAI's way (newest first by default).

    Raises:
        InvalidRequestError: an order other than asc/desc, or a limit outside 1..100.
    """
    if order not in ("asc", "desc") or not 1 <= limit <= 100:
        raise bad_request("order must be 'asc' or 'desc' and limit 1..100.", "order")
    items = list(items)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:limit]
    return InputItemList(data=page, first_id=page[0]["id"] if page else None,
                         last_id=page[-1]["id"] if page else None, has_more=len(items) > limit)
