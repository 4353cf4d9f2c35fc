"""Stored responses as the routes reach them: owned by the API key that made them (any other
key gets 404, as if the response did not exist) and their input items listed a page at a
time."""

from __future__ import annotations

import hashlib

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from tokenserve.errors import ModelNotFoundError

from .config import OpenAIServerConfig
from .params import bad_request
from .responses_schemas import InputItemList


class ResponseNotFoundError(ModelNotFoundError):
    """A response id that does not exist, expired, or belongs to another API key (404)."""

    code = "not_found"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def key_owner(request: Request, config: OpenAIServerConfig) -> str:
    """A digest of the caller's API key ("" without API keys): what a response belongs to."""
    if not config.api_keys.enabled:
        return ""
    authorization = request.headers.get("authorization", "")
    return hashlib.sha256(authorization.removeprefix("Bearer ").strip().encode()).hexdigest()


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
