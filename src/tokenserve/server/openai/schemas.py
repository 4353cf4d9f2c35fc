"""OpenAI API wire models (pydantic v2): the only place the OpenAI JSON shapes are spelled out.

Requests are validated in strict mode (no "0.5" -> 0.5 coercion, no `true` as 1), as the
OpenAI API does. Unknown fields are accepted and ignored, except the ones listed in
`REJECTED_FIELDS`: those change what a client gets back, and silently ignoring them would
return something the client did not ask for, so they are refused with a 400 naming the field.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, model_serializer


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class _WithoutNulls(BaseModel):
    """Fields left unset (None) are left out of the JSON, as OpenAI sends stream deltas."""

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM extension: a usage object on every chunk."""


class _Sampling(_Request):
    """Parameters shared by completions and chat, OpenAI names first, then vLLM's extensions."""

    model: str | None = None
    """name, name:version or name@label; missing means the server's default model."""
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    priority: int = 0
    timeout_s: float | None = None
    """tokenserve extension: a deadline shorter than the server's request timeout."""
    # vLLM's structured-output extensions (at most one per request)
    guided_json: dict | str | None = None
    """A JSON schema the output must match (an object, or its JSON text)."""
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    """A Lark grammar (llguidance dialect) or a GBNF grammar (with `::=`)."""


PROMPT_SCHEMA = {"anyOf": [
    {"type": "string"},
    {"type": "array", "items": {"type": "string"}},
    {"type": "array", "items": {"type": "integer"}},
    {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
]}
"""The `prompt` forms, for the OpenAPI schema (validation itself is in params.py)."""


class JsonSchemaFormat(_Request):
    name: str
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """`{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: Annotated[Any, WithJsonSchema(PROMPT_SCHEMA)]
    """A string, a list of strings, a list of token ids or a list of token-id lists; checked
    in params.prompt_token_ids, which can say which of these it expected."""
    max_tokens: int | None = None
    """OpenAI's default is 16 for completions; so is ours."""
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    response_format: ResponseFormat | None = None
    """As in chat completions (vLLM takes it here too): json_object or json_schema constrains
    the completion to JSON."""


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class FunctionCall(BaseModel):
    name: str
    arguments: str
    """The arguments as JSON text, as OpenAI sends them."""


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    """A JSON schema of the arguments object; missing means no arguments."""
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ContentPart(_Request):
    """One part of a message's content; only `{"type": "text", "text": ...}` is served."""

    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: str
    """One of CHAT_ROLES."""
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    """An assistant turn's calls, sent back with the tools' results."""
    tool_call_id: str | None = None
    """A `tool` message: the call it answers."""
    reasoning_content: str | None = None
    """An assistant turn's reasoning, for templates that show it (vLLM's extension)."""


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    """Preferred over max_tokens when both are set, as in the OpenAI API."""
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """Default: "auto" with tools, "none" without."""
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM extension: further chat template variables, e.g. {"enable_thinking": false}."""


class TokenizeRequest(_Request):
    """POST /tokenize: text (or chat messages rendered with the chat template) to token ids."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    """As in chat completions, at least one message."""
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Request):
    """POST /detokenize: token ids to text."""

    model: str | None = None
    tokens: list[int]


# Fields whose meaning we do not implement: name -> the value that is harmless (None = any
# value but null/absent is refused). Anything else unknown is ignored, like `user` or `store`.
REJECTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "logit_bias": (None, {}),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "min_tokens": (None, 0),
    "use_beam_search": (None, False),
    "include_stop_str_in_output": (None, False),
    "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,),
    "structured_outputs": (None,),
    "logits_processors": (None,),
    "chat_template": (None,),
    "continue_final_message": (None, False),
}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The OpenAI error body: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    """Prompt tokens whose prefill the prefix cache (local or the Redis tier) skipped: a
    multiple of the KV block size (16)."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """Completions format: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    """vLLM extension: the stop string or stop token id that ended the choice."""


class CompletionResponse(BaseModel):
    """Both the response and each stream chunk of /v1/completions."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """Chat format: one entry per generated token."""

    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    """A thinking model's reasoning (vLLM's and llama.cpp's field); left out when none."""
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _without_empty_fields(self, handler):
        return {k: v for k, v in handler(self).items()
                if k not in ("tool_calls", "reasoning_content") or v}


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class DeltaFunctionCall(_WithoutNulls):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_WithoutNulls):
    """A streamed tool call: the first delta of a call has its id, type and name; the
    following ones carry pieces of `function.arguments`."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_WithoutNulls):
    """A chat stream delta; unset fields are left out, as OpenAI sends them."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str
    """The model name this id resolves to (an id may name a version or a label)."""
    max_model_len: int | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field); None for a model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class Readiness(BaseModel):
    """GET /ready: `ready` (200), or `not_ready` / `unavailable` with a reason (503)."""

    status: Literal["ready", "not_ready", "unavailable"]
    model: str
    reason: str | None = None
