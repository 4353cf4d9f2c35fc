"""OpenAI request fields to engine inputs: prompt token ids and SamplingParams.

All request-level checks that are not plain types live here, so the HTTP and gRPC frontends
refuse the same inputs with the same messages. Every refusal is an InvalidRequestError (or
PromptTooLongError) whose `param` and `code` fill the OpenAI error body.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

from tokenserve.engine.guided import check_structured
from tokenserve.errors import InvalidRequestError, PromptTooLongError
from tokenserve.sampling import GuideKind, SamplingParams, StructuredOutput

from .schemas import REJECTED_FIELDS, ChatCompletionRequest, CompletionRequest

def bad_request(message: str, param: str | None = None, code: str | None = None,
                kind: type[InvalidRequestError] = InvalidRequestError) -> InvalidRequestError:
    """An InvalidRequestError (or `kind`) that names the offending request field."""
    return kind(message, param, code)


def check_unsupported(request: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuses fields that matter but that tokenserve does not implement.

    Raises:
        InvalidRequestError: naming the first such field.
    """
    for name, value in (request.model_extra or {}).items():
        allowed = REJECTED_FIELDS.get(name)
        if allowed is not None and value not in allowed:
            raise bad_request(f"'{name}' is not supported by this server.", name,
                              "unsupported_parameter")
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed when stream is true.",
                          "stream_options")
    if isinstance(request, CompletionRequest):
        if request.suffix:
            raise bad_request("'suffix' is not supported by this server.", "suffix",
                              "unsupported_parameter")
        if request.best_of is not None and request.best_of != request.n:
            raise bad_request(f"best_of must equal n ({request.n}) on this server; "
                              f"got best_of={request.best_of}.", "best_of",
                              "unsupported_parameter")
    elif request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true.", "top_logprobs")


_CHARS_PER_TOKEN: "weakref.WeakKeyDictionary[object, int | None]" = weakref.WeakKeyDictionary()


def max_chars_per_token(tokenizer) -> int | None:
    """The most characters of prompt text one token can stand for, or None when the
    tokenizer does not bound it.

    Bounded for a BPE model with no normalizer (GPT-2 style byte-level BPE, the built-in
    models): every character of the text ends up inside some vocabulary entry, whose
    string is at least as long as the text it covers (a byte-level entry has one character
    per byte). A normalizer may shrink text first (NFKC, stripping), and a fused unknown
    token covers any run of characters, so those tokenizers get no bound. Computed once per
    tokenizer (the vocabulary walk takes milliseconds).
    """
    try:
        return _CHARS_PER_TOKEN[tokenizer]
    except (KeyError, TypeError):
        pass
    bound = None
    hf = getattr(tokenizer, "hf", None)
    model = getattr(hf, "model", None)
    if (model is not None and type(model).__name__ == "BPE" and hf.normalizer is None
            and not (model.unk_token and model.fuse_unk)):
        vocab = hf.get_vocab(with_added_tokens=True)
        bound = max((len(token) for token in vocab), default=None)
    try:
        _CHARS_PER_TOKEN[tokenizer] = bound
    except TypeError:  # not weakly referenceable: recomputed next time
        pass
    return bound


def encode_text(tokenizer, text: str) -> list[int]:
    """`tokenizer.encode(text)`, through the batch call: HF tokenizers' `encode` holds the
    GIL for the whole text (seconds for megabytes, during which no other thread, the event
    loop included, runs), while `encode_batch` releases it. Same ids (with the bos token
    first for a model that wants it: Tokenizer.encode_prompts)."""
    if hasattr(tokenizer, "encode_prompts"):
        return tokenizer.encode_prompts([text])[0]
    return tokenizer.encode_batch([text])[0]


