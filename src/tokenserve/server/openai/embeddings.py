"""Embedding and rerank requests as encoder inputs, and the encoder's rows as responses.

Blocking helpers (tokenizing) run off the event loop; every check raises an
InvalidRequestError naming its field, so each bad input is a precise 400.
"""

from __future__ import annotations

import base64
import uuid
from typing import Any

import numpy as np

from tokenserve.encoder_config import EncodedInput, EncoderTask

from .embedding_schemas import (Embedding, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage,
                                RerankDocument, RerankRequest, RerankResponse, RerankResult,
                                RerankUsage)
from .params import bad_request

MAX_EMBEDDING_INPUTS = 2048
"""Most inputs in one /v1/embeddings request (OpenAI's limit)."""
MAX_RERANK_DOCUMENTS = 1024
"""Most documents in one /v1/rerank request."""
_KINDS = {EncoderTask.EMBED: "an embedding model",
          EncoderTask.SCORE: "a reranking model (a cross-encoder)"}


def require_task(engine, model_id: str, task: EncoderTask, endpoint: str) -> None:
    """Refuses a model that does not serve `endpoint`: a generator, or the other encoder kind.

    Reranking accepts both kinds: a cross-encoder scores each pair, an embedding model
    ranks by cosine similarity.
    """
    served = getattr(engine, "task", None)  # generation engines name no task
    if served is task or (endpoint == "/v1/rerank" and served is not None):
        return
    kind = ("a text generation model" if served is None else
            f"{_KINDS[served]} (it serves "
            f"{'/v1/embeddings' if served is EncoderTask.EMBED else '/v1/rerank'})")
    raise bad_request(f"The model '{model_id}' is {kind}; it does not serve {endpoint}.",
                      "model", "wrong_model_type")


def require_generator(engine, model_id: str) -> None:
    """Refuses an encoder asked to generate text (completions, chat, responses, gRPC)."""
    served = getattr(engine, "task", None)
    if served is not None:
        endpoint = "/v1/embeddings" if served is EncoderTask.EMBED else "/v1/rerank"
        raise bad_request(f"The model '{model_id}' is {_KINDS[served]}; it does not "
                          f"generate text. Use {endpoint}.", "model", "wrong_model_type")


def truncation(requested: int | None, max_model_len: int) -> int | None:
    """truncate_prompt_tokens as a token count: None (no cut), -1 (the model's maximum) or
    1..max_model_len."""
    if requested is None:
        return None
    if requested == -1:
        return max_model_len
    if not 1 <= requested <= max_model_len:
        raise bad_request(f"truncate_prompt_tokens must be -1 or in 1..{max_model_len}, got "
                          f"{requested}.", "truncate_prompt_tokens")
    return requested


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def embedding_inputs(body: EmbeddingRequest, tokenizer, max_model_len: int
                     ) -> list[EncodedInput]:
    """`input` as one EncodedInput per item (blocking: tokenizes)."""
    value, cut = body.input, truncation(body.truncate_prompt_tokens, max_model_len)
    if isinstance(value, str) or (_is_ids(value) and value):
        items = [value]
    elif isinstance(value, list) and value and (all(isinstance(v, str) for v in value)
                                                or all(_is_ids(v) for v in value)):
        items = value
    elif value == []:
        raise bad_request("input must not be empty.", "input", "empty_input")
    else:
        raise bad_request("input must be a string, a list of strings, a list of token ids "
                          "or a list of token-id lists.", "input", "invalid_type")
    if len(items) > MAX_EMBEDDING_INPUTS:
        raise bad_request(f"At most {MAX_EMBEDDING_INPUTS} inputs per request, got "
                          f"{len(items)}.", "input")
    if isinstance(items[0], str):
        return [tokenizer.encode(text, cut) for text in items]
    return [EncodedInput.from_ids(ids[:cut] if cut else ids) for ids in items]


def check_dimensions(requested: int | None, size: int) -> None:
    if requested is not None and requested != size:
        raise bad_request(f"dimensions {requested} is not supported: this model's embeddings "
                          f"have {size} dimensions, and it was not trained to be shortened.",
                          "dimensions", "unsupported_parameter")


def embedding_response(vectors: np.ndarray, body: EmbeddingRequest, model_id: str,
                       num_tokens: int) -> dict:
    """[N, D] float32 -> the OpenAI body, floats or base64 of little-endian float32."""
    if body.encoding_format == "base64":
        data = [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vectors]
    else:
        data = vectors.tolist()
    return EmbeddingResponse(
        data=[Embedding(index=i, embedding=e) for i, e in enumerate(data)], model=model_id,
        usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)).model_dump()


def document_texts(body: RerankRequest) -> list[str]:
    """`documents` as strings: plain strings, or objects with a `text` string."""
    if not body.documents:
        raise bad_request("documents must not be empty.", "documents", "empty_input")
    if len(body.documents) > MAX_RERANK_DOCUMENTS:
        raise bad_request(f"At most {MAX_RERANK_DOCUMENTS} documents per request, got "
                          f"{len(body.documents)}.", "documents")
    texts = []
    for index, document in enumerate(body.documents):
        if isinstance(document, dict) and isinstance(document.get("text"), str):
            document = document["text"]
        if not isinstance(document, str):
            raise bad_request(f"documents[{index}] must be a string or an object with a "
                              f"'text' string.", "documents", "invalid_type")
        texts.append(document)
    if body.top_n is not None and body.top_n < 0:
        raise bad_request(f"top_n must not be negative, got {body.top_n}.", "top_n")
    return texts


def rerank_inputs(body: RerankRequest, texts: list[str], tokenizer, task: EncoderTask,
                  max_model_len: int) -> list[EncodedInput]:
    """A cross-encoder's (query, document) pairs; for an embedding model, the query then
    each document (blocking: tokenizes)."""
    cut = truncation(body.truncate_prompt_tokens, max_model_len)
    if task is EncoderTask.SCORE:
        return [tokenizer.encode_pair(body.query, text, cut) for text in texts]
    return [tokenizer.encode(text, cut) for text in [body.query, *texts]]


def relevance(rows: np.ndarray, task: EncoderTask) -> np.ndarray:
    """The encoder's rows -> one score per document: a cross-encoder's own scores, or the
    cosine similarity of each document's embedding with the query's."""
    if task is EncoderTask.SCORE:
        return rows
    unit = rows / np.maximum(np.linalg.norm(rows, axis=-1, keepdims=True), 1e-12)
    return unit[1:] @ unit[0]


def rerank_response(scores: np.ndarray, texts: list[str], body: RerankRequest, model_id: str,
                    num_tokens: int) -> dict:
    """Best first, the top_n of them (all when top_n is missing or 0)."""
    order = sorted(range(len(texts)), key=lambda i: (-float(scores[i]), i))
    if body.top_n:
        order = order[:body.top_n]
    results = [RerankResult(index=i, relevance_score=float(scores[i]),
                            document=RerankDocument(text=texts[i]) if body.return_documents
                            else None) for i in order]
    return RerankResponse(id=f"rerank-{uuid.uuid4().hex}", model=model_id,
                          usage=RerankUsage(total_tokens=num_tokens),
                          results=results).model_dump(exclude_none=True)

