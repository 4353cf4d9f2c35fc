"""Streaming OpenAI-compatible client that times each request as `vllm bench serve` does.

Per request: TTFT is the time from sending to the first chunk that carries choices; each
later choices chunk adds one inter-token latency (the gap since the previous chunk); E2E
latency runs to the last chunk received. Output tokens come from the server's `usage`
(requested with `stream_options.include_usage`) when it sends it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from tokenserve.bench.dataset import BenchRequest


@dataclass
class RequestResult:
    """What one benchmark request measured (not the engine's `engine.outputs.RequestOutput`).
    Times in seconds."""

    success: bool = False
    prompt_len: int = 0
    """Prompt tokens: the server's usage when reported, else the dataset's count."""
    output_tokens: int | None = None
    """completion_tokens from the server's usage; None when it sent none."""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    """perf_counter() when the request was sent."""
    generated_text: str = ""
    error: str = ""


@dataclass(frozen=True)
class ClientConfig:
    """Where and how requests are sent."""

    base_url: str
    """Server root, e.g. http://127.0.0.1:8000 (the endpoint path is appended)."""
    model: str
    endpoint: str = "/v1/completions"
    """/v1/completions, or /v1/chat/completions for chat messages."""
    api_key: str | None = None
    """Sent as `Authorization: Bearer ...`."""
    ignore_eos: bool = False
    """Ask the server (vLLM extension) to generate exactly max_tokens."""
    temperature: float = 0.0
    """0: greedy (the default, as vLLM's benchmark)."""
    top_p: float | None = None
    top_k: int | None = None
    """Sent only when set (top_k and min_p are vLLM's extensions of the OpenAI API)."""
    min_p: float | None = None
    timeout_s: float = 6 * 3600

    @property
    def is_chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")


def request_body(config: ClientConfig, request: BenchRequest) -> dict:
    """The JSON body of one streaming completions (or chat completions) request."""
    body = {"model": config.model, "temperature": config.temperature,
            "max_tokens": request.output_len, "stream": True,
            "stream_options": {"include_usage": True}}
    if config.is_chat:
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    if config.ignore_eos:
        body["ignore_eos"] = True
    for name in ("top_p", "top_k", "min_p"):
        if getattr(config, name) is not None:
            body[name] = getattr(config, name)
    return body


class StreamingClient:
    """Sends benchmark requests over one pooled httpx connection set.

    Use as an async context manager; `send` never raises (errors land in the output).
    """

    def __init__(self, config: ClientConfig, max_connections: int | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=None)
        self._http = httpx.AsyncClient(base_url=config.base_url.rstrip("/"), headers=headers,
                                       timeout=httpx.Timeout(config.timeout_s), limits=limits,
                                       transport=transport)

    async def __aenter__(self) -> "StreamingClient":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self._http.aclose()

    async def send(self, request: BenchRequest) -> RequestResult:
        output = RequestResult(prompt_len=request.prompt_len)
        started = time.perf_counter()
        output.start_time = started
        last_chunk_at = started
        pieces: list[str] = []
        try:
            async with self._http.stream("POST", self.config.endpoint,
                                         json=request_body(self.config, request)) as response:
                if response.status_code != 200:
                    body = (await response.aread()).decode(errors="replace")
                    output.error = f"HTTP {response.status_code}: {body[:500]}"
                    return output
                async for line in response.aiter_lines():
                    line = line.strip()
                    if not line.startswith("data:"):
                        continue  # blank separators and SSE comments (": ping")
                    chunk = line[len("data:"):].strip()
                    if chunk == "[DONE]":
                        continue
                    now = time.perf_counter()
                    message = json.loads(chunk)
                    if "error" in message:  # the server gave up mid-stream: a failure
                        output.error = f"error event: {json.dumps(message['error'])[:500]}"
                        break
                    if choices := message.get("choices"):
                        if not output.success:
                            output.success = True
                            output.ttft = now - started
                        else:
                            output.itl.append(now - last_chunk_at)
                        pieces.append(self._text(choices[0]) or "")
                    if usage := message.get("usage"):  # the last chunk, or every chunk
                        output.output_tokens = usage.get("completion_tokens")
                        output.prompt_len = usage.get("prompt_tokens") or output.prompt_len
                    last_chunk_at = now
            output.latency = last_chunk_at - started
            output.generated_text = "".join(pieces)
            if not output.success and not output.error:
                output.error = "no chunk with choices received; cannot time the first token"
        except (httpx.HTTPError, json.JSONDecodeError, KeyError) as error:
            output.error = f"{type(error).__name__}: {error}"
        output.success = output.success and not output.error
        return output

    def _text(self, choice: dict) -> str | None:
        if self.config.is_chat:
            return (choice.get("delta") or {}).get("content")
        return choice.get("text")

    async def first_model(self) -> str:
        """The id of the first model in GET /v1/models."""
        response = await self._http.get("/v1/models")
        response.raise_for_status()
        models = response.json().get("data") or []
        if not models:
            raise ValueError(f"{self.config.base_url}/v1/models lists no models")
        return models[0]["id"]
