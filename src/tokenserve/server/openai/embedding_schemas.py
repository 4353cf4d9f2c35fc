"""Wire models of POST /v1/embeddings (OpenAI's shape, with vLLM's truncate_prompt_tokens)
and POST /v1/rerank (the Jina and Cohere shape vLLM and llama.cpp's server accept).

`input` and `documents` are typed loosely here and checked in embeddings.py, so each wrong
shape gets a message that names what was expected, not pydantic's union report."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class EmbeddingRequest(_Request):
    """POST /v1/embeddings."""

    model: str | None = None
    """name, name:version or name@label; missing: the first embedding model served."""
    input: Any
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    encoding_format: Literal["float", "base64"] = "float"
    """base64: each vector's little-endian float32 bytes, as OpenAI sends them."""
    dimensions: int | None = None
    """Accepted only when it equals the model's own size (no model here is Matryoshka-
    trained, so a shorter vector would not be a meaningful embedding)."""
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    """vLLM extension: cut each input to this many tokens (-1: the model's maximum) instead
    of refusing a longer one; text keeps its special tokens, as sentence-transformers cuts."""
    timeout_s: float | None = None
    """tokenserve extension: a deadline shorter than the server's request timeout."""


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class RerankRequest(_Request):
    """POST /v1/rerank (also /rerank and /v2/rerank, as vLLM serves it)."""

    model: str | None = None
    """missing: the first reranking model served."""
    query: str
    documents: list[Any]
    """Strings, or objects with a `text` string (Cohere's and Jina's document objects)."""
    top_n: int | None = None
    """Return the best this many; missing or 0: every document."""
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    """As in embeddings: cut each (query, document) pair to this many tokens, the longer
    text first, instead of refusing it."""
    timeout_s: float | None = None


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    """The document's position in the request."""
    relevance_score: float
    """0..1, higher is more relevant (the sigmoid of the cross-encoder's logit)."""
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
    """Best first."""
