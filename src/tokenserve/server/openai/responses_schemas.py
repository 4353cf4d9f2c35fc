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


class FunctionCallInput(BaseModel):
    """An input item of type "function_call": a call the model made in an earlier turn, as
    the client sends it back (ResponseFunctionToolCallParam)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputInput(BaseModel):
    """An input item of type "function_call_output": the client's result of a call."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputContentPart]
    id: str | None = None
    status: str | None = None


class ReasoningInput(BaseModel):
    """An input item of type "reasoning": a reasoning output item, as a client that keeps the
    conversation itself sends it back. Its text becomes the next assistant turn's
    reasoning_content, which templates that show earlier thinking render."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[InputContentPart] = Field(default_factory=list)
    content: list[InputContentPart] | None = None
    encrypted_content: str | None = None
    status: str | None = None


INPUT_ITEMS = {"message": InputMessage, "function_call": FunctionCallInput,
               "function_call_output": FunctionCallOutputInput, "reasoning": ReasoningInput}
"""The input item types served, by `type` (an easy input message, {"role", "content"}, has
none: "message"). Each item is validated on its own (responses_input.input_messages), so an
error names the item's own field (input.2.call_id) rather than a branch of a union."""


class FunctionTool(BaseModel):
    """A tool of type "function" (FunctionToolParam): the definition at the top level, where
    chat completions nest it under `function`. Other tool types (web search, file search,
    MCP ...) run on OpenAI's side and are refused here."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class FunctionToolChoice(BaseModel):
    """tool_choice naming one function (ToolChoiceFunction)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """text.format: "text" (the default), "json_object", or "json_schema" with the schema at
    this level (chat completions' response_format nests it under `json_schema`)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat = Field(default_factory=lambda: TextFormat(type="text"))


class ResponseCreateRequest(BaseModel):
    """POST /v1/responses. Function tools are served, and a thinking model's reasoning comes
    back as a reasoning item; `reasoning` options (effort, summaries), background mode and
    tools that run on OpenAI's side are not served."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: str | list[Any]
    """Text, or input items (INPUT_ITEMS)."""
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    metadata: dict[str, str] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    """"auto": a conversation too long for the context drops its oldest messages (after the
    instructions) until it fits; "disabled" (the default): it is refused with 400."""
    # Fields that would change the answer and are not served (these four, and include values
    # other than logprobs): refused (400) when set (responses_options.check_unsupported), never
    # silently ignored.
    conversation: Any = None
    prompt: Any = None
    background: bool | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    include: list[str] | None = None
    """Extra output to include; "message.output_text.logprobs" is served."""


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: list[dict] = Field(default_factory=list)
    """Per token {"token", "logprob", "bytes", "top_logprobs"}, with include
    "message.output_text.logprobs" (or top_logprobs)."""


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    """An output item of type "reasoning" (ResponseReasoningItem): the thinking model's
    reasoning as text (no summary is written, nothing is encrypted)."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"]


class OutputFunctionCall(BaseModel):
    """An output item of type "function_call" (ResponseFunctionToolCall): `call_id` is what
    the client's function_call_output names."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


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
    output: list[OutputReasoning | OutputMessage | OutputFunctionCall] = Field(
        default_factory=list)
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    store: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
    incomplete_details: dict | None = None
    error: dict | None = None
    parallel_tool_calls: bool = True
    tool_choice: str | dict = "none"
    tools: list[dict] = Field(default_factory=list)
    text: dict = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: Literal["auto", "disabled"] = "disabled"
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
