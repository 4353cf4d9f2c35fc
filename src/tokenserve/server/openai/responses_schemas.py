"""Wire models of the OpenAI Responses API (POST /v1/responses and its objects).

Field names, types and event shapes follow the official `openai` package's
`openai.types.responses` models, which the tests parse our output with.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INPUT_ROLES = ("user", "assistant", "system", "developer")


class InputContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class InputMessage(BaseModel):
    """An input item of type "message" (EasyInputMessage or ResponseInputItem.Message)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["message"] = "message"
    role: str
    content: str | list[InputContentPart]


class ResponseCreateRequest(BaseModel):
    """POST /v1/responses. Tools, reasoning and background mode are not served."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: str | list[InputMessage]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    metadata: dict[str, str] | None = None
    tools: list[Any] | None = None


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: list = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText] = Field(default_factory=list)


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: float
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[OutputMessage] = Field(default_factory=list)
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    store: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
    incomplete_details: dict | None = None
    error: dict | None = None
    parallel_tool_calls: bool = False
    tool_choice: str = "none"
    tools: list = Field(default_factory=list)
    text: dict = Field(default_factory=lambda: {"format": {"type": "text"}})
    usage: ResponseUsage | None = None


class InputItemList(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
