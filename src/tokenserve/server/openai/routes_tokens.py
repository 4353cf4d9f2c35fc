"""POST /tokenize and POST /detokenize, with the model's own tokenizer and chat template."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from .chat_prompt import chat_prompt_ids
from .config import OpenAIServerConfig
from .embeddings import require_generator
from .http import read_json
from .models import ModelResolver
from .openapi import BODY_ERRORS, request_body, responses
from .params import bad_request, decode_ids, encode_text
from .schemas import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse


def tokens_router(models: ModelResolver, config: OpenAIServerConfig) -> APIRouter:
    """Text to token ids and back, off the event loop (a long text takes a while)."""
    router = APIRouter()

    def resolve(request: Request, model_id: str | None):
        model_id = model_id or models.default_model()
        request.state.model = model_id
        engine = models.resolve(model_id)
        require_generator(engine, model_id)  # an encoder's tokenizer adds its special tokens
        return engine

    @router.post("/tokenize", openapi_extra=request_body(TokenizeRequest),
                 responses=responses(TokenizeResponse, *BODY_ERRORS))
    async def tokenize(request: Request) -> JSONResponse:
        body = await read_json(request, TokenizeRequest, config.max_body_bytes,
                               config.max_json_depth)
        engine = resolve(request, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("Give exactly one of 'prompt' and 'messages'.", "prompt")

        def token_ids() -> list[int]:
            if body.messages is not None:
                return chat_prompt_ids(body.messages, engine, body.add_generation_prompt,
                                       check_length=False,
                                       template_kwargs=body.chat_template_kwargs)
            return encode_text(engine.tokenizer, body.prompt)

        ids = await run_in_threadpool(token_ids)
        return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len,
                                             tokens=ids).model_dump())

    @router.post("/detokenize", openapi_extra=request_body(DetokenizeRequest),
                 responses=responses(DetokenizeResponse, *BODY_ERRORS))
    async def detokenize(request: Request) -> JSONResponse:
        body = await read_json(request, DetokenizeRequest, config.max_body_bytes,
                               config.max_json_depth)
        engine = resolve(request, body.model)
        vocab_size = engine.config.model.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary (size "
                              f"{vocab_size}).", "tokens")
        text = await run_in_threadpool(decode_ids, engine.tokenizer, body.tokens)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    return router
