"""OpenAIServerConfig: the knobs of the OpenAI-compatible HTTP frontend."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenserve.errors import ConfigError
from tokenserve.server.auth import APIKeys
from tokenserve.server.config import MAX_BODY_BYTES, REASONING_PARSER, REQUEST_TIMEOUT_S

from .reasoning import check_parser_name


@dataclass(frozen=True)
class OpenAIServerConfig:
    """Limits and options of `build_openai_app`; checked when built."""

    api_keys: APIKeys = field(default_factory=APIKeys)
    """Accepted bearer keys; empty (the default) leaves the API open."""
    max_body_bytes: int = MAX_BODY_BYTES
    """Larger request bodies get 413 before they are parsed (a 128k-token prompt is ~0.5 MB)."""
    request_timeout_s: float | None = REQUEST_TIMEOUT_S
    """Deadline of every generation request, passed to the engine as `timeout_s`. A request
    may shorten it with the `timeout_s` body field. None: no deadline."""
    max_prompts: int = 32
    """Most prompts in one batched /v1/completions request (LangChain batches 20)."""
    default_completion_max_tokens: int = 16
    """max_tokens of /v1/completions when the request gives none (OpenAI's default).
    Chat defaults to the rest of the model's context, as vLLM does."""
    max_json_depth: int = 64
    """Request bodies nested deeper than this (arrays and objects) get 400 before they are
    validated: a real request is a handful of levels deep, and a body nested about 1,000
    deep would otherwise exhaust Python's recursion limit (a 500) in the parser or later."""
    metrics_registry: Any = None
    """A prometheus_client CollectorRegistry served at GET /metrics; None answers 404."""
    metrics_public: bool = False
    """Serve /metrics without an API key (`--metrics_public`). By default it follows
    `api_keys`: metric labels name every served model and version."""
    owned_by: str = "tokenserve"
    reasoning_parser: str = REASONING_PARSER
    """How chat replies are split into reasoning_content and content (reasoning.py): "auto"
    parses a model whose chat template writes <think>, "none" parses none, and a parser name
    (qwen3, deepseek_r1) parses every model's replies that way."""

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ConfigError(f"request_timeout_s must be positive, got {self.request_timeout_s}")
        if self.max_prompts < 1:
            raise ConfigError(f"max_prompts must be at least 1, got {self.max_prompts}")
        if self.max_json_depth < 8:
            raise ConfigError(f"max_json_depth must be at least 8, got {self.max_json_depth}")
        if self.default_completion_max_tokens < 1:
            raise ConfigError("default_completion_max_tokens must be at least 1")
        check_parser_name(self.reasoning_parser)