def decode_ids(tokenizer, token_ids: list[int]) -> str:
    """`tokenizer.decode(token_ids)`, releasing the GIL as `encode_text` does."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None:
        return tokenizer.decode(token_ids)
    return hf.decode_batch([list(token_ids)], skip_special_tokens=True)[0]


def check_prompt_chars(text: str, tokenizer, max_model_len: int, param: str = "prompt"
                       ) -> None:
    """Refuses, before tokenizing, a prompt with more characters than `max_model_len` tokens
    can hold: tokenizing megabytes would take seconds only to refuse it afterwards.

    Raises:
        PromptTooLongError: with the context-length message and code.
    """
    per_token = max_chars_per_token(tokenizer)
    if per_token is None or len(text) <= per_token * max_model_len:
        return
    raise bad_request(
        f"This model's maximum context length is {max_model_len} tokens. However, your "
        f"prompt has {len(text)} characters, more than {max_model_len} tokens can hold "
        f"(at most {per_token * max_model_len} characters). Please reduce the length of the "
        f"prompt.", param, "context_length_exceeded", PromptTooLongError)


def prompt_token_ids(prompt: Any, tokenizer, vocab_size: int, max_prompts: int,
                     max_model_len: int | None = None) -> list[list[int]]:
    """The prompt (str, [str], [int] or [[int]]) as one token-id list per prompt. Blocking:
    servers call it off their event loop (tokenizing a long text takes a while).

    Args:
        max_model_len: when given, text prompts longer than this many tokens can hold are
            refused before they are tokenized (`check_prompt_chars`).

    Raises:
        InvalidRequestError: empty prompt, too many prompts, bad text or token ids.
        PromptTooLongError: a text prompt with more characters than the context can hold.
    """
    if isinstance(prompt, str) or _is_token_ids(prompt):
        prompts: list = [prompt]
    elif isinstance(prompt, list) and all(isinstance(p, str) or _is_token_ids(p, True)
                                          for p in prompt):
        prompts = prompt
    else:
        raise bad_request("prompt must be a string, a list of strings, a list of token ids or "
                          "a list of token-id lists.", "prompt", "invalid_type")
    if not prompts:
        raise bad_request("prompt must not be empty.", "prompt", "empty_prompt")
    if len(prompts) > max_prompts:
        raise bad_request(f"At most {max_prompts} prompts per request, got {len(prompts)}.",
                          "prompt")
    token_lists = []
    for item in prompts:
        if isinstance(item, str):
            if max_model_len is not None:
                check_prompt_chars(item, tokenizer, max_model_len)
            ids = encode_text(tokenizer, item)
        else:
            ids = list(item)
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise bad_request(f"prompt token id {bad[0]} is outside the vocabulary "
                                  f"(size {vocab_size}).", "prompt")
        if not ids:
            raise bad_request("prompt must not be empty.", "prompt", "empty_prompt")
        token_lists.append(ids)
    return token_lists


def _is_token_ids(value: Any, allow_empty: bool = False) -> bool:
    return (isinstance(value, list) and (allow_empty or bool(value))
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


def max_new_tokens(requested: int | None, param: str, prompt_len: int, max_model_len: int,
                   default: int | None) -> int:
    """max_tokens for one prompt: the request's value, checked against the context, or the
    default clamped to what the context leaves (default None: all of it).

    Raises:
        InvalidRequestError: max_tokens < 1.
        PromptTooLongError: the prompt (plus max_tokens) does not fit the context.
    """
    if requested is not None and requested < 1:
        raise bad_request(f"{param} must be at least 1, got {requested}.", param)
    room = max_model_len - prompt_len
    if room < 1 or (requested is not None and requested > room):
        wanted = prompt_len + (requested or 1)
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {wanted} tokens ({prompt_len} in the prompt, {requested or 1} in the "
            f"completion). Please reduce the length of the prompt or completion.",
            "prompt" if room < 1 else param, "context_length_exceeded", PromptTooLongError)
    if requested is not None:
        return requested
    return room if default is None else min(default, room)


def engine_seed(seed: int | None) -> int | None:
    """A request's seed as the engine's non-negative one: the int64 range that OpenAI and
    vLLM clients send, negatives taken modulo 2**64 (so -1 is a seed like any other).

    Raises:
        InvalidRequestError: a seed outside int64.
    """
    if seed is None:
        return None
    if not -2**63 <= seed < 2**63:
        raise bad_request(f"seed must be a 64-bit integer, got {seed}.", "seed")
    return seed % 2**64


JSON_OBJECT_SCHEMA = '{"type": "object"}'
"""OpenAI's json_object mode: any JSON object."""


