"""The Responses API's streamed events (`stream: true`): the typed SSE events OpenAI sends,
from response.created to response.completed (or response.incomplete).

Every event carries its `type` twice (the SSE `event:` line and the JSON) and a
`sequence_number` counting from 0.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator


async def response_events(run, save) -> AsyncIterator[str]:
    """The typed SSE events of a streamed ResponseRun `run`, as OpenAI sends them: each
    output item added, its deltas, its done events, then the next item.

    Args:
        run: a ResponseRun whose outputs have started.
        save: `async (final ResponseObject) -> None`, awaited before the last event (it
            stores the response, so a client that reads the last event can continue it).
    """
    number = iter(range(1 << 62))

    def event(kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": next(number), **fields}
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    # items in output order: the reasoning, the message, the calls; the reasoning comes out
    # before the text and the text before the calls, so each index is known when it opens
    def message_index() -> int:
        return int(bool(run.reasoning))

    def call_index(index: int) -> int:
        return message_index() + bool(run.content) + index

    def reasoning_place() -> dict:
        return {"item_id": run.reasoning_id, "output_index": 0, "content_index": 0}

    def message_place() -> dict:
        return {"item_id": run.message_id, "output_index": message_index(), "content_index": 0}

    def open_reasoning() -> list[str]:
        item = {"id": run.reasoning_id, "type": "reasoning", "summary": [], "content": [],
                "status": "in_progress"}
        part = {"type": "reasoning_text", "text": ""}
        return [event("response.output_item.added", output_index=0, item=item),
                event("response.content_part.added", part=part, **reasoning_place())]

    def close_reasoning(status: str = "completed") -> list[str]:
        item = run.reasoning_item(status).model_dump()
        return [event("response.reasoning_text.done", text=run.reasoning, **reasoning_place()),
                event("response.content_part.done", part=item["content"][0],
                      **reasoning_place()),
                event("response.output_item.done", output_index=0, item=item)]

    def open_message() -> list[str]:
        item = {"id": run.message_id, "type": "message", "role": "assistant",
                "status": "in_progress", "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [event("response.output_item.added", output_index=message_index(), item=item),
                event("response.content_part.added", part=part, **message_place())]

    def close_message(status: str = "completed") -> list[str]:
        message = run.message_item(status).model_dump()
        return [event("response.output_text.done", text=run.content,
                      logprobs=run.logprobs, **message_place()),
                event("response.content_part.done", part=message["content"][0],
                      **message_place()),
                event("response.output_item.done", output_index=message_index(),
                      item=message)]

    def close_call(index: int, status: str = "completed") -> list[str]:
        item = run.call_item(index, status).model_dump()
        place = {"item_id": item["id"], "output_index": call_index(index)}
        return [event("response.function_call_arguments.done",
                      arguments=item["arguments"], name=item["name"], **place),
                event("response.output_item.done", output_index=place["output_index"],
                      item=item)]

    def close(opened, status: str = "completed") -> list[str]:
        if opened == "reasoning":
            return close_reasoning(status)
        if opened == "message":
            return close_message(status)
        return [] if opened is None else close_call(opened, status)

    started = run.response_object("in_progress").model_dump()
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    opened = None  # the open item: "reasoning", "message" or a call's index
    async for kind, index, delta in run.pieces():
        if kind == "reasoning":
            if opened is None:
                opened = "reasoning"
                for text in open_reasoning():
                    yield text
            yield event("response.reasoning_text.delta", delta=delta, **reasoning_place())
            continue
        if kind == "text":
            if opened != "message":  # the reasoning before it is complete
                for text in close(opened) + open_message():
                    yield text
                opened = "message"
            yield event("response.output_text.delta", delta=delta,
                        logprobs=run.take_logprobs(), **message_place())
            continue
        if opened != index:  # a call begins: the item before it is complete
            for text in close(opened):
                yield text
            opened = index
            # the call as it opens: its arguments come in the deltas (the first one
            # already in run.calls)
            item = {**run.call_item(index, "in_progress").model_dump(), "arguments": ""}
            yield event("response.output_item.added", output_index=call_index(index),
                        item=item)
        if delta:
            yield event("response.function_call_arguments.delta", delta=delta,
                        item_id=run.calls[index]["id"], output_index=call_index(index))
    final = run.final()
    if opened is None:  # no reasoning, no text and no call: one empty message
        for text in open_message():
            yield text
        opened = "message"
    statuses = {item.id: item.status for item in final.output}
    item_id = {"reasoning": run.reasoning_id, "message": run.message_id}.get(opened) \
        or run.calls[opened]["id"]
    for text in close(opened, statuses[item_id]):
        yield text
    await save(final)
    kind = "response.completed" if final.status == "completed" else "response.incomplete"
    yield event(kind, response=final.model_dump())
