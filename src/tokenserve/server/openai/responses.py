"""The OpenAI Responses API: conversations kept on the server.

The routes are in routes_responses.py: POST /v1/responses (SSE with `stream: true`), GET and
DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items. A response made with `store: true` (the default) keeps
the whole conversation, so the next turn sends only its new input and
`previous_response_id`. The prompt of every turn is the chat template over the whole
conversation (this turn's `instructions` first; earlier instructions are not carried, as in
OpenAI's API), so the prefix cache skips the part an earlier turn computed. Ids are
random (192 bits); with API keys, a response is visible only to the key that created it,
and to any other key it does not exist (404).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import AsyncIterator

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from tokenserve.engine.outputs import FinishReason
from tokenserve.engine.protocol import EngineClient
from tokenserve.errors import ModelNotFoundError
from tokenserve.sampling import SamplingParams

from .chat import chat_prompt_ids
from .config import OpenAIServerConfig
from .params import bad_request, max_new_tokens, request_timeout
from .responses_schemas import (INPUT_ROLES, InputItemList, InputTokensDetails, OutputMessage,
                                OutputText, ResponseCreateRequest, ResponseObject,
                                ResponseUsage)
from .schemas import ChatMessage
from .streams import MergedOutputs


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


def input_messages(body: ResponseCreateRequest) -> tuple[list[dict], list[dict]]:
    """(plain messages, input items as the API lists them) of a request's `input`.

    Raises:
        InvalidRequestError: an unsupported role or content part.
    """
    if isinstance(body.input, str):
        items = [{"role": "user", "content": [{"type": "input_text", "text": body.input}]}]
    else:
        items = []
        for i, item in enumerate(body.input):
            if item.role not in INPUT_ROLES:
                raise bad_request(f"input.{i}.role: role '{item.role}' is not supported; use "
                                  f"one of {', '.join(INPUT_ROLES)}.", f"input.{i}.role")
            parts = ([{"type": "input_text", "text": item.content}]
                     if isinstance(item.content, str) else
                     [part.model_dump(exclude_none=True) for part in item.content])
            for j, part in enumerate(parts):
                if part["type"] not in ("input_text", "output_text", "text") or \
                        not isinstance(part.get("text"), str):
                    raise bad_request(f"input.{i}.content.{j}: only text content is served.",
                                      f"input.{i}.content.{j}", "unsupported_parameter")
            items.append({"role": item.role, "content": parts})
    messages = [{"role": "system" if item["role"] == "developer" else item["role"],
                 "content": "".join(part["text"] for part in item["content"])}
                for item in items]
    listed = [{"id": new_id("msg"), "type": "message", "status": "completed", **item}
              for item in items]
    return messages, listed


class ResponseRun:
    """One POST /v1/responses from validation to its stored result."""

    def __init__(self, body: ResponseCreateRequest, engine: EngineClient, model_id: str,
                 config: OpenAIServerConfig, previous, owner: str,
                 trace: dict[str, str] | None = None):
        """Builds the prompt from the stored conversation and the new input. Blocking.

        Raises:
            InvalidRequestError / PromptTooLongError: the request cannot be served.
        """
        self.body, self.model_id, self.owner = body, model_id, owner
        self.response_id, self.message_id = new_id("resp"), new_id("msg")
        self.history = list(previous.conversation) if previous is not None else []
        self.new_messages, self.input_items = input_messages(body)
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        messages = [ChatMessage(role=m["role"], content=m["content"])
                    for m in system + self.history + self.new_messages]
        self.prompt_ids = chat_prompt_ids(messages, engine)
        max_tokens = max_new_tokens(body.max_output_tokens, "max_output_tokens",
                                    len(self.prompt_ids), engine.max_model_len, default=None)
        self.params = SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if body.temperature is None
            else body.temperature, top_p=1.0 if body.top_p is None else body.top_p)
        timeout_s = request_timeout(None, config.request_timeout_s)
        self.outputs = MergedOutputs(engine, [self.prompt_ids], self.params, self.response_id,
                                     timeout_s=timeout_s, trace_context=trace,
                                     final_only=not body.stream)
        self.created_at = time.time()
        self.text, self.output_ids, self.finish_reason = "", [], None

    def _response(self, status: str) -> ResponseObject:
        done = status != "in_progress"
        message_status = {"completed": "completed", "incomplete": "incomplete"}.get(
            status, "in_progress")
        output = [OutputMessage(id=self.message_id, status=message_status,
                                content=[OutputText(text=self.text)])] if done else []
        body = self.body
        return ResponseObject(
            id=self.response_id, created_at=self.created_at, status=status, model=self.model_id,
            output=output, instructions=body.instructions,
            previous_response_id=body.previous_response_id,
            max_output_tokens=body.max_output_tokens, temperature=self.params.temperature,
            top_p=self.params.top_p, store=body.store, metadata=body.metadata or {},
            incomplete_details={"reason": "max_output_tokens"} if status == "incomplete"
            else None,
            usage=ResponseUsage(input_tokens=len(self.prompt_ids),
                                input_tokens_details=InputTokensDetails(
                                    cached_tokens=self.outputs.num_cached_tokens),
                                output_tokens=len(self.output_ids),
                                total_tokens=len(self.prompt_ids) + len(self.output_ids))
            if done else None)

    async def _deltas(self) -> AsyncIterator[str]:
        """Text deltas of the one sequence; records its tokens and finish reason."""
        async for _, output in self.outputs:
            for seq in output.outputs:
                self.output_ids += seq.token_ids
                self.text += seq.text
                if seq.finish_reason is not None:
                    if self.outputs.deadline_passed(seq.finish_reason):
                        raise self.outputs.deadline_error()
                    self.finish_reason = seq.finish_reason
                if seq.text:
                    yield seq.text

    def _final(self) -> ResponseObject:
        return self._response("incomplete" if self.finish_reason is FinishReason.LENGTH
                              else "completed")

    def stored(self, response: ResponseObject):
        from tokenserve.state.response_store import StoredResponse

        conversation = self.history + self.new_messages + [{"role": "assistant",
                                                            "content": self.text}]
        return StoredResponse(id=self.response_id, owner=self.owner,
                              response=response.model_dump(), input_items=self.input_items,
                              conversation=conversation,
                              token_ids=self.prompt_ids + self.output_ids)

    async def response(self) -> ResponseObject:
        async for _ in self._deltas():
            pass
        return self._final()

    async def events(self, save) -> AsyncIterator[str]:
        """The typed SSE events of a streamed response, as OpenAI sends them."""
        number = iter(range(1 << 62))

        def event(kind: str, **fields) -> str:
            data = {"type": kind, "sequence_number": next(number), **fields}
            return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

        started = self._response("in_progress").model_dump()
        yield event("response.created", response=started)
        yield event("response.in_progress", response=started)
        item = {"id": self.message_id, "type": "message", "role": "assistant",
                "status": "in_progress", "content": []}
        place = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        empty_part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        yield event("response.output_item.added", output_index=0, item=item)
        yield event("response.content_part.added", part=empty_part, **place)
        async for delta in self._deltas():
            yield event("response.output_text.delta", delta=delta, logprobs=[], **place)
        final = self._final()
        message = final.output[0].model_dump()
        yield event("response.output_text.done", text=self.text, logprobs=[], **place)
        yield event("response.content_part.done", part=message["content"][0], **place)
        yield event("response.output_item.done", output_index=0, item=message)
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