def structured_output(request: CompletionRequest | ChatCompletionRequest
                      ) -> StructuredOutput | None:
    """The request's output constraint from `guided_*` or `response_format`, checked.

    Raises:
        InvalidRequestError: more than one constraint, or one that is invalid (a 400 naming
            the field and the problem, before the request reaches an engine).
    """
    found: list[tuple[str, StructuredOutput]] = []
    if request.guided_json is not None:
        schema = request.guided_json
        text = schema if isinstance(schema, str) else json.dumps(schema)
        found.append(("guided_json", StructuredOutput(GuideKind.JSON_SCHEMA, text)))
    if request.guided_regex is not None:
        found.append(("guided_regex", StructuredOutput(GuideKind.REGEX, request.guided_regex)))
    if request.guided_choice is not None:
        found.append(("guided_choice", StructuredOutput(GuideKind.CHOICE,
                                                        tuple(request.guided_choice))))
    if request.guided_grammar is not None:
        found.append(("guided_grammar", StructuredOutput(GuideKind.GRAMMAR,
                                                         request.guided_grammar)))
    response_format = request.response_format
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            text = JSON_OBJECT_SCHEMA
        elif response_format.json_schema is None:
            raise bad_request("response_format of type 'json_schema' needs a 'json_schema' "
                              "object.", "response_format.json_schema", "invalid_type")
        else:
            schema = response_format.json_schema.schema_
            text = JSON_OBJECT_SCHEMA if schema is None else json.dumps(schema)
        param = ("response_format" if response_format.type == "json_object"
                 else "response_format.json_schema.schema")
        found.append((param, StructuredOutput(GuideKind.JSON_SCHEMA, text)))
    if len(found) > 1:
        raise bad_request(f"At most one output constraint per request; got "
                          f"{', '.join(name for name, _ in found)}.", found[1][0],
                          "invalid_structured_output")
    if not found:
        return None
    param, structured = found[0]
    check_structured(structured, param)
    return structured


def sampling_params(request: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                    logprobs: int | None, structured: StructuredOutput | None = None
                    ) -> SamplingParams:
    """The engine's SamplingParams for a validated request.

    Raises:
        InvalidRequestError: a value out of range, naming the request field.
    """
    values: dict[str, Any] = {"max_tokens": max_tokens, "logprobs": logprobs, "n": request.n,
                              "ignore_eos": request.ignore_eos, "structured": structured}
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "stop_token_ids"):
        value = getattr(request, name)
        if value is not None:
            values[name] = value
    values["seed"] = engine_seed(request.seed)
    if request.stop is not None:
        values["stop"] = [request.stop] if isinstance(request.stop, str) else request.stop
    try:
        return SamplingParams(**values)
    except InvalidRequestError as error:  # `param` names the SamplingParams field
        if error.param == "logprobs" and isinstance(request, ChatCompletionRequest):
            raise bad_request(str(error), "top_logprobs") from None  # chat's name for it
        raise


def request_timeout(requested: float | None, server_limit: float | None) -> float | None:
    """The request's deadline in seconds: its own `timeout_s` can only shorten the server's.

    Raises:
        InvalidRequestError: a timeout_s that is not positive.
    """
    if requested is None:
        return server_limit
    if not requested > 0:
        raise bad_request(f"timeout_s must be positive, got {requested}.", "timeout_s")
    return requested if server_limit is None else min(requested, server_limit)
