"""The OpenAI Responses API: conversations kept on the server.

Routes: POST /v1/responses (SSE with `stream: true`), GET and DELETE /v1/responses/{id},
GET /v1/responses/{id}/input_items. A response made with `store: true` (the default) keeps
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

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from tokenserve.engine.outputs import FinishReason
from tokenserve.engine.protocol import EngineClient
from tokenserve.errors import ModelNotFoundError
from tokenserve.sampling import SamplingParams

from .chat import chat_prompt_ids
from .config import OpenAIServerConfig
from .http import EventStream, read_json, unless_disconnected, with_error_event
from .models import ModelResolver
from .openapi import request_body
from .openapi import responses as documented
from .params import bad_request, max_new_tokens, request_timeout
from .responses_schemas import (INPUT_ROLES, DeletedResponse, InputItemList,
                                InputTokensDetails, OutputMessage, OutputText,
                                ResponseCreateRequest, ResponseObject, ResponseUsage)
from .schemas import ChatMessage
from .streams import MergedOutputs, trace_context


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
                                     timeout_s=timeout_s, trace_context=trace)
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


def add_responses_routes(app: FastAPI, models: ModelResolver, config: OpenAIServerConfig,
                         store) -> None:
    """Registers the Responses API on `app`, keeping stored responses in `store`
    (tokenserve.state.response_store)."""
    router = APIRouter()

    async def owned(request: Request, response_id: str, param: str | None = None):
        stored = await run_in_threadpool(store.get, response_id)
        if stored is None or stored.owner != key_owner(request, config):
            what = "Previous response" if param else "Response"
            raise ResponseNotFoundError(f"{what} with id '{response_id}' not found. It may "
                                        f"have expired, been deleted, or never been stored.",
                                        param)
        return stored

    @router.post("/v1/responses", openapi_extra=request_body(ResponseCreateRequest),
                 responses=documented(ResponseObject, 400, 401, 404, 413, 415, 429, 503, 504,
                                      stream=True))
    async def create(request: Request) -> Response:
        body = await read_json(request, ResponseCreateRequest, config.max_body_bytes,
                               config.max_json_depth)
        if body.tools:
            raise bad_request("tools are not served by this server.", "tools",
                              "unsupported_parameter")
        owner = key_owner(request, config)
        previous = None
        if body.previous_response_id is not None:
            previous = await owned(request, body.previous_response_id, "previous_response_id")
        model_id = body.model or models.default_model()
        request.state.model = model_id
        held = models.acquire(model_id)
        engine = held.__enter__()
        try:
            run = await run_in_threadpool(ResponseRun, body, engine, model_id, config,
                                          previous, owner, trace_context(request.headers))
            await unless_disconnected(request, run.outputs.start())
        except BaseException as error:
            held.__exit__(type(error), error, error.__traceback__)
            raise

        async def save(final: ResponseObject) -> None:
            if body.store:
                await run_in_threadpool(store.put, run.stored(final))

        if body.stream:
            async def close() -> None:
                try:
                    await run.outputs.aclose()
                finally:
                    held.__exit__(None, None, None)

            return EventStream(with_error_event(run.events(save)), on_close=close)
        try:
            final = await unless_disconnected(request, run.response())
            await save(final)
        finally:
            await run.outputs.aclose()
            held.__exit__(None, None, None)
        return JSONResponse(final.model_dump())

    @router.get("/v1/responses/{response_id}",
                responses=documented(ResponseObject, 400, 401, 404))
    async def retrieve(request: Request, response_id: str) -> JSONResponse:
        return JSONResponse((await owned(request, response_id)).response)

    @router.delete("/v1/responses/{response_id}",
                   responses=documented(DeletedResponse, 400, 401, 404))
    async def delete(request: Request, response_id: str) -> JSONResponse:
        await owned(request, response_id)
        await run_in_threadpool(store.delete, response_id)
        return JSONResponse(DeletedResponse(id=response_id).model_dump())

    @router.get("/v1/responses/{response_id}/input_items",
                responses=documented(InputItemList, 400, 401, 404))
    async def input_items(request: Request, response_id: str, order: str = "desc",
                          limit: int = 20, after: str | None = None) -> JSONResponse:
        if order not in ("asc", "desc") or not 1 <= limit <= 100:
            raise bad_request("order must be 'asc' or 'desc' and limit 1..100.", "order")
        items = list((await owned(request, response_id)).input_items)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item["id"] for item in items]
            items = items[ids.index(after) + 1:] if after in ids else []
        page = items[:limit]
        return JSONResponse(InputItemList(
            data=page, first_id=page[0]["id"] if page else None,
            last_id=page[-1]["id"] if page else None,
            has_more=len(items) > limit).model_dump())

    app.include_router(router)
